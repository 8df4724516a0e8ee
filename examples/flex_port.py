"""Porting FlexAttention code: its ``mask_mod`` and ``score_mod`` run unchanged in ``ModBias``.

The two functions below are written for ``torch.nn.attention.flex_attention``: causal attention
inside packed documents, read from a closure over a ``(B, S)`` tensor of document ids, and
Gemma 2's logit soft-cap as a ``score_mod``. ``ModBias(mask_mod=..., score_mod=...)`` takes them
as they are, with no block mask built by hand. The output and gradients are checked against an
independent float64 computation with stock PyTorch (the two functions evaluated in eager PyTorch
on broadcast index tensors, as FlexAttention defines them, then a softmax) and, where
FlexAttention runs here, compared with it too (compiled on a GPU; forward only on a CPU, where
FlexAttention has no backward).

    python examples/flex_port.py
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from attnbias import ModBias, explain, sdpa

SOFTCAP = 20.0


def max_errors(got: list[Tensor], expected: list[Tensor]) -> str:
    return ", ".join(
        f"{label} {(a.double() - b.double()).abs().max().item():.1e}"
        for label, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=False)
    )


def outputs(
    attend: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor | None
) -> list[Tensor]:
    """``[out]``, and ``dq, dk, dv`` after it unless ``grad_out`` is None."""
    leaves = [t.detach().requires_grad_(grad_out is not None) for t in (q, k, v)]
    out = attend(*leaves)
    if grad_out is None:
        return [out.detach()]
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batch, heads_q, heads_kv, length, head_dim = (
        (2, 16, 4, 4096, 64) if cuda else (2, 4, 2, 256, 32)
    )
    torch.manual_seed(0)
    # packed documents: random lengths, a different packing per batch row
    cuts = torch.sort(torch.randint(1, length, (batch, 5)), dim=-1).values
    docs = torch.searchsorted(cuts, torch.arange(length).repeat(batch, 1), right=True).to(device)

    # FlexAttention's functions, as they are
    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    def soft_cap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    bias = ModBias(mask_mod=document_causal, score_mod=soft_cap)
    q = torch.randn(batch, heads_q, length, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    grad_out = torch.randn_like(q)

    def ours(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

    leaf = q.detach().requires_grad_()
    print("route:", explain(leaf, k, v, attn_mask=bias, enable_gqa=True).splitlines()[0])
    got = outputs(ours, q, k, v, grad_out)

    # the reference: the same two functions on every (b, h, q_idx, kv_idx) at once, in float64
    index = (
        torch.arange(batch, device=device)[:, None, None, None],
        torch.arange(heads_q, device=device)[None, :, None, None],
        torch.arange(length, device=device)[None, None, :, None],
        torch.arange(length, device=device)[None, None, None, :],
    )
    keep = document_causal(*index)  # (B, 1, L, S)

    def reference(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        k, v = (t.repeat_interleave(heads_q // heads_kv, dim=1) for t in (k, v))  # GQA
        scores = soft_cap(q @ k.transpose(-1, -2) / math.sqrt(head_dim), *index)
        scores = scores.masked_fill(~keep, -math.inf)
        # a row that keeps no key gives 0, as attnbias's contract says
        weights = torch.softmax(scores.masked_fill(~keep.any(-1, keepdim=True), 0.0), dim=-1)
        return (weights * keep) @ v

    expected = outputs(reference, q.double(), k.double(), v.double(), grad_out.double())
    print(f"  max error vs float64 stock PyTorch: {max_errors(got, expected)}")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # of the largest value
    for value, exact in zip(got, expected, strict=True):
        assert (value.double() - exact).abs().max() <= tolerance * exact.abs().max()

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention) if cuda else flex_attention
        block_mask = create_block_mask(document_causal, batch, None, length, length, device=device)

        def theirs(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return flex(q, k, v, score_mod=soft_cap, block_mask=block_mask, enable_gqa=True)

        with warnings.catch_warnings():
            # on a CPU it runs unfused on purpose: the warning says so
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
            flexed = outputs(theirs, q, k, v, grad_out if cuda else None)
    except Exception as error:  # FlexAttention's own limits on this machine
        print(f"FlexAttention did not run here: {type(error).__name__}: {error}")
        return
    print(f"  max difference from FlexAttention: {max_errors(got, flexed)}")


if __name__ == "__main__":
    main()

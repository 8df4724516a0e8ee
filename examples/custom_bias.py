"""Writing your own bias: a prefix-LM mask as a ``ModBias``.

A prefix-LM (T5, PaLI, UL2) attends bidirectionally within a prefix and causally after it. Write
the rule as a ``mask_mod`` with FlexAttention's signature (``b, h, q_idx, kv_idx`` are integer
tensors) in a frozen dataclass whose fields are its parameters. On a GPU the function is compiled
into the Triton kernels, which skip the tiles it keeps nothing of and never build an L x S mask;
on a CPU the same call runs the exact eager path. It composes with the built-in biases by ``+``.
Each call is checked, output and gradients, against an independent float64 computation with
stock PyTorch: a softmax over the mask written out with ``torch.arange`` comparisons.

    python examples/custom_bias.py

A bias can also implement ``materialize`` itself: an ``AttnBias`` subclass that returns its mask
as a tensor (and ``True`` from ``needs_materialization``) runs stock SDPA with that mask (see
"API at a glance" in the README).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import AttnBias, ModBias, SlidingWindowBias, SoftcapBias, explain, sdpa


@dataclass(frozen=True)
class PrefixLM(ModBias):
    """Keeps ``j <= i`` (causal) or ``j < prefix`` (the prefix is visible to every query)."""

    prefix: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)


def reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, cap: float | None = None) -> Tensor:
    """Attention with stock PyTorch on the keys where ``keep`` is true, the scores soft-capped
    first when ``cap`` is given; a row that keeps no key gives 0, as attnbias's contract says."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # GQA
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(~keep, -math.inf)
    weights = torch.softmax(scores.masked_fill(~keep.any(-1, keepdim=True), 0.0), dim=-1)
    return (weights * keep) @ v


def check(
    name: str, q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, keep: Tensor, cap: float | None
) -> None:
    """Print the route of a training call and its largest errors, output and gradients,
    against ``reference`` in float64 on the same inputs; raise if one is too large."""
    grad_out = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    print(f"{name}\n  route: {explain(*leaves, attn_mask=bias, enable_gqa=True).splitlines()[0]}")
    out = sdpa(*leaves, attn_mask=bias, enable_gqa=True)
    got = [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = reference(*leaves, keep, cap)
    expected = [out.detach(), *torch.autograd.grad(out, leaves, grad_out.double())]
    errors = [(a.double() - b).abs().max().item() for a, b in zip(got, expected, strict=True)]
    labels = ("out", "dq", "dk", "dv")
    text = ", ".join(f"{label} {e:.1e}" for label, e in zip(labels, errors, strict=True))
    print(f"  max error vs float64 stock PyTorch: {text}")
    tolerance = 2e-2 if q.dtype == torch.bfloat16 else 1e-5  # of the largest value
    largest = [b.abs().max().item() for b in expected]
    assert all(e <= tolerance * m for e, m in zip(errors, largest, strict=True)), errors


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batch, heads_q, heads_kv, length, head_dim = (2, 8, 2, 2048, 64) if cuda else (2, 4, 2, 256, 32)
    torch.manual_seed(0)
    q = torch.randn(batch, heads_q, length, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)

    prefix = PrefixLM(length // 4)
    window = length // 8
    # the masks written out, (L, S): query i, key j
    i, j = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)
    prefix_lm = (j <= i) | (j < prefix.prefix)
    check("prefix-LM", q, k, v, prefix, prefix_lm, None)
    check("prefix-LM + soft-cap 30", q, k, v, prefix + SoftcapBias(30.0), prefix_lm, 30.0)
    in_window = (i - window < j) & (j <= i)  # SlidingWindowBias(window - 1): window keys
    check(
        f"prefix-LM + a window of {window} keys",
        q, k, v, prefix + SlidingWindowBias(window - 1), prefix_lm & in_window, None,
    )  # fmt: skip


if __name__ == "__main__":
    main()

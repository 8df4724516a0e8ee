"""Llama 4's chunked attention as a ``ModBias``: causal inside chunks of 1024 tokens.

Llama 4's local layers cut the sequence into chunks and attend causally inside each one. As a
``mask_mod`` that is one line. Equal chunks and a causal comparison are built-in masks written
as a function (documents of ``chunk`` tokens, and the causal band), so the call runs as those
built-ins: documents of one length are separate sequences, so stock SDPA's causal kernel (cuDNN
on a GPU) runs them on a view of q, k and v, where that is fastest; else FlashAttention 4's
variable-length kernel where installed, or the Triton kernel, visiting only the tiles on the
diagonal blocks of the chunks; never an L x S mask. ``explain`` shows the route. A mask that is
not such a form runs as generated code in the Triton and FlashAttention 4 kernels. The output
and gradients are checked against an independent float64 computation with stock PyTorch: a
softmax over a block-diagonal lower-triangular mask built from ``torch.arange``.

    python examples/chunked_local.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import AttnBias, ModBias, explain, sdpa


@dataclass(frozen=True)
class ChunkedLocal(ModBias):
    """Keeps ``j <= i`` inside the same chunk of ``chunk`` tokens."""

    chunk: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx // self.chunk == kv_idx // self.chunk) & (kv_idx <= q_idx)


def reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """Attention with stock PyTorch on the keys where ``keep`` is true; a row that keeps no key
    gives 0, as attnbias's contract says."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # GQA
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)
    weights = torch.softmax(scores.masked_fill(~keep.any(-1, keepdim=True), 0.0), dim=-1)
    return (weights * keep) @ v


def check(name: str, q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, keep: Tensor) -> None:
    """Print the route of a training call and its largest errors, output and gradients,
    against ``reference`` in float64 on the same inputs; raise if one is too large."""
    grad_out = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    print(f"{name}\n  route: {explain(*leaves, attn_mask=bias, enable_gqa=True).splitlines()[0]}")
    out = sdpa(*leaves, attn_mask=bias, enable_gqa=True)
    got = [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = reference(*leaves, keep)
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
    if cuda:
        device, dtype, chunk = "cuda", torch.bfloat16, 1024
        batch, heads_q, heads_kv, length, head_dim = 1, 8, 2, 4096, 128
    else:
        device, dtype, chunk = "cpu", torch.float32, 64
        batch, heads_q, heads_kv, length, head_dim = 1, 4, 2, 256, 32
    torch.manual_seed(0)
    q = torch.randn(batch, heads_q, length, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    # the mask written out: the (L, S) blocks of `chunk` on the diagonal, lower-triangular
    i, j = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)
    keep = (i // chunk == j // chunk) & (j <= i)
    name = f"chunks of {chunk}, causal inside, L = {length}"
    check(name, q, k, v, ChunkedLocal(chunk), keep)


if __name__ == "__main__":
    main()

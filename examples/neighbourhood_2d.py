"""2-D neighbourhood attention over an image as a ``ModBias``.

The tokens are the pixels of a ``height x width`` image in row-major order; each pixel attends
the ``window_h x window_w`` pixels around it. At the border the window is not cut: its centre
moves inside the image, so every pixel attends exactly ``window_h * window_w`` others (as
NATTEN does). The rule reads the image size and the window from the dataclass fields; on a GPU
it runs in the Triton kernels, on a CPU on the exact eager path. The output and gradients are
checked against an independent float64 computation with stock PyTorch: a softmax over the mask
written out from each pixel's row and column, the window's first row and column clamped into
the image (the rule said another way).

    python examples/neighbourhood_2d.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import AttnBias, ModBias, explain, sdpa


@dataclass(frozen=True)
class Neighbourhood2D(ModBias):
    """A ``window_h x window_w`` window (odd sizes) around each pixel of a ``height x width``
    image, its centre clamped so the window stays inside the image."""

    height: int
    width: int
    window_h: int
    window_w: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        half_h, half_w = self.window_h // 2, self.window_w // 2
        centre_row = (q_idx // self.width).clamp(half_h, self.height - 1 - half_h)
        centre_col = (q_idx % self.width).clamp(half_w, self.width - 1 - half_w)
        row, col = kv_idx // self.width, kv_idx % self.width
        return ((row - centre_row).abs() <= half_h) & ((col - centre_col).abs() <= half_w)


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
    print(f"{name}\n  route: {explain(*leaves, attn_mask=bias).splitlines()[0]}")
    out = sdpa(*leaves, attn_mask=bias)
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
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    height, width, window_h, window_w = (48, 64, 7, 7) if cuda else (12, 16, 3, 5)
    batch, heads, head_dim = (2, 8, 64) if cuda else (1, 2, 32)
    bias = Neighbourhood2D(height, width, window_h, window_w)
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, height * width, head_dim, device=device, dtype=dtype)
        for _ in range(3)
    )
    # the mask written out, (L, S): each pixel's window starts window // 2 before it, moved
    # into the image, and spans `window` rows and columns
    pixel = torch.arange(height * width, device=device)
    row, col = pixel // width, pixel % width
    first_row = (row - window_h // 2).clamp(0, height - window_h)[:, None]
    first_col = (col - window_w // 2).clamp(0, width - window_w)[:, None]
    keep = (first_row <= row) & (row < first_row + window_h)
    keep &= (first_col <= col) & (col < first_col + window_w)
    assert bool((keep.sum(-1) == window_h * window_w).all())  # no window is cut at the border
    name = f"{window_h}x{window_w} neighbourhoods over a {height}x{width} image"
    check(name, q, k, v, bias, keep)


if __name__ == "__main__":
    main()

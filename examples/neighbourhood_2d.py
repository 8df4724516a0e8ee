"""2-D neighbourhood attention over an image as a ``ModBias``.

The tokens are the pixels of a ``height x width`` image in row-major order; each pixel attends
the ``window_h x window_w`` pixels around it. At the border the window is not cut: its centre
moves inside the image, so every pixel attends exactly ``window_h * window_w`` others (as
NATTEN does). The rule reads the image size and the window from the dataclass fields; on a GPU
it runs in the Triton kernels, on a CPU on the exact eager path. The output and gradients are
checked against the exact path (``use_backends("reference")``).

    python examples/neighbourhood_2d.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import ModBias

# isort: split
# a sibling module: the examples' folder is on sys.path when one runs
from route_check import check


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
    name = f"{window_h}x{window_w} neighbourhoods over a {height}x{width} image"
    check(name, q, k, v, bias)


if __name__ == "__main__":
    main()

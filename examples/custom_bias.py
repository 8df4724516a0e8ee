"""Writing your own bias: a prefix-LM mask.

A prefix-LM (T5, PaLI, UL2) attends bidirectionally within a prefix and causally after it. Any
mask you can write as a tensor is an ``AttnBias`` in a few lines: implement ``materialize`` and
return ``True`` from ``needs_materialization``; ``sdpa`` then runs stock SDPA with it, and it
composes with the built-in biases (here with soft-capping, which then runs on the exact path).

    python examples/custom_bias.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import attnbias
from attnbias import AttnBias, SoftcapBias, sdpa


@dataclass(frozen=True)
class PrefixLMBias(AttnBias):
    """Keeps ``j <= i`` (causal) or ``j < prefix_length`` (the prefix is visible to all).

    >>> PrefixLMBias(2).materialize(shape=(3, 3))
    tensor([[0., 0., -inf],
            [0., 0., -inf],
            [0., 0., 0.]])
    """

    prefix_length: int

    def __post_init__(self) -> None:
        if self.prefix_length < 0:
            raise ValueError(f"prefix_length must be >= 0, got {self.prefix_length}")

    def materialize(self, device=None, *, shape=None, dtype=None):  # type: ignore[no-untyped-def]
        if shape is None:
            raise ValueError("PrefixLMBias.materialize needs shape=(..., L, S)")
        rows = torch.arange(shape[-2], device=device)[:, None]
        cols = torch.arange(shape[-1], device=device)[None, :]
        keep = (cols <= rows) | (cols < self.prefix_length)
        zeros = torch.zeros(keep.shape, device=device, dtype=dtype or torch.float32)
        return zeros.masked_fill(~keep, -math.inf)

    def needs_materialization(self) -> bool:
        return True


def main() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 10, 32, dtype=torch.float64) for _ in range(3))
    bias = PrefixLMBias(prefix_length=4)

    out = sdpa(q, k, v, attn_mask=bias)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.materialize(shape=(10, 10), dtype=torch.float64)
    )
    print("prefix-LM:", attnbias.explain(q, k, v, attn_mask=bias))
    print("  max error vs stock SDPA:", (out - expected).abs().max().item())

    capped = bias + SoftcapBias(30.0)
    out = sdpa(q, k, v, attn_mask=capped)
    scores = 30.0 * torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(32) / 30.0)
    expected = torch.softmax(scores + bias.materialize(shape=(10, 10), dtype=torch.float64), -1) @ v
    print("prefix-LM + soft-cap:", attnbias.explain(q, k, v, attn_mask=capped))
    print("  max error vs eager:", (out - expected).abs().max().item())

    # existing model code that calls F.scaled_dot_product_attention accepts the bias too
    with attnbias.patch_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    print("through patch_sdpa: same result:", torch.equal(out, sdpa(q, k, v, attn_mask=bias)))


if __name__ == "__main__":
    main()

"""Testing a bias of your own with ``attnbias.testing``.

``check_bias`` runs a bias on every route that can take it on this machine (the exact path,
stock SDPA on the materialized mask, the Triton kernels, FlashAttention 4 where installed; on a
CPU the kernels under Triton's interpreter when ``TRITON_INTERPRET=1``) and holds each to an
fp64 oracle in eager PyTorch that evaluates your functions directly: the output and the
gradients of q, k, v and of the bias's own tensors. With hypothesis installed
(``pip install "attnbias[test]"``), ``strategies.builtin_biases()`` draws the built-ins your bias
may be summed with.

    python examples/check_my_bias.py
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():  # the Triton kernels on the CPU too (set before Triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch import Tensor

from attnbias import ModBias, SlidingWindowBias
from attnbias.testing import check_bias


@dataclass(frozen=True, eq=False)
class PrefixLMWithBonus(ModBias):
    """Causal with a visible prefix, and a learned bonus per head for keys in the prefix."""

    prefix: int
    bonus: Tensor  # (H,)

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)

    def score_mod(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return score + torch.where(kv_idx < self.prefix, self.bonus[h], 0.0)


def main() -> None:
    bonus = torch.linspace(-0.5, 0.5, 4).requires_grad_()  # its gradient is checked too
    bias = PrefixLMWithBonus(prefix=3, bonus=bonus)
    print(check_bias(bias, shapes=[(1, 4, 2, 12, 12, 16), (2, 4, 4, 8, 20, 16)]))
    print()
    # summed with a built-in: every route that takes the sum
    print(check_bias(bias + SlidingWindowBias(6), shapes=[(1, 4, 4, 10, 14, 16)]))
    # a bias whose construction depends on the lengths: a function (L, S) -> bias
    print()
    print(
        check_bias(
            lambda L, S: PrefixLMWithBonus(prefix=L // 2, bonus=bonus), shapes=[(1, 4, 4, 9, 9, 16)]
        )
    )


if __name__ == "__main__":
    main()

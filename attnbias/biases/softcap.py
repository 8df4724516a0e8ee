"""Logit soft-capping (Gemma 2)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias.biases.base import Device, KernelBias, Shape, check_head_range
from attnbias.materialize import MaskedBias
from attnbias.terms import Block, Call, Terms

__all__ = ["SoftcapBias"]


@dataclass(frozen=True)
class SoftcapBias(KernelBias):
    """Logit soft-capping (Gemma 2): ``s = cap * tanh(s / cap)`` after scaling, before the
    additive biases and the masks.

    It is not additive, so it has no materialized form: ``materialize`` raises and the bias
    always dispatches (to the fused kernel on CUDA, to the exact eager path elsewhere).
    """

    cap: float

    # no materialized form (a sum holding it always dispatches), and at most one per sum
    materializable = False
    unique = True

    def __post_init__(self) -> None:
        if isinstance(self.cap, bool) or not isinstance(self.cap, numbers.Real):
            raise TypeError(f"SoftcapBias cap must be a positive float, got {self.cap!r}")
        if not (math.isfinite(self.cap) and self.cap > 0):
            raise ValueError(
                f"SoftcapBias cap must be finite and > 0, got cap={self.cap}; Gemma 2 uses 50.0"
            )
        object.__setattr__(self, "cap", float(self.cap))

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        raise TypeError(
            "SoftcapBias transforms the scores (cap * tanh(s / cap)) and has no additive "
            "tensor form; pass it to attnbias.sdpa as attn_mask instead of materializing it"
        )

    def lower(self, call: Call) -> Terms:
        return Terms.of(softcap=self.cap)

    def masked(self, device: Device, shape: Shape, dtype: torch.dtype) -> MaskedBias:
        return MaskedBias(None, None, self.cap, ())

    def sub_block(self, call: Call, block: Block) -> SoftcapBias:
        """The same cap: it acts on each score alone."""
        return self

    def sub_heads(self, call: Call, start: int, count: int) -> SoftcapBias:
        """The bias itself: the same cap for every head."""
        check_head_range(call, start, count, "SoftcapBias")
        return self

    def cache_key(self) -> Hashable:
        return self  # frozen, equal by value, no tensors

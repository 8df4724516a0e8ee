"""Local attention: a sliding window."""

from __future__ import annotations

import operator
from collections.abc import Hashable
from dataclasses import dataclass

from torch import Tensor

from attnbias.biases.band import BandBias, shifted_band
from attnbias.biases.base import Device, KernelMask, Shape, band_keep, resolve_lengths
from attnbias.terms import Block, Call, Terms

__all__ = ["SlidingWindowBias"]


@dataclass(frozen=True)
class SlidingWindowBias(KernelMask):
    """Local attention, FlashAttention 2's ``window_size=(window_left, window_right)``.

    Keeps ``i + (S - L) - window_left <= j <= i + (S - L) + window_right`` (bottom-right
    aligned, inclusive); ``None`` leaves that side unbounded. ``SlidingWindowBias(W - 1)``
    keeps ``W`` keys per query: the query's own position and the ``W - 1`` before it.

    >>> SlidingWindowBias(1).materialize(shape=(3, 3))
    tensor([[0., -inf, -inf],
            [0., 0., -inf],
            [-inf, 0., 0.]])
    """

    window_left: int | None
    window_right: int | None = 0

    def __post_init__(self) -> None:
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise TypeError(f"SlidingWindowBias {name} must be an int or None, got {value!r}")
            value = operator.index(value)
            object.__setattr__(self, name, value)
            if value < 0:
                raise ValueError(
                    f"SlidingWindowBias {name} must be >= 0 (or None for unbounded), got "
                    f"{value}; window_left=W-1 keeps W keys per query"
                )

    def offsets(self, length_q: int, length_kv: int) -> tuple[int | None, int | None]:
        """``(lo, hi)`` such that the kept pairs are ``lo <= j - i <= hi``."""
        shift = length_kv - length_q
        lo = None if self.window_left is None else shift - self.window_left
        hi = None if self.window_right is None else shift + self.window_right
        return lo, hi

    def keep(self, device: Device = None, shape: Shape = None) -> Tensor:
        length_q, length_kv = resolve_lengths(shape, None, None, "SlidingWindowBias")
        return band_keep(length_q, length_kv, *self.offsets(length_q, length_kv), device)

    def lower(self, call: Call) -> Terms:
        lo, hi = self.offsets(call.length_q, call.length_kv)
        return Terms.of(band_lo=lo, band_hi=hi)

    def sub_block(self, call: Call, block: Block) -> BandBias:
        """The band of the block: the call's window (aligned with the call's ``S - L``),
        shifted along the diagonal."""
        return shifted_band(*self.offsets(call.length_q, call.length_kv), block)

    def cache_key(self) -> Hashable:
        return self  # frozen, equal by value, no tensors

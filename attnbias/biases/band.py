"""A diagonal band of the scores, at fixed offsets: the block form of causal masks and windows."""

from __future__ import annotations

import operator
from collections.abc import Hashable
from dataclasses import dataclass

from torch import Tensor

from attnbias.biases.base import Device, KernelMask, Shape, band_keep, resolve_lengths
from attnbias.terms import Block, Call, Terms

__all__ = ["BandBias"]


@dataclass(frozen=True)
class BandBias(KernelMask):
    """Keeps the pairs with ``lo <= j - i <= hi`` (``None``: that side unbounded), whatever
    ``L`` and ``S`` are: the kernels' band itself.

    A causal mask or a sliding window is such a band with offsets taken from the call's
    lengths; their blocks (:meth:`~attnbias.AttnBias.sub_block`, context parallelism) are
    bands shifted along the diagonal. ``BandBias(None, 0)`` is upper-left causal.

    >>> BandBias(-1, 1).materialize(shape=(3, 4))
    tensor([[0., 0., -inf, -inf],
            [0., 0., 0., -inf],
            [-inf, 0., 0., 0.]])
    """

    lo: int | None
    hi: int | None

    def __post_init__(self) -> None:
        for name in ("lo", "hi"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise TypeError(f"BandBias {name} must be an int or None, got {value!r}")
            object.__setattr__(self, name, operator.index(value))

    def keep(self, device: Device = None, shape: Shape = None) -> Tensor:
        length_q, length_kv = resolve_lengths(shape, None, None, "BandBias")
        return band_keep(length_q, length_kv, self.lo, self.hi, device)

    def lower(self, call: Call) -> Terms:
        return Terms.of(band_lo=self.lo, band_hi=self.hi)

    def sub_block(self, call: Call, block: Block) -> BandBias:
        return shifted_band(self.lo, self.hi, block)

    def cache_key(self) -> Hashable:
        return self  # frozen, equal by value, no tensors


def shifted_band(lo: int | None, hi: int | None, block: Block) -> BandBias:
    """The band ``lo <= j - i <= hi`` of a call, seen from ``block`` of it."""
    return BandBias(
        None if lo is None else lo - block.offset, None if hi is None else hi - block.offset
    )

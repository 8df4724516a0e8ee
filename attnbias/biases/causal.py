"""The causal mask, aligned to either corner."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass

from torch import Tensor

from attnbias.biases.band import BandBias, shifted_band
from attnbias.biases.base import Device, KernelMask, Shape, band_keep, resolve_lengths
from attnbias.terms import Block, Call, Terms

__all__ = ["CausalBias", "CausalVariant", "causal_lower_right", "causal_upper_left"]


class CausalVariant(enum.IntEnum):
    """Alignment of a causal mask when ``L != S`` (the values match PyTorch's enum).

    ``UPPER_LEFT`` keeps ``j <= i``; ``LOWER_RIGHT`` keeps ``j <= i + (S - L)``, so the last
    query sees every key (KV cache, chunked prefill).
    """

    UPPER_LEFT = 1
    LOWER_RIGHT = 2


@dataclass(frozen=True)
class CausalBias(KernelMask):
    """Causal mask, aligned to the top-left or bottom-right corner of the ``(L, S)`` scores.

    ``seq_len_q`` / ``seq_len_kv`` are optional; when given, the bias materializes on its own
    (``materialize(device)``) and ``sdpa`` checks them against the inputs.

    >>> causal_lower_right(2, 3).materialize()
    tensor([[0., 0., -inf],
            [0., 0., 0.]])
    """

    variant: CausalVariant = CausalVariant.UPPER_LEFT
    seq_len_q: int | None = None
    seq_len_kv: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.variant, CausalVariant):
            try:
                object.__setattr__(self, "variant", CausalVariant(self.variant))
            except ValueError:
                raise ValueError(
                    f"CausalBias variant must be CausalVariant.UPPER_LEFT or LOWER_RIGHT, got "
                    f"{self.variant!r}"
                ) from None
        for name in ("seq_len_q", "seq_len_kv"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CausalBias {name} must be a positive int or None, got {value!r}")
            if value < 1:
                raise ValueError(f"CausalBias {name} must be a positive int, got {value!r}")

    def offset_hi(self, length_q: int, length_kv: int) -> int:
        """The largest kept ``j - i``."""
        return 0 if self.variant is CausalVariant.UPPER_LEFT else length_kv - length_q

    def keep(self, device: Device = None, shape: Shape = None) -> Tensor:
        length_q, length_kv = resolve_lengths(shape, self.seq_len_q, self.seq_len_kv, "CausalBias")
        return band_keep(length_q, length_kv, None, self.offset_hi(length_q, length_kv), device)

    def validate_call(self, call: Call) -> None:
        resolve_lengths(
            (call.length_q, call.length_kv), self.seq_len_q, self.seq_len_kv, "CausalBias"
        )

    def lower(self, call: Call) -> Terms:
        return Terms.of(band_hi=self.offset_hi(call.length_q, call.length_kv))

    def sub_block(self, call: Call, block: Block) -> BandBias:
        """The band of the block: the call's ``j - i <= hi`` (``hi`` from the call's lengths,
        ``S - L`` for lower-right), shifted along the diagonal."""
        return shifted_band(None, self.offset_hi(call.length_q, call.length_kv), block)

    def cache_key(self) -> Hashable:
        return self  # frozen, equal by value, no tensors

    def __repr__(self) -> str:
        lengths = ""
        if self.seq_len_q is not None or self.seq_len_kv is not None:
            lengths = f", seq_len_q={self.seq_len_q}, seq_len_kv={self.seq_len_kv}"
        return f"CausalBias({self.variant.name}{lengths})"


def causal_upper_left(seq_len_q: int | None = None, seq_len_kv: int | None = None) -> CausalBias:
    """Causal mask keeping ``j <= i`` (PyTorch's ``is_causal=True``)."""
    return CausalBias(CausalVariant.UPPER_LEFT, seq_len_q, seq_len_kv)


def causal_lower_right(seq_len_q: int | None = None, seq_len_kv: int | None = None) -> CausalBias:
    """Causal mask keeping ``j <= i + (S - L)``; rows ``i < L - S`` are fully masked."""
    return CausalBias(CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv)

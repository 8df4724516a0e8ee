"""The valid keys of each batch row (padding, the filled part of a cache)."""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnbias.biases.base import Device, KernelMask, Shape, cached_on, device_key, resolve_lengths
from attnbias.terms import Block, Call, Terms

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["KeyRangeBias"]


def _check_key_bound(value: Any, name: str) -> Tensor | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        bound = value
    else:
        values = list(value) if isinstance(value, Sequence) else value
        if isinstance(values, list) and any(
            isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in values
        ):
            raise TypeError(f"KeyRangeBias {name} must hold int positions, got {values!r}")
        try:
            bound = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"KeyRangeBias {name} must be a (B,) tensor or list of int positions, got {value!r}"
            ) from None
    if bound.dtype.is_floating_point or bound.dtype.is_complex or bound.dtype == torch.bool:
        raise TypeError(
            f"KeyRangeBias {name} must hold integer positions, got dtype={bound.dtype}; convert "
            f"with .long()"
        )
    if bound.dim() != 1 or bound.numel() == 0:
        raise ValueError(
            f"KeyRangeBias {name} must have shape (B,) with one position per batch row, got "
            f"{tuple(bound.shape)}"
        )
    if not torch.compiler.is_compiling() and bool((bound < 0).any()):
        raise ValueError(
            f"KeyRangeBias {name} must be >= 0, got {bound.tolist()}; positions count keys from 0"
        )
    return bound


@dataclass(frozen=True, eq=False)
class KeyRangeBias(KernelMask):
    """The valid keys of each batch row: query ``i`` of row ``b`` attends to key ``j`` only
    when ``start[b] <= j < end[b]``.

    For padded batches (left padding: ``start`` is the padding length; right padding: ``end``
    is the sequence length) and for a key/value cache of which only a prefix is filled.
    ``start`` and ``end`` are ``(B,)`` integer tensors or lists (``(1,)`` broadcasts over the
    batch); ``None`` means ``0`` and ``S``. A row whose range is empty keeps no key (its
    output is 0). Keys outside the range reach nothing at all, on every route: a NaN in a
    padded key or an unused cache slot stays out of every output and gradient.

    Positions given as ``torch.int32`` tensors of shape ``(B,)`` on the inputs' device are
    used as they are, not copied: a cache that fills can write ``end += 1`` in place between
    decode steps, and the next call with the same bias (a CUDA-graph replay of a captured
    call too) sees it. They must stay ``0 <= start <= end``, which is checked only when the
    bias is made. Positions of another dtype, shape or device are copied once, and later
    writes into them are not seen.

    >>> KeyRangeBias(start=[1, 0], end=[3, 2]).materialize(shape=(2, 1, 1, 3))
    tensor([[[[-inf, 0., 0.]]],
    <BLANKLINE>
    <BLANKLINE>
            [[[0., 0., -inf]]]])
    """

    start: Tensor | None = field(default=None, repr=False)
    end: Tensor | None = field(default=None, repr=False)
    _on_device: dict[Any, Tensor] = field(default_factory=dict, init=False, repr=False)
    # which of start / end a call had to copy (another dtype, device or shape)
    _copied: dict[str, bool] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        start = _check_key_bound(self.start, "start")
        end = _check_key_bound(self.end, "end")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        if start is not None and end is not None:
            if start.device != end.device:
                raise ValueError(
                    f"KeyRangeBias start is on {start.device} but end is on {end.device}; put "
                    f"both on the device of the inputs"
                )
            if start.shape[0] != end.shape[0] and 1 not in (start.shape[0], end.shape[0]):
                raise ValueError(
                    f"KeyRangeBias start has {start.shape[0]} rows but end has {end.shape[0]}; "
                    f"give one position per batch row (or one for all)"
                )
            if not torch.compiler.is_compiling() and bool((end < start).any()):
                raise ValueError(
                    f"KeyRangeBias needs start <= end in every row, got start={start.tolist()} "
                    f"and end={end.tolist()}"
                )

    @classmethod
    def from_padding_mask(cls, mask: Tensor) -> Self:
        """The key ranges of a ``(B, S)`` padding mask (``True`` or ``1`` = a real token).

        Each row's real tokens must form one contiguous run (left or right padding); a mask
        with holes is no key range: pass it as a :class:`TensorBias` instead. The positions are
        int32 ``(B,)`` on the mask's device, which the kernels read where they are.

        >>> KeyRangeBias.from_padding_mask(torch.tensor([[0, 1, 1], [1, 1, 0]]))
        KeyRangeBias(start=[1, 0], end=[3, 2])
        """
        if not isinstance(mask, Tensor):
            raise TypeError(
                f"KeyRangeBias.from_padding_mask takes a (B, S) tensor, got {type(mask).__name__}"
            )
        if mask.dim() != 2:
            raise ValueError(
                f"KeyRangeBias.from_padding_mask takes a (B, S) mask, got shape {tuple(mask.shape)}"
            )
        if mask.dtype != torch.bool:
            if (
                mask.is_floating_point()
                or mask.is_complex()
                or bool(((mask != 0) & (mask != 1)).any())
            ):
                raise ValueError(
                    f"KeyRangeBias.from_padding_mask takes a bool or 0/1 integer mask, got "
                    f"dtype={mask.dtype}"
                    + ("" if mask.is_floating_point() else " with values other than 0 and 1")
                )
            mask = mask != 0
        length = mask.shape[1]
        positions = torch.arange(length, device=mask.device)
        count = mask.sum(1)
        start = torch.where(mask, positions, length).amin(1)
        end = torch.where(mask, positions + 1, 0).amax(1)
        start = torch.where(count > 0, start, 0)
        holes = (count > 0) & (end - start != count)
        if bool(holes.any()):
            row = int(holes.nonzero()[0, 0])
            raise ValueError(
                f"KeyRangeBias.from_padding_mask: row {row} of the mask has padding between "
                f"real tokens, so its keys are no single range; pass the mask as a TensorBias"
            )
        # int32 on the mask's device: read there by the kernels at each call, no copy
        return cls(start.to(torch.int32), end.to(torch.int32))

    def bounds_on(self, device: Device, batch: int, length_kv: int) -> tuple[Tensor, Tensor]:
        """``(start, end)`` as int32 ``(B,)`` tensors on ``device``, ``None`` filled in with 0
        and ``S``: the bias's own tensors where they are int32 ``(B,)`` on ``device`` already
        (so that writes into them are seen), otherwise copied to a device and kept with the
        bias until the tensor is written again (its version counter; :meth:`cache_key` then
        names the version, so that a plan holding the old copy is not reused)."""
        where = device_key(device)
        key = (where, batch, length_kv)

        def kept(name: str, bound: Tensor | None, default: int) -> Tensor:
            if bound is None:
                return cached_on(
                    self._on_device,
                    (name, key),
                    lambda: torch.full((batch,), default, dtype=torch.int32, device=where),
                )
            if (
                bound.dtype == torch.int32
                and bound.device == where
                and bound.shape == (batch,)
                and bound.is_contiguous()
            ):
                return bound  # read where it is, at each call
            if not torch.compiler.is_compiling():
                self._copied[name] = True
            return cached_on(
                self._on_device,
                (name, key, bound._version),
                lambda: bound.to(device=where, dtype=torch.int32).expand(batch).contiguous(),
            )

        return kept("start", self.start, 0), kept("end", self.end, length_kv)

    def keep(self, device: Device = None, shape: Shape = None) -> Tensor:
        """``(B, 1, 1, S)`` bool."""
        _, length_kv = resolve_lengths(shape, None, None, "KeyRangeBias")
        shape = tuple(shape) if shape is not None else ()
        rows = [b.shape[0] for b in (self.start, self.end) if b is not None]
        batch = int(shape[0]) if len(shape) == 4 else max(rows, default=1)
        self.validate_call(Call(batch, 1, 1, length_kv, device_key(device)))
        cols = torch.arange(length_kv, device=device)
        keep = torch.ones(batch, length_kv, dtype=torch.bool, device=device)
        if self.start is not None:
            keep &= cols >= self.start.to(device)[:, None]
        if self.end is not None:
            keep &= cols < self.end.to(device)[:, None]
        return keep[:, None, None, :]

    def validate_call(self, call: Call) -> None:
        batch, length_kv = call.batch_size, call.length_kv
        for name, bound in (("start", self.start), ("end", self.end)):
            if bound is None:
                continue
            if bound.shape[0] not in (1, batch):
                raise ValueError(
                    f"KeyRangeBias {name} has {bound.shape[0]} rows but the call has batch size "
                    f"B={batch}; give one position per batch row"
                )
            # values are read where the call may synchronise: not while compiling, nor while
            # a CUDA graph is captured (the calls run before capturing checked them)
            readable = not torch.compiler.is_compiling() and not (
                bound.is_cuda and torch.cuda.is_current_stream_capturing()
            )
            if readable and bool((bound > length_kv).any()):
                raise ValueError(
                    f"KeyRangeBias {name}={bound.tolist()} goes past the call's S={length_kv} "
                    f"keys; positions must be at most S"
                )

    def lower(self, call: Call) -> Terms:
        if self.start is None and self.end is None:
            return Terms.of()  # every key of every row
        # (B,) int32 on the device, kept with the bias
        rows = call.batch
        if rows is None:
            rows = max(b.shape[0] for b in (self.start, self.end) if b is not None)
        start, end = self.bounds_on(call.device, rows, call.length_kv)
        return Terms.of(kv_start=start, kv_end=end)

    def sub_block(self, call: Call, block: Block) -> KeyRangeBias:
        """Each row's range moved to the block's keys and clipped to them (an empty range
        where the row's keys all lie outside the block), read from the positions as they are
        now."""

        def moved(bound: Tensor | None) -> Tensor | None:
            if bound is None:
                return None
            return (bound.long() - block.kv_start).clamp(0, block.length_kv)

        return KeyRangeBias(moved(self.start), moved(self.end))

    def cache_key(self) -> Hashable:
        # by identity, as DocumentBias: the positions are read on the device at each call;
        # where a call copied them, their versions too (a write needs a new copy)
        versions = tuple(
            bound._version
            for name, bound in (("start", self.start), ("end", self.end))
            if bound is not None and (self._copied.get(name) or bound.dtype != torch.int32)
        )
        return (KeyRangeBias, id(self), versions)

    @property
    def cache_key_varies(self) -> bool:
        return self.start is not None or self.end is not None

    def __repr__(self) -> str:
        def show(bound: Tensor | None) -> str:
            if bound is None:
                return "None"
            return str(bound.tolist()) if bound.numel() <= 8 else f"({bound.shape[0]},) tensor"

        return f"KeyRangeBias(start={show(self.start)}, end={show(self.end)})"

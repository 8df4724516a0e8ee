"""Packed documents."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnbias.biases.base import Device, KernelMask, Shape, capturing_now, device_key
from attnbias.kernels.pools import outside_pools
from attnbias.terms import Block, Call, Terms

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["DocumentBias"]


def _check_doc_ids(ids: Tensor, name: str) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(
            f"DocumentBias {name} must be a torch.Tensor of integer ids, got {type(ids).__name__}"
        )
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(
            f"DocumentBias {name} must hold integer document ids, got dtype={ids.dtype}; "
            f"convert with .long()"
        )
    if ids.dim() not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(
            f"DocumentBias {name} must have shape (L,) or (B, L) with L > 0, got {tuple(ids.shape)}"
        )
    if torch.compiler.is_compiling():
        return
    if ids.shape[-1] > 1 and bool((ids[..., 1:] < ids[..., :-1]).any()):
        position = int((ids[..., 1:] < ids[..., :-1]).nonzero()[0, -1]) + 1
        raise ValueError(
            f"DocumentBias {name} must be non-decreasing along the sequence (packed documents), "
            f"but it decreases at position {position}; sort the sequences by document or build "
            f"the ids with DocumentBias.from_seqlens(...)"
        )


@dataclass(frozen=True, eq=False)
class DocumentBias(KernelMask):
    """Packed documents: query ``i`` attends to key ``j`` only when ``doc_q[i] == doc_kv[j]``.

    ``q_doc_ids`` has shape ``(L,)`` or ``(B, L)``, ``kv_doc_ids`` ``(S,)`` or ``(B, S)``
    (default: the query ids, for self-attention); ids are non-decreasing along the sequence.
    Combine with :class:`CausalBias` for causal packed training.

    The ids are read at each call: an in-place write (``ids[...] = ...``, ``ids.copy_(...)``)
    is seen by the next call on every route, and checked again (ids made to decrease raise the
    same ``ValueError`` as at construction). A write that bumps no version counter (through
    ``.data`` or a NumPy view) may not be seen: write through the tensor itself.

    >>> DocumentBias.from_seqlens([1, 2]).materialize()
    tensor([[0., -inf, -inf],
            [-inf, 0., 0.],
            [-inf, 0., 0.]])
    """

    q_doc_ids: Tensor = field(repr=False)
    kv_doc_ids: Tensor | None = field(default=None, repr=False)
    # per (side, device): the ids there and the versions they were made from
    _on_device: dict[Any, tuple[Any, Tensor]] = field(default_factory=dict, init=False, repr=False)
    _blocks: dict[Block, DocumentBias] = field(default_factory=dict, init=False, repr=False)
    # the ids' versions when they were last checked (non-decreasing)
    _checked: list[Any] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._check()
        if self.kv_doc_ids is not None and self.kv_doc_ids.device != self.q_doc_ids.device:
            raise ValueError(
                f"DocumentBias q_doc_ids is on {self.q_doc_ids.device} but kv_doc_ids is on "
                f"{self.kv_doc_ids.device}; put both on the device of the inputs"
            )

    def versions(self) -> tuple[int, int] | None:
        """The version counters of the id tensors (an in-place write bumps them), or ``None``
        where one has none (an inference tensor: its ids are read at every call) or while
        ``torch.compile`` traces (the traced graph reads the ids themselves)."""
        if torch.compiler.is_compiling():
            return None
        try:
            return (self.q_doc_ids._version, self.kv_ids._version)
        except RuntimeError:
            return None

    def _check(self) -> None:
        """The ids' checks, once per version of the tensors (a host synchronisation)."""
        versions = self.versions()
        if (versions is not None and self._checked == [versions]) or (
            torch.compiler.is_compiling() and self._checked
        ):
            return
        _check_doc_ids(self.q_doc_ids, "q_doc_ids")
        if self.kv_doc_ids is not None:
            _check_doc_ids(self.kv_doc_ids, "kv_doc_ids")
        self._checked[:] = [versions]

    @classmethod
    def from_seqlens(
        cls,
        q_seqlens: Sequence[int] | Tensor,
        kv_seqlens: Sequence[int] | Tensor | None = None,
        *,
        device: Device = None,
    ) -> Self:
        """Document ids for sequences packed back to back.

        ``q_seqlens[d]`` query tokens (and ``kv_seqlens[d]`` keys, default the same) belong to
        document ``d``; ``sum(q_seqlens) == L``, ``sum(kv_seqlens) == S``.
        """
        q_ids = cls._ids_from_seqlens(q_seqlens, "q_seqlens", device)
        if kv_seqlens is None:
            return cls(q_ids)
        kv_ids = cls._ids_from_seqlens(kv_seqlens, "kv_seqlens", device)
        if len(kv_seqlens) != len(q_seqlens):
            raise ValueError(
                f"DocumentBias.from_seqlens needs one kv length per document: got "
                f"{len(q_seqlens)} query lengths and {len(kv_seqlens)} kv lengths"
            )
        return cls(q_ids, kv_ids)

    @staticmethod
    def _ids_from_seqlens(seqlens: Sequence[int] | Tensor, name: str, device: Device) -> Tensor:
        try:
            lengths = torch.as_tensor(seqlens)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"DocumentBias.from_seqlens: {name} must be a list or 1-D tensor of int lengths, "
                f"got {seqlens!r}"
            ) from None
        if lengths.dim() != 1 or lengths.numel() == 0:
            raise ValueError(
                f"DocumentBias.from_seqlens: {name} must be a non-empty 1-D list of lengths, got "
                f"shape {tuple(lengths.shape)}"
            )
        mixed_bools = isinstance(seqlens, (list, tuple)) and any(
            isinstance(n, bool) for n in seqlens
        )
        if (
            mixed_bools
            or lengths.dtype == torch.bool
            or lengths.is_floating_point()
            or lengths.is_complex()
        ):
            # a fractional length would be truncated, and True would count as 1
            raise TypeError(
                f"DocumentBias.from_seqlens: {name} must hold int lengths, got {lengths.tolist()} "
                f"(dtype={lengths.dtype}); pass whole numbers of tokens as ints"
            )
        lengths = lengths.to(device=device, dtype=torch.long)
        if bool((lengths < 0).any()) or int(lengths.sum()) == 0:
            raise ValueError(
                f"DocumentBias.from_seqlens: {name} must be non-negative with a positive sum, "
                f"got {lengths.tolist()}"
            )
        return torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device), lengths
        )

    @property
    def kv_ids(self) -> Tensor:
        return self.q_doc_ids if self.kv_doc_ids is None else self.kv_doc_ids

    def ids_on(self, device: Device) -> tuple[Tensor, Tensor]:
        """``(q_ids, kv_ids)`` as int64 ``(1 or B, L)`` and ``(1 or B, S)`` on ``device``.

        Ids already int64 on ``device`` are used as they are (views: the kernels read them
        live); others are copied there once per version of the tensors, so an in-place write
        (``ids[...] = ...``, ``ids.copy_(...)``) is seen by the next call. A write that bumps no
        version counter (through ``.data`` or a NumPy view) is not seen where the ids are
        copied: write in place through the tensor itself. Build the bias on the inputs' device
        (``device=`` in :meth:`from_seqlens`) to skip the copy.
        """

        def prepare(ids: Tensor) -> Tensor:
            ids = ids.to(device=device, dtype=torch.long)
            return ids if ids.dim() == 2 else ids[None]

        key, versions = device_key(device), self.versions()
        found = []
        for side, ids in (("q", self.q_doc_ids), ("kv", self.kv_ids)):
            kept = self._on_device.get((side, key))
            if kept is None or versions is None or kept[0] != versions:
                copied = not (ids.dtype == torch.long and ids.device == key)
                # Nothing kept while capturing (a copy made then is filled on replay only) or
                # while torch.compile traces (the traced graph makes its own, as cached_on).
                if torch.compiler.is_compiling() or capturing_now():
                    kept = (versions, prepare(ids))
                elif copied:  # kept: made where no CUDA graph writes (see base.cached_on)
                    kept = (versions, outside_pools(lambda ids=ids: prepare(ids)))
                    self._on_device[side, key] = kept
                else:  # the ids themselves (a view)
                    kept = (versions, prepare(ids))
                    self._on_device[side, key] = kept
            found.append(kept[1])
        return found[0], found[1]

    def keep(self, device: Device = None, shape: Shape = None) -> Tensor:
        q_ids, kv_ids = self.q_doc_ids, self.kv_ids
        if shape is not None:
            shape = tuple(shape)
            batch = shape[0] if len(shape) == 4 else 1
            self.validate_call(Call(batch, 1, int(shape[-2]), int(shape[-1]), q_ids.device))
        keep = q_ids[..., :, None] == kv_ids[..., None, :]
        if keep.dim() == 3:  # (B, L, S) -> (B, 1, L, S)
            keep = keep[:, None]
        if device is not None:
            keep = keep.to(device)
        return keep

    def validate_call(self, call: Call) -> None:
        self._check()  # ids written in place since the last check: checked again
        batch, length_q, length_kv = call.batch_size, call.length_q, call.length_kv
        for name, ids, length, letter in (
            ("q_doc_ids", self.q_doc_ids, length_q, "L"),
            ("kv_doc_ids", self.kv_ids, length_kv, "S"),
        ):
            if ids.shape[-1] != length:
                raise ValueError(
                    f"DocumentBias {name} has length {ids.shape[-1]} but the call has "
                    f"{letter}={length}; give one id per {'query' if letter == 'L' else 'key'}"
                    + (
                        " (pass kv_doc_ids when S != L)"
                        if self.kv_doc_ids is None and letter == "S"
                        else ""
                    )
                )
            if ids.dim() == 2 and ids.shape[0] not in (1, batch):
                raise ValueError(
                    f"DocumentBias {name} of shape {tuple(ids.shape)} does not match batch size "
                    f"B={batch}; use shape ({letter},) or (B, {letter})"
                )

    def lower(self, call: Call) -> Terms:
        # The bias's cached device tensors pass on unchanged, so that the kernel can recognise
        # them from call to call; the kernel broadcasts (1, L) against (B, S).
        q_ids, kv_ids = self.ids_on(call.device)
        return Terms.of(q_doc=q_ids, kv_doc=kv_ids, doc_parts=(self,))

    def sub_block(self, call: Call, block: Block) -> DocumentBias:
        """The ids of the block's queries and keys: views of this bias's, so they follow its
        in-place writes (kept with the bias, per block)."""
        found = self._blocks.get(block)
        if found is None:
            found = DocumentBias(
                self.q_doc_ids[..., block.q_start : block.q_start + block.length_q],
                self.kv_ids[..., block.kv_start : block.kv_start + block.length_kv],
            )
            self._blocks[block] = found
        return found

    def cache_key(self) -> Hashable | None:
        # by identity and the ids' versions: the plan-cache entry keeps the bias alive, so
        # that its identity cannot be reused (the terms it stores hold its tensors on the
        # device), and a call after an in-place write is planned again
        versions = self.versions()
        return None if versions is None else (DocumentBias, id(self), versions)

    @property
    def cache_key_varies(self) -> bool:
        return True

    def __repr__(self) -> str:
        return (
            f"DocumentBias(q_doc_ids of shape {tuple(self.q_doc_ids.shape)}, kv_doc_ids of "
            f"shape {tuple(self.kv_ids.shape)})"
        )

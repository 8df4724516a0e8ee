"""The mask program: everything the kernels need to know about a call's mask and score terms,
in one value that is built once by the front-end and passed unchanged to every launcher.

The kernels see no bias classes. A mask program holds:

* the **iteration source** of each query block's key blocks: the analytic band (with documents
  and key ranges: one contiguous run of key blocks per query block, see ``common.py``), or
  precomputed :class:`BlockLists` of full and partial key blocks per query block (and their
  transpose for the dK/dV kernel), which can describe any block pattern;
* the **element terms** every partial tile evaluates: band limits, document ids, per-row key
  ranges (all intersect);
* the **score terms**: ALiBi slopes and the soft-cap.

One place turns a program into what the kernels take (``masks.launch_mask``: the record and
features of ``record.py``); the registered ops
take it packed (:meth:`MaskProgram.pack`: a list of tensors, a list of ints, a list of floats)
and unpack it (:meth:`MaskProgram.unpack`), so no parameter list is written out by hand.

Shape legend: ``B`` batch, ``Hq`` query heads, ``L`` queries, ``S`` keys, ``Mb = ceil(L /
block_m)`` query blocks and ``Nb = ceil(S / block_n)`` key blocks of a :class:`BlockLists`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

if TYPE_CHECKING:
    from .modfn import CompiledMods

__all__ = ["BlockLists", "MaskProgram"]

# How a field travels through the packed form: "tensor" fields (Tensor or None) go to the
# tensor list, "int" and "float" fields (a number or None) to the number lists with a flag
# saying whether they are set, "lists" is the optional nested BlockLists.
_KIND = "packed_as"


@dataclass(frozen=True, eq=False)
class BlockLists:
    """Per query block, the key blocks to visit, and per key block the query blocks (the
    transpose, for the dK/dV kernel), each split into *partial* blocks (the element terms
    are evaluated) and *full* blocks (every pair kept: no element mask).

    Blocks are ``block_m`` queries by ``block_n`` keys; the kernels' own tiles divide them
    (their tiles are powers of two of at most 128, 16 under the interpreter). ``kv_lists``
    is ``(Bl, Hl, Mb, 2, Nb + 1)`` int32: for query block ``m``, ``[..., m, 0, 0]`` partial
    key blocks listed in ``[..., m, 0, 1:]``, and ``[..., m, 1, 0]`` full ones in
    ``[..., m, 1, 1:]`` (entries past a count are never read). ``q_lists`` is the same for
    key blocks, ``(Bl, Hl, Nb, 2, Mb + 1)``. ``Bl`` and ``Hl`` are 1 (shared by every batch
    row or head) or ``B`` and ``Hq``; both tensors are contiguous.

    A block that holds a kept pair must be listed; a block listed as full must keep every
    pair of it (so it lies inside ``[0, L) x [0, S)`` and inside every key range) under the
    program's element terms, which are applied to partial blocks only.
    """

    block_m: int
    block_n: int
    kv_lists: Tensor  # (Bl, Hl, Mb, 2, Nb + 1) int32
    q_lists: Tensor  # (Bl, Hl, Nb, 2, Mb + 1) int32

    TENSORS = ("kv_lists", "q_lists")

    def tensors(self) -> list[Tensor]:
        return [self.kv_lists, self.q_lists]

    @property
    def per_batch(self) -> bool:
        return self.kv_lists.shape[0] > 1

    def counts(self) -> tuple[int, int, int]:
        """``(partial, full, blocks)``: the partial and the full blocks listed over every list
        row, and how many blocks the rows have in all (reading the counts is a host
        synchronisation)."""
        lists = self.kv_lists
        partial = int(lists[..., 0, 0].sum())
        full = int(lists[..., 1, 0].sum())
        rows = lists.shape[0] * lists.shape[1] * lists.shape[2]
        return partial, full, rows * (lists.shape[4] - 1)

    @property
    def per_head(self) -> bool:
        return self.kv_lists.shape[1] > 1


@dataclass(frozen=True, eq=False)
class MaskProgram:
    """A call's mask and score terms in the kernels' form (see the module docstring).

    A pair ``(i, j)`` of batch row ``b`` and query head ``h`` is kept when
    ``band_lo <= j - i <= band_hi`` (``None``: open side), ``q_doc[b, i] == kv_doc[b, j]``
    (document ids non-decreasing, ``(1 | B, L)`` and ``(1 | B, S)``, both or neither) and
    ``kv_start[b] <= j < kv_end[b]`` (``(B,)`` or ``(1,)`` integers, both or neither), and,
    with ``blocks``, when its block is listed for that query block. Scores are
    ``scale * q.k``, then ``softcap * tanh(s / softcap)``, then ``- slope[b, h] *
    |i + S - L + alibi_shift - j|`` with ``alibi_slopes`` ``(1 | B, Hq)`` float32.

    A nonzero ``alibi_shift`` (a block of a larger call, for context parallelism) runs only
    where every kept pair's distance has one sign (:func:`~.masks.alibi_sign`): the kernels
    then score ``- slope * sign * (i + S - L - j)``, which is the shifted term plus
    ``slope * sign * alibi_shift`` on every pair of a row, a constant the softmax ignores and
    :func:`alibi_score_offset` gives to the log-sum-exp.
    """

    band_lo: int | None = field(default=None, metadata={_KIND: "int"})
    band_hi: int | None = field(default=None, metadata={_KIND: "int"})
    q_doc: Tensor | None = field(default=None, metadata={_KIND: "tensor"})  # (1 | B, L) ids
    kv_doc: Tensor | None = field(default=None, metadata={_KIND: "tensor"})  # (1 | B, S) ids
    kv_start: Tensor | None = field(default=None, metadata={_KIND: "tensor"})  # (B,) or (1,)
    kv_end: Tensor | None = field(default=None, metadata={_KIND: "tensor"})  # (B,) or (1,)
    alibi_slopes: Tensor | None = field(default=None, metadata={_KIND: "tensor"})  # (1|B, Hq)
    alibi_shift: int | None = field(default=None, metadata={_KIND: "int"})  # None: 0
    softcap: float | None = field(default=None, metadata={_KIND: "float"})
    blocks: BlockLists | None = field(default=None, metadata={_KIND: "lists"})
    # generated mask and score functions (kernels/modfn.py), applied after the terms above
    mods: CompiledMods | None = field(default=None, metadata={_KIND: "mods"})

    @property
    def has_key_range(self) -> bool:
        return self.kv_start is not None

    @property
    def has_docs(self) -> bool:
        return self.q_doc is not None

    def replace(self, **changes: Any) -> MaskProgram:
        return dataclasses.replace(self, **changes)

    # -- the packed form of the registered ops ------------------------------------------------

    def pack(self) -> tuple[list[Tensor | None], list[int], list[float]]:
        """``(tensors, ints, floats)``: this program as the registered ops take it."""
        tensors: list[Tensor | None] = []
        ints: list[int] = []
        floats: list[float] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = f.metadata[_KIND]
            if kind == "tensor":
                tensors.append(value)
            elif kind == "int":
                ints += [0, 0] if value is None else [1, int(value)]
            elif kind == "float":
                ints.append(0 if value is None else 1)
                floats.append(0.0 if value is None else float(value))
            elif kind == "mods":
                if value is None:
                    ints.append(-1)
                else:
                    ints.append(value.register())
                    value.pack_into(tensors, ints, floats)
            else:  # lists
                if value is None:
                    ints += [0, 0, 0]
                    tensors += [None] * len(BlockLists.TENSORS)
                else:
                    ints += [1, value.block_m, value.block_n]
                    tensors += value.tensors()
        return tensors, ints, floats

    @classmethod
    def unpack(
        cls, tensors: list[Tensor | None], ints: list[int], floats: list[float]
    ) -> MaskProgram:
        """The program :meth:`pack` was given."""
        tensor_it, int_it, float_it = iter(tensors), iter(ints), iter(floats)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            kind = f.metadata[_KIND]
            if kind == "tensor":
                values[f.name] = next(tensor_it)
            elif kind == "int":
                is_set, number = next(int_it), next(int_it)
                values[f.name] = number if is_set else None
            elif kind == "float":
                is_set, real = next(int_it), next(float_it)
                values[f.name] = real if is_set else None
            elif kind == "mods":
                from .modfn import CompiledMods

                registered = next(int_it)
                values[f.name] = (
                    None
                    if registered < 0
                    else CompiledMods.unpack_from(registered, tensor_it, int_it, float_it)
                )
            else:
                is_set, block_m, block_n = next(int_it), next(int_it), next(int_it)
                lists = [next(tensor_it) for _ in BlockLists.TENSORS]
                values[f.name] = (
                    BlockLists(block_m, block_n, *lists)  # type: ignore[arg-type]
                    if is_set
                    else None
                )
        return cls(**values)

    @classmethod
    def tensor_slot(cls, name: str) -> int:
        """Where the tensor field ``name`` sits in :meth:`pack`'s tensor list (the ops'
        backward returns a gradient there)."""
        slot = 0
        for f in dataclasses.fields(cls):
            if f.name == name:
                return slot
            kind = f.metadata[_KIND]
            slot += 1 if kind == "tensor" else len(BlockLists.TENSORS) if kind == "lists" else 0
        raise KeyError(name)

    def describe(self) -> str:
        """The terms in words (for error messages and ``explain``)."""
        terms = []
        if self.band_lo is not None or self.band_hi is not None:
            lo = "-inf" if self.band_lo is None else str(self.band_lo)
            hi = "+inf" if self.band_hi is None else str(self.band_hi)
            terms.append(f"band {lo} <= j - i <= {hi}")
        if self.q_doc is not None:
            terms.append("documents")
        if self.has_key_range:
            terms.append("key range kv_start[b] <= j < kv_end[b]")
        if self.alibi_slopes is not None:
            terms.append(f"ALiBi shifted by {self.alibi_shift}" if self.alibi_shift else "ALiBi")
        if self.softcap is not None:
            terms.append(f"soft-cap {self.softcap:g}")
        if self.blocks is not None:
            terms.append(f"block lists of {self.blocks.block_m}x{self.blocks.block_n}")
        if self.mods is not None:
            terms.append(self.mods.describe())
        return ", ".join(terms) if terms else "no mask"

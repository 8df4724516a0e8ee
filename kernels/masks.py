"""The launchers' view of a call's mask: a :class:`~.program.MaskProgram` made into the
kernels' record and features (band bounds, document ranges, key ranges, ALiBi and soft-cap
arguments, block lists, pages), and the launch order of programs."""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import triton
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .common import FP32_TINY, LOG2E
from .configs import LISTED_MASK_FORWARD_CONFIGS, tanh_mode
from .launch import launcher, launches_traceable
from .program import BlockLists, MaskProgram
from .record import MaskFeatures, MaskRecord, Pages, flat_kernel

if TYPE_CHECKING:
    from .modfn import CompiledMods

__all__ = [
    "LaunchMask",
    "alibi_score_offset",
    "alibi_sign",
    "late_cols_first",
    "late_rows_first",
    "launch_mask",
    "mod_block_lists",
    "with_mod_lists",
]


@dataclass(frozen=True, eq=False)
class LaunchMask:
    """A call's mask as the kernels take it (``record.py``): the runtime record and the
    compile-time features, with the block lists and generated functions they come from."""

    record: MaskRecord
    features: MaskFeatures
    blocks: BlockLists | None = None  # the block-list iteration source, if the program has one
    mods: CompiledMods | None = None  # generated mask and score functions

    def listed_mask_forward_configs(self) -> dict[tuple[int, int, int], Any] | None:
        """The forward's configs to prefer where block lists drive it and partial tiles
        evaluate generated mask functions (``None`` elsewhere)."""
        if self.blocks is None or self.mods is None or not self.mods.has_mask:
            return None
        return LISTED_MASK_FORWARD_CONFIGS

    def options(self, *, backward: bool, decode: bool = False) -> dict[str, Any]:
        """The ``tl.constexpr`` arguments of a kernel's flat form (:meth:`kernel`) for this
        mask: the features, and without generated functions the kernel's function
        parameters, ``None`` each (passed all the same: a traced launch takes every parameter
        explicitly; with them, :meth:`kernel` binds them)."""
        options = self.features.options()
        if self.mods is None:
            options["MASK_FN"] = None
            options["SCORE_GRAD_FN" if backward else "SCORE_FN"] = None
            if decode:
                options["HEADLESS_TILE_FN"] = None
        return options

    def param_grad_option(self) -> dict[str, Any]:
        """The dQ kernel's ``PARAM_GRAD_FN`` without generated functions (with them,
        :meth:`kernel` binds it)."""
        return {} if self.mods is not None else {"PARAM_GRAD_FN": None}

    def mod_args(self) -> list[Any]:
        """The runtime arguments in the place of a kernel's ``MOD`` parameter: ``None``, or
        the generated functions' flat arguments (for :meth:`kernel`)."""
        return [None] if self.mods is None else self.mods.args()

    def kernel(self, base: Any, extra: int = 0, *, param_grads: bool = False) -> Any:
        """``base`` in its flat form (:func:`~.record.flat_kernel`): the record's fields and
        the features as flat parameters, and with generated functions their flat arguments
        (and ``extra`` more after them: gradient buffers) with the functions bound to its
        ``MASK_FN``, ``SCORE_FN``, ``SCORE_GRAD_FN`` and (with ``param_grads``)
        ``PARAM_GRAD_FN`` parameters."""
        mods = self.mods
        if mods is None:
            return flat_kernel(base)
        return flat_kernel(base, len(mods.args()) + extra, mods.bound(param_grads))

    def tiles(self, block_m: int, block_n: int) -> tuple[int, int]:
        """A kernel's tile sizes ``(block_m, block_n)``, no larger than the list blocks they
        must divide (both are powers of two)."""
        if self.blocks is None:
            return block_m, block_n
        return min(block_m, self.blocks.block_m), min(block_n, self.blocks.block_n)

    def stages(self, num_stages: int) -> int:
        """A kernel's pipeline depth: at most 2 where generated functions read tensors (each
        stage would hold a tile of their gathered values too; the dQ kernel's 4 stages at head
        dim 128 asked for 288 KB of shared memory on an H100 with a T5 table)."""
        if self.mods is not None and self.mods.traced.params:
            return min(num_stages, 2)
        return num_stages


def _doc_ranges(sorted_ids: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each id of ``ids``, the positions ``[lo, hi)`` of that id in ``sorted_ids``."""
    lo = torch.searchsorted(sorted_ids, ids, side="left", out_int32=True)
    hi = torch.searchsorted(sorted_ids, ids, side="right", out_int32=True)
    return lo, hi


@dataclass
class _DocRanges:
    """Per query row and per key column, the range of positions of its document on the other
    side; ``None`` where not computed."""

    kv_doc: weakref.ref[Tensor] | None = None  # the key ids they were computed with, if cached
    versions: tuple[int, int] = (0, 0)  # the query and key ids' version counters at that time
    row_lo: Tensor | None = None  # (Bd, L) int32: first key of each query row's document
    row_hi: Tensor | None = None  # (Bd, L) int32: one past its last key
    col_lo: Tensor | None = None  # (Bd, S) int32: first query of each key column's document
    col_hi: Tensor | None = None  # (Bd, S) int32: one past its last query
    per_batch: bool = False  # False when one row of ids is shared by the whole batch

    def computed_from(self, q_doc: Tensor, kv_doc: Tensor) -> bool:
        """Whether these ranges belong to ``q_doc``/``kv_doc`` as they are now."""
        return (
            self.kv_doc is not None
            and self.kv_doc() is kv_doc
            and self.versions == (q_doc._version, kv_doc._version)
        )


# Eager calls with one bias pass the same id tensors every time (the biases keep their ids on
# the device), so the ranges are computed once per pair of id tensors, not on every call; they
# are dropped with the query ids, and recomputed if either tensor was modified in place.
_DOC_RANGES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _document_ranges(q_doc: Tensor, kv_doc: Tensor, *, rows: bool, cols: bool) -> _DocRanges:
    cacheable = not (launches_traceable() or torch.compiler.is_compiling())
    found: _DocRanges | None = _DOC_RANGES.get(q_doc) if cacheable else None
    if found is not None and found.computed_from(q_doc, kv_doc):
        ranges = found
    elif cacheable:
        ranges = _DocRanges(weakref.ref(kv_doc), (q_doc._version, kv_doc._version))
        _DOC_RANGES[q_doc] = ranges
        rows = cols = True  # both sides at once: the backward needs them all
    else:
        ranges = _DocRanges()
    if (rows and ranges.row_lo is None) or (cols and ranges.col_lo is None):
        q_ids = q_doc if q_doc.dim() == 2 else q_doc.unsqueeze(0)
        kv_ids = kv_doc if kv_doc.dim() == 2 else kv_doc.unsqueeze(0)
        nb = max(q_ids.shape[0], kv_ids.shape[0])
        q_ids = q_ids.to(torch.int64).expand(nb, q_ids.shape[1]).contiguous()
        kv_ids = kv_ids.to(torch.int64).expand(nb, kv_ids.shape[1]).contiguous()
        ranges.per_batch = nb > 1
        if rows and ranges.row_lo is None:
            ranges.row_lo, ranges.row_hi = _doc_ranges(kv_ids, q_ids)
        if cols and ranges.col_lo is None:
            ranges.col_lo, ranges.col_hi = _doc_ranges(q_ids, kv_ids)
    return ranges


def alibi_sign(program: MaskProgram, seq_q: int, seq_k: int) -> int:
    """``+1`` (``-1``) when every pair the band keeps has its ALiBi distance
    ``i + (S - L) + alibi_shift - j`` at least (at most) 0, else 0.

    The distance is ``(S - L + shift) - (j - i)``: one sign over the band (within the grid's
    ``1 - L <= j - i <= S - 1``) when the band lies on one side of ``j - i = S - L + shift``
    (causal attention does); its ``|.|`` is then the distance or its negation, which saves an
    instruction per score."""
    band_lo, band_hi = program.band_lo, program.band_hi
    lo = 1 - seq_q if band_lo is None else max(band_lo, 1 - seq_q)
    hi = seq_k - 1 if band_hi is None else min(band_hi, seq_k - 1)
    diagonal = seq_k - seq_q + (program.alibi_shift or 0)
    if hi <= diagonal:
        return 1
    if lo >= diagonal:
        return -1
    return 0


def alibi_score_offset(program: MaskProgram, seq_q: int, seq_k: int) -> Tensor | None:
    """What the kernels' scores of a shifted ALiBi add to the exact ones, ``(1 | B, Hq, 1)``
    float32 (natural log): ``slope * sign * alibi_shift`` on every pair of a row (``None``
    without a shift). The kernels' log-sum-exp is the exact one plus this."""
    slopes, shift = program.alibi_slopes, program.alibi_shift
    if slopes is None or not shift:
        return None
    sign = alibi_sign(program, seq_q, seq_k)
    slopes = slopes.float()
    return (slopes if slopes.dim() == 2 else slopes[None])[..., None] * float(sign * shift)


def launch_mask(
    q: Tensor,
    k: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    rows: bool,
    cols: bool,
    lists: bool = True,
    pages: Pages | None = None,
) -> LaunchMask:
    """The one place a :class:`~.program.MaskProgram` becomes the kernels' mask, for a call
    with ``q`` ``(B, Hq, L, E)`` and ``k`` ``(B, Hkv, S, E)``; ``rows`` / ``cols``: whether
    the kernels to launch need the document ranges per query row / per key column; ``lists``:
    whether they iterate the block lists of generated mask functions (the decode kernel
    does not); ``pages``: where the keys lie in a paged pool (the record holds its sizes;
    each launch gives its tables, :meth:`~.record.MaskRecord.values`)."""
    band_lo, band_hi = program.band_lo, program.band_hi
    q_doc, kv_doc = program.q_doc, program.kv_doc
    kv_start, kv_end = program.kv_start, program.kv_end
    alibi_slopes, softcap = program.alibi_slopes, program.softcap
    seq_q, seq_k = q.shape[2], k.shape[2]
    # Every pair has 1 - L <= j - i <= S - 1: a bound outside that range keeps everything and is
    # dropped; a bound beyond the other end keeps nothing and is clamped to stay in int32.
    has_lo = band_lo is not None and band_lo > 1 - seq_q
    has_hi = band_hi is not None and band_hi < seq_k - 1
    lo = min(int(band_lo), seq_k) if has_lo and band_lo is not None else 0
    hi = max(int(band_hi), -seq_q) if has_hi and band_hi is not None else 0

    row_lo = row_hi = col_lo = col_hi = None
    docs_per_batch = False
    if q_doc is not None and kv_doc is not None:
        docs = _document_ranges(q_doc, kv_doc, rows=rows, cols=cols)
        row_lo, row_hi, col_lo, col_hi = docs.row_lo, docs.row_hi, docs.col_lo, docs.col_hi
        docs_per_batch = docs.per_batch

    if (kv_start is None) != (kv_end is None):
        raise ValueError("kv_start and kv_end go together: pass both or neither")
    if kv_start is not None and kv_end is not None:
        batch = q.shape[0]
        kv_start = kv_start.to(device=q.device, dtype=torch.int32).expand(batch).contiguous()
        kv_end = kv_end.to(device=q.device, dtype=torch.int32).expand(batch).contiguous()

    slopes = None
    stride_sb = stride_sh = 0
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)
        if slopes.dim() == 1:
            stride_sh = slopes.stride(0)
        else:
            stride_sb = 0 if slopes.shape[0] == 1 else slopes.stride(0)
            stride_sh = slopes.stride(1)

    sign = 0 if alibi_slopes is None else alibi_sign(program, seq_q, seq_k)
    if program.alibi_shift and alibi_slopes is not None and sign == 0:
        raise ValueError(
            f"ALiBi shifted by {program.alibi_shift} runs in the kernels only where every kept "
            f"pair's distance has one sign ({program.describe()}, L={seq_q}, S={seq_k})"
        )

    qk_scale = scale * LOG2E
    if softcap is not None:
        softcap_in, softcap_out = scale / softcap, softcap * LOG2E
    else:
        softcap_in = softcap_out = 0.0
    record = MaskRecord(
        band_lo=lo,
        band_hi=hi,
        row_lo=row_lo,
        row_hi=row_hi,
        row_stride=seq_q if docs_per_batch else 0,
        col_lo=col_lo,
        col_hi=col_hi,
        col_stride=seq_k if docs_per_batch else 0,
        kv_start=kv_start,
        kv_end=kv_end,
        slopes=slopes,
        alibi_stride_b=stride_sb,
        alibi_stride_h=stride_sh,
        qk_scale=qk_scale,
        softcap_in=softcap_in,
        softcap_out=softcap_out,
        table_stride=0 if pages is None else pages.table.stride(0),
        kv_capacity=0 if pages is None else pages.table.shape[1] * pages.page_size,
        kv_pool=0 if pages is None else pages.num_pages,
    )
    features = MaskFeatures(
        has_lo=has_lo,
        has_hi=has_hi,
        has_docs=row_lo is not None or col_lo is not None,
        has_kv_range=kv_start is not None,
        has_alibi=slopes is not None,
        alibi_sign=sign,
        has_softcap=softcap is not None,
        tanh_mode=tanh_mode(q),
        positive_scale=qk_scale >= FP32_TINY,
        page=0 if pages is None else pages.page_size,
        ragged_queries=pages is not None and pages.query_starts is not None,
    )
    blocks = program.blocks
    mods = program.mods
    if lists and blocks is None and mods is not None and mods.has_mask:
        blocks = _mod_block_lists(q, k, program, mods, record, features)
    if blocks is not None:
        for name, size in (("block_m", blocks.block_m), ("block_n", blocks.block_n)):
            if size < 16 or size & (size - 1):
                raise ValueError(
                    f"BlockLists {name}={size}: list blocks are powers of two of at least 16 "
                    f"(the kernels' tiles divide them)"
                )
        record = dataclasses.replace(record, kv_lists=blocks.kv_lists, q_lists=blocks.q_lists)
        features = dataclasses.replace(
            features,
            has_block_lists=True,
            lists_per_batch=blocks.per_batch,
            lists_per_head=blocks.per_head,
            sparse_m=blocks.block_m,
            sparse_n=blocks.block_n,
        )
    return LaunchMask(record, features, blocks, mods)


# The block lists of a program's mask functions, per program and block size, with what they
# were built from: a repeated call with the same program (the plan cache keeps it) reuses them
# unless a tensor they read was written since (its version counter moved).
_MOD_LISTS: weakref.WeakKeyDictionary[
    MaskProgram, dict[tuple[int, int], tuple[tuple[object, ...], BlockLists]]
] = weakref.WeakKeyDictionary()


def with_mod_lists(q: Tensor, k: Tensor, program: MaskProgram) -> MaskProgram:
    """``program`` with the block lists of its mask functions in it (unchanged when it has
    none or holds lists already), for launches that would each build them."""
    if program.blocks is not None or program.mods is None or not program.mods.has_mask:
        return program
    blocks = launch_mask(q, k, program, scale=1.0, rows=True, cols=False).blocks
    return program.replace(blocks=blocks)


def visited_keys_per_row(q: Tensor, k: Tensor, program: MaskProgram) -> float:
    """The mean number of keys that the block lists of ``program``'s mask functions visit per
    block of query rows (partial and full blocks, times their width), over the list rows: the
    reach of the mask. The lists are the kernels' own (built once and kept); reading the counts
    is a host synchronisation. The program must have mask functions."""
    blocks = with_mod_lists(q, k, program).blocks
    if blocks is None:
        raise ValueError(f"visited_keys_per_row: {program.describe()} has no mask function")
    partial, full, _ = blocks.counts()
    rows = math.prod(blocks.kv_lists.shape[:3])  # (Bl, Hl, Mb): the list rows
    return (partial + full) * blocks.block_n / max(rows, 1)


def mod_block_lists(
    q: Tensor, k: Tensor, program: MaskProgram, block_m: int, block_n: int
) -> BlockLists:
    """The block lists of every mask term of ``program`` (band, documents, key range and its
    generated mask functions) at blocks of ``block_m x block_n``, for a call with ``q``
    ``(B, Hq, L, E)`` and ``k`` ``(B, Hkv, S, E)``: another kernel's block size (FlashAttention
    4's tiles) with the same machinery as :func:`launch_mask`'s lists. The program must have
    mask functions."""
    mods = program.mods
    if mods is None or not mods.has_mask:
        raise ValueError(f"mod_block_lists: {program.describe()} has no generated mask function")
    mask = launch_mask(q, k, program, scale=1.0, rows=True, cols=False, lists=False)
    return _mod_block_lists(q, k, program, mods, mask.record, mask.features, (block_m, block_n))


def list_block_sizes() -> tuple[int, int]:
    """The blocks of the lists built from mask functions: 128 x 128 (the kernels' largest
    tiles), 16 x 16 under the interpreter (its tiles)."""
    from .limits import interpreting

    return (16, 16) if interpreting() else (128, 128)


def _mod_block_lists(
    q: Tensor,
    k: Tensor,
    program: MaskProgram,
    mods: CompiledMods,
    record: MaskRecord,
    features: MaskFeatures,
    block: tuple[int, int] | None = None,
) -> BlockLists:
    """The block lists of every mask term of the call at once (band, documents, key range and
    the generated mask functions), from one program per block evaluating the mask: no
    ``L x S`` tensor, no host synchronisation. Lists are per batch row when a term differs
    between rows, per head when a mask function reads ``h``. ``record``, ``features``: the
    call's mask without lists. ``block``: ``(block_m, block_n)``, by default
    :func:`list_block_sizes`."""
    from .blocks import _classify_blocks, block_lists_on_device

    row_lo, row_hi = record.row_lo, record.row_hi
    kv_start, kv_end = record.kv_start, record.kv_end

    batch, heads, seq_q, _ = q.shape
    seq_k = k.shape[2]
    reads = mods.traced.reads()
    rows = batch if ("b" in reads or record.row_stride or kv_start is not None) else 1
    list_heads = heads if "h" in reads else 1
    block_m, block_n = list_block_sizes() if block is None else block
    read = [t for t in (*mods.traced.params, row_lo, row_hi, kv_start, kv_end) if t is not None]
    key = (
        batch, heads, seq_q, seq_k, q.device, block_m, block_n,
        tuple((id(t), t._version) for t in read),
    )  # fmt: skip
    cacheable = not (
        launches_traceable()
        or torch.compiler.is_compiling()
        or (q.is_cuda and torch.cuda.is_current_stream_capturing())
    )
    if cacheable:
        found = _MOD_LISTS.get(program, {}).get((block_m, block_n))
        if found is not None and found[0] == key:
            return found[1]
    grid = (triton.cdiv(seq_q, block_m), triton.cdiv(seq_k, block_n), rows * list_heads)
    states = torch.empty((rows, list_heads, grid[0], grid[1]), dtype=torch.int8, device=q.device)
    args = mods.args()
    kernel = flat_kernel(_classify_blocks, len(args), mods.bound(False))
    launcher(kernel)[grid](
        states, *record.values(), list_heads, seq_q, seq_k, *args,
        **features.options(), BLOCK_M=block_m, BLOCK_N=block_n, ROWS=min(block_m, 32),
    )  # fmt: skip
    # kept lists: allocated where no CUDA graph writes (pools.outside_pools)
    lists = block_lists_on_device(states, block_m, block_n, kept=cacheable)
    if cacheable:
        _MOD_LISTS.setdefault(program, {})[block_m, block_n] = (key, lists)
    return lists


def _late_first(rows: int, cols: int, lo: int | None, hi: int | None) -> bool:
    """Whether a band gives late rows more columns than early ones, so that launching their
    programs first (longest first) leaves the short ones for the last wave.

    Row ``r`` keeps columns ``[max(0, r + lo), min(cols - 1, r + hi)]`` (``None``: open): the
    band cuts rows short at the start (``r < -lo``) and at the end (``r > cols - 1 - hi``);
    launch late rows first when more rows are cut short at the start. Documents are not known
    on the host and are left out.
    """
    if lo is None:
        return hi is not None  # rows keep [0, r + hi]: more for later rows
    if hi is None:
        return False  # rows keep [r + lo, cols): fewer for later rows
    return min(max(-lo, 0), rows) > min(max(rows - cols + hi, 0), rows)


def _band(mask: LaunchMask) -> tuple[int | None, int | None]:
    """The mask's band bounds, ``None`` where open."""
    record, features = mask.record, mask.features
    return (
        record.band_lo if features.has_lo else None,
        record.band_hi if features.has_hi else None,
    )


def late_rows_first(seq_q: int, seq_k: int, mask: LaunchMask) -> bool:
    """:func:`_late_first` for query rows (forward and dQ programs)."""
    lo, hi = _band(mask)
    return _late_first(seq_q, seq_k, lo, hi)


def late_cols_first(seq_q: int, seq_k: int, mask: LaunchMask) -> bool:
    """:func:`_late_first` for key columns (dK/dV programs): column ``j`` is kept by rows
    ``[j - hi, j - lo]``, the band mirrored."""
    lo, hi = _band(mask)
    return _late_first(seq_k, seq_q, None if hi is None else -hi, None if lo is None else -lo)

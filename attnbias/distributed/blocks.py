"""Where a bias keeps pairs, at the granularity of blocks of positions: the key/value blocks
each rank needs, the work of each chunk of queries, and the layout that balances it.

The *keep grid* of a call ``(B, Hq, L, S)`` at grains ``(gq, gk)`` is a bool ``(L / gq, S /
gk)``: whether the block of queries ``[m gq, (m + 1) gq)`` and keys ``[n gk, (n + 1) gk)`` may
keep a pair, for some batch row and head. It is never wrong by leaving out a block that keeps
a pair (a kept pair is in a kept block): bands, documents and key ranges give it by arithmetic
per block; mask functions (``ModBias``) and materialized parts are evaluated on slices of rows.
Every rank works it out alike from the same bias, so the ranks agree on who sends what without
telling each other.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from attnbias.biases import AttnBias, ModBias
from attnbias.spec import lower
from attnbias.terms import Block, Call

from .layouts import Layout

V = TypeVar("V")

__all__ = [
    "Costs",
    "Kept",
    "balanced_layout",
    "candidate_layouts",
    "document_layout",
    "grain",
    "keep_grid",
    "layout_costs",
]

#: The largest block of positions the grid is kept at: small enough that the key/value
#: positions a rank receives are within a few percent of the kept ones for windows of
#: thousands, large enough that a 512k-long call's grid stays a few million flags.
GRAIN = 256

#: The most elements of one slice of a materialized part's keep-mask evaluated at once.
_SLICE_ELEMENTS = 1 << 26

#: Chunks per rank of the balanced layouts tried by ``layout="auto"``.
BALANCED_CHUNKS = (4,)


def grain(length: int, pieces: int) -> int:
    """The grid's block length along a sequence of ``length`` cut into ``pieces`` chunks: the
    largest divisor of the chunk length up to :data:`GRAIN`, so that blocks never straddle
    two chunks."""
    chunk = length // pieces
    for size in range(min(GRAIN, chunk), 0, -1):
        if chunk % size == 0:
            return size
    return 1


# -- the grid ------------------------------------------------------------------------------


class Kept(Generic[V]):
    """What was worked out for a class of calls, by key, the oldest dropped past ``size``."""

    def __init__(self, size: int) -> None:
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: Hashable, value: V) -> V:
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


_GRIDS: Kept[Tensor] = Kept(16)


def keep_grid(bias: AttnBias | None, call: Call, grain_q: int, grain_kv: int) -> Tensor:
    """The keep grid of ``bias`` for ``call`` (bool ``(L / grain_q, S / grain_kv)``, on the
    CPU). Kept per bias (by its plan-cache key, when it has one), call and grains."""
    blocks_q, blocks_kv = call.length_q // grain_q, call.length_kv // grain_kv
    if bias is None:
        return torch.ones(blocks_q, blocks_kv, dtype=torch.bool)
    identity = bias.cache_key()
    if identity is None:
        return _grid(bias, call, grain_q, grain_kv).cpu()
    key = (identity, call.batch, call.heads, call.length_q, call.length_kv, str(call.device),
           grain_q, grain_kv)  # fmt: skip
    found = _GRIDS.get(key)
    if found is None:
        found = _GRIDS.put(key, _grid(bias, call, grain_q, grain_kv).cpu())
    return found


def _grid(bias: AttnBias, call: Call, grain_q: int, grain_kv: int) -> Tensor:
    length_q, length_kv, device = call.length_q, call.length_kv, call.device
    terms = lower(bias, length_q, length_kv, device, batch=call.batch, heads=call.heads)
    first_q = torch.arange(0, length_q, grain_q, device=device)
    first_kv = torch.arange(0, length_kv, grain_kv, device=device)
    # the diagonals j - i a block spans
    low = first_kv[None, :] - (first_q[:, None] + grain_q - 1)
    high = first_kv[None, :] + grain_kv - 1 - first_q[:, None]
    keep = torch.ones(low.shape, dtype=torch.bool, device=device)
    if terms.band_lo is not None:
        keep &= high >= terms.band_lo
    if terms.band_hi is not None:
        keep &= low <= terms.band_hi
    rows = keep[None]  # (1 or B, L / gq, S / gk): per batch row where the terms differ
    if terms.q_doc is not None and terms.kv_doc is not None:
        # ids do not decrease: a block's ids lie between its first and its last
        q_doc, kv_doc = terms.q_doc.to(device), terms.kv_doc.to(device)
        q_first, q_last = q_doc[:, ::grain_q], q_doc[:, grain_q - 1 :: grain_q]
        kv_first, kv_last = kv_doc[:, ::grain_kv], kv_doc[:, grain_kv - 1 :: grain_kv]
        rows = rows & (
            (q_first[:, :, None] <= kv_last[:, None, :])
            & (kv_first[:, None, :] <= q_last[:, :, None])
        )
    if terms.kv_start is not None and terms.kv_end is not None:
        start = terms.kv_start.to(device=device, dtype=torch.int64)[:, None]
        end = terms.kv_end.to(device=device, dtype=torch.int64).clamp(max=length_kv)[:, None]
        inside = torch.maximum(start, first_kv[None]) < torch.minimum(
            end, first_kv[None] + grain_kv
        )
        rows = rows & inside[:, None, :]
    for part in (*terms.mods, *terms.others):
        if isinstance(part, AttnBias):
            rows = rows & _evaluated(part, call, grain_q, grain_kv)
    return rows.any(0)


def _evaluated(part: AttnBias, call: Call, grain_q: int, grain_kv: int) -> Tensor:
    """The keep grid of one part with no arithmetic form (``(1 or B, L / gq, S / gk)``): its
    keep-mask on slices of rows, reduced over the heads and over each block."""
    batch, heads = call.batch_size, call.heads
    length_q, length_kv = call.length_q, call.length_kv
    per_row = max(batch * heads * length_kv, 1)
    rows = max(grain_q, (_SLICE_ELEMENTS // per_row) // grain_q * grain_q)
    slices = []
    for start in range(0, length_q, rows):
        count = min(rows, length_q - start)
        shape = (batch, heads, count, length_kv)
        if isinstance(part, ModBias):
            keep = part.keep_rows(call.device, shape, start)
        else:
            sub = part.sub_block(call, Block(start, 0, count, length_kv))
            keep = sub.masked(call.device, shape, torch.float32).keep
        if keep is None:
            keep = torch.ones((), dtype=torch.bool, device=call.device)
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        keep = keep.expand(keep.shape[0], keep.shape[1], count, length_kv).any(1)
        slices.append(
            keep.reshape(keep.shape[0], count // grain_q, grain_q, length_kv // grain_kv, grain_kv)
            .any(4)
            .any(2)
        )
    return torch.cat(slices, 1)


# -- work per chunk, and the balanced layout -------------------------------------------------


@dataclass(frozen=True)
class Costs:
    """The predicted work of a call split by a layout: per rank, the blocks of kept pairs its
    queries run, the key/value blocks it receives, and the time both take at the given
    seconds per block."""

    layout: Layout
    compute: tuple[int, ...]  # kept blocks of the grid per rank
    received: tuple[int, ...]  # key/value blocks received per rank
    seconds: tuple[float, ...]  # predicted time per rank


def layout_costs(
    grid: Tensor, layout: Layout, block_seconds: float, transfer_seconds: float
) -> Costs:
    """The costs of ``layout`` from the keep grid (its blocks must not straddle the layout's
    chunks): a rank computes the kept blocks of its query chunks and receives the key blocks
    of other ranks that some of them keep; transfers overlap the computation, so a rank takes
    the longer of the two."""
    world, pieces = layout.world, layout.pieces
    rows = grid.reshape(pieces, grid.shape[0] // pieces, pieces, grid.shape[1] // pieces)
    per_chunk = rows.sum(dim=(1, 3))  # (query chunk, key chunk) kept blocks
    columns = rows.any(1)  # (query chunk, key chunk, key block of the chunk)
    compute, received, seconds = [], [], []
    for rank in range(world):
        # index_select, not a list index: advanced indexing of a CPU tensor costs
        # milliseconds where several processes share the cores
        held = set(layout.chunks[rank])
        mine = torch.tensor(layout.chunks[rank], dtype=torch.int64)
        others = torch.tensor([c for c in range(pieces) if c not in held], dtype=torch.int64)
        work = int(per_chunk.index_select(0, mine).sum())
        needed = 0
        if others.numel():
            needed = int(columns.index_select(0, mine).index_select(1, others).any(0).sum())
        compute.append(work)
        received.append(needed)
        seconds.append(max(work * block_seconds, needed * transfer_seconds))
    return Costs(layout, tuple(compute), tuple(received), tuple(seconds))


def balanced_layout(grid: Tensor, world: int, per_rank: int) -> Layout:
    """Chunks of ``per_rank`` per rank assigned by their work (greedy, heaviest first, each to
    the least loaded rank that has room); a rank's chunks in sequence order."""
    pieces = world * per_rank
    rows = grid.reshape(pieces, grid.shape[0] // pieces, grid.shape[1]).sum(dim=(1, 2))
    work = rows.tolist()
    order = sorted(range(pieces), key=lambda c: (-work[c], c))
    heap = [(0, rank) for rank in range(world)]
    held: list[list[int]] = [[] for _ in range(world)]
    for chunk in order:
        waiting = []
        while True:
            load, rank = heapq.heappop(heap)
            if len(held[rank]) < per_rank:
                break
            waiting.append((load, rank))
        held[rank].append(chunk)
        heapq.heappush(heap, (load + work[chunk], rank))
        for entry in waiting:
            heapq.heappush(heap, entry)
    return Layout(tuple(tuple(sorted(chunks)) for chunks in held), f"balanced-{per_rank}")


def layout_candidates(length_q: int, length_kv: int, world: int) -> tuple[int, list[int]]:
    """The finest chunking every candidate layout's chunks are made of (chunks of the whole
    sequence), and the chunks per rank of the balanced layouts that fit both lengths."""
    fits = [k for k in (1, 2, *BALANCED_CHUNKS) if length_q % (k * world) == 0
            and length_kv % (k * world) == 0]  # fmt: skip
    finest = world * math.lcm(*fits) if fits else world
    return finest, [k for k in BALANCED_CHUNKS if k in fits]


def document_layout(bias: AttnBias | None, call: Call, world: int) -> Layout | None:
    """:meth:`Layout.documents` for the documents ``bias`` packs in ``call`` (self-attention:
    the same ids for queries and keys, shared by the batch), or ``None`` where it has none or
    a document's length is not a multiple of ``2W``. Reads the ids on the host."""
    if bias is None or call.length_q != call.length_kv:
        return None
    terms = lower(bias, call.length_q, call.length_kv, call.device, batch=None, heads=1)
    q_doc, kv_doc = terms.q_doc, terms.kv_doc
    if q_doc is None or kv_doc is None:
        return None
    q_doc, kv_doc = q_doc.reshape(-1, q_doc.shape[-1]), kv_doc.reshape(-1, kv_doc.shape[-1])
    if q_doc.shape[0] != 1 or kv_doc.shape[0] != 1 or not torch.equal(q_doc, kv_doc):
        return None
    lengths = torch.unique_consecutive(q_doc[0].cpu(), return_counts=True)[1].tolist()
    if any(n % (2 * world) for n in lengths):
        return None
    return Layout.documents(lengths, world)


def candidate_layouts(bias: AttnBias | None, call: Call, world: int) -> list[Layout]:
    """The layouts ``layout="auto"`` weighs for ``bias`` over ``call``: contiguous, zigzag,
    the balanced assignments of :data:`BALANCED_CHUNKS` chunks a rank (by the kept blocks of
    each chunk), and for packed documents head-tail within each (:func:`document_layout`),
    those that split both lengths."""
    finest, balanced = layout_candidates(call.length_q, call.length_kv, world)
    candidates = []
    for layout in (Layout.contiguous(world), Layout.zigzag(world)):
        if call.length_q % layout.pieces == 0 and call.length_kv % layout.pieces == 0:
            candidates.append(layout)
    if balanced:
        grid = keep_grid(bias, call, grain(call.length_q, finest), grain(call.length_kv, finest))
        candidates += [balanced_layout(grid, world, per_rank) for per_rank in balanced]
    documents = document_layout(bias, call, world)
    if documents is not None:
        candidates.append(documents)
    return candidates

"""Attention over a paged key/value cache (:class:`~attnbias.biases.paged.PagedKV`).

The pages of each row are gathered on the device into a contiguous ``(B, Hkv, S, E)`` cache
with the row's tokens at its end (``S = max_pages * page_size``), and the call runs as any
other with a :class:`~attnbias.KeyRangeBias` keeping each row's keys: aligned at the end, the
built-ins that measure from the last key (``causal_lower_right()``, windows, ALiBi) read each
row's own positions, and a ``ModBias`` reads them through per-row offsets. Ragged queries
(``cu_seqlens_q``) are placed the same way, each row's at the end of a ``(B, Hq, total, E)``
query (queries past the last row, a padded step's, are not placed: their outputs are zeros).
No host synchronisation per call: the tables are read on the device, and their
problems are flagged there and read at the next eager call (on the CPU, checked before
anything runs).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnbias.biases import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    parts_of,
)
from attnbias.biases.mod import reindexed
from attnbias.biases.paged import PagedKV, check_layout, row_queries
from attnbias.kernels.decode import MIN_ROWS
from attnbias.kernels.forward import reads_pages, stand_in
from attnbias.kernels.limits import MAX_DECODE_QUERIES, interpreting
from attnbias.kernels.ragged import place_ragged, take_placed
from attnbias.kernels.record import Pages

__all__ = ["check_pending", "gathered_pages", "paged_explain", "paged_sdpa"]

# the parts that align per row when each row's keys end the gathered cache (a ModBias reads
# its row's own positions through per-row offsets: _in_row)
_ALIGNED = (CausalBias, SlidingWindowBias, AlibiBias, SoftcapBias, ModBias)

# Set by gathered_pages(): the calls in its context read the pages gathered into a contiguous
# cache, neither a kernel over the pages nor FlashAttention 4's paged forward.
_GATHER_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "attnbias_paged_gather_only", default=False
)

# The problems found on a GPU by earlier calls, copied to pinned host memory without waiting:
# (host flags, the copy's event, the call in words), read once the copy is done
_PENDING: list[tuple[Tensor, Any, str]] = []
_PENDING_LOCK = threading.Lock()
# Moved each time a problem is raised: the tables a bias last checked are then checked again at
# its next call (a call that goes on with tables found bad raises again).
_RAISED = [0]


def _split(attn_mask: AttnBias) -> tuple[PagedKV, tuple[AttnBias, ...]]:
    pages = [p for p in parts_of(attn_mask) if isinstance(p, PagedKV)]
    rest = tuple(p for p in parts_of(attn_mask) if not isinstance(p, PagedKV))
    if len(pages) != 1:
        raise ValueError(f"a bias can hold at most one PagedKV, got {len(pages)}")
    for part in rest:
        if not isinstance(part, _ALIGNED):
            raise ValueError(
                f"PagedKV composes with causal_lower_right(), SlidingWindowBias, AlibiBias, "
                f"SoftcapBias (which align per row at its last key) and ModBias (which reads "
                f"each row's own positions); got {part!r}. A BandBias (measured from the first "
                f"query and key), documents, key ranges and tensor masks over a paged cache are "
                f"not supported yet"
            )
        if isinstance(part, CausalBias) and (
            part.variant is CausalVariant.UPPER_LEFT
            or part.seq_len_q is not None
            or part.seq_len_kv is not None
        ):
            raise ValueError(
                f"PagedKV takes causal_lower_right() without lengths (each row's queries end at "
                f"its last key), got {part!r}; causal_upper_left() has no meaning for a cache"
            )
    return pages[0], rest


def _problems(pages: PagedKV, num_pages: int, page_size: int, query: Tensor) -> Tensor:
    """``(5,)`` bool on the device: a page index out of the pool among the pages a row reads,
    a length beyond the row's pages, more queries than tokens, ragged query offsets that end
    past the query's length, a row with more queries than ``max_seqlen_q``."""
    queries = row_queries(pages, query)
    table, lens = pages.block_table, pages.seq_lens.long()
    capacity = table.shape[1] * page_size
    slots = torch.arange(table.shape[1], device=table.device)[None, :] * page_size
    read = slots < lens[:, None]
    outside = (read & ((table < 0) | (table >= num_pages))).any()
    cu = pages.cu_seqlens_q
    ragged = torch.zeros((), dtype=torch.bool, device=table.device)
    if cu is not None:
        ragged = cu[-1] > query.shape[2]
    longer = torch.zeros((), dtype=torch.bool, device=table.device)
    if pages.max_seqlen_q is not None:
        longer = (queries > pages.max_seqlen_q).any()
    return torch.stack(
        (outside, (lens > capacity).any(), (queries.long() > lens).any(), ragged, longer)
    )  # fmt: skip


_PROBLEMS = (
    "reads a page index outside the pools",
    "has a seq_lens beyond its block_table row's pages",
    "has more queries than tokens (the queries are the row's last tokens, already written)",
    "has cu_seqlens_q that ends past the query's length",
    "has more queries than max_seqlen_q",
)


def _raise_problems(flags: Tensor, said: str, when: str) -> None:
    found = flags.tolist()
    if any(found):
        _RAISED[0] += 1
        named = "; ".join(text for text, bad in zip(_PROBLEMS, found, strict=True) if bad)
        raise ValueError(
            f"{said}{when}: a row {named}. Call PagedKV.validate(key, value, query) to find the "
            f"row and the values"
        )


def check_pending(*, wait: bool = False) -> None:
    """Read the problems that earlier paged calls found on the device and raise the first,
    naming the call: those whose copy to the host is done (no synchronisation), or all of
    them with ``wait``."""
    done: list[tuple[Tensor, Any, str]] = []
    waiting: list[tuple[Tensor, Any, str]] = []
    with _PENDING_LOCK:
        for entry in _PENDING:  # (sorted by identity: entries hold tensors, whose == is not)
            (done if wait or entry[1].query() else waiting).append(entry)
        _PENDING[:] = waiting
    for host, event, said in done:
        event.synchronize()
        _raise_problems(host, said, " (an earlier call: its output is not to be trusted)")


def _in_row(part: ModBias, key_starts: Tensor, query_starts: Tensor) -> ModBias:
    """``part``'s functions reading each row's own positions in the gathered call, as
    FlexAttention's paged attention gives them: ``kv_idx`` the key's position in its row
    (``kv_idx - key_starts[b]``; negative where the gather starts inside the row), ``q_idx``
    the query's index among its row's queries (``q_idx - query_starts[b]``). Both offsets are
    ``(B,)`` int32 tensors written in place at each call (read by the generated code there);
    positions before a row's start, kept out by its key range or dropped from the output, read
    as 0."""
    return reindexed(
        part,
        "[in its row]",
        query=lambda b, q_idx: (q_idx - query_starts[b]).clamp(min=0),
        key=lambda b, kv_idx: (kv_idx - key_starts[b]).clamp(min=0),
    )


def _kept_layout(
    pages: PagedKV, rest: tuple[AttnBias, ...], batch: int, keys: int, device: torch.device
) -> tuple[AttnBias, tuple[Tensor, Tensor, Tensor], dict[Any, Any]]:
    """The bias of the gathered call (each row's key range, then the other parts, a ModBias
    reading its row's positions), the ``(B,)`` int32 tensors it reads, written in place at
    each call (the key range's starts, the offsets of the rows' keys and of their queries),
    and the kernels' runs over the pages made for it (:func:`_reader`). One object per sum
    and layout, so that the plan cache serves the calls after the first."""
    key = (tuple(id(p) for p in rest), batch, keys, device)
    found = pages._kept.get(key)
    if found is None:
        starts, key_offsets, query_offsets = (
            torch.zeros(batch, dtype=torch.int32, device=device) for _ in range(3)
        )
        bias: AttnBias = KeyRangeBias(start=starts, end=None)
        for part in rest:
            if isinstance(part, ModBias):
                part = _in_row(part, key_offsets, query_offsets)
            bias = bias + part
        # the parts held with it: their ids in the key stay theirs
        found = (rest, bias, (starts, key_offsets, query_offsets), {})
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            # (made while capturing, the zeros are written when that graph is replayed only)
            pages._kept.put(key, found)
    return found[1], found[2], found[3]


def reach(rest: tuple[AttnBias, ...], length_q: int) -> int | None:
    """How many of each row's last tokens a call of ``length_q`` queries can keep: its
    queries' span and the narrowest sliding window's left side (``None``: every token)."""
    windows = [
        p.window_left
        for p in rest
        if isinstance(p, SlidingWindowBias) and p.window_left is not None
    ]
    return None if not windows else length_q + min(windows)


def _token_rows(table: Tensor, lens: Tensor, page_size: int, keys: int, pages: int) -> Tensor:
    """``(B, keys)`` int64: the pool row (page times page size plus slot) of each gathered
    position, row ``b``'s last ``keys`` tokens with its last token last; positions before a
    row's first token read that token (kept out by the key range). Page indices are clamped
    into the pool (a bad one is flagged, never read out of bounds)."""
    capacity = table.shape[1] * page_size
    positions = torch.arange(keys, device=table.device)
    token = (positions[None, :] - (keys - lens.long())[:, None]).clamp(0, capacity - 1)
    page = table.long().gather(1, token // page_size).clamp(0, pages - 1)
    return page * page_size + token % page_size


def _rows(layout: Pages) -> Tensor:
    """:func:`_token_rows` of a layout."""
    return _token_rows(
        layout.table, layout.seq_lens, layout.page_size, layout.keys, layout.num_pages
    )


def _gathered(pool: Tensor, rows: Tensor) -> Tensor:
    """``(B, Hkv, keys, E)``, a view of the ``(B, keys, Hkv, E)`` gather of ``rows``."""
    return pool.reshape(-1, *pool.shape[2:])[rows].transpose(1, 2)


def placed_length(pages: PagedKV, query: Tensor) -> int:
    """The queries each row runs at on the library's kernels: the query's length, for ragged
    rows ``max_seqlen_q`` where given (at most the packed total), else the packed total."""
    total = query.shape[2]
    if pages.cu_seqlens_q is None or pages.max_seqlen_q is None:
        return total
    return max(1, min(total, pages.max_seqlen_q))


def _places_by_kernel(query: Tensor) -> bool:
    """Whether ragged rows are placed by :func:`~attnbias.kernels.ragged.place_ragged`: on a
    GPU and under Triton's interpreter, for a query whose last dim is contiguous, outside
    ``torch.compile`` tracing."""
    return (
        (query.is_cuda or interpreting())
        and query.stride(3) == 1
        and not torch.compiler.is_compiling()
    )


def _placed(pages: PagedKV, query: Tensor) -> tuple[Tensor, Tensor | None]:
    """The query as ``(B, Hq, L, E)``: itself, or for ragged rows each row's queries at the
    end of a ``(B, Hq, placed_length, E)`` query (zeros before them), with the flat
    ``(B * Hq * L)`` position of each packed query and head there, int64 ``(total, Hq)`` (to
    read the output back; -1 for a query past the last row, not placed). On a GPU (and under
    Triton's interpreter) one launch places them (:func:`attnbias.kernels.ragged.place_ragged`);
    elsewhere, and while ``torch.compile`` traces, tensor operations."""
    cu = pages.cu_seqlens_q
    if cu is None:
        return query, None
    total, length = query.shape[2], placed_length(pages, query)
    batch, heads = pages.batch_size, query.shape[1]
    if _places_by_kernel(query):
        return place_ragged(query, cu, batch, length)
    flat = torch.arange(total, device=query.device)
    row = torch.searchsorted(cu[1:].long(), flat, right=True).clamp(max=batch - 1)
    in_row = flat < cu[-1]  # (a padded step's queries past the last row: not placed)
    count = (cu[1:] - cu[:-1]).long()
    place = length - count[row] + (flat - cu[:-1].long()[row])
    place = place.clamp(0, length - 1)  # (a row past the bound is flagged, not read right)
    placed = query.new_zeros(batch, heads, length, query.shape[3])
    # summed in: a query of no row adds zeros to the last row's last place, read as it is
    values = torch.where(in_row[:, None, None], query[0].transpose(0, 1), 0)
    placed.transpose(1, 2).index_put_((row, place), values, accumulate=True)
    head = torch.arange(heads, device=query.device)
    where = ((row * heads)[:, None] + head) * length + place[:, None]
    return placed, torch.where(in_row[:, None], where, -1)


def _taken(out: Tensor, where: Tensor) -> Tensor:
    """The packed ``(1, Hq, total, Ev)`` output of a ragged call from the placed call's ``(B,
    Hq, L, Ev)`` output and :func:`_placed`'s ``where`` (zeros for the queries of no row)."""
    if _places_by_kernel(out):
        taken = take_placed(out, where)
    else:
        rows = out.reshape(-1, out.shape[3])[where.clamp(min=0)]
        taken = torch.where((where >= 0)[..., None], rows, 0)
    return taken.transpose(0, 1).unsqueeze(0)


def _tables_state(
    pages: PagedKV, num_pages: int, page_size: int, query: Tensor
) -> tuple[int, ...] | None:
    """What the check of a call's table values depends on: the pools' ``(num_pages,
    page_size)``, the query's length, and the tables as they are now (their version
    counters, which every in-place write through PyTorch moves); ``None`` where that cannot be
    told (inference tensors count no versions)."""
    tables: tuple[Tensor, ...] = (pages.block_table, pages.seq_lens)
    if pages.cu_seqlens_q is not None:
        tables += (pages.cu_seqlens_q,)
    if any(t.is_inference() for t in tables):
        return None
    return (_RAISED[0], num_pages, page_size, query.shape[2], *(t._version for t in tables))


def _checked(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: AttnBias, is_causal: bool
) -> tuple[PagedKV, tuple[AttnBias, ...], int, int]:
    """The call's :class:`PagedKV`, its other parts and the pools' ``(num_pages,
    page_size)``, after the checks every paged call makes (the tables' values: on the CPU at
    once, on a GPU flagged on the device and read at a later eager call; once per state of
    the tables (:func:`_tables_state`): the layers of a model's step share them)."""
    pages, rest = _split(attn_mask)
    if is_causal:
        raise ValueError(
            "is_causal=True adds an upper-left causal mask, which has no meaning for a paged "
            "cache; add causal_lower_right() to the bias instead"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError(
            "attention over a PagedKV cache is forward only; run it under torch.no_grad() or "
            "torch.inference_mode(), or detach the inputs"
        )
    num_pages, page_size = check_layout(pages, key, value, query)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} and "
            f"{value.dtype}"
        )
    compiling = torch.compiler.is_compiling()
    if query.device.type != "cpu" and (compiling or torch.cuda.is_current_stream_capturing()):
        # (not while captured: a graph's replays could not report what they find)
        return pages, rest, num_pages, page_size
    state = None if compiling else _tables_state(pages, num_pages, page_size, query)
    if state is not None and pages._checked[0] == state:  # checked as they are
        return pages, rest, num_pages, page_size
    said = f"attention over {pages!r} with pools {tuple(key.shape)}"
    if query.device.type == "cpu":
        _raise_problems(_problems(pages, num_pages, page_size, query), said, "")
    else:
        flags = _problems(pages, num_pages, page_size, query)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        with _PENDING_LOCK:
            _PENDING.append((host, event, said))
    pages._checked[0] = state
    return pages, rest, num_pages, page_size


def _prepare(
    query: Tensor, pages: PagedKV, rest: tuple[AttnBias, ...], num_pages: int, page_size: int
) -> tuple[Tensor, Pages, AttnBias, Tensor | None, dict[Any, Any]]:
    """The call on a contiguous cache: the query placed (ragged rows at the end of theirs),
    where that cache's ``keys`` positions lie in the pools (each row's last tokens, its last
    token last), the bias of that call, for ragged queries where each packed query lands,
    and the table of runs kept for that bias (:func:`_reader`)."""
    batch, max_pages = pages.block_table.shape
    # a window keeps only each row's last tokens: gather those (the queries' span and the
    # window; ragged rows' queries are at most their placed length)
    keys = max_pages * page_size
    kept = reach(rest, placed_length(pages, query))
    if kept is not None:
        keys = max(1, min(keys, kept))
    bias, (starts, key_offsets, query_offsets), runs = _kept_layout(
        pages, rest, batch, keys, query.device
    )
    lens = pages.seq_lens
    torch.sub(keys, lens, out=key_offsets)  # a row's token t at t + keys - lens
    torch.clamp(key_offsets, min=0, out=starts)  # read by the key range
    if pages.cu_seqlens_q is not None:  # each row's queries at the end of `total` places
        cu = pages.cu_seqlens_q
        torch.sub(placed_length(pages, query), cu[1:] - cu[:-1], out=query_offsets)
    placed, where = _placed(pages, query)
    # ragged rows: where each row's queries begin, so that the kernels skip the tiles before
    starts_q = query_offsets if pages.cu_seqlens_q is not None else None
    layout = Pages(pages.block_table, lens, page_size, num_pages, keys, starts_q)
    return placed, layout, bias, where, runs


def _pool_rows(pool: Tensor) -> Tensor | None:
    """A ``(num_pages, page_size, Hkv, E)`` pool as ``(1, Hkv, num_pages * page_size, E)``
    without a copy (``None`` where its strides do not allow one, or its rows would not fit
    the kernel's int32 row numbers)."""
    rows = pool.shape[0] * pool.shape[1]
    if rows >= 2**31 or pool.stride(0) != pool.shape[1] * pool.stride(1):
        return None
    return _batch_rows(pool, 1)


def _batch_rows(pool: Tensor, batch: int) -> Tensor:
    """A pool's rows for every batch row, ``(B, Hkv, R, E)`` with a batch stride of 0 (where
    :func:`_pool_rows` allows the view: a kept run checked it for these strides)."""
    rows = pool.flatten(0, 1).transpose(0, 1)
    return rows.expand(batch, *rows.shape)


def _in_place(
    placed: Tensor, key: Tensor, value: Tensor, layout: Pages, bias: AttnBias,
    dropout_p: Any, scale: Any, enable_gqa: Any,
) -> tuple[Any, Tensor, Tensor] | None:  # fmt: skip
    """Where the planner gives the call on the contiguous cache to one of the library's
    kernels that read keys from pages (the decode kernel; the training kernel's forward
    without block lists or mask functions, for longer queries), that plan and the pools as
    the kernel reads them in place (``(1, Hkv, R, E)``): the call then runs without gathering
    the pages.
    ``None`` otherwise (other backends read the gathered cache), also while ``torch.compile``
    traces the call (the traced ops take contiguous keys)."""
    from attnbias.functional import _validate, plan_spec
    from attnbias.spec import make_spec

    if torch.compiler.is_compiling():
        return None
    # the kernels read a row's page table and the lengths as dense int32 rows
    if layout.table.stride(-1) != 1 or layout.seq_lens.stride(0) != 1:
        return None
    key_rows, value_rows = _pool_rows(key), _pool_rows(value)
    if key_rows is None or value_rows is None:
        return None
    batch, keys = layout.table.shape[0], layout.keys
    # stand-ins of the gathered cache's shape for planning (planning reads no values)
    key_like, value_like = (stand_in(t, batch, keys) for t in (key_rows, value_rows))
    # the call's arguments checked as the call on the gathered cache would check them
    dropout, scale = _validate(
        placed, key_like, value_like, bias, dropout_p, False, scale, enable_gqa
    )
    spec = make_spec(placed, key_like, value_like, bias, False, scale, dropout, enable_gqa)
    chosen = plan_spec(spec)
    name = chosen.backend.name
    if name == "triton-decode" or (name == "triton" and reads_pages(chosen.spec.program)):
        return chosen, key_rows, value_rows
    return None


Reader = Callable[[Tensor, Tensor, Tensor, Pages], Tensor]


class _Run(NamedTuple):
    """A kernel's run over the pages: ``read(placed query, key pool, value pool, pages) ->
    out``, and whether that kernel is the decode kernel."""

    read: Reader
    decode: bool


_RUNS_KEPT = 16


def _reader(
    placed: Tensor, key: Tensor, value: Tensor, layout: Pages, bias: AttnBias,
    dropout_p: Any, scale: Any, enable_gqa: Any, runs: dict[Any, Any],
) -> _Run | None:  # fmt: skip
    """The kernel's run over the pages (:class:`_Run`), or ``None`` where the call reads the
    gathered cache (:func:`_in_place`). Kept in ``runs``
    for the identical calls after it (the plan cache's role for other calls), except where
    the bias has mask or score functions, whose compiled form may change between calls, and
    for flags that are not plain numbers (a tensor scale may change in place)."""
    from attnbias.kernels.decode import plan_decode
    from attnbias.kernels.forward import plan_forward
    from attnbias.planner import current_policy

    capturing = placed.is_cuda and torch.cuda.is_current_stream_capturing()
    flags = (dropout_p, scale, enable_gqa)
    plain = all(type(f) in (type(None), bool, int, float) for f in flags)
    identity = (
        placed.shape, placed.stride(), placed.dtype, placed.device, key.shape, key.stride(),
        value.shape, value.stride(), key.dtype, layout.table.shape, layout.table.stride(),
        layout.seq_lens.stride(), layout.query_starts is None,
        *((type(f), f) for f in flags), current_policy(), capturing,
    )  # fmt: skip
    if plain and identity in runs:
        found: _Run | None = runs[identity]
        return found
    chosen = _in_place(placed, key, value, layout, bias, dropout_p, scale, enable_gqa)
    run: _Run | None = None
    if chosen is not None:
        plan, key_rows, value_rows = chosen
        spec, scale_ = plan.spec, plan.spec.resolved_scale
        if plan.backend.name == "triton-decode":
            # a window's reach bounds the keys each row keeps (the pages read are its
            # stretch): the rows keep about as many each, however long they are
            windowed = reach(tuple(parts_of(bias)), placed.shape[2]) is not None
            decode = plan_decode(spec.query, key_rows, value_rows, spec.program, scale=scale_,
                                 pages=layout, even_rows=windowed)  # fmt: skip

            def reader(q: Tensor, k: Tensor, v: Tensor, pages: Pages) -> Tensor:
                batch = q.shape[0]
                return decode.run(q, _batch_rows(k, batch), _batch_rows(v, batch), pages)

            run = _Run(reader, True)
        else:
            forward = plan_forward(spec.query, key_rows, value_rows, spec.program,
                                   scale=scale_, pages=layout)  # fmt: skip

            def reader(q: Tensor, k: Tensor, v: Tensor, pages: Pages) -> Tensor:
                batch = q.shape[0]
                return forward.launch(q, _batch_rows(k, batch), _batch_rows(v, batch),
                                      checked=False, pages=pages)[0]  # fmt: skip

            run = _Run(reader, False)
        if spec.program.mods is not None or spec.terms.refresh:
            return run
    if not plain or capturing:  # (what a capture planned may hold what only it fills)
        return run
    if len(runs) >= _RUNS_KEPT:
        runs.clear()
    runs[identity] = run
    return run


# Ragged rows placed longer than the decode kernel takes (a prefill chunk among decode rows)
# run on the training kernel at the placed length, where a row of a few queries has one tile,
# whose program reads all the row's keys alone. With this set, the rows of at most
# short_queries() queries run on the decode kernel instead (the last placed positions of
# every row; each row's keys split across programs) and the training kernel skips all their
# tiles; each row's output is taken from the kernel that ran it.
SPLIT_SHORT_ROWS = True


def _splits(length: int) -> bool:
    """Whether ragged rows placed at ``length`` queries are split between the decode and the
    training kernel (:data:`SPLIT_SHORT_ROWS`, a length the decode kernel does not take
    whole), a ``ModBias`` aside."""
    return SPLIT_SHORT_ROWS and length > MAX_DECODE_QUERIES


def short_queries(placed: Tensor, key: Tensor, rest: tuple[AttnBias, ...]) -> int:
    """The queries a ragged row holds at most to run on the decode kernel beside longer rows
    on the training kernel (:data:`SPLIT_SHORT_ROWS`): as many as fill the decode kernel's
    smallest tile of packed rows with a group's query heads. 0 where the call is not split:
    :data:`SPLIT_SHORT_ROWS` unset, a placed length the decode kernel takes whole, or a
    ``ModBias`` (it reads a query's index among its row's, which the last positions alone
    would shift). ``placed``: ``(B, Hq, L, E)``; ``key``: a ``(num_pages, page_size, Hkv, E)``
    pool."""
    if not _splits(placed.shape[2]):
        return 0
    if any(isinstance(part, ModBias) for part in rest):
        return 0
    group = max(1, placed.shape[1] // key.shape[2])
    return max(1, MIN_ROWS // group)


def _tail(
    placed: Tensor, key: Tensor, layout: Pages, rest: tuple[AttnBias, ...]
) -> tuple[int, Tensor, Pages] | None:
    """For ragged rows placed longer than the decode kernel takes, ``(short, tail, pages)``:
    the queries a short row holds at most (:func:`short_queries`), every row's last ``short``
    placed positions and their pages (no ragged starts: a short row's queries fill them);
    ``None`` where the call is not split."""
    if layout.query_starts is None:
        return None
    short = short_queries(placed, key, rest)
    if not short:
        return None
    return short, placed[:, :, -short:], dataclasses.replace(layout, query_starts=None)


def _read_in_place(
    run: _Run, placed: Tensor, key: Tensor, value: Tensor, layout: Pages, bias: AttnBias,
    rest: tuple[AttnBias, ...], dropout_p: Any, scale: Any, enable_gqa: Any,
    runs: dict[Any, Any],
) -> Tensor:  # fmt: skip
    """The placed call's output ``(B, Hq, L, Ev)`` from the kernels reading the pages: ``run``
    alone, or for ragged rows on the training kernel its longer rows there and the short ones
    on the decode kernel (:data:`SPLIT_SHORT_ROWS`). No host synchronisation: which rows are
    short is decided on the device."""
    split = None if run.decode else _tail(placed, key, layout, rest)
    tail_run = None
    if split is not None:
        tail_run = _reader(split[1], key, value, split[2], bias, dropout_p, scale, enable_gqa, runs)
    if split is None or tail_run is None or not tail_run.decode:
        # (not split, or the planner gives the last positions another kernel)
        return run.read(placed, key, value, layout)
    short, tail_query, tail_pages = split
    starts, length = layout.query_starts, placed.shape[2]
    assert starts is not None  # (a split's rows are ragged)
    # a short row's queries lie in the last `short` positions: the training kernel skips all
    # its tiles (its output there is replaced below)
    is_short = starts >= length - short
    long_rows = dataclasses.replace(layout, query_starts=torch.where(is_short, length, starts))
    out = run.read(placed, key, value, long_rows)
    tail = tail_run.read(tail_query, key, value, tail_pages)
    ends = out[:, :, -short:]
    torch.where(is_short[:, None, None, None], tail, ends, out=ends)
    return out


# FlashAttention 4's paged forward takes calls of at least this many queries per row (for
# ragged rows: their placed length): chunked prefill, where it is faster than the library's
# kernel reading the pages (1.2-1.7x from 64 queries a row on an H200, slower at 32 and
# below); decode stays on the decode kernel (benchmarks/PAGED_RESULTS.md).
FA4_MIN_QUERIES = 64
# Ragged rows that the library's kernels split (SPLIT_SHORT_ROWS: rows placed longer than the
# decode kernel takes) go to FlashAttention 4's paged forward only from this many queries a
# row on average (the packed total over the rows, both known without reading the device):
# one prefill chunk among seven decode rows of 8k-32k tokens runs at 0.72x its time on the
# library's kernels with a chunk of 256 (33 queries a row) and at parity with 1024 (129 a
# row), on an H200; uniform rows of 128 or more are 1.4-1.7x faster on FlashAttention 4.
FA4_MIN_RAGGED_MEAN_QUERIES = 128
# The compute capabilities whose FlashAttention 4 paged forward is checked against the oracle
# with garbage (NaN) past each row's length.
FA4_PAGED_CAPABILITIES = (9,)
# The compilation keys FlashAttention 4's paged forward has run with eagerly: a CUDA-graph
# capture takes it only for those (its first call compiles, which a capture must not see).
_FA4_SEEN: set[tuple[Any, ...]] = set()
_FA4_SEEN_LOCK = threading.Lock()
_FA4_SEEN_KEPT = 4096


def _fa4_key_tiles(head_dim: int) -> set[int] | None:
    """The key tiles FlashAttention 4's forward on capability 9 may take at this head dim
    (causal or not, a window or not), ``None`` where this version does not say (its private
    helper missing or changed)."""
    from attnbias.backends import fa4

    helper = getattr(fa4.interface_module(), "_tile_size_fwd_sm90", None)
    if helper is None:
        return None
    try:
        return {
            int(helper(head_dim, head_dim, causal, local).n_block_size)
            for causal in (False, True)
            for local in (False, True)
        }
    except (AttributeError, TypeError, ValueError):
        return None


def _fa4_form(
    rest: tuple[AttnBias, ...],
) -> tuple[bool, tuple[int | None, int | None]] | None:
    """``(causal, window_size)`` of FlashAttention 4 for the parts beside the PagedKV, or
    ``None`` where a part has no such form (soft-cap, ALiBi, ModBias)."""
    causal = False
    left: int | None = None
    right: int | None = None
    for part in rest:
        if isinstance(part, CausalBias):
            causal = True  # lower right: _split refused the rest
        elif isinstance(part, SlidingWindowBias):
            if part.window_left is not None:
                left = part.window_left if left is None else min(left, part.window_left)
            if part.window_right is not None:
                right = part.window_right if right is None else min(right, part.window_right)
        else:
            return None
    if causal:
        right = 0 if right is None else min(right, 0)
    if (left is not None and left < 0) or (right is not None and right < 0):
        return None  # a band that keeps no pair, or starts past the diagonal (ours take it)
    return causal, (left, right)


def fa4_paged(
    query: Tensor, key: Tensor, value: Tensor, pages: PagedKV, rest: tuple[AttnBias, ...],
    page_size: int, dropout_p: Any, scale: Any, enable_gqa: Any,
) -> Callable[[], Tensor] | None:  # fmt: skip
    """FlashAttention 4's paged forward for this call (``page_table``, ``seqused_k``, causal
    and windows aligned at each row's end, ragged rows through ``cu_seqlens_q``) as a
    function giving the output, or ``None`` where the call takes the library's kernels:

    - FlashAttention 4 not installed, not a CUDA device of capability 9 (the one checked),
      not float16 / bfloat16, head dims it does not take, ``Hq != Hkv`` without
      ``enable_gqa``, dropout, a scale that is not a positive number;
    - parts other than ``causal_lower_right()`` and sliding windows, or no causal part (the
      forms checked against the oracle on a GPU are causal, with or without a window);
    - fewer than :data:`FA4_MIN_QUERIES` queries a row (for ragged rows: ``max_seqlen_q``,
      or without it the packed total, which the library's kernels run each row at): decode
      is faster on the decode kernel;
    - ragged rows that the library's kernels split (:data:`SPLIT_SHORT_ROWS`) with fewer
      than :data:`FA4_MIN_RAGGED_MEAN_QUERIES` queries a row on average: a few prefill
      chunks among decode rows run faster with the decode rows on the decode kernel;
    - a page size equal to its key tile: it then loads whole pages by TMA, slots past a row's
      length included, and a NaN there would reach the output (``P = 0`` times ``NaN``); with
      other page sizes it loads each key row under a predicate on the row's length;
    - tables or pools in layouts it does not read in place, ``torch.compile`` tracing, and a
      CUDA-graph capture of options it has not run eagerly (its first call compiles);
    - a :func:`attnbias.use_backends` region that excludes ``fa4`` or pins another backend
      first."""
    from attnbias.backends import fa4
    from attnbias.planner import current_policy

    if not (query.is_cuda and fa4._installed()) or torch.compiler.is_compiling():
        return None
    policy = current_policy()  # use_backends: FlashAttention 4 first, or no pin
    if "fa4" in policy.exclude or (policy.only is not None and policy.only[0] != "fa4"):
        return None
    if query.dtype not in (torch.float16, torch.bfloat16) or dropout_p != 0.0:
        return None
    if not (scale is None or (type(scale) in (int, float) and scale > 0)):
        return None
    major = fa4._capability(query.device.index or 0)[0]
    head_dim, head_dim_v = key.shape[3], value.shape[3]
    if major not in FA4_PAGED_CAPABILITIES or head_dim != query.shape[3]:
        return None
    if fa4._head_dim_reasons(major, head_dim, head_dim_v, query.dtype):
        return None
    heads_q, heads_kv = query.shape[1], key.shape[2]
    if heads_q != heads_kv and not (enable_gqa and heads_q % heads_kv == 0):
        return None
    form = _fa4_form(rest)
    if form is None or not form[0]:  # (the forms checked on a GPU: causal, with a window)
        return None
    causal, window = form
    placed = placed_length(pages, query)
    if placed < FA4_MIN_QUERIES:  # a row's, or the packed rows' bound
        return None
    mean_below = query.shape[2] < FA4_MIN_RAGGED_MEAN_QUERIES * pages.block_table.shape[0]
    if pages.cu_seqlens_q is not None and _splits(placed) and mean_below:  # (form: no ModBias)
        return None
    tiles = _fa4_key_tiles(head_dim)
    if tiles is None or page_size in tiles:
        return None
    table, lens = pages.block_table, pages.seq_lens
    if table.dtype != torch.int32 or lens.dtype != torch.int32 or table.stride(-1) != 1:
        return None
    if any(t.stride(-1) != 1 for t in (key, value)):
        return None
    cu = pages.cu_seqlens_q
    options = (
        query.shape[1:], query.dtype, query.device, key.shape[1:], cu is None, causal, window,
        scale,
    )  # fmt: skip
    captured = torch.cuda.is_current_stream_capturing()
    if captured and options not in _FA4_SEEN:
        return None
    function = fa4._flash_attn_varlen_func()

    def run() -> Tensor:
        if cu is None:
            q = query.transpose(1, 2)  # (B, L, Hq, E)
            more: dict[str, Any] = {}
        else:
            q = query[0].transpose(0, 1)  # (total, Hq, E)
            # an upper bound (no host synchronisation): max_seqlen_q or the packed total
            more = {"cu_seqlens_q": cu, "max_seqlen_q": placed_length(pages, query)}
        found = function(
            q, key, value, seqused_k=lens, page_table=table, causal=causal,
            window_size=window, softmax_scale=scale, num_splits=1, **more,
        )  # fmt: skip
        out = found[0] if isinstance(found, tuple) else found
        if cu is not None:  # the queries past the last row (a padded step): zeros
            past = torch.arange(out.shape[0], device=out.device) >= cu[-1]
            out = out.masked_fill(past[:, None, None], 0)
        if not captured:  # compiled now (explain() decides without running: not seen)
            with _FA4_SEEN_LOCK:
                if len(_FA4_SEEN) >= _FA4_SEEN_KEPT:  # (ragged totals vary from step to step)
                    _FA4_SEEN.clear()
                _FA4_SEEN.add(options)
        if cu is None:
            return out.transpose(1, 2)
        return out.transpose(0, 1).unsqueeze(0)

    return run


def _fa4_words(query: Tensor, pages: PagedKV, rest: tuple[AttnBias, ...], page_size: int) -> str:
    form = _fa4_form(rest)
    assert form is not None
    causal, window = form
    rows = "ragged rows (cu_seqlens_q)" if pages.cu_seqlens_q is not None else "rows"
    return (
        f"{rows} of {query.shape[2]} queries, causal={causal}, window_size={window}, pages "
        f"of {page_size} loaded row by row under each row's length (not FlashAttention 4's "
        f"key tile: no slot past a row's length is read)"
    )


@contextlib.contextmanager
def gathered_pages() -> Iterator[None]:
    """Paged calls in this context gather each row's pages into a contiguous cache and run
    there (the exact route every backend takes), instead of a kernel reading the pages or
    FlashAttention 4's paged forward."""
    token = _GATHER_ONLY.set(True)
    try:
        yield
    finally:
        _GATHER_ONLY.reset(token)


def paged_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnBias,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """:func:`attnbias.sdpa` of a call whose bias holds a :class:`PagedKV`: ``(B, Hq, L, Ev)``,
    or ``(1, Hq, total, Ev)`` for ragged queries."""
    from attnbias.functional import sdpa

    if _PENDING and not torch.cuda.is_current_stream_capturing():
        check_pending()
    pages, rest, num_pages, page_size = _checked(query, key, value, attn_mask, is_causal)
    gather = _GATHER_ONLY.get()
    fa4 = None
    if not gather:
        fa4 = fa4_paged(query, key, value, pages, rest, page_size, dropout_p, scale, enable_gqa)
    if fa4 is not None:
        return fa4()
    placed, layout, bias, where, runs = _prepare(query, pages, rest, num_pages, page_size)
    run = None
    if not gather:
        run = _reader(placed, key, value, layout, bias, dropout_p, scale, enable_gqa, runs)
    if run is not None:  # a kernel reads the pages where they are
        out = _read_in_place(
            run, placed, key, value, layout, bias, rest, dropout_p, scale, enable_gqa, runs
        )
    else:
        rows = _rows(layout)  # once for both
        out = sdpa(
            placed, _gathered(key, rows), _gathered(value, rows), attn_mask=bias,
            dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
        )  # fmt: skip
    if where is None:
        return out
    return _taken(out, where)


def paged_explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnBias,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> str:
    """:func:`attnbias.explain` of a paged call: how the pages are read, then the route of
    the call on them."""
    from attnbias.functional import explain

    pages, rest, num_pages, page_size = _checked(query, key, value, attn_mask, is_causal)
    gather = _GATHER_ONLY.get()
    if not gather and fa4_paged(
        query, key, value, pages, rest, page_size, dropout_p, scale, enable_gqa
    ):
        return (
            f"{pages!r}: FlashAttention 4's paged forward (page_table, seqused_k) reads the "
            f"pages in place: {_fa4_words(query, pages, rest, page_size)}"
        )
    placed, layout, bias, _, _ = _prepare(query, pages, rest, num_pages, page_size)
    count = layout.keys
    found = None
    if not gather:
        found = _in_place(placed, key, value, layout, bias, dropout_p, scale, enable_gqa)
    if found is not None:
        text = (
            f"{pages!r}: the kernel reads each row's last {count} tokens in place, through "
            f"their rows in the pools (no copy), kept by a key range\n{found[0].explain()}"
        )
        split = _tail(placed, key, layout, rest) if found[0].backend.name == "triton" else None
        tail = None
        if split is not None:
            short, tail_query, tail_pages = split
            tail = _in_place(tail_query, key, value, tail_pages, bias, dropout_p, scale, enable_gqa)
        if tail is not None and tail[0].backend.name == "triton-decode":
            text += (
                f"\nragged rows of at most {short} queries run on the decode kernel instead "
                f"(every row's last {short} placed positions; the training kernel skips all "
                f"their tiles):\n{tail[0].explain()}"
            )
        return text
    head = (
        f"{pages!r}: each row's pages gathered on the device into a contiguous cache of "
        f"{count} keys, its tokens at the end, kept by a key range"
    )
    rows = _rows(layout)
    route = explain(
        placed, _gathered(key, rows), _gathered(value, rows), attn_mask=bias,
        dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
    )  # fmt: skip
    return f"{head}\n{route}"

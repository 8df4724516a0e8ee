"""Attention over a sequence split across ranks, exchanging only the key/value blocks that hold
kept pairs (the sequence mode of :func:`attnbias.distributed.sdpa`).

From the bias's keep grid (:mod:`.blocks`) every rank works out the same schedule: for each
receiving rank and each owning rank, the runs of the owner's part whose keys some query of the
receiver keeps. At step ``t`` rank ``r`` attends what rank ``(r - t) % W`` sends it (its own
part at step 0) while the transfers of step ``t + 1`` are in flight; partial outputs merge by
their log-sum-exp. A window shorter than a rank's part exchanges with the neighbours only, and
only the window's reach; documents only within documents; a causal mask everything below the
diagonal. The backward sends the same runs again (recomputing each pair) and returns their
gradients straight to their owners.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnbias.biases import AttnBias
from attnbias.functional import plan_spec
from attnbias.materialize import compute_dtype
from attnbias.planner import Plan
from attnbias.spec import make_spec
from attnbias.terms import Block, Call

from .blocks import grain, keep_grid
from .layouts import Layout

__all__ = [
    "Cover", "Needs", "Schedule", "exchange_sdpa", "exchanged_runs", "pair_shapes",
    "received_positions",
]  # fmt: skip

Run = tuple[int, int]  # [start, stop) in a rank's part
Needs = list[list[list[Run]]]  # needs[r][o]: the runs of rank o's part rank r receives


@dataclass(frozen=True, eq=False)
class Pair:
    """A query chunk and a run of keys: the rows in this rank's query part, the columns in the
    key/value tensors in hand (its own part, or a received buffer) and the block of the whole
    call they are, with the bias's block made with the call."""

    rows: slice
    cols: slice
    block: Block
    sub: AttnBias | None


@dataclass(frozen=True, eq=False)
class Schedule:
    """One call's exchange, the same on every rank.

    ``needs[r][o]``: the runs of rank ``o``'s key/value part that rank ``r`` receives (merged,
    in ``o``'s part order; none for ``r == o``). ``pairs[t]``: this rank's pairs at step ``t``
    over what it holds then (its own part at step 0, else the runs of rank ``(rank - t) % W``
    laid end to end)."""

    rank: int
    world: int
    group: Any
    bias: AttnBias | None
    call: Call
    layout: Layout
    scale: float | None
    enable_gqa: bool
    needs_grad: bool
    needs: Needs
    pairs: list[list[Pair]]
    rows: Cover
    own_columns: Cover
    held_columns: list[Cover]
    # each pair's plan per layout of its slices (Schedule.plan_pair)
    plans: dict[Any, Plan] = dataclasses.field(default_factory=dict)

    @classmethod
    def make(
        cls,
        bias: AttnBias | None,
        call: Call,
        layout: Layout,
        rank: int,
        group: Any,
        *,
        scale: float | None,
        enable_gqa: bool,
        needs_grad: bool,
        grid: Tensor | None = None,
        needs: Needs | None = None,
    ) -> Schedule:
        """The schedule of ``bias`` over ``call`` split by ``layout``, seen from ``rank``;
        ``grid``: the bias's keep grid at the layout's grains, and ``needs``: the runs each
        rank receives (:func:`exchanged_runs`), where already worked out."""
        if grid is None:
            pieces = layout.pieces
            grid = keep_grid(
                bias, call, grain(call.length_q, pieces), grain(call.length_kv, pieces)
            )
        if needs is None:
            needs = exchanged_runs(grid, call, layout)
        pairs = []
        for shapes in pair_shapes(grid, call, layout, rank, needs):
            pairs.append([
                Pair(rows, cols, block, None if bias is None else bias.sub_block(call, block))
                for rows, cols, block in shapes
            ])  # fmt: skip
        world = layout.world
        part_q, part_kv = call.length_q // world, call.length_kv // world
        rows = Cover.of([_span_of(p.rows) for step in pairs for p in step], part_q)
        # the own part's key/value gradients: its pairs at step 0, then those coming home
        home = [run for receiver in range(world) if receiver != rank
                for run in needs[receiver][rank]]  # fmt: skip
        own_columns = Cover.of([_span_of(p.cols) for p in pairs[0]] + home, part_kv)
        held_columns = [Cover.of([], 0)] + [
            Cover.of([_span_of(p.cols) for p in pairs[step]],
                     sum(b - a for a, b in needs[rank][(rank - step) % world]))
            for step in range(1, world)
        ]  # fmt: skip
        return cls(rank, world, group, bias, call, layout, scale, enable_gqa, needs_grad,
                   needs, pairs, rows, own_columns, held_columns)  # fmt: skip

    def received(self, rank: int) -> int:
        """The key/value positions ``rank`` receives in the forward."""
        return received_positions(self.needs, rank)

    # -- transfers ---------------------------------------------------------------------------

    def transfers(self, step: int, own: tuple[Tensor, ...]) -> tuple[list[Any], Any]:
        """The operations that bring each rank what it attends at ``step`` (posted one step
        earlier), and this rank's receive buffers (``None``: it receives nothing then). The
        operations hold the packed sends: keep them until the transfers are done."""
        ops: list[Any] = []
        incoming = None
        if not 1 <= step < self.world:
            return ops, incoming
        me, world = self.rank, self.world
        receiver = (me + step) % world
        runs = self.needs[receiver][me]
        if runs:
            sent = (_pack_joined(own, runs),) if _joined(own, runs) else (
                tuple(_pack(t, runs) for t in own)
            )  # fmt: skip
            ops += _sends(sent, receiver, self.group, _KV_TAG)
        owner = (me - step) % world
        runs = self.needs[me][owner]
        if runs:
            count = sum(b - a for a, b in runs)
            buffers: tuple[Tensor, ...]
            if _joined(own, runs):
                buffer = _empty_like_part(own[0], count, joined=True)
                incoming, buffers = tuple(buffer.unbind(0)), (buffer,)
            else:
                incoming = buffers = tuple(_empty_like_part(t, count) for t in own)
            ops += _receives(buffers, owner, self.group, _KV_TAG)
        return ops, incoming

    def gradient_transfers(
        self, step: int, finished: tuple[Tensor, ...] | None, template: tuple[Tensor, ...]
    ) -> tuple[list[Any], tuple[Tensor, ...] | None]:
        """The operations, posted at ``step``, that return the key/value gradients of the
        runs attended at ``step - 1`` to their owner, and the buffers of the gradients of this
        rank's own runs coming home from the rank that attended them then."""
        ops: list[Any] = []
        before = step - 1
        if not 1 <= before < self.world:
            return ops, None
        me, world = self.rank, self.world
        if finished is not None:
            ops += _sends(finished, (me - before) % world, self.group, _GRAD_TAG)
        runs = self.home_runs(step)
        home = None
        if runs:
            count = sum(b - a for a, b in runs)
            home = tuple(_empty_like_part(t, count) for t in template)
            ops += _receives(home, (me + before) % world, self.group, _GRAD_TAG)
        return ops, home

    def home_runs(self, step: int) -> list[Run]:
        """The runs of this rank's part whose gradients come home at ``step``: those the
        rank ``step - 1`` after it attended at step ``step - 1``."""
        return self.needs[(self.rank + step - 1) % self.world][self.rank]

    # -- the pairs ---------------------------------------------------------------------------

    def plan_pair(
        self, query: Tensor, key: Tensor, value: Tensor, pair: Pair, *, backward: bool = False
    ) -> Plan:
        """The planned call of a pair: with the block's bias made with the schedule, or, for a
        bias with tensors of its own, in the ``backward`` made again (under grad mode there,
        so that the gradients of the block's tensors reach the bias's own)."""
        q, k, v = query[:, :, pair.rows], key[:, :, pair.cols], value[:, :, pair.cols]
        # A bias without tensors of its own plans a pair once per layout of its slices (the
        # schedule itself is kept only for a bias whose plan-cache key names its values): a
        # repeated call takes that plan with its own tensors, as the plan cache does, unless
        # the plan's terms ask for work before each call. Planning costs host time, which holds
        # the GPU up where a step's pairs are short (benchmarks/NOTES.md).
        learnable = self.bias is not None and bool(self.bias.parameters())
        slot = None if learnable else (id(pair), backward, q.stride(), k.stride(), v.stride())
        found = None if slot is None else self.plans.get(slot)
        if found is not None:
            spec = dataclasses.replace(found.spec, query=q, key=k, value=v)
            return dataclasses.replace(found, spec=spec)
        sub = pair.sub
        if backward and learnable:
            assert self.bias is not None
            sub = self.bias.sub_block(self.call, pair.block)
        spec = make_spec(q, k, v, sub, False, self.scale, 0.0, self.enable_gqa, needs_lse=True)
        chosen = plan_spec(dataclasses.replace(spec, needs_grad=self.needs_grad))
        if slot is not None and not chosen.provisional and not chosen.spec.terms.refresh:
            self.plans[slot] = chosen
        return chosen


def received_positions(needs: Needs, rank: int) -> int:
    """The key/value positions ``rank`` receives of the other ranks' parts (``needs``:
    :func:`exchanged_runs`)."""
    return sum(b - a for owner in needs[rank] for a, b in owner)


def exchanged_runs(grid: Tensor, call: Call, layout: Layout) -> Needs:
    """``needs[r][o]``: the runs of rank ``o``'s key/value part whose blocks some query of rank
    ``r`` keeps (merged, in ``o``'s part order; none for ``r == o``), from the keep grid at
    the layout's grains."""
    world = layout.world
    grain_q, grain_kv = grain(call.length_q, layout.pieces), grain(call.length_kv, layout.pieces)
    # global blocks of each rank's part, in part order
    q_blocks = [_blocks(layout.ranges(r, call.length_q), grain_q) for r in range(world)]
    kv_blocks = [_blocks(layout.ranges(r, call.length_kv), grain_kv) for r in range(world)]
    needs: Needs = []
    for receiver in range(world):
        # rows by index_select, not a list index: advanced indexing of a CPU tensor costs
        # milliseconds where several processes share the cores
        kept_columns = _rows(grid, q_blocks[receiver]).any(0)
        row: list[list[Run]] = []
        for owner in range(world):
            if owner == receiver:
                row.append([])
                continue
            kept = _rows(kept_columns, kv_blocks[owner]).tolist()
            row.append(_runs(kept, grain_kv))
        needs.append(row)
    return needs


def pair_shapes(
    grid: Tensor, call: Call, layout: Layout, rank: int, needs: Needs
) -> list[list[tuple[slice, slice, Block]]]:
    """Per step, ``rank``'s pairs as ``(rows in its query part, columns in the key/value
    tensors in hand, block of the whole call)``: its own part at step 0, the runs of rank
    ``(rank - t) % W`` after."""
    world = layout.world
    grain_q, grain_kv = grain(call.length_q, layout.pieces), grain(call.length_kv, layout.pieces)
    found = []
    for step in range(world):
        owner = (rank - step) % world
        runs = [(0, call.length_kv // world)] if step == 0 else needs[rank][owner]
        found.append(_pairs(call, grid, layout, rank, owner, runs, grain_q, grain_kv))
    return found


def _rows(x: Tensor, index: list[int]) -> Tensor:
    """``x[index]`` along dim 0."""
    return x.index_select(0, torch.tensor(index, dtype=torch.int64))


def _blocks(ranges: list[tuple[int, int]], size: int) -> list[int]:
    """The global blocks of ``size`` that ``ranges`` cover, in order."""
    return [b for a, stop in ranges for b in range(a // size, stop // size)]


def _runs(kept: list[bool], size: int) -> list[Run]:
    """The runs of a part whose blocks of ``size`` are kept, merged where they touch."""
    runs: list[Run] = []
    for index, flag in enumerate(kept):
        if not flag:
            continue
        start = index * size
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + size)
        else:
            runs.append((start, start + size))
    return runs


def _pairs(
    call: Call,
    grid: Tensor,
    layout: Layout,
    rank: int,
    owner: int,
    runs: list[Run],
    grain_q: int,
    grain_kv: int,
) -> list[tuple[slice, slice, Block]]:
    """This rank's pairs over ``runs`` of ``owner``'s part laid end to end: each stretch of
    its queries against each stretch of the runs (a stretch is contiguous both in the part and
    in the whole sequence, as a block of the call must be), narrowed to the query and key
    blocks that keep a pair there; none where nothing is kept."""
    q_pieces, offset = [], 0  # (row in the query part, global start, length)
    for a, b in layout.ranges(rank, call.length_q):
        q_pieces.append((offset, a, b - a))
        offset += b - a
    kv_ranges = layout.ranges(owner, call.length_kv)
    chunk_kv = kv_ranges[0][1] - kv_ranges[0][0]
    pieces = []  # (column in the buffer, global start, length)
    column = 0
    for a, b in runs:
        position = a
        while position < b:
            chunk = position // chunk_kv
            stop = min(b, (chunk + 1) * chunk_kv)
            start = kv_ranges[chunk][0] + position - chunk * chunk_kv
            pieces.append((column, start, stop - position))
            column += stop - position
            position = stop
    found = []
    for row, qa, length_q in _stretches(q_pieces):
        rows = grid[qa // grain_q : (qa + length_q) // grain_q]  # (query blocks, S / gk)
        for column, start, length in _stretches(pieces):
            kept = rows[:, start // grain_kv : (start + length) // grain_kv]
            kept_rows, kept_cols = kept.any(1).tolist(), kept.any(0).tolist()
            if not any(kept_rows):
                continue
            first_q, last_q = _span(kept_rows, grain_q)
            first, last = _span(kept_cols, grain_kv)
            block = Block(qa + first_q, start + first, last_q - first_q, last - first)
            found.append(
                (slice(row + first_q, row + last_q), slice(column + first, column + last), block)
            )
    return found


def _stretches(pieces: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(offset in the tensor, global start, length)`` pieces, in order, merged where one
    follows the other both in the tensor and in the sequence."""
    merged: list[tuple[int, int, int]] = []
    for offset, start, length in pieces:
        if merged:
            last_offset, last_start, last_length = merged[-1]
            if last_offset + last_length == offset and last_start + last_length == start:
                merged[-1] = (last_offset, last_start, last_length + length)
                continue
        merged.append((offset, start, length))
    return merged


def _span(flags: list[bool], size: int) -> tuple[int, int]:
    """The positions from the first kept block of ``flags`` to the end of the last."""
    first = flags.index(True)
    last = len(flags) - flags[::-1].index(True)
    return first * size, last * size


@dataclass(frozen=True)
class Cover:
    """How many of a call's partial results reach each stretch of ``[0, length)`` (of a
    rank's query rows, or of key/value columns): ``stretches`` ``(start, stop, count)`` in
    order, ``count`` 0, 1 or 2 (two or more). Rows one result reaches take it as it comes;
    only rows several reach are summed (or merged) in the compute dtype."""

    length: int
    stretches: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, spans: list[Run], length: int) -> Cover:
        """The cover of ``[0, length)`` by ``spans`` (``[start, stop)`` each)."""
        cuts = sorted({0, length, *(a for a, _ in spans), *(b for _, b in spans)})
        stretches: list[tuple[int, int, int]] = []
        for a, b in itertools.pairwise(cuts):
            count = min(2, sum(1 for start, stop in spans if start <= a and b <= stop))
            if stretches and stretches[-1][2] == count and stretches[-1][1] == a:
                stretches[-1] = (stretches[-1][0], b, count)
            else:
                stretches.append((a, b, count))
        return cls(length, tuple(stretches))

    def within(self, start: int, stop: int) -> list[tuple[int, int, int, int]]:
        """The stretches ``[start, stop)`` meets, clipped to it: ``(a, b, count, stretch
        start)``."""
        return [
            (max(a, start), min(b, stop), count, a)
            for a, b, count in self.stretches
            if a < stop and start < b
        ]

    def elements(self, count: int) -> int:
        """The positions reached by ``count`` results (2: two or more)."""
        return sum(b - a for a, b, c in self.stretches if c == count)


class _Sum:
    """The sum of partial results along dim 2 of a ``(B, H, n, ...)`` tensor of ``dtype``,
    laid out by a :class:`Cover`: a position one result reaches is written as it comes, one
    that several reach is summed in ``compute`` (the same numbers as summing everything in
    ``compute`` from zeros, without its passes over the rest), one none reaches is 0. A first
    result that spans all ``n`` positions in ``dtype`` becomes the sum's tensor (no copy)."""

    def __init__(
        self, cover: Cover, shape: tuple[int, ...], dtype: torch.dtype, compute: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.cover, self.shape, self.dtype, self.device = cover, shape, dtype, device
        self.in_place = dtype == compute  # several results summed in the tensor itself
        self.result: Tensor | None = None
        self.sums: dict[int, Tensor] = {}
        if self.in_place:
            self._allocate()
        else:
            for a, b, count in cover.stretches:
                if count == 2:
                    self.sums[a] = torch.zeros(
                        (*shape[:2], b - a, *shape[3:]), dtype=compute, device=device
                    )

    def _allocate(self) -> Tensor:
        result = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for a, b, count in self.cover.stretches:
            if count == 0:
                result[:, :, a:b].zero_()
            elif count == 2 and self.in_place:
                self.sums[a] = result[:, :, a:b].zero_()
        self.result = result
        return result

    def add(self, start: int, value: Tensor) -> None:
        """Add ``value``, the result at positions ``[start, start + value.shape[2])``."""
        result, adopted = self.result, False
        if result is None:
            adopted = start == 0 and tuple(value.shape) == self.shape
            adopted = adopted and value.dtype == self.dtype
            result = self.result = value if adopted else self._allocate()
        for a, b, count, at in self.cover.within(start, start + value.shape[2]):
            piece = value[:, :, a - start : b - start]
            if count == 2:
                self.sums[at][:, :, a - at : b - at] += piece
            elif not adopted:
                result[:, :, a:b].copy_(piece)

    def finish(self) -> Tensor:
        result = self.result if self.result is not None else self._allocate()
        if not self.in_place:
            for at, total in self.sums.items():
                result[:, :, at : at + total.shape[2]].copy_(total)
        return result


class _Merged:
    """The log-sum-exp merge of partial attention results over a rank's query rows, laid out
    by a :class:`Cover`: rows one result reaches take its output and log-sum-exp as they come,
    rows several reach merge in ``compute``, rows none reaches are 0 with a log-sum-exp of
    ``-inf``. ``finish`` gives the output in ``dtype`` and the log-sum-exp in ``compute``. A
    first result that spans every row becomes the output (no copy)."""

    def __init__(
        self, cover: Cover, shape: tuple[int, int, int, int], dtype: torch.dtype,
        compute: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        self.cover, self.shape, self.dtype, self.compute = cover, shape, dtype, compute
        self.device = device
        self.out: Tensor | None = None
        self.lse: Tensor | None = None
        self.sums: dict[int, tuple[Tensor, Tensor]] = {}
        for a, b, count in cover.stretches:
            if count == 2:
                self.sums[a] = (
                    torch.zeros((*shape[:2], b - a, shape[3]), dtype=compute, device=device),
                    torch.full((*shape[:2], b - a), -float("inf"), dtype=compute,
                               device=device),
                )  # fmt: skip

    def _allocate(self) -> tuple[Tensor, Tensor]:
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.shape[:3], dtype=self.compute, device=self.device)
        for a, b, count in self.cover.stretches:
            if count == 0:
                out[:, :, a:b].zero_()
                lse[:, :, a:b].fill_(-float("inf"))
        self.out, self.lse = out, lse
        return out, lse

    def add(self, start: int, out: Tensor, lse: Tensor) -> None:
        """Merge a partial result at rows ``[start, start + out.shape[2])``: ``out``
        ``(B, Hq, m, Ev)``, ``lse`` ``(B, Hq, m)``."""
        adopted = False
        if self.out is None or self.lse is None:
            adopted = start == 0 and tuple(out.shape) == self.shape and out.dtype == self.dtype
            adopted = adopted and lse.dtype == self.compute
            if adopted:
                self.out, self.lse = out, lse
            else:
                self._allocate()
        assert self.out is not None and self.lse is not None
        for a, b, count, at in self.cover.within(start, start + out.shape[2]):
            rows = slice(a - start, b - start)
            if count == 2:
                total_out, total_lse = self.sums[at]
                _merge(total_out, total_lse, slice(a - at, b - at), out[:, :, rows],
                       lse[:, :, rows])  # fmt: skip
            elif not adopted:
                self.out[:, :, a:b].copy_(out[:, :, rows])
                self.lse[:, :, a:b].copy_(lse[:, :, rows])

    def finish(self) -> tuple[Tensor, Tensor]:
        out, lse = (self.out, self.lse) if self.out is not None and self.lse is not None else (
            self._allocate()
        )  # fmt: skip
        for at, (total_out, total_lse) in self.sums.items():
            stop = at + total_out.shape[2]
            out[:, :, at:stop].copy_(total_out)
            lse[:, :, at:stop].copy_(total_lse)
        return out, lse


def _span_of(rows: slice) -> Run:
    return (rows.start, rows.stop)


class ExchangeAttention(torch.autograd.Function):
    """The exchange's forward and backward, with the bias's tensors as inputs of their own
    (their gradients)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        schedule: Schedule,
        check: Callable[[], Callable[[], None]] | None,
        *params: Tensor,
    ) -> Tensor:
        compute = compute_dtype(query.dtype)
        batch, heads_q, part_q, _ = query.shape
        merged = _Merged(schedule.rows, (batch, heads_q, part_q, value.shape[-1]), query.dtype,
                         compute, query.device)  # fmt: skip
        own = (key, value)
        held: tuple[Tensor, ...] | None = own
        for step in range(schedule.world):
            ops, incoming = schedule.transfers(step + 1, own)

            def attend(held: tuple[Tensor, ...] | None = held, step: int = step) -> None:
                if held is not None:
                    for pair in schedule.pairs[step]:
                        chosen = schedule.plan_pair(query, held[0], held[1], pair)
                        pair_out, pair_lse = chosen.backend.forward_lse(chosen.spec)
                        merged.add(pair.rows.start, pair_out, pair_lse)

            works = _overlapped(ops, attend, check if step == 0 else None, query.device)
            _wait(works)
            held = incoming
        result, lse = merged.finish()
        ctx.schedule = schedule
        ctx.save_for_backward(query, key, value, result, lse, *params)
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # asked to build a graph of the gradients
            raise RuntimeError(
                "attnbias.distributed.sdpa: double backward (create_graph=True) is not "
                "supported: the exchange's gradients are not themselves differentiable"
            )
        schedule: Schedule = ctx.schedule
        query, key, value, out, lse, *params = ctx.saved_tensors
        compute = compute_dtype(query.dtype)
        device = query.device
        grad_q = _Sum(schedule.rows, tuple(query.shape), query.dtype, compute, device)
        grad_own = [
            _Sum(schedule.own_columns, tuple(t.shape), t.dtype, compute, device)
            for t in (key, value)
        ]
        grad_params: list[Tensor | None] = [None] * len(params)
        own = (key, value)
        # the shapes of the gradients coming home (in the compute dtype)
        template = tuple(
            torch.empty((*t.shape[:2], 0, *t.shape[3:]), dtype=compute, device=device) for t in own
        )
        held: tuple[Tensor, ...] | None = own
        finished: tuple[Tensor, ...] | None = None
        for step in range(schedule.world + 1):
            ops, incoming = schedule.transfers(step + 1, own)
            grad_ops, home = schedule.gradient_transfers(step, finished, template)
            finished = None

            def attend(held: tuple[Tensor, ...] | None = held, step: int = step) -> None:
                nonlocal finished
                if step == schedule.world or held is None:
                    return
                # the own part's gradients where they are summed; a received run's in the
                # compute dtype, to be sent home
                grad_k, grad_v = grad_own if step == 0 else (
                    _Sum(schedule.held_columns[step], tuple(t.shape), compute, compute, device)
                    for t in held
                )  # fmt: skip
                for pair in schedule.pairs[step]:
                    with torch.enable_grad():
                        chosen = schedule.plan_pair(query, held[0], held[1], pair, backward=True)
                    dq, dk, dv, dparams = chosen.backend.backward_lse(
                        chosen.spec,
                        grad_out[:, :, pair.rows],
                        out[:, :, pair.rows],
                        lse[:, :, pair.rows],
                        params,
                    )
                    grad_q.add(pair.rows.start, dq)
                    grad_k.add(pair.cols.start, dk)
                    grad_v.add(pair.cols.start, dv)
                    for i, grad in enumerate(dparams):
                        if grad is not None:
                            total = grad_params[i]
                            grad_params[i] = grad if total is None else total + grad
                if step > 0:
                    finished = (grad_k.finish(), grad_v.finish())

            works = _overlapped(ops + grad_ops, attend, None, device)
            _wait(works)
            if home is not None:
                runs = schedule.home_runs(step)
                _unpack_add(grad_own[0], home[0], runs)
                _unpack_add(grad_own[1], home[1], runs)
            held = incoming
        return (
            grad_q.finish(),
            grad_own[0].finish(),
            grad_own[1].finish(),
            None,
            None,
            *(
                None if g is None else g.to(p.dtype)
                for g, p in zip(grad_params, params, strict=True)
            ),
        )


def exchange_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    schedule: Schedule,
    params: tuple[Tensor, ...],
    check: Callable[[], Callable[[], None]] | None = None,
) -> Tensor:
    """This rank's rows of the output, ``(B, Hq, L / W, Ev)``. ``check``: the ranks'
    agreement on the call, started once (it returns the function that waits for it and
    raises), before the own part's attention is launched, and finished before the first
    transfer."""
    result: Tensor = ExchangeAttention.apply(query, key, value, schedule, check, *params)
    return result


def _merge(out: Tensor, lse: Tensor, rows: slice, part_out: Tensor, part_lse: Tensor) -> None:
    """Merge a partial result (``part_out`` ``(B, Hq, m, Ev)``, ``part_lse`` ``(B, Hq, m)``)
    into ``out`` / ``lse`` at ``rows``, in place: the log-sum-exp weighted mean. Rows that
    keep nothing in both stay 0 and ``-inf``; a NaN row stays NaN. On a CUDA device in
    float32, one kernel (``kernels.merge``): a dozen tensor operations cost the host more than
    the merge costs the GPU, which then waits for the next launch (benchmarks/NOTES.md)."""
    current_out, current_lse = out[:, :, rows], lse[:, :, rows]
    if (
        out.is_cuda
        and out.dtype == lse.dtype == torch.float32
        and out.stride(3) == 1
        and part_out.stride(3) == 1
    ):
        from attnbias.kernels.merge import merge_partial

        merge_partial(current_out, current_lse, part_out, part_lse)
        return
    part_lse = part_lse.to(lse.dtype)
    merged = torch.logaddexp(current_lse, part_lse)
    # a Python zero: a CPU tensor here would be copied to the device, and the host would wait
    # for every kernel queued before the copy
    finite = torch.where(torch.isfinite(merged), merged, 0.0)
    weight = torch.exp(current_lse - finite)[..., None]
    part_weight = torch.exp(part_lse - finite)[..., None]
    out[:, :, rows] = current_out * weight + part_out.to(out.dtype) * part_weight
    lse[:, :, rows] = merged


_KV_TAG = 0
_GRAD_TAG = 2


def _pack(x: Tensor, runs: list[Run]) -> Tensor:
    """The runs of ``x``'s positions (dim 2) laid end to end, contiguous."""
    if len(runs) == 1 and runs[0] == (0, x.shape[2]):
        return x.contiguous()
    return torch.cat([x[:, :, a:b] for a, b in runs], 2).contiguous()


def _unpack_add(whole: _Sum, packed: Tensor, runs: list[Run]) -> None:
    """Add ``packed`` (the runs laid end to end) into ``whole`` at the runs."""
    column = 0
    for a, b in runs:
        whole.add(a, packed[:, :, column : column + b - a])
        column += b - a


def _empty_like_part(x: Tensor, count: int, *, joined: bool = False) -> Tensor:
    """``x``'s shape with ``count`` positions (two of them stacked where ``joined``)."""
    shape = (*x.shape[:2], count, *x.shape[3:])
    return torch.empty((2, *shape) if joined else shape, dtype=x.dtype, device=x.device)


def _joined(pair: tuple[Tensor, ...], runs: list[Run]) -> bool:
    """Whether the keys and values of a transfer of ``runs`` (of a part like ``pair``'s) travel
    in one buffer, ``(2, B, Hkv, n, E)``: where they have one shape and packing copies them
    anyway (not the whole part), one transfer instead of two (each costs the host time to
    post). Both ends decide it from the same runs. (Their gradients travel apart: joining
    them would take a copy that packing does not.)"""
    keys, values = pair
    whole = len(runs) == 1 and runs[0] == (0, keys.shape[2])
    return not whole and keys.shape[3] == values.shape[3] and keys.dtype == values.dtype


def _pack_joined(pair: tuple[Tensor, ...], runs: list[Run]) -> Tensor:
    """The runs of both tensors of ``pair`` laid end to end, stacked: ``(2, B, H, n, E)``."""
    count = sum(b - a for a, b in runs)
    packed = _empty_like_part(pair[0], count, joined=True)
    for x, into in zip(pair, packed.unbind(0), strict=True):
        torch.cat([x[:, :, a:b] for a, b in runs], 2, out=into)
    return packed


def _sends(tensors: tuple[Tensor, ...], peer: int, group: Any, tag: int) -> list[Any]:
    return [
        dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=peer, tag=tag + i)
        for i, t in enumerate(tensors)
    ]


def _receives(tensors: tuple[Tensor, ...], peer: int, group: Any, tag: int) -> list[Any]:
    return [
        dist.P2POp(dist.irecv, t, group=group, group_peer=peer, tag=tag + i)
        for i, t in enumerate(tensors)
    ]


def _start(ops: list[Any]) -> list[Any]:
    return dist.batch_isend_irecv(ops) if ops else []


def _overlapped(
    ops: list[Any],
    attend: Callable[[], None],
    check: Callable[[], Callable[[], None]] | None,
    device: torch.device,
) -> list[Any]:
    """Run ``attend`` (a step's attention) and post ``ops`` (the next step's transfers),
    ``check`` (started, then finished) before any transfer; returns the transfers' works.

    On a CUDA device ``check`` starts first, the attention is launched while it is under way,
    and the transfers are posted from a side stream that waits only for what was queued
    before ``attend`` (what the transfers read): the GPU starts on the attention while the
    host checks and posts the transfers, and the transfers run beside it, not after it as
    they would if posted after it from the same stream. Elsewhere the check and the transfers
    come first, as the collectives there block."""
    if device.type != "cuda":
        if check is not None:
            check()()
        works = _start(ops)
        attend()
        return works
    finish = None if check is None else check()
    stream = torch.cuda.current_stream(device)
    ready = stream.record_event() if ops else None
    attend()
    if finish is not None:
        finish()
    if ready is None:
        return []
    side = _side_stream(device)
    with torch.cuda.stream(side):
        side.wait_event(ready)
        return _start(ops)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    found = _SIDE_STREAMS.get(device)
    if found is None:
        found = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return found


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()

"""Sequences split across the processes of a ``torch.distributed`` group (context parallelism).

Each of the group's ``W`` ranks holds a part of the sequence dimension:

* ``"contiguous"``: the sequence in ``W`` equal chunks, rank ``r`` holds chunk ``r``;
* ``"zigzag"``: the sequence in ``2W`` equal chunks, rank ``r`` holds chunks ``r`` and
  ``2W - 1 - r`` (in that order), so that under a causal mask every rank has the same number
  of kept pairs.

:func:`shard` takes this rank's part of a tensor every rank holds whole; :func:`unshard` gathers
the parts back into the whole tensor on every rank. Both are differentiable. :func:`sdpa` is
attention over the whole sequence with each rank holding its part of the queries, keys and
values (ring attention): the key/value parts travel around the ring of ranks.

Example, on every rank of an initialised group::

    x = torch.randn(2, 8, 4096, 64)                 # the same tensor on every rank
    part = attnbias.distributed.shard(x)            # (2, 8, 4096 // W, 64)
    assert torch.equal(attnbias.distributed.unshard(part), x)

    q, k, v = (attnbias.distributed.shard(t) for t in (q_all, k_all, v_all))
    out = attnbias.distributed.sdpa(q, k, v, attn_mask=causal_lower_right())  # this rank's rows
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnbias.biases import AttnBias
from attnbias.functional import _validate
from attnbias.materialize import compute_dtype
from attnbias.planner import Plan, plan
from attnbias.spec import lower, make_spec, with_causal
from attnbias.terms import Block, Call

__all__ = ["LAYOUTS", "positions", "sdpa", "shard", "unshard"]

#: The ways a sequence is split across ranks.
LAYOUTS = ("contiguous", "zigzag")


def _world(group: Any) -> tuple[int, int]:
    """``(rank, world size)`` of ``group`` (``None``: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "attnbias.distributed needs an initialised process group: call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _chunks(length: int, world: int, layout: str) -> list[list[tuple[int, int]]]:
    """Per rank, the ``[start, stop)`` ranges of a sequence of ``length`` it holds, in order."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {', '.join(map(repr, LAYOUTS))}")
    pieces = world if layout == "contiguous" else 2 * world
    if length % pieces:
        raise ValueError(
            f"a sequence of length {length} cannot be split evenly for the {layout!r} layout "
            f"over {world} ranks: it needs a multiple of {pieces} ({world} ranks x "
            f"{pieces // world} chunks); pad it to {-(-length // pieces) * pieces}"
        )
    size = length // pieces
    if layout == "contiguous":
        return [[(r * size, (r + 1) * size)] for r in range(world)]
    return [
        [(r * size, (r + 1) * size), ((pieces - 1 - r) * size, (pieces - r) * size)]
        for r in range(world)
    ]


def _check_dim(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def positions(
    length: int, *, group: Any = None, layout: str = "zigzag", device: Any = None
) -> Tensor:
    """The global positions (int64, ``(length / W,)``) of this rank's part of a sequence of
    ``length``, in the order :func:`shard` lays them out."""
    rank, world = _world(group)
    ranges = _chunks(length, world, layout)[rank]
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])


def shard(x: Tensor, *, group: Any = None, layout: str = "zigzag", dim: int = 2) -> Tensor:
    """This rank's part of ``x`` along ``dim`` (``x`` is the whole tensor, the same on every
    rank). Shape: ``x``'s with ``dim`` divided by the group's size ``W``.

    Raises ``ValueError`` when the length along ``dim`` is no multiple of ``W`` (contiguous)
    or ``2W`` (zigzag), naming the length, ``W`` and the layout."""
    dim = _check_dim(x, dim)
    rank, world = _world(group)
    ranges = _chunks(x.shape[dim], world, layout)[rank]
    parts = [x.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard(x: Tensor, *, group: Any = None, layout: str = "zigzag", dim: int = 2) -> Tensor:
    """The whole tensor from every rank's part ``x`` (as :func:`shard` gave it), on every rank;
    ``dim`` grows ``W`` times. Differentiable: the gradient of a part is the sum over ranks of
    the gradients of the whole tensor's matching positions."""
    dim = _check_dim(x, dim)
    _, world = _world(group)
    _chunks(x.shape[dim] * world, world, layout)  # the layout's checks
    return _Unshard.apply(x, group, layout, dim)


def _assemble(parts: list[Tensor], layout: str, dim: int) -> Tensor:
    """The whole tensor from the ranks' parts, in rank order."""
    if layout == "contiguous":
        return torch.cat(parts, dim)
    # rank r holds chunks r and 2W - 1 - r: the first halves in rank order, then the second
    # halves in reverse rank order
    halves = [part.chunk(2, dim) for part in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, layout: str, dim: int) -> Tensor:
        ctx.group, ctx.layout, ctx.dim = group, layout, dim
        _, world = _world(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return _assemble(parts, layout, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # every rank used the whole tensor: a part's gradient sums theirs
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return shard(grad, group=ctx.group, layout=ctx.layout, dim=ctx.dim), None, None, None


# -- attention over a sharded sequence (ring attention) ------------------------------------


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnBias | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    group: Any = None,
    layout: str = "zigzag",
) -> Tensor:
    """:func:`attnbias.sdpa` over a sequence split across the ranks of ``group``.

    Every rank passes its part of the queries, keys and values along the sequence (dim 2, as
    :func:`shard` lays them out) and the same ``attn_mask``, a bias over the *whole* sequence
    (any bias: sums and ``ModBias`` included); each gets back its part of the output. The key
    and value parts travel around the ring of ranks (point-to-point, each transfer overlapped
    with the attention of the part in hand) and the partial outputs merge by their
    log-sum-exp; no rank ever holds the whole keys and values (memory ``O(S / W)`` per rank
    plus two parts in flight). Each pair of a query chunk and a key chunk is an ordinary call
    with the bias's block there (:meth:`AttnBias.sub_block`), planned among the backends that
    give the log-sum-exp (the Triton kernel, the exact eager path); a pair that keeps nothing
    is skipped, and a key/value part goes only to the ranks that keep some of its pairs.

    Differentiable: the backward sends the key/value parts around the ring again (recomputing
    each pair, not keeping them from the forward) and their gradients accumulate as they
    travel, back to the rank that owns them. Gradients are of the sum of every rank's loss:
    a rank's ``key.grad`` holds what every rank's queries send to its keys. A tensor of the
    bias that requires grad (ALiBi slopes, a :class:`TensorBias`, a ``ModBias`` table) gets on
    each rank the part of that gradient from its own queries, not summed across ranks: sum it
    over ``group`` (as data parallelism does for every other parameter) to get the whole.

    Args:
        query: ``(B, Hq, L / W, E)``, this rank's part of ``(B, Hq, L, E)``.
        key: ``(B, Hkv, S / W, E)``.
        value: ``(B, Hkv, S / W, Ev)``.
        attn_mask: a bias over the whole ``(L, S)`` (the same on every rank), or ``None``.
        dropout_p: must be 0 (dropout is not supported here).
        is_causal, scale, enable_gqa: as :func:`attnbias.sdpa` (``is_causal`` is upper-left
            over the whole sequence).
        group: the process group (``None``: the default group).
        layout: ``"zigzag"`` or ``"contiguous"``, how the sequence is split (:data:`LAYOUTS`).

    Returns:
        ``(B, Hq, L / W, Ev)``: this rank's rows of the whole attention output.

    Raises:
        RuntimeError: no initialised process group.
        TypeError / ValueError: as :func:`attnbias.sdpa` for this rank's tensors; a plain
            tensor ``attn_mask`` (pass a :class:`TensorBias` of the whole ``(L, S)``);
            ``dropout_p > 0``; a length the layout cannot split evenly (naming the length,
            ``W`` and the layout); ranks whose parts differ in shape, dtype or flags (naming
            each rank's).

    Under ``torch.compile`` the call runs eagerly, with a graph break around it: the ring's
    point-to-point transfers and its schedule, which depends on the bias's values, do not
    trace (``fullgraph=True`` refuses it).
    """
    return _ring_sdpa(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, group, layout
    )


@torch.compiler.disable(
    reason="attnbias.distributed.sdpa runs eagerly: its ring of point-to-point transfers "
    "and its schedule, which depends on the bias's values, does not trace"
)
def _ring_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    group: Any,
    layout: str,
) -> Tensor:
    rank, world = _world(group)
    # A rank that refuses its call still joins the one gather of the call, so that the others
    # learn it and raise too instead of waiting for it.
    try:
        local: _Local | None = _Local.make(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, rank, world,
            layout,
        )  # fmt: skip
        failure: Exception | None = None
    except (TypeError, ValueError) as error:
        local, failure = None, error
    summary = _Local.summary(local, world, _gather_device(group))
    gathered = [torch.empty_like(summary) for _ in range(world)]
    dist.all_gather(gathered, summary, group=group)
    rows = [g.tolist() for g in gathered]
    if failure is not None:
        raise failure
    refused = [r for r, row in enumerate(rows) if row[0]]
    if refused:
        raise ValueError(
            f"attnbias.distributed.sdpa: rank(s) {refused} of the group refused their part of "
            f"the call (their error says why); every rank must make the same call"
        )
    assert local is not None  # no failure here
    _check_agreement([row[1 : 1 + _HEADER] for row in rows])
    ring = _Ring.of(local, rows, group)
    return _RingAttention.apply(query, key, value, ring, *local.params)


# the header of a rank's summary: B, Hq, L / W, E of the query, B, Hkv, S / W, E of the key,
# Ev, the dtype, the layout, enable_gqa, whether the scale is the default
_HEADER = 13


@dataclass(frozen=True, eq=False)
class _Local:
    """This rank's call, checked: the bias over the whole call, and its chunk pairs per step
    with whether each may keep a pair (a bool, or a 0-d tensor not read yet)."""

    bias: AttnBias | None
    call: Call
    scale: float | None
    enable_gqa: bool
    needs_grad: bool
    params: tuple[Tensor, ...]
    header: list[int]
    pairs: list[list[_Pair]]
    keeps: list[bool | Tensor]

    @classmethod
    def make(
        cls,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Any,
        dropout_p: Any,
        is_causal: Any,
        scale: Any,
        enable_gqa: Any,
        rank: int,
        world: int,
        layout: str,
    ) -> _Local:
        if isinstance(attn_mask, Tensor):
            raise TypeError(
                "attnbias.distributed.sdpa takes a bias object over the whole sequence as "
                "attn_mask, not a plain tensor; wrap the whole (L, S) mask in "
                "attnbias.TensorBias"
            )
        if attn_mask is not None and not isinstance(attn_mask, AttnBias):
            raise TypeError(
                f"attnbias.distributed.sdpa: attn_mask must be an AttnBias over the whole "
                f"sequence or None, got {type(attn_mask).__name__}"
            )
        # this rank's tensors as an ordinary call; the bias is checked against the whole call
        dropout, scale = _validate(query, key, value, None, dropout_p, is_causal, scale, enable_gqa)
        if dropout != 0.0:
            raise ValueError(
                f"attnbias.distributed.sdpa: dropout_p={dropout_p!r} is not supported (each "
                f"shard pair would need the dropout mask of the whole sequence); pass 0.0"
            )
        if query.dtype not in _DTYPES:
            raise TypeError(f"attnbias.distributed.sdpa: dtype {query.dtype} is not supported")
        length_q, length_kv = query.shape[2] * world, key.shape[2] * world
        q_chunks = _chunks(length_q, world, layout)  # a length it cannot split: ValueError
        kv_chunks = _chunks(length_kv, world, layout)
        bias = with_causal(attn_mask, is_causal)
        batch, heads_q = query.shape[0], query.shape[1]
        call = Call(batch, heads_q, length_q, length_kv, query.device)
        if bias is not None:
            bias.validate_call(call)
        pairs: list[list[_Pair]] = []
        keeps: list[bool | Tensor] = []
        for step in range(world):
            step_pairs = []
            for row_start, (qa, qb) in _with_offsets(q_chunks[rank]):
                for col_start, (ka, kb) in _with_offsets(kv_chunks[(rank - step) % world]):
                    block = Block(qa, ka, qb - qa, kb - ka)
                    sub = None if bias is None else bias.sub_block(call, block)
                    step_pairs.append(
                        _Pair(slice(row_start, row_start + qb - qa),
                              slice(col_start, col_start + kb - ka), block, sub)
                    )  # fmt: skip
                    keeps.append(_may_keep(sub, call, block, query.dtype))
            pairs.append(step_pairs)
        header = [
            *query.shape, *key.shape, value.shape[-1], _DTYPES.index(query.dtype),
            LAYOUTS.index(layout), int(enable_gqa), int(scale is None),
        ]  # fmt: skip
        params = () if bias is None else bias.parameters()
        tensors = [query, key, value, *params]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return cls(bias, call, scale, enable_gqa, needs_grad, params, header, pairs, keeps)

    @staticmethod
    def summary(local: _Local | None, world: int, device: torch.device) -> Tensor:
        """What this rank tells the others, int64 of one size on every rank: whether it
        refused the call, its header, then whether each chunk pair may keep a pair (4 per
        step, the unused ones 0)."""
        if local is None:
            found = torch.zeros(1 + _HEADER + 4 * world, dtype=torch.int64, device=device)
            found[0] = 1
            return found
        flags = torch.stack(
            [torch.as_tensor(k, dtype=torch.bool).to(device) for k in local.keeps]
        ).to(torch.int64)
        return torch.cat(
            [
                torch.tensor([0, *local.header], dtype=torch.int64, device=device),
                flags,
                flags.new_zeros(4 * world - flags.numel()),
            ]
        )


@dataclass(frozen=True, eq=False)
class _Pair:
    """A query chunk and a key chunk: their rows in this rank's query part and in the
    key/value part in hand, and where they lie in the whole call."""

    rows: slice
    cols: slice
    block: Block
    sub: AttnBias | None  # the bias's block, made with the call (the forward's)


@dataclass(frozen=True, eq=False)
class _Ring:
    """One call's schedule, the same on every rank: which rank needs which key/value part at
    which step, where each part comes from, and this rank's chunk pairs per step.

    At step ``t`` rank ``r`` attends the part of rank ``(r - t) % W`` (its own at step 0).
    ``need[r][t]``: whether some chunk pair of that step may keep a pair."""

    rank: int
    world: int
    group: Any
    bias: AttnBias | None
    call: Call
    scale: float | None
    enable_gqa: bool
    needs_grad: bool
    need: list[list[bool]]
    pairs: list[list[_Pair]]  # this rank's, per step: those that may keep a pair

    @classmethod
    def of(cls, local: _Local, rows: list[list[int]], group: Any) -> _Ring:
        """The schedule from every rank's summary (``rows``, in rank order)."""
        rank, world = _world(group)
        per_step = len(local.keeps) // world
        start = 1 + _HEADER
        need = [
            [any(row[start + t * per_step : start + (t + 1) * per_step]) for t in range(world)]
            for row in rows
        ]
        mine = rows[rank][start:]
        pairs = [
            [p for i, p in enumerate(step_pairs) if mine[t * per_step + i]]
            for t, step_pairs in enumerate(local.pairs)
        ]
        return cls(
            rank, world, group, local.bias, local.call, local.scale, local.enable_gqa,
            local.needs_grad, need, pairs,
        )  # fmt: skip

    # -- who sends what, the same on every rank ----------------------------------------------

    def holds(self, rank: int, step: int) -> bool:
        """Whether ``rank`` has the part of step ``step`` in hand (its own at step 0)."""
        return step == 0 or self.need[rank % self.world][step]

    def source(self, rank: int, step: int) -> int:
        """Where ``rank`` gets the part of step ``step`` (>= 1) from: the rank before it in the
        ring if that one had it at the step before, else the part's owner."""
        before = (rank - 1) % self.world
        return before if self.holds(before, step - 1) else (rank - step) % self.world

    def continues(self, rank: int, step: int) -> bool:
        """Whether the part ``rank`` attends at step ``step`` goes on to the next rank, which
        then also takes its gradients accumulated so far."""
        return step + 1 < self.world and self.need[(rank + 1) % self.world][step + 1]

    def transfers(
        self, step: int, held: tuple[Tensor, ...] | None, own: tuple[Tensor, ...]
    ) -> tuple[list[Any], tuple[Tensor, ...] | None]:
        """The point-to-point operations that bring each rank the part of step ``step + 1``,
        posted at step ``step``; and this rank's receive buffers (``None``: it skips it)."""
        ops: list[Any] = []
        incoming = None
        nxt = step + 1
        if nxt >= self.world:
            return ops, incoming
        me = self.rank
        for receiver in range(self.world):
            if receiver == me or not self.need[receiver][nxt]:
                continue
            if self.source(receiver, nxt) != me:
                continue
            relay = (receiver - 1) % self.world == me and self.holds(me, step)
            tensors = held if relay and held is not None else own
            ops += _sends(tensors, receiver, self.group, _KV_TAG)
        if self.need[me][nxt]:
            incoming = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in own)
            ops += _receives(incoming, self.source(me, nxt), self.group, _KV_TAG)
        return ops, incoming

    def gradient_transfers(
        self, step: int, finished: tuple[Tensor, ...] | None, template: tuple[Tensor, ...]
    ) -> tuple[list[Any], tuple[Tensor, ...] | None, list[tuple[Tensor, ...]]]:
        """The point-to-point operations, posted at step ``step``, that move the key/value
        gradients accumulated at step ``step - 1``: on to the next rank while the part goes
        on there, else home to the part's owner. ``finished``: this rank's accumulated
        gradients of step ``step - 1`` (``None`` if it attended nothing then). Returns the
        operations, the buffers of the gradients this rank takes over for step ``step`` and
        those of its own part coming home."""
        ops: list[Any] = []
        me, world = self.rank, self.world
        before = step - 1
        if finished is not None and before >= 1:
            owner = (me - before) % world
            peer = (me + 1) % world if self.continues(me, before) else owner
            ops += _sends(finished, peer, self.group, _GRAD_TAG)
        taken = None
        if step < world and self.need[me][step] and before >= 1:
            previous = (me - 1) % world
            if self.need[previous][before]:  # it attended this part at the step before
                taken = tuple(torch.empty_like(t) for t in template)
                ops += _receives(taken, previous, self.group, _GRAD_TAG)
        home: list[tuple[Tensor, ...]] = []
        if before >= 1:
            sender = (me + before) % world  # attended this rank's part at step ``before``
            if self.need[sender][before] and not self.continues(sender, before):
                buffers = tuple(torch.empty_like(t) for t in template)
                ops += _receives(buffers, sender, self.group, _GRAD_TAG)
                home.append(buffers)
        return ops, taken, home

    # -- the shard pairs -----------------------------------------------------------------------

    def plan_pair(
        self, query: Tensor, key: Tensor, value: Tensor, pair: _Pair, *, backward: bool = False
    ) -> Plan:
        """The planned call of a chunk pair: with the block's bias made with the call, or in
        the ``backward`` made again (under grad mode there, so that the gradients of the
        block's tensors reach the bias's own)."""
        sub = pair.sub
        if backward and self.bias is not None:
            sub = self.bias.sub_block(self.call, pair.block)
        spec = make_spec(
            query[:, :, pair.rows],
            key[:, :, pair.cols],
            value[:, :, pair.cols],
            sub,
            False,
            self.scale,
            0.0,
            self.enable_gqa,
            needs_lse=True,
        )
        return plan(dataclasses.replace(spec, needs_grad=self.needs_grad))


class _RingAttention(torch.autograd.Function):
    """Ring attention with the bias's tensors as inputs of their own (their gradients)."""

    @staticmethod
    def forward(
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, ring: _Ring, *params: Tensor
    ) -> Tensor:
        compute = compute_dtype(query.dtype)
        batch, heads_q, part_q, _ = query.shape
        out = torch.zeros(
            batch, heads_q, part_q, value.shape[-1], dtype=compute, device=query.device
        )
        lse = torch.full((batch, heads_q, part_q), -float("inf"), dtype=compute,
                         device=query.device)  # fmt: skip
        own = (key, value)
        held: tuple[Tensor, ...] | None = own
        for step in range(ring.world):
            ops, incoming = ring.transfers(step, held, own)
            works = _start(ops)
            if held is not None and ring.need[ring.rank][step]:
                for pair in ring.pairs[step]:
                    chosen = ring.plan_pair(query, held[0], held[1], pair)
                    pair_out, pair_lse = chosen.backend.forward_lse(chosen.spec)
                    _merge(out, lse, pair.rows, pair_out, pair_lse)
            _wait(works)
            held = incoming
        result = out.to(query.dtype)
        ctx.ring = ring
        ctx.save_for_backward(query, key, value, result, lse, *params)
        return result

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # asked to build a graph of the gradients
            raise RuntimeError(
                "attnbias.distributed.sdpa: double backward (create_graph=True) is not "
                "supported: the ring's gradients are not themselves differentiable"
            )
        ring: _Ring = ctx.ring
        query, key, value, out, lse, *params = ctx.saved_tensors
        compute = compute_dtype(query.dtype)
        grad_q = torch.zeros(query.shape, dtype=compute, device=query.device)
        grad_own = [torch.zeros(t.shape, dtype=compute, device=t.device) for t in (key, value)]
        grad_params: list[Tensor | None] = [None] * len(params)
        own = (key, value)
        template = tuple(grad_own)
        held: tuple[Tensor, ...] | None = own
        finished: tuple[Tensor, ...] | None = None
        for step in range(ring.world + 1):
            ops, incoming = ring.transfers(step, held, own)
            grad_ops, taken, home = ring.gradient_transfers(step, finished, template)
            works = _start(ops + grad_ops)
            finished = None
            if step < ring.world and held is not None and ring.need[ring.rank][step]:
                grad_k = torch.zeros(held[0].shape, dtype=compute, device=query.device)
                grad_v = torch.zeros(held[1].shape, dtype=compute, device=query.device)
                for pair in ring.pairs[step]:
                    with torch.enable_grad():
                        chosen = ring.plan_pair(query, held[0], held[1], pair, backward=True)
                    dq, dk, dv, dparams = chosen.backend.backward_lse(
                        chosen.spec,
                        grad_out[:, :, pair.rows],
                        out[:, :, pair.rows],
                        lse[:, :, pair.rows],
                        params,
                    )
                    grad_q[:, :, pair.rows] += dq
                    grad_k[:, :, pair.cols] += dk
                    grad_v[:, :, pair.cols] += dv
                    for i, grad in enumerate(dparams):
                        if grad is not None:
                            total = grad_params[i]
                            grad_params[i] = grad if total is None else total + grad
                if step == 0:
                    grad_own[0] += grad_k
                    grad_own[1] += grad_v
                else:
                    finished = (grad_k, grad_v)
            _wait(works)
            if finished is not None and taken is not None:
                finished = (finished[0] + taken[0], finished[1] + taken[1])
            for buffers in home:
                grad_own[0] += buffers[0]
                grad_own[1] += buffers[1]
            held = incoming
        return (
            grad_q.to(query.dtype),
            grad_own[0].to(key.dtype),
            grad_own[1].to(value.dtype),
            None,
            *(
                None if g is None else g.to(p.dtype)
                for g, p in zip(grad_params, params, strict=True)
            ),
        )


def _merge(out: Tensor, lse: Tensor, rows: slice, part_out: Tensor, part_lse: Tensor) -> None:
    """Merge a partial result (``part_out`` ``(B, Hq, m, Ev)``, ``part_lse`` ``(B, Hq, m)``)
    into ``out`` / ``lse`` at ``rows``, in place: the log-sum-exp weighted mean. Rows that
    keep nothing in both stay 0 and ``-inf``; a NaN row stays NaN."""
    current_out, current_lse = out[:, :, rows], lse[:, :, rows]
    part_lse = part_lse.to(lse.dtype)
    merged = torch.logaddexp(current_lse, part_lse)
    finite = torch.where(torch.isfinite(merged), merged, torch.zeros((), dtype=merged.dtype))
    weight = torch.exp(current_lse - finite)[..., None]
    part_weight = torch.exp(part_lse - finite)[..., None]
    out[:, :, rows] = current_out * weight + part_out.to(out.dtype) * part_weight
    lse[:, :, rows] = merged


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KV_TAG = 0
_GRAD_TAG = 2


def _with_offsets(chunks: list[tuple[int, int]]) -> list[tuple[int, tuple[int, int]]]:
    """Each chunk with its first row in the rank's part."""
    found, start = [], 0
    for a, b in chunks:
        found.append((start, (a, b)))
        start += b - a
    return found


def _gather_device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the current CUDA device for NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_agreement(headers: list[list[int]]) -> None:
    if all(h == headers[0] for h in headers):
        return

    def describe(h: list[int]) -> str:
        return (
            f"query {tuple(h[0:4])}, key {tuple(h[4:8])}, Ev={h[8]}, "
            f"{_DTYPES[h[9]] if 0 <= h[9] < len(_DTYPES) else '?'}, layout="
            f"{LAYOUTS[h[10]]!r}, enable_gqa={bool(h[11])}, scale {'default' if h[12] else 'given'}"
        )

    lines = "; ".join(f"rank {r}: {describe(h)}" for r, h in enumerate(headers))
    raise ValueError(
        f"attnbias.distributed.sdpa: the ranks' parts do not match ({lines}); every rank must "
        f"pass parts of the same shape and dtype ((B, H, L / W, E), as shard() gives) and the "
        f"same flags"
    )


def _may_keep(sub: AttnBias | None, call: Call, block: Block, dtype: torch.dtype) -> bool | Tensor:
    """Whether ``block`` of ``call`` may keep a pair under ``sub``, the bias's block: from its
    lowered terms (bands, key ranges, documents), and for generated masks and materialized
    parts from their keep-mask on the block (``False`` only when it surely keeps none)."""
    if sub is None:
        return True
    terms = lower(sub, block.length_q, block.length_kv, call.device, batch=call.batch)
    found = terms.may_keep(block.length_q, block.length_kv)
    if found is False:
        return False
    parts = [p for p in (*terms.mods, *terms.others) if isinstance(p, AttnBias)]
    if not parts:
        return found
    shape = (call.batch_size, call.heads, block.length_q, block.length_kv)
    keep: Tensor | None = None
    for part in parts:
        part_keep = part.masked(call.device, shape, dtype).keep
        if part_keep is not None:
            keep = part_keep if keep is None else keep & part_keep
    if keep is None:
        return found
    return keep.any() if found is True else found & keep.any()


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


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()

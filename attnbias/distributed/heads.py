"""The head-parallel mode of context parallelism (all-to-all, as DeepSpeed-Ulysses).

Each of the group's ``W`` ranks holds its part of the sequence for every head. Two all-to-all
exchanges turn that around and back: rank ``r`` gets the whole sequence of the query heads
``[r * Hq / W, (r + 1) * Hq / W)`` (and of the key/value heads they use), runs the
single-process :func:`attnbias.sdpa` on it with the bias of those heads
(:meth:`attnbias.AttnBias.sub_heads`), and the outputs go back to the sequence parts. Every
bias that has a head form runs so, learnable tables included; nothing is merged by
log-sum-exp and no rank holds the whole sequence of more than ``Hq / W`` heads.

Shape legend:

    B   batch size              L   query sequence length (whole), L / W on a rank
    Hq  query heads             S   key/value sequence length (whole), S / W on a rank
    Hkv key/value heads         E   head dimension (Ev: of the values)
    W   ranks in the group

Key/value heads (GQA maps query head ``h`` to key/value head ``h // (Hq / Hkv)``): with
``Hkv >= W`` each rank gets its ``Hkv / W`` heads; with fewer key/value heads than ranks, each
key/value head goes to every rank whose query heads use it, so the exchange keeps equal splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnbias.biases import AttnBias, parts_of
from attnbias.distributed.layouts import Layout, as_group, world_of
from attnbias.functional import sdpa
from attnbias.terms import Call

__all__ = ["MAX_CHUNKS", "chunk_count", "heads_reasons", "heads_sdpa"]


def heads_reasons(call_heads_q: int, heads_kv: int, world: int, bias: AttnBias | None) -> list[str]:
    """Why the head mode cannot run a call of ``Hq=call_heads_q`` query heads and
    ``Hkv=heads_kv`` key/value heads with ``bias`` over ``W=world`` ranks; empty where it can.

    Each reason names the values and what would make the mode possible."""
    reasons = []
    heads_q = call_heads_q
    if heads_q < 1 or heads_kv < 1:
        reasons.append(
            f"Hq={heads_q} and Hkv={heads_kv}: the head mode splits the heads over the ranks "
            f"and needs at least one of each"
        )
        return reasons
    if heads_q % world:
        reasons.append(
            f"Hq={heads_q} is not a multiple of W={world}: each rank takes Hq / W query heads; "
            f"use a group whose size divides {heads_q}, or the sequence mode"
        )
    elif heads_q % heads_kv == 0:
        per_rank, group_size = heads_q // world, heads_q // heads_kv
        if per_rank % group_size and group_size % per_rank:
            reasons.append(
                f"Hq={heads_q}, Hkv={heads_kv} over W={world}: each rank's {per_rank} query "
                f"heads would use a part of the {group_size} query heads that share a "
                f"key/value head, so ranks would split a key/value head between them; the head "
                f"mode needs (Hq / W) % (Hq / Hkv) == 0 or (Hq / Hkv) % (Hq / W) == 0 (a group "
                f"size that divides Hkv or is a multiple of it), or the sequence mode"
            )
    for part in parts_of(bias):
        kind = type(part)
        if kind.sub_heads is AttnBias.sub_heads and kind.materialize is AttnBias.materialize:
            reasons.append(
                f"{kind.__name__} has no head form: it neither materializes nor gives the bias "
                f"of a range of heads; implement {kind.__name__}.sub_heads(call, start, count) "
                f"or materialize(), or use the sequence mode"
            )
    return reasons


def heads_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None,
    *,
    scale: float | None,
    enable_gqa: bool,
    group: Any,
    layout: Layout,
) -> Tensor:
    """Attention over the whole sequence from each rank's part of it, the heads split over
    the ranks of ``group`` (``None``: the default group).

    The call must be one :func:`heads_reasons` accepts and validated as a whole: ``bias``
    over the whole ``(L, S)`` sequence, the same on every rank, ``is_causal`` folded in.

    Each rank's heads run in up to :data:`MAX_CHUNKS` groups (:func:`chunk_count`), so that
    the exchanges of one group overlap the attention of another: every group's queries, keys
    and values are sent at once, each group's attention starts when its own have arrived, and
    its output leaves while the next group computes; the backward likewise.

    Args:
        query: this rank's part ``(B, Hq, L / W, E)``, laid out by ``layout``.
        key: ``(B, Hkv, S / W, E)``, likewise.
        value: ``(B, Hkv, S / W, Ev)``, likewise.
        bias: the bias of the whole call, or ``None``.
        scale: score scale, ``None`` for ``1 / sqrt(E)``.
        enable_gqa: whether ``Hkv < Hq`` is allowed (the caller checked it with the shapes;
            each rank's call sets its own from the heads it holds).
        group: the process group (or ``None``).
        layout: how the sequence is split across the ranks.

    Returns:
        This rank's part of the output, ``(B, Hq, L / W, Ev)`` in ``layout``'s order.
        Differentiable (once) in the inputs and in the bias's tensors; a bias tensor's
        gradient on a rank holds that rank's heads' entries (summed over the group: the whole
        gradient).
    """
    del enable_gqa  # each rank's call sets its own from the heads it holds
    group = as_group(group)
    rank, world = world_of(group)
    params = () if bias is None else tuple(bias.parameters())
    plan = _Plan(bias, scale, group, rank, world, layout)
    result: Tensor = _HeadsAttention.apply(query, key, value, plan, *params)
    return result


#: The most groups a rank's heads are run in (the exchanges of one overlap another's work).
MAX_CHUNKS = 4
#: On a GPU, a group holds at least this many query rows (heads x batch x L), so that its
#: attention fills the device.
MIN_CHUNK_ROWS = 65536


def chunk_count(heads_q: int, heads_kv: int, rows: int, on_gpu: bool) -> int:
    """How many groups a rank's ``heads_q`` query heads (and ``heads_kv`` key/value heads,
    after GQA's replication) run in: the largest divisor of both that is at most
    :data:`MAX_CHUNKS` and, on a GPU, leaves each group ``MIN_CHUNK_ROWS`` query rows
    (``rows``: batch x whole query length)."""
    common = math.gcd(heads_q, heads_kv)
    for count in range(min(MAX_CHUNKS, common), 1, -1):
        if common % count == 0 and (not on_gpu or heads_q // count * rows >= MIN_CHUNK_ROWS):
            return count
    return 1


@dataclass
class _Plan:
    """What :class:`_HeadsAttention` needs besides its tensors; the forward keeps each
    group's graph here for the backward."""

    bias: AttnBias | None
    scale: float | None
    group: Any
    rank: int
    world: int
    layout: Layout
    graphs: list[tuple[Tensor, list[Tensor]]] = field(default_factory=list)


class _HeadsAttention(torch.autograd.Function):
    """The head mode's forward and backward, pipelined over groups of heads, with the bias's
    tensors as inputs of their own (their gradients)."""

    @staticmethod
    def forward(
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, plan: _Plan, *params: Tensor
    ) -> Tensor:
        world, layout, group = plan.world, plan.layout, plan.group
        batch, heads_q, part_q, _ = query.shape
        per_rank = heads_q // world
        q_by = _by_head(query, world)  # (W, B, Hq / W, L / W, E)
        k_by, v_by = (_by_head(_kv_for_ranks(t, world), world) for t in (key, value))
        heads_kv = k_by.shape[2]
        count = chunk_count(per_rank, heads_kv, batch * part_q * world, query.is_cuda)
        step_q, step_kv = per_rank // count, heads_kv // count
        call = Call(batch, heads_q, part_q * world, key.shape[2] * world, query.device)
        needs_grad = any(ctx.needs_input_grad)
        # every group's exchange at once; each group's attention waits for its own only
        sent = [
            [
                _Exchange(x[:, :, g * step : (g + 1) * step], group)
                for x, step in ((q_by, step_q), (k_by, step_kv), (v_by, step_kv))
            ]
            for g in range(count)
        ]
        back = []
        for g in range(count):
            whole = [layout.assemble(list(e.result().unbind(0)), 2) for e in sent[g]]
            if needs_grad:
                whole = [t.requires_grad_() for t in whole]
            start = plan.rank * per_rank + g * step_q
            with torch.enable_grad():
                own = None if plan.bias is None else plan.bias.sub_heads(call, start, step_q)
                out = sdpa(
                    whole[0],
                    whole[1],
                    whole[2],
                    attn_mask=own,
                    scale=plan.scale,
                    enable_gqa=step_kv != step_q,
                )
            if needs_grad:
                plan.graphs.append((out, whole))
            # (W, B, Hq / W / count, L / W, Ev): rank j's part of the sequence, these heads
            parts = torch.stack([layout.take(out.detach(), j, 2) for j in range(world)])
            back.append(_Exchange(parts, group))
        # received[j]: this rank's part of the sequence for rank j's heads
        received = torch.cat([e.result() for e in back], 2)
        ctx.plan, ctx.count = plan, count
        ctx.shapes = (query.shape, key.shape, value.shape)
        ctx.save_for_backward(*params)
        return received.transpose(0, 1).reshape(batch, heads_q, part_q, received.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # asked to build a graph of the gradients
            raise RuntimeError(
                "attnbias.distributed.sdpa: double backward (create_graph=True) is not "
                "supported: the head mode's gradients are not themselves differentiable"
            )
        plan: _Plan = ctx.plan
        params = ctx.saved_tensors
        world, layout, group, count = plan.world, plan.layout, plan.group, ctx.count
        wanted = [p for p in params if p.requires_grad]
        by_head = _by_head(grad_out, world)
        step_q = by_head.shape[2] // count
        sent = [
            _Exchange(by_head[:, :, g * step_q : (g + 1) * step_q], group) for g in range(count)
        ]
        back: list[list[_Exchange]] = []
        grad_params: list[Tensor | None] = [None] * len(wanted)
        for g, (out, whole) in enumerate(plan.graphs):
            grad = layout.assemble(list(sent[g].result().unbind(0)), 2)
            grads = torch.autograd.grad(out, [*whole, *wanted], grad, allow_unused=True)
            inputs = [torch.zeros_like(t) if d is None else d
                      for t, d in zip(whole, grads[:3], strict=True)]  # fmt: skip
            back.append(
                [
                    _Exchange(torch.stack([layout.take(t, j, 2) for j in range(world)]), group)
                    for t in inputs
                ]
            )
            for i, found in enumerate(grads[3:]):
                if found is not None:
                    total = grad_params[i]
                    grad_params[i] = found if total is None else total + found
        plan.graphs.clear()
        shape_q, shape_k, shape_v = ctx.shapes
        results = [torch.cat([b[i].result() for b in back], 2) for i in range(3)]
        grad_q = _from_by_head(results[0], shape_q[1])
        grad_k = _from_by_head(results[1], shape_k[1])
        grad_v = _from_by_head(results[2], shape_v[1])
        found_params = iter(grad_params)
        return (
            grad_q,
            grad_k,
            grad_v,
            None,
            *(next(found_params) if p.requires_grad else None for p in params),
        )


class _Exchange:
    """An all-to-all started now: ``result()[j]`` is rank ``j``'s ``x[rank]``, for ``x`` of
    shape ``(W, ...)``. On a GPU the exchange runs on the communication stream, beside the
    work queued after it; ``result()`` makes the current stream wait for it."""

    def __init__(self, x: Tensor, group: Any) -> None:
        self.input = x.contiguous()
        self.output = torch.empty_like(self.input)
        self.work = dist.all_to_all_single(self.output, self.input, group=group, async_op=True)

    def result(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.output


def _by_head(x: Tensor, world: int) -> Tensor:
    """``(B, H, n, E)`` as ``(W, B, H / W, n, E)``: the heads for each rank, in rank order."""
    batch, heads, length, dim = x.shape
    return x.reshape(batch, world, heads // world, length, dim).transpose(0, 1)


def _kv_for_ranks(x: Tensor, world: int) -> Tensor:
    """Key/value heads ``(B, Hkv, n, E)`` laid out for :func:`_by_head`: as they are where
    each rank takes ``Hkv / W`` whole heads; with fewer heads than ranks (``Hq / Hkv`` a
    multiple of ``Hq / W``, so every rank's query heads use one key/value head), each head
    repeated for the ``W / Hkv`` ranks that use it, ``(B, W, n, E)``."""
    batch, heads, length, dim = x.shape
    if heads >= world:
        return x
    copies = world // heads
    # the backward of expand sums the copies' gradients
    return (
        x[:, :, None].expand(batch, heads, copies, length, dim).reshape(batch, world, length, dim)
    )


def _from_by_head(x: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`_by_head` and :func:`_kv_for_ranks`: ``(W, B, h, n, E)`` as
    ``(B, heads, n, E)``, the copies of a key/value head replicated for several ranks summed."""
    world, batch, per_rank, length, dim = x.shape
    whole = x.transpose(0, 1).reshape(batch, world * per_rank, length, dim)
    if heads >= world:
        return whole
    return whole.view(batch, heads, world // heads, length, dim).sum(2)

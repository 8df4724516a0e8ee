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

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnbias.biases import AttnBias, parts_of
from attnbias.distributed.blocks import Kept
from attnbias.distributed.layouts import Layout, as_group, world_of
from attnbias.functional import sdpa
from attnbias.terms import Call

__all__ = ["heads_reasons", "heads_sdpa"]


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
    before_exchange: Callable[[], None] | None = None,
) -> Tensor:
    """Attention over the whole sequence from each rank's part of it, the heads split over
    the ranks of ``group`` (``None``: the default group).

    The call must be one :func:`heads_reasons` accepts and validated as a whole: ``bias``
    over the whole ``(L, S)`` sequence, the same on every rank, ``is_causal`` folded in.

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
        before_exchange: called once after this rank's parts are packed for the first
            exchange and before it starts (the wait for the ranks' agreement on the call, so
            that the packing's launches overlap its round trip); it may raise.

    Returns:
        This rank's part of the output, ``(B, Hq, L / W, Ev)`` in ``layout``'s order.
        Differentiable in the inputs and in the bias's tensors; a bias tensor's gradient on
        a rank holds that rank's heads' entries (summed over the group: the whole gradient).
    """
    group = as_group(group)
    rank, world = world_of(group)
    batch, heads_q, part_q, _ = query.shape
    part_kv = key.shape[2]
    per_rank = heads_q // world
    key, value = _kv_for_ranks(key, world), _kv_for_ranks(value, world)
    call = Call(batch, heads_q, part_q * world, part_kv * world, query.device)
    own = None if bias is None else bias.sub_heads(call, rank * per_rank, per_rank)
    if part_q == part_kv:  # q, k and v in one exchange (and their gradients in one, back)
        whole_q, whole_k, whole_v = _ToHeads.apply(group, layout, before_exchange, query, key,
                                                   value)  # fmt: skip
    else:
        (whole_q,) = _ToHeads.apply(group, layout, before_exchange, query)
        whole_k, whole_v = _ToHeads.apply(group, layout, None, key, value)
    out = sdpa(
        whole_q,
        whole_k,
        whole_v,
        attn_mask=own,
        scale=scale,
        enable_gqa=whole_k.shape[1] != per_rank,
    )
    (result,) = _FromHeads.apply(group, layout, out)
    return result


def _kv_for_ranks(x: Tensor, world: int) -> Tensor:
    """Key/value heads ``(B, Hkv, n, E)`` as each rank's share of them: as they are where
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


# The exchanges move rows: a row is one position of the sequence, of one batch entry, with
# the features of one rank's heads of every tensor exchanged laid end to end (``F`` of them).
# The whole sequence for a rank's heads is kept position-major, ``(S, B, F)``, so that each
# chunk of the layout is one contiguous stretch of it: the exchange writes every rank's chunks
# straight where they belong (one all-to-all per chunk a rank holds), and the attention reads
# ``(B, H / W, S, E)`` views of it with the sequence as the outer stride, as it reads
# ``(B, S, H, E)`` tensors. Layouts of more chunks per rank than ``_DIRECT`` exchange in one
# all-to-all and put the rows in order with one indexed copy.
_DIRECT = 2


class _ToHeads(torch.autograd.Function):
    """Rank parts ``(B, H, n, E)`` of one or more tensors (the same ``B`` and ``n``, one
    dtype) to views ``(B, H / W, S, E)`` of the whole sequence for this rank's heads, all in
    one exchange. Its adjoint is :class:`_FromHeads`, which its backward applies (so that
    double backward runs through it too)."""

    @staticmethod
    def forward(
        ctx: Any,
        group: Any,
        layout: Layout,
        before_exchange: Callable[[], None] | None,
        *parts: Tensor,
    ) -> tuple[Tensor, ...]:
        world = layout.world
        ctx.group, ctx.layout = group, layout
        shapes = [tuple(p.shape) for p in parts]
        length = parts[0].shape[2] * world
        packed = _pack_heads(parts, world)
        if before_exchange is not None:
            before_exchange()
        whole = _to_whole(packed, length, layout, group)
        return tuple(_whole_views(whole, shapes, world))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, None, *_FromHeads.apply(ctx.group, ctx.layout, *grads))


class _FromHeads(torch.autograd.Function):
    """Views ``(B, H / W, S, E)`` of the whole sequence for this rank's heads (the output, or
    the gradients of :class:`_ToHeads`' views), one or more of one dtype, back to this rank's
    parts ``(B, H, n, E)`` of every head, in one exchange. Its adjoint is :class:`_ToHeads`."""

    @staticmethod
    def forward(ctx: Any, group: Any, layout: Layout, *wholes: Tensor) -> tuple[Tensor, ...]:
        world = layout.world
        ctx.group, ctx.layout = group, layout
        shapes: list[tuple[int, ...]] = [
            (b, h * world, s // world, e) for b, h, s, e in (w.shape for w in wholes)
        ]
        if len(wholes) == 1:  # no copy where it is (B, S, H, E) in memory with B = 1
            rows = wholes[0].permute(2, 0, 1, 3).contiguous().flatten(2)
        else:
            batch, _, length, _ = wholes[0].shape
            width = sum(w.shape[1] * w.shape[3] for w in wholes)
            rows = wholes[0].new_empty((length, batch, width))
            for view, whole in zip(_whole_views(rows, shapes, world), wholes, strict=True):
                view.copy_(whole)
        return tuple(_unpack_heads(_to_parts(rows, layout, group), shapes, world))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        return (None, None, *_ToHeads.apply(ctx.group, ctx.layout, None, *grads))


def _pack_heads(parts: tuple[Tensor, ...], world: int) -> Tensor:
    """``(W, n, B, F)``: for each rank ``j``, this rank's ``n`` positions of rank ``j``'s heads
    (of every tensor of ``parts``, each ``(B, H, n, E)``), one copy per tensor."""
    batch, _, length, _ = parts[0].shape
    widths = [p.shape[1] // world * p.shape[3] for p in parts]
    packed = parts[0].new_empty((world, length, batch, sum(widths)))
    start = 0
    for part, width in zip(parts, widths, strict=True):
        heads, dim = part.shape[1] // world, part.shape[3]
        target = packed[..., start : start + width].unflatten(-1, (heads, dim))
        target.copy_(part.unflatten(1, (world, heads)).permute(1, 3, 0, 2, 4))
        start += width
    return packed


def _unpack_heads(received: Tensor, shapes: list[tuple[int, ...]], world: int) -> list[Tensor]:
    """The inverse of :func:`_pack_heads`: ``received`` ``(W, n, B, F)`` (for each rank ``j``,
    rank ``j``'s heads of this rank's positions) as new tensors of ``shapes``."""
    found, start = [], 0
    for batch, heads, length, dim in shapes:
        per_rank = heads // world
        width = per_rank * dim
        part = received.new_empty((batch, heads, length, dim))
        source = received[..., start : start + width].unflatten(-1, (per_rank, dim))
        part.unflatten(1, (world, per_rank)).permute(1, 3, 0, 2, 4).copy_(source)
        found.append(part)
        start += width
    return found


def _whole_views(whole: Tensor, shapes: list[tuple[int, ...]], world: int) -> list[Tensor]:
    """The ``(B, H / W, S, E)`` views of the position-major ``whole`` ``(S, B, F)``, one per
    tensor of ``shapes`` (parts ``(B, H, n, E)``)."""
    views, start = [], 0
    for _, heads, _, dim in shapes:
        width = heads // world * dim
        views.append(
            whole[..., start : start + width].unflatten(-1, (heads // world, dim))
            .permute(1, 2, 0, 3)
        )  # fmt: skip
        start += width
    return views


def _to_whole(packed: Tensor, length: int, layout: Layout, group: Any) -> Tensor:
    """``(S, B, F)``: the whole sequence's rows for this rank's heads, from every rank's
    ``packed`` ``(W, n, B, F)`` (:func:`_pack_heads`)."""
    whole = packed.new_empty((length, *packed.shape[2:]))
    size = layout.chunk_size(length)
    held = len(layout.chunks[0])
    if held <= _DIRECT:
        for i in range(held):
            _all_to_all(
                [whole[c * size : (c + 1) * size] for c in (held_[i] for held_ in layout.chunks)],
                list(packed[:, i * size : (i + 1) * size].unbind(0)),
                group,
            )
        return whole
    received = torch.empty_like(packed)
    dist.all_to_all_single(received, packed, group=group)
    return whole.index_copy_(0, _order(layout, length, packed.device), received.flatten(0, 1))


def _to_parts(rows: Tensor, layout: Layout, group: Any) -> Tensor:
    """``(W, n, B, F)``: for each rank ``j``, rank ``j``'s rows of this rank's part, from this
    rank's rows of the whole sequence ``rows`` ``(S, B, F)`` (contiguous)."""
    world, length = layout.world, rows.shape[0]
    received = rows.new_empty((world, length // world, *rows.shape[1:]))
    size = layout.chunk_size(length)
    held = len(layout.chunks[0])
    if held <= _DIRECT:
        for i in range(held):
            _all_to_all(
                list(received[:, i * size : (i + 1) * size].unbind(0)),
                [rows[c * size : (c + 1) * size] for c in (held_[i] for held_ in layout.chunks)],
                group,
            )
        return received
    ordered = rows.index_select(0, _order(layout, length, rows.device)).unflatten(0, (world, -1))
    dist.all_to_all_single(received, ordered, group=group)
    return received


def _all_to_all(outputs: list[Tensor], inputs: list[Tensor], group: Any) -> None:
    """``outputs[j]`` = rank ``j``'s ``inputs[rank]`` (contiguous tensors). Over NCCL this
    rank's own share is copied here, not sent through the collective, which would move it
    through the same channels as the others' at their bandwidth (on two ranks, half of what
    it carries); gloo takes tensors of one size only."""
    if dist.get_backend(group) != "nccl":
        dist.all_to_all(outputs, inputs, group=group)
        return
    me = dist.get_rank(group)
    outputs[me].copy_(inputs[me])
    nothing = inputs[me].new_empty(0)
    dist.all_to_all(
        [nothing if j == me else out for j, out in enumerate(outputs)],
        [nothing if j == me else x for j, x in enumerate(inputs)],
        group=group,
    )


_ORDERS: Kept[Tensor] = Kept(16)


def _order(layout: Layout, length: int, device: torch.device) -> Tensor:
    """The positions of every rank's part, in rank order (int64, ``(S,)``), kept per layout,
    length and device."""
    key = (layout, length, device)
    found = _ORDERS.get(key)
    if found is None:
        positions = [layout.positions(r, length) for r in range(layout.world)]
        found = _ORDERS.put(key, torch.cat(positions).to(device))
    return found

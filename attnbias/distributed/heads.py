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

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnbias.biases import AttnBias, parts_of
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
    # q, k and v in one exchange (and their gradients in one, back)
    whole_q, whole_k, whole_v = (
        layout.assemble(list(received.unbind(0)), 2)
        for received in _AllToAllMany.apply(
            group,
            _by_head(query, world),
            _by_head(_kv_for_ranks(key, world), world),
            _by_head(_kv_for_ranks(value, world), world),
        )
    )
    call = Call(batch, heads_q, part_q * world, part_kv * world, query.device)
    own = None if bias is None else bias.sub_heads(call, rank * per_rank, per_rank)
    out = sdpa(
        whole_q,
        whole_k,
        whole_v,
        attn_mask=own,
        scale=scale,
        enable_gqa=whole_k.shape[1] != per_rank,
    )
    # (W, B, Hq / W, L / W, Ev): rank j's part of the sequence, for this rank's heads
    parts = torch.stack([layout.take(out, j, 2) for j in range(world)])
    back = _AllToAll.apply(parts, group)
    # back[j]: this rank's part of the sequence for rank j's heads, in head order
    return back.transpose(0, 1).reshape(batch, heads_q, part_q, out.shape[-1])


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


class _AllToAll(torch.autograd.Function):
    """``out[j]`` = rank ``j``'s ``x[rank]``, for ``x`` of shape ``(W, ...)``. The exchange is
    its own adjoint: the gradient goes back by the same exchange (differentiable too, so
    double backward reaches the single-process call)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None]:
        return _AllToAll.apply(grad, ctx.group), None


class _AllToAllMany(torch.autograd.Function):
    """:class:`_AllToAll` of several ``(W, ...)`` tensors of one dtype in one exchange: each
    rank's share of every tensor laid end to end in one buffer (one collective instead of
    one per tensor, each with its fixed cost). Its own adjoint, as :class:`_AllToAll`."""

    @staticmethod
    def forward(ctx: Any, group: Any, *xs: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        return _exchange_many(xs, group)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        # (an output without a gradient gets zeros: autograd materializes them)
        return (None, *_AllToAllMany.apply(ctx.group, *grads))


def _exchange_many(xs: tuple[Tensor, ...], group: Any) -> tuple[Tensor, ...]:
    """``found[i][j]`` = rank ``j``'s ``xs[i][rank]``, through one buffer each way."""
    world = xs[0].shape[0]
    sizes = [x[0].numel() for x in xs]
    packed = torch.empty((world, sum(sizes)), dtype=xs[0].dtype, device=xs[0].device)
    start = 0
    for x, size in zip(xs, sizes, strict=True):
        packed[:, start : start + size].unflatten(1, x.shape[1:]).copy_(x)
        start += size
    out = torch.empty_like(packed)
    dist.all_to_all_single(out, packed, group=group)
    found, start = [], 0
    for x, size in zip(xs, sizes, strict=True):
        found.append(out[:, start : start + size].unflatten(1, x.shape[1:]))
        start += size
    return tuple(found)


def _exchange(x: Tensor, group: Any) -> Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out

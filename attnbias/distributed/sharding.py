"""Tensors between the whole sequence and the ranks' parts: :func:`shard`, :func:`unshard`,
:func:`positions`, and the layout a bias balances best (:func:`layout_for`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnbias.biases import AttnBias
from attnbias.terms import Call

from .blocks import Kept, candidate_layouts, grain, keep_grid
from .exchange import exchanged_runs, received_positions
from .layouts import LAYOUTS, Layout, as_group, check_dim, world_of
from .model import StepShape, sequence_seconds

__all__ = ["layout_for", "positions", "resolve_layout", "shard", "unshard"]

#: The call ``layout="auto"`` predicts for: heads (query and key/value), head dim and element
#: bytes (bf16), one batch row, forward + backward. The layout depends on the bias and the
#: lengths only, so every rank, and :func:`shard` before the call, find the same one.
NOMINAL = (16, 128, 2)


def layout_for(
    bias: AttnBias | None,
    length: int,
    length_kv: int | None = None,
    *,
    group: Any = None,
    world: int | None = None,
    device: Any = None,
) -> Layout:
    """The layout that balances ``bias`` over a sequence of ``length`` queries (and
    ``length_kv`` keys, by default as many) across the ranks of ``group`` (or ``world``
    ranks): the least predicted time of a training step in the sequence mode
    (:func:`~.model.sequence_seconds`, for a call of one batch row and :data:`NOMINAL` heads
    and head dims) among contiguous, zigzag, a balanced assignment of ``4 W`` chunks by their
    kept pairs (heaviest chunk first to the least loaded rank) and, where the bias packs
    documents whose lengths ``2 W`` divides, head-tail within each document
    (:meth:`Layout.documents`). Within 5% of the fastest, the layout whose ranks receive
    fewer key/value blocks, then the one of fewer chunks, is taken.

    The same bias and lengths give the same layout on every rank, with no communication;
    this is what ``layout="auto"`` means for :func:`shard`, :func:`unshard`,
    :func:`positions` and :func:`attnbias.distributed.sdpa`. The costs are worked out from the
    bias lowered without a batch size, for one head, on ``device`` (where its tensors are;
    the CPU by default)."""
    kv = length if length_kv is None else length_kv
    return _auto(bias, length, kv, _size(group, world), device)


_AUTO: Kept[Layout] = Kept(16)


def _auto(bias: AttnBias | None, length_q: int, length_kv: int, world: int, device: Any) -> Layout:
    """:func:`layout_for`, kept per bias (by its plan-cache key, when it has one), lengths and
    group size: ``layout="auto"`` asks for it at every call."""
    identity = None if bias is None else bias.cache_key()
    key = (identity, length_q, length_kv, world)
    cacheable = bias is None or identity is not None
    found = _AUTO.get(key) if cacheable else None
    if found is not None:
        return found
    if length_q % world or length_kv % world:
        Layout.contiguous(world).chunk_size(length_q)  # the error for lengths W does not divide
        Layout.contiguous(world).chunk_size(length_kv)
    heads, dim, element = NOMINAL
    # the bias lowered without a batch size, for one head (as it was made: per-head parts of
    # any head count), the step predicted for the nominal heads
    call = Call(None, 1, length_q, length_kv, torch.device(device or "cpu"))
    step = Call(None, heads, length_q, length_kv, call.device)
    shape = StepShape(heads, dim, dim, element, needs_grad=True)
    timed = []
    for candidate in candidate_layouts(bias, call, world):
        grid = keep_grid(
            bias, call, grain(length_q, candidate.pieces), grain(length_kv, candidate.pieces)
        )
        needs = exchanged_runs(grid, step, candidate)
        seconds = sequence_seconds(bias, step, candidate, grid, needs, shape)
        received = max(received_positions(needs, rank) for rank in range(world))
        timed.append((seconds, received, candidate.pieces, candidate))
    fastest = min(t[0] for t in timed)
    best = min((t for t in timed if t[0] <= fastest * 1.05), key=lambda t: t[1:3])[3]
    layout = Layout(best.chunks, f"auto: {best.name}", best.length)
    return _AUTO.put(key, layout) if cacheable else layout


def _size(group: Any, world: int | None) -> int:
    if world is not None:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world={world!r}: expected a positive number of ranks")
        return world
    return world_of(group)[1]


def resolve_layout(
    layout: str | Layout,
    world: int,
    bias: AttnBias | None,
    length_q: int,
    length_kv: int,
    device: Any = None,
) -> Layout:
    """``layout`` (a name of :data:`LAYOUTS` or a :class:`Layout`) for ``world`` ranks;
    ``"auto"`` works it out from ``bias`` (:func:`layout_for`)."""
    if isinstance(layout, Layout):
        if layout.world != world:
            raise ValueError(
                f"layout {layout} is for {layout.world} ranks, but the group has {world}; "
                f"make it for this group (attnbias.distributed.layout_for(..., group=group))"
            )
        return layout
    if layout == "auto":
        return _auto(bias, length_q, length_kv, world, device)
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout={layout!r}: expected one of {', '.join(map(repr, LAYOUTS))} or a "
            f"attnbias.distributed.Layout"
        )
    return Layout.named(layout, world)


def positions(
    length: int,
    *,
    group: Any = None,
    layout: str | Layout = "zigzag",
    device: Any = None,
    bias: AttnBias | None = None,
) -> Tensor:
    """The global positions (int64, ``(length / W,)``) of this rank's part of a sequence of
    ``length``, in the order :func:`shard` lays them out (``layout="auto"`` needs ``bias``)."""
    rank, world = world_of(group)
    chosen = _layout(layout, world, bias, length, device)
    return chosen.positions(rank, length, device)


def shard(
    x: Tensor,
    *,
    group: Any = None,
    layout: str | Layout = "zigzag",
    dim: int = 2,
    bias: AttnBias | None = None,
) -> Tensor:
    """This rank's part of ``x`` along ``dim`` (``x`` is the whole tensor, the same on every
    rank). Shape: ``x``'s with ``dim`` divided by the group's size ``W``.

    ``layout``: ``"zigzag"``, ``"contiguous"``, ``"auto"`` (the layout :func:`layout_for`
    gives for ``bias`` over a square call of ``x``'s length; for queries and keys of different
    lengths pass the :class:`Layout` that ``layout_for(bias, L, S)`` returns) or a
    :class:`Layout`. Raises ``ValueError`` when the length along ``dim`` cannot be split
    evenly, naming the length, ``W`` and the layout."""
    dim = check_dim(x, dim)
    rank, world = world_of(group)
    chosen = _layout(layout, world, bias, x.shape[dim], x.device)
    return chosen.take(x, rank, dim)


def unshard(
    x: Tensor,
    *,
    group: Any = None,
    layout: str | Layout = "zigzag",
    dim: int = 2,
    bias: AttnBias | None = None,
) -> Tensor:
    """The whole tensor from every rank's part ``x`` (as :func:`shard` gave it), on every rank;
    ``dim`` grows ``W`` times. Differentiable: the gradient of a part is the sum over ranks of
    the gradients of the whole tensor's matching positions."""
    dim = check_dim(x, dim)
    _, world = world_of(group)
    chosen = _layout(layout, world, bias, x.shape[dim] * world, x.device)
    chosen.chunk_size(x.shape[dim] * world)  # the layout's checks
    return _Unshard.apply(x, as_group(group), chosen, dim)


def _layout(
    layout: str | Layout, world: int, bias: AttnBias | None, length: int, device: Any
) -> Layout:
    if layout == "auto" and bias is None:
        raise ValueError(
            "layout='auto' is worked out from the bias: pass bias= (the attn_mask of the "
            "call), or the Layout that attnbias.distributed.layout_for(bias, L, S) returns"
        )
    return resolve_layout(layout, world, bias, length, length, device)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, layout: Layout, dim: int) -> Tensor:
        ctx.group, ctx.layout, ctx.dim = group, layout, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(layout.world)]
        dist.all_gather(parts, x, group=group)
        return layout.assemble(parts, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # every rank used the whole tensor: a part's gradient sums theirs
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return ctx.layout.take(grad, rank, ctx.dim), None, None, None

"""Sequences split across the processes of a ``torch.distributed`` group (context parallelism).

Each of the group's ``W`` ranks holds a part of the sequence dimension:

* ``"contiguous"``: the sequence in ``W`` equal chunks, rank ``r`` holds chunk ``r``;
* ``"zigzag"``: the sequence in ``2W`` equal chunks, rank ``r`` holds chunks ``r`` and
  ``2W - 1 - r`` (in that order), so that under a causal mask every rank has the same number
  of kept pairs.

:func:`shard` takes this rank's part of a tensor every rank holds whole; :func:`unshard` gathers
the parts back into the whole tensor on every rank. Both are differentiable.

Example, on every rank of an initialised group::

    x = torch.randn(2, 8, 4096, 64)                 # the same tensor on every rank
    part = attnbias.distributed.shard(x)            # (2, 8, 4096 // W, 64)
    assert torch.equal(attnbias.distributed.unshard(part), x)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LAYOUTS", "positions", "shard", "unshard"]

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

"""How a sequence is split across the ranks of a group, and moving tensors between the whole
and the parts.

A :class:`Layout` cuts a sequence into ``P`` equal chunks and gives each of the ``W`` ranks
``P / W`` of them, in an order; a rank's *part* is its chunks laid end to end. The named
layouts:

* ``"contiguous"``: ``P = W``, rank ``r`` holds chunk ``r``;
* ``"zigzag"``: ``P = 2W``, rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` (in that order),
  so that under a causal mask every rank has the same number of kept pairs;
* ``"auto"``: the chunks assigned by their cost under a bias
  (:func:`attnbias.distributed.layout_for`), which may be :meth:`Layout.documents`, zigzag
  within each packed document ("head-tail").

:func:`shard` takes this rank's part of a tensor every rank holds whole; :func:`unshard` gathers
the parts back into the whole tensor on every rank. Both are differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["LAYOUTS", "Layout", "as_group", "check_dim", "world_of"]

#: The layouts named by a string (``"auto"`` needs the bias).
LAYOUTS = ("contiguous", "zigzag", "auto")


def as_group(group: Any) -> Any:
    """The process group of ``group``: ``None`` (the default group), a ``ProcessGroup``, or a
    one-dimensional ``DeviceMesh`` (or one dimension of one, ``mesh["cp"]``)."""
    get_group = getattr(group, "get_group", None)
    if get_group is not None and hasattr(group, "mesh"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(
                f"group: a DeviceMesh of {group.ndim} dimensions "
                f"{tuple(group.mesh_dim_names or ())} does not say which one splits the "
                f"sequence; pass that dimension, e.g. mesh['cp']"
            )
        return get_group()
    return group


def world_of(group: Any) -> tuple[int, int]:
    """``(rank, world size)`` of ``group`` (``None``: the default group)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "attnbias.distributed needs an initialised process group: call "
            "torch.distributed.init_process_group(...) on every rank first"
        )
    group = as_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class Layout:
    """A split of a sequence across ``W`` ranks: the sequence is cut into ``P`` equal chunks
    (``P`` = the number of chunk ids in ``chunks``) and rank ``r`` holds the chunks
    ``chunks[r]``, laid end to end in that order. Every rank holds the same number of chunks.

    The same layout splits sequences of any length that ``P`` divides (queries and keys of
    different lengths alike). Example: ``Layout(((0, 3), (1, 2)))`` is zigzag over two ranks::

        >>> Layout.zigzag(2).ranges(0, 16)
        [(0, 4), (12, 16)]
    """

    chunks: tuple[tuple[int, ...], ...]
    name: str = "custom"
    #: the one sequence length this layout splits (``None``: any length ``P`` divides); a
    #: layout made for a sequence's documents has its length
    length: int | None = None

    def __post_init__(self) -> None:
        ids = sorted(c for rank in self.chunks for c in rank)
        if not self.chunks or ids != list(range(len(ids))):
            raise ValueError(
                f"Layout chunks={self.chunks}: each chunk id 0 .. P - 1 must appear exactly "
                f"once over the ranks"
            )
        if len({len(rank) for rank in self.chunks}) != 1:
            raise ValueError(
                f"Layout chunks={self.chunks}: every rank must hold the same number of chunks "
                f"(the parts must have one shape)"
            )

    @classmethod
    def contiguous(cls, world: int) -> Layout:
        return cls(tuple((r,) for r in range(world)), "contiguous")

    @classmethod
    def zigzag(cls, world: int) -> Layout:
        return cls(tuple((r, 2 * world - 1 - r) for r in range(world)), "zigzag")

    @classmethod
    def documents(cls, lengths: Sequence[int], world: int) -> Layout:
        """Head-tail within every document: each of the packed documents (``lengths``, in
        sequence order) is cut into ``2W`` equal pieces and rank ``r`` holds pieces ``r`` and
        ``2W - 1 - r`` of every document, so that under a causal mask within documents every
        rank has the same work and the same keys to reach, whatever the documents' lengths.
        The layout's chunks are the pieces' greatest common length; it splits sequences of
        ``sum(lengths)`` only.

            >>> Layout.documents([8, 4], world=2).spans(0, 12)  # pieces 0 and 3 of each
            [(0, 2), (6, 9), (11, 12)]

        ``ValueError`` where a length is not a multiple of ``2W`` (pad each document)."""
        lengths = [int(n) for n in lengths]
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world={world!r}: expected a positive number of ranks")
        pieces = 2 * world
        if not lengths or any(n <= 0 for n in lengths):
            raise ValueError(f"Layout.documents: lengths={lengths}: expected positive lengths")
        uneven = [n for n in lengths if n % pieces]
        if uneven:
            raise ValueError(
                f"Layout.documents: documents of lengths {uneven[:8]} cannot be cut into "
                f"2W = {pieces} equal pieces over {world} ranks; pad each document to a "
                f"multiple of {pieces}"
            )
        size = math.gcd(*(n // pieces for n in lengths))  # the chunk
        held: list[list[int]] = [[] for _ in range(world)]
        start = 0
        for n in lengths:
            per_piece = n // pieces // size
            for rank in range(world):
                for piece in (rank, pieces - 1 - rank):
                    first = start + piece * per_piece
                    held[rank].extend(range(first, first + per_piece))
            start += pieces * per_piece
        return cls(tuple(tuple(h) for h in held), "head-tail", sum(lengths))

    @classmethod
    def named(cls, name: str, world: int) -> Layout:
        if name == "contiguous":
            return cls.contiguous(world)
        if name == "zigzag":
            return cls.zigzag(world)
        raise ValueError(f"layout={name!r}: expected one of {', '.join(map(repr, LAYOUTS))}")

    @property
    def world(self) -> int:
        return len(self.chunks)

    @property
    def pieces(self) -> int:
        """``P``, the number of chunks."""
        return sum(len(rank) for rank in self.chunks)

    def chunk_size(self, length: int) -> int:
        """The length of one chunk of a sequence of ``length``; ``ValueError`` (naming the
        length, ``W``, the layout and the length to pad to) where ``P`` does not divide it."""
        pieces = self.pieces
        if self.length is not None and length != self.length:
            raise ValueError(
                f"the {self.name!r} layout splits a sequence of {self.length} (its documents' "
                f"lengths), not {length}"
            )
        if length % pieces:
            raise ValueError(
                f"a sequence of length {length} cannot be split evenly for the {self.name!r} "
                f"layout over {self.world} ranks: it needs a multiple of {pieces} "
                f"({self.world} ranks x {pieces // self.world} chunks); pad it to "
                f"{-(-length // pieces) * pieces}"
            )
        return length // pieces

    def ranges(self, rank: int, length: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of a sequence of ``length`` that ``rank`` holds, in the
        order of its part."""
        size = self.chunk_size(length)
        return [(c * size, (c + 1) * size) for c in self.chunks[rank]]

    def spans(self, rank: int, length: int) -> list[tuple[int, int]]:
        """:meth:`ranges` with the ranges that follow each other in the sequence merged (a
        part's contiguous stretches)."""
        spans: list[tuple[int, int]] = []
        for a, b in self.ranges(rank, length):
            if spans and spans[-1][1] == a:
                spans[-1] = (spans[-1][0], b)
            else:
                spans.append((a, b))
        return spans

    def positions(self, rank: int, length: int, device: Any = None) -> Tensor:
        """The global positions (int64, ``(length / W,)``) of ``rank``'s part."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.spans(rank, length)])

    def take(self, x: Tensor, rank: int, dim: int) -> Tensor:
        """``rank``'s part of the whole tensor ``x`` along ``dim``."""
        parts = [x.narrow(dim, a, b - a) for a, b in self.spans(rank, x.shape[dim])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def assemble(self, parts: list[Tensor], dim: int) -> Tensor:
        """The whole tensor from every rank's part (in rank order) along ``dim``."""
        per_rank = len(self.chunks[0])
        pieces: list[Tensor | None] = [None] * self.pieces
        for rank, part in enumerate(parts):
            for chunk, piece in zip(self.chunks[rank], part.chunk(per_rank, dim), strict=True):
                pieces[chunk] = piece
        return torch.cat([p for p in pieces if p is not None], dim)

    def __repr__(self) -> str:
        return f"Layout({self.name!r}, chunks={self.chunks})"


def check_dim(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()

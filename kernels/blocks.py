"""Building :class:`~.program.BlockLists`, the second source of the blocks a kernel visits:
from a bool keep-mask, or from per-block states that a mask function gave.

Everything runs on the mask's device with tensor operations (no host synchronisation).

Shape legend: ``Bl`` / ``Hl`` 1 or the batch size / query heads, ``L`` queries, ``S`` keys,
``Mb = ceil(L / block_m)``, ``Nb = ceil(S / block_n)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .program import BlockLists

__all__ = ["EMPTY", "FULL", "PARTIAL", "block_lists", "block_lists_of_keep", "tile_states"]

# The state of a block: no kept pair, some kept pairs, every pair kept.
EMPTY, PARTIAL, FULL = 0, 1, 2


def tile_states(keep: Tensor, block_m: int, block_n: int) -> Tensor:
    """``(Bl, Hl, Mb, Nb)`` int8 states (:data:`EMPTY`, :data:`PARTIAL`, :data:`FULL`) of
    the ``block_m x block_n`` blocks of a ``(Bl, Hl, L, S)`` bool keep-mask. A block cut by
    the end of the queries or keys is at most partial."""
    if keep.dim() != 4 or keep.dtype != torch.bool:
        raise ValueError(
            f"tile_states takes a (Bl, Hl, L, S) bool keep-mask, got shape "
            f"{tuple(keep.shape)} and dtype={keep.dtype}"
        )
    rows, heads, length_q, length_kv = keep.shape
    blocks_m = -(-length_q // block_m)
    blocks_n = -(-length_kv // block_n)
    padded = keep.new_zeros(rows, heads, blocks_m * block_m, blocks_n * block_n)
    padded[..., :length_q, :length_kv] = keep
    tiles = padded.reshape(rows, heads, blocks_m, block_m, blocks_n, block_n)
    some = tiles.any(dim=5).any(dim=3)
    every = tiles.all(dim=5).all(dim=3)
    return some.to(torch.int8) + every.to(torch.int8)


def _lists(states: Tensor) -> Tensor:
    """``(Bl, Hl, R, 2, C + 1)`` int32 lists of the ``(Bl, Hl, R, C)`` states: per row, the
    count of partial blocks and their columns in increasing order, then the same for full
    ones."""
    *lead, columns = states.shape
    out = torch.zeros((*lead, 2, columns + 1), dtype=torch.int32, device=states.device)
    for slot, state in enumerate((PARTIAL, FULL)):
        chosen = states == state
        # the chosen columns first, each group in increasing order (a stable sort of 0s and 1s)
        order = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices
        out[..., slot, 0] = chosen.sum(-1, dtype=torch.int32)
        out[..., slot, 1:] = order.to(torch.int32)
    return out


def block_lists(states: Tensor, block_m: int, block_n: int) -> BlockLists:
    """The lists of the ``(Bl, Hl, Mb, Nb)`` block states (see :func:`tile_states`)."""
    if states.dim() != 4:
        raise ValueError(f"block_lists takes (Bl, Hl, Mb, Nb) states, got {tuple(states.shape)}")
    return BlockLists(
        block_m,
        block_n,
        kv_lists=_lists(states).contiguous(),
        q_lists=_lists(states.transpose(-1, -2)).contiguous(),
    )


def block_lists_of_keep(keep: Tensor, block_m: int, block_n: int) -> BlockLists:
    """:func:`block_lists` of a ``(Bl, Hl, L, S)`` bool keep-mask's blocks."""
    return block_lists(tile_states(keep, block_m, block_n), block_m, block_n)

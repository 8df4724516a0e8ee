"""Building :class:`~.program.BlockLists`, the second source of the blocks a kernel visits:
from a bool keep-mask, or from per-block states that a mask function gave.

Everything runs on the mask's device with tensor operations (no host synchronisation).

Shape legend: ``Bl`` / ``Hl`` 1 or the batch size / query heads, ``L`` queries, ``S`` keys,
``Mb = ceil(L / block_m)``, ``Nb = ceil(S / block_n)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import _key_range, _mod_context, _mod_keep, _row_bounds
from .pools import outside_pools
from .program import BlockLists
from .record import has_docs, has_hi, has_kv_range, has_lo, mask_row_stride

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "block_lists",
    "block_lists_of_keep",
    "block_lists_on_device",
    "tile_states",
]

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

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


# -- block states from the mask itself (generated mask functions, with the band, documents and
# key range), one program per block, without an L x S tensor -----------------------------------


@triton.jit
def _classify_blocks(
    States,
    M,
    heads,
    seq_q,
    seq_k,
    MOD,
    F: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    MASK_FN: tl.constexpr = None,
    TILE_FN: tl.constexpr = None,
):
    """The state of block ``(program 0, program 1)`` of list row ``program 2`` (batch row times
    ``heads`` plus head): :data:`EMPTY`, :data:`PARTIAL` or :data:`FULL`, in ``ROWS``-row
    slices, for the mask ``M``, ``F`` (``record.py``). A block cut by ``L`` or ``S`` is at
    most partial.

    ``TILE_FN`` (the masks' bounds over a block, see ``modtiles.tile_function``) settles a block
    without evaluating its pairs where the masks drop all of them, or, with no other mask term,
    keep all of them."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(2)
    off_b = (pid_bh // heads).to(tl.int64)
    off_h = pid_bh % heads
    kv_lo, kv_hi = _key_range(M, F, off_b, seq_k)
    MODC = _mod_context(off_b, off_h, seq_q, seq_k, MOD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    verdict = 1  # 0: every pair dropped, 2: every pair kept, 1: evaluate the pairs
    if TILE_FN is not None:
        q_last = tl.minimum(pid_m * BLOCK_M + BLOCK_M, seq_q) - 1
        k_last = tl.minimum(pid_n * BLOCK_N + BLOCK_N, seq_k) - 1
        may_keep, may_drop = TILE_FN(
            MODC[0], MODC[1], pid_m * BLOCK_M, q_last, pid_n * BLOCK_N, k_last, MOD
        )
        verdict = tl.where(may_keep == 0, 0, 1)
        if not (has_lo(F) or has_hi(F) or has_docs(F) or has_kv_range(F)):
            whole = (pid_m * BLOCK_M + BLOCK_M <= seq_q) & (pid_n * BLOCK_N + BLOCK_N <= seq_k)
            verdict = tl.where((may_keep != 0) & (may_drop == 0) & whole, 2, verdict)
    state = verdict
    if verdict == 1:
        kept = 0
        for r in tl.static_range(0, BLOCK_M, ROWS):
            offs_m = pid_m * BLOCK_M + r + tl.arange(0, ROWS)
            row_lo, row_hi = _row_bounds(
                offs_m, seq_q, seq_k, M, F, off_b * mask_row_stride(M), kv_lo, kv_hi
            )
            keep = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
            keep = keep & (offs_m < seq_q)[:, None] & (offs_n < seq_k)[None, :]
            if MASK_FN is not None:
                keep = keep & _mod_keep(offs_m, offs_n, MODC, MASK_FN)
            kept += tl.sum(keep.to(tl.int32))
        state = tl.where(kept == BLOCK_M * BLOCK_N, 2, tl.where(kept > 0, 1, 0))
    blocks_m = tl.num_programs(0)
    blocks_n = tl.num_programs(1)
    tl.store(States + (pid_bh * blocks_m + pid_m) * blocks_n + pid_n, tl.cast(state, tl.int8))


@triton.jit
def _write_lists(
    States,
    Lists,
    stride_bh,
    stride_row,
    stride_col,
    rows,
    columns,
    BLOCK: tl.constexpr,
):
    """The lists of one row of block states (program 0; program 1: the list row's batch row
    and head): its partial columns, then its full ones, each as ``[count, column, ...]`` in
    increasing order (see ``program.BlockLists``). ``stride_*`` read ``(Bl * Hl, rows,
    columns)`` states, so the transposed lists read the same states with the strides swapped."""
    row = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    states = tl.load(
        States + bh * stride_bh + row * stride_row + cols * stride_col, mask=cols < columns, other=0
    )  # [BLOCK]
    out = Lists + ((bh * rows + row) * 2) * (columns + 1)
    for slot in tl.static_range(2):
        chosen = states == slot + 1  # PARTIAL, then FULL
        position = tl.cumsum(chosen.to(tl.int32), 0) - 1
        tl.store(out + slot * (columns + 1), tl.sum(chosen.to(tl.int32), 0))
        tl.store(out + slot * (columns + 1) + 1 + position, cols, mask=chosen)


def block_lists_on_device(
    states: Tensor, block_m: int, block_n: int, *, kept: bool = False
) -> BlockLists:
    """:func:`block_lists` of ``(Bl, Hl, Mb, Nb)`` int8 states, written by one program per
    list row (two launches instead of some thirty small tensor operations; entries past a
    count are 0). ``kept``: lists kept from call to call, allocated outside memory pools
    (:func:`.pools.outside_pools`)."""
    from .launch import launcher

    rows, heads, blocks_m, blocks_n = states.shape
    states = states.contiguous()
    device = states.device

    def zeros(shape: tuple[int, ...]) -> Tensor:
        def make() -> Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return outside_pools(make) if kept else make()

    kv_lists = zeros((rows, heads, blocks_m, 2, blocks_n + 1))
    q_lists = zeros((rows, heads, blocks_n, 2, blocks_m + 1))
    per_bh = blocks_m * blocks_n
    launcher(_write_lists)[(blocks_m, rows * heads)](
        states, kv_lists, per_bh, blocks_n, 1, blocks_m, blocks_n,
        BLOCK=triton.next_power_of_2(blocks_n),
    )  # fmt: skip
    launcher(_write_lists)[(blocks_n, rows * heads)](
        states, q_lists, per_bh, 1, blocks_n, blocks_n, blocks_m,
        BLOCK=triton.next_power_of_2(blocks_m),
    )  # fmt: skip
    return BlockLists(block_m, block_n, kv_lists=kv_lists, q_lists=q_lists)

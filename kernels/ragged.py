"""Ragged rows of a packed query placed at the end of per-row query positions, in one launch.

A paged call with ``cu_seqlens_q`` packs every row's queries in a ``(1, Hq, total, E)`` query;
the kernels run each row at ``L`` query positions, its queries at the end (lower-right
alignment). :func:`place_ragged` writes the ``(B, Hq, L, E)`` placed query (zeros before each
row's queries) and, for each packed query and head, the flat row of the ``(B, Hq, L, E)``
output that holds its result, instead of the dozen small tensor operations that work the
same out (each its own launch and host time); :func:`take_placed` reads the packed output back
from the placed one. A packed query past the last row (``cu_seqlens_q[-1] <= t``: a step
padded to a fixed size) belongs to no row: it is not placed and its output is zeros.
"""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .launch import launcher

__all__ = ["place_ragged", "take_placed"]

BLOCK_T = 16  # packed queries per program


@triton.jit
def _place_ragged(
    Q,
    Placed,
    Where,
    CU,
    total,
    batch,
    length,
    heads,
    steps,
    stride_qh,
    stride_qt,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program per ``BLOCK_T`` packed queries and head: each query's row (the last ``b``
    with ``cu[b] <= t``, by ``steps`` halvings of ``[0, batch)``), its place ``L - (cu[b + 1]
    - t)`` (clamped into ``[0, L)``: a table past the bound is flagged by the call's checks,
    not read right), its ``E`` values copied there, and ``Where[t, h]``, the flat row of the
    placed ``(B, Hq, L)`` positions; -1 for a query past the last row (not placed)."""
    pid_t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_row = (t < total) & (t < tl.load(CU + batch))
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)
    hi = tl.zeros([BLOCK_T], dtype=tl.int32) + (batch - 1)
    for _ in range(steps):
        mid = (lo + hi + 1) // 2
        found = tl.load(CU + mid) <= t
        lo = tl.where(found, mid, lo)
        hi = tl.where(found, hi, mid - 1)
    end = tl.load(CU + lo + 1)
    place = tl.minimum(tl.maximum(length - (end - t), 0), length - 1)
    flat = (lo.to(tl.int64) * heads + head) * length + place
    tl.store(Where + t.to(tl.int64) * heads + head, tl.where(in_row, flat, -1), mask=t < total)
    e = tl.arange(0, BLOCK_E)
    values = tl.load(
        Q + head * stride_qh + t.to(tl.int64)[:, None] * stride_qt + e[None, :],
        mask=in_row[:, None] & (e < HEAD_DIM)[None, :],
        other=0.0,
    )
    tl.store(
        Placed + flat[:, None] * HEAD_DIM + e[None, :],
        values,
        mask=in_row[:, None] & (e < HEAD_DIM)[None, :],
    )


@triton.jit
def _take_placed(
    Out,
    Where,
    Taken,
    total,
    heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One program per ``BLOCK_T`` packed queries and head: ``Taken[t, h]`` is the placed
    output's row ``Where[t, h]``, zeros where that is -1 (a query of no row)."""
    pid_t = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    valid = t < total
    flat = tl.load(Where + t * heads + head, mask=valid, other=-1)
    e = tl.arange(0, BLOCK_E)
    columns = (e < HEAD_DIM)[None, :]
    values = tl.load(
        Out + flat[:, None] * HEAD_DIM + e[None, :], mask=(flat >= 0)[:, None] & columns, other=0.0
    )
    tl.store(
        Taken + (t * heads + head)[:, None] * HEAD_DIM + e[None, :],
        values,
        mask=valid[:, None] & columns,
    )


def place_ragged(
    query: Tensor, cu_seqlens_q: Tensor, batch: int, length: int
) -> tuple[Tensor, Tensor]:
    """``(placed, where)`` for a packed ``query`` ``(1, Hq, total, E)`` whose rows are
    ``cu_seqlens_q`` (int32 ``(batch + 1,)``, from 0, ending at ``total`` or before it):
    ``placed`` ``(batch, Hq, length, E)``, row ``b``'s queries at its last positions and zeros
    before them; ``where`` int64 ``(total, Hq)``, the flat ``(batch * Hq * length)`` position
    of each packed query and head in ``placed`` (and in an output of its shape), -1 for the
    queries past the last row (not placed). One launch besides the zeros. The query's last dim
    must be contiguous."""
    _, heads, total, head_dim = query.shape
    if query.stride(3) != 1:
        raise ValueError(
            f"place_ragged: the query's last dim must be contiguous, got strides {query.stride()}"
        )
    placed = query.new_zeros(batch, heads, length, head_dim)
    where = torch.empty((total, heads), dtype=torch.int64, device=query.device)
    if total == 0 or heads == 0:
        return placed, where
    steps = max(batch - 1, 0).bit_length()  # halvings of [0, batch) down to one row
    grid = (triton.cdiv(total, BLOCK_T), heads)
    launcher(_place_ragged)[grid](
        query, placed, where, cu_seqlens_q, total, batch, length, heads, steps,
        query.stride(1), query.stride(2), HEAD_DIM=head_dim,
        BLOCK_E=triton.next_power_of_2(head_dim), BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return placed, where


def take_placed(out: Tensor, where: Tensor) -> Tensor:
    """The packed output ``(total, Hq, Ev)`` of a placed call: for each packed query and head
    the row ``where`` ((total, Hq) int64, from :func:`place_ragged`) of ``out`` ``(B, Hq, L,
    Ev)``, zeros where ``where`` is -1 (a query past the last row). One launch."""
    total, heads = where.shape
    head_dim = out.shape[3]
    out = out.contiguous()
    taken = out.new_empty((total, heads, head_dim))
    if taken.numel() == 0:
        return taken
    grid = (triton.cdiv(total, BLOCK_T), heads)
    launcher(_take_placed)[grid](
        out, where, taken, total, heads, HEAD_DIM=head_dim,
        BLOCK_E=triton.next_power_of_2(head_dim), BLOCK_T=BLOCK_T,
    )  # fmt: skip
    return taken

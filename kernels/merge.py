"""Merging a partial attention result into a running one by their log-sum-exps, in place, in
one launch (context parallelism's shard pairs: ``attnbias.distributed.exchange``).

Shape legend: ``B`` batch, ``H`` query heads, ``m`` rows, ``Ev`` value head dim.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .launch import launcher

__all__ = ["merge_partial"]

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs


@triton.jit
def _merge_kernel(
    Out,
    Lse,
    Part,
    PartLse,
    heads,
    rows,
    dim,
    so_b,
    so_h,
    so_m,
    sl_b,
    sl_h,
    sl_m,
    sp_b,
    sp_h,
    sp_m,
    spl_b,
    spl_h,
    spl_m,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Rows ``[program 0 * BLOCK_M, ...)`` of batch row and head ``program 1``: ``Out`` and
    ``Lse`` become the log-sum-exp weighted mean of themselves and ``Part`` / ``PartLse``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads).to(tl.int64)
    off_h = (pid_bh % heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    in_rows = offs_m < rows
    lse_at = Lse + off_b * sl_b + off_h * sl_h + offs_m * sl_m
    current = tl.load(lse_at, mask=in_rows, other=0.0).to(tl.float32)  # [BLOCK_M]
    part = tl.load(
        PartLse + off_b * spl_b + off_h * spl_h + offs_m * spl_m, mask=in_rows, other=0.0
    ).to(tl.float32)  # [BLOCK_M]
    # logaddexp, -inf where both are, NaN where either is
    top = tl.maximum(current, part, propagate_nan=tl.PropagateNan.ALL)
    top_finite = tl.where(top == float("-inf"), 0.0, top)
    both_empty = top == float("-inf")
    summed = tl.exp(current - top_finite) + tl.exp(part - top_finite)
    total = top_finite + tl.log(tl.where(both_empty, 1.0, summed))
    merged = tl.where(both_empty, float("-inf"), total)
    # as the unfused merge: the weights relative to the merged value where it is finite
    finite = tl.where((merged == merged) & (tl.abs(merged) != float("inf")), merged, 0.0)
    weight = tl.exp(current - finite)
    part_weight = tl.exp(part - finite)
    tile = in_rows[:, None] & (offs_e < dim)[None, :]
    out_at = Out + off_b * so_b + off_h * so_h + offs_m[:, None] * so_m + offs_e[None, :]
    out = tl.load(out_at, mask=tile, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_E]
    value = tl.load(
        Part + off_b * sp_b + off_h * sp_h + offs_m[:, None] * sp_m + offs_e[None, :],
        mask=tile,
        other=0.0,
    ).to(tl.float32)  # [BLOCK_M, BLOCK_E]
    result = out * weight[:, None] + value * part_weight[:, None]
    tl.store(out_at, result.to(Out.dtype.element_ty), mask=tile)
    tl.store(lse_at, merged.to(Lse.dtype.element_ty), mask=in_rows)


def merge_partial(out: Tensor, lse: Tensor, part: Tensor, part_lse: Tensor) -> None:
    """Merge ``part`` ``(B, H, m, Ev)`` with its log-sum-exp ``part_lse`` ``(B, H, m)`` into
    ``out`` / ``lse`` (the same shapes; views allowed, each with a contiguous last dim of
    ``out`` and ``part``), in place, as the log-sum-exp weighted mean computed in float32:
    rows where both log-sum-exps are ``-inf`` stay 0 with ``-inf``, a NaN stays NaN."""
    batch, heads, rows, dim = out.shape
    if part.shape != out.shape or lse.shape != out.shape[:3] or part_lse.shape != lse.shape:
        raise ValueError(
            f"merge_partial: out {tuple(out.shape)}, lse {tuple(lse.shape)}, part "
            f"{tuple(part.shape)} and part_lse {tuple(part_lse.shape)} must be (B, H, m, Ev) "
            f"and (B, H, m) alike"
        )
    if out.stride(3) != 1 or part.stride(3) != 1:
        raise ValueError("merge_partial: out and part need a contiguous last dim")
    if 0 in out.shape:
        return
    block_m = 32
    launcher(_merge_kernel)[(triton.cdiv(rows, block_m), batch * heads)](
        out, lse, part, part_lse, heads, rows, dim,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        part.stride(0), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(dim),
    )  # fmt: skip

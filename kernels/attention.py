"""Block-sparse flash attention for a diagonal band intersected with packed documents.

Mask model (``i`` a query row in ``[0, L)``, ``j`` a key column in ``[0, S)``)::

    keep(i, j) = band_lo <= j - i <= band_hi          (either side may be unbounded)
                 and q_doc[b, i] == kv_doc[b, j]      (when document ids are given)

Document ids are non-decreasing along the sequence, so the keys a query row keeps form one
contiguous range ``[row_lo[i], row_hi[i])`` and the queries a key column is kept by form one
contiguous range ``[col_lo[j], col_hi[j])``; both bounds are non-decreasing in the index.
The launchers fold the document part of these ranges out of the ids with
``torch.searchsorted`` (device-side, no host sync) and the kernels add the band part. Hence:

* a tile of rows ``[first, last]`` touches only keys in ``[row_lo[first], row_hi[last])``:
  one contiguous run of key blocks, everything else is skipped;
* a key block inside ``[row_lo[last], row_hi[first])`` is *full* (every pair of the tile is
  kept, no element mask is built); the blocks between the touched run and the full run are
  *partial* and take the masked variant of the inner loop (a ``tl.constexpr`` flag).

Scores are kept in base 2: ``s2 = log2(e) * s`` so the softmax uses ``exp2``; the
log-sum-exp written out is in natural log. A row that keeps no key gets output 0 and
``lse = -inf``; the backward kernels read such a row's ``lse`` as ``+inf`` so every
probability recomputed from it is exactly 0 and no gradient from it is NaN.

Any finite scale works: with a positive normal scale and no score modifier the forward
masks and maximises raw dot products and scales them in the exponent's FMA; otherwise (0,
negative, below float32's smallest normal) it scales first (``POSITIVE_SCALE``).

Masked pairs *select* their value (``-inf`` scores, zero probabilities and score gradients)
with ``tl.where``, so a NaN or Inf in a masked key never becomes a score. Skipped tiles and
rows past ``L`` or ``S`` (or head dims past ``E``) are never loaded. Within a partial tile
the zero weights of masked pairs still multiply their rows of values (forward), keys (dQ),
queries and output gradients (dK/dV): a NaN or Inf there reaches the rows of that tile, as
in the other fused kernels (stock SDPA's, FlashAttention 4). Zeroing those rows first cost
13-31% on windows and documents on the H100 (``benchmarks/NOTES.md``). A NaN in a kept
position propagates to what depends on it, as in stock SDPA.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``Hq % Hkv == 0``;
query head ``h`` reads key/value head ``h // (Hq // Hkv)``), ``L`` queries, ``S`` keys,
``E`` head dim (16 to 256; padded to the next power of two inside the kernels).
"""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary
from triton.language.extra import libdevice

from .limits import interpreting

__all__ = ["KernelConfig", "attention_backward", "attention_forward", "traceable_launches"]

LOG2E = 1.4426950408889634  # log2(e): scores are pre-scaled by it so the softmax can use exp2
# The smallest positive normal float32: a smaller scale may flush to zero on the GPU.
_FP32_TINY = torch.finfo(torch.float32).tiny

# How the soft-cap evaluates tanh: an exact formula built from exp (the interpreter has no
# libdevice and no inline asm), libdevice's tanh (fp32 inputs on the GPU, where the error
# budget is fp32's), or the hardware's tanh.approx.f32 (fp16/bf16 inputs: its ~2^-11
# relative error is below what rounding the scores to 16 bits costs eager PyTorch).
TANH_EXACT = 0
TANH_LIBDEVICE = 1
TANH_APPROX = 2


# Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit patterns; widening them
# to fp32 first is exact, so the interpreter then matches the GPU up to summation order.
_INTERPRETER = tl.constexpr(interpreting())


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    if _INTERPRETER and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)  # [rows of a, cols of b]


# --------------------------------------------------------------------------------------
# Shared jit helpers
# --------------------------------------------------------------------------------------


@triton.jit
def _tanh(x, TANH_MODE: tl.constexpr):
    if TANH_MODE == 2:
        y = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;",
            "=r,r",
            [x],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    elif TANH_MODE == 1:
        y = libdevice.tanh(x)
    else:
        # tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) <= 1, so nothing overflows; near 0
        # that quotient cancels, so small |x| takes the odd Taylor series (error < 1e-9).
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        big = (1.0 - e) / (1.0 + e)
        x2 = ax * ax
        small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
        r = tl.where(ax < 0.125, small, big)
        y = tl.where(x < 0, -r, r)
    return y


@triton.jit
def _log2_scores(
    qk,
    rel,
    offset,
    qk_scale,
    softcap_in,
    softcap_out,
    alibi_coef,
    HAS_OFFSET: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    TANH_MODE: tl.constexpr,
):
    """Base-2 scores from raw dot products, minus ``offset`` (a broadcast row or column of
    base-2 log-sum-exps) when ``HAS_OFFSET``.

    ``rel = i + (S - L) - j`` as fp32 is read only for ALiBi (integers below 2^24 are exact
    in fp32, so it is the integer distance), whose term is ``alibi_coef * |rel|``, or
    ``alibi_coef * rel`` when every kept pair has ``rel`` of the sign ``ALIBI_SIGN`` (+1 or
    -1; 0 when unknown), with ``alibi_coef`` = ``-slope * log2(e)`` times that sign (-1 for 0).

    Returns ``(s2, t)`` where ``t = tanh(scale * qk / cap)`` under a soft-cap (the backward
    pass needs it for ``1 - t^2``) and ``qk`` otherwise (unused then). The terms are summed
    so that each step is one FMA.
    """
    if HAS_ALIBI:
        dist = tl.abs(rel) if ALIBI_SIGN == 0 else rel
        extra = dist * alibi_coef - offset if HAS_OFFSET else dist * alibi_coef
    elif HAS_OFFSET:
        extra = -offset
    else:
        extra = 0.0
    if HAS_SOFTCAP:
        t = _tanh(qk * softcap_in, TANH_MODE)
        s = t * softcap_out + extra
    else:
        t = qk
        s = qk * qk_scale + extra
    return s, t


@triton.jit
def _alibi_coef(Slopes, off_b, off_h, stride_sb, stride_sh, HAS_ALIBI: tl.constexpr,
                ALIBI_SIGN: tl.constexpr):  # fmt: skip
    """The factor of the ALiBi distance in base-2 scores (see ``_log2_scores``)."""
    if HAS_ALIBI:
        slope = tl.load(Slopes + off_b * stride_sb + off_h * stride_sh)
        coef = slope * (1.4426950408889634 if ALIBI_SIGN < 0 else -1.4426950408889634)
    else:
        coef = 0.0
    return coef


@triton.jit
def _load_tile(
    ptrs,
    offs_rows,
    n_rows,
    ROW_MASK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Load a ``[ROWS, BLOCK_E]`` tile, masking rows past ``n_rows`` and padded head dims."""
    offs_e = tl.arange(0, BLOCK_E)
    if ROW_MASK:
        if BLOCK_E == HEAD_DIM:
            x = tl.load(ptrs, mask=offs_rows[:, None] < n_rows, other=0.0)  # [ROWS, BLOCK_E]
        else:
            mask = (offs_rows[:, None] < n_rows) & (offs_e[None, :] < HEAD_DIM)
            x = tl.load(ptrs, mask=mask, other=0.0)  # [ROWS, BLOCK_E]
    else:
        if BLOCK_E == HEAD_DIM:
            x = tl.load(ptrs)  # [ROWS, BLOCK_E]
        else:
            x = tl.load(ptrs, mask=offs_e[None, :] < HEAD_DIM, other=0.0)  # [ROWS, BLOCK_E]
    return x


@triton.jit
def _tile_ptrs(head, start, stride_row, stride_col, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pointers ``[ROWS, BLOCK_E]`` to rows ``[start, start + ROWS)`` of the ``(rows, E)``
    matrix at ``head`` (one batch entry and head of a ``(B, H, rows, E)`` tensor)."""
    return (
        head
        + start.to(tl.int64) * stride_row
        + tl.arange(0, ROWS)[:, None] * stride_row
        + tl.arange(0, BLOCK_E)[None, :] * stride_col
    )


@triton.jit
def _split_blocks(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Cut the index range ``[lo, hi)`` into block ranges.

    ``[full_lo, full_hi)`` is the sub-range kept for every row (column) of the tile. Returns
    ``(first, full_first, full_end, end)``: blocks ``[first, full_first)`` and
    ``[full_end, end)`` are partial, ``[full_first, full_end)`` full. All divisions see
    non-negative operands (Triton's integer division truncates).
    """
    hi = tl.maximum(hi, lo)
    full_lo = tl.maximum(full_lo, lo)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    first = lo // BLOCK
    end = (hi + BLOCK - 1) // BLOCK
    end = tl.where(hi > lo, end, first)
    full_first = (full_lo + BLOCK - 1) // BLOCK
    full_end = full_hi // BLOCK
    no_full = full_end <= full_first
    full_first = tl.where(no_full, end, full_first)
    full_end = tl.where(no_full, end, full_end)
    return first, full_first, full_end, end


@triton.jit
def _key_block_range(
    start_m,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
    RowLo,
    RowHi,
    doc_off,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key blocks seen by query rows ``[start_m, start_m + BLOCK_M)`` (see ``_split_blocks``)."""
    first = start_m
    last = tl.minimum(start_m + BLOCK_M, seq_q) - 1
    lo = first * 0
    hi = lo + seq_k
    full_lo = lo
    full_hi = hi
    if HAS_LO:
        lo = tl.maximum(lo, first + band_lo)
        full_lo = tl.maximum(full_lo, last + band_lo)
    if HAS_HI:
        hi = tl.minimum(hi, last + band_hi + 1)
        full_hi = tl.minimum(full_hi, first + band_hi + 1)
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.load(RowLo + doc_off + first))
        full_lo = tl.maximum(full_lo, tl.load(RowLo + doc_off + last))
        hi = tl.minimum(hi, tl.load(RowHi + doc_off + last))
        full_hi = tl.minimum(full_hi, tl.load(RowHi + doc_off + first))
    return _split_blocks(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def _row_bounds(
    offs_m,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
    RowLo,
    RowHi,
    doc_off,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Per query row, the kept keys ``[row_lo, row_hi)`` (``row_hi <= S``), both ``[BLOCK_M]``."""
    row_lo = offs_m * 0
    row_hi = row_lo + seq_k
    if HAS_LO:
        row_lo = tl.maximum(row_lo, offs_m + band_lo)
    if HAS_HI:
        row_hi = tl.minimum(row_hi, offs_m + band_hi + 1)
    if HAS_DOCS:
        in_rows = offs_m < seq_q
        doc_lo = tl.load(RowLo + doc_off + offs_m, mask=in_rows, other=0)  # [BLOCK_M]
        doc_hi = tl.load(RowHi + doc_off + offs_m, mask=in_rows, other=0)  # [BLOCK_M]
        row_lo = tl.maximum(row_lo, doc_lo)
        row_hi = tl.minimum(row_hi, doc_hi)
    return row_lo, row_hi


@triton.jit
def _query_block_range(
    start_n,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
    ColLo,
    ColHi,
    doc_off,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Query blocks that see key columns ``[start_n, start_n + BLOCK_N)``."""
    first = start_n
    last = tl.minimum(start_n + BLOCK_N, seq_k) - 1
    lo = first * 0
    hi = lo + seq_q
    full_lo = lo
    full_hi = hi
    if HAS_HI:  # j - i <= band_hi  <=>  i >= j - band_hi
        lo = tl.maximum(lo, first - band_hi)
        full_lo = tl.maximum(full_lo, last - band_hi)
    if HAS_LO:  # j - i >= band_lo  <=>  i <= j - band_lo
        hi = tl.minimum(hi, last - band_lo + 1)
        full_hi = tl.minimum(full_hi, first - band_lo + 1)
    if HAS_DOCS:
        lo = tl.maximum(lo, tl.load(ColLo + doc_off + first))
        full_lo = tl.maximum(full_lo, tl.load(ColLo + doc_off + last))
        hi = tl.minimum(hi, tl.load(ColHi + doc_off + last))
        full_hi = tl.minimum(full_hi, tl.load(ColHi + doc_off + first))
    return _split_blocks(lo, hi, full_lo, full_hi, BLOCK_M)


@triton.jit
def _col_bounds(
    offs_n,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
    ColLo,
    ColHi,
    doc_off,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
):
    """Per key column, the query rows keeping it ``[col_lo, col_hi)``; empty past ``S``."""
    in_cols = offs_n < seq_k
    col_lo = offs_n * 0
    col_hi = tl.where(in_cols, col_lo + seq_q, 0)
    if HAS_HI:
        col_lo = tl.maximum(col_lo, offs_n - band_hi)
    if HAS_LO:
        col_hi = tl.minimum(col_hi, offs_n - band_lo + 1)
    if HAS_DOCS:
        doc_lo = tl.load(ColLo + doc_off + offs_n, mask=in_cols, other=0)  # [BLOCK_N]
        doc_hi = tl.load(ColHi + doc_off + offs_n, mask=in_cols, other=0)  # [BLOCK_N]
        col_lo = tl.maximum(col_lo, doc_lo)
        col_hi = tl.minimum(col_hi, doc_hi)
    return col_lo, col_hi


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_head,
    v_head,
    stride_kn,
    stride_kk,
    stride_vn,
    stride_vk,
    offs_m,
    row_lo,
    row_hi,
    block_first,
    block_end,
    seq_k,
    shift,
    qk_scale,
    softcap_in,
    softcap_out,
    alibi_coef,
    MASKED: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    TANH_MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr,
):
    # Raw dot products can be masked and maximised before scaling only when the scale is a
    # positive normal float: scaling then keeps the order and -inf; otherwise scale first.
    PLAIN: tl.constexpr = not (HAS_SOFTCAP or HAS_ALIBI) and POSITIVE_SCALE
    # tiles past the sequence's end exist only when its length is no multiple of BLOCK_N
    BOUNDS: tl.constexpr = MASKED and not EVEN
    offs_n = block_first * BLOCK_N + tl.arange(0, BLOCK_N)
    start = (block_first * BLOCK_N).to(tl.int64)
    k_ptrs = _tile_ptrs(k_head, start, stride_kn, stride_kk, BLOCK_N, BLOCK_E)
    v_ptrs = _tile_ptrs(v_head, start, stride_vn, stride_vk, BLOCK_N, BLOCK_E)
    for _ in range(block_first, block_end):
        k = _load_tile(k_ptrs, offs_n, seq_k, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_N, BLOCK_E]
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if not PLAIN:
            if HAS_ALIBI:
                # built from fp32 vectors: one add per score, no integer-to-float conversion
                rel = (offs_m + shift).to(tl.float32)[:, None] - offs_n.to(tl.float32)[None, :]
            else:
                rel = 0.0
            qk, _t = _log2_scores(
                qk, rel, 0.0, qk_scale, softcap_in, softcap_out, alibi_coef,
                HAS_OFFSET=False, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE,
            )  # fmt: skip
        if MASKED:
            # masked pairs select -inf whatever their score (a NaN key there stays out)
            keep = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
            qk = tl.where(keep, qk, float("-inf"))
        # PLAIN keeps raw dot products so that scaling and subtracting the max is one FMA.
        if PLAIN:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
        if MASKED:
            # A row with nothing kept so far has m_new = -inf; subtract 0 so exp2 gives 0, not NaN.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        if PLAIN:
            p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        else:
            p = tl.math.exp2(qk - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_tile(v_ptrs, offs_n, seq_k, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_N, BLOCK_E]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)  # [BLOCK_M, BLOCK_E]
        m_i = m_new
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    Lse,
    RowLo,
    RowHi,
    Slopes,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    stride_db,
    stride_sb, stride_sh,
    num_heads,
    group_size,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
    qk_scale,
    softcap_in,
    softcap_out,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_MODE: tl.constexpr,
    REVERSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr,
):  # fmt: skip
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    # torch.compile passes Python floats as fp64; keep the softmax arithmetic in fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_in = tl.cast(softcap_in, tl.float32)
    softcap_out = tl.cast(softcap_out, tl.float32)
    pid_m = tl.program_id(0)
    if REVERSE:  # rows late in the sequence keep the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = (off_h // group_size).to(tl.int64)
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    q_ptrs = _tile_ptrs(
        Q + off_b * stride_qb + off_h.to(tl.int64) * stride_qh, start_m, stride_qm, stride_qk,
        BLOCK_M, BLOCK_E,
    )  # fmt: skip
    q = _load_tile(q_ptrs, offs_m, seq_q, True, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
    k_head = K + off_b * stride_kb + off_hk * stride_kh
    v_head = V + off_b * stride_vb + off_hk * stride_vh

    doc_off = off_b * stride_db
    block_first, full_first, full_end, block_end = _key_block_range(
        start_m, seq_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off,
        HAS_LO, HAS_HI, HAS_DOCS, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    row_lo, row_hi = _row_bounds(
        offs_m, seq_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off, HAS_LO, HAS_HI, HAS_DOCS
    )
    alibi_coef = _alibi_coef(Slopes, off_b, off_h, stride_sb, stride_sh, HAS_ALIBI, ALIBI_SIGN)
    shift = seq_k - seq_q

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    # partial prefix, full middle, partial suffix
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, block_first, full_first, seq_k, shift,
        qk_scale, softcap_in, softcap_out, alibi_coef,
        True, EVEN_N, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
        HEAD_DIM, BLOCK_E, BLOCK_N, DOT_PRECISION, POSITIVE_SCALE=POSITIVE_SCALE,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, full_first, full_end, seq_k, shift,
        qk_scale, softcap_in, softcap_out, alibi_coef,
        False, EVEN_N, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
        HEAD_DIM, BLOCK_E, BLOCK_N, DOT_PRECISION, POSITIVE_SCALE=POSITIVE_SCALE,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, full_end, block_end, seq_k, shift,
        qk_scale, softcap_in, softcap_out, alibi_coef,
        True, EVEN_N, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
        HEAD_DIM, BLOCK_E, BLOCK_N, DOT_PRECISION, POSITIVE_SCALE=POSITIVE_SCALE,
    )  # fmt: skip

    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(
        empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453
    )
    in_rows = offs_m < seq_q
    lse_ptrs = Lse + (off_b * num_heads + off_h) * seq_q + offs_m
    tl.store(lse_ptrs, lse, mask=in_rows)
    o_ptrs = _tile_ptrs(
        Out + off_b * stride_ob + off_h.to(tl.int64) * stride_oh, start_m, stride_om, stride_ok,
        BLOCK_M, BLOCK_E,
    )  # fmt: skip
    tl.store(
        o_ptrs, acc.to(Out.dtype.element_ty), mask=in_rows[:, None] & (offs_e[None, :] < HEAD_DIM)
    )


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_head,
    do_head,
    lse_head,
    delta_head,
    stride_qm,
    stride_qk,
    stride_dom,
    stride_dok,
    offs_n,
    col_lo,
    col_hi,
    block_first,
    block_end,
    seq_q,
    shift,
    qk_scale,
    softcap_in,
    softcap_out,
    alibi_coef,
    MASKED: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    TANH_MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate one query head's contribution to ``dK`` (unscaled) and ``dV`` of a key tile.

    Works on transposed tiles ``[BLOCK_N, BLOCK_M]`` so that ``dK``/``dV`` rows stay in place.
    """
    BOUNDS: tl.constexpr = MASKED and not EVEN  # see _attn_fwd_inner
    offs_m = block_first * BLOCK_M + tl.arange(0, BLOCK_M)
    start = (block_first * BLOCK_M).to(tl.int64)
    q_ptrs = _tile_ptrs(q_head, start, stride_qm, stride_qk, BLOCK_M, BLOCK_E)
    do_ptrs = _tile_ptrs(do_head, start, stride_dom, stride_dok, BLOCK_M, BLOCK_E)
    for _ in range(block_first, block_end):
        q = _load_tile(q_ptrs, offs_m, seq_q, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
        if BOUNDS:
            in_rows = offs_m < seq_q
            lse = tl.load(lse_head + offs_m, mask=in_rows, other=float("inf"))  # [BLOCK_M]
            delta = tl.load(delta_head + offs_m, mask=in_rows, other=0.0)  # [BLOCK_M]
        else:
            lse = tl.load(lse_head + offs_m)  # [BLOCK_M]
            delta = tl.load(delta_head + offs_m)  # [BLOCK_M]
        # A row that kept nothing has lse = -inf: read it as +inf so its probabilities are 0.
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        qkT = _dot(k, tl.trans(q), None, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if HAS_SOFTCAP or HAS_ALIBI:
            relT = (offs_m + shift).to(tl.float32)[None, :] - offs_n.to(tl.float32)[:, None]
            sT, tT = _log2_scores(
                qkT, relT, lse2[None, :], qk_scale, softcap_in, softcap_out, alibi_coef,
                True, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
            )  # fmt: skip
            pT = tl.math.exp2(sT)
        else:
            tT = qkT
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        do = _load_tile(do_ptrs, offs_m, seq_q, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
        if MASKED:
            # masked pairs select 0 whatever their score
            keep = (offs_m[None, :] >= col_lo[:, None]) & (offs_m[None, :] < col_hi[:, None])
            pT = tl.where(keep, pT, 0.0)
        dv = _dot(pT.to(do.dtype), do, dv, DOT_PRECISION)  # [BLOCK_N, BLOCK_E]
        dpT = _dot(v, tl.trans(do), None, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        if MASKED:
            dsT = tl.where(keep, dsT, 0.0)
        dk = _dot(dsT.to(q.dtype), q, dk, DOT_PRECISION)  # [BLOCK_N, BLOCK_E]
        offs_m += BLOCK_M
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    DK,
    DV,
    ColLo,
    ColHi,
    Slopes,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_dob, stride_doh, stride_dom, stride_dok,
    stride_dkb, stride_dkh, stride_dkn, stride_dkk,
    stride_dvb, stride_dvh, stride_dvn, stride_dvk,
    stride_db,
    stride_sb, stride_sh,
    num_heads,
    group_size,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
    sm_scale,
    qk_scale,
    softcap_in,
    softcap_out,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_MODE: tl.constexpr,
    REVERSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_M: tl.constexpr,
):  # fmt: skip
    """``dK``, ``dV`` of one key tile of one key/value head, summed over its query heads."""
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    # torch.compile passes Python floats as fp64; keep the softmax arithmetic in fp32
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_in = tl.cast(softcap_in, tl.float32)
    softcap_out = tl.cast(softcap_out, tl.float32)
    pid_n = tl.program_id(0)
    if REVERSE:  # keys late in the sequence are kept by the most queries: start them first
        pid_n = tl.num_programs(0) - 1 - pid_n
    off_hk = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    k_ptrs = _tile_ptrs(
        K + off_b * stride_kb + off_hk.to(tl.int64) * stride_kh, start_n, stride_kn, stride_kk,
        BLOCK_N, BLOCK_E,
    )  # fmt: skip
    v_ptrs = _tile_ptrs(
        V + off_b * stride_vb + off_hk.to(tl.int64) * stride_vh, start_n, stride_vn, stride_vk,
        BLOCK_N, BLOCK_E,
    )  # fmt: skip
    k = _load_tile(k_ptrs, offs_n, seq_k, True, HEAD_DIM, BLOCK_E)  # [BLOCK_N, BLOCK_E]
    v = _load_tile(v_ptrs, offs_n, seq_k, True, HEAD_DIM, BLOCK_E)  # [BLOCK_N, BLOCK_E]

    doc_off = off_b * stride_db
    block_first, full_first, full_end, block_end = _query_block_range(
        start_n, seq_q, seq_k, band_lo, band_hi, ColLo, ColHi, doc_off,
        HAS_LO, HAS_HI, HAS_DOCS, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    col_lo, col_hi = _col_bounds(
        offs_n, seq_q, seq_k, band_lo, band_hi, ColLo, ColHi, doc_off, HAS_LO, HAS_HI, HAS_DOCS
    )
    shift = seq_k - seq_q

    dk = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_E], dtype=tl.float32)
    # The query heads of a GQA group share this key tile: loop over them here, no atomics.
    for g in range(0, group_size):
        off_h = (off_hk * group_size + g).to(tl.int64)
        q_head = Q + off_b * stride_qb + off_h * stride_qh
        do_head = DO + off_b * stride_dob + off_h * stride_doh
        lse_head = Lse + (off_b * num_heads + off_h) * seq_q
        delta_head = Delta + (off_b * num_heads + off_h) * seq_q
        alibi_coef = _alibi_coef(Slopes, off_b, off_h, stride_sb, stride_sh, HAS_ALIBI, ALIBI_SIGN)
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head,
            stride_qm, stride_qk, stride_dom, stride_dok,
            offs_n, col_lo, col_hi, block_first, full_first, seq_q, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef,
            True, EVEN_M, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
            HEAD_DIM, BLOCK_E, BLOCK_M, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head,
            stride_qm, stride_qk, stride_dom, stride_dok,
            offs_n, col_lo, col_hi, full_first, full_end, seq_q, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef,
            False, EVEN_M, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
            HEAD_DIM, BLOCK_E, BLOCK_M, DOT_PRECISION,
        )  # fmt: skip
        dk, dv = _attn_bwd_dkdv_inner(
            dk, dv, k, v, q_head, do_head, lse_head, delta_head,
            stride_qm, stride_qk, stride_dom, stride_dok,
            offs_n, col_lo, col_hi, full_end, block_end, seq_q, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef,
            True, EVEN_M, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
            HEAD_DIM, BLOCK_E, BLOCK_M, DOT_PRECISION,
        )  # fmt: skip

    dk *= sm_scale
    store_mask = (offs_n[:, None] < seq_k) & (offs_e[None, :] < HEAD_DIM)
    dk_ptrs = _tile_ptrs(
        DK + off_b * stride_dkb + off_hk.to(tl.int64) * stride_dkh, start_n, stride_dkn, stride_dkk,
        BLOCK_N, BLOCK_E,
    )  # fmt: skip
    dv_ptrs = _tile_ptrs(
        DV + off_b * stride_dvb + off_hk.to(tl.int64) * stride_dvh, start_n, stride_dvn, stride_dvk,
        BLOCK_N, BLOCK_E,
    )  # fmt: skip
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=store_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=store_mask)


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    dslope,
    q,
    do,
    lse2,
    delta,
    k_head,
    v_head,
    stride_kn,
    stride_kk,
    stride_vn,
    stride_vk,
    offs_m,
    row_lo,
    row_hi,
    block_first,
    block_end,
    seq_k,
    shift,
    qk_scale,
    softcap_in,
    softcap_out,
    alibi_coef,
    MASKED: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    TANH_MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_DSLOPE: tl.constexpr,
):
    """Accumulate ``dQ`` (unscaled) of a query tile over key tiles, and with ``HAS_DSLOPE``
    ``dslope`` ``[BLOCK_M]``: each row's sum of ``dS * |i + (S - L) - j|``, where ``dS`` is
    the gradient of the score that ALiBi's term ``-slope * |i + (S - L) - j|`` is added to."""
    BOUNDS: tl.constexpr = MASKED and not EVEN  # see _attn_fwd_inner
    offs_n = block_first * BLOCK_N + tl.arange(0, BLOCK_N)
    start = (block_first * BLOCK_N).to(tl.int64)
    k_ptrs = _tile_ptrs(k_head, start, stride_kn, stride_kk, BLOCK_N, BLOCK_E)
    v_ptrs = _tile_ptrs(v_head, start, stride_vn, stride_vk, BLOCK_N, BLOCK_E)
    for _ in range(block_first, block_end):
        k = _load_tile(k_ptrs, offs_n, seq_k, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_N, BLOCK_E]
        v = _load_tile(v_ptrs, offs_n, seq_k, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_N, BLOCK_E]
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP or HAS_ALIBI:
            rel = (offs_m + shift).to(tl.float32)[:, None] - offs_n.to(tl.float32)[None, :]
            s, t = _log2_scores(
                qk, rel, lse2[:, None], qk_scale, softcap_in, softcap_out, alibi_coef,
                True, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
            )  # fmt: skip
            p = tl.math.exp2(s)
        else:
            t = qk
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        if MASKED:
            # masked pairs select 0 whatever p and dp are
            keep = (offs_n[None, :] >= row_lo[:, None]) & (offs_n[None, :] < row_hi[:, None])
            ds = tl.where(keep, ds, 0.0)
        if HAS_DSLOPE:
            dslope += tl.sum(ds * tl.abs(rel), 1)
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
            if MASKED:  # t of a masked pair may be NaN
                ds = tl.where(keep, ds, 0.0)
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION)  # [BLOCK_M, BLOCK_E]
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq, dslope


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    Out,
    DO,
    Lse,
    DLse,
    Delta,
    DQ,
    RowLo,
    RowHi,
    Slopes,
    DSlope,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    stride_dob, stride_doh, stride_dom, stride_dok,
    stride_dqb, stride_dqh, stride_dqm, stride_dqk,
    stride_db,
    stride_sb, stride_sh,
    num_heads,
    group_size,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
    sm_scale,
    qk_scale,
    softcap_in,
    softcap_out,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_MODE: tl.constexpr,
    REVERSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_DSLOPE: tl.constexpr,
):  # fmt: skip
    """``dQ`` of one query tile of one query head.

    Also computes the tile's row terms ``delta = rowsum(dO * O) - dLse`` of the softmax
    gradient and stores them for the dK/dV kernel, which must run after this one. With
    ``HAS_DSLOPE`` it stores the tile's part of the gradient of its head's ALiBi slope in
    ``DSlope`` ``(B, Hq, programs along L)``, which the launcher sums.
    """
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    # torch.compile passes Python floats as fp64; keep the softmax arithmetic in fp32
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_in = tl.cast(softcap_in, tl.float32)
    softcap_out = tl.cast(softcap_out, tl.float32)
    pid_m = tl.program_id(0)
    if REVERSE:
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    off_hk = (off_h // group_size).to(tl.int64)
    start_m = pid_m * BLOCK_M

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    q_ptrs = _tile_ptrs(
        Q + off_b * stride_qb + off_h.to(tl.int64) * stride_qh, start_m, stride_qm, stride_qk,
        BLOCK_M, BLOCK_E,
    )  # fmt: skip
    do_ptrs = _tile_ptrs(
        DO + off_b * stride_dob + off_h.to(tl.int64) * stride_doh, start_m, stride_dom, stride_dok,
        BLOCK_M, BLOCK_E,
    )  # fmt: skip
    q = _load_tile(q_ptrs, offs_m, seq_q, True, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
    do = _load_tile(do_ptrs, offs_m, seq_q, True, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
    o_ptrs = _tile_ptrs(
        Out + off_b * stride_ob + off_h.to(tl.int64) * stride_oh, start_m, stride_om, stride_ok,
        BLOCK_M, BLOCK_E,
    )  # fmt: skip
    o = _load_tile(o_ptrs, offs_m, seq_q, True, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
    in_rows = offs_m < seq_q
    row_ptrs = (off_b * num_heads + off_h) * seq_q + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + row_ptrs, mask=in_rows, other=0.0)  # [BLOCK_M]
    tl.store(Delta + row_ptrs, delta, mask=in_rows)
    lse = tl.load(Lse + row_ptrs, mask=in_rows, other=float("inf"))  # [BLOCK_M]
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    k_head = K + off_b * stride_kb + off_hk * stride_kh
    v_head = V + off_b * stride_vb + off_hk * stride_vh

    doc_off = off_b * stride_db
    block_first, full_first, full_end, block_end = _key_block_range(
        start_m, seq_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off,
        HAS_LO, HAS_HI, HAS_DOCS, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    row_lo, row_hi = _row_bounds(
        offs_m, seq_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off, HAS_LO, HAS_HI, HAS_DOCS
    )
    alibi_coef = _alibi_coef(Slopes, off_b, off_h, stride_sb, stride_sh, HAS_ALIBI, ALIBI_SIGN)
    shift = seq_k - seq_q

    dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    dslope = tl.zeros([BLOCK_M], dtype=tl.float32)
    dq, dslope = _attn_bwd_dq_inner(
        dq, dslope, q, do, lse2, delta, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, block_first, full_first, seq_k, shift,
        qk_scale, softcap_in, softcap_out, alibi_coef,
        True, EVEN_N, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
        HEAD_DIM, BLOCK_E, BLOCK_N, DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
    )  # fmt: skip
    dq, dslope = _attn_bwd_dq_inner(
        dq, dslope, q, do, lse2, delta, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, full_first, full_end, seq_k, shift,
        qk_scale, softcap_in, softcap_out, alibi_coef,
        False, EVEN_N, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
        HEAD_DIM, BLOCK_E, BLOCK_N, DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
    )  # fmt: skip
    dq, dslope = _attn_bwd_dq_inner(
        dq, dslope, q, do, lse2, delta, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, full_end, block_end, seq_k, shift,
        qk_scale, softcap_in, softcap_out, alibi_coef,
        True, EVEN_N, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
        HEAD_DIM, BLOCK_E, BLOCK_N, DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
    )  # fmt: skip

    if HAS_DSLOPE:
        # ALiBi's term is -slope * |i + (S - L) - j|
        dslope_ptr = DSlope + (off_b * num_heads + off_h) * tl.num_programs(0) + pid_m
        tl.store(dslope_ptr, -tl.sum(dslope, 0))
    dq *= sm_scale
    dq_ptrs = _tile_ptrs(
        DQ + off_b * stride_dqb + off_h.to(tl.int64) * stride_dqh, start_m, stride_dqm, stride_dqk,
        BLOCK_M, BLOCK_E,
    )  # fmt: skip
    tl.store(
        dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_rows[:, None] & (offs_e[None, :] < HEAD_DIM)
    )


# --------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of one kernel (``BLOCK_M`` queries, ``BLOCK_N`` keys)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Keyed by (GPU major compute capability, head dim padded to a power of two, bytes per
# element). Capability 0 holds the rows for GPUs without their own (Ampere and older, ROCm).
# Retune here; nothing else in this module depends on the numbers. The Hopper bf16 rows for
# head dims 64, 128 and 256 were picked by timing B=4, H=16, L=S=4096 causal, sliding-window
# and unmasked problems on an H100; the other rows (fp32, head dims 16/32, other GPUs) are
# conservative guesses that still need a sweep.
_C = KernelConfig
FORWARD_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {
    (9, 16, 2): _C(128, 64, 4, 3),
    (9, 32, 2): _C(128, 64, 4, 3),
    (9, 64, 2): _C(128, 64, 4, 3),
    (9, 128, 2): _C(128, 64, 8, 3),
    (9, 256, 2): _C(128, 64, 8, 2),
    (0, 16, 2): _C(128, 64, 4, 3),
    (0, 32, 2): _C(128, 64, 4, 3),
    (0, 64, 2): _C(128, 64, 4, 3),
    (0, 128, 2): _C(128, 64, 8, 3),
    (0, 256, 2): _C(64, 32, 4, 2),
    (0, 16, 4): _C(64, 32, 4, 2),
    (0, 32, 4): _C(64, 32, 4, 2),
    (0, 64, 4): _C(64, 32, 4, 2),
    (0, 128, 4): _C(64, 32, 4, 2),
    (0, 256, 4): _C(32, 32, 4, 1),
}
# dK/dV kernel: BLOCK_N keys stay resident while BLOCK_M query tiles stream past.
DKDV_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {
    (9, 16, 2): _C(32, 128, 4, 3),
    (9, 32, 2): _C(32, 128, 4, 3),
    (9, 64, 2): _C(32, 128, 4, 3),
    (9, 128, 2): _C(32, 64, 4, 3),
    (9, 256, 2): _C(64, 64, 8, 2),
    (0, 16, 2): _C(32, 64, 4, 2),
    (0, 32, 2): _C(32, 64, 4, 2),
    (0, 64, 2): _C(32, 64, 4, 2),
    (0, 128, 2): _C(32, 64, 4, 2),
    (0, 256, 2): _C(32, 32, 4, 1),
    (0, 16, 4): _C(32, 32, 4, 1),
    (0, 32, 4): _C(32, 32, 4, 1),
    (0, 64, 4): _C(32, 32, 4, 1),
    (0, 128, 4): _C(32, 32, 4, 1),
    (0, 256, 4): _C(16, 32, 4, 1),
}
# dQ kernel: BLOCK_M queries stay resident while BLOCK_N key tiles stream past.
DQ_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {
    (9, 16, 2): _C(64, 128, 4, 3),
    (9, 32, 2): _C(64, 128, 4, 3),
    (9, 64, 2): _C(64, 128, 4, 3),
    (9, 128, 2): _C(128, 64, 8, 4),
    (9, 256, 2): _C(128, 32, 8, 2),
    (0, 16, 2): _C(64, 32, 4, 2),
    (0, 32, 2): _C(64, 32, 4, 2),
    (0, 64, 2): _C(64, 32, 4, 2),
    (0, 128, 2): _C(64, 32, 4, 2),
    (0, 256, 2): _C(32, 32, 4, 1),
    (0, 16, 4): _C(32, 32, 4, 1),
    (0, 32, 4): _C(32, 32, 4, 1),
    (0, 64, 4): _C(32, 32, 4, 1),
    (0, 128, 4): _C(32, 32, 4, 1),
    (0, 256, 4): _C(32, 16, 4, 1),
}
del _C
# The interpreter runs each program in numpy: small tiles keep CPU tests fast.
INTERPRETER_CONFIG = KernelConfig(16, 16, 1, 1)


def _arch(device: torch.device) -> int:
    if device.type != "cuda" or torch.version.hip is not None:
        return 0
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_arch(index: int) -> int:
    major, _ = torch.cuda.get_device_capability(index)
    return 9 if major >= 9 else 0


def _pick_config(
    table: dict[tuple[int, int, int], KernelConfig], q: Tensor, block_e: int
) -> KernelConfig:
    if interpreting():
        return INTERPRETER_CONFIG
    elem = 4 if q.dtype == torch.float32 else 2
    return table.get((_arch(q.device), block_e, elem)) or table[(0, block_e, elem)]


def _tanh_mode(q: Tensor) -> int:
    if interpreting():
        return TANH_EXACT
    if q.dtype == torch.float32 or torch.version.hip is not None:
        return TANH_LIBDEVICE
    return TANH_APPROX


# Set while a launcher runs as the body of a registered op (kernels/ops.py). Only then are the
# launches routed through ``wrap_triton``, so ``torch.compile`` can trace them; a direct call
# launches the kernel itself, because the traceable wrapper costs ~0.1 ms of host time per
# launch in eager mode.
_TRACEABLE_LAUNCH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "attnbias_traceable_launch", default=False
)


@contextlib.contextmanager
def traceable_launches() -> Iterator[None]:
    """Route kernel launches through ``torch.library.wrap_triton`` inside this block."""
    token = _TRACEABLE_LAUNCH.set(True)
    try:
        yield
    finally:
        _TRACEABLE_LAUNCH.reset(token)


def _launch(kernel: Any) -> Any:
    """``kernel`` as something to launch with ``[grid](*args, **constexprs)``: traceable
    inside :func:`traceable_launches`, the plain kernel under the interpreter, and otherwise
    a :class:`_CachedLaunch` of it."""
    if interpreting():
        return kernel
    if _TRACEABLE_LAUNCH.get():
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    launcher = _CACHED_LAUNCHES.get(kernel)
    if launcher is None:
        launcher = _CACHED_LAUNCHES[kernel] = _CachedLaunch(kernel)
    return launcher


class _CachedLaunch:
    """Launches one ``@triton.jit`` kernel, reusing the compiled kernel when a call repeats
    an earlier call's scalar arguments and its tensors' dtypes and 16-byte alignment.

    Triton specializes a kernel on no more than that (integers on their width and on being 1
    or a multiple of 16, tensors on dtype and alignment, ``None`` as a constant), so a
    repeated key has the same compiled kernel. A launch through the jit function binds and
    specializes every argument and builds its own cache key on each call: on an H100 host
    that took ~60 µs per launch of the forward kernel, against ~20 µs for the compiled
    kernel's own launcher. Only the first call with a new key goes through the jit function
    (which compiles if needed). The kernel's parameters must be its tensors (or ``None``)
    first, from the first ``stride_*`` parameter on its scalars, and its ``tl.constexpr``
    parameters last, passed by keyword.
    """

    MAX_KEYS = 1024  # forget them all beyond this many (shapes that never repeat)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        names = [param.name for param in kernel.params]
        flags = [param.is_constexpr for param in kernel.params]
        self.num_args = flags.index(True) if True in flags else len(flags)
        self.num_tensors = next(
            (i for i, name in enumerate(names) if name.startswith("stride_")), self.num_args
        )
        if any(not flag for flag in flags[self.num_args :]):
            raise TypeError(f"{kernel}: constexpr parameters must come last")
        self.constexpr_names = names[self.num_args :]
        self.compiled: dict[tuple[object, ...], Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return functools.partial(self.run, grid)

    def run(self, grid: tuple[int, ...], *args: Any, **options: Any) -> None:
        if len(args) != self.num_args:
            raise TypeError(f"expected {self.num_args} runtime arguments, got {len(args)}")
        constexprs = [options[name] for name in self.constexpr_names]
        key = (
            torch.cuda.current_device(),
            options.get("num_warps"),
            options.get("num_stages"),
            *constexprs,
            *[
                None if t is None else (t.dtype, t.data_ptr() % 16 == 0)
                for t in args[: self.num_tensors]
            ],
            *args[self.num_tensors :],
        )
        compiled = self.compiled.get(key)
        if compiled is None:
            if len(self.compiled) >= self.MAX_KEYS:
                self.compiled.clear()
            launched = self.kernel[grid](*args, **options)
            if hasattr(launched, "__getitem__"):  # a compiled kernel with its own launcher
                self.compiled[key] = launched
        else:
            compiled[grid](*args, *constexprs)


_CACHED_LAUNCHES: dict[Any, _CachedLaunch] = {}


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MaskArgs:
    """Kernel arguments describing the mask and score modifiers of one call."""

    has_lo: bool
    has_hi: bool
    band_lo: int
    band_hi: int
    row_lo: Tensor | None  # (Bd, L) int32: first key of each query row's document
    row_hi: Tensor | None  # (Bd, L) int32: one past its last key
    col_lo: Tensor | None  # (Bd, S) int32: first query of each key column's document
    col_hi: Tensor | None  # (Bd, S) int32: one past its last query
    docs_per_batch: bool  # False when one row of ids is shared by the whole batch
    slopes: Tensor | None
    alibi_sign: int  # +1 (-1): every kept pair has i + (S - L) - j >= 0 (<= 0); 0 unknown
    stride_sb: int
    stride_sh: int
    qk_scale: float
    softcap_in: float
    softcap_out: float


def _doc_ranges(sorted_ids: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each id of ``ids``, the positions ``[lo, hi)`` of that id in ``sorted_ids``."""
    lo = torch.searchsorted(sorted_ids, ids, side="left", out_int32=True)
    hi = torch.searchsorted(sorted_ids, ids, side="right", out_int32=True)
    return lo, hi


@dataclass
class _DocRanges:
    """Per query row and per key column, the range of positions of its document on the other
    side; ``None`` where not computed."""

    kv_doc: weakref.ref[Tensor] | None = None  # the key ids they were computed with, if cached
    versions: tuple[int, int] = (0, 0)  # the query and key ids' version counters at that time
    row_lo: Tensor | None = None  # (Bd, L) int32: first key of each query row's document
    row_hi: Tensor | None = None  # (Bd, L) int32: one past its last key
    col_lo: Tensor | None = None  # (Bd, S) int32: first query of each key column's document
    col_hi: Tensor | None = None  # (Bd, S) int32: one past its last query
    per_batch: bool = False  # False when one row of ids is shared by the whole batch

    def computed_from(self, q_doc: Tensor, kv_doc: Tensor) -> bool:
        """Whether these ranges belong to ``q_doc``/``kv_doc`` as they are now."""
        return (
            self.kv_doc is not None
            and self.kv_doc() is kv_doc
            and self.versions == (q_doc._version, kv_doc._version)
        )


# Eager calls with one bias pass the same id tensors every time (the biases keep their ids on
# the device), so the ranges are computed once per pair of id tensors, not on every call; they
# are dropped with the query ids, and recomputed if either tensor was modified in place.
_DOC_RANGES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _document_ranges(q_doc: Tensor, kv_doc: Tensor, *, rows: bool, cols: bool) -> _DocRanges:
    cacheable = not (_TRACEABLE_LAUNCH.get() or torch.compiler.is_compiling())
    found: _DocRanges | None = _DOC_RANGES.get(q_doc) if cacheable else None
    if found is not None and found.computed_from(q_doc, kv_doc):
        ranges = found
    elif cacheable:
        ranges = _DocRanges(weakref.ref(kv_doc), (q_doc._version, kv_doc._version))
        _DOC_RANGES[q_doc] = ranges
        rows = cols = True  # both sides at once: the backward needs them all
    else:
        ranges = _DocRanges()
    if (rows and ranges.row_lo is None) or (cols and ranges.col_lo is None):
        q_ids = q_doc if q_doc.dim() == 2 else q_doc.unsqueeze(0)
        kv_ids = kv_doc if kv_doc.dim() == 2 else kv_doc.unsqueeze(0)
        nb = max(q_ids.shape[0], kv_ids.shape[0])
        q_ids = q_ids.to(torch.int64).expand(nb, q_ids.shape[1]).contiguous()
        kv_ids = kv_ids.to(torch.int64).expand(nb, kv_ids.shape[1]).contiguous()
        ranges.per_batch = nb > 1
        if rows and ranges.row_lo is None:
            ranges.row_lo, ranges.row_hi = _doc_ranges(kv_ids, q_ids)
        if cols and ranges.col_lo is None:
            ranges.col_lo, ranges.col_hi = _doc_ranges(q_ids, kv_ids)
    return ranges


def _mask_args(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    band_lo: int | None,
    band_hi: int | None,
    q_doc: Tensor | None,
    kv_doc: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float | None,
    rows: bool,
    cols: bool,
) -> _MaskArgs:
    seq_q, seq_k = q.shape[2], k.shape[2]
    # Every pair has 1 - L <= j - i <= S - 1: a bound outside that range keeps everything and is
    # dropped; a bound beyond the other end keeps nothing and is clamped to stay in int32.
    has_lo = band_lo is not None and band_lo > 1 - seq_q
    has_hi = band_hi is not None and band_hi < seq_k - 1
    lo = min(int(band_lo), seq_k) if has_lo and band_lo is not None else 0
    hi = max(int(band_hi), -seq_q) if has_hi and band_hi is not None else 0

    row_lo = row_hi = col_lo = col_hi = None
    docs_per_batch = False
    if q_doc is not None and kv_doc is not None:
        docs = _document_ranges(q_doc, kv_doc, rows=rows, cols=cols)
        row_lo, row_hi, col_lo, col_hi = docs.row_lo, docs.row_hi, docs.col_lo, docs.col_hi
        docs_per_batch = docs.per_batch

    slopes = None
    stride_sb = stride_sh = 0
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=torch.float32)
        if slopes.dim() == 1:
            stride_sh = slopes.stride(0)
        else:
            stride_sb = 0 if slopes.shape[0] == 1 else slopes.stride(0)
            stride_sh = slopes.stride(1)

    # The ALiBi distance i + (S - L) - j = (S - L) - (j - i) has one sign over the band when
    # the band lies on one side of j - i = S - L (causal attention does); its |.| is then
    # the distance or its negation, which saves an instruction per score.
    shift = seq_k - seq_q
    alibi_sign = 0
    if has_hi and hi <= shift:
        alibi_sign = 1
    elif has_lo and lo >= shift:
        alibi_sign = -1

    if softcap is not None:
        softcap_in, softcap_out = scale / softcap, softcap * LOG2E
    else:
        softcap_in = softcap_out = 0.0
    return _MaskArgs(
        has_lo=has_lo,
        has_hi=has_hi,
        band_lo=lo,
        band_hi=hi,
        row_lo=row_lo,
        row_hi=row_hi,
        col_lo=col_lo,
        col_hi=col_hi,
        docs_per_batch=docs_per_batch,
        slopes=slopes,
        alibi_sign=alibi_sign,
        stride_sb=stride_sb,
        stride_sh=stride_sh,
        qk_scale=scale * LOG2E,
        softcap_in=softcap_in,
        softcap_out=softcap_out,
    )


def _late_first(rows: int, cols: int, lo: int | None, hi: int | None) -> bool:
    """Whether a band gives late rows more columns than early ones, so that launching their
    programs first (longest first) leaves the short ones for the last wave.

    Row ``r`` keeps columns ``[max(0, r + lo), min(cols - 1, r + hi)]`` (``None``: open): the
    band cuts rows short at the start (``r < -lo``) and at the end (``r > cols - 1 - hi``);
    launch late rows first when more rows are cut short at the start. Documents are not known
    on the host and are left out.
    """
    if lo is None:
        return hi is not None  # rows keep [0, r + hi]: more for later rows
    if hi is None:
        return False  # rows keep [r + lo, cols): fewer for later rows
    return min(max(-lo, 0), rows) > min(max(rows - cols + hi, 0), rows)


def _late_rows_first(seq_q: int, seq_k: int, mask: _MaskArgs) -> bool:
    """:func:`_late_first` for query rows (forward and dQ programs)."""
    lo = mask.band_lo if mask.has_lo else None
    hi = mask.band_hi if mask.has_hi else None
    return _late_first(seq_q, seq_k, lo, hi)


def _late_cols_first(seq_q: int, seq_k: int, mask: _MaskArgs) -> bool:
    """:func:`_late_first` for key columns (dK/dV programs): column ``j`` is kept by rows
    ``[j - hi, j - lo]``, the band mirrored."""
    lo = -mask.band_hi if mask.has_hi else None
    hi = -mask.band_lo if mask.has_lo else None
    return _late_first(seq_k, seq_q, lo, hi)


def _doc_stride(mask: _MaskArgs, length: int) -> int:
    """Batch stride of the contiguous ``(Bd, length)`` document ranges (0 broadcasts)."""
    return length if mask.docs_per_batch else 0


def _block_e(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())  # the next power of two


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    band_lo: int | None,
    band_hi: int | None,
    q_doc: Tensor | None,
    kv_doc: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention forward.

    Args:
        q: ``(B, Hq, L, E)``; k, v: ``(B, Hkv, S, E)``, same dtype (fp16, bf16 or fp32) and
            device, any strides.
        scale: multiplies ``q @ k^T``.
        band_lo, band_hi: keep ``band_lo <= j - i <= band_hi``; ``None`` leaves a side open.
        q_doc, kv_doc: non-decreasing integer document ids ``(1 | B, L)`` and ``(1 | B, S)``
            (both or neither); a pair is kept only within one document.
        alibi_slopes: fp32 ``(1 | B, Hq)``; adds ``-slope * |i + (S - L) - j|``.
        softcap: ``cap > 0`` turns a score ``s`` into ``cap * tanh(s / cap)`` before ALiBi.

    Returns:
        ``out`` ``(B, Hq, L, E)`` in ``q.dtype`` (contiguous) and ``lse`` ``(B, Hq, L)`` fp32,
        natural log; a row that keeps no key has ``out = 0`` and ``lse = -inf``.

    Inputs are assumed valid (the caller validates them).
    """
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    out = torch.empty((batch, num_heads, seq_q, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads, seq_q), dtype=torch.float32, device=q.device)
    if lse.numel() == 0:
        return out, lse
    mask = _mask_args(
        q, k, scale=scale, band_lo=band_lo, band_hi=band_hi, q_doc=q_doc, kv_doc=kv_doc,
        alibi_slopes=alibi_slopes, softcap=softcap, rows=True, cols=False,
    )  # fmt: skip
    block_e = _block_e(head_dim)
    cfg = _pick_config(FORWARD_CONFIGS, q, block_e)
    grid = (triton.cdiv(seq_q, cfg.block_m), num_heads, batch)
    _launch(_attn_fwd)[grid](
        q, k, v, out, lse, mask.row_lo, mask.row_hi, mask.slopes,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        _doc_stride(mask, seq_q),
        mask.stride_sb, mask.stride_sh,
        num_heads, num_heads // num_kv_heads, seq_q, seq_k, mask.band_lo, mask.band_hi,
        mask.qk_scale, mask.softcap_in, mask.softcap_out,
        HEAD_DIM=head_dim,
        BLOCK_E=block_e,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HAS_LO=mask.has_lo,
        HAS_HI=mask.has_hi,
        HAS_DOCS=mask.row_lo is not None,
        HAS_ALIBI=mask.slopes is not None,
        ALIBI_SIGN=mask.alibi_sign,
        HAS_SOFTCAP=softcap is not None,
        TANH_MODE=_tanh_mode(q),
        REVERSE=_late_rows_first(seq_q, seq_k, mask),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        EVEN_N=seq_k % cfg.block_n == 0,
        POSITIVE_SCALE=mask.qk_scale >= _FP32_TINY,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, lse


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float,
    band_lo: int | None,
    band_hi: int | None,
    q_doc: Tensor | None,
    kv_doc: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float | None,
    grad_lse: Tensor | None = None,
    slopes_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients ``(dq, dk, dv, dslopes)`` of :func:`attention_forward`, in the inputs' dtypes
    and shapes.

    ``out`` and ``lse`` are the forward's outputs, ``grad_out`` ``(B, Hq, L, E)`` any strides;
    ``grad_lse`` ``(B, Hq, L)``, optional, is the gradient of ``lse`` when it was used.
    ``dslopes``, the gradient of ``alibi_slopes`` (same shape), is computed only when
    ``slopes_grad`` is set (and ALiBi is on), and is ``None`` otherwise.
    Rows that kept no key contribute nothing; keys that no row keeps get zero gradients.
    """
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    slopes_grad = slopes_grad and alibi_slopes is not None
    dslopes = None
    if batch * num_heads * seq_q * seq_k * head_dim == 0:  # nothing depends on anything
        if slopes_grad and alibi_slopes is not None:
            dslopes = torch.zeros_like(alibi_slopes)
        return dq.zero_(), dk.zero_(), dv.zero_(), dslopes
    mask = _mask_args(
        q, k, scale=scale, band_lo=band_lo, band_hi=band_hi, q_doc=q_doc, kv_doc=kv_doc,
        alibi_slopes=alibi_slopes, softcap=softcap, rows=True, cols=True,
    )  # fmt: skip
    lse = lse.to(torch.float32).contiguous()
    block_e = _block_e(head_dim)
    group_size = num_heads // num_kv_heads
    common: dict[str, Any] = dict(
        HEAD_DIM=head_dim,
        BLOCK_E=block_e,
        HAS_LO=mask.has_lo,
        HAS_HI=mask.has_hi,
        HAS_DOCS=mask.row_lo is not None,
        HAS_ALIBI=mask.slopes is not None,
        ALIBI_SIGN=mask.alibi_sign,
        HAS_SOFTCAP=softcap is not None,
        TANH_MODE=_tanh_mode(q),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )

    delta = torch.empty((batch, num_heads, seq_q), dtype=torch.float32, device=q.device)
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()

    # The dQ kernel goes first: it also stores the row terms ``delta`` that dK/dV reads.
    cfg = _pick_config(DQ_CONFIGS, q, block_e)
    grid = (triton.cdiv(seq_q, cfg.block_m), num_heads, batch)
    dslope_parts = (
        torch.empty((batch, num_heads, grid[0]), dtype=torch.float32, device=q.device)
        if slopes_grad
        else None
    )
    _launch(_attn_bwd_dq)[grid](
        q, k, v, out, grad_out, lse, grad_lse, delta, dq,
        mask.row_lo, mask.row_hi, mask.slopes, dslope_parts,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *out.stride(),
        *grad_out.stride(),
        *dq.stride(),
        _doc_stride(mask, seq_q),
        mask.stride_sb, mask.stride_sh,
        num_heads, group_size, seq_q, seq_k, mask.band_lo, mask.band_hi,
        scale, mask.qk_scale, mask.softcap_in, mask.softcap_out,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        REVERSE=_late_rows_first(seq_q, seq_k, mask),
        HAS_DLSE=grad_lse is not None,
        EVEN_N=seq_k % cfg.block_n == 0,
        HAS_DSLOPE=dslope_parts is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **common,
    )  # fmt: skip
    if dslope_parts is not None and alibi_slopes is not None:
        dslopes = _reduce_to(dslope_parts.sum(-1), alibi_slopes)
    cfg = _pick_config(DKDV_CONFIGS, q, block_e)
    grid = (triton.cdiv(seq_k, cfg.block_n), num_kv_heads, batch)
    _launch(_attn_bwd_dkdv)[grid](
        q, k, v, grad_out, lse, delta, dk, dv, mask.col_lo, mask.col_hi, mask.slopes,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *grad_out.stride(),
        *dk.stride(),
        *dv.stride(),
        _doc_stride(mask, seq_k),
        mask.stride_sb, mask.stride_sh,
        num_heads, group_size, seq_q, seq_k, mask.band_lo, mask.band_hi,
        scale, mask.qk_scale, mask.softcap_in, mask.softcap_out,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        REVERSE=_late_cols_first(seq_q, seq_k, mask),
        EVEN_M=seq_q % cfg.block_m == 0,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **common,
    )  # fmt: skip
    return dq, dk, dv, dslopes


def _reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """``(B, Hq)`` per-slope gradients summed over the batch where ``like`` is ``(Hq,)`` or
    ``(1, Hq)``, in ``like``'s dtype."""
    if like.dim() == 1:
        grad = grad.sum(0)
    elif like.shape[0] == 1:
        grad = grad.sum(0, keepdim=True)
    return grad.to(like.dtype)

"""Constants and ``@triton.jit`` helpers shared by the forward, backward and decode kernels.

Mask model (``i`` a query row in ``[0, L)``, ``j`` a key column in ``[0, S)``)::

    keep(i, j) = band_lo <= j - i <= band_hi          (either side may be unbounded)
                 and q_doc[b, i] == kv_doc[b, j]      (when document ids are given)
                 and kv_start[b] <= j < kv_end[b]     (when a key range is given)

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

The key range of batch row ``b`` (padding, the filled part of a cache) is the same for every
row of the tile: it narrows the touched and the full runs alike, and it also bounds the loads.
In the blocks at its ends (partial by construction) keys and values outside it are loaded as
zeros, never read, and the dK/dV kernel stores zero gradients for them: a NaN or Inf in a
padded key or value or an unused cache slot reaches nothing at all, unlike the masked
positions of the band and documents described next. Whether there is a key range is a
compile-time feature (``has_kv_range(F)``, see ``record.py``), so calls without one compile
to the same code as before.

Scores are kept in base 2: ``s2 = log2(e) * s`` so the softmax uses ``exp2``; the
log-sum-exp written out is in natural log. A row that keeps no key gets output 0 and
``lse = -inf``; the backward kernels read such a row's ``lse`` as ``+inf`` so every
probability recomputed from it is exactly 0 and no gradient from it is NaN.

Any finite scale works: with a positive normal scale and no score modifier the forward
masks and maximises raw dot products and scales them in the exponent's FMA; otherwise (0,
negative, below float32's smallest normal) it scales first (``positive_scale(F)``).

Masked pairs *select* their value (``-inf`` scores, zero probabilities and score gradients)
with ``tl.where``, so a NaN or Inf in a masked key never becomes a score. Skipped tiles and
rows past ``L`` or ``S`` (or head dims past ``E``) are never loaded. Within a partial tile
the zero weights of masked pairs still multiply their rows of values (forward), keys (dQ),
queries and output gradients (dK/dV): a NaN or Inf there reaches the rows of that tile, as
in the other fused kernels (stock SDPA's, FlashAttention 4). Zeroing those rows first cost
more than a tenth of the time on windows and documents (``benchmarks/NOTES.md``). A NaN in a kept
position propagates to what depends on it, as in stock SDPA.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``Hq % Hkv == 0``;
query head ``h`` reads key/value head ``h // (Hq // Hkv)``), ``L`` queries, ``S`` keys,
``E`` head dim (16 to 256; padded to the next power of two inside the kernels).
"""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .limits import interpreting
from .record import (
    alibi_sign_of,
    has_alibi,
    has_docs,
    has_hi,
    has_kv_range,
    has_lo,
    has_softcap,
    lists_per_batch,
    lists_per_head,
    mask_alibi_stride_b,
    mask_alibi_stride_h,
    mask_band_hi,
    mask_band_lo,
    mask_col_hi,
    mask_col_lo,
    mask_kv_capacity,
    mask_kv_end,
    mask_kv_pool,
    mask_kv_start,
    mask_page_table,
    mask_qk_scale,
    mask_row_hi,
    mask_row_lo,
    mask_seq_lens,
    mask_slopes,
    mask_softcap_in,
    mask_softcap_out,
    mask_table_stride,
    page_size,
    tanh_mode_of,
)

__all__ = [
    "FP32_TINY",
    "LN2",
    "LN2_K",
    "LOG2E",
    "LOG2E_K",
    "TANH_APPROX",
    "TANH_APPROX_K",
    "TANH_EXACT",
    "TANH_LIBDEVICE",
    "TANH_LIBDEVICE_K",
]

LOG2E = 1.4426950408889634  # log2(e): scores are pre-scaled by it so the softmax can use exp2
# The smallest positive normal float32: a smaller scale may flush to zero on the GPU.
FP32_TINY = torch.finfo(torch.float32).tiny

# How the soft-cap evaluates tanh: an exact formula built from exp (the interpreter has no
# libdevice and no inline asm), libdevice's tanh (fp32 inputs on the GPU, where the error
# budget is fp32's), or the hardware's tanh.approx.f32 (fp16/bf16 inputs: its ~2^-11
# relative error is below what rounding the scores to 16 bits costs eager PyTorch).
TANH_EXACT = 0
TANH_LIBDEVICE = 1
TANH_APPROX = 2
LN2 = 0.6931471805599453  # ln(2): a base-2 log-sum-exp times this is a natural one

# The same numbers as the kernels read them (a jit function reads only constexpr globals).
LOG2E_K = tl.constexpr(LOG2E)
LN2_K = tl.constexpr(LN2)
TANH_LIBDEVICE_K = tl.constexpr(TANH_LIBDEVICE)
TANH_APPROX_K = tl.constexpr(TANH_APPROX)


# Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit patterns; widening them
# to fp32 first is exact, so the interpreter then matches the GPU up to summation order.
_INTERPRETER = tl.constexpr(interpreting())


@triton.jit
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    if _INTERPRETER and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)  # [rows of a, cols of b]


@triton.jit
def _tanh(x, TANH_MODE: tl.constexpr):
    if TANH_MODE == TANH_APPROX_K:
        y = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;",
            "=r,r",
            [x],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    elif TANH_MODE == TANH_LIBDEVICE_K:
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
def _log2_scores(qk, rel, offset, alibi_coef, M, F: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """Base-2 scores from raw dot products, minus ``offset`` (a broadcast row or column of
    base-2 log-sum-exps) when ``HAS_OFFSET``.

    ``rel = i + (S - L) - j`` as fp32 is read only for ALiBi (integers below 2^24 are exact
    in fp32, so it is the integer distance), whose term is ``alibi_coef * |rel|``, or
    ``alibi_coef * rel`` when every kept pair has ``rel`` of the sign ``ALIBI_SIGN`` (+1 or
    -1; 0 when unknown), with ``alibi_coef`` = ``-slope * log2(e)`` times that sign (-1 for 0).

    Returns ``(s2, t)`` where ``t = tanh(scale * qk / cap)`` under a soft-cap (the backward
    pass needs it for ``1 - t^2``) and ``qk`` otherwise (unused then). The terms are summed
    so that each step is one FMA. The scale, the soft-cap and ALiBi's sign are the mask's
    (``M``, ``F``: see ``record.py``).
    """
    HAS_ALIBI: tl.constexpr = has_alibi(F)
    ALIBI_SIGN: tl.constexpr = alibi_sign_of(F)
    if HAS_ALIBI:
        dist = tl.abs(rel) if ALIBI_SIGN == 0 else rel
        extra = dist * alibi_coef - offset if HAS_OFFSET else dist * alibi_coef
    elif HAS_OFFSET:
        extra = -offset
    else:
        extra = 0.0
    if has_softcap(F):
        t = _tanh(qk * mask_softcap_in(M), tanh_mode_of(F))
        s = t * mask_softcap_out(M) + extra
    else:
        t = qk
        s = qk * mask_qk_scale(M) + extra
    return s, t


@triton.jit
def _alibi_coef(M, F: tl.constexpr, off_b, off_h):
    """The factor of the ALiBi distance in base-2 scores (see ``_log2_scores``)."""
    if has_alibi(F):
        slope = tl.load(
            mask_slopes(M) + off_b * mask_alibi_stride_b(M) + off_h * mask_alibi_stride_h(M)
        )
        coef = slope * (LOG2E_K if alibi_sign_of(F) < 0 else -LOG2E_K)
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
def _load_key_tile(
    ptrs,
    offs_n,
    seq_k,
    kv_lo,
    kv_hi,
    BOUNDS: tl.constexpr,
    IN_RANGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Load a ``[ROWS, BLOCK_E]`` tile of keys (or values) ``offs_n``.

    ``IN_RANGE``: rows outside the key range ``[kv_lo, kv_hi)`` (within ``[0, S]``, see
    ``_key_range``) are not read and come out 0. Otherwise, with ``BOUNDS``, rows past ``S``.
    """
    offs_e = tl.arange(0, BLOCK_E)
    if IN_RANGE:
        rows = (offs_n[:, None] >= kv_lo) & (offs_n[:, None] < kv_hi)
        if BLOCK_E == HEAD_DIM:
            x = tl.load(ptrs, mask=rows, other=0.0)  # [ROWS, BLOCK_E]
        else:
            x = tl.load(
                ptrs, mask=rows & (offs_e[None, :] < HEAD_DIM), other=0.0
            )  # [ROWS, BLOCK_E]
    else:
        x = _load_tile(ptrs, offs_n, seq_k, BOUNDS, HEAD_DIM, BLOCK_E)  # [ROWS, BLOCK_E]
    return x


@triton.jit
def _key_range(M, F: tl.constexpr, off_b, seq_k):
    """Batch row ``off_b``'s valid keys ``[kv_lo, kv_hi)`` with ``0 <= kv_lo <= kv_hi <= S``
    (empty when equal; the front-end checks the bounds, which are clamped here anyway so that
    no load can leave the tensor); ``[0, S)`` without a key range."""
    if has_kv_range(F):
        kv_lo = tl.load(mask_kv_start(M) + off_b)
        kv_hi = tl.load(mask_kv_end(M) + off_b)
        kv_lo = tl.minimum(tl.maximum(kv_lo, 0), seq_k)
        kv_hi = tl.minimum(tl.maximum(kv_hi, kv_lo), seq_k)
    else:
        kv_lo = seq_k * 0
        kv_hi = seq_k
    return kv_lo, kv_hi


@triton.jit
def _listed_tiles(entries, length, BLOCK: tl.constexpr, TILES: tl.constexpr):
    """How many tiles of ``BLOCK`` the list at ``entries`` (a count, then list blocks of
    ``TILES`` tiles) holds: every block's ``TILES`` but the sequence's last block's (cut at
    ``length``), which a list holds last."""
    count = tl.load(entries)
    tiles = count * TILES
    if count > 0:
        end = (tl.load(entries + count) + 1) * TILES
        tiles -= tl.maximum(end - tl.cdiv(length, BLOCK), 0)
    return tiles


@triton.jit
def _listed_tile(entries, t, TILES: tl.constexpr):
    """Tile ``t`` of the list at ``entries``, counted in list order (``TILES`` per block)."""
    return tl.load(entries + 1 + t // TILES) * TILES + t % TILES


@triton.jit
def _page_row(M, F: tl.constexpr, off_b, seq_k):
    """Batch row ``off_b``'s page table and the token at its key position 0 (``seq_lens[b]
    - seq_k``: its tokens end at the last position); placeholders without pages."""
    if page_size(F) > 0:
        table = mask_page_table(M) + off_b * mask_table_stride(M)
        shift = tl.load(mask_seq_lens(M) + off_b) - seq_k
    else:
        table = 0
        shift = 0
    return table, shift


@triton.jit
def _paged_rows(table, tokens, M, F: tl.constexpr):
    """The pool rows of a row's ``tokens`` in pages of ``PAGE`` (the mask's page size):
    token ``t`` is slot ``t % PAGE`` of page ``table[t // PAGE]``, row ``page * PAGE + slot``
    of the pool. Tokens are clamped into the row's capacity and pages into the pool (a bad
    entry is flagged where the tables are checked, never read out of bounds); positions
    before the row's first token read that token (they are outside its key range)."""
    PAGE: tl.constexpr = page_size(F)
    t = tl.minimum(tl.maximum(tokens, 0), mask_kv_capacity(M) - 1)
    return _pool_page(table, t // PAGE, M).to(tl.int64) * PAGE + t % PAGE


@triton.jit
def _pool_page(table, entry, M):
    """The page at ``table[entry]``, clamped into the pool (a bad entry is flagged where the
    tables are checked, never read out of bounds)."""
    return tl.minimum(tl.maximum(tl.load(table + entry), 0), mask_kv_pool(M) - 1)


@triton.jit
def _page_tile_row(table, token, M, F: tl.constexpr, BLOCK_N: tl.constexpr):
    """The pool row of a tile's first token ``token`` (a multiple of ``BLOCK_N``, which
    divides the page size): the tile's tokens are that row and the next ``BLOCK_N - 1`` of
    the same page. Clamped as :func:`_paged_rows` clamps, by whole tiles."""
    PAGE: tl.constexpr = page_size(F)
    t = tl.maximum(tl.minimum(tl.maximum(token, 0), mask_kv_capacity(M) - BLOCK_N), 0)
    return _pool_page(table, t // PAGE, M).to(tl.int64) * PAGE + t % PAGE


@triton.jit
def _page_tile_pages(table, token, M, F: tl.constexpr, BLOCK_N: tl.constexpr):
    """For a tile of ``BLOCK_N`` tokens from ``token`` (a multiple of ``BLOCK_N``, which the
    page size divides, so the tile holds ``BLOCK_N / PAGE`` whole pages): the pool row of each
    token's page's first slot (int64 ``[BLOCK_N]``); the tile's token ``i`` is slot ``i %
    PAGE`` past it. Table entries are clamped into the row's table and pages into the pool,
    as :func:`_paged_rows` clamps."""
    PAGE: tl.constexpr = page_size(F)
    entry = token // PAGE + tl.arange(0, BLOCK_N) // PAGE
    entry = tl.minimum(tl.maximum(entry, 0), mask_kv_capacity(M) // PAGE - 1)
    return _pool_page(table, entry, M).to(tl.int64) * PAGE


@triton.jit
def _page_grid(kv_shift, BLOCK_N: tl.constexpr):
    """The grid offset that puts key tiles on a row's tokens (key position ``n`` is token
    ``n + kv_shift``): tiles start at the positions whose token is a multiple of
    ``BLOCK_N``."""
    return ((kv_shift % BLOCK_N) + BLOCK_N) % BLOCK_N


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
    start_m, seq_q, seq_k, M, F: tl.constexpr, doc_off, kv_lo, kv_hi, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key blocks seen by query rows ``[start_m, start_m + BLOCK_M)`` (see ``_split_blocks``)."""
    last = tl.minimum(start_m + BLOCK_M, seq_q) - 1
    return _rows_key_blocks(start_m, last, seq_k, M, F, doc_off, kv_lo, kv_hi, BLOCK_N)


@triton.jit
def _rows_key_blocks(
    first, last, seq_k, M, F: tl.constexpr, doc_off, kv_lo, kv_hi, BLOCK_N: tl.constexpr,
    grid_off=0,
):  # fmt: skip
    """Key blocks seen by query rows ``[first, last]`` (see ``_split_blocks``); ``doc_off``:
    the batch row's offset into the document ranges. Block ``t`` holds key positions
    ``[t * BLOCK_N - grid_off, (t + 1) * BLOCK_N - grid_off)``."""
    lo = first * 0
    hi = lo + seq_k
    full_lo = lo
    full_hi = hi
    if has_lo(F):
        lo = tl.maximum(lo, first + mask_band_lo(M))
        full_lo = tl.maximum(full_lo, last + mask_band_lo(M))
    if has_hi(F):
        hi = tl.minimum(hi, last + mask_band_hi(M) + 1)
        full_hi = tl.minimum(full_hi, first + mask_band_hi(M) + 1)
    if has_docs(F):
        lo = tl.maximum(lo, tl.load(mask_row_lo(M) + doc_off + first))
        full_lo = tl.maximum(full_lo, tl.load(mask_row_lo(M) + doc_off + last))
        hi = tl.minimum(hi, tl.load(mask_row_hi(M) + doc_off + last))
        full_hi = tl.minimum(full_hi, tl.load(mask_row_hi(M) + doc_off + first))
    if has_kv_range(F):  # the same keys for every row: it narrows the full run as well
        lo = tl.maximum(lo, kv_lo)
        full_lo = tl.maximum(full_lo, kv_lo)
        hi = tl.minimum(hi, kv_hi)
        full_hi = tl.minimum(full_hi, kv_hi)
    return _split_blocks(lo + grid_off, hi + grid_off, full_lo + grid_off, full_hi + grid_off,
                         BLOCK_N)  # fmt: skip


@triton.jit
def _row_bounds(offs_m, seq_q, seq_k, M, F: tl.constexpr, doc_off, kv_lo, kv_hi):
    """Per query row, the kept keys ``[row_lo, row_hi)`` (``row_hi <= S``), both ``[BLOCK_M]``."""
    row_lo = offs_m * 0
    row_hi = row_lo + seq_k
    if has_lo(F):
        row_lo = tl.maximum(row_lo, offs_m + mask_band_lo(M))
    if has_hi(F):
        row_hi = tl.minimum(row_hi, offs_m + mask_band_hi(M) + 1)
    if has_docs(F):
        in_rows = offs_m < seq_q
        doc_lo = tl.load(mask_row_lo(M) + doc_off + offs_m, mask=in_rows, other=0)  # [BLOCK_M]
        doc_hi = tl.load(mask_row_hi(M) + doc_off + offs_m, mask=in_rows, other=0)  # [BLOCK_M]
        row_lo = tl.maximum(row_lo, doc_lo)
        row_hi = tl.minimum(row_hi, doc_hi)
    if has_kv_range(F):
        row_lo = tl.maximum(row_lo, kv_lo)
        row_hi = tl.minimum(row_hi, kv_hi)
    return row_lo, row_hi


@triton.jit
def _query_block_range(
    start_n, seq_q, seq_k, M, F: tl.constexpr, doc_off, kv_lo, kv_hi, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Query blocks that see key columns ``[start_n, start_n + BLOCK_N)``."""
    first = start_n
    last = tl.minimum(start_n + BLOCK_N, seq_k) - 1
    if has_kv_range(F):
        # Only the tile's columns inside the key range are kept by any row: the rows are
        # bounded by the first and last of those (indices kept inside the tile, so that the
        # loads below stay in bounds), and no block is full unless every column is inside.
        any_inside = (kv_lo < kv_hi) & (first < kv_hi) & (last >= kv_lo)
        all_inside = (first >= kv_lo) & (last < kv_hi)
        first = tl.minimum(tl.maximum(first, kv_lo), last)
        last = tl.maximum(tl.minimum(last, kv_hi - 1), first)
    lo = first * 0
    hi = lo + seq_q
    full_lo = lo
    full_hi = hi
    if has_hi(F):  # j - i <= band_hi  <=>  i >= j - band_hi
        lo = tl.maximum(lo, first - mask_band_hi(M))
        full_lo = tl.maximum(full_lo, last - mask_band_hi(M))
    if has_lo(F):  # j - i >= band_lo  <=>  i <= j - band_lo
        hi = tl.minimum(hi, last - mask_band_lo(M) + 1)
        full_hi = tl.minimum(full_hi, first - mask_band_lo(M) + 1)
    if has_docs(F):
        lo = tl.maximum(lo, tl.load(mask_col_lo(M) + doc_off + first))
        full_lo = tl.maximum(full_lo, tl.load(mask_col_lo(M) + doc_off + last))
        hi = tl.minimum(hi, tl.load(mask_col_hi(M) + doc_off + last))
        full_hi = tl.minimum(full_hi, tl.load(mask_col_hi(M) + doc_off + first))
    if has_kv_range(F):
        hi = tl.where(any_inside, hi, lo)
        full_hi = tl.where(all_inside, full_hi, full_lo)
    return _split_blocks(lo, hi, full_lo, full_hi, BLOCK_M)


@triton.jit
def _col_bounds(offs_n, seq_q, seq_k, M, F: tl.constexpr, doc_off, kv_lo, kv_hi):
    """Per key column, the query rows keeping it ``[col_lo, col_hi)``; empty past ``S`` and
    outside the key range."""
    in_cols = offs_n < seq_k
    col_lo = offs_n * 0
    col_hi = tl.where(in_cols, col_lo + seq_q, 0)
    if has_hi(F):
        col_lo = tl.maximum(col_lo, offs_n - mask_band_hi(M))
    if has_lo(F):
        col_hi = tl.minimum(col_hi, offs_n - mask_band_lo(M) + 1)
    if has_docs(F):
        doc_lo = tl.load(mask_col_lo(M) + doc_off + offs_n, mask=in_cols, other=0)  # [BLOCK_N]
        doc_hi = tl.load(mask_col_hi(M) + doc_off + offs_n, mask=in_cols, other=0)  # [BLOCK_N]
        col_lo = tl.maximum(col_lo, doc_lo)
        col_hi = tl.minimum(col_hi, doc_hi)
    if has_kv_range(F):
        col_hi = tl.where((offs_n >= kv_lo) & (offs_n < kv_hi), col_hi, 0)
    return col_lo, col_hi


@triton.jit
def _list_row(Lists, F: tl.constexpr, off_b, off_h, num_heads, row, num_rows, width):
    """Where block row ``row`` of batch row ``off_b`` and query head ``off_h`` starts in a
    ``(Bl, Hl, num_rows, 2, width)`` list tensor (see ``program.BlockLists``): its partial
    blocks ``[count, block, ...]``, then at ``+ width`` its full blocks."""
    lb = off_b if lists_per_batch(F) else off_b * 0
    lh = off_h if lists_per_head(F) else off_h * 0
    heads = num_heads if lists_per_head(F) else 1
    return Lists + ((lb * heads + lh) * num_rows + row).to(tl.int64) * (2 * width)


# -- generated mask and score functions (``modemit.py``) ---------------------------------------
# They see FlexAttention's indices: the batch row, the query head, and each pair's query and
# key positions, clamped into the sequences (rows and columns past L or S in a tile's padding
# are masked anyway, and must not index a parameter out of its range). Scores go in and out in
# natural units; the kernels keep base-2 scores.


@triton.jit
def _mod_context(off_b, off_h, seq_q, seq_k, MOD):
    """What the generated functions read besides the pair: ``(b, h, last query, last key,
    the runtime arguments)``."""
    return (off_b.to(tl.int32), off_h.to(tl.int32), seq_q - 1, seq_k - 1, MOD)


@triton.jit
def _mod_indices(offs_m, offs_n, MODC, TRANSPOSED: tl.constexpr):
    q_idx = tl.minimum(offs_m, MODC[2])
    kv_idx = tl.minimum(offs_n, MODC[3])
    if TRANSPOSED:  # [BLOCK_N, BLOCK_M] tiles of the dK/dV kernel
        rows = q_idx[None, :]
        cols = kv_idx[:, None]
    else:
        rows = q_idx[:, None]
        cols = kv_idx[None, :]
    return rows, cols


@triton.jit
def _mod_keep(offs_m, offs_n, MODC, MASK_FN: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """Whether the generated mask functions keep each pair of the tile."""
    q_idx, kv_idx = _mod_indices(offs_m, offs_n, MODC, TRANSPOSED)
    return MASK_FN(MODC[0], MODC[1], q_idx, kv_idx, MODC[4])


@triton.jit
def _partial_keep(
    offs_m,
    offs_n,
    lo,
    hi,
    length,
    MODC,
    MASK_FN: tl.constexpr,
    BOUNDED: tl.constexpr,
    BOUNDS: tl.constexpr,
    TRANSPOSED: tl.constexpr = False,
):
    """Which pairs of a partial tile are kept, ``[BLOCK_M, BLOCK_N]`` (``TRANSPOSED``:
    ``[BLOCK_N, BLOCK_M]``, a key tile's rows): ``lo``, ``hi`` give each tile row's kept
    columns ``[lo, hi)`` (keys; queries when ``TRANSPOSED``), ``BOUNDED`` says whether band,
    document or key-range terms set them (else they are ``[0, length)``), ``BOUNDS`` whether
    columns may lie past ``length``. Without such terms a mask function's tile compares
    only what it must: the row bounds would cost two compares per pair."""
    cols = offs_m if TRANSPOSED else offs_n
    if MASK_FN is None or BOUNDED:
        keep = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        if MASK_FN is not None:
            keep = keep & _mod_keep(offs_m, offs_n, MODC, MASK_FN, TRANSPOSED)
    else:
        keep = _mod_keep(offs_m, offs_n, MODC, MASK_FN, TRANSPOSED)
        if BOUNDS:
            keep = keep & (cols[None, :] < length)
    return keep


@triton.jit
def _mod_score(
    s2, offs_m, offs_n, MODC, SCORE_FN: tl.constexpr, TRANSPOSED: tl.constexpr = False,
    TILED: tl.constexpr = False,
):  # fmt: skip
    """Base-2 scores ``s2`` through the generated score functions. ``TILED``: a tile of one
    batch row and head (``MODC``'s ``b`` and ``h`` scalars), whose score functions may take
    one value over the tile where they have one (see ``modemit._score_cut``)."""
    q_idx, kv_idx = _mod_indices(offs_m, offs_n, MODC, TRANSPOSED)
    return SCORE_FN(s2 * LN2_K, MODC[0], MODC[1], q_idx, kv_idx, MODC[4], TILED) * LOG2E_K


@triton.jit
def _mod_score_grad(
    s2, offs_m, offs_n, MODC, SCORE_GRAD_FN: tl.constexpr, TRANSPOSED: tl.constexpr = False
):
    """:func:`_mod_score` and the derivative of the score functions in their input score."""
    q_idx, kv_idx = _mod_indices(offs_m, offs_n, MODC, TRANSPOSED)
    s, ds = SCORE_GRAD_FN(s2 * LN2_K, MODC[0], MODC[1], q_idx, kv_idx, MODC[4], True)
    return s * LOG2E_K, ds


@triton.jit
def _mod_param_grads(s2, offs_m, offs_n, MODC, ds, PARAM_GRAD_FN: tl.constexpr):
    """Add a tile's part of the gradients of the tensors the generated score functions read:
    ``ds`` is the gradient of their output (0 on masked pairs), ``s2`` their base-2 input."""
    q_idx, kv_idx = _mod_indices(offs_m, offs_n, MODC, False)
    PARAM_GRAD_FN(s2 * LN2_K, MODC[0], MODC[1], q_idx, kv_idx, MODC[4], ds, True)

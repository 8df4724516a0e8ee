"""The decode kernels: :func:`_decode_fwd` (a program per tile of packed query rows and share of
the keys) and :func:`_decode_merge` (the shares' merge where it is not done in the first kernel).
What they compute, and the layout of the packed rows, is described in :mod:`.decode`."""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E_K,
    _key_range,
    _mod_context,
    _page_grid,
    _page_row,
    _row_bounds,
    _rows_key_blocks,
)
from .forward import _attn_fwd_runs
from .record import (
    alibi_sign_of,
    has_alibi,
    mask_alibi_stride_b,
    mask_alibi_stride_h,
    mask_row_stride,
    mask_slopes,
    page_size,
)

__all__: list[str] = []
# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------


@triton.jit
def _decode_fwd(
    Q,
    K,
    V,
    Out,
    Parts,
    Counters,
    M,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    group_size,
    row_tiles,
    seq_q,
    seq_k,
    MOD,
    F: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT: tl.constexpr,
    MERGE_LAST: tl.constexpr,
    MASK_FN: tl.constexpr = None,
    SCORE_FN: tl.constexpr = None,
    HEADLESS_TILE_FN: tl.constexpr = None,
):  # fmt: skip
    """One share of the key blocks of one tile of packed rows (grid: splits, Hkv * tiles, B).

    Generated mask functions (``MASK_FN``) may drop pairs of any visited block: the band's
    full run stays full only where they do not read the head and their bounds over the run
    (``HEADLESS_TILE_FN``) show them keeping all of it (a draft tree's cache); otherwise every
    block is partial (the training kernel's block lists settle each block).

    With ``SPLIT`` it stores the share's normalised output and base-2 log-sum-exp in
    ``Parts`` (float32: ``(splits, B * Hkv * tiles, BLOCK_M, BLOCK_E)`` outputs, then
    ``(splits, B * Hkv * tiles, BLOCK_M)`` log-sum-exps); with ``MERGE_LAST`` the last share
    of the tile to finish, counted on ``Counters`` ``(B * Hkv * tiles,)`` (int32, zero on
    entry and on exit), merges them into the output, and without it :func:`_decode_merge`
    does. With one share it stores the output itself.

    ``M``, ``F``: the mask (``record.py``). With its page size the keys lie in pages of that
    many tokens (a paged cache): ``K`` and ``V`` are the pools' rows along dim 2 (batch stride
    0), batch row ``b``'s pages are listed in its row of the page table and its ``seq_lens[b]``
    tokens end at key position ``seq_k`` (see ``_paged_rows``).
    """
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    pid_split = tl.program_id(0)
    num_splits = tl.num_programs(0)
    off_hk = tl.program_id(1) // row_tiles
    tile = tl.program_id(1) % row_tiles
    off_b = tl.program_id(2).to(tl.int64)

    start_r = tile * BLOCK_M
    offs_m, heads, in_rows = _packed_rows(start_r, off_hk, group_size, seq_q, BLOCK_M=BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    in_tile = in_rows[:, None] & (offs_e[None, :] < HEAD_DIM)

    q_ptrs = (
        Q
        + off_b * stride_qb
        + heads[:, None] * stride_qh
        + offs_m.to(tl.int64)[:, None] * stride_qm
        + offs_e[None, :] * stride_qk
    )
    q = tl.load(q_ptrs, mask=in_tile, other=0.0)  # [BLOCK_M, BLOCK_E]
    k_head = K + off_b * stride_kb + off_hk.to(tl.int64) * stride_kh
    v_head = V + off_b * stride_vb + off_hk.to(tl.int64) * stride_vh
    kv_table, kv_shift = _page_row(M, F, off_b, seq_k)
    # Over pages the block of keys divides (or that divide it), the key tiles lie on the
    # row's tokens, so each lies in one page (one page-table read a tile, pointers moved by
    # one number), or holds whole pages (one read a page, each key's slot in it fixed)
    PAGE: tl.constexpr = page_size(F)
    PAGE_TILES: tl.constexpr = PAGE > 0 and (PAGE % BLOCK_N == 0 or BLOCK_N % PAGE == 0)
    grid_off = kv_shift * 0
    if PAGE_TILES:
        grid_off = _page_grid(kv_shift, BLOCK_N)

    doc_off = off_b * mask_row_stride(M)
    first_q = start_r // group_size
    last_q = tl.minimum((start_r + BLOCK_M - 1) // group_size, seq_q - 1)
    kv_lo, kv_hi = _key_range(M, F, off_b, seq_k)
    block_first, full_first, full_end, block_end = _rows_key_blocks(
        first_q, last_q, seq_k, M, F, doc_off, kv_lo, kv_hi, BLOCK_N, grid_off
    )
    if MASK_FN is not None and HEADLESS_TILE_FN is not None:
        # the band's full run stays full where the masks' bounds over all of it (or all but
        # its last block, which a draft tree's root shares with the cache) keep every pair
        run_first = full_first * BLOCK_N - grid_off  # (the run's first and last keys)
        run_last = full_end * BLOCK_N - grid_off - 1
        _, drops_all = HEADLESS_TILE_FN(off_b, off_b * 0, first_q, last_q, run_first, run_last, MOD)
        _, drops_shorter = HEADLESS_TILE_FN(
            off_b, off_b * 0, first_q, last_q, run_first, run_last - BLOCK_N, MOD
        )
        full_end = tl.where(
            drops_all == 0, full_end, tl.where(drops_shorter == 0, full_end - 1, full_first)
        )
        full_end = tl.maximum(full_end, full_first)
    elif MASK_FN is not None:  # every block partial: the mask functions apply everywhere
        full_first = block_end
        full_end = block_end
    # this program's even share [share_first, share_end) of the visited blocks
    visited = block_end - block_first
    share_first = block_first + (visited * pid_split) // num_splits
    share_end = block_first + (visited * (pid_split + 1)) // num_splits
    # the share's part of the partial prefix, the full middle and the partial suffix
    prefix_end = tl.minimum(tl.maximum(full_first, share_first), share_end)
    middle_first = tl.maximum(full_first, share_first)
    middle_end = tl.maximum(tl.minimum(full_end, share_end), middle_first)
    suffix_first = tl.minimum(tl.maximum(full_end, share_first), share_end)

    row_lo, row_hi = _row_bounds(offs_m, seq_q, seq_k, M, F, doc_off, kv_lo, kv_hi)
    if has_alibi(F):
        # heads differ between rows: one slope per row, broadcast over the keys
        slopes = tl.load(
            mask_slopes(M) + off_b * mask_alibi_stride_b(M) + heads * mask_alibi_stride_h(M),
            mask=in_rows,
            other=0.0,
        )
        sign = LOG2E_K if alibi_sign_of(F) < 0 else -LOG2E_K
        alibi_coef = (slopes * sign)[:, None]  # [BLOCK_M, 1]
    else:
        alibi_coef = 0.0
    shift = seq_k - seq_q
    if MASK_FN is not None or SCORE_FN is not None:
        # heads differ between packed rows: the generated functions get a column of them
        MODC = _mod_context(off_b, heads[:, None], seq_q, seq_k, MOD)
    else:  # no tuple holding None: Triton refuses one
        MODC = 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_runs(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, share_first, prefix_end, middle_first, middle_end, suffix_first,
        share_end,
        seq_k, kv_lo, kv_hi, shift, alibi_coef, MODC, M, F,
        EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN, kv_table=kv_table,
        kv_shift=kv_shift, grid_off=grid_off, PAGE_TILES=PAGE_TILES,
    )  # fmt: skip
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_ptrs = _out_ptrs(
        Out, off_b, heads, offs_m, offs_e, stride_ob, stride_oh, stride_om, stride_ok
    )  # [BLOCK_M, BLOCK_E]
    if SPLIT:
        # The partial results, tile by tile: (splits, B * Hkv * row_tiles, BLOCK_M, BLOCK_E)
        # outputs, then (splits, B * Hkv * row_tiles, BLOCK_M) log-sum-exps.
        tile_index = off_b * tl.num_programs(1) + tl.program_id(1)
        tiles = tl.num_programs(2).to(tl.int64) * tl.num_programs(1)
        lse_base = Parts + num_splits * tiles * BLOCK_M * BLOCK_E
        lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        rows = (pid_split * tiles + tile_index) * BLOCK_M + tl.arange(0, BLOCK_M)
        tl.store(lse_base + rows, lse2, mask=in_rows)  # [BLOCK_M]
        tl.store(
            Parts + rows[:, None] * BLOCK_E + offs_e[None, :], acc, mask=in_rows[:, None]
        )  # [BLOCK_M, BLOCK_E]
        if MERGE_LAST:
            # Every thread's stores, then one release per program: the share that arrives
            # last sees all of them and merges.
            tl.debug_barrier()
            arrived = tl.atomic_add(Counters + tile_index, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tile_rows = tile_index * BLOCK_M + tl.arange(0, BLOCK_M)
                # its own share from registers, as the rows outside the tile load it
                own_lse = tl.where(in_rows, lse2, float("-inf"))
                own_part = tl.where(in_rows[:, None], acc, 0.0)
                out = _merge_shares(
                    Parts, lse_base, tile_rows, tiles * BLOCK_M, offs_e, in_rows, num_splits,
                    pid_split, own_lse, own_part, ROWS=BLOCK_M, BLOCK_E=BLOCK_E,
                )  # fmt: skip
                tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=in_tile)
                # back to zero for the next launch on this stream
                tl.store(Counters + tile_index, 0)
    else:
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=in_tile)  # [BLOCK_M, BLOCK_E]


@triton.jit
def _merge_shares(
    Parts,
    lse_base,
    part_rows,
    share_stride,
    offs_e,
    in_rows,
    num_splits,
    own_split,
    own_lse,
    own_part,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """The output of ``ROWS`` packed rows from the shares' partial outputs, weighted by their
    base-2 log-sum-exps; ``part_rows`` are the rows in the first share, each next share
    ``share_stride`` rows further. Read through L2 (``.cg``): other programs wrote them.
    Share ``own_split`` (-1: none) is the caller's own, ``own_lse`` ``[ROWS]`` and
    ``own_part`` ``[ROWS, BLOCK_E]``, taken from registers instead of memory; the shares are
    merged in the same order either way, so the result does not depend on who merges.

    One pass, the running largest log-sum-exp rescaling what came before: each share's two
    loads depend on nothing loaded before them."""
    lse_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    weights = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    for s in range(0, num_splits):
        rows = s * share_stride + part_rows
        load_rows = in_rows & (tl.zeros([ROWS], dtype=tl.int32) + s != own_split)
        lse = tl.load(
            lse_base + rows, mask=load_rows, other=float("-inf"), cache_modifier=".cg"
        )  # [ROWS]
        part_ptrs = Parts + rows[:, None] * BLOCK_E + offs_e[None, :]
        part = tl.load(
            part_ptrs, mask=load_rows[:, None], other=0.0, cache_modifier=".cg"
        )  # [ROWS, BLOCK_E]
        lse = tl.where(s == own_split, own_lse, lse)
        part = tl.where(s == own_split, own_part, part)
        new_max = tl.maximum(lse_max, lse)
        # rows with no kept key so far: subtract 0 so every weight is exp2(-inf) = 0
        base = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.math.exp2(lse_max - base)
        weight = tl.math.exp2(lse - base)
        # a share that kept nothing adds exactly nothing; a NaN log-sum-exp (a kept NaN
        # score) propagates
        acc = acc * rescale[:, None] + tl.where(
            (lse == float("-inf"))[:, None], 0.0, weight[:, None] * part
        )
        weights = weights * rescale + weight
        lse_max = new_max
    return acc / tl.where(weights == 0.0, 1.0, weights)[:, None]


@triton.jit
def _packed_rows(start_r, off_hk, group_size, seq_q, BLOCK_M: tl.constexpr):
    """The query positions, query heads and validity of the packed rows ``start_r ..
    start_r + BLOCK_M`` of key/value head ``off_hk``, query-major: row ``r`` is query
    ``r // G`` of query head ``off_hk * G + r % G``."""
    offs_r = start_r + tl.arange(0, BLOCK_M)
    offs_m = offs_r // group_size  # [BLOCK_M]
    heads = (off_hk * group_size + offs_r % group_size).to(tl.int64)  # [BLOCK_M]
    return offs_m, heads, offs_r < group_size * seq_q


@triton.jit
def _out_ptrs(Out, off_b, heads, offs_m, offs_e, stride_ob, stride_oh, stride_om, stride_ok):
    """The output's ``[rows, BLOCK_E]`` pointers of packed rows (query ``offs_m`` of head
    ``heads``)."""
    return (
        Out
        + off_b * stride_ob
        + heads[:, None] * stride_oh
        + offs_m.to(tl.int64)[:, None] * stride_om
        + offs_e[None, :] * stride_ok
    )


@triton.jit
def _decode_merge(
    Parts,
    Out,
    stride_ob, stride_oh, stride_om, stride_ok,
    group_size,
    row_tiles,
    seq_q,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """The output of ``ROWS`` packed rows from the shares ``_decode_fwd`` left in ``Parts``
    without ``MERGE_LAST`` (grid: Hkv * tiles * BLOCK_M // ROWS, B): a second kernel, for
    launches that cannot keep counters (captured in a CUDA graph, which may be replayed on
    any stream, or traced)."""
    tl.static_assert(BLOCK_M % ROWS == 0)
    CHUNKS: tl.constexpr = BLOCK_M // ROWS
    off_b = tl.program_id(1).to(tl.int64)
    tile_of_b = tl.program_id(0) // CHUNKS  # off_hk * row_tiles + tile
    start_r = (tile_of_b % row_tiles) * BLOCK_M + (tl.program_id(0) % CHUNKS) * ROWS
    offs_m, heads, in_rows = _packed_rows(
        start_r, tile_of_b // row_tiles, group_size, seq_q, BLOCK_M=ROWS
    )
    offs_e = tl.arange(0, BLOCK_E)
    tiles_of_b = tl.num_programs(0) // CHUNKS
    tiles = tl.num_programs(1).to(tl.int64) * tiles_of_b
    lse_base = Parts + num_splits * tiles * BLOCK_M * BLOCK_E
    part_rows = (
        (off_b * tiles_of_b + tile_of_b) * BLOCK_M + (tl.program_id(0) % CHUNKS) * ROWS
        + tl.arange(0, ROWS)
    )  # fmt: skip
    # no share of its own (split -1): every share comes from memory
    no_lse = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    no_part = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    out = _merge_shares(
        Parts, lse_base, part_rows, tiles * BLOCK_M, offs_e, in_rows, num_splits,
        -1, no_lse, no_part, ROWS=ROWS, BLOCK_E=BLOCK_E,
    )  # fmt: skip
    o_ptrs = _out_ptrs(
        Out, off_b, heads, offs_m, offs_e, stride_ob, stride_oh, stride_om, stride_ok
    )  # [ROWS, BLOCK_E]
    in_tile = in_rows[:, None] & (offs_e[None, :] < HEAD_DIM)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=in_tile)

"""The forward kernel: one program per (query block, query head, batch) streams the key blocks
its rows keep (see ``kernels/common.py`` for the mask model), with an online softmax."""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor

from .common import (
    LN2_K,
    _alibi_coef,
    _dot,
    _key_block_range,
    _key_range,
    _list_row,
    _listed_tile,
    _listed_tiles,
    _load_key_tile,
    _load_tile,
    _log2_scores,
    _mod_context,
    _mod_score,
    _page_row,
    _page_tile_pages,
    _page_tile_row,
    _paged_rows,
    _partial_keep,
    _row_bounds,
    _tile_ptrs,
)
from .configs import FORWARD_CONFIGS, dot_precision, padded_head_dim, pick_config
from .launch import PreparedLaunch, empty_contiguous, empty_rows
from .masks import late_rows_first, launch_mask
from .program import MaskProgram
from .record import (
    MaskRecord,
    Pages,
    has_alibi,
    has_block_lists,
    has_docs,
    has_hi,
    has_kv_range,
    has_lo,
    has_softcap,
    mask_kv_lists,
    mask_qk_scale,
    mask_query_starts,
    mask_row_stride,
    page_size,
    page_tensors,
    positive_scale,
    ragged_queries,
    sparse_m,
    sparse_n,
)

__all__ = [
    "ForwardPlan", "attention_forward", "check_identity", "identity_of", "plan_forward",
    "reads_pages", "stand_in",
]  # fmt: skip


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk, offs_m,
    row_lo, row_hi, block_first, block_end, seq_k, kv_lo, kv_hi, shift, alibi_coef, MODC, M,
    F: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK_FN: tl.constexpr,
    SCORE_FN: tl.constexpr,
    entries=0,
    LISTED_TILES: tl.constexpr = 0,
    BOUNDED: tl.constexpr = True,
    TILED_SCORES: tl.constexpr = False,
    kv_table=0,
    kv_shift=0,
    grid_off=0,
    PAGE_TILES: tl.constexpr = False,
):  # fmt: skip
    """Key tiles ``[block_first, block_end)``: contiguous tiles, or with ``LISTED_TILES`` the
    tiles of the list blocks at ``entries + 1`` (``LISTED_TILES`` tiles to a block), counted
    in list order, so that one loop (one software pipeline) runs over every listed block.
    ``BOUNDED``: whether ``row_lo``, ``row_hi`` hold mask terms (see ``_partial_keep``).
    ``TILED_SCORES``: ``MODC`` holds one batch row and head (see ``_mod_score``).
    ``M``, ``F``: the mask (``record.py``). With its page size, the keys lie in pages (a
    paged cache): key position ``n`` is the row's token ``n + kv_shift``, read where
    ``kv_table`` (its page table) puts it among the rows of ``k_head`` / ``v_head``
    (:func:`_paged_rows`). ``grid_off``: tile ``t`` holds key positions ``[t * BLOCK_N -
    grid_off, (t + 1) * BLOCK_N - grid_off)`` (0: the positions' own grid). ``PAGE_TILES``:
    the caller put the tiles on pages (``grid_off`` aligns them to the row's tokens, see
    :func:`_page_grid`): where ``BLOCK_N`` divides the page size, a tile's rows are one page's
    consecutive slots, found with one page-table read a tile; where the page size divides
    ``BLOCK_N``, a tile holds whole pages and each key's slot in its page is fixed."""
    HAS_SOFTCAP: tl.constexpr = has_softcap(F)
    HAS_ALIBI: tl.constexpr = has_alibi(F)
    PAGE: tl.constexpr = page_size(F)
    qk_scale = mask_qk_scale(M)
    # Raw dot products can be masked and maximised before scaling only when the scale is a
    # positive normal float: scaling then keeps the order and -inf; otherwise scale first.
    PLAIN: tl.constexpr = not (HAS_SOFTCAP or HAS_ALIBI or SCORE_FN is not None) and positive_scale(
        F
    )
    # tiles past the sequence's end exist only when its length is no multiple of BLOCK_N
    BOUNDS: tl.constexpr = MASKED and not EVEN
    # Full tiles lie inside the key range; partial ones may cross its ends: keys and values
    # outside it are not read there (zeros), so that nothing in them reaches the results.
    IN_RANGE: tl.constexpr = MASKED and has_kv_range(F)
    offs_n = block_first * BLOCK_N - grid_off + tl.arange(0, BLOCK_N)
    start = (block_first * BLOCK_N - grid_off).to(tl.int64)
    k_ptrs = _tile_ptrs(k_head, start, stride_kn, stride_kk, BLOCK_N, BLOCK_E)
    v_ptrs = _tile_ptrs(v_head, start, stride_vn, stride_vk, BLOCK_N, BLOCK_E)
    if PAGE > 0:
        tl.static_assert(LISTED_TILES == 0, "paged keys are read over contiguous tiles")
        # each tile's rows are worked out one tile ahead, so that its key and value loads do
        # not wait for its page numbers
        if PAGE_TILES:
            tl.static_assert(PAGE % BLOCK_N == 0 or BLOCK_N % PAGE == 0, "tiles on pages")
            tile_token = block_first * BLOCK_N - grid_off + kv_shift  # a multiple of BLOCK_N
            if PAGE % BLOCK_N == 0:  # a tile inside one page
                k_tile = _tile_ptrs(k_head, start * 0, stride_kn, stride_kk, BLOCK_N, BLOCK_E)
                v_tile = _tile_ptrs(v_head, start * 0, stride_vn, stride_vk, BLOCK_N, BLOCK_E)
                next_row = _page_tile_row(kv_table, tile_token, M, F, BLOCK_N)
            else:  # whole pages a tile: each key's slot in its page is fixed
                slots = (tl.arange(0, BLOCK_N) % PAGE)[:, None]
                offs_e = tl.arange(0, BLOCK_E)[None, :]
                k_tile = k_head + slots * stride_kn + offs_e * stride_kk
                v_tile = v_head + slots * stride_vn + offs_e * stride_vk
                next_pages = _page_tile_pages(kv_table, tile_token, M, F, BLOCK_N)
        else:
            next_rows = _paged_rows(kv_table, offs_n + kv_shift, M, F)
    for t in range(block_first, block_end):
        if LISTED_TILES > 0:
            tile = _listed_tile(entries, t, LISTED_TILES)
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            k_ptrs = _tile_ptrs(k_head, tile * BLOCK_N, stride_kn, stride_kk, BLOCK_N, BLOCK_E)
            v_ptrs = _tile_ptrs(v_head, tile * BLOCK_N, stride_vn, stride_vk, BLOCK_N, BLOCK_E)
        if PAGE > 0 and PAGE_TILES:
            if PAGE % BLOCK_N == 0:
                # the tile's first pool row: every pointer moves by one number, as over a cache
                row = next_row
                k_ptrs = k_tile + row * stride_kn
                v_ptrs = v_tile + row * stride_vn
                next_row = _page_tile_row(kv_table, tile_token + BLOCK_N, M, F, BLOCK_N)
            else:
                # each key's row moves by its page's: one table read a page
                pages = next_pages[:, None]
                k_ptrs = k_tile + pages * stride_kn
                v_ptrs = v_tile + pages * stride_vn
                next_pages = _page_tile_pages(kv_table, tile_token + BLOCK_N, M, F, BLOCK_N)
            tile_token += BLOCK_N
        elif PAGE > 0:
            # positions past the end read the row's last token (masked, or never kept)
            rows = next_rows
            offs_e = tl.arange(0, BLOCK_E)[None, :]
            k_ptrs = k_head + rows[:, None] * stride_kn + offs_e * stride_kk
            v_ptrs = v_head + rows[:, None] * stride_vn + offs_e * stride_vk
            ahead = offs_n + BLOCK_N + kv_shift
            next_rows = _paged_rows(kv_table, ahead, M, F)
        k = _load_key_tile(  # [BLOCK_N, BLOCK_E]
            k_ptrs, offs_n, seq_k, kv_lo, kv_hi,
            BOUNDS=BOUNDS, IN_RANGE=IN_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
        )  # fmt: skip
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if not PLAIN:
            if HAS_ALIBI:
                # built from fp32 vectors: one add per score, no integer-to-float conversion
                rel = (offs_m + shift).to(tl.float32)[:, None] - offs_n.to(tl.float32)[None, :]
            else:
                rel = 0.0
            qk, _t = _log2_scores(qk, rel, 0.0, alibi_coef, M, F, HAS_OFFSET=False)
            if SCORE_FN is not None:
                qk = _mod_score(qk, offs_m, offs_n, MODC, SCORE_FN, TILED=TILED_SCORES)
        if MASKED:
            # masked pairs select -inf whatever their score (a NaN key there stays out)
            keep = _partial_keep(
                offs_m, offs_n, row_lo, row_hi, seq_k, MODC,
                MASK_FN=MASK_FN, BOUNDED=BOUNDED, BOUNDS=BOUNDS,
            )  # fmt: skip
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
        v = _load_key_tile(  # [BLOCK_N, BLOCK_E]
            v_ptrs, offs_n, seq_k, kv_lo, kv_hi,
            BOUNDS=BOUNDS, IN_RANGE=IN_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
        )  # fmt: skip
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION)  # [BLOCK_M, BLOCK_E]
        m_i = m_new
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_runs(
    acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
    offs_m, row_lo, row_hi, prefix_first, prefix_end, middle_first, middle_end, suffix_first,
    suffix_end, seq_k, kv_lo, kv_hi, shift, alibi_coef, MODC, M, F: tl.constexpr,
    EVEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, MASK_FN: tl.constexpr, SCORE_FN: tl.constexpr,
    TILED_SCORES: tl.constexpr = False, kv_table=0, kv_shift=0, grid_off=0,
    PAGE_TILES: tl.constexpr = False,
):  # fmt: skip
    """The key blocks of a tile in three runs: a partial prefix, a full middle (no element
    mask) and a partial suffix, each ``[first, end)`` in blocks (the page arguments and the
    grid: as :func:`_attn_fwd_inner` takes them)."""
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, prefix_first, prefix_end, seq_k, kv_lo, kv_hi, shift,
        alibi_coef, MODC, M, F,
        MASKED=True, EVEN=EVEN, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN,
        TILED_SCORES=TILED_SCORES, kv_table=kv_table, kv_shift=kv_shift, grid_off=grid_off,
        PAGE_TILES=PAGE_TILES,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, middle_first, middle_end, seq_k, kv_lo, kv_hi, shift,
        alibi_coef, MODC, M, F,
        MASKED=False, EVEN=EVEN, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN,
        TILED_SCORES=TILED_SCORES, kv_table=kv_table, kv_shift=kv_shift, grid_off=grid_off,
        PAGE_TILES=PAGE_TILES,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, suffix_first, suffix_end, seq_k, kv_lo, kv_hi, shift,
        alibi_coef, MODC, M, F,
        MASKED=True, EVEN=EVEN, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN,
        TILED_SCORES=TILED_SCORES, kv_table=kv_table, kv_shift=kv_shift, grid_off=grid_off,
        PAGE_TILES=PAGE_TILES,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_listed(
    acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
    offs_m, row_lo, row_hi, entries, seq_k, kv_lo, kv_hi, shift, alibi_coef, MODC, M,
    F: tl.constexpr, MASKED: tl.constexpr, EVEN: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_FN: tl.constexpr, SCORE_FN: tl.constexpr, BOUNDED: tl.constexpr,
    TILED_SCORES: tl.constexpr = False,
):  # fmt: skip
    """The key blocks of one list (``entries``: a count, then list blocks of the mask's
    ``sparse_n`` keys), each as its tiles of ``BLOCK_N`` keys, all partial (``MASKED``) or
    all full, in one loop over the tiles of every block."""
    TILES: tl.constexpr = sparse_n(F) // BLOCK_N
    tiles = _listed_tiles(entries, seq_k, BLOCK_N, TILES)
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, tl.zeros([], dtype=tl.int32), tiles, seq_k, kv_lo, kv_hi, shift,
        alibi_coef, MODC, M, F,
        MASKED=MASKED, EVEN=EVEN, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN,
        entries=entries, LISTED_TILES=TILES, BOUNDED=BOUNDED, TILED_SCORES=TILED_SCORES,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    Lse,
    M,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    num_heads,
    group_size,
    seq_q,
    seq_k,
    MOD,
    F: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REVERSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    MASK_FN: tl.constexpr = None,
    SCORE_FN: tl.constexpr = None,
):  # fmt: skip
    """One tile of query rows of one head and batch row (grid: query tiles, Hq, B); ``M``,
    ``F``: the mask (``record.py``). With a page size the keys lie in pages of that many
    tokens (a paged cache): ``K`` and ``V`` are the pools' rows along dim 2 (batch stride 0),
    batch row ``b``'s pages are listed in its row of the page table and its ``seq_lens[b]``
    tokens end at key position ``seq_k``; not with block lists."""
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    HAS_BLOCK_LISTS: tl.constexpr = has_block_lists(F)
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
    kv_table, kv_shift = _page_row(M, F, off_b, seq_k)
    tl.static_assert(
        page_size(F) == 0 or not HAS_BLOCK_LISTS, "paged keys are read over contiguous tiles"
    )

    doc_off = off_b * mask_row_stride(M)
    kv_lo, kv_hi = _key_range(M, F, off_b, seq_k)
    if not HAS_BLOCK_LISTS:
        # before the row bounds: in another order the band path compiles to other code
        block_first, full_first, full_end, block_end = _key_block_range(
            start_m, seq_q, seq_k, M, F, doc_off, kv_lo, kv_hi, BLOCK_M, BLOCK_N
        )
        if ragged_queries(F):
            # a ragged row's queries end its placed positions: a tile holding none of them
            # (before its first one, or every tile where the start is the placed length) is
            # padding (its output is not read), and visits no key
            idle = tl.minimum(start_m + BLOCK_M, seq_q) <= tl.load(mask_query_starts(M) + off_b)
            full_first = tl.where(idle, block_first, full_first)
            full_end = tl.where(idle, block_first, full_end)
            block_end = tl.where(idle, block_first, block_end)
    row_lo, row_hi = _row_bounds(offs_m, seq_q, seq_k, M, F, doc_off, kv_lo, kv_hi)
    alibi_coef = _alibi_coef(M, F, off_b, off_h)
    shift = seq_k - seq_q
    if MASK_FN is not None or SCORE_FN is not None:
        MODC = _mod_context(off_b, off_h, seq_q, seq_k, MOD)
    else:  # no tuple holding None: Triton refuses one
        MODC = 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    if HAS_BLOCK_LISTS:
        # the listed key blocks of this tile's list row, partial then full
        SPARSE_M: tl.constexpr = sparse_m(F)
        tl.static_assert(SPARSE_M % BLOCK_M == 0 and sparse_n(F) % BLOCK_N == 0)
        BOUNDED: tl.constexpr = has_lo(F) or has_hi(F) or has_docs(F) or has_kv_range(F)
        width = tl.cdiv(seq_k, sparse_n(F)) + 1
        entries = _list_row(
            mask_kv_lists(M), F, off_b, off_h, num_heads, start_m // SPARSE_M,
            tl.cdiv(seq_q, SPARSE_M), width,
        )  # fmt: skip
        acc, l_i, m_i = _attn_fwd_listed(
            acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, entries, seq_k, kv_lo, kv_hi, shift, alibi_coef, MODC, M,
            F, MASKED=True, EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN, BOUNDED=BOUNDED,
            TILED_SCORES=True,
        )  # fmt: skip
        acc, l_i, m_i = _attn_fwd_listed(
            acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, entries + width, seq_k, kv_lo, kv_hi, shift, alibi_coef,
            MODC, M, F, MASKED=False, EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
            BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN,
            BOUNDED=BOUNDED, TILED_SCORES=True,
        )  # fmt: skip
    else:
        acc, l_i, m_i = _attn_fwd_runs(
            acc, l_i, m_i, q, k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, block_first, full_first, full_first, full_end, full_end,
            block_end, seq_k, kv_lo, kv_hi, shift, alibi_coef, MODC, M, F,
            EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN, SCORE_FN=SCORE_FN,
            TILED_SCORES=True, kv_table=kv_table, kv_shift=kv_shift,
        )  # fmt: skip
    empty = l_i == 0.0
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2_K)
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


def reads_pages(program: MaskProgram) -> bool:
    """Whether the forward kernel can read a call of ``program`` from pages: not with block
    lists or mask functions (it settles their tiles by block lists over contiguous keys)."""
    mods = program.mods
    return program.blocks is None and not (mods is not None and mods.has_mask)


def stand_in(pool: Tensor, batch: int, keys: int) -> Tensor:
    """A ``(B, Hkv, keys, E)`` stand-in of a pool's first row (a view), for what reads only
    shapes, dtypes and devices."""
    return pool[:, :, :1].expand(batch, pool.shape[1], keys, pool.shape[3])


def identity_of(q: Tensor, k: Tensor, v: Tensor) -> tuple[object, ...]:
    """What a plan is made for: shapes, dtypes and devices of the call's tensors."""
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device)


def check_identity(kind: str, planned: tuple[object, ...], q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise unless ``q``, ``k``, ``v`` have the shapes, dtypes and devices of the plan."""
    got = identity_of(q, k, v)
    if got != planned:
        raise ValueError(
            f"this {kind} plan was made for q, k, v of shapes, dtypes and devices {planned}, "
            f"got {got}; make a new plan for these tensors"
        )


@dataclass(frozen=True, eq=False)
class ForwardPlan:
    """The forward of one call identity, worked out once: :meth:`launch` only allocates the
    outputs and launches the kernel with the call's tensors.

    Made by :func:`plan_forward` for the shapes, dtypes and devices of ``q``, ``k``, ``v``
    (checked on each launch) and the mask arguments, whose tensors (document ranges, slopes,
    key ranges) it holds: their contents are read by the kernel at each launch, so they must
    not be written in place while the plan is used. Strides and the data pointers' alignment
    may change from call to call (each combination gets its compiled kernel).
    """

    identity: tuple[object, ...]
    mask: MaskRecord | None  # the kernel's mask record (its tensors are read at each launch)
    scalars: tuple[int | float, ...]  # the runtime scalars after the strides
    kernel: PreparedLaunch | None  # None: an empty output, nothing to launch

    def launch(
        self, q: Tensor, k: Tensor, v: Tensor, *, checked: bool = True,
        pages: Pages | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``(out, lse)`` as :func:`attention_forward` returns them. No host synchronisation.

        ``checked=False`` skips checking that the tensors are of the plan's identity, for a
        caller that has (the plan cache keys on it). ``pages``: for a plan made with them
        (:func:`plan_forward`), where this call's keys lie in ``k`` and ``v`` (the identity
        check does not see them)."""
        if checked:
            check_identity("forward", self.identity, q, k, v)
        out = empty_contiguous(q)  # (B, Hq, L, E)
        lse = empty_rows(q)  # (B, Hq, L)
        if self.kernel is None or self.mask is None:
            return out, lse
        q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
        # What the compiled kernel is specialised on beyond the plan: the strides (out and lse
        # are fresh and contiguous: theirs are fixed by the shapes), and each tensor's 16-byte
        # alignment, spelled out only when some tensor lacks it.
        call_key: tuple[object, ...] | None = None
        if self.kernel.direct():
            call_key = (q_stride, k_stride, v_stride)
            if (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | lse.data_ptr()) % 16:
                call_key = (
                    q_stride,
                    k_stride,
                    v_stride,
                    *(t.data_ptr() % 16 == 0 for t in (q, k, v, out, lse)),
                )
        self.kernel(
            call_key, q, k, v, out, lse, *self.mask.values(*page_tensors(pages)), *q_stride,
            *k_stride, *v_stride, *out.stride(), *self.scalars,
        )  # fmt: skip
        return out, lse


def plan_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    pages: Pages | None = None,
) -> ForwardPlan:
    """The :class:`ForwardPlan` of :func:`attention_forward` with these arguments; ``q``,
    ``k``, ``v`` (and ``pages``) give only their shapes, dtypes and devices (the plan keeps
    none of them)."""
    batch, num_heads, seq_q, head_dim = q.shape
    if pages is not None:
        if not reads_pages(program):
            raise ValueError(
                "paged keys are read over contiguous key tiles; a mask program with block "
                "lists or mask functions (settled by block lists) needs contiguous keys"
            )
        # the call's keys as the mask and the tiles see them: (B, Hkv, S, E)
        k, v = (stand_in(t, batch, pages.keys) for t in (k, v))
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    identity = identity_of(q, k, v)
    if batch * num_heads * seq_q == 0:
        return ForwardPlan(identity, None, (), None)
    mask = launch_mask(q, k, program, scale=scale, rows=True, cols=False, pages=pages)
    block_e = padded_head_dim(head_dim)
    cfg = pick_config(FORWARD_CONFIGS, q, block_e, mask.listed_mask_forward_configs())
    block_m, block_n = mask.tiles(cfg.block_m, cfg.block_n)
    grid = (triton.cdiv(seq_q, block_m), num_heads, batch)
    options = dict(
        HEAD_DIM=head_dim,
        BLOCK_E=block_e,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        REVERSE=late_rows_first(seq_q, seq_k, mask),
        DOT_PRECISION=dot_precision(q),
        EVEN_N=seq_k % block_n == 0,
        **mask.options(backward=False),
        num_warps=cfg.num_warps,
        num_stages=mask.stages(cfg.num_stages),
    )
    return ForwardPlan(
        identity,
        mask.record,
        (num_heads, num_heads // num_kv_heads, seq_q, seq_k, *mask.mod_args()),
        PreparedLaunch(mask.kernel(_attn_fwd), grid, options),
    )


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    pages: Pages | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention forward: :func:`plan_forward`, then its launch.

    Args:
        q: ``(B, Hq, L, E)``; k, v: ``(B, Hkv, S, E)``, same dtype (fp16, bf16 or fp32) and
            device, any strides.
        program: the mask and score terms (:class:`~.program.MaskProgram`); keys and values
            outside a batch row's key range are never read.
        scale: multiplies ``q @ k^T``.
        pages: for keys in a paged pool (:class:`Pages`): ``k`` and ``v`` are then the pools'
            rows ``(1 | B, Hkv, R, E)``. Not with block lists or mask functions.

    Returns:
        ``out`` ``(B, Hq, L, E)`` in ``q.dtype`` (contiguous) and ``lse`` ``(B, Hq, L)`` fp32,
        natural log; a row that keeps no key has ``out = 0`` and ``lse = -inf``.

    Inputs are assumed valid (the caller validates them).
    """
    if pages is None:
        return plan_forward(q, k, v, program, scale=scale).launch(q, k, v)
    plan = plan_forward(q, k, v, program, scale=scale, pages=pages)
    k, v = (t.expand(q.shape[0], *t.shape[1:]) for t in (k, v))
    return plan.launch(q, k, v, checked=False, pages=pages)

"""The dK/dV backward kernel: one program per key block and key/value head, summing over its
group of query heads (and the ALiBi slopes' gradient), over listed or ranged query blocks."""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E_K,
    _alibi_coef,
    _col_bounds,
    _dot,
    _key_range,
    _list_row,
    _listed_tile,
    _listed_tiles,
    _load_key_tile,
    _load_tile,
    _log2_scores,
    _mod_context,
    _mod_score_grad,
    _partial_keep,
    _query_block_range,
    _tile_ptrs,
)
from .record import (
    has_alibi,
    has_block_lists,
    has_docs,
    has_hi,
    has_kv_range,
    has_lo,
    has_softcap,
    mask_col_stride,
    mask_q_lists,
    mask_qk_scale,
    sparse_m,
    sparse_n,
)

__all__: list[str] = []


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
    alibi_coef,
    MODC,
    M,
    F: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASK_FN: tl.constexpr,
    SCORE_GRAD_FN: tl.constexpr,
    entries=0,
    LISTED_TILES: tl.constexpr = 0,
    BOUNDED: tl.constexpr = True,
):
    """Accumulate one query head's contribution to ``dK`` (unscaled) and ``dV`` of a key tile
    over query tiles ``[block_first, block_end)`` (with ``LISTED_TILES``: of the list at
    ``entries``, as ``_attn_fwd_inner`` counts them).

    Works on transposed tiles ``[BLOCK_N, BLOCK_M]`` so that ``dK``/``dV`` rows stay in place.
    ``M``, ``F``: the mask (``record.py``).
    """
    HAS_SOFTCAP: tl.constexpr = has_softcap(F)
    HAS_ALIBI: tl.constexpr = has_alibi(F)
    qk_scale = mask_qk_scale(M)
    BOUNDS: tl.constexpr = MASKED and not EVEN  # see _attn_fwd_inner
    offs_m = block_first * BLOCK_M + tl.arange(0, BLOCK_M)
    start = (block_first * BLOCK_M).to(tl.int64)
    q_ptrs = _tile_ptrs(q_head, start, stride_qm, stride_qk, BLOCK_M, BLOCK_E)
    do_ptrs = _tile_ptrs(do_head, start, stride_dom, stride_dok, BLOCK_M, BLOCK_E)
    for t in range(block_first, block_end):
        if LISTED_TILES > 0:
            tile = _listed_tile(entries, t, LISTED_TILES)
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            q_ptrs = _tile_ptrs(q_head, tile * BLOCK_M, stride_qm, stride_qk, BLOCK_M, BLOCK_E)
            do_ptrs = _tile_ptrs(do_head, tile * BLOCK_M, stride_dom, stride_dok, BLOCK_M, BLOCK_E)
        q = _load_tile(q_ptrs, offs_m, seq_q, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
        if BOUNDS:
            in_rows = offs_m < seq_q
            lse = tl.load(lse_head + offs_m, mask=in_rows, other=float("inf"))  # [BLOCK_M]
            delta = tl.load(delta_head + offs_m, mask=in_rows, other=0.0)  # [BLOCK_M]
        else:
            lse = tl.load(lse_head + offs_m)  # [BLOCK_M]
            delta = tl.load(delta_head + offs_m)  # [BLOCK_M]
        # A row that kept nothing has lse = -inf: read it as +inf so its probabilities are 0.
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_K)
        qkT = _dot(k, tl.trans(q), None, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        if SCORE_GRAD_FN is not None:
            relT = (offs_m + shift).to(tl.float32)[None, :] - offs_n.to(tl.float32)[:, None]
            sT, tT = _log2_scores(qkT, relT, 0.0, alibi_coef, M, F, False)
            sT, dmodT = _mod_score_grad(sT, offs_m, offs_n, MODC, SCORE_GRAD_FN, TRANSPOSED=True)
            pT = tl.math.exp2(sT - lse2[None, :])
        elif HAS_SOFTCAP or HAS_ALIBI:
            relT = (offs_m + shift).to(tl.float32)[None, :] - offs_n.to(tl.float32)[:, None]
            sT, tT = _log2_scores(qkT, relT, lse2[None, :], alibi_coef, M, F, True)
            pT = tl.math.exp2(sT)
        else:
            tT = qkT
            pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        do = _load_tile(do_ptrs, offs_m, seq_q, BOUNDS, HEAD_DIM, BLOCK_E)  # [BLOCK_M, BLOCK_E]
        if MASKED:
            # masked pairs select 0 whatever their score
            keep = _partial_keep(
                offs_m, offs_n, col_lo, col_hi, seq_q, MODC,
                MASK_FN=MASK_FN, BOUNDED=BOUNDED, BOUNDS=BOUNDS, TRANSPOSED=True,
            )  # fmt: skip
            pT = tl.where(keep, pT, 0.0)
        dv = _dot(pT.to(do.dtype), do, dv, DOT_PRECISION)  # [BLOCK_N, BLOCK_E]
        dpT = _dot(v, tl.trans(do), None, DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        if SCORE_GRAD_FN is not None:
            dsT = dsT * dmodT
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
def _attn_bwd_dkdv_listed(
    dk, dv, k, v, q_head, do_head, lse_head, delta_head, stride_qm, stride_qk, stride_dom,
    stride_dok, offs_n, col_lo, col_hi, entries, seq_q, shift, alibi_coef, MODC, M,
    F: tl.constexpr, MASKED: tl.constexpr, EVEN: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
    MASK_FN: tl.constexpr, SCORE_GRAD_FN: tl.constexpr, BOUNDED: tl.constexpr,
):  # fmt: skip
    """The query blocks of one list (``entries``: a count, then list blocks of the mask's
    ``sparse_m`` queries), each as its tiles of ``BLOCK_M`` queries, all partial (``MASKED``)
    or all full."""
    TILES: tl.constexpr = sparse_m(F) // BLOCK_M
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, q_head, do_head, lse_head, delta_head,
        stride_qm, stride_qk, stride_dom, stride_dok,
        offs_n, col_lo, col_hi, tl.zeros([], dtype=tl.int32),
        _listed_tiles(entries, seq_q, BLOCK_M, TILES), seq_q, shift,
        alibi_coef, MODC, M, F,
        MASKED=MASKED, EVEN=EVEN, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
        BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN,
        SCORE_GRAD_FN=SCORE_GRAD_FN, entries=entries, LISTED_TILES=TILES, BOUNDED=BOUNDED,
    )  # fmt: skip
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
    M,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_dob, stride_doh, stride_dom, stride_dok,
    stride_dkb, stride_dkh, stride_dkn, stride_dkk,
    stride_dvb, stride_dvh, stride_dvn, stride_dvk,
    num_heads,
    group_size,
    seq_q,
    seq_k,
    sm_scale,
    MOD,
    F: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    REVERSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_M: tl.constexpr,
    MASK_FN: tl.constexpr = None,
    SCORE_GRAD_FN: tl.constexpr = None,
):  # fmt: skip
    """``dK``, ``dV`` of one key tile of one key/value head, summed over its query heads.

    Keys outside the batch row's key range are not read and get zero gradients. ``M``,
    ``F``: the mask (``record.py``)."""
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    # torch.compile passes Python floats as fp64; keep the softmax arithmetic in fp32
    sm_scale = tl.cast(sm_scale, tl.float32)
    HAS_KV_RANGE: tl.constexpr = has_kv_range(F)
    HAS_BLOCK_LISTS: tl.constexpr = has_block_lists(F)
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
    kv_lo, kv_hi = _key_range(M, F, off_b, seq_k)
    k = _load_key_tile(  # [BLOCK_N, BLOCK_E]
        k_ptrs, offs_n, seq_k, kv_lo, kv_hi,
        BOUNDS=True, IN_RANGE=HAS_KV_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
    )  # fmt: skip
    v = _load_key_tile(  # [BLOCK_N, BLOCK_E]
        v_ptrs, offs_n, seq_k, kv_lo, kv_hi,
        BOUNDS=True, IN_RANGE=HAS_KV_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
    )  # fmt: skip

    doc_off = off_b * mask_col_stride(M)
    if HAS_BLOCK_LISTS:
        SPARSE_N: tl.constexpr = sparse_n(F)
        tl.static_assert(sparse_m(F) % BLOCK_M == 0 and SPARSE_N % BLOCK_N == 0)
        BOUNDED: tl.constexpr = has_lo(F) or has_hi(F) or has_docs(F) or HAS_KV_RANGE
        # the query blocks listed for this tile's list column, per query head below
        list_width = tl.cdiv(seq_q, sparse_m(F)) + 1
        list_col = start_n // SPARSE_N
        list_cols = tl.cdiv(seq_k, SPARSE_N)
    else:
        block_first, full_first, full_end, block_end = _query_block_range(
            start_n, seq_q, seq_k, M, F, doc_off, kv_lo, kv_hi, BLOCK_M, BLOCK_N
        )
    col_lo, col_hi = _col_bounds(offs_n, seq_q, seq_k, M, F, doc_off, kv_lo, kv_hi)
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
        alibi_coef = _alibi_coef(M, F, off_b, off_h)
        if MASK_FN is not None or SCORE_GRAD_FN is not None:
            MODC = _mod_context(off_b, off_h, seq_q, seq_k, MOD)
        else:  # no tuple holding None: Triton refuses one
            MODC = 0
        if HAS_BLOCK_LISTS:
            entries = _list_row(
                mask_q_lists(M), F, off_b, off_h, num_heads, list_col, list_cols, list_width
            )
            dk, dv = _attn_bwd_dkdv_listed(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, entries, seq_q, shift,
                alibi_coef, MODC, M, F,
                MASKED=True, EVEN=EVEN_M, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION,
                MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, BOUNDED=BOUNDED,
            )  # fmt: skip
            dk, dv = _attn_bwd_dkdv_listed(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, entries + list_width, seq_q, shift,
                alibi_coef, MODC, M, F,
                MASKED=False, EVEN=EVEN_M, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION,
                MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, BOUNDED=BOUNDED,
            )  # fmt: skip
        else:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, block_first, full_first, seq_q, shift,
                alibi_coef, MODC, M, F,
                MASKED=True, EVEN=EVEN_M, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN,
                SCORE_GRAD_FN=SCORE_GRAD_FN,
            )  # fmt: skip
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, full_first, full_end, seq_q, shift,
                alibi_coef, MODC, M, F,
                MASKED=False, EVEN=EVEN_M, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN,
                SCORE_GRAD_FN=SCORE_GRAD_FN,
            )  # fmt: skip
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, full_end, block_end, seq_q, shift,
                alibi_coef, MODC, M, F,
                MASKED=True, EVEN=EVEN_M, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN,
                SCORE_GRAD_FN=SCORE_GRAD_FN,
            )  # fmt: skip

    dk *= sm_scale
    if HAS_KV_RANGE:
        # A key outside the range is kept by no row: its gradients are 0 by definition, and
        # the zero weights of its column must not carry a non-finite query or output
        # gradient of the tile's other rows into them.
        inside = (offs_n >= kv_lo) & (offs_n < kv_hi)
        dk = tl.where(inside[:, None], dk, 0.0)
        dv = tl.where(inside[:, None], dv, 0.0)
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

"""The dQ backward kernel: one program per query block, which also stores the row terms
``delta``, over listed or ranged key blocks."""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    LOG2E_K,
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
    _mod_param_grads,
    _mod_score_grad,
    _partial_keep,
    _row_bounds,
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
    mask_kv_lists,
    mask_qk_scale,
    mask_row_stride,
    sparse_m,
    sparse_n,
)

__all__: list[str] = []


@triton.jit
def _attn_bwd_dq_inner(
    dq,
    slope_pdr,
    slope_pr,
    slope_pd,
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
    kv_lo,
    kv_hi,
    shift,
    alibi_coef,
    MODC,
    M,
    F: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_DSLOPE: tl.constexpr,
    MASK_FN: tl.constexpr,
    SCORE_GRAD_FN: tl.constexpr,
    PARAM_GRAD_FN: tl.constexpr,
    entries=0,
    LISTED_TILES: tl.constexpr = 0,
    BOUNDED: tl.constexpr = True,
):
    """Accumulate ``dQ`` (unscaled) of a query tile over key tiles (``[block_first,
    block_end)``, or with ``LISTED_TILES`` those of the list at ``entries`` as
    ``_attn_fwd_inner`` counts them), and with ``HAS_DSLOPE``
    three ``[BLOCK_M]`` row sums for the gradient of ALiBi's slope: ``sum P dP r``,
    ``sum P r`` and ``sum P dP``, where ``r = |i + (S - L) - j|`` and ``dP`` is the gradient of
    the probabilities. The slope's part of a row is ``sum dS r = sum P dP r - (sum P r)(sum P
    dP)`` (:func:`_attn_bwd_dq`): it needs no ``delta``, whose rounding (it is read from the
    low-precision output) would otherwise be multiplied by the distances. ``M``, ``F``: the
    mask (``record.py``)."""
    HAS_SOFTCAP: tl.constexpr = has_softcap(F)
    HAS_ALIBI: tl.constexpr = has_alibi(F)
    qk_scale = mask_qk_scale(M)
    BOUNDS: tl.constexpr = MASKED and not EVEN  # see _attn_fwd_inner
    IN_RANGE: tl.constexpr = MASKED and has_kv_range(F)  # see _attn_fwd_inner
    offs_n = block_first * BLOCK_N + tl.arange(0, BLOCK_N)
    start = (block_first * BLOCK_N).to(tl.int64)
    k_ptrs = _tile_ptrs(k_head, start, stride_kn, stride_kk, BLOCK_N, BLOCK_E)
    v_ptrs = _tile_ptrs(v_head, start, stride_vn, stride_vk, BLOCK_N, BLOCK_E)
    for t in range(block_first, block_end):
        if LISTED_TILES > 0:
            tile = _listed_tile(entries, t, LISTED_TILES)
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            k_ptrs = _tile_ptrs(k_head, tile * BLOCK_N, stride_kn, stride_kk, BLOCK_N, BLOCK_E)
            v_ptrs = _tile_ptrs(v_head, tile * BLOCK_N, stride_vn, stride_vk, BLOCK_N, BLOCK_E)
        k = _load_key_tile(  # [BLOCK_N, BLOCK_E]
            k_ptrs, offs_n, seq_k, kv_lo, kv_hi,
            BOUNDS=BOUNDS, IN_RANGE=IN_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
        )  # fmt: skip
        v = _load_key_tile(  # [BLOCK_N, BLOCK_E]
            v_ptrs, offs_n, seq_k, kv_lo, kv_hi,
            BOUNDS=BOUNDS, IN_RANGE=IN_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
        )  # fmt: skip
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if SCORE_GRAD_FN is not None:
            rel = (offs_m + shift).to(tl.float32)[:, None] - offs_n.to(tl.float32)[None, :]
            s, t = _log2_scores(qk, rel, 0.0, alibi_coef, M, F, False)
            s_in = s
            s, dmod = _mod_score_grad(s, offs_m, offs_n, MODC, SCORE_GRAD_FN)
            p = tl.math.exp2(s - lse2[:, None])
        elif HAS_SOFTCAP or HAS_ALIBI:
            rel = (offs_m + shift).to(tl.float32)[:, None] - offs_n.to(tl.float32)[None, :]
            s, t = _log2_scores(qk, rel, lse2[:, None], alibi_coef, M, F, True)
            p = tl.math.exp2(s)
        else:
            t = qk
            p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        dp = _dot(do, tl.trans(v), None, DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        if MASKED:
            # masked pairs select 0 whatever p and dp are
            keep = _partial_keep(
                offs_m, offs_n, row_lo, row_hi, seq_k, MODC,
                MASK_FN=MASK_FN, BOUNDED=BOUNDED, BOUNDS=BOUNDS,
            )  # fmt: skip
            ds = tl.where(keep, ds, 0.0)
        if HAS_DSLOPE:
            dist = tl.abs(rel)
            pd = p * dp
            pr = p * dist
            if MASKED:
                pd = tl.where(keep, pd, 0.0)
                pr = tl.where(keep, pr, 0.0)
            slope_pdr += tl.sum(pd * dist, 1)
            slope_pr += tl.sum(pr, 1)
            slope_pd += tl.sum(pd, 1)
        if PARAM_GRAD_FN is not None:
            _mod_param_grads(s_in, offs_m, offs_n, MODC, ds, PARAM_GRAD_FN)
        if SCORE_GRAD_FN is not None:
            ds = ds * dmod
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        if MASKED and (HAS_SOFTCAP or SCORE_GRAD_FN is not None):
            ds = tl.where(keep, ds, 0.0)  # t or the derivative of a masked pair may be NaN
        dq = _dot(ds.to(k.dtype), k, dq, DOT_PRECISION)  # [BLOCK_M, BLOCK_E]
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq, slope_pdr, slope_pr, slope_pd


@triton.jit
def _attn_bwd_dq_listed(
    dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta, k_head, v_head, stride_kn,
    stride_kk, stride_vn, stride_vk, offs_m, row_lo, row_hi, entries, seq_k, kv_lo, kv_hi,
    shift, alibi_coef, MODC, M, F: tl.constexpr,
    MASKED: tl.constexpr, EVEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DSLOPE: tl.constexpr,
    MASK_FN: tl.constexpr, SCORE_GRAD_FN: tl.constexpr, PARAM_GRAD_FN: tl.constexpr,
    BOUNDED: tl.constexpr,
):  # fmt: skip
    """The key blocks of one list, as ``_attn_fwd_listed`` visits them, for ``dQ``."""
    TILES: tl.constexpr = sparse_n(F) // BLOCK_N
    dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
        dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
        k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, tl.zeros([], dtype=tl.int32),
        _listed_tiles(entries, seq_k, BLOCK_N, TILES), seq_k, kv_lo,
        kv_hi, shift, alibi_coef, MODC, M, F,
        MASKED=MASKED, EVEN=EVEN, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
        DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
        MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, PARAM_GRAD_FN=PARAM_GRAD_FN,
        entries=entries, LISTED_TILES=TILES, BOUNDED=BOUNDED,
    )  # fmt: skip
    return dq, slope_pdr, slope_pr, slope_pd


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
    DSlope,
    M,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    stride_dob, stride_doh, stride_dom, stride_dok,
    stride_dqb, stride_dqh, stride_dqm, stride_dqk,
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
    HAS_DLSE: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_DSLOPE: tl.constexpr,
    MASK_FN: tl.constexpr = None,
    SCORE_GRAD_FN: tl.constexpr = None,
    PARAM_GRAD_FN: tl.constexpr = None,
):  # fmt: skip
    """``dQ`` of one query tile of one query head.

    Also computes the tile's row terms ``delta = rowsum(dO * O) - dLse`` of the softmax
    gradient and stores them for the dK/dV kernel, which must run after this one. With
    ``HAS_DSLOPE`` it stores the tile's part of the gradient of its head's ALiBi slope in
    ``DSlope`` ``(B, Hq, programs along L)``, which the launcher sums. ``M``, ``F``: the mask
    (``record.py``).
    """
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    # torch.compile passes Python floats as fp64; keep the softmax arithmetic in fp32
    sm_scale = tl.cast(sm_scale, tl.float32)
    HAS_BLOCK_LISTS: tl.constexpr = has_block_lists(F)
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
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_K)
    k_head = K + off_b * stride_kb + off_hk * stride_kh
    v_head = V + off_b * stride_vb + off_hk * stride_vh

    doc_off = off_b * mask_row_stride(M)
    kv_lo, kv_hi = _key_range(M, F, off_b, seq_k)
    if not HAS_BLOCK_LISTS:
        # before the row bounds: in another order the band path compiles to other code
        block_first, full_first, full_end, block_end = _key_block_range(
            start_m, seq_q, seq_k, M, F, doc_off, kv_lo, kv_hi, BLOCK_M, BLOCK_N
        )
    row_lo, row_hi = _row_bounds(offs_m, seq_q, seq_k, M, F, doc_off, kv_lo, kv_hi)
    alibi_coef = _alibi_coef(M, F, off_b, off_h)
    shift = seq_k - seq_q
    if MASK_FN is not None or SCORE_GRAD_FN is not None:
        MODC = _mod_context(off_b, off_h, seq_q, seq_k, MOD)
    else:  # no tuple holding None: Triton refuses one
        MODC = 0

    dq = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    slope_pdr = tl.zeros([BLOCK_M], dtype=tl.float32)
    slope_pr = tl.zeros([BLOCK_M], dtype=tl.float32)
    slope_pd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_BLOCK_LISTS:
        # the listed key blocks of this tile's list row, partial then full (as the forward)
        SPARSE_M: tl.constexpr = sparse_m(F)
        tl.static_assert(SPARSE_M % BLOCK_M == 0 and sparse_n(F) % BLOCK_N == 0)
        BOUNDED: tl.constexpr = has_lo(F) or has_hi(F) or has_docs(F) or has_kv_range(F)
        width = tl.cdiv(seq_k, sparse_n(F)) + 1
        entries = _list_row(
            mask_kv_lists(M), F, off_b, off_h, num_heads, start_m // SPARSE_M,
            tl.cdiv(seq_q, SPARSE_M), width,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_listed(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, entries, seq_k, kv_lo, kv_hi, shift,
            alibi_coef, MODC, M, F,
            MASKED=True, EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN,
            PARAM_GRAD_FN=PARAM_GRAD_FN, BOUNDED=BOUNDED,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_listed(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, entries + width, seq_k, kv_lo, kv_hi, shift,
            alibi_coef, MODC, M, F,
            MASKED=False, EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN,
            PARAM_GRAD_FN=PARAM_GRAD_FN, BOUNDED=BOUNDED,
        )  # fmt: skip
    else:
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, block_first, full_first, seq_k, kv_lo, kv_hi, shift,
            alibi_coef, MODC, M, F,
            MASKED=True, EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, PARAM_GRAD_FN=PARAM_GRAD_FN,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, full_first, full_end, seq_k, kv_lo, kv_hi, shift,
            alibi_coef, MODC, M, F,
            MASKED=False, EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, PARAM_GRAD_FN=PARAM_GRAD_FN,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, full_end, block_end, seq_k, kv_lo, kv_hi, shift,
            alibi_coef, MODC, M, F,
            MASKED=True, EVEN=EVEN_N, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, PARAM_GRAD_FN=PARAM_GRAD_FN,
        )  # fmt: skip

    if HAS_DSLOPE:
        # ALiBi's term is -slope * |i + (S - L) - j|
        dslope_ptr = DSlope + (off_b * num_heads + off_h) * tl.num_programs(0) + pid_m
        tl.store(dslope_ptr, -tl.sum(slope_pdr - slope_pr * slope_pd, 0))
    dq *= sm_scale
    dq_ptrs = _tile_ptrs(
        DQ + off_b * stride_dqb + off_h.to(tl.int64) * stride_dqh, start_m, stride_dqm, stride_dqk,
        BLOCK_M, BLOCK_E,
    )  # fmt: skip
    tl.store(
        dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_rows[:, None] & (offs_e[None, :] < HEAD_DIM)
    )

"""The backward kernels: dQ (one program per query block, which also stores the row terms
``delta``) then dK/dV (one program per key block and key/value head, summing over its group of
query heads), and the ALiBi slopes' gradient."""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import (
    LOG2E_K,
    _alibi_coef,
    _col_bounds,
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
    _query_block_range,
    _row_bounds,
    _tile_ptrs,
)
from .configs import DKDV_CONFIGS, DQ_CONFIGS, padded_head_dim, pick_config
from .forward import check_identity, identity_of
from .launch import PreparedLaunch, empty_contiguous, empty_rows
from .masks import doc_stride, late_cols_first, late_rows_first, mask_args
from .program import MaskProgram

__all__ = ["BackwardPlan", "attention_backward", "plan_backward"]


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
    MODC,
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
    """
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
            sT, tT = _log2_scores(
                qkT, relT, 0.0, qk_scale, softcap_in, softcap_out, alibi_coef,
                False, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
            )  # fmt: skip
            sT, dmodT = _mod_score_grad(sT, offs_m, offs_n, MODC, SCORE_GRAD_FN, TRANSPOSED=True)
            pT = tl.math.exp2(sT - lse2[None, :])
        elif HAS_SOFTCAP or HAS_ALIBI:
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
    stride_dok, offs_n, col_lo, col_hi, entries, seq_q, shift, qk_scale, softcap_in,
    softcap_out, alibi_coef, MODC,
    MASKED: tl.constexpr, EVEN: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, ALIBI_SIGN: tl.constexpr, TANH_MODE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPARSE_M: tl.constexpr, MASK_FN: tl.constexpr,
    SCORE_GRAD_FN: tl.constexpr, BOUNDED: tl.constexpr,
):  # fmt: skip
    """The query blocks of one list (``entries``: a count, then list blocks of ``SPARSE_M``
    queries), each as its tiles of ``BLOCK_M`` queries, all partial (``MASKED``) or all full."""
    TILES: tl.constexpr = SPARSE_M // BLOCK_M
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, q_head, do_head, lse_head, delta_head,
        stride_qm, stride_qk, stride_dom, stride_dok,
        offs_n, col_lo, col_hi, tl.zeros([], dtype=tl.int32),
        _listed_tiles(entries, seq_q, BLOCK_M, TILES), seq_q, shift,
        qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
        MASKED=MASKED, EVEN=EVEN, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
        ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
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
    ColLo,
    ColHi,
    Slopes,
    KvStart,
    KvEnd,
    Lists,
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
    MOD,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_KV_RANGE: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_MODE: tl.constexpr,
    REVERSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EVEN_M: tl.constexpr,
    HAS_BLOCK_LISTS: tl.constexpr,
    LISTS_PER_BATCH: tl.constexpr,
    LISTS_PER_HEAD: tl.constexpr,
    SPARSE_M: tl.constexpr,
    SPARSE_N: tl.constexpr,
    MASK_FN: tl.constexpr = None,
    SCORE_GRAD_FN: tl.constexpr = None,
):  # fmt: skip
    """``dK``, ``dV`` of one key tile of one key/value head, summed over its query heads.

    Keys outside the batch row's key range are not read and get zero gradients."""
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
    kv_lo, kv_hi = _key_range(KvStart, KvEnd, off_b, seq_k, HAS_KV_RANGE=HAS_KV_RANGE)
    k = _load_key_tile(  # [BLOCK_N, BLOCK_E]
        k_ptrs, offs_n, seq_k, kv_lo, kv_hi,
        BOUNDS=True, IN_RANGE=HAS_KV_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
    )  # fmt: skip
    v = _load_key_tile(  # [BLOCK_N, BLOCK_E]
        v_ptrs, offs_n, seq_k, kv_lo, kv_hi,
        BOUNDS=True, IN_RANGE=HAS_KV_RANGE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
    )  # fmt: skip

    doc_off = off_b * stride_db
    if HAS_BLOCK_LISTS:
        tl.static_assert(SPARSE_M % BLOCK_M == 0 and SPARSE_N % BLOCK_N == 0)
        BOUNDED: tl.constexpr = HAS_LO or HAS_HI or HAS_DOCS or HAS_KV_RANGE
        # the query blocks listed for this tile's list column, per query head below
        list_width = tl.cdiv(seq_q, SPARSE_M) + 1
        list_col = start_n // SPARSE_N
        list_cols = tl.cdiv(seq_k, SPARSE_N)
    else:
        block_first, full_first, full_end, block_end = _query_block_range(
            start_n, seq_q, seq_k, band_lo, band_hi, ColLo, ColHi, doc_off, kv_lo, kv_hi,
            HAS_LO=HAS_LO, HAS_HI=HAS_HI, HAS_DOCS=HAS_DOCS, HAS_KV_RANGE=HAS_KV_RANGE,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        )  # fmt: skip
    col_lo, col_hi = _col_bounds(
        offs_n, seq_q, seq_k, band_lo, band_hi, ColLo, ColHi, doc_off, kv_lo, kv_hi,
        HAS_LO=HAS_LO, HAS_HI=HAS_HI, HAS_DOCS=HAS_DOCS, HAS_KV_RANGE=HAS_KV_RANGE,
    )  # fmt: skip
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
        if MASK_FN is not None or SCORE_GRAD_FN is not None:
            MODC = _mod_context(off_b, off_h, seq_q, seq_k, MOD)
        else:  # no tuple holding None: Triton refuses one
            MODC = 0
        if HAS_BLOCK_LISTS:
            entries = _list_row(
                Lists, off_b, off_h, num_heads, list_col, list_cols, list_width,
                LISTS_PER_BATCH=LISTS_PER_BATCH, LISTS_PER_HEAD=LISTS_PER_HEAD,
            )  # fmt: skip
            dk, dv = _attn_bwd_dkdv_listed(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, entries, seq_q, shift,
                qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
                MASKED=True, EVEN=EVEN_M, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, SPARSE_M=SPARSE_M,
                MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, BOUNDED=BOUNDED,
            )  # fmt: skip
            dk, dv = _attn_bwd_dkdv_listed(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, entries + list_width, seq_q, shift,
                qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
                MASKED=False, EVEN=EVEN_M, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, SPARSE_M=SPARSE_M,
                MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, BOUNDED=BOUNDED,
            )  # fmt: skip
        else:
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, block_first, full_first, seq_q, shift,
                qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
                MASKED=True, EVEN=EVEN_M, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN,
                SCORE_GRAD_FN=SCORE_GRAD_FN,
            )  # fmt: skip
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, full_first, full_end, seq_q, shift,
                qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
                MASKED=False, EVEN=EVEN_M, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
                BLOCK_M=BLOCK_M, DOT_PRECISION=DOT_PRECISION, MASK_FN=MASK_FN,
                SCORE_GRAD_FN=SCORE_GRAD_FN,
            )  # fmt: skip
            dk, dv = _attn_bwd_dkdv_inner(
                dk, dv, k, v, q_head, do_head, lse_head, delta_head,
                stride_qm, stride_qk, stride_dom, stride_dok,
                offs_n, col_lo, col_hi, full_end, block_end, seq_q, shift,
                qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
                MASKED=True, EVEN=EVEN_M, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
                ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
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
    qk_scale,
    softcap_in,
    softcap_out,
    alibi_coef,
    MODC,
    MASKED: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_KV_RANGE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    TANH_MODE: tl.constexpr,
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
    low-precision output) would otherwise be multiplied by the distances."""
    BOUNDS: tl.constexpr = MASKED and not EVEN  # see _attn_fwd_inner
    IN_RANGE: tl.constexpr = MASKED and HAS_KV_RANGE  # see _attn_fwd_inner
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
            s, t = _log2_scores(
                qk, rel, 0.0, qk_scale, softcap_in, softcap_out, alibi_coef,
                False, HAS_SOFTCAP, HAS_ALIBI, ALIBI_SIGN, TANH_MODE,
            )  # fmt: skip
            s_in = s
            s, dmod = _mod_score_grad(s, offs_m, offs_n, MODC, SCORE_GRAD_FN)
            p = tl.math.exp2(s - lse2[:, None])
        elif HAS_SOFTCAP or HAS_ALIBI:
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
    shift, qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
    MASKED: tl.constexpr, EVEN: tl.constexpr, HAS_KV_RANGE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, ALIBI_SIGN: tl.constexpr,
    TANH_MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DSLOPE: tl.constexpr,
    SPARSE_N: tl.constexpr, MASK_FN: tl.constexpr, SCORE_GRAD_FN: tl.constexpr,
    PARAM_GRAD_FN: tl.constexpr, BOUNDED: tl.constexpr,
):  # fmt: skip
    """The key blocks of one list, as ``_attn_fwd_listed`` visits them, for ``dQ``."""
    TILES: tl.constexpr = SPARSE_N // BLOCK_N
    dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
        dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
        k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
        offs_m, row_lo, row_hi, tl.zeros([], dtype=tl.int32),
        _listed_tiles(entries, seq_k, BLOCK_N, TILES), seq_k, kv_lo,
        kv_hi, shift, qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
        MASKED=MASKED, EVEN=EVEN, HAS_KV_RANGE=HAS_KV_RANGE, HAS_SOFTCAP=HAS_SOFTCAP,
        HAS_ALIBI=HAS_ALIBI, ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM,
        BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
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
    RowLo,
    RowHi,
    Slopes,
    DSlope,
    KvStart,
    KvEnd,
    Lists,
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
    MOD,
    HEAD_DIM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    HAS_KV_RANGE: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_SIGN: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    TANH_MODE: tl.constexpr,
    REVERSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_DSLOPE: tl.constexpr,
    HAS_BLOCK_LISTS: tl.constexpr,
    LISTS_PER_BATCH: tl.constexpr,
    LISTS_PER_HEAD: tl.constexpr,
    SPARSE_M: tl.constexpr,
    SPARSE_N: tl.constexpr,
    MASK_FN: tl.constexpr = None,
    SCORE_GRAD_FN: tl.constexpr = None,
    PARAM_GRAD_FN: tl.constexpr = None,
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
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E_K)
    k_head = K + off_b * stride_kb + off_hk * stride_kh
    v_head = V + off_b * stride_vb + off_hk * stride_vh

    doc_off = off_b * stride_db
    kv_lo, kv_hi = _key_range(KvStart, KvEnd, off_b, seq_k, HAS_KV_RANGE=HAS_KV_RANGE)
    if not HAS_BLOCK_LISTS:
        # before the row bounds: in another order the band path compiles to other code
        block_first, full_first, full_end, block_end = _key_block_range(
            start_m, seq_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off, kv_lo, kv_hi,
            HAS_LO=HAS_LO, HAS_HI=HAS_HI, HAS_DOCS=HAS_DOCS, HAS_KV_RANGE=HAS_KV_RANGE,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        )  # fmt: skip
    row_lo, row_hi = _row_bounds(
        offs_m, seq_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off, kv_lo, kv_hi,
        HAS_LO=HAS_LO, HAS_HI=HAS_HI, HAS_DOCS=HAS_DOCS, HAS_KV_RANGE=HAS_KV_RANGE,
    )  # fmt: skip
    alibi_coef = _alibi_coef(Slopes, off_b, off_h, stride_sb, stride_sh, HAS_ALIBI, ALIBI_SIGN)
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
        tl.static_assert(SPARSE_M % BLOCK_M == 0 and SPARSE_N % BLOCK_N == 0)
        BOUNDED: tl.constexpr = HAS_LO or HAS_HI or HAS_DOCS or HAS_KV_RANGE
        width = tl.cdiv(seq_k, SPARSE_N) + 1
        entries = _list_row(
            Lists, off_b, off_h, num_heads, start_m // SPARSE_M, tl.cdiv(seq_q, SPARSE_M), width,
            LISTS_PER_BATCH=LISTS_PER_BATCH, LISTS_PER_HEAD=LISTS_PER_HEAD,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_listed(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, entries, seq_k, kv_lo, kv_hi, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
            MASKED=True, EVEN=EVEN_N, HAS_KV_RANGE=HAS_KV_RANGE, HAS_SOFTCAP=HAS_SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM,
            BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            SPARSE_N=SPARSE_N, MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN,
            PARAM_GRAD_FN=PARAM_GRAD_FN, BOUNDED=BOUNDED,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_listed(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, entries + width, seq_k, kv_lo, kv_hi, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
            MASKED=False, EVEN=EVEN_N, HAS_KV_RANGE=HAS_KV_RANGE, HAS_SOFTCAP=HAS_SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM,
            BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            SPARSE_N=SPARSE_N, MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN,
            PARAM_GRAD_FN=PARAM_GRAD_FN, BOUNDED=BOUNDED,
        )  # fmt: skip
    else:
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, block_first, full_first, seq_k, kv_lo, kv_hi, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
            MASKED=True, EVEN=EVEN_N, HAS_KV_RANGE=HAS_KV_RANGE, HAS_SOFTCAP=HAS_SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM,
            BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, PARAM_GRAD_FN=PARAM_GRAD_FN,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, full_first, full_end, seq_k, kv_lo, kv_hi, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
            MASKED=False, EVEN=EVEN_N, HAS_KV_RANGE=HAS_KV_RANGE, HAS_SOFTCAP=HAS_SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM,
            BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
            MASK_FN=MASK_FN, SCORE_GRAD_FN=SCORE_GRAD_FN, PARAM_GRAD_FN=PARAM_GRAD_FN,
        )  # fmt: skip
        dq, slope_pdr, slope_pr, slope_pd = _attn_bwd_dq_inner(
            dq, slope_pdr, slope_pr, slope_pd, q, do, lse2, delta,
            k_head, v_head, stride_kn, stride_kk, stride_vn, stride_vk,
            offs_m, row_lo, row_hi, full_end, block_end, seq_k, kv_lo, kv_hi, shift,
            qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
            MASKED=True, EVEN=EVEN_N, HAS_KV_RANGE=HAS_KV_RANGE, HAS_SOFTCAP=HAS_SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM,
            BLOCK_E=BLOCK_E, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, HAS_DSLOPE=HAS_DSLOPE,
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


@dataclass(frozen=True, eq=False)
class BackwardPlan:
    """The backward of one call identity, worked out once: :meth:`launch` only allocates the
    gradients and launches the dQ then the dK/dV kernel with the call's tensors.

    Made by :func:`plan_backward` for the shapes, dtypes and devices of ``q``, ``k``, ``v``
    (checked on each launch unless the caller has), the mask arguments (whose tensors it
    holds and the kernels read at each launch: they must not be written in place while the
    plan is used) and which gradients are wanted: the log-sum-exp's (``has_dlse``), the ALiBi
    slopes' and those of generated score functions' tensors. Strides and the data pointers'
    alignment may change from call to call (each combination gets its compiled kernel).
    """

    identity: tuple[object, ...]
    slopes: Tensor | None  # the program's ALiBi slopes, where their gradient is wanted
    # row_lo, row_hi, slopes (dQ's mask tensors before its slope-gradient buffer), then kv_start,
    # kv_end, the key-block lists (after it)
    dq_tensors: tuple[Tensor | None, ...]
    dq_tail: tuple[Tensor | None, ...]
    dq_scalars: tuple[Any, ...]  # after the strides
    dq_blocks: int  # dQ's programs along the query rows (the slope-gradient parts)
    # col_lo, col_hi, slopes, kv_start, kv_end, the query-block lists
    dkdv_tensors: tuple[Tensor | None, ...]
    dkdv_scalars: tuple[Any, ...]
    mod_grads: tuple[Tensor, ...]  # the float tensors score functions read, gradient wanted
    has_dlse: bool
    kernels: tuple[PreparedLaunch, PreparedLaunch] | None  # None: an empty call

    def launch(
        self,
        grad_out: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        grad_lse: Tensor | None = None,
        checked: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor] | None]:
        """``(dq, dk, dv, dslopes, dmods)`` as :func:`attention_backward` returns them. No host
        synchronisation. ``grad_lse`` is given exactly where the plan has ``has_dlse``."""
        if checked:
            check_identity("backward", self.identity, q, k, v)
        if (grad_lse is not None) != self.has_dlse:
            raise ValueError(
                f"this backward plan was made {'with' if self.has_dlse else 'without'} a "
                "log-sum-exp gradient; make a new plan for this call"
            )
        dq, dk, dv = empty_contiguous(q), empty_contiguous(k), empty_contiguous(v)
        dmods = (
            [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in self.mod_grads]
            if self.mod_grads
            else None
        )
        slopes = self.slopes
        if self.kernels is None:  # nothing depends on anything
            dslopes = None if slopes is None else torch.zeros_like(slopes)
            return dq.zero_(), dk.zero_(), dv.zero_(), dslopes, dmods
        dq_kernel, dkdv_kernel = self.kernels
        lse = lse.to(torch.float32).contiguous()
        if grad_lse is not None:
            grad_lse = grad_lse.to(torch.float32).contiguous()
        delta = empty_rows(q)  # (B, Hq, L)
        dslope_parts = None
        if slopes is not None:
            dslope_parts = q.new_empty((*q.shape[:2], self.dq_blocks), dtype=torch.float32)
        q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
        o_stride, do_stride = out.stride(), grad_out.stride()
        # What the compiled kernels are specialised on beyond the plan: the strides (the
        # gradients and row terms are fresh and contiguous: theirs are fixed by the shapes),
        # and each tensor's 16-byte alignment, spelled out only when some tensor lacks it.
        key: tuple[object, ...] | None = None
        if dq_kernel.direct():
            key = (q_stride, k_stride, v_stride, o_stride, do_stride)
            pointers = (
                q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | grad_out.data_ptr()
                | lse.data_ptr() | dq.data_ptr() | dk.data_ptr() | dv.data_ptr()
                | delta.data_ptr()
            )  # fmt: skip
            others = (grad_lse, dslope_parts)
            if pointers % 16 or any(t is not None and t.data_ptr() % 16 for t in others):
                own = (q, k, v, out, grad_out, lse, grad_lse, dq, dk, dv, delta, dslope_parts)
                key += tuple(t is None or t.data_ptr() % 16 == 0 for t in own)
        dq_kernel(
            key, q, k, v, out, grad_out, lse, grad_lse, delta, dq, *self.dq_tensors,
            dslope_parts, *self.dq_tail, *q_stride, *k_stride, *v_stride, *o_stride,
            *do_stride, *dq.stride(), *self.dq_scalars, *(dmods or []),
        )  # fmt: skip
        dkdv_kernel(
            key, q, k, v, grad_out, lse, delta, dk, dv, *self.dkdv_tensors, *q_stride,
            *k_stride, *v_stride, *do_stride, *dk.stride(), *dv.stride(), *self.dkdv_scalars,
        )  # fmt: skip
        dslopes = None
        if dslope_parts is not None and slopes is not None:
            dslopes = _reduce_to(dslope_parts.sum(-1), slopes)
        return dq, dk, dv, dslopes, dmods


def plan_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    has_dlse: bool = False,
    slopes_grad: bool = False,
    mod_grads: bool = False,
) -> BackwardPlan:
    """The :class:`BackwardPlan` of :func:`attention_backward` with these arguments; ``q``,
    ``k``, ``v`` give only their shapes, dtypes and devices (the plan keeps none of them)."""
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    identity = identity_of(q, k, v)
    alibi_slopes = program.alibi_slopes
    slopes = alibi_slopes if slopes_grad and alibi_slopes is not None else None
    mods = program.mods
    float_params: tuple[Tensor, ...] = ()
    if mod_grads and mods is not None and mods.has_score:
        float_params = tuple(t for t in mods.traced.params if t.is_floating_point())
    if batch * num_heads * seq_q * seq_k * head_dim == 0:
        return BackwardPlan(
            identity, slopes, (), (), (), 0, (), (), float_params, has_dlse, None
        )  # fmt: skip
    mask = mask_args(q, k, program, scale=scale, rows=True, cols=True)
    block_e = padded_head_dim(head_dim)
    group_size = num_heads // num_kv_heads
    common: dict[str, Any] = dict(
        HEAD_DIM=head_dim,
        BLOCK_E=block_e,
        **mask.flags(q),
        **mask.list_flags(),
        **mask.mod_options(backward=True),
    )
    scalars = (
        num_heads, group_size, seq_q, seq_k, mask.band_lo, mask.band_hi,
        scale, mask.qk_scale, mask.softcap_in, mask.softcap_out, *mask.mod_args(),
    )  # fmt: skip

    # The dQ kernel goes first: it also stores the row terms ``delta`` that dK/dV reads.
    cfg = pick_config(DQ_CONFIGS, q, block_e)
    block_m, block_n = mask.tiles(cfg.block_m, cfg.block_n)
    dq_grid = (triton.cdiv(seq_q, block_m), num_heads, batch)
    dq_kernel = PreparedLaunch(
        mask.kernel(_attn_bwd_dq, len(float_params), param_grads=bool(float_params)),
        dq_grid,
        dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            REVERSE=late_rows_first(seq_q, seq_k, mask),
            HAS_DLSE=has_dlse,
            EVEN_N=seq_k % block_n == 0,
            HAS_DSLOPE=slopes is not None,
            **mask.param_grad_option(),
            num_warps=cfg.num_warps,
            num_stages=mask.stages(cfg.num_stages),
            **common,
        ),
    )
    cfg = pick_config(DKDV_CONFIGS, q, block_e)
    block_m, block_n = mask.tiles(cfg.block_m, cfg.block_n)
    dkdv_kernel = PreparedLaunch(
        mask.kernel(_attn_bwd_dkdv),
        (triton.cdiv(seq_k, block_n), num_kv_heads, batch),
        dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            REVERSE=late_cols_first(seq_q, seq_k, mask),
            EVEN_M=seq_q % block_m == 0,
            num_warps=cfg.num_warps,
            num_stages=mask.stages(cfg.num_stages),
            **common,
        ),
    )
    return BackwardPlan(
        identity,
        slopes,
        (mask.row_lo, mask.row_hi, mask.slopes),
        (mask.kv_start, mask.kv_end, mask.kv_lists),
        (doc_stride(mask, seq_q), mask.stride_sb, mask.stride_sh, *scalars),
        dq_grid[0],
        (mask.col_lo, mask.col_hi, mask.slopes, mask.kv_start, mask.kv_end, mask.q_lists),
        (doc_stride(mask, seq_k), mask.stride_sb, mask.stride_sh, *scalars),
        float_params,
        has_dlse,
        (dq_kernel, dkdv_kernel),
    )


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    grad_lse: Tensor | None = None,
    slopes_grad: bool = False,
    mod_grads: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor] | None]:
    """Gradients ``(dq, dk, dv, dslopes)`` of :func:`attention_forward`, in the inputs' dtypes
    and shapes: :func:`plan_backward`, then its launch.

    ``out`` and ``lse`` are the forward's outputs, ``grad_out`` ``(B, Hq, L, E)`` any strides;
    ``grad_lse`` ``(B, Hq, L)``, optional, is the gradient of ``lse`` when it was used.
    ``dslopes``, the gradient of ``program.alibi_slopes`` (same shape), is computed only when
    ``slopes_grad`` is set (and ALiBi is on), and is ``None`` otherwise. ``dmods``, with
    ``mod_grads`` and generated score functions, are the float32 gradients of the float
    tensors those functions read (``program.mods``), in their order; ``None`` otherwise.
    Rows that kept no key contribute nothing; keys that no row keeps get zero gradients, and
    keys and values outside a row's key range ``[kv_start[b], kv_end[b])`` are never read.
    """
    plan = plan_backward(
        q, k, v, program, scale=scale, has_dlse=grad_lse is not None, slopes_grad=slopes_grad,
        mod_grads=mod_grads,
    )  # fmt: skip
    return plan.launch(grad_out, q, k, v, out, lse, grad_lse=grad_lse, checked=False)


def _reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """``(B, Hq)`` per-slope gradients summed over the batch where ``like`` is ``(Hq,)`` or
    ``(1, Hq)``, in ``like``'s dtype."""
    if like.dim() == 1:
        grad = grad.sum(0)
    elif like.shape[0] == 1:
        grad = grad.sum(0, keepdim=True)
    return grad.to(like.dtype)

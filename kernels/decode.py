"""Attention forward for short queries against long key/value caches (decoding, speculative
decoding, short chunks of new tokens): the same mask model and score modifiers as
``kernels/forward.py``, laid out for ``L`` of at most :data:`MAX_DECODE_QUERIES`.

Why the training kernel is slow here: it launches one program per (query block, query head,
batch entry), so a query of a few rows fills a few of the tile's rows, every query head of a
grouped-query group reads its key/value head again (``Hq / Hkv`` times the traffic), and
``B * Hq`` programs, each streaming the whole cache, leave most of a large GPU idle.

Packing. The ``G = Hq // Hkv`` query heads that share a key/value head and the ``L`` query rows
form one column of ``G * L`` rows, ordered query-major (row ``r`` is query ``r // G`` of head
``kv_head * G + r % G``), cut into tiles of ``BLOCK_M`` rows (at least 16, the tensor cores'
minimum). Each key/value block is then read once per group and tile instead of once per query
head, and consecutive queries share a tile, so a tile's key range is that of a few consecutive
rows: ``[row_lo[first], row_hi[last])``, the bound arithmetic of the training kernel. Each row
keeps its own ALiBi slope (heads differ within a tile).

Splitting. The key blocks a tile visits (its band and documents decide them, so a window of
``W`` keys visits about ``W / BLOCK_N`` blocks whatever ``S`` is) are cut into ``num_splits``
even shares, one program each; :func:`num_splits` picks the count on the host from the shapes
and the band alone (never from tensor contents, so the launch is CUDA-graph safe). With one
split the program normalises and stores the output. With more, each program stores its
normalised partial output ``o_s`` and its base-2 log-sum-exp ``lse_s`` in float32 and counts
itself done on the tile's counter; the program that finishes last merges the shares per row::

    M = max_s lse_s,    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)

and sets the counter back to 0. Merging in the kernel that computed the shares, instead of in
a second kernel, saves a launch and its gap on the GPU and on the host. The counters (int32
zeros) and the partial results are kept per stream and shared by its launches
(:func:`split_scratch`): they run one after another, and each leaves the counters at 0.

A share with no kept key (empty, or all masked) has ``o_s = 0`` and ``lse_s = -inf``, so it
weighs nothing; a row whose shares are all empty gets 0.

Everything inside a tile (the inner loop over key blocks, masking by selection, any finite
scale, non-finite values in partial tiles) is the training kernel's ``_attn_fwd_inner``.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``G = Hq // Hkv``),
``L`` queries (1 to :data:`MAX_DECODE_QUERIES`), ``S`` keys, ``E`` head dim (16 to 256).
"""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import FP32_TINY, LOG2E_K, _key_range, _mod_context, _row_bounds, _rows_key_blocks
from .configs import padded_head_dim
from .forward import _attn_fwd_runs, check_identity, identity_of
from .launch import PreparedLaunch, empty_contiguous, launches_traceable
from .limits import MAX_DECODE_QUERIES, interpreting
from .masks import doc_stride, mask_args
from .program import MaskProgram

__all__ = [
    "MAX_DECODE_QUERIES",
    "DecodeConfig",
    "DecodeLayout",
    "DecodePlan",
    "decode_config",
    "decode_forward",
    "decode_layout",
    "merges_in_kernel",
    "num_splits",
    "plan_decode",
    "split_scratch",
    "visited_key_blocks",
]

MIN_ROWS = 16  # the smallest row count of a tensor-core product
MAX_SPLITS = 128  # beyond this the merge costs more than the parallelism gains
# FlashAttention 2's rule: take the fewest splits whose waves of programs fill the GPU to
# within this fraction of the best split count's.
SPLIT_EFFICIENCY = 0.85
# Below this fraction of the SMs busy, splitting the keys pays.
FULL_ENOUGH = 0.8
# The interpreter has no SMs: a fixed small machine keeps CPU tests deterministic, splitting
# the keys of one or two programs, and fast (each program costs the interpreter time).
INTERPRETER_SM_COUNT = 4
# Packed rows per program of the merge kernel
MERGE_ROWS = 4


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
    RowLo,
    RowHi,
    KvStart,
    KvEnd,
    Slopes,
    stride_qb, stride_qh, stride_qm, stride_qk,
    stride_kb, stride_kh, stride_kn, stride_kk,
    stride_vb, stride_vh, stride_vn, stride_vk,
    stride_ob, stride_oh, stride_om, stride_ok,
    stride_db,
    stride_sb, stride_sh,
    group_size,
    row_tiles,
    seq_q,
    seq_k,
    band_lo,
    band_hi,
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
    DOT_PRECISION: tl.constexpr,
    EVEN_N: tl.constexpr,
    POSITIVE_SCALE: tl.constexpr,
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
    """
    tl.static_assert(BLOCK_E >= HEAD_DIM)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and BLOCK_E >= 16)
    # torch.compile passes Python floats as fp64; keep the softmax arithmetic in fp32
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap_in = tl.cast(softcap_in, tl.float32)
    softcap_out = tl.cast(softcap_out, tl.float32)
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

    doc_off = off_b * stride_db
    first_q = start_r // group_size
    last_q = tl.minimum((start_r + BLOCK_M - 1) // group_size, seq_q - 1)
    kv_lo, kv_hi = _key_range(KvStart, KvEnd, off_b, seq_k, HAS_KV_RANGE=HAS_KV_RANGE)
    block_first, full_first, full_end, block_end = _rows_key_blocks(
        first_q, last_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off, kv_lo, kv_hi,
        HAS_LO=HAS_LO, HAS_HI=HAS_HI, HAS_DOCS=HAS_DOCS, HAS_KV_RANGE=HAS_KV_RANGE,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    if MASK_FN is not None and HEADLESS_TILE_FN is not None:
        # the band's full run stays full where the masks' bounds over all of it (or all but
        # its last block, which a draft tree's root shares with the cache) keep every pair
        _, drops_all = HEADLESS_TILE_FN(
            off_b, off_b * 0, first_q, last_q, full_first * BLOCK_N, full_end * BLOCK_N - 1, MOD
        )
        _, drops_shorter = HEADLESS_TILE_FN(
            off_b, off_b * 0, first_q, last_q, full_first * BLOCK_N,
            full_end * BLOCK_N - BLOCK_N - 1, MOD,
        )  # fmt: skip
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

    row_lo, row_hi = _row_bounds(
        offs_m, seq_q, seq_k, band_lo, band_hi, RowLo, RowHi, doc_off, kv_lo, kv_hi,
        HAS_LO=HAS_LO, HAS_HI=HAS_HI, HAS_DOCS=HAS_DOCS, HAS_KV_RANGE=HAS_KV_RANGE,
    )  # fmt: skip
    if HAS_ALIBI:
        # heads differ between rows: one slope per row, broadcast over the keys
        slopes = tl.load(Slopes + off_b * stride_sb + heads * stride_sh, mask=in_rows, other=0.0)
        sign = LOG2E_K if ALIBI_SIGN < 0 else -LOG2E_K
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
        seq_k, kv_lo, kv_hi, shift, qk_scale, softcap_in, softcap_out, alibi_coef, MODC,
        EVEN=EVEN_N, HAS_KV_RANGE=HAS_KV_RANGE, HAS_SOFTCAP=HAS_SOFTCAP, HAS_ALIBI=HAS_ALIBI,
        ALIBI_SIGN=ALIBI_SIGN, TANH_MODE=TANH_MODE, HEAD_DIM=HEAD_DIM, BLOCK_E=BLOCK_E,
        BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION, POSITIVE_SCALE=POSITIVE_SCALE,
        MASK_FN=MASK_FN, SCORE_FN=SCORE_FN,
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


# --------------------------------------------------------------------------------------
# Host side: configuration, layout and the number of splits
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel: ``block_n`` keys per block, at most
    ``max_rows`` packed rows per tile, the kernel's warps and pipeline stages, and
    ``full_enough``: the share of the multiprocessors that, each given a program, keeps the
    GPU busy enough that the keys are not split (:func:`num_splits`)."""

    block_n: int
    max_rows: int
    num_warps: int
    num_stages: int
    full_enough: float = FULL_ENOUGH


# Keyed by the head dim padded to a power of two (the warps at head dim 256 follow the
# training kernel's forward).
_GPU_CONFIGS = {
    16: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    32: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    64: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    128: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    256: DecodeConfig(block_n=32, max_rows=64, num_warps=8, num_stages=2),
}
# A tile of at most 16 packed rows (a query or a few per group of heads) computes little per
# key it reads: on a key range of up to SMALL_TILE_MAX_KEYS, longer key blocks, more of them
# in flight, and one program per tile even when only half of the multiprocessors get one keep
# the memory as busy without the merge; longer ranges keep the general tiles, which are faster
# there (benchmarks/NOTES.md, "Figures behind the code's choices"). Taken where the stages'
# key and value blocks fit the device's shared memory.
_GPU_SMALL_TILE_CONFIGS = {
    128: DecodeConfig(block_n=128, max_rows=MIN_ROWS, num_warps=4, num_stages=3, full_enough=0.45),
}
SMALL_TILE_MAX_KEYS = 32768
# Shared memory a decode program needs beside its key and value blocks (the query tile,
# the compiler's scratch)
SHARED_MEMORY_SLACK = 16 * 1024
# The interpreter runs each program in numpy: small tiles keep CPU tests fast and still span
# several key blocks and row tiles.
INTERPRETER_CONFIG = DecodeConfig(block_n=16, max_rows=16, num_warps=1, num_stages=1)


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    properties = torch.cuda.get_device_properties(index)
    return int(getattr(properties, "shared_memory_per_block_optin", 0))


def decode_config(
    block_e: int, *, rows: int, keys: int, itemsize: int, device: torch.device
) -> DecodeConfig:
    """The launch parameters for a head dim padded to ``block_e``, ``rows`` packed rows per
    key/value head (``Hq // Hkv * L``) that visit up to ``keys`` keys, inputs of ``itemsize``
    bytes, on ``device`` (the one place to tune)."""
    if interpreting():
        return INTERPRETER_CONFIG
    small = _GPU_SMALL_TILE_CONFIGS.get(block_e)
    if (
        small is not None
        and rows <= small.max_rows
        and keys <= SMALL_TILE_MAX_KEYS
        and device.type == "cuda"
    ):
        index = device.index if device.index is not None else torch.cuda.current_device()
        blocks = small.num_stages * 2 * small.block_n * block_e * itemsize
        if blocks + SHARED_MEMORY_SLACK <= _cuda_shared_memory(index):
            return small
    return _GPU_CONFIGS[block_e]


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of ``device`` (a fixed count under the interpreter)."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def visited_key_blocks(
    seq_q: int,
    seq_k: int,
    band_lo: int | None,
    band_hi: int | None,
    has_docs: bool,
    block_n: int,
) -> int:
    """How many key blocks the queries visit: those holding keys ``[lo, hi)`` that some row
    keeps under the band (``band_lo <= j - i <= band_hi``, ``None`` open), all ``S`` keys
    with documents (their extent is on the device, not known here)."""
    lo, hi = 0, seq_k
    if band_lo is not None and band_hi is not None and band_lo > band_hi:
        return 0  # an empty band
    if not has_docs:
        if band_lo is not None:
            lo = max(lo, band_lo)  # the first row, i = 0, reaches furthest back
        if band_hi is not None:
            hi = min(hi, seq_q - 1 + band_hi + 1)  # the last row reaches furthest ahead
    if hi <= lo or seq_q == 0:
        return 0
    return (hi - 1) // block_n - lo // block_n + 1


def num_splits(
    *,
    batch: int,
    kv_heads: int,
    row_tiles: int,
    key_blocks: int,
    sms: int,
    full_enough: float = FULL_ENOUGH,
) -> int:
    """How many programs share the key blocks of one (batch entry, key/value head, row tile).

    One while ``batch * kv_heads * row_tiles`` programs keep ``full_enough`` of the ``sms``
    multiprocessors busy; otherwise FlashAttention 2's rule: the fewest splits whose waves of
    programs fill the GPU nearly as well as the best count does, counting only split counts
    that change the blocks per split, never more splits than ``key_blocks`` nor
    :data:`MAX_SPLITS`, nor more than two waves' worth (beyond that a split adds merge work
    and fills the GPU no better).
    """
    programs = batch * kv_heads * row_tiles
    if programs == 0 or key_blocks <= 1 or programs >= full_enough * sms:
        return 1
    limit = min(MAX_SPLITS, key_blocks, -(-2 * sms // programs))

    def changes_share(splits: int) -> bool:
        # a split count that leaves the largest share as it was only adds merge work
        return splits == 1 or -(-key_blocks // splits) != -(-key_blocks // (splits - 1))

    def efficiency(splits: int) -> float:
        waves = programs * splits / sms
        return waves / -(-waves // 1)

    candidates = [s for s in range(1, limit + 1) if changes_share(s)]
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= SPLIT_EFFICIENCY * best)


@dataclass(frozen=True)
class DecodeLayout:
    """How a call runs: ``block_m`` packed rows per tile, ``row_tiles`` tiles per key/value
    head, ``splits`` programs per tile, and the launch ``config``."""

    group_size: int
    block_m: int
    row_tiles: int
    splits: int
    config: DecodeConfig


def decode_layout(
    q_shape: tuple[int, ...] | torch.Size,
    k_shape: tuple[int, ...] | torch.Size,
    device: torch.device,
    program: MaskProgram,
    *,
    itemsize: int,
    splits: int | None = None,
) -> DecodeLayout:
    """The layout of a call with ``q`` ``(B, Hq, L, E)`` and ``k`` ``(B, Hkv, S, E)`` of
    ``itemsize``-byte elements, from shapes and the program's band only (``splits`` forces
    the split count)."""
    batch, num_heads, seq_q, head_dim = q_shape
    num_kv_heads, seq_k = k_shape[1], k_shape[2]
    band_lo, band_hi = program.band_lo, program.band_hi
    # the extent of documents and key ranges is on the device: count every key
    has_docs = program.has_docs or program.has_key_range
    group_size = num_heads // num_kv_heads if num_kv_heads else 1
    rows = group_size * seq_q
    keys = visited_key_blocks(seq_q, seq_k, band_lo, band_hi, has_docs, 1)
    config = decode_config(
        padded_head_dim(head_dim), rows=rows, keys=keys, itemsize=itemsize, device=device
    )
    block_m = min(config.max_rows, max(MIN_ROWS, triton.next_power_of_2(max(rows, 1))))
    row_tiles = triton.cdiv(rows, block_m)
    if splits is None:
        splits = num_splits(
            batch=batch,
            kv_heads=num_kv_heads,
            row_tiles=row_tiles,
            key_blocks=visited_key_blocks(seq_q, seq_k, band_lo, band_hi, has_docs, config.block_n),
            sms=sm_count(device),
            full_enough=config.full_enough,
        )
    return DecodeLayout(group_size, block_m, row_tiles, splits, config)


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


# (device index, stream) -> (counters, partial results) of the eager split launches on that
# stream: int32 zeros, one per tile, that each launch counts the finished shares of a tile in
# and sets back to 0 before it ends, and the float32 partial results the shares leave for the
# last one. The launches of one stream run one after another, so they can share both; a
# launch on another stream could run at the same time, so each stream has its own.
_SCRATCH: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def merges_in_kernel(device: torch.device) -> bool:
    """Whether a split launch now merges in its last share (on counters) rather than in a
    second kernel: yes for eager launches and under the interpreter; no for launches being
    traced by ``torch.compile`` or captured in a CUDA graph (a graph may be replayed on any
    stream, so it could not share counters with the launches of one)."""
    if launches_traceable():
        return False
    return device.type != "cuda" or not torch._C._cuda_isCurrentStreamCapturing()


def split_scratch(device: torch.device, tiles: int, part_size: int) -> tuple[Tensor, Tensor] | None:
    """``(counters, parts)`` for an eager split launch on ``device`` whose last share merges:
    at least ``tiles`` int32 zeros and ``part_size`` float32 elements, kept per CUDA stream
    (fresh ones on the CPU, under the interpreter); ``None`` when the launch merges in a
    second kernel instead (:func:`merges_in_kernel`)."""
    if not merges_in_kernel(device):
        return None
    if device.type != "cuda":
        counters = torch.zeros(tiles, dtype=torch.int32, device=device)
        return counters, torch.empty(part_size, dtype=torch.float32, device=device)
    index = device.index if device.index is not None else torch._C._cuda_getDevice()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    found = _SCRATCH.get(key)
    if found is None or found[0].numel() < tiles or found[1].numel() < part_size:
        # grown to powers of two; a buffer given up here is reused by the allocator only
        # after the launches already queued on this stream
        if found is None or found[0].numel() < tiles:
            size = triton.next_power_of_2(tiles)
            kept_counters = torch.zeros(size, dtype=torch.int32, device=device)
        else:
            kept_counters = found[0]
        if found is None or found[1].numel() < part_size:
            size = triton.next_power_of_2(part_size)
            kept_parts = torch.empty(size, dtype=torch.float32, device=device)
        else:
            kept_parts = found[1]
        found = _SCRATCH[key] = (kept_counters, kept_parts)
    return found


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """The decode forward of one call identity, worked out once (the decode layout, its split
    count, the mask arguments, the grid): :meth:`launch` only allocates the output (and the
    partial results where the stream keeps none) and launches the kernel with the call's
    tensors.

    Made by :func:`plan_decode` for the shapes, dtypes and devices of ``q``, ``k``, ``v``
    (checked on each launch) and the mask arguments, whose tensors (document ranges, slopes,
    key ranges) it holds: the kernel reads their contents at each launch, so they must not be
    written in place while the plan is used. Strides and the data pointers' alignment may
    change from call to call (each combination gets its compiled kernel).
    """

    identity: tuple[object, ...]
    layout: DecodeLayout | None  # None: an empty output, nothing to launch
    mask_tensors: tuple[Tensor | None, ...]  # row_lo, row_hi, kv_start, kv_end, slopes
    scalars: tuple[int | float, ...]  # the output's strides and the scalars after them
    kernel: PreparedLaunch | None  # with more than one split, its last share merges
    part_size: int  # float32 elements of the partial results (one split: 0, none)
    tiles: int  # B * Hkv * row_tiles: the counters a split launch needs
    # with more than one split, for launches that keep no counters: the shares only, then
    # the merge kernel and its runtime scalars
    kernel_apart: PreparedLaunch | None = None
    merge: PreparedLaunch | None = None
    merge_scalars: tuple[int, ...] = ()
    # [(stream, (counters, parts))]: the CUDA stream of this plan's last direct split launch
    # and that stream's split_scratch, so that a launch on the same stream skips the lookup
    # (one item, replaced whole: threads launching on other streams read a consistent pair)
    last_stream: list[tuple[int, tuple[Tensor, Tensor]] | None] = field(
        default_factory=lambda: [None]
    )

    def launch(self, q: Tensor, k: Tensor, v: Tensor, *, checked: bool = True) -> Tensor:
        """``out`` as :func:`decode_forward` returns it. No host synchronisation: one launch,
        or two where a split launch cannot keep counters (:func:`merges_in_kernel`).

        ``checked=False`` skips checking that the tensors are of the plan's identity, for a
        caller that has (the plan cache keys on it); :meth:`run` is that call."""
        if checked:
            check_identity("decode", self.identity, q, k, v)
        return self.run(q, k, v)

    def run(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """:meth:`launch` without the identity check."""
        out = empty_contiguous(q)  # (B, Hq, L, E): the strides the plan holds
        kernel, merge = self.kernel, None
        if kernel is None:
            return out
        direct = kernel.direct()
        parts = counters = None
        if self.part_size:
            scratch = (
                self._stream_scratch(q)
                if direct
                else split_scratch(q.device, self.tiles, self.part_size)
            )
            if scratch is not None:
                counters, parts = scratch
            else:
                parts = torch.empty(self.part_size, dtype=torch.float32, device=q.device)
                kernel, merge = self.kernel_apart, self.merge
                assert kernel is not None  # a split plan has both
        q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
        if direct:
            # What the compiled kernel is specialised on beyond the plan: the strides, and
            # each tensor's 16-byte alignment, spelled out only when some tensor lacks it
            # (the output and partial results come from the allocator: their strides are
            # the plan's).
            ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()
            if parts is not None:
                ptrs |= parts.data_ptr()
            call_key: tuple[object, ...] | None = (q_stride, k_stride, v_stride)
            if ptrs % 16:
                call_key = (
                    q_stride,
                    k_stride,
                    v_stride,
                    *(t is None or t.data_ptr() % 16 == 0 for t in (q, k, v, out, parts)),
                )
        else:
            call_key = None
        kernel(
            call_key, q, k, v, out, parts, counters, *self.mask_tensors,
            *q_stride, *k_stride, *v_stride, *self.scalars,
        )  # fmt: skip
        if merge is not None:
            assert parts is not None  # the launch's fresh partial results
            merge_key = None
            if direct:
                merge_key = (parts.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
            merge(merge_key, parts, out, *self.merge_scalars)
        return out

    def _stream_scratch(self, q: Tensor) -> tuple[Tensor, Tensor] | None:
        """:func:`split_scratch` for a direct launch (a CUDA one, not traced), found from
        the current stream alone when it is the stream of the plan's last launch."""
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = torch._C._cuda_getCurrentRawStream(q.get_device())
        last = self.last_stream[0]
        if last is None or last[0] != stream:
            scratch = split_scratch(q.device, self.tiles, self.part_size)
            if scratch is None:
                return None
            last = self.last_stream[0] = (stream, scratch)
        return last[1]


def plan_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    num_splits: int | None = None,
) -> DecodePlan:
    """The :class:`DecodePlan` of :func:`decode_forward` with these arguments; ``q``, ``k``,
    ``v`` give only their shapes, dtypes and devices (the plan keeps none of them)."""
    if program.blocks is not None:
        raise ValueError(
            "the decode kernel iterates the analytic band only; a mask program with block "
            "lists runs in the training kernel (attention_forward)"
        )
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    identity = identity_of(q, k, v)
    if batch * num_heads * seq_q * head_dim == 0:
        return DecodePlan(identity, None, (), (), None, 0, 0)
    mask = mask_args(q, k, program, scale=scale, rows=True, cols=False, lists=False)
    layout = decode_layout(
        q.shape, k.shape, q.device, program, itemsize=q.element_size(), splits=num_splits
    )
    cfg = layout.config
    block_e = padded_head_dim(head_dim)
    split = layout.splits > 1
    tiles = batch * num_kv_heads * layout.row_tiles
    grid = (layout.splits, num_kv_heads * layout.row_tiles, batch)
    options = dict(
        HEAD_DIM=head_dim,
        BLOCK_E=block_e,
        BLOCK_M=layout.block_m,
        BLOCK_N=cfg.block_n,
        **mask.flags(q),
        **mask.mod_options(backward=False, decode=True),
        EVEN_N=seq_k % cfg.block_n == 0,
        POSITIVE_SCALE=mask.qk_scale >= FP32_TINY,
        SPLIT=split,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    # the output is allocated contiguous: (B, Hq, L, E)
    out_strides = (num_heads * seq_q * head_dim, seq_q * head_dim, head_dim, 1)
    kernel_apart = merge = None
    merge_scalars: tuple[int, ...] = ()
    if split:
        kernel_apart = PreparedLaunch(
            mask.kernel(_decode_fwd), grid, {**options, "MERGE_LAST": False}
        )
        rows = min(MERGE_ROWS, layout.block_m)
        merge_options = dict(
            HEAD_DIM=head_dim, BLOCK_E=block_e, BLOCK_M=layout.block_m, ROWS=rows,
            num_warps=cfg.num_warps, num_stages=1,
        )  # fmt: skip
        merge_grid = (grid[1] * (layout.block_m // rows), batch)
        merge = PreparedLaunch(_decode_merge, merge_grid, merge_options)
        merge_scalars = (*out_strides, layout.group_size, layout.row_tiles, seq_q, layout.splits)
    return DecodePlan(
        identity,
        layout,
        (mask.row_lo, mask.row_hi, mask.kv_start, mask.kv_end, mask.slopes),
        (
            *out_strides,
            doc_stride(mask, seq_q),
            mask.stride_sb,
            mask.stride_sh,
            layout.group_size,
            layout.row_tiles,
            seq_q,
            seq_k,
            mask.band_lo,
            mask.band_hi,
            mask.qk_scale,
            mask.softcap_in,
            mask.softcap_out,
            *mask.mod_args(),
        ),
        PreparedLaunch(mask.kernel(_decode_fwd), grid, {**options, "MERGE_LAST": split}),
        layout.splits * tiles * layout.block_m * (block_e + 1) if split else 0,
        tiles,
        kernel_apart,
        merge,
        merge_scalars,
    )


def decode_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    num_splits: int | None = None,
) -> Tensor:
    """Attention forward for short queries, the arguments of ``attention_forward``:
    :func:`plan_decode`, then its launch.

    Args:
        q: ``(B, Hq, L, E)`` with ``L <= MAX_DECODE_QUERIES``; k, v: ``(B, Hkv, S, E)``, same
            dtype (fp16, bf16 or fp32) and device, any strides.
        program: the mask and score terms (:class:`~.program.MaskProgram`, the analytic band
            source only); no key outside a batch row's key range is read.
        scale: multiplies ``q @ k^T`` (any finite value).
        num_splits: programs per tile of packed rows over its keys; ``None`` picks it from
            the shapes, the band and the GPU (:func:`num_splits`).

    Returns:
        ``out`` ``(B, Hq, L, E)`` in ``q.dtype`` (contiguous); a row that keeps no key is 0.

    No host synchronisation: everything on the host depends on shapes, dtypes and the band,
    so a call can be captured in a CUDA graph. Inputs are assumed valid.
    """
    return plan_decode(q, k, v, program, scale=scale, num_splits=num_splits).launch(q, k, v)

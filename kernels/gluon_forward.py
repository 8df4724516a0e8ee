"""An attention forward for Hopper in Triton's Gluon dialect: warp-specialized, with ping-pong.

One program per 128 query rows of one (batch, query head), three partitions:

* a producer warp issues every TMA load: the program's queries once, then each block of
  ``BLOCK_N`` keys and values into one of ``STAGES`` shared-memory stages, once both consumers
  released the block that held it (an mbarrier per stage each way);
* two consumer warpgroups of 64 query rows each issue block ``j``'s scores MMA
  (``S = Q K^T``) and block ``j - 1``'s ``O += P V`` back to back (warpgroup MMAs, ``P`` from
  registers), then run block ``j``'s online softmax (base 2, in registers) while both run; the
  two take turns to issue their MMAs (an mbarrier each), so that one's softmax runs while the
  other's MMAs do (FlashAttention 3's ping-pong).

Masks: a band ``band_lo <= j - i <= band_hi`` (either side open; causal in either alignment,
sliding windows) over a key loop bounded to the band's blocks; keys at or past ``S`` are masked
(TMA fills them with zeros: nothing past a row's end is read). Packed documents: each query
row keeps the keys ``[row_lo[i], row_hi[i])`` of its document (the Triton kernels' ranges,
``kernels/masks.py``), which narrow the key loop as the band does. A row that keeps no key
gives 0. Scores: ``scale * q.k``, then a soft-cap ``cap * tanh(s / cap)`` (``tanh.approx``, as the
Triton kernels take it for fp16 / bf16), then ALiBi's ``- slope[b, h] * |i + S - L - j|``
(float32 distances, exact below 2**24), as :class:`~.program.MaskProgram` defines them.

Shape legend:

    B   batch size              L   query length            E   head dim (64, 128, 256)
    Hq  query heads             S   key/value length
    Hkv key/value heads (GQA: query head h reads key/value head h // (Hq / Hkv))

Tensors are seen through 3-D TMA descriptors ``(P, length, C)``: ``(B, H, length, E)`` in
memory as ``(B * H, length, E)``; ``(B, length, H, E)`` in memory (a ``(B, H, length, E)``
view of projections) as ``(B, length, H * E)``, a head's columns at ``h * E``.

Why three stages at E = 128: with two, the next load waits for both consumers to release the
stage it needs, and the kernel ran no faster than one partition of both warpgroups, turns or
not (benchmarks/RESULTS.md, "A Hopper forward in Gluon"). Per head dim (:data:`CONFIGS`), the
keys per block and the stages that fit Hopper's 227 KiB of shared memory beside the queries.
"""

# The @gluon.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .launch import KeptLaunch, current_device
from .masks import _document_ranges

__all__ = ["BLOCK_M", "CONFIGS", "HEAD_DIMS", "gluon_forward", "layout_of", "plan_gluon_forward"]

#: Query rows per program (two consumer warpgroups of 64).
BLOCK_M = 128
#: Per head dim: keys per block and stages of the key/value ring. E = 128: 3 x 64 KiB beside
#: 32 KiB of queries; E = 64: 4 x 32 KiB beside 16; E = 256: 2 x 64 KiB (blocks of 64 keys)
#: beside 64.
CONFIGS: dict[int, tuple[int, int]] = {64: (128, 4), 128: (128, 3), 256: (64, 2)}
#: The head dims the kernel takes.
HEAD_DIMS = tuple(CONFIGS)
_LOG2E = 1.4426950408889634


def layout_of(x: Tensor) -> str | None:
    """How a ``(B, H, length, E)`` tensor lies in memory for a TMA descriptor: ``"bhse"``
    (``(B * H, length, E)`` rows), ``"bshe"`` (``(B, length, H * E)`` rows), or ``None``
    (neither, or strides / base not 16-byte aligned)."""
    batch, heads, length, dim = x.shape
    s_b, s_h, s_l, s_e = x.stride()
    size = x.element_size()
    if s_e != 1 or x.data_ptr() % 16:
        return None
    if s_l == dim and (s_h == length * dim or heads == 1) and (s_b == heads * s_h or batch == 1):
        return "bhse" if (s_h * size) % 16 == 0 else None
    if s_h == dim and (s_b == length * s_l or batch == 1) and (s_l * size) % 16 == 0:
        return "bshe" if s_l == heads * dim and (s_b * size) % 16 == 0 else None
    return None


@functools.cache
def _shared_layout(rows: int, dim: int, bf16: bool) -> Any:
    """The swizzled shared-memory layout of a ``(1, rows, dim)`` block (kept: Gluon works it out
    in ~50-150 µs of host time a call)."""
    return gl.NVMMASharedLayout.get_default_for([1, rows, dim], gl.bfloat16 if bf16 else gl.float16)


def _descriptor(x: Tensor, rows: int, bhse: bool) -> tuple[Any, tuple[int, int, int]]:
    """A 3-D TMA descriptor of ``x`` ``(B, H, length, E)`` with blocks of ``rows`` positions
    of one head, and how a (batch, head) finds its block: ``(per batch, per head, column per
    head)`` steps of the descriptor's first and last coordinates. ``bhse``: whether
    :func:`layout_of` finds ``x`` ``"bhse"`` (else ``"bshe"``; a plan works it out once)."""
    batch, heads, length, dim = x.shape
    s_b, s_h, s_l, _ = x.stride()
    layout = _shared_layout(rows, dim, x.dtype == torch.bfloat16)
    if bhse:
        shape, strides, steps = [batch * heads, length, dim], [s_h, s_l, 1], (heads, 1, 0)
    else:
        shape, strides, steps = [batch, length, heads * dim], [s_b, s_l, 1], (1, 0, dim)
    return TensorDescriptor(x, shape, strides, [1, rows, dim], layout), steps


def plan_gluon_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    band_lo: int | None,
    band_hi: int | None,
    scale: float,
    config: tuple[int, int] | None = None,
    *,
    softcap: float | None = None,
    slopes: Tensor | None = None,
    documents: tuple[Tensor, Tensor] | None = None,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The forward of calls like this one (the shapes, strides, dtypes and device of
    ``query``, ``key``, ``value``: the caller guarantees them, and 16-byte aligned data), worked
    out once: the returned function takes each call's tensors and returns
    ``(B, Hq, L, E)`` in the query's layout. Its first launch goes through Triton's JIT
    (compiling if needed); the later ones call the compiled kernel's launcher directly
    (:class:`~.launch.KeptLaunch`, ~40 µs less host time a call), which every argument but
    the descriptors' data pointers allows: they are fixed by the call's identity.

    ``query`` ``(B, Hq, L, E)``, ``key`` / ``value`` ``(B, Hkv, S, E)`` (fp16 or bf16, E in
    :data:`HEAD_DIMS`, laid out as :func:`layout_of` accepts, ``Hq`` a multiple of ``Hkv``);
    the band keeps ``band_lo <= j - i <= band_hi`` (``None``: open side), scores scaled by
    ``scale > 0``, then soft-capped at ``softcap`` (> 0), then ALiBi's ``slopes`` float32
    ``(1 | B, Hq)`` (kept by the plan: not written in place while it is used); ``documents``:
    the ids ``(q_doc (1 | B, L), kv_doc (1 | B, S))``, non-decreasing, read at each call
    (their ranges are recomputed where the ids changed in place). ``config``:
    ``(keys per block, stages)`` instead of :data:`CONFIGS`'s (for measuring). The caller has
    checked all of this (the ``gluon`` backend's reasons)."""
    batch, heads_q, length_q, dim = query.shape
    heads_kv, length_kv = key.shape[1], key.shape[2]
    block_n, stages = CONFIGS[dim] if config is None else config
    bhse = layout_of(query) == "bhse"  # the output's layout too
    kv_bhse = layout_of(key) == "bhse"  # the values' too (the backend checked)
    grid = (math.ceil(length_q / BLOCK_M), batch * heads_q, 1)
    _, q_steps = _descriptor(query, BLOCK_M // 2, bhse)
    _, k_steps = _descriptor(key, block_n, kv_bhse)
    # base-2 scores: s2 = qk * score_scale, or cap_out * tanh(qk * cap_in) under a soft-cap;
    # the softmax then takes exp2(s2 * qk_scale - max), qk_scale = 1 where a term comes first
    modified = softcap is not None or slopes is not None
    head = (
        1.0 if modified else scale * _LOG2E, length_q, length_kv, heads_q,
        heads_q // heads_kv, *q_steps, *k_steps, 0 if band_lo is None else band_lo,
        0 if band_hi is None else band_hi,
    )  # fmt: skip
    slope_steps = (0, 0) if slopes is None else (
        0 if slopes.shape[0] == 1 else slopes.stride(0), slopes.stride(1),
    )  # fmt: skip
    score_terms = (
        scale * _LOG2E, 0.0 if softcap is None else scale / softcap,
        0.0 if softcap is None else softcap * _LOG2E,
    )  # fmt: skip
    options = {
        "HAS_LO": band_lo is not None, "HAS_HI": band_hi is not None,
        "HAS_SOFTCAP": softcap is not None, "HAS_ALIBI": slopes is not None,
        "HAS_DOCS": documents is not None, "STAGES": stages, "num_warps": 4,
    }  # fmt: skip

    def ranges(query: Tensor) -> tuple[Tensor, Tensor, int]:
        if documents is None:
            return query, query, 0  # (pointers never read)
        found = _document_ranges(*documents, rows=True, cols=False)
        assert found.row_lo is not None and found.row_hi is not None
        return found.row_lo, found.row_hi, length_q if found.per_batch else 0

    constexprs = tuple(options.values())
    kept: dict[int, KeptLaunch] = {}  # per current device

    def run(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        if bhse:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        else:
            out = query.new_empty((batch, length_q, heads_q, dim)).transpose(1, 2)
        descriptors = (
            _descriptor(query, BLOCK_M // 2, bhse)[0], _descriptor(key, block_n, kv_bhse)[0],
            _descriptor(value, block_n, kv_bhse)[0], _descriptor(out, BLOCK_M // 2, bhse)[0],
        )  # fmt: skip
        # (the call's query stands for pointers the kernel does not read: the plan keeps no
        # tensor of the call it was made for)
        scalars = (
            *head, query if slopes is None else slopes, *slope_steps, *score_terms,
            *ranges(query),
        )  # fmt: skip
        device = current_device()
        launch = kept.get(device)
        if launch is not None:
            launch(grid, device, *descriptors, *scalars, *constexprs)
            return out
        compiled = _attention_forward[grid[:2]](*descriptors, *scalars, **options)
        if hasattr(compiled, "__getitem__"):  # a compiled kernel with its own launcher
            kept[device] = KeptLaunch(compiled)
        return out

    return run


def gluon_forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    band_lo: int | None,
    band_hi: int | None,
    scale: float,
    *,
    softcap: float | None = None,
    slopes: Tensor | None = None,
    documents: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """One call of :func:`plan_gluon_forward` (its arguments, but ``config``): attention
    ``(B, Hq, L, E)`` in the query's layout."""
    planned = plan_gluon_forward(
        query, key, value, band_lo, band_hi, scale, softcap=softcap, slopes=slopes,
        documents=documents,
    )  # fmt: skip
    return planned(query, key, value)


@gluon.jit
def _tanh_approx(x):
    return gl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.jit
def _scores(s, rows, n0, terms, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
            col_s: gl.constexpr):  # fmt: skip
    # Base-2 scores with the soft-cap and ALiBi (see plan_gluon_forward); ``terms`` is
    # (score_scale, cap_in, cap_out, alibi_coef, shift) with alibi_coef = -slope * log2(e)
    # and shift = S - L.
    score_scale, cap_in, cap_out, alibi_coef, shift = terms
    BLOCK: gl.constexpr = s.shape[1]
    if HAS_SOFTCAP:  # noqa: SIM108 (a branch per constexpr value)
        s = _tanh_approx(s * cap_in) * cap_out
    else:
        s = s * score_scale
    if HAS_ALIBI:
        cols = (n0 + gl.arange(0, BLOCK, col_s)).to(gl.float32)
        dist = gl.abs((rows + shift).to(gl.float32)[:, None] - cols[None, :])
        s = s + dist * alibi_coef
    return s


@gluon.jit
def _softmax_block(s, m_i, l_i, rows, n0, seq_k, band_lo, band_hi, qk_scale, terms, docs,
                   MASK: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
                   HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DOCS: gl.constexpr,
                   col_s: gl.constexpr, row_o: gl.constexpr, p_layout: gl.constexpr,
                   dtype: gl.constexpr):  # fmt: skip
    # One block's online softmax: the new row maxima and sums, the weights as the PV
    # MMA's register operand, the factor that rescales the accumulator. A row with no
    # kept key yet keeps its maximum at -inf and its weights at 0. Without score terms
    # ``s`` stays raw dot products (scaled in the exponent); with them it becomes base-2
    # scores and ``qk_scale`` is 1.
    BLOCK: gl.constexpr = s.shape[1]
    if HAS_SOFTCAP or HAS_ALIBI:
        s = _scores(s, rows, n0, terms, HAS_SOFTCAP, HAS_ALIBI, col_s)
    if MASK:
        cols = n0 + gl.arange(0, BLOCK, col_s)
        keep = cols[None, :] < seq_k
        if HAS_LO:
            keep = keep & (cols[None, :] - rows[:, None] >= band_lo)
        if HAS_HI:
            keep = keep & (cols[None, :] - rows[:, None] <= band_hi)
        if HAS_DOCS:
            row_lo, row_hi, _, _ = docs
            keep = keep & (cols[None, :] >= row_lo[:, None]) & (cols[None, :] < row_hi[:, None])
        s = gl.where(keep, s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p16 = gl.convert_layout(p.to(dtype), p_layout)
    return m_new, l_i, p16, gl.convert_layout(alpha, row_o)


@gluon.jit
def _block_is_full(n0, first, seq_k, band_lo, band_hi, docs, ROWS: gl.constexpr,
                  BLOCK: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
                  HAS_DOCS: gl.constexpr):  # fmt: skip
    # Whether every pair of rows [first, first + ROWS) and keys [n0, n0 + BLOCK) is kept.
    full = n0 + BLOCK <= seq_k
    if HAS_LO:
        full = full & (n0 - (first + ROWS - 1) >= band_lo)
    if HAS_HI:
        full = full & (n0 + BLOCK - 1 - first <= band_hi)
    if HAS_DOCS:  # the largest first key and the smallest end of the rows' documents
        _, _, full_lo, full_hi = docs
        full = full & (n0 >= full_lo) & (n0 + BLOCK <= full_hi)
    return full


@gluon.jit
def _softmax(s, m_i, l_i, rows, n0, first, seq_k, band_lo, band_hi, qk_scale, terms, docs,
             ROWS: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
             HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DOCS: gl.constexpr,
             col_s: gl.constexpr, row_o: gl.constexpr, p_layout: gl.constexpr,
             dtype: gl.constexpr):  # fmt: skip
    # The softmax of the block of keys from n0, masked only where the band or the end of the
    # keys cuts it for rows [first, first + ROWS).
    BLOCK: gl.constexpr = s.shape[1]
    if _block_is_full(n0, first, seq_k, band_lo, band_hi, docs, ROWS, BLOCK, HAS_LO, HAS_HI,
                      HAS_DOCS):  # fmt: skip
        m_i, l_i, p16, alpha = _softmax_block(s, m_i, l_i, rows, n0, seq_k, band_lo, band_hi,
                                              qk_scale, terms, docs, False, HAS_LO, HAS_HI,
                                              HAS_SOFTCAP, HAS_ALIBI, HAS_DOCS, col_s, row_o,
                                              p_layout, dtype)  # fmt: skip
    else:
        m_i, l_i, p16, alpha = _softmax_block(s, m_i, l_i, rows, n0, seq_k, band_lo, band_hi,
                                              qk_scale, terms, docs, True, HAS_LO, HAS_HI,
                                              HAS_SOFTCAP, HAS_ALIBI, HAS_DOCS, col_s, row_o,
                                              p_layout, dtype)  # fmt: skip
    return m_i, l_i, p16, alpha


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, q_p,
             q_c, kv_p, kv_c, off_m, first_block, blocks,
             STAGES: gl.constexpr):  # fmt: skip
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK: gl.constexpr = k_desc.block_type.shape[1]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_p, off_m, q_c], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_p, off_m + ROWS, q_c], q_bar,
                                    q_smem.index(1))  # fmt: skip
    for j in range(blocks):
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1, pred=j >= STAGES)
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        n0 = (first_block + j) * BLOCK
        tma.async_copy_global_to_shared(k_desc, [kv_p, n0, kv_c], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [kv_p, n0, kv_c], bar, v_smem.index(stage))


@gluon.jit
def _consumer(o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turns, q_p, q_c, off_m,
             first_block, blocks, seq_k, band_lo, band_hi, qk_scale, score_scale, cap_in,
             cap_out, alibi_coef, shift, row_lo, row_hi, doc_base, seq_q,
             WHICH: gl.constexpr, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
             HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DOCS: gl.constexpr,
             STAGES: gl.constexpr):  # fmt: skip
    ROWS: gl.constexpr = o_desc.block_type.shape[1]
    E: gl.constexpr = o_desc.block_type.shape[2]
    BLOCK: gl.constexpr = k_smem.type.shape[2]
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, E, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                 k_width=2)  # fmt: skip
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    first = off_m + WHICH * ROWS
    rows = first + gl.arange(0, ROWS, row_s)
    terms = (score_scale, cap_in, cap_out, alibi_coef, shift)
    if HAS_DOCS:
        # each row's document's keys; rows past L keep none (their output is not stored)
        valid = rows < seq_q
        docs = (
            gl.load(row_lo + doc_base + rows, mask=valid, other=0),
            gl.load(row_hi + doc_base + rows, mask=valid, other=0),
            gl.load(row_lo + doc_base + gl.minimum(first + ROWS, seq_q) - 1),
            gl.load(row_hi + doc_base + gl.minimum(first, seq_q - 1)),
        )
    else:
        docs = (0, 0, 0, 0)
    q = q_smem.index(WHICH).reshape([ROWS, E])
    my_turn = turns.index(WHICH)
    their_turn = turns.index(1 - WHICH)
    m_i = gl.full([ROWS], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([ROWS], gl.float32, row_s)
    acc = gl.zeros([ROWS, E], gl.float32, o_layout)
    zero = gl.zeros([ROWS, BLOCK], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)

    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(my_turn, 0)
    k0 = k_smem.index(0).reshape([BLOCK, E]).permute((1, 0))
    s = warpgroup_mma(q, k0, zero, use_acc=False, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    m_i, l_i, p16, alpha = _softmax(s, m_i, l_i, rows, first_block * BLOCK, first, seq_k,
                                    band_lo, band_hi, qk_scale, terms, docs, ROWS, HAS_LO,
                                    HAS_HI, HAS_SOFTCAP, HAS_ALIBI, HAS_DOCS, col_s, row_o,
                                    p_layout, dtype)  # fmt: skip
    for j in range(1, blocks):
        stage = j % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        mbarrier.wait(my_turn, j & 1)
        kt = k_smem.index(stage).reshape([BLOCK, E]).permute((1, 0))
        s = warpgroup_mma(q, kt, zero, use_acc=False, is_async=True)
        acc = acc * alpha[:, None]
        v = v_smem.index((j - 1) % STAGES).reshape([BLOCK, E])
        acc = warpgroup_mma(p16, v, acc, is_async=True)
        mbarrier.arrive(their_turn, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        m_i, l_i, p16, alpha = _softmax(s, m_i, l_i, rows, (first_block + j) * BLOCK, first,
                                        seq_k, band_lo, band_hi, qk_scale, terms, docs, ROWS,
                                        HAS_LO, HAS_HI, HAS_SOFTCAP, HAS_ALIBI, HAS_DOCS, col_s,
                                        row_o, p_layout, dtype)  # fmt: skip
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
    last = (blocks - 1) % STAGES
    mbarrier.wait(my_turn, blocks & 1)
    acc = acc * alpha[:, None]
    acc = warpgroup_mma(p16, v_smem.index(last).reshape([BLOCK, E]), acc, is_async=True)
    mbarrier.arrive(their_turn, count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(last), count=1)
    total = gl.convert_layout(l_i, row_o)
    acc = acc / gl.where(total == 0.0, 1.0, total)[:, None]  # no kept key: 0
    q.store(acc.to(dtype))  # this warpgroup's queries are no longer read
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_p, first, q_c], q_smem.index(WHICH))
    tma.store_wait(pendings=0)


@gluon.jit
def _attention_forward(q_desc, k_desc, v_desc, o_desc, qk_scale, seq_q, seq_k, heads_q,
                      group, q_pb, q_ph, q_ch, kv_pb, kv_ph, kv_ch, band_lo, band_hi,
                      slopes, slope_b, slope_h, score_scale, cap_in, cap_out, row_lo, row_hi,
                      doc_b, HAS_LO: gl.constexpr, HAS_HI: gl.constexpr,
                      HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DOCS: gl.constexpr,
                      STAGES: gl.constexpr,
                      num_warps: gl.constexpr):  # fmt: skip
    ROWS: gl.constexpr = q_desc.block_type.shape[1]
    E: gl.constexpr = q_desc.block_type.shape[2]
    BLOCK: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    pid_m = gl.num_programs(0) - 1 - gl.program_id(0)  # later rows first: more keys
    batch = gl.program_id(1) // heads_q
    head = gl.program_id(1) % heads_q
    head_kv = head // group
    q_p = batch * q_pb + head * q_ph
    q_c = head * q_ch
    kv_p = batch * kv_pb + head_kv * kv_ph
    kv_c = head_kv * kv_ch
    if HAS_ALIBI:
        alibi_coef = -gl.load(slopes + batch * slope_b + head * slope_h) * 1.4426950408889634
    else:
        alibi_coef = 0.0
    off_m = pid_m * 2 * ROWS
    # the band's blocks for rows [off_m, last row]; at least one (a row keeping no key
    # runs it masked and gives 0)
    last_row = gl.minimum(off_m + 2 * ROWS, seq_q) - 1
    key_lo = gl.maximum(off_m + band_lo, 0) if HAS_LO else 0
    key_hi = gl.minimum(last_row + band_hi + 1, seq_k) if HAS_HI else seq_k
    doc_base = batch * doc_b
    if HAS_DOCS:  # the documents of the first and the last row bound the keys too
        key_lo = gl.maximum(key_lo, gl.load(row_lo + doc_base + off_m))
        key_hi = gl.minimum(key_hi, gl.load(row_hi + doc_base + last_row))
    key_blocks = (seq_k + BLOCK - 1) // BLOCK
    first_block = gl.minimum(key_lo // BLOCK, key_blocks - 1)
    blocks = gl.maximum((key_hi + BLOCK - 1) // BLOCK - first_block, 1)

    q_smem = gl.allocate_shared_memory(dtype, [2, 1, ROWS, E], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK, E], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, BLOCK, E], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    mbarrier.arrive(turns.index(0), count=1)  # the first warpgroup issues first
    gl.warp_specialize(
        [
            (_consumer, (o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turns, q_p,
                        q_c, off_m, first_block, blocks, seq_k, band_lo, band_hi,
                        qk_scale, score_scale, cap_in, cap_out, alibi_coef, seq_k - seq_q,
                        row_lo, row_hi, doc_base, seq_q, 0, HAS_LO, HAS_HI, HAS_SOFTCAP,
                        HAS_ALIBI, HAS_DOCS, STAGES)),
            (_consumer, (o_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, turns, q_p,
                        q_c, off_m, first_block, blocks, seq_k, band_lo, band_hi,
                        qk_scale, score_scale, cap_in, cap_out, alibi_coef, seq_k - seq_q,
                        row_lo, row_hi, doc_base, seq_q, 1, HAS_LO, HAS_HI, HAS_SOFTCAP,
                        HAS_ALIBI, HAS_DOCS, STAGES)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready,
                        empty, q_p, q_c, kv_p, kv_c, off_m, first_block, blocks, STAGES)),
        ],
        [4, 1],
        [232, 24],
    )  # fmt: skip

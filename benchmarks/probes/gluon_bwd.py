"""A first Hopper backward in Gluon: the dK/dV and dQ kernels of causal (and unmasked)
attention, written with warpgroup MMAs, TMA loads into two shared-memory stages and mbarriers,
to be measured against FlashAttention 4's backward, stock SDPA's and this library's Triton
kernels in the same process (issue 43's next step after the forward).

Two kernels, eight warps (two warpgroups) each, no warp specialization yet:

* ``attn_bwd_dkdv``: one program per 128 keys of one (batch, head). Its keys and values arrive
  once by TMA; blocks of 64 query rows and their output gradients stream through two stages,
  the next block loaded while this one is worked on. Per block, on transposed tiles
  ``[keys, rows]``: ``S^T = K Q^T``, ``P^T = exp2(S^T * scale * log2(e) - lse2)``, ``dV += P^T
  dO``, ``dP^T = V dO^T``, ``dS^T = P^T (dP^T - delta)``, ``dK += dS^T Q`` (``P^T`` and ``dS^T``
  from registers). Causal: the query blocks before the keys' first row are skipped, the
  diagonal's pairs masked.
* ``attn_bwd_dq``: one program per 128 query rows; blocks of 64 keys and values stream through
  two stages: ``S = Q K^T``, ``P``, ``dP = dO V^T``, ``dS = P (dP - delta)``, ``dQ += dS K``.

``lse2`` is the forward's log-sum-exp in base 2 and ``delta`` the rows' ``sum(dO * O)``, both
made by the host here (torch). The probe takes ``(B, H, S, E)`` bf16 contiguous tensors with S
a multiple of 128 and E = 128.

Run on a Hopper GPU: ``python benchmarks/probes/gluon_bwd.py`` checks both kernels against
fp32 autograd on small shapes, then times the backward alone (B = 4, S = 4096 and B = 1, S =
16384, H = 16) against the peers; run it under a timeout (a wrong barrier hangs). Without a
GPU, ``--compile-only`` compiles both kernels for sm_90a and prints registers and spills.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
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

LOG2E = 1.4426950408889634
KEYS_DKDV, ROWS_DKDV = 128, 64  # the dK/dV program's keys, the rows of a streamed block
ROWS_DQ, KEYS_DQ = 128, 64  # the dQ program's rows, the keys of a streamed block


@gluon.jit
def _load_pair(a_desc, b_desc, a_smem, b_smem, bars, index, row, STAGES: gl.constexpr):
    # block ``index`` of two tensors (rows ``row``..) into stage ``index % STAGES``
    stage = index % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row, 0], bar, a_smem.index(stage))
    tma.async_copy_global_to_shared(b_desc, [row, 0], bar, b_smem.index(stage))


@gluon.jit
def attn_bwd_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse2, delta, qk_scale,
                  scale, seq_len, CAUSAL: gl.constexpr,
                  num_warps: gl.constexpr):  # fmt: skip
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    E: gl.constexpr = k_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, E, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_st: gl.constexpr = gl.SliceLayout(1, st_layout)
    row_st: gl.constexpr = gl.SliceLayout(0, st_layout)

    bh = gl.program_id(1)
    row0 = bh * seq_len
    off_n = gl.program_id(0) * BLOCK_N
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, E], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, E], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, E], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, E], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + off_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row0 + off_n, 0], kv_bar, v_smem)
    first = off_n // BLOCK_M if CAUSAL else 0  # rows before the keys' first keep none
    blocks = seq_len // BLOCK_M - first
    _load_pair(q_desc, do_desc, q_smem, do_smem, bars, 0, row0 + first * BLOCK_M, 2)

    dk = gl.zeros([BLOCK_N, E], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, E], gl.float32, acc_layout)
    zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    offs_n = off_n + gl.arange(0, BLOCK_N, key_st)
    mbarrier.wait(kv_bar, 0)
    for j in range(blocks):
        if j + 1 < blocks:  # its stage held block j - 1, whose MMAs have all finished
            next_row = row0 + (first + j + 1) * BLOCK_M
            _load_pair(q_desc, do_desc, q_smem, do_smem, bars, j + 1, next_row, 2)
        stage = j % 2
        mbarrier.wait(bars.index(stage), (j // 2) & 1)
        q = q_smem.index(stage)
        do = do_smem.index(stage)
        st = warpgroup_mma(k_smem, q.permute((1, 0)), zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_smem, do.permute((1, 0)), zero, use_acc=False, is_async=True)
        offs_m = (first + j) * BLOCK_M + gl.arange(0, BLOCK_M, row_st)
        row_lse = gl.load(lse2 + row0 + offs_m)
        row_delta = gl.load(delta + row0 + offs_m)
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st,))
        pt = gl.exp2(st * qk_scale - row_lse[None, :])
        if CAUSAL:
            pt = gl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        pt16 = gl.convert_layout(pt.to(dtype), a_layout)
        dv = warpgroup_mma(pt16, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt,))
        dst = pt * (dpt - row_delta[None, :])
        dst16 = gl.convert_layout(dst.to(dtype), a_layout)
        dk = warpgroup_mma(dst16, q, dk, is_async=True)
        dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))

    mbarrier.invalidate(kv_bar)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))
    k_smem.store((dk * scale).to(dtype))  # keys and values are no longer read
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [row0 + off_n, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [row0 + off_n, 0], v_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def attn_bwd_dq(q_desc, k_desc, v_desc, do_desc, dq_desc, lse2, delta, qk_scale, scale,
                seq_len, CAUSAL: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    E: gl.constexpr = q_desc.block_type.shape[1]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, E, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    key_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    bh = gl.program_id(1)
    row0 = bh * seq_len
    blocks_m = gl.num_programs(0)
    off_m = (blocks_m - 1 - gl.program_id(0)) * BLOCK_M  # heaviest causal rows first
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, E], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, E], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, E], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, E], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + off_m, 0], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [row0 + off_m, 0], q_bar, do_smem)
    blocks = (off_m + BLOCK_M) // BLOCK_N if CAUSAL else seq_len // BLOCK_N
    _load_pair(k_desc, v_desc, k_smem, v_smem, bars, 0, row0, 2)

    offs_m = off_m + gl.arange(0, BLOCK_M, row_s)
    row_lse = gl.load(lse2 + row0 + offs_m)
    row_delta = gl.load(delta + row0 + offs_m)
    dq = gl.zeros([BLOCK_M, E], gl.float32, acc_layout)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(blocks):
        if j + 1 < blocks:
            _load_pair(k_desc, v_desc, k_smem, v_smem, bars, j + 1, row0 + (j + 1) * BLOCK_N, 2)
        stage = j % 2
        mbarrier.wait(bars.index(stage), (j // 2) & 1)
        k = k_smem.index(stage)
        s = warpgroup_mma(q_smem, k.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_smem, v_smem.index(stage).permute((1, 0)), zero, use_acc=False,
                           is_async=True)  # fmt: skip
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p = gl.exp2(s * qk_scale - row_lse[:, None])
        if CAUSAL:
            offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, key_s)
            p = gl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds16 = gl.convert_layout((p * (dp - row_delta[:, None])).to(dtype), a_layout)
        dq = warpgroup_mma(ds16, k, dq, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))

    mbarrier.invalidate(q_bar)
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))
    q_smem.store((dq * scale).to(dtype))  # the queries are no longer read
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [row0 + off_m, 0], q_smem)
    tma.store_wait(pendings=0)


def _descriptor(x: torch.Tensor, rows: int) -> Any:
    """A TMA descriptor of a ``(B, H, S, E)`` contiguous tensor seen as ``(B * H * S, E)``
    rows, in blocks of ``rows``."""
    flat = x.reshape(-1, x.shape[-1])
    layout = gl.NVMMASharedLayout.get_default_for([rows, x.shape[-1]], gl.bfloat16)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, x.shape[-1]],
                            layout)  # fmt: skip


def gluon_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of attention ``(B, H, S, E)`` bf16 contiguous (S a multiple of 128,
    E = 128), given the forward's output and natural log-sum-exp ``(B, H, S)`` float32."""
    batch, heads, length, dim = q.shape
    assert length % 128 == 0 and dim == 128 and q.dtype == torch.bfloat16
    scale = 1 / math.sqrt(dim)
    lse2 = (lse * LOG2E).contiguous()
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()
    grad_out = grad_out.contiguous()
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    grid = (length // KEYS_DKDV, batch * heads)
    attn_bwd_dkdv[grid](
        _descriptor(q, ROWS_DKDV), _descriptor(k, KEYS_DKDV), _descriptor(v, KEYS_DKDV),
        _descriptor(grad_out, ROWS_DKDV), _descriptor(dk, KEYS_DKDV),
        _descriptor(dv, KEYS_DKDV), lse2, delta, scale * LOG2E, scale, length, causal,
        num_warps=8,
    )  # fmt: skip
    grid = (length // ROWS_DQ, batch * heads)
    attn_bwd_dq[grid](
        _descriptor(q, ROWS_DQ), _descriptor(k, KEYS_DQ), _descriptor(v, KEYS_DQ),
        _descriptor(grad_out, ROWS_DQ), _descriptor(dq, ROWS_DQ), lse2, delta,
        scale * LOG2E, scale, length, causal, num_warps=8,
    )  # fmt: skip
    return dq, dk, dv


def _forward_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output (bf16) and natural log-sum-exp (float32) the backward starts from, in fp32."""
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v.float()
    return out.to(q.dtype), lse


def check() -> bool:
    """Both kernels against fp32 autograd of the same attention on small shapes."""
    ok = True
    torch.manual_seed(0)
    for batch, heads, length in ((1, 2, 256), (2, 3, 512)):
        q, k, v, grad_out = (
            torch.randn(batch, heads, length, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(4)
        )
        for causal in (True, False):
            leaves = [x.float().requires_grad_() for x in (q, k, v)]
            ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            want = torch.autograd.grad(ref, leaves, grad_out.float())
            out, lse = _forward_with_lse(q, k, v, causal)
            got = gluon_backward(q, k, v, out, grad_out, lse, causal)
            torch.cuda.synchronize()
            for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
                rounding = (w.bfloat16().float() - w).abs().max().item()
                err = (g.float() - w).abs().max().item()
                scale = w.abs().max().item()
                good = err <= 8 * rounding + 2e-2 * scale
                ok &= good
                print(f"check B={batch} H={heads} S={length} causal={causal} {name}: err "
                      f"{err:.2e} (bf16 rounding {rounding:.2e}, max {scale:.2e}) "
                      f"{'ok' if good else 'WRONG'}", flush=True)  # fmt: skip
    return ok


def _contenders(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, causal: bool
) -> dict[str, Callable[[], Any]]:
    """The backward of each contender over a forward kept for it: this probe's kernels (from
    the Triton forward's output and log-sum-exp), stock SDPA's, the Triton kernels' and
    FlashAttention 4's (where installed), each as ``torch.autograd.grad``."""
    import attnbias
    from attnbias.kernels import attention_forward
    from attnbias.spec import make_spec

    mask = attnbias.causal_upper_left() if causal else attnbias.SlidingWindowBias(None, None)
    spec = make_spec(q, k, v, mask, False, None, 0.0, False)
    out, lse = attention_forward(q, k, v, spec.program, scale=spec.resolved_scale)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    stock = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    with attnbias.use_backends("triton"):
        ours = attnbias.sdpa(*leaves, attn_mask=mask)
    calls: dict[str, Callable[[], Any]] = {
        "gluon": lambda: gluon_backward(q, k, v, out, grad_out, lse, causal),
        "stock sdpa": lambda: torch.autograd.grad(stock, leaves, grad_out, retain_graph=True),
        "attnbias triton": lambda: torch.autograd.grad(ours, leaves, grad_out, retain_graph=True),
    }
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return calls
    t_leaves = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
    found = flash_attn_func(*t_leaves, causal=causal)
    fa4_out = found[0] if isinstance(found, tuple) else found
    t_grad = grad_out.transpose(1, 2)
    calls["fa4"] = lambda: torch.autograd.grad(fa4_out, t_leaves, t_grad, retain_graph=True)
    return calls


def bench() -> None:
    """The backward alone (B = 4, S = 4096 and B = 1, S = 16384; H = 16, E = 128, bf16)
    against FlashAttention 4's (where installed), stock SDPA's and the Triton kernels'
    (``do_bench`` medians, two rounds in alternating order)."""
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; bf16, H=16, E=128, backward alone")  # fmt: skip
    print("| B | S | causal | kernel | ms | TFLOP/s |")
    print("|--:|--:|---|---|--:|--:|")
    for batch, length in ((4, 4096), (1, 16384)):
        q, k, v, grad_out = (
            torch.randn(batch, 16, length, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(4)
        )
        for causal in (True, False):
            calls = _contenders(q, k, v, grad_out, causal)
            times: dict[str, list[float]] = {name: [] for name in calls}
            for round_index in range(2):
                order = list(calls) if round_index == 0 else list(calls)[::-1]
                for name in order:
                    times[name].append(do_bench(calls[name], warmup=25, rep=200))
            # the backward's five matrix products of 2 * E flops per kept pair
            flops = 2.5 * 4 * batch * 16 * length * length * 128 * (0.5 if causal else 1.0)
            for name, found_times in times.items():
                ms = sum(found_times) / len(found_times)
                print(f"| {batch} | {length} | {causal} | {name} | {ms:.3f} | "
                      f"{flops / ms / 1e9:.0f} |", flush=True)  # fmt: skip


def compile_only() -> None:
    """Both kernels compiled for sm_90a without a GPU: registers and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.empty(1, 1, 256, 128, dtype=torch.bfloat16)
    kernels = {
        "dkdv": (attn_bwd_dkdv, [ROWS_DKDV, KEYS_DKDV, KEYS_DKDV, ROWS_DKDV, KEYS_DKDV,
                                 KEYS_DKDV], ["q_desc", "k_desc", "v_desc", "do_desc",
                                              "dk_desc", "dv_desc"]),
        "dq": (attn_bwd_dq, [ROWS_DQ, KEYS_DQ, KEYS_DQ, ROWS_DQ, ROWS_DQ],
               ["q_desc", "k_desc", "v_desc", "do_desc", "dq_desc"]),
    }  # fmt: skip
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name, (kernel, rows, names) in kernels.items():
        signature: dict[str, Any] = {
            n: mangle_type(_descriptor(x, r)) for n, r in zip(names, rows, strict=True)
        }
        signature.update(lse2="*fp32", delta="*fp32", qk_scale="fp32", scale="fp32",
                         seq_len="i32", CAUSAL="constexpr", num_warps="constexpr")  # fmt: skip
        for causal in (True, False):
            source = GluonASTSource(kernel, signature, {"CAUSAL": causal, "num_warps": 8})
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": 8})  # fmt: skip
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                command = [tools / "cuobjdump", "-res-usage", f.name]
                usage = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            line = [u for u in usage.splitlines() if "REG" in u]
            print(f"{name} causal={causal}: shared {compiled.metadata.shared} B; "
                  f"{line[0].strip() if line else usage}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    if check():
        bench()


if __name__ == "__main__":
    main()

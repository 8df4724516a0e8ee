"""Go / no-go for a Hopper forward in Gluon: a causal (and unmasked) attention forward written
with warpgroup MMA, TMA loads into a ring of shared-memory stages and mbarriers, against
FlashAttention 4's forward, stock SDPA and this library's Triton kernel in the same process.

Two kernels, each one program per 128 query rows of one (batch, head):

* ``attn_fwd``: two warpgroups in one partition (64 rows each); Q arrives once by TMA; keys
  and values stream through ``STAGES`` shared-memory stages, loaded by TMA ``STAGES - 1``
  blocks ahead by the same warps, each stage tracked by an mbarrier. ``S = Q K^T`` and
  ``O += P V`` are warpgroup MMAs (``P`` from registers); the online softmax runs in registers
  in base 2. ``OVERLAP`` issues the next block's scores MMA before this block's softmax.
* the library's kernel (``attnbias/kernels/gluon_forward.py``), warp-specialized as
  FlashAttention 3 is: a producer warp issues every TMA load (a stage is reused once both
  consumers released it), two consumer warpgroups of 64 rows each issue block ``j``'s scores
  MMA and block ``j - 1``'s PV MMA back to back, then run block ``j``'s softmax while both MMAs
  run, taking turns to issue their MMAs (one mbarrier each), so that one's softmax runs while
  the other's MMAs do; three stages. Its first version here, at e103f28, also ran without the
  turns and with two stages (benchmarks/RESULTS.md, "A Hopper forward in Gluon").

Causal: blocks past the diagonal are skipped, the diagonal block masked; the heaviest query
blocks are launched first. ``attn_fwd`` takes S a multiple of 128 (a probe's kernel).

Run on a Hopper GPU (bf16, H=16, E=128): ``python benchmarks/probes/gluon_fwd.py``;
``--ws-check`` checks the warp-specialized kernel alone (run it under a timeout: a wrong
barrier hangs); ``--library`` times ``attnbias.sdpa`` pinned to each backend. Without a GPU,
``--compile-only`` compiles ``attn_fwd`` for sm_90a and prints registers, spills and shared
memory.
"""

from __future__ import annotations

import argparse
import functools
import math
import subprocess
import sys
import tempfile
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

from attnbias.kernels.gluon_forward import gluon_forward

LOG2E = 1.4426950408889634
# (overlap, stages, block_n) timed against the peers
VARIANTS = ((False, 2, 128), (False, 3, 128), (False, 2, 64))


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, bars, block, row0, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr):  # fmt: skip
    stage = block % STAGES
    bar = bars.index(stage)
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + block * BLOCK_N, 0], bar, k_smem.index(stage))
    tma.async_copy_global_to_shared(v_desc, [row0 + block * BLOCK_N, 0], bar, v_smem.index(stage))


@gluon.jit
def _scores(q_smem, k_smem, bars, block, s_layout: gl.constexpr, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    stage = block % STAGES
    mbarrier.wait(bars.index(stage), (block // STAGES) & 1)
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    # [BLOCK_M, E] @ [E, BLOCK_N]: the key tile's transposed view
    return warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), zero, use_acc=False,
                         is_async=True)  # fmt: skip


@gluon.jit
def _softmax(s, m_i, l_i, offs_m, block, off_m, qk_scale, CAUSAL: gl.constexpr,
             BLOCK_N: gl.constexpr, col_s: gl.constexpr, row_o: gl.constexpr,
             p_layout: gl.constexpr):  # fmt: skip
    """The online softmax of one block of scores: the new row maxima and sums, the weights
    as the PV MMA's register operand, and the factor that rescales the accumulator."""
    if CAUSAL and (block + 1) * BLOCK_N > off_m:  # the diagonal block
        offs_n = block * BLOCK_N + gl.arange(0, BLOCK_N, col_s)
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    return m_new, l_i, p16, gl.convert_layout(alpha, row_o)


@gluon.jit
def attn_fwd(
    q_desc,
    k_desc,
    v_desc,
    o_desc,
    qk_scale,
    seq_len,
    CAUSAL: gl.constexpr,
    OVERLAP: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    blocks_m = gl.num_programs(0)
    pid_m = blocks_m - 1 - gl.program_id(0)  # heaviest causal rows first
    row0 = gl.program_id(1) * seq_len
    off_m = pid_m * BLOCK_M

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + off_m, 0], q_bar, q_smem)

    blocks = (off_m + BLOCK_M) // BLOCK_N if CAUSAL else seq_len // BLOCK_N
    for i in gl.static_range(STAGES - 1):
        if i < blocks:
            _load_kv(k_desc, v_desc, k_smem, v_smem, bars, i, row0, BLOCK_N, STAGES)

    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    offs_m = off_m + gl.arange(0, BLOCK_M, row_s)
    mbarrier.wait(q_bar, 0)

    if OVERLAP:
        s = _scores(q_smem, k_smem, bars, 0, s_layout, BLOCK_M, BLOCK_N, STAGES)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        for j in range(blocks - 1):
            ahead = j + STAGES - 1
            if ahead < blocks:  # its stage held block j - 1, whose MMAs have finished
                _load_kv(k_desc, v_desc, k_smem, v_smem, bars, ahead, row0, BLOCK_N, STAGES)
            # the tensor cores work on the next block's scores during this block's softmax
            s_next = _scores(q_smem, k_smem, bars, j + 1, s_layout, BLOCK_M, BLOCK_N, STAGES)
            m_i, l_i, p16, alpha = _softmax(s, m_i, l_i, offs_m, j, off_m, qk_scale, CAUSAL,
                                            BLOCK_N, col_s, row_o, p_layout)  # fmt: skip
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(p16, v_smem.index(j % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        last = blocks - 1
        m_i, l_i, p16, alpha = _softmax(s, m_i, l_i, offs_m, last, off_m, qk_scale, CAUSAL,
                                        BLOCK_N, col_s, row_o, p_layout)  # fmt: skip
        acc = acc * alpha[:, None]
        acc = warpgroup_mma(p16, v_smem.index(last % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        for j in range(blocks):
            ahead = j + STAGES - 1
            if ahead < blocks:
                _load_kv(k_desc, v_desc, k_smem, v_smem, bars, ahead, row0, BLOCK_N, STAGES)
            s = _scores(q_smem, k_smem, bars, j, s_layout, BLOCK_M, BLOCK_N, STAGES)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_i, l_i, p16, alpha = _softmax(s, m_i, l_i, offs_m, j, off_m, qk_scale, CAUSAL,
                                            BLOCK_N, col_s, row_o, p_layout)  # fmt: skip
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(p16, v_smem.index(j % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(q_bar)
    acc = acc / gl.convert_layout(l_i, row_o)[:, None]
    q_smem.store(acc.to(dtype))  # Q is no longer read: its buffer stages the output
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [row0 + off_m, 0], q_smem)
    tma.store_wait(pendings=0)


def descriptors(q: Any, k: Any, v: Any, o: Any, block_m: int, block_n: int) -> list[Any]:
    """TMA descriptors of ``(B, H, S, E)`` tensors seen as ``(B * H * S, E)`` rows."""
    found = []
    for x, rows in ((q, block_m), (k, block_n), (v, block_n), (o, block_m)):
        flat = x.reshape(-1, x.shape[-1])
        layout = gl.NVMMASharedLayout.get_default_for([rows, x.shape[-1]], gl.bfloat16)
        found.append(TensorDescriptor(flat, list(flat.shape), list(flat.stride()),
                                      [rows, x.shape[-1]], layout))  # fmt: skip
    return found


def gluon_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    overlap: bool = True,
    stages: int = 2,
    block_m: int = 128,
    block_n: int = 128,
) -> torch.Tensor:
    """``(B, H, S, E)`` bf16 contiguous, S a multiple of the blocks."""
    batch, heads, length, dim = q.shape
    assert length % block_m == 0 and length % block_n == 0 and block_m % block_n == 0
    o = torch.empty_like(q)
    grid = (length // block_m, batch * heads)
    attn_fwd[grid](
        *descriptors(q, k, v, o, block_m, block_n), LOG2E / math.sqrt(dim), length,
        causal, overlap, stages, num_warps=8,
    )  # fmt: skip
    return o


def compile_only(args: argparse.Namespace) -> None:
    """Compile for sm_90a without a GPU; print registers, spills and shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    q = torch.empty(1, 1, 256, 128, dtype=torch.bfloat16)
    descs = descriptors(q, q, q, q, 128, 128)
    names = ["q_desc", "k_desc", "v_desc", "o_desc"]
    signature: dict[str, Any] = {n: mangle_type(d) for n, d in zip(names, descs, strict=True)}
    signature.update(qk_scale="fp32", seq_len="i32", CAUSAL="constexpr", OVERLAP="constexpr",
                     STAGES="constexpr", num_warps="constexpr")  # fmt: skip
    for causal in (True, False):
        for overlap in (False, True):
            constexprs = {"CAUSAL": causal, "OVERLAP": overlap, "STAGES": args.stages,
                          "num_warps": 8}  # fmt: skip
            source = GluonASTSource(attn_fwd, signature, constexprs)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": 8})  # fmt: skip
            tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(compiled.asm["cubin"])
                f.flush()
                command = [tools / "cuobjdump", "-res-usage", f.name]
                usage = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            line = [x for x in usage.splitlines() if "REG" in x]
            print(f"causal={causal} overlap={overlap} stages={args.stages}: "
                  f"{line[0].strip() if line else usage}")  # fmt: skip


def tflops(batch: int, heads: int, length: int, dim: int, causal: bool, ms: float) -> float:
    flops = 4 * batch * heads * length * length * dim * (0.5 if causal else 1.0)
    return flops / ms / 1e9


def kernels(q: Any, k: Any, v: Any, causal: bool, ws_only: bool = False) -> dict[str, Any]:
    """The Gluon variants as named calls."""
    found: dict[str, Any] = {}
    if not ws_only:
        for overlap, stages, block_n in VARIANTS:
            name = f"gluon {'overlap' if overlap else 'in turn'} stages={stages} N={block_n}"
            found[name] = functools.partial(gluon_sdpa, q, k, v, causal, overlap, stages, 128,
                                             block_n)  # fmt: skip
    scale = 1 / math.sqrt(q.shape[-1])
    found["gluon warp-specialized ping-pong stages=3 (the library's)"] = functools.partial(
        gluon_forward, q, k, v, None, 0 if causal else None, scale
    )
    return found


def check(ws_only: bool) -> set[str]:
    """Each variant against fp32 SDPA on small and odd shapes; the names that failed."""
    failed: set[str] = set()
    torch.manual_seed(0)
    for batch, heads, length in ((1, 2, 256), (2, 3, 1024)):
        q, k, v = (torch.randn(batch, heads, length, 128, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))  # fmt: skip
        for causal in (True, False):
            want = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), is_causal=causal
            )
            bf16 = (want.bfloat16().float() - want).abs().max().item()
            for name, call in kernels(q, k, v, causal, ws_only).items():
                try:
                    got = call().float()
                    torch.cuda.synchronize()
                except Exception as error:  # a variant that does not compile: report it
                    print(f"{name} failed: {error!r:.300}", flush=True)
                    failed.add(name)
                    continue
                err = (got - want).abs().max().item()
                status = "ok" if err <= 4 * bf16 + 1e-3 else "WRONG"
                if status != "ok":
                    failed.add(name)
                print(f"check B={batch} H={heads} S={length} causal={causal} {name}: err "
                      f"{err:.2e} (bf16 rounding {bf16:.2e}) {status}", flush=True)  # fmt: skip
    return failed


def bench(args: argparse.Namespace) -> None:
    from triton.testing import do_bench

    import attnbias

    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        flash_attn_func = None
    failed = check(ws_only=False)
    rows = []
    for batch, length in ((4, 4096), (1, 16384)):
        heads, dim = 16, 128
        q, k, v = (torch.randn(batch, heads, length, dim, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))  # fmt: skip
        for causal in (True, False):
            contenders = {n: c for n, c in kernels(q, k, v, causal).items() if n not in failed}
            mask = attnbias.causal_upper_left() if causal else None
            contenders["attnbias triton"] = functools.partial(_ours, attnbias, q, k, v, mask)
            contenders["stock sdpa"] = functools.partial(
                torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=causal
            )
            if flash_attn_func is not None:
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                contenders["fa4"] = functools.partial(flash_attn_func, qt, kt, vt, causal=causal)
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for round_index in range(2):
                order = list(contenders) if round_index == 0 else list(contenders)[::-1]
                for name in order:
                    times[name].append(do_bench(contenders[name], warmup=50, rep=300))
            for name, found in times.items():
                ms = sum(found) / len(found)
                rows.append((batch, length, causal, name, ms,
                             tflops(batch, heads, length, dim, causal, ms)))  # fmt: skip
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; bf16, H=16, E=128, forward")  # fmt: skip
    print("| B | S | causal | kernel | ms | TFLOP/s | ÷ FA4 throughput |")
    print("|--:|--:|---|---|--:|--:|--:|")
    fa4 = {(b, s, c): t for b, s, c, name, _, t in rows if name == "fa4"}
    for batch, length, causal, name, ms, rate in rows:
        ref = fa4.get((batch, length, causal))
        ratio = f"{rate / ref:.2f}" if ref else "-"
        print(f"| {batch} | {length} | {causal} | {name} | {ms:.3f} | {rate:.0f} | {ratio} |")


def library(args: argparse.Namespace) -> None:
    """``attnbias.sdpa`` pinned to the Gluon backend, the Triton kernel and FlashAttention 4
    (where installed), whole calls as a user makes them: causal, a window of 1024 + causal and
    no mask, on (B, H, S, E) tensors and on (B, S, H, E) memory."""
    from triton.testing import do_bench

    import attnbias

    backends = ["gluon", "triton", "sdpa", "fa4"]
    biases = {
        "causal": attnbias.causal_upper_left,
        "window 1024 + causal": lambda: (
            attnbias.causal_upper_left() + attnbias.SlidingWindowBias(1023)
        ),
        "no mask": lambda: None,
    }
    rows = []
    for batch, length in ((4, 4096), (1, 16384)):
        for layout in ("bhse", "bshe"):
            q, k, v = (torch.randn(batch, 16, length, 128, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))  # fmt: skip
            if layout == "bshe":
                q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
            for case, make in biases.items():
                bias = make()
                calls = {}
                for name in backends:
                    try:
                        with attnbias.use_backends(name):
                            attnbias.sdpa(q, k, v, attn_mask=bias)
                    except ValueError:
                        continue  # it cannot run this call
                    calls[name] = functools.partial(_pinned, attnbias, name, q, k, v, bias)
                times: dict[str, list[float]] = {name: [] for name in calls}
                for round_index in range(2):
                    order = list(calls) if round_index == 0 else list(calls)[::-1]
                    for name in order:
                        times[name].append(do_bench(calls[name], warmup=50, rep=300))
                for name, found in times.items():
                    rows.append((batch, length, layout, case, name, sum(found) / len(found)))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; attnbias.sdpa pinned, bf16, H=16, E=128, forward")  # fmt: skip
    print("| B | S | memory | bias | backend | ms | gluon ÷ this |")
    print("|--:|--:|---|---|---|--:|--:|")
    gluon_ms = {r[:4]: r[5] for r in rows if r[4] == "gluon"}
    for batch, length, layout, case, name, ms in rows:
        mine = gluon_ms.get((batch, length, layout, case))
        ratio = f"{mine / ms:.2f}" if mine else "-"
        print(f"| {batch} | {length} | {layout} | {case} | {name} | {ms:.3f} | {ratio} |")


def _pinned(attnbias: Any, name: str, q: Any, k: Any, v: Any, bias: Any) -> Any:
    with attnbias.use_backends(name):
        return attnbias.sdpa(q, k, v, attn_mask=bias)


def _ours(attnbias: Any, q: Any, k: Any, v: Any, mask: Any) -> Any:
    with attnbias.use_backends("triton"):
        return attnbias.sdpa(q, k, v, attn_mask=mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--ws-check", action="store_true", help="check the warp-specialized "
                        "kernel only (run it under a timeout: a wrong barrier hangs)")  # fmt: skip
    parser.add_argument("--library", action="store_true", help="time attnbias.sdpa pinned to "
                        "the Gluon backend against the other backends")  # fmt: skip
    args = parser.parse_args()
    if args.library:
        library(args)
    elif args.compile_only:
        compile_only(args)
    elif args.ws_check:
        sys.exit(1 if check(ws_only=True) else 0)
    else:
        bench(args)


if __name__ == "__main__":
    sys.exit(main())

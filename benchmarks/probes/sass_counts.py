"""Instruction counts of the decode kernel over a paged and a contiguous cache, without a GPU:
each call is recorded under Triton's interpreter (its launch arguments, nothing run), then
compiled for Hopper (sm_90a) with the GPU's tile sizes, and the compiled kernel's SASS is
counted by opcode (with Triton's own ``cuobjdump``), beside its registers and shared memory.

Two processes: the recording one sets ``TRITON_INTERPRET=1`` before Triton is imported; this
one compiles. The counts are static (prologue, epilogue and each pipelined copy of the key
loop together): read them as where the two kernels differ, not as time.

    python benchmarks/probes/sass_counts.py [--queries 16] [--page 64] [--block-m 64] [--block-n 64]

Relies on Triton internals (``create_function_from_signature``, ``JITFunction._pack_args``;
Triton 3.6-3.9) and on the rows below fitting the interpreter's quick run: two rows of 320
and 512 tokens, pages of 64 (``--page``), 32 query heads over 8 key/value heads, head dim 128, bf16.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

OPCODES = ("LDG", "LDGSTS", "LDS", "LDSM", "STS", "HGMMA", "HMMA", "IMAD", "IADD3", "LEA",
           "SHF", "VIMNMX", "ISETP", "SEL", "MUFU", "BAR")  # fmt: skip


def record(queries: int, page: int, path: str) -> None:
    """Under the interpreter: the decode kernel's launch arguments and options for the paged
    call, then the contiguous one (the same tokens at the end of a cache of 512)."""
    import torch

    import attnbias
    import attnbias.kernels.launch as launch
    from attnbias import KeyRangeBias, PagedKV, causal_lower_right

    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def keep(self: Any, key: Any, *args: Any) -> None:
        calls.append((args, dict(self.options)))

    launch.PreparedLaunch.__call__ = keep  # type: ignore[method-assign]
    torch.manual_seed(0)
    lens = torch.tensor([320, 512], dtype=torch.int32)
    pages = 1024 // page  # two rows of 512 tokens
    table = torch.arange(pages, dtype=torch.int32).reshape(2, pages // 2)
    pool_k = torch.randn(pages, page, 8, 128, dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    q = torch.randn(2, 32, queries, 128, dtype=torch.bfloat16)
    k = torch.randn(2, 8, 512, 128, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    with torch.no_grad():
        paged = PagedKV(table, lens) + causal_lower_right()
        attnbias.sdpa(q, pool_k, pool_v, attn_mask=paged, enable_gqa=True)
        contiguous = KeyRangeBias(start=(512 - lens).int()) + causal_lower_right()
        attnbias.sdpa(q, k, v, attn_mask=contiguous, enable_gqa=True)
    if len(calls) != 2:
        raise RuntimeError(f"expected two decode launches, recorded {len(calls)}")
    with open(path, "wb") as file:
        pickle.dump(calls, file)


def counts(args: tuple[Any, ...], options: dict[str, Any]) -> dict[str, Any]:
    """The decode kernel compiled for sm_90a with ``args`` and ``options``: registers, shared
    memory and SASS opcode counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from attnbias.kernels.decode_kernels import _decode_fwd
    from attnbias.kernels.record import flat_kernel

    kernel = flat_kernel(_decode_fwd)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, defaults = binder(*args, **options)
    parsed, signature, constexprs, attrs = kernel._pack_args(
        backend, options, bound, specialization, defaults
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=parsed.__dict__)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [tools / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [tools / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    ops: dict[str, int] = {}
    instruction = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", re.M)
    for match in instruction.finditer(sass):
        ops[match.group(1)] = ops.get(match.group(1), 0) + 1
    registers = re.search(r"REG:(\d+)", usage)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "shared": compiled.metadata.shared,
        "instructions": sum(ops.values()),
        **{op: ops.get(op, 0) for op in OPCODES},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--page", type=int, default=64, help="tokens a page (divides 512)")
    parser.add_argument("--block-m", type=int, help="default: 4 x queries, 16 to 64")
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--record", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.record:
        record(options.queries, options.page, options.record)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "calls.pkl")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        subprocess.run(
            [sys.executable, __file__, "--queries", str(options.queries), "--page",
             str(options.page), "--record", path],
            env=env, check=True,
        )  # fmt: skip
        with open(path, "rb") as file:
            calls = pickle.load(file)
    block_m = options.block_m or min(64, max(16, 4 * options.queries))
    gpu = dict(BLOCK_M=block_m, BLOCK_N=options.block_n, num_warps=options.warps,
               num_stages=options.stages, DOT_PRECISION="ieee", SPLIT=False)  # fmt: skip
    rows = {}
    for label, (args, recorded) in zip(("paged", "contiguous"), calls, strict=True):
        rows[label] = counts(args, {**recorded, **gpu})
    print(f"L = {options.queries}, pages of {options.page}, {gpu}")
    columns = list(rows["paged"])
    print("| cache | " + " | ".join(columns) + " |")
    print("|---|" + "--:|" * len(columns))
    for label, row in rows.items():
        print(f"| {label} | " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()

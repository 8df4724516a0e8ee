"""The decode kernel's split for rows of unequal lengths (``decode.RAGGED_WAVES``) swept, one
process per setting (plans are kept per call, so a setting changed within a process would not
reach calls planned before), as CUDA-graph replays:

1. the paged benchmark's decode cases (rows of 4096 to 32768 tokens, capacity 32768, B = 8,
   Hq / Hkv = 32 / 8, E = 128, bf16; pages of 16, 64, 256; L = 1 and 16) and the same tokens
   contiguous behind a key range: what the split is for;
2. full rows behind a key range (every row's range the whole cache) against the same call
   without one (the even rule): what the split costs where the rows are equal after all.

Waves 0 stands for the even rule (the split for unequal rows off).

Run: ``python benchmarks/probes/ragged_waves.py`` (waves 0, 2, 4, 8 by default;
``WAVES=2,4`` for others).
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch

import attnbias
from attnbias import KeyRangeBias, causal_lower_right

HERE = Path(__file__).resolve().parent
CASES = [(16, 1, None), (64, 1, None), (256, 1, None), (16, 16, None)]
# (B, S, L) of the full rows, Hq / Hkv = 32 / 8, E = 128
FULL = [(8, 32768, 1), (8, 32768, 16), (1, 131072, 1), (32, 8192, 1), (1, 8192, 1), (4, 65536, 4)]


def full_rows(waves: int) -> None:
    import triton

    for batch, length_kv, length_q in FULL:
        q = torch.randn(batch, 32, length_q, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (
            torch.randn(batch, 8, length_kv, 128, device="cuda", dtype=torch.bfloat16)
            for _ in range(2)
        )
        end = torch.full((batch,), length_kv, dtype=torch.int32, device="cuda")
        ms = {}
        for name, bias in (
            ("range", causal_lower_right() + KeyRangeBias(end=end)),
            ("plain", causal_lower_right()),
        ):
            with torch.no_grad():
                call = partial(attnbias.sdpa, q, k, v, attn_mask=bias, enable_gqa=True)
                ms[name] = triton.testing.do_bench_cudagraph(call, rep=200)
        print(
            f"| {waves} | B {batch}, S {length_kv}, L {length_q} | {ms['range']:.4f} | "
            f"{ms['plain']:.4f} | {ms['range'] / ms['plain']:.3f} |",
            flush=True,
        )


def one(waves: int, table: str) -> None:
    from attnbias.kernels import decode

    if waves == 0:
        even = decode.num_splits
        decode.num_splits = lambda **kw: even(**{**kw, "ragged": False})  # type: ignore[assignment]
    else:
        decode.RAGGED_WAVES = waves
    if table == "full":
        full_rows(waves)
        return
    sys.path.insert(0, str(HERE.parent))
    import paged_bench

    for page, length_q, window in CASES:
        row = paged_bench.case(page, length_q, window, peers=False)
        print(
            f"| {waves} | {page} | {length_q} | {row['in place']:.3f} | {row['contiguous']:.3f} "
            f"| {row['floor'] / row['in place']:.0%} | {row['floor'] / row['contiguous']:.0%} |",
            flush=True,
        )


def main() -> None:
    if len(sys.argv) > 2:
        one(int(sys.argv[1]), sys.argv[2])
        return
    settings = os.environ.get("WAVES", "0,2,4,8").split(",")
    print("| waves | page | L | in place ms | contiguous ms | floor / in place | "
          "floor / contiguous |")  # fmt: skip
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for waves in settings:
        subprocess.run([sys.executable, __file__, waves, "paged"], check=True)
    print("\n| waves | full rows | key range ms | no key range ms | ratio |")
    print("|--:|--|--:|--:|--:|")
    for waves in settings + settings[::-1]:  # each setting twice, the order reversed
        subprocess.run([sys.executable, __file__, waves, "full"], check=True)


if __name__ == "__main__":
    main()

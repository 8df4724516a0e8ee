"""The decode kernel's split for rows of unequal lengths (``decode.RAGGED_WAVES``) swept: the
paged benchmark's decode cases (rows of 4096 to 32768 tokens, capacity 32768, B = 8,
Hq / Hkv = 32 / 8, E = 128, bf16; pages of 16, 64, 256; L = 1 and 16) and the same tokens
contiguous behind a key range, one process per setting (plans are kept per call, so a setting
changed within a process would not reach calls planned before), as CUDA-graph replays.

Run: ``python benchmarks/probes/ragged_waves.py`` (waves 4, 8, 16, 32 by default;
``WAVES=8,16`` for others).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = [(16, 1, None), (64, 1, None), (256, 1, None), (16, 16, None)]


def one(waves: int) -> None:
    sys.path.insert(0, str(HERE.parent))
    import paged_bench

    from attnbias.kernels import decode

    decode.RAGGED_WAVES = waves
    for page, length_q, window in CASES:
        row = paged_bench.case(page, length_q, window, peers=False)
        print(
            f"| {waves} | {page} | {length_q} | {row['in place']:.3f} | {row['contiguous']:.3f} "
            f"| {row['floor'] / row['in place']:.0%} | {row['floor'] / row['contiguous']:.0%} |",
            flush=True,
        )


def main() -> None:
    if len(sys.argv) > 1:
        one(int(sys.argv[1]))
        return
    print("| waves | page | L | in place ms | contiguous ms | floor / in place | "
          "floor / contiguous |")  # fmt: skip
    print("|--:|--:|--:|--:|--:|--:|--:|")
    for waves in os.environ.get("WAVES", "4,8,16,32").split(","):
        subprocess.run([sys.executable, __file__, waves], check=True)


if __name__ == "__main__":
    main()

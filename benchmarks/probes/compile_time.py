"""Cold compile time of a new kernel variant and of a new ``ModBias``, in fresh processes.

Each timing is one process with an empty Triton cache: the seconds from building the bias to
the end of its first forward + backward pinned to the Triton kernels (tracing, code
generation, Triton's and the assembler's compilation, the first launches). Two cases: a
built-in variant (causal + window + ALiBi, head dim 64) and a new ``ModBias`` (a prefix-LM
mask and a T5-style table score). ``--trees`` names the packages to compare (another tree
imported under its own name, as ``benchmarks/ab.py --make-old`` builds one); processes of
the trees alternate, and the median of ``--repeats`` is printed per tree and case.

    python benchmarks/probes/compile_time.py --trees attnbias attnbias_old --repeats 5
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = ("variant", "modbias")


def one(tree: str, case: str) -> float:
    """Seconds to the end of the first forward + backward of ``case`` with ``tree``."""
    import torch

    lib = importlib.import_module(tree)
    q, k, v = (
        torch.randn(2, 4, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    table = torch.randn(4, 32, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    if case == "variant":
        bias = lib.causal_lower_right() + lib.SlidingWindowBias(255) + lib.AlibiBias(num_heads=4)
    else:

        def prefix(b: object, h: object, q_idx: object, kv_idx: object) -> object:
            return (kv_idx <= q_idx) | (kv_idx < 300)

        def t5(score: object, b: object, h: object, q_idx: object, kv_idx: object) -> object:
            return score + table[h, (q_idx - kv_idx).clamp(0, 31)]  # type: ignore[operator,union-attr]

        bias = lib.ModBias(mask_mod=prefix, score_mod=t5)
    with lib.use_backends("triton"):
        out = lib.sdpa(q, k, v, attn_mask=bias)
    out.sum().backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", nargs="+", default=["attnbias"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("TREE", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one)))
        return
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        for case in CASES:
            for tree in args.trees if r % 2 == 0 else args.trees[::-1]:
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "TRITON_CACHE_DIR": cache}
                    found = subprocess.run(
                        [sys.executable, __file__, "--one", tree, case],
                        env=env, capture_output=True, text=True, check=True,
                    )  # fmt: skip
                times.setdefault((tree, case), []).append(
                    float(found.stdout.strip().splitlines()[-1])
                )
                print(tree, case, f"{times[tree, case][-1]:.2f} s", flush=True)
    print("\n| case | " + " | ".join(args.trees) + " |")
    print("|---|" + "--:|" * len(args.trees))
    for case in CASES:
        cells = [f"{statistics.median(times[t, case]):.2f} s" for t in args.trees]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

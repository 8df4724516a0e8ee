"""Benchmark `attnbias.sdpa` against FlexAttention, FlashAttention 4 and stock SDPA.

For each case (full, causal, sliding window, packed documents, ALiBi, soft-cap) and each
sequence length, every contender is first checked against an fp32 eager reference on the
same inputs, then timed for the forward and for forward + backward, and its peak memory is
measured. Results go to a markdown report, a JSON file and (when matplotlib is importable) a
PNG plot; `benchmarks/plot.py results.json out.png` redraws the plot elsewhere.

The project's kernels install as `attnbias.kernels`, so install it first (from the repository
root): `pip install -e . --no-deps --no-build-isolation`. The `fa4` and `flex-flash`
contenders need FlashAttention 4 (`flash_attn.cute`); without it they are reported as skipped.

Usage::

    python benchmarks/bench.py                 # full run, writes benchmarks/RESULTS.md
    python benchmarks/bench.py --quick         # S = 4096 only, fewer reps
    python benchmarks/bench.py --cases causal,softcap --out /tmp/bench
    python benchmarks/bench.py --contenders attnbias,fa4,flex-flash --out /tmp/bench
    python benchmarks/bench.py --smoke         # CPU, tiny shapes: plumbing only

The work is split by job: `cases.py` (configuration, patterns, inputs, reference),
`contenders.py` (the calls timed), `measure.py` (check, timing, memory, rounds) and
`report.py` (tables, targets, output files); this script parses the arguments and runs them.

Shape legend: B batch, H heads, L query length, S key length (L = S here), E head dim.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

# isort: split
# Siblings, importable as top-level modules: Python puts this script's folder first on
# sys.path.
from cases import CASE_NAMES, Config
from contenders import CONTENDER_NAMES
from measure import bench_case
from report import environment, write_outputs


def make_config(args: argparse.Namespace) -> Config:
    if args.smoke:
        return Config(
            mode="smoke",
            device=torch.device("cpu"),
            dtype=torch.float32,
            tokens=256,
            num_heads=2,
            head_dim=64,
            seq_lens=(256,),
            window=64,
            warmup_ms=0,
            rep_ms=0,
            rounds=1,
            cpu_reps=1,
            compile_flex=False,
        )
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke to exercise the script on CPU")
    return Config(
        mode="quick" if args.quick else "full",
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        tokens=16 * 1024,
        num_heads=16,
        head_dim=128,
        seq_lens=(4096,) if args.quick else (4096, 16384),
        window=1024,
        warmup_ms=25 if args.quick else 100,
        rep_ms=100 if args.quick else 500,
        rounds=2,
        cpu_reps=1,
        compile_flex=True,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="S = 4096 only, fewer reps")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny fp32 shapes, one rep: plumbing check"
    )
    parser.add_argument("--cases", help=f"comma list out of {','.join(CASE_NAMES)}")
    parser.add_argument(
        "--contenders",
        help=f"comma list out of {','.join(CONTENDER_NAMES)}; attnbias's speed-ups and the "
        "targets need attnbias among them",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="directory for RESULTS.md, results.json, results.png "
        "(default: benchmarks/, or a temporary directory with --smoke)",
    )
    return parser.parse_args(argv)


def pick(
    requested: str | None, known: Sequence[str], what: str, default: Sequence[str] | None = None
) -> list[str]:
    if requested is None:
        return list(known if default is None else default)
    names = [n.strip() for n in requested.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = make_config(args)
    case_names = pick(args.cases, CASE_NAMES, "cases")
    # attnbias pinned to one backend is opt-in (--contenders attnbias-fa4,...): diagnostics
    default = [name for name in CONTENDER_NAMES if not name.startswith("attnbias-")]
    contenders = pick(args.contenders, CONTENDER_NAMES, "contenders", default)
    if args.out is not None:
        out_dir = args.out
    elif cfg.mode == "smoke":
        out_dir = Path(tempfile.gettempdir()) / "attnbias-bench-smoke"
    else:
        out_dir = Path(__file__).resolve().parent
    # Every case and length compiles FlexAttention anew (twice with flex-flash); the default
    # limit would make later ones fall back to eager.
    dynamo_config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 64))

    if not cfg.compile_flex:
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    env = environment(cfg)
    print(f"{env['device']}; torch {env['torch']}, triton {env['triton']}; mode {cfg.mode}")
    infos, rows = [], []
    for seq_len in cfg.seq_lens:
        for name in case_names:
            info, case_rows = bench_case(name, seq_len, contenders, cfg)
            infos.append(info)
            rows += case_rows
    text = write_outputs(out_dir, cfg, env, infos, rows)
    # The tables and targets, the part of the run that gets read.
    print("\n" + text[text.index("## S = ") :])
    print(f"written: {out_dir / 'RESULTS.md'}, {out_dir / 'results.json'}")


if __name__ == "__main__":
    main()

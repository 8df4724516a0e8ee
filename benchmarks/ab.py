"""This tree's kernels against another tree's, in one process, on the GPU.

The other tree is imported as ``attnbias_old``: a copy of its ``attnbias/`` with its
``kernels/`` folder as ``attnbias_old/kernels`` and every ``attnbias`` name in its Python files
renamed (``python benchmarks/ab.py --make-old REV DIR`` builds it from a git revision), so both
register their custom ops side by side. Every case is timed for both trees in alternating order
over two rounds (the GPU's clock follows its power draw), each pinned to one backend, and the
table gives new ms / old ms (below 1: the new tree is faster).

Cases: the training kernel on the benchmark's biases (bf16, H=16, E=128, B·S=16k, forward and
forward + backward), the same on the custom-bias benchmark's mask and score functions (``mods``:
one ``ModBias`` per tree over the same plain functions), the decode kernel (B=8, Hq=32, Hkv=8,
CUDA-graph replays) and the host time of a repeated tiny call.

Usage::

    python benchmarks/ab.py --make-old 93f4d92 .old     # on a machine with the git history
    PYTHONPATH=.old python benchmarks/ab.py              # on the GPU
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import shutil
import statistics
import subprocess
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROUNDS = 2
TREES = {"new": "attnbias", "old": "attnbias_old"}
Timer = Callable[[Callable[[], Any]], float]


def make_old(revision: str, target: Path) -> None:
    """Write ``target/attnbias_old`` from ``revision`` of the repository in the working dir."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "tree.tar"
        subprocess.run(
            ["git", "archive", "-o", str(archive), revision, "attnbias", "kernels"], check=True
        )
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        package = target / "attnbias_old"
        shutil.rmtree(package, ignore_errors=True)
        shutil.copytree(Path(tmp) / "attnbias", package)
        shutil.copytree(Path(tmp) / "kernels", package / "kernels")
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\battnbias\b", "attnbias_old", path.read_text()))


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def training_biases(lib: Any, seq_len: int, heads: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seq_len)
    cuts = sorted(torch.randperm(seq_len - 1, generator=gen)[: seq_len // 2048 + 3].add(1))
    seqlens = [b - a for a, b in zip([0, *cuts], [*cuts, seq_len], strict=True)]
    causal = lib.CausalBias(lib.CausalVariant.UPPER_LEFT)
    return {
        "causal": causal,
        "window": causal + lib.SlidingWindowBias(1023),
        "documents": lib.DocumentBias.from_seqlens(seqlens, device="cuda") + causal,
        "alibi": causal + lib.AlibiBias(num_heads=heads),
        "softcap": causal + lib.SoftcapBias(50.0),
    }


def mod_biases(lib: Any, seq_len: int, table: torch.Tensor) -> dict[str, Any]:
    """The custom-bias benchmark's cases as ``lib.ModBias`` over plain functions (the same
    functions for both trees; ``table`` requires grad)."""
    from mod_bench import (
        IMAGE,
        WINDOW_2D,
        ChunkedLocal,
        Neighbourhood2D,
        PrefixLM,
        WindowMod,
        t5_bucket,
    )

    def t5(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + table[h, t5_bucket(q_idx - kv_idx).clamp(0, 31)]

    made = {
        "prefix-LM": lib.ModBias(mask_mod=PrefixLM(seq_len // 8).mask_mod),
        "chunked local": lib.ModBias(mask_mod=ChunkedLocal(1024).mask_mod),
        "T5 table + causal": lib.ModBias(score_mod=t5) + lib.causal_upper_left(),
        "window as mask_mod": lib.ModBias(mask_mod=WindowMod(1024).mask_mod),
    }
    if seq_len == IMAGE[0] * IMAGE[1]:
        made["2-D neighbourhood"] = lib.ModBias(
            mask_mod=Neighbourhood2D(*IMAGE, WINDOW_2D).mask_mod
        )
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-old", nargs=2, metavar=("REV", "DIR"))
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["training", "mods", "decode", "host"]
    )
    parser.add_argument("--cases", nargs="*", help="training cases (default: all)")
    parser.add_argument("--seqs", nargs="*", type=int, default=[4096, 16384])
    args = parser.parse_args()
    if args.make_old:
        make_old(args.make_old[0], Path(args.make_old[1]))
        return
    trees = {
        "new": importlib.import_module("attnbias"),
        "old": importlib.import_module("attnbias_old"),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows: list[tuple[str, float, float]] = []

    def compare(
        label: str, calls: dict[str, Callable[[], Any]], timer: Callable[..., float]
    ) -> None:
        times: dict[str, list[float]] = {name: [] for name in calls}
        for r in range(ROUNDS):
            for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
                times[name].append(timer(calls[name]))
        new, old = (statistics.fmean(times[n]) for n in ("new", "old"))
        rows.append((label, new, old))
        print(f"{label}: new {new:.4f} old {old:.4f} ratio {new / old:.3f}", flush=True)

    dt = torch.bfloat16
    groups = [g for g in ("training", "mods") if g not in args.skip]
    for group in groups:
        heads, head_dim = 16, 128
        for seq_len in args.seqs:
            batch = 16384 // seq_len
            q, k, v = (
                torch.randn(batch, heads, seq_len, head_dim, device="cuda", dtype=dt)
                .mul_(4 if i == 0 else 1)
                .requires_grad_()
                for i in range(3)
            )
            grad = torch.randn_like(q)
            if group == "mods":
                table = (torch.randn(heads, 32, device="cuda") * 0.5).requires_grad_()
                biases = {name: mod_biases(lib, seq_len, table) for name, lib in trees.items()}
            else:
                biases = {name: training_biases(lib, seq_len, heads) for name, lib in trees.items()}
            for case in args.cases or biases["new"]:
                if case not in biases["new"]:
                    continue

                def fwd(
                    lib: Any, bias: Any, q: Any = q, k: Any = k, v: Any = v
                ) -> Callable[[], Any]:
                    def call() -> Any:
                        with lib.use_backends("triton"):
                            return lib.sdpa(q, k, v, attn_mask=bias)

                    return call

                def fwd_bwd(
                    lib: Any, bias: Any, q: Any = q, k: Any = k, v: Any = v, grad: Any = grad
                ) -> Callable[[], Any]:
                    def call() -> None:
                        with lib.use_backends("triton"):
                            out = lib.sdpa(q, k, v, attn_mask=bias)
                        torch.autograd.grad(out, (q, k, v), grad)

                    return call

                out = {n: fwd(trees[n], biases[n][case])() for n in trees}
                diff = (out["new"].float() - out["old"].float()).abs().max().item()
                print(f"{case} S={seq_len}: max |new - old| = {diff:.2e}")
                compare(
                    f"triton {case} S={seq_len} fwd",
                    {n: fwd(trees[n], biases[n][case]) for n in trees},
                    bench_ms,
                )
                compare(
                    f"triton {case} S={seq_len} f+b",
                    {n: fwd_bwd(trees[n], biases[n][case]) for n in trees},
                    bench_ms,
                )
            del q, k, v, grad
    if "decode" not in args.skip:
        # the decode benchmark's timing: CUDA-graph replays of several calls
        from decode_bench import graph_ms

        for length_q in (1, 16):
            for length_kv in (8192, 131072):
                q = torch.randn(8, 32, length_q, 128, device="cuda", dtype=dt)
                k, v = (
                    torch.randn(8, 8, length_kv, 128, device="cuda", dtype=dt) for _ in range(2)
                )
                for case in ("causal", "window"):

                    def decode(
                        lib: Any, case: str = case, q: Any = q, k: Any = k, v: Any = v
                    ) -> Callable[[], Any]:
                        bias = lib.causal_lower_right()
                        if case == "window":
                            bias = bias + lib.SlidingWindowBias(4095)

                        def call() -> Any:
                            with lib.use_backends("triton-decode"):
                                return lib.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

                        return call

                    compare(
                        f"decode {case} L={length_q} S={length_kv}",
                        {n: decode(trees[n]) for n in trees},
                        graph_ms,
                    )
    if "host" not in args.skip:
        # the default route of a tiny call, as a user makes it: host time is what it costs
        from measure import host_us_interleaved

        q = torch.randn(1, 1, 128, 64, device="cuda", dtype=dt)
        for case in ("window", "causal", "documents"):
            calls = {}
            for name, lib in trees.items():
                bias = lib.causal_upper_left(128, 128)
                if case == "window":
                    bias = bias + lib.SlidingWindowBias(31)
                elif case == "documents":
                    bias = bias + lib.DocumentBias.from_seqlens([64, 64], device="cuda")
                calls[name] = functools.partial(lib.sdpa, q, q, q, attn_mask=bias)
                print(f"host {case} ({name}): {lib.explain(q, q, q, attn_mask=bias)[:60]}")
            with torch.no_grad():
                for _ in range(ROUNDS):
                    times = host_us_interleaved(calls)
                    rows.append((f"host us {case} no grad", times["new"], times["old"]))
    print("\n| case | new | old | new / old |\n|---|--:|--:|--:|")
    for label, new, old in rows:
        print(f"| {label} | {new:.4f} | {old:.4f} | {new / old:.3f} |")


if __name__ == "__main__":
    main()

"""Context parallelism, this tree against an older one: ``attnbias.distributed.sdpa`` of both
in the same processes (one per GPU, NCCL, NVLink multicast off), in alternating order over two
rounds, each case in one mode and layout.

The older tree is a copy of the package renamed ``attnbias_old`` (``python benchmarks/ab.py
--make-old REV DIR`` builds it), on ``PYTHONPATH``. Per case: whether the output and the
gradients are bit-identical to the older tree's and to a second run of this tree (``=`` per
tensor: out, dq, dk, dv), the largest error against one GPU running the whole call, the
slowest rank's median ms per forward + backward step of each tree and of one GPU, and for the
first case of the bias ``PROFILE_BIAS`` (default ``window``) a profile of one step per rank
(the GPU's busy time, its longest idle gaps, and the kernels' time summed by kind).

    PYTHONPATH=.old W=2 python benchmarks/cp_ab.py
    CASES=window:131072:contiguous:sequence W=4 python benchmarks/cp_ab.py

``CASES``: comma-separated ``bias:S:layout:mode`` (bias ``window`` 4096 + causal,
``documents`` ragged + causal, ``causal``; layout ``contiguous``, ``zigzag`` or ``auto``).
``LEAD_MS``: each timed step (of both trees and of one GPU) starts behind a GPU sleep of this
many ms, subtracted from its time, so that the host runs that far ahead of the GPU, as where
a model's other layers keep the GPU busy: the time the step's GPU work takes when the host's
time (planning, FlashAttention 4's calls) is hidden.
``PIN_NEW``: backends this tree's steps are pinned to (``use_backends``, comma-separated),
e.g. ``triton`` against the same code unpinned as the older tree.
Writes ``$OUT/cp_ab_w{W}.json`` and prints a table.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

sys.path.insert(0, str(Path(__file__).parent))
from cp_bench import timed, timed_local

OUT = os.environ.get("OUT", "/tmp")
PIN_NEW = tuple(n for n in os.environ.get("PIN_NEW", "").split(",") if n)
LEAD_MS = float(os.environ.get("LEAD_MS", "0"))
HEADS, HEAD_DIM, DTYPE = 16, 128, torch.bfloat16
TREES = ("attnbias", "attnbias_old")
DEFAULT_CASES = (
    "window:131072:contiguous:sequence,window:524288:contiguous:sequence,"
    "causal:32768:zigzag:heads,documents:131072:zigzag:heads"
)


def ragged(length: int, seed: int = 0) -> list[int]:
    """Document lengths between length / 32 and length / 4 that sum to ``length``."""
    generator = torch.Generator().manual_seed(seed)
    lengths, left = [], length
    while left > 0:
        n = int(torch.randint(length // 32, length // 4 + 1, (1,), generator=generator))
        lengths.append(min(n, left))
        left -= lengths[-1]
    return lengths


def make_bias(tree: Any, name: str, length: int, device: torch.device) -> Any:
    if name == "window":
        return tree.causal_upper_left() + tree.SlidingWindowBias(4095)
    if name == "documents":
        lengths = ragged(length)
        return tree.DocumentBias.from_seqlens(lengths, device=device) + tree.causal_upper_left()
    return tree.causal_upper_left()


def gaps(profiler: Any, label: str) -> dict[str, Any]:
    """The span of a profiled step's GPU work, the time some kernel ran, and the longest idle
    gaps (with the kernels on either side)."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in profiler.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    if not kernels:
        return {"label": label, "span_us": 0.0, "busy_us": 0.0, "holes": []}
    busy, (first, end, previous), holes = 0.0, kernels[0], []
    for start, stop, name in kernels[1:]:
        if start > end:
            busy += end - first
            holes.append((round(start - end), previous[:60], name[:60]))
            first, end = start, stop
        else:
            end = max(end, stop)
        previous = name
    busy += end - first
    by_kind: dict[str, float] = {}
    for start, stop, name in kernels:
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + stop - start
    return {
        "label": label,
        "span_us": kernels[-1][1] - kernels[0][0],
        "busy_us": busy,
        "holes": sorted(holes, reverse=True)[:8],
        "kinds_us": {k: round(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
    }


def kernel_kind(name: str) -> str:
    """A kernel's name reduced to what it does: NCCL's, attention's, copies, the rest."""
    lowered = name.lower()
    for word, kind in (
        ("nccl", "nccl"), ("flash", "attention"), ("fmha", "attention"), ("attn", "attention"),
        ("copy", "copy"), ("memcpy", "copy"), ("memset", "fill"), ("fill", "fill"),
        ("index", "index"), ("reduce", "reduce"),
    ):  # fmt: skip
        if word in lowered:
            return kind
    return name[:40]


def leading(ms: float) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """A wrapper that puts a GPU sleep of ``ms`` milliseconds before a step (none for 0)."""
    if ms <= 0:
        return lambda step: step
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    count = int(cycles * ms / start.elapsed_time(end))

    def wrap(step: Callable[[], Any]) -> Callable[[], Any]:
        def led() -> Any:
            torch.cuda._sleep(count)
            return step()

        return led

    return wrap


def bench_case(
    rank: int, world: int, trees: dict[str, Any], case: list[str], profiles: list[Any]
) -> dict[str, Any]:
    """One case's row (and, for the first window case, a profile appended to ``profiles``)."""
    bias_name, length_text, layout_name, mode = case
    length, device = int(length_text), torch.device("cuda", rank)
    torch.manual_seed(0)
    q, k, v, grad = (
        torch.randn(1, HEADS, length, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(4)
    )
    new = trees["attnbias"]
    biases = {t: make_bias(m, bias_name, length, device) for t, m in trees.items()}
    layouts = {
        t: m.distributed.layout_for(biases[t], length, device=device)
        if layout_name == "auto" else layout_name
        for t, m in trees.items()
    }  # fmt: skip
    parts = [new.distributed.shard(x, layout=layouts["attnbias"]) for x in (q, k, v)]
    part_grad = new.distributed.shard(grad, layout=layouts["attnbias"])

    def step(tree: str) -> list[Tensor]:
        leaves = [p.detach().requires_grad_() for p in parts]
        pinned = PIN_NEW if tree == "attnbias" else ()
        with trees[tree].use_backends(*pinned) if pinned else contextlib.nullcontext():
            out = trees[tree].distributed.sdpa(
                *leaves, attn_mask=biases[tree], layout=layouts[tree], mode=mode
            )
            out.backward(part_grad)
        return [out.detach(), *(x.grad for x in leaves)]

    results = {t: step(t) for t in TREES}
    again = step("attnbias")

    def equal(got: list[Tensor], other: list[Tensor]) -> str:
        return "".join("=" if torch.equal(a, b) else "x" for a, b in zip(got, other, strict=True))

    same = equal(results["attnbias"], results["attnbias_old"]) + "/"
    same += equal(results["attnbias"], again)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    reference = new.sdpa(*whole, attn_mask=biases["attnbias"])
    reference.backward(grad)
    wanted = [reference.detach(), *(x.grad for x in whole)]
    errors = [
        float((a.float() - new.distributed.shard(b, layout=layouts["attnbias"]).float())
              .abs().max())
        for a, b in zip(results["attnbias"], wanted, strict=True)
    ]  # fmt: skip
    del whole, reference, wanted

    def single() -> None:
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        new.sdpa(*leaves, attn_mask=biases["attnbias"]).backward(grad)

    reps = 6 if length <= 131072 else 3
    times: dict[str, list[float]] = {"attnbias": [], "attnbias_old": [], "one": []}
    lead = leading(LEAD_MS)
    for round_index in range(2):
        one = timed_local(lead(single), reps) - LEAD_MS if rank == 0 else 0.0
        shared = torch.tensor([one], device="cuda")
        dist.broadcast(shared, 0)
        times["one"].append(float(shared))
        for tree in TREES if round_index == 0 else TREES[::-1]:
            times[tree].append(timed(lead(lambda tree=tree: step(tree)), reps) - LEAD_MS)
    row = {
        "case": bias_name, "mode": mode, "S": length, "layout": str(layouts["attnbias"]),
        "W": world, "bitwise_same": same, "err_vs_one": errors,
        **{key: statistics.mean(value) for key, value in times.items()}, "rounds": times,
    }  # fmt: skip
    profile_this = bias_name == os.environ.get("PROFILE_BIAS", "window") and not profiles
    if profile_this and os.environ.get("PROFILE", "1") == "1":
        from torch.profiler import ProfilerActivity, profile

        for tree in TREES:
            step(tree)
            torch.cuda.synchronize()
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step(tree)
                torch.cuda.synchronize()
            profiles.append(gaps(prof, tree))
    return row


def run_rank(rank: int, world: int, port: int, cases: list[list[str]]) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.set_num_threads(1)  # one host thread per rank, as torchrun sets
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        device_id=torch.device("cuda", rank),
    )  # fmt: skip
    trees = {name: importlib.import_module(name) for name in TREES}
    for name in TREES:
        importlib.import_module(name + ".distributed")
    rows: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    for case in cases:
        rows.append(bench_case(rank, world, trees, case, profiles))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    with open(f"{OUT}/profile_w{world}_rank{rank}.json", "w") as f:
        json.dump(profiles, f, indent=1)
    if rank == 0:
        with open(f"{OUT}/cp_ab_w{world}.json", "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


def main() -> None:
    world = int(os.environ.get("W", torch.cuda.device_count()))
    cases = [c.split(":") for c in os.environ.get("CASES", DEFAULT_CASES).split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank, args=(world, port, cases), nprocs=world)
    for rank in range(world):
        path = f"{OUT}/profile_w{world}_rank{rank}.json"
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for found in json.load(f):
                span, busy = found["span_us"] / 1e3, found["busy_us"] / 1e3
                print(f"rank {rank} {found['label']}: GPU span {span:.2f} ms, busy {busy:.2f} "
                      f"ms, gaps {found['holes'][:3]}")  # fmt: skip
                print(f"  kernels (us) {found.get('kinds_us')}")
    print("case mode S W | one GPU | new | old | new/old | bitwise (old/again) | errors | eff")
    with open(f"{OUT}/cp_ab_w{world}.json") as f:
        rows = json.load(f)
    for row in rows:
        efficiency = [row["one"] / (row["W"] * row[t]) for t in TREES]
        print(
            row["case"], row["mode"], row["S"], row["W"], "|", f"{row['one']:.2f}", "|",
            f"{row['attnbias']:.2f} | {row['attnbias_old']:.2f} | "
            f"{row['attnbias'] / row['attnbias_old']:.3f} |", row["bitwise_same"], "|",
            ", ".join(f"{e:.1e}" for e in row["err_vs_one"]), "|",
            "/".join(f"{e:.2f}" for e in efficiency),
        )  # fmt: skip


if __name__ == "__main__":
    main()

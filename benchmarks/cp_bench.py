"""Context parallelism on the GPUs of one host: ``attnbias.distributed.sdpa`` against one GPU
running the whole call and against PyTorch's ``context_parallel``.

One process per GPU (NCCL, NVLink multicast off). For each bias and length, every rank draws
the same whole ``q, k, v`` (bf16, B=1, H=16, E=128) and:

* one GPU, whole: ``attnbias.sdpa`` forward + backward on the whole sequence (rank 0's time;
  each rank computes it once as the reference of the errors);
* each (mode, layout) of ``distributed.sdpa``: forward + backward per step (the slowest rank's
  median over the repetitions), the errors of the output and gradients against the whole
  call, the peak memory the step adds, and for the sequence mode the key/value positions each
  rank receives against the positions its queries keep (both at blocks of 16 positions, of
  64 beyond 128k);
* the overlap of the chosen sequence layout: the step with its transfers alone (no pairs
  computed) and with its computation alone (no transfers; buffers left unfilled);
* PyTorch's ``context_parallel`` (causal only: its ring takes ``is_causal``, not these masks).

Two rounds, the second in reverse order; the table gives the mean of the two medians.

    python benchmarks/cp_bench.py --lengths 32768,131072 --out cp.json
    python benchmarks/cp_bench.py --report cp.json > benchmarks/CP_RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

import attnbias
from attnbias import DocumentBias, ModBias, SlidingWindowBias, causal_upper_left, distributed
from attnbias.distributed import blocks, exchange
from attnbias.terms import Call

HEADS, HEAD_DIM, BATCH = 16, 128, 1
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class PrefixLM(ModBias):
    """A prefix of bidirectional attention, causal after it (a ModBias, run as its function)."""

    prefix: int

    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)


def ragged(length: int, seed: int = 0) -> list[int]:
    """Document lengths between length / 32 and length / 4 that sum to ``length``."""
    generator = torch.Generator().manual_seed(seed)
    lengths, left = [], length
    while left > 0:
        n = int(torch.randint(length // 32, length // 4 + 1, (1,), generator=generator))
        n = min(n, left)
        lengths.append(n)
        left -= n
    return lengths


def padded(lengths: list[int], multiple: int = 1024) -> list[int]:
    """``lengths`` rounded to multiples of ``multiple`` (the last one taking what is left),
    as a packer that pads each document would give them: head-tail within documents needs
    lengths ``2W`` divides."""
    total = sum(lengths)
    out = [max(multiple, n // multiple * multiple) for n in lengths[:-1]]
    out.append(total - sum(out))
    return [n for n in out if n > 0]


def biases(length: int, device: torch.device) -> dict[str, Any]:
    return {
        "causal": causal_upper_left(),
        "window 4096 + causal": causal_upper_left() + SlidingWindowBias(4095),
        "documents + causal": DocumentBias.from_seqlens(ragged(length), device=device)
        + causal_upper_left(),
        "documents (padded to 1024) + causal": DocumentBias.from_seqlens(
            padded(ragged(length)), device=device
        )
        + causal_upper_left(),
        "prefix-LM (S/8)": PrefixLM(length // 8),
    }


CONFIGS = [
    ("sequence", "zigzag"),
    ("sequence", "contiguous"),
    ("sequence", "auto"),
    ("sequence", "head-tail"),  # within documents, where the bias packs them
    ("heads", "zigzag"),
]


def timed(step: Callable[[], Any], reps: int, group: Any = None) -> float:
    """The slowest rank's median milliseconds of ``step`` (after one warm-up)."""
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier(group)
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    mine = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    return float(mine)


def error(a: Tensor, b: Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def need_and_sent(bias: Any, length: int, layout: Any, world: int) -> tuple[list[int], list[int]]:
    """Per rank: the key/value positions of other ranks its queries keep (at blocks of 16, of
    64 beyond 128k) and the positions the schedule sends it."""
    call = Call(BATCH, HEADS, length, length, torch.device("cuda"))
    size = 16 if length <= 131072 else 64
    fine = blocks.keep_grid(bias, call, size, size)
    schedule = exchange.Schedule.make(
        bias, call, layout, 0, None, scale=None, enable_gqa=False, needs_grad=True
    )
    need = []
    for rank in range(world):
        mine = [b for a, c in layout.ranges(rank, length) for b in range(a // size, c // size)]
        kept = fine[mine].any(0).cpu()
        kept[mine] = False
        need.append(size * int(kept.sum()))
    return need, [schedule.received(r) for r in range(world)]


def run_rank(rank: int, world: int, port: int, args: Any) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    # one host thread per rank, as torchrun sets OMP_NUM_THREADS=1 for several processes
    torch.set_num_threads(args.threads)
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        device_id=torch.device("cuda", rank),
    )  # fmt: skip
    device = torch.device("cuda", rank)
    rows: list[dict[str, Any]] = []
    try:
        for length in args.lengths:
            cases = biases(length, device)
            for name, bias in cases.items():
                if args.cases and not selected(name, args.cases, cases):
                    continue
                rows += bench_case(rank, world, length, name, bias, args)
                if rank == 0:
                    print(rows[-1]["case"], length, "done", flush=True)
                    with open(args.out + ".rows", "w") as f:  # what is done so far
                        json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def selected(name: str, cases: list[str], names: Collection[str]) -> bool:
    """Whether ``--cases`` selects the case ``name`` of the cases ``names``: a whole name
    selects only its case ("causal" is not "window 4096 + causal"); a part of a name selects
    every case it is part of."""
    return any(c == name or (c not in names and c in name) for c in cases)


def bench_case(
    rank: int, world: int, length: int, name: str, bias: Any, args: Any
) -> list[dict[str, Any]]:
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    q, k, v, grad = (
        torch.randn(BATCH, HEADS, length, HEAD_DIM, device=device, dtype=DTYPE) for _ in range(4)
    )
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attnbias.sdpa(*whole, attn_mask=bias)
    expected.backward(grad)
    wanted = [expected.detach(), *(t.grad for t in whole)]
    reps = args.reps if length <= 65536 else max(3, args.reps // 2)

    def single() -> None:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        attnbias.sdpa(*leaves, attn_mask=bias).backward(grad)

    rows: list[dict[str, Any]] = []
    base = {"case": name, "length": length, "world": world}
    configs = [c for c in CONFIGS if not args.configs or f"{c[0]}/{c[1]}" in args.configs]
    rounds: dict[str, list[float]] = {}
    extra: dict[str, dict[str, Any]] = {}
    for round_index in range(2):
        order = configs if round_index == 0 else configs[::-1]
        # one GPU: rank 0 runs it, the others wait
        one = None
        if rank == 0:
            one = timed_local(single, reps)
        rounds.setdefault("one GPU", []).append(broadcast(one))
        for mode, layout_name in order:
            label = f"{mode} / {layout_name}"
            if layout_name == "head-tail":
                call = Call(None, 1, length, length, device)
                layout = blocks.document_layout(bias, call, world)
                if layout is None:  # no documents, or lengths 2W does not divide
                    continue
            elif layout_name == "auto":
                layout = distributed.layout_for(bias, length, device=device)
            else:
                layout = layout_name
            parts = [distributed.shard(t, layout=layout) for t in (q, k, v)]
            part_grad = distributed.shard(grad, layout=layout)

            def step(
                parts: list[Tensor] = parts,
                layout: Any = layout,
                mode: str = mode,
                part_grad: Tensor = part_grad,
            ) -> Any:
                leaves = [p.detach().requires_grad_() for p in parts]
                out = distributed.sdpa(*leaves, attn_mask=bias, layout=layout, mode=mode)
                out.backward(part_grad)
                return out, leaves

            if round_index == 0:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                out, leaves = step()
                torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - before) / 2**20
                got = [out.detach(), *(t.grad for t in leaves)]
                errors = [error(g, distributed.shard(w, layout=layout))
                          for g, w in zip(got, wanted, strict=True)]  # fmt: skip
                chosen = distributed.layouts.Layout.named("zigzag", world)
                if isinstance(layout, distributed.Layout):
                    chosen = layout
                elif layout in ("contiguous", "zigzag"):
                    chosen = distributed.Layout.named(layout, world)
                info: dict[str, Any] = {"errors": errors, "peak_mib": peak,
                                        "layout": repr(chosen)}  # fmt: skip
                if mode == "sequence":
                    need, sent = need_and_sent(bias, length, chosen, world)
                    info["need_positions"], info["sent_positions"] = need, sent
                peaks = torch.tensor([peak], device=device)
                dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
                info["peak_mib"] = float(peaks)
                extra[label] = info
            rounds.setdefault(label, []).append(timed(step, reps))
            if mode == "sequence" and layout_name == "auto" and round_index == 0:
                extra[label]["transfers_only_ms"] = with_patch(
                    exchange, "_pairs", lambda *a, **k: [], lambda: timed(step, reps)
                )
                extra[label]["compute_only_ms"] = with_patch(
                    exchange, "_start", lambda ops: [], lambda: timed(step, reps)
                )
        if name == "causal":
            rounds.setdefault("PyTorch context_parallel", []).append(
                torch_cp(q, k, v, grad, world, reps)
            )
    one_ms = statistics.mean(rounds["one GPU"])
    for label, times in rounds.items():
        row = {**base, "config": label, "ms_rounds": times, "ms": statistics.mean(times)}
        row["efficiency"] = one_ms / (world * row["ms"]) if label != "one GPU" else 1.0
        row.update(extra.get(label, {}))
        rows.append(row)
    return rows


def timed_local(step: Callable[[], Any], reps: int) -> float:
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def broadcast(value: float | None) -> float:
    found = torch.tensor([value or 0.0], device="cuda")
    dist.broadcast(found, 0)
    return float(found)


def with_patch(module: Any, name: str, replacement: Any, run: Callable[[], float]) -> float:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        return run()
    finally:
        setattr(module, name, original)


def torch_cp(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, world: int, reps: int) -> float:
    """PyTorch's context_parallel (its load-balanced causal ring over SDPA's flash kernel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (world,))
    buffers = [t.detach().clone() for t in (q, k, v, grad)]
    with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2, 2]):

        def step() -> None:
            leaves = [t.detach().requires_grad_() for t in buffers[:3]]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
            out.backward(buffers[3])

        return timed(step, reps)


def report(path: str) -> str:
    with open(path) as f:
        rows = json.load(f)
    meta = rows[0].get("meta", {}) if rows and "meta" in rows[0] else {}
    lines = [
        f"{meta.get('gpus', '?')} x {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
        f"NCCL {meta.get('nccl', '?')}; bf16, B=1, H=16, E=128; forward + backward per step, "
        "the slowest rank's median, mean of two rounds (the second in reverse order). "
        "Efficiency: one GPU's time / (W x time per step). Positions: per rank, the "
        "key/value positions it receives / those of other ranks its queries keep (blocks of "
        "16; of 64 beyond 128k). Errors: bf16 against the one-GPU call.",
        "",
    ]
    cases = sorted({(r["case"], r["length"]) for r in rows if "case" in r},
                   key=lambda c: (c[1], c[0]))  # fmt: skip
    lines += [
        "| case | S | config | ms f+b per step (rounds) | efficiency | sent / need positions "
        "(per rank) | peak MiB | max error out, dq, dk, dv |",
        "|---|--:|---|--:|--:|---|--:|---|",
    ]
    for case, length in cases:
        for r in rows:
            if r.get("case") != case or r.get("length") != length or r["config"] == "explain":
                continue
            sent = ""
            if "sent_positions" in r:
                sent = ", ".join(
                    f"{s} / {n}"
                    for s, n in zip(r["sent_positions"], r["need_positions"], strict=True)
                )
            errs = ", ".join(f"{e:.1e}" for e in r.get("errors", []))
            rounds = " / ".join(f"{t:.2f}" for t in r["ms_rounds"])
            overlap = ""
            if "transfers_only_ms" in r:
                overlap = (f" (transfers alone {r['transfers_only_ms']:.2f}, compute alone "
                           f"{r['compute_only_ms']:.2f})")  # fmt: skip
            lines.append(
                f"| {case} | {length} | {r['config']}{overlap} | {r['ms']:.2f} ({rounds}) | "
                f"{r['efficiency']:.2f} | {sent} | {r.get('peak_mib', 0):.0f} | {errs} |"
            )
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--cases", default="")
    parser.add_argument("--configs", default="", help="e.g. sequence/auto,heads/zigzag")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--out", default="cp.json")
    parser.add_argument("--report", default=None)
    parser.add_argument("--threads", type=int, default=1, help="host threads per rank")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.cases = [c for c in args.cases.split(",") if c]
    args.configs = [c for c in args.configs.split(",") if c]
    world = torch.cuda.device_count()
    if world < 2:
        sys.exit("cp_bench needs at least two GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run_rank, args=(world, port, args), nprocs=world, start_method="spawn")
    with open(args.out + ".rows") as f:
        rows = json.load(f)
    os.remove(args.out + ".rows")
    meta = {
        "device": torch.cuda.get_device_name(0), "gpus": world, "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }  # fmt: skip
    rows.insert(0, {"meta": meta})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(report(args.out))


if __name__ == "__main__":
    main()

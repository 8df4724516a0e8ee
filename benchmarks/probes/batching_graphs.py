"""Why continuous batching's captured steps run slower than its eager ones: ``generate_batch``
of ``batching_bench.py``'s model (random weights, bf16) on attnbias with CUDA graphs, tokens
per second under each setting of the paged route that a captured step depends on:

* ``as routed``: the library's settings;
* ``no split``: ``paged.SPLIT_SHORT_ROWS`` off (every ragged row on the training kernel);
* ``FA4 from 64``: ``paged.FA4_MIN_RAGGED_MEAN_QUERIES`` 0 (split steps go to FlashAttention 4
  from 64 queries in all, the rule before the mean bound);
* ``no FA4``: ``as routed`` without FlashAttention 4's paged forward (every step on the
  library's kernels; a capture must take the route its eager warm-up took, which compiled
  the kernels it runs);
* ``eager``: the same settings as ``as routed``, CUDA graphs off.

Then, of one captured ``generate_batch`` as routed: the GPU's kernels summed by name (the ten
largest), the paged calls the route saw (packed queries, rows, the route taken), and the host
time of the attention function in calls made while a graph was captured against the others
(warm-ups, eager steps), so that a slow kernel, a route that differs from the eager steps' or
a capture cost shows.

    python benchmarks/probes/batching_graphs.py [--requests 24] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from batching_bench import add_workload, run, workload

import attnbias.integrations.transformers as attnbias_hf
import attnbias.paged as route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload(parser, requests=24, new_tokens=64)
    parser.add_argument(
        "--settings", default="as routed,no split,FA4 from 64,no FA4,eager",
        help="the settings to time, by name, comma-separated",
    )  # fmt: skip
    args = parser.parse_args()
    calls: collections.Counter[str] = collections.Counter()
    host: collections.Counter[str] = collections.Counter()
    forward = attnbias_hf.paged_attention_forward

    def timed_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
        kind = "captured" if torch.cuda.is_current_stream_capturing() else "not captured"
        began = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            calls[kind] += 1
            host[kind] += time.perf_counter() - began

    attnbias_hf.paged_attention_forward = timed_forward  # read by register()
    attnbias_hf.register()
    prompts, model = workload(args)
    defaults = (route.SPLIT_SHORT_ROWS, route.FA4_MIN_RAGGED_MEAN_QUERIES)
    settings = {
        "as routed": (defaults, True),
        "no split": ((False, defaults[1]), True),
        "FA4 from 64": ((defaults[0], 0), True),
        "no FA4": (defaults, True),
        "eager": (defaults, False),
    }
    fa4_route = route.fa4_paged

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        return None

    def one(name: str) -> float:
        (split, mean), graphs = settings[name]
        route.SPLIT_SHORT_ROWS, route.FA4_MIN_RAGGED_MEAN_QUERIES = split, mean
        routed = route.fa4_paged  # (the counting wrapper below, while profiling)
        if name == "no FA4":
            route.fa4_paged = never
        try:
            with attnbias_hf.continuous_batching(model):
                return run(model, prompts, args.new_tokens, graphs)[0]
        finally:
            route.SPLIT_SHORT_ROWS, route.FA4_MIN_RAGGED_MEAN_QUERIES = defaults
            route.fa4_paged = routed

    timed = args.settings.split(",")
    for name in timed:  # warm up: compiled, captured
        one(name)
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    for order in (timed, timed[::-1]):
        for name in order:
            seconds[name].append(one(name))
            print(f"  {name}: {seconds[name][-1]:.2f} s", flush=True)

    # the kernels of one generate_batch as routed (captured) and eager, and the steps the
    # route saw
    seen: collections.Counter[tuple[int, int, str]] = collections.Counter()

    def counting(query, key, value, pages, *rest, **kwargs):  # type: ignore[no-untyped-def]
        found = fa4_route(query, key, value, pages, *rest, **kwargs)
        rows = pages.block_table.shape[0]
        capture = torch.cuda.is_current_stream_capturing()
        taken = ("fa4" if found is not None else "own") + (" captured" if capture else "")
        seen[(query.shape[2], rows, taken)] += 1
        return found

    route.fa4_paged = counting
    calls.clear()
    host.clear()
    kernels = {}
    try:
        for name in ("eager", "as routed"):  # (the calls counted: the captured run's)
            seen.clear()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                one(name)
            totals: collections.Counter[str] = collections.Counter()
            counts: collections.Counter[str] = collections.Counter()
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    totals[event.name[:70]] += event.device_time_total
                    counts[event.name[:70]] += 1
            kernels[name] = (totals, counts)
    finally:
        route.fa4_paged = fa4_route
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.requests} "
          f"requests of {args.prompts[0]}-{args.prompts[1]} prompt tokens, {args.new_tokens} "
          "new each")  # fmt: skip
    print("| setting | s (two rounds) | tokens/s |")
    print("|---|--:|--:|")
    tokens = args.requests * args.new_tokens
    for name, took in seconds.items():
        mean = sum(took) / len(took)
        print(f"| {name} | {' / '.join(f'{t:.2f}' for t in took)} | {tokens / mean:.0f} |")
    for setting, (totals, counts) in kernels.items():
        print(f"\nGPU ms by kernel, launches (one generate_batch, {setting}):")
        for name, micros in totals.most_common(10):
            print(f"  {micros / 1e3:9.1f} {counts[name]:7d}  {name}")
    print("\nAttention function's host time (the two generate_batch runs profiled):")
    for kind in ("captured", "not captured"):
        print(f"  {kind}: {calls[kind]} calls, {host[kind]:.2f} s")
    print("\nPaged calls (packed queries, rows, route) -> count, the 15 most frequent:")
    for (queries, rows, taken), count in seen.most_common(15):
        print(f"  {queries:6d} {rows:4d} {taken:14s} {count}")


if __name__ == "__main__":
    main()

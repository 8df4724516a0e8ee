"""The attention of continuous batching's captured steps, replayed alone: one ``generate_batch``
of ``batching_bench.py``'s model with CUDA graphs, then for each paged call shape the route
saw while capturing, the tables its graph wrote at its last replay (the step's rows are kept
by the library as long as the process: read after the run), summarised (rows, packed and real
queries, the longest row's keys, the table's width, the pages) and timed alone on random
queries, keys and values of the captured shapes: on FlashAttention 4's paged forward and on
the library's kernels, each as captured (no bound on a row's queries) and with the rows'
bound. Whether a captured step's attention is slow by its tables or by its capture.

    python benchmarks/probes/captured_steps.py [--requests 24] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from batching_bench import add_workload, run, workload
from decode_bench import graph_ms

import attnbias
import attnbias.integrations.transformers as attnbias_hf
import attnbias.paged as route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload(parser, requests=24, new_tokens=64)
    args = parser.parse_args()
    attnbias_hf.register()
    prompts, model = workload(args)
    seen: dict[int, tuple[Any, ...]] = {}  # id of the PagedKV -> the call's shapes
    fa4_route = route.fa4_paged

    def recording(query, key, value, pages, rest, page_size, *more, **kwargs):  # type: ignore[no-untyped-def]
        found = fa4_route(query, key, value, pages, rest, page_size, *more, **kwargs)
        if torch.cuda.is_current_stream_capturing():
            taken = "fa4" if found is not None else "own"
            seen[id(pages)] = (pages, rest, query.shape, key.shape, query.dtype, taken)
        return found

    route.fa4_paged = recording
    try:
        with attnbias_hf.continuous_batching(model):
            seconds = run(model, prompts, args.new_tokens, True)[0]
    finally:
        route.fa4_paged = fa4_route
    print(f"generate_batch with CUDA graphs: {seconds:.2f} s; {len(seen)} captured layouts")
    rows = []
    for pages, rest, q_shape, k_shape, dtype, taken in seen.values():
        lens, cu = pages.seq_lens.long().cpu(), pages.cu_seqlens_q.long().cpu()
        counts = cu[1:] - cu[:-1]
        said = (
            f"{q_shape[2]} packed, {int(cu[-1])} real queries in {int((counts > 0).sum())} of "
            f"{len(lens)} rows (most {int(counts.max())}), keys up to {int(lens.max())} "
            f"(sum {int(lens.sum())}), table {tuple(pages.block_table.shape)}, pages "
            f"{tuple(k_shape[:2])}, captured on {taken}"
        )
        print(" ", said, flush=True)
        query = torch.randn(q_shape, device="cuda", dtype=dtype)
        pool_k, pool_v = (torch.randn(k_shape, device="cuda", dtype=dtype) for _ in range(2))
        bound = max(1, int(counts.max()))
        timings = {}
        for name, paged in (
            ("as captured", pages),
            ("bound", dataclasses.replace(pages, max_seqlen_q=bound)),
        ):
            bias = paged
            for part in rest:
                bias = bias + part
            for backend in ("fa4", "own"):
                exclude = ["fa4"] if backend == "own" else []

                def call(bias=bias, exclude=exclude, q=query, k=pool_k, v=pool_v):  # type: ignore[no-untyped-def]
                    with torch.no_grad(), attnbias.use_backends(exclude=exclude):
                        return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

                try:
                    timings[f"{backend} {name}"] = graph_ms(call)
                except Exception as error:  # (a route that cannot take it: say so, go on)
                    print(f"    {backend} {name}: {type(error).__name__}: {error}", flush=True)
                    timings[f"{backend} {name}"] = float("nan")
                print(f"    {backend} {name}: {timings[f'{backend} {name}']:.3f} ms", flush=True)
        rows.append((said, timings))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per call")
    names = list(rows[0][1]) if rows else []
    print("| layout | " + " | ".join(names) + " |")
    print("|---|" + "--:|" * len(names))
    for said, timings in rows:
        print(f"| {said} | " + " | ".join(f"{timings[n]:.3f}" for n in names) + " |")


if __name__ == "__main__":
    main()

"""Where FlashAttention 4's paged forward beats the library's kernel reading the pages: the
route ``attnbias.sdpa`` takes for a ``PagedKV`` call with FlashAttention 4 allowed from every
query count (``FA4_MIN_QUERIES`` and ``FA4_MIN_RAGGED_MEAN_QUERIES`` 0) against it never
taken, per queries a row (uniform rows and a continuous-batching step of ragged rows: one
prefill chunk among decode rows), pages of 16 and 64, bf16, Hq / Hkv = 32 / 8, E = 128,
B = 8 rows of 4096 to 32768 tokens; ms per call as CUDA-graph replays, two rounds
alternating. The library's kernels run twice: as routed
(``own``: ragged rows of a few queries on the decode kernel, ``paged.SPLIT_SHORT_ROWS``) and
with every ragged row on the training kernel (``unsplit``).

    python benchmarks/probes/fa4_paged.py [--ragged-only]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import attnbias
import attnbias.paged as route
from attnbias import PagedKV, causal_lower_right

sys.path.insert(0, str(Path(__file__).parents[1]))
from decode_bench import graph_ms

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
LENGTHS = [4096, 8192, 12000, 16384, 20000, 24576, 28000, 32768]


def tables(page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    per_row = 32768 // page
    pages = per_row * len(LENGTHS)
    table = torch.randperm(pages).reshape(len(LENGTHS), per_row).int().cuda()
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    shape = (pages, page, HEADS_KV, HEAD_DIM)
    pool_k, pool_v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return table, lens, pool_k, pool_v


def timed(query: torch.Tensor, pool_k, pool_v, bias) -> dict[str, float]:  # type: ignore[no-untyped-def]
    def run() -> torch.Tensor:
        with torch.no_grad():
            return attnbias.sdpa(query, pool_k, pool_v, attn_mask=bias, enable_gqa=True)

    never = 1 << 30
    settings = {"fa4": (0, 0, True), "own": (never, never, True), "unsplit": (never, never, False)}
    names = "FA4_MIN_QUERIES", "FA4_MIN_RAGGED_MEAN_QUERIES", "SPLIT_SHORT_ROWS"
    default = tuple(getattr(route, name) for name in names)
    outs, times = {}, {name: [] for name in settings}
    for round_index in range(2):
        for name in settings if round_index == 0 else list(settings)[::-1]:
            for setting, value in zip(names, settings[name], strict=True):
                setattr(route, setting, value)
            outs[name] = run().float()
            times[name].append(graph_ms(run))
    for setting, value in zip(names, default, strict=True):
        setattr(route, setting, value)
    diff = max(float((outs["fa4"] - outs[name]).abs().max()) for name in ("own", "unsplit"))
    return {**{n: sum(t) / 2 for n, t in times.items()}, "diff": diff}


def main() -> None:
    ragged_only = "--ragged-only" in sys.argv[1:]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| page | queries | fa4 ms | own ms | own / fa4 | unsplit ms | max diff |")
    print("|--:|--|--:|--:|--:|--:|--:|")
    for page in (16, 64):
        table, lens, pool_k, pool_v = tables(page)
        for length_q in () if ragged_only else (16, 32, 64, 128, 256, 512, 2048):
            query = torch.randn(len(LENGTHS), HEADS_Q, length_q, HEAD_DIM, device="cuda",
                                dtype=torch.bfloat16)  # fmt: skip
            r = timed(query, pool_k, pool_v, PagedKV(table, lens) + causal_lower_right())
            print(f"| {page} | {length_q} a row | {r['fa4']:.3f} | {r['own']:.3f} | "
                  f"{r['own'] / r['fa4']:.2f} | {r['unsplit']:.3f} | "
                  f"{r['diff']:.1e} |")  # fmt: skip
        for chunk in (256, 1024):  # one row's prefill chunk, the others decode one token
            counts = [chunk] + [1] * (len(LENGTHS) - 1)
            cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
            query = torch.randn(1, HEADS_Q, sum(counts), HEAD_DIM, device="cuda",
                                dtype=torch.bfloat16)  # fmt: skip
            bias = PagedKV(table, lens, cu_seqlens_q=cu.cuda()) + causal_lower_right()
            r = timed(query, pool_k, pool_v, bias)
            print(f"| {page} | ragged {chunk} + 7 x 1 | {r['fa4']:.3f} | {r['own']:.3f} | "
                  f"{r['own'] / r['fa4']:.2f} | {r['unsplit']:.3f} | "
                  f"{r['diff']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()

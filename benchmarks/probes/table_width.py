"""Whether a paged call's cost follows its block table's width: continuous batching's steps on
transformers before 5.19 read the keys gathered (pages of one token), and a captured step's
table is as wide as the largest key count the capture was told of (millions of slots) while
each row holds a few thousand keys. One layer of ``batching_bench.py``'s model (Hq / Hkv =
32 / 8, E = 64, bf16): a prefill-like step (8192 queries in 23 rows of up to ~3900 keys) and
a decode-like one (24 rows of one query, padded to 64), timed (CUDA-graph replays) on
FlashAttention 4's paged forward and on the library's kernels at several table widths and
pool sizes; and the integration's table fill at each width.

    python benchmarks/probes/table_width.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import attnbias
from attnbias import PagedKV, causal_lower_right

sys.path.insert(0, str(Path(__file__).parents[1]))
from decode_bench import graph_ms

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 64
WIDTHS = (4096, 65536, 1 << 22)
POOLS = (65536, 3809280)


def step(kind: str) -> tuple[list[int], list[int], int]:
    """Each row's query count and key count, and the packed query total."""
    torch.manual_seed(0)
    if kind == "prefill":
        counts = [356] * 23
        counts[0] += 8192 - sum(counts)
        lens = [c + int(p) for c, p in zip(counts, torch.randint(300, 1300, (23,)), strict=True)]
        return counts, lens, 8192
    counts = [1] * 24
    return counts, [int(n) for n in torch.randint(300, 3900, (24,))], 64


def main() -> None:
    rows: list[tuple[str, float]] = []
    for kind in ("prefill", "decode"):
        counts, lens, packed = step(kind)
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()[:-1]])
        cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
        cu, lens_t = cu.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
        query = torch.randn(1, HEADS_Q, packed, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        for pool in POOLS:
            reference = None
            shape = (pool, 1, HEADS_KV, HEAD_DIM)
            pool_k, pool_v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            for width in WIDTHS:
                slots = torch.arange(width, dtype=torch.int32)
                table = (starts[:, None].int() + slots).clamp_(max=pool - 1).cuda()
                bias = PagedKV(table, lens_t, cu_seqlens_q=cu) + causal_lower_right()
                for route in ("fa4", "own"):
                    exclude = ["fa4"] if route == "own" else []

                    def call(bias=bias, exclude=exclude, q=query, k=pool_k, v=pool_v):  # type: ignore[no-untyped-def]
                        with torch.no_grad(), attnbias.use_backends(exclude=exclude):
                            return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

                    try:
                        out = call()[:, :, : sum(counts)].float()
                        if reference is None:
                            reference = out
                        error = f"err {(out - reference).abs().max().item():.1e}"
                        ms = graph_ms(call)
                    except Exception as exc:  # a route that cannot take it: named, go on
                        error, ms = f"{type(exc).__name__}: {str(exc)[:80]}", float("nan")
                    name = f"{kind} pool {pool} width {width} {route} ({error})"
                    rows.append((name, ms))
                    print(f"  {name}: {ms:.3f} ms", flush=True)
                del table, bias
            del pool_k, pool_v
    for width in WIDTHS:  # the integration's fill of a captured step's table (24 rows)
        first = torch.zeros(24, 1, dtype=torch.int32, device="cuda")
        target = torch.zeros(24, width, dtype=torch.int32, device="cuda")

        def fill(first=first, target=target, width=width):  # type: ignore[no-untyped-def]
            slots = torch.arange(width, dtype=torch.int32, device="cuda")
            target.copy_((first + slots).clamp_(max=POOLS[-1] - 1))

        rows.append((f"table fill, width {width}", graph_ms(fill)))
        print(f"  {rows[-1][0]}: {rows[-1][1]:.3f} ms", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| call | ms |\n|---|--:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()

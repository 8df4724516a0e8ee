"""What a continuous-batching step padded for CUDA graphs costs in attention: one layer of
``batching_bench.py``'s model (Hq / Hkv = 32 / 8, E = 64, bf16) over a paged cache (pages of
256), 24 rows of 300-4600 keys, four prefill chunks of 1500 queries and twenty decode rows
(6020 queries) packed, padded to 8192 queries past the last row. ms per call (CUDA-graph
replays) on FlashAttention 4's paged forward and on the library's kernels, each with the
rows' bound (``max_seqlen_q``, as eager steps pass it) and without it (as a captured step
runs: each row at the padded total), and the unpadded step for reference.

    python benchmarks/probes/padded_step.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import attnbias
from attnbias import PagedKV, causal_lower_right

sys.path.insert(0, str(Path(__file__).parents[1]))
from decode_bench import graph_ms

HEADS_Q, HEADS_KV, HEAD_DIM, PAGE = 32, 8, 64, 256


def main() -> None:
    torch.manual_seed(0)
    counts = [1500] * 4 + [1] * 20
    lens = [c + int(p) for c, p in zip(counts, torch.randint(300, 3100, (24,)), strict=True)]
    per_row = -(-max(lens) // PAGE)
    pages = per_row * len(lens)
    table = torch.randperm(pages).reshape(len(lens), per_row).int().cuda()
    shape = (pages, PAGE, HEADS_KV, HEAD_DIM)
    pool_k, pool_v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    real = sum(counts)
    query = torch.randn(1, HEADS_Q, 8192, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    rows: list[tuple[str, float]] = []
    reference = None
    for padded in (True, False):
        q = query if padded else query[:, :, :real]
        for bound in (None, 1500):
            pagedkv = PagedKV(table, lens_t, cu_seqlens_q=cu, max_seqlen_q=bound)
            bias = pagedkv + causal_lower_right()
            for route in ("fa4", "own"):
                exclude = ["fa4"] if route == "own" else []

                def call(q=q, bias=bias, exclude=exclude):  # type: ignore[no-untyped-def]
                    with torch.no_grad(), attnbias.use_backends(exclude=exclude):
                        return attnbias.sdpa(q, pool_k, pool_v, attn_mask=bias, enable_gqa=True)

                out = call()
                with attnbias.use_backends(exclude=exclude):
                    said = attnbias.explain(q, pool_k, pool_v, attn_mask=bias, enable_gqa=True)
                if reference is None:
                    reference = out[:, :, :real].float()
                error = (out[:, :, :real].float() - reference).abs().max().item()
                zeros = bool((out[:, :, real:] == 0).all())
                took = "FlashAttention 4" if "FlashAttention 4's paged" in said else "own"
                name = (f"{'padded' if padded else 'unpadded'} bound={bound} {route} "
                        f"({took}; err {error:.1e}, zeros past {zeros})")  # fmt: skip
                rows.append((name, graph_ms(call)))
                print(f"  {name}: {rows[-1][1]:.3f} ms", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| step | ms |\n|---|--:|")
    for name, ms in rows:
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()

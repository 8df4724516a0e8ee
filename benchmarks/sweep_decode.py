"""Tune the decode kernel's tiles: CUDA-graph time of every (block_n, warps, stages, splits)
for a few decode cases (bf16, B=8, Hq=32, Hkv=8, E=128), next to the split count the
heuristic picks and the bytes floor.

Run on the GPU: ``python benchmarks/sweep_decode.py``; prints one markdown table per case,
fastest first.
"""

from __future__ import annotations

import itertools
import math

import torch

from attnbias import SlidingWindowBias, causal_lower_right
from attnbias.kernels import decode
from attnbias.spec import lower

# isort: split
from decode_bench import WINDOW, draw, floor_ms, graph_ms

CASES = {
    "window L=1 S=32768": (1, 32768, True),
    "window L=16 S=32768": (16, 32768, True),
    "causal L=1 S=8192": (1, 8192, False),
    "causal L=16 S=8192": (16, 8192, False),
    "causal L=4 S=131072": (4, 131072, False),
}
BLOCK_N, WARPS, STAGES, SPLITS = (32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8, 16)


def sweep(name: str, length_q: int, length_kv: int, window: bool) -> None:
    tuned, tuned_small = decode._GPU_CONFIGS[128], decode._GPU_SMALL_TILE_CONFIGS[128]
    q, k, v = draw(length_q, length_kv)
    bias = causal_lower_right()
    if window:
        bias = bias + SlidingWindowBias(WINDOW - 1)
    program = lower(bias, length_q, length_kv, q.device, batch=q.shape[0]).program
    share = min(WINDOW + length_q, length_kv) / length_kv if window else 1.0
    floor = floor_ms(k, v) * share
    layout_now = decode.plan_decode(q, k, v, program, scale=0.1).layout
    assert layout_now is not None
    splits_now, now_config = layout_now.splits, layout_now.config
    print(f"\n## {name}: floor {floor:.4f} ms; now {now_config}, {splits_now} splits\n")
    print("| block_n | warps | stages | splits | ms | floor / ms |")
    print("|--:|--:|--:|--:|--:|--:|")
    rows = []
    for block_n, warps, stages in itertools.product(BLOCK_N, WARPS, STAGES):
        swept = decode.DecodeConfig(block_n, 64, warps, stages)
        decode._GPU_CONFIGS[128] = decode._GPU_SMALL_TILE_CONFIGS[128] = swept
        for splits in SPLITS:
            try:
                plan = decode.plan_decode(q, k, v, program, scale=0.1, num_splits=splits)
                ms = graph_ms(lambda plan=plan: plan.launch(q, k, v))
            except Exception as exc:  # out of shared memory, ...
                print(f"  {block_n}/{warps}/{stages}/{splits}: {type(exc).__name__}")
                ms = math.inf
            rows.append((ms, block_n, warps, stages, splits))
    decode._GPU_CONFIGS[128], decode._GPU_SMALL_TILE_CONFIGS[128] = tuned, tuned_small
    now = (now_config.block_n, now_config.num_warps, now_config.num_stages, splits_now)
    for ms, *config in sorted(rows)[:10] + [r for r in rows if tuple(r[1:]) == now]:
        label = " (now)" if tuple(config) == now else ""
        cells = " | ".join(str(c) for c in config)
        print(f"| {cells}{label} | {ms:.4f} | {floor / ms:.2f} |")


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, case in CASES.items():
        sweep(name, *case)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

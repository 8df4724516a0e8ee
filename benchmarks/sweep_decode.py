"""Tune the decode kernel's tiles: CUDA-graph time of every (block_n, warps, stages, splits)
for a few decode cases (bf16, B=8, Hq=32, Hkv=8, E=128), next to the split count the
heuristic picks and the bytes floor.

``--ragged``: instead, ``paged_bench.py``'s rows (4096 to 32768 tokens) with L = 1 and 16
(``--queries``), over pages of ``--page`` tokens, causal or with a ``--window``,
through ``attnbias.sdpa`` as it routes them, on the contiguous cache (a key range keeping
each row's tokens) and on the pages: every (block_n, warps, stages, rows per tile where
L > 1) with the split count the rule picks for rows of unequal lengths and twice it,
against the measured floor of the bytes the rows keep.

Run on the GPU: ``python benchmarks/sweep_decode.py [--ragged [--queries 16]]``; prints one
markdown table per case, fastest first.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch

import attnbias
from attnbias import KeyRangeBias, PagedKV, SlidingWindowBias, causal_lower_right, plan_cache
from attnbias.kernels import decode
from attnbias.spec import lower

# isort: split
from decode_bench import WINDOW, draw, floor_ms, graph_ms
from paged_bench import CAPACITY, HEADS_KV, LENGTHS, cache

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


def sweep_ragged(length_q: int, page: int = 64, window: int | None = None) -> None:
    """The ``--ragged`` table for L = ``length_q`` over pages of ``page`` tokens, with a
    sliding window of ``window`` keys before each query where given."""
    tuned, tuned_small = decode._GPU_CONFIGS[128], decode._GPU_SMALL_TILE_CONFIGS[128]
    splitting = decode.num_splits
    q, pool_k, pool_v, table, lens, k, v = cache(page, length_q)
    reach = LENGTHS if window is None else [min(n, window + length_q) for n in LENGTHS]
    kept = torch.empty(sum(reach), HEADS_KV, k.shape[-1], device=k.device, dtype=k.dtype)
    floor = floor_ms(kept, kept)
    del kept
    rest = causal_lower_right()
    if window is not None:
        rest = rest + SlidingWindowBias(window)
    print(f"\n## ragged rows, L={length_q}, pages of {page}, window {window}: "
          f"floor {floor:.4f} ms\n")  # fmt: skip
    print("| block_n | warps | stages | rows | splits | contiguous ms | floor / ms | paged ms "
          "| floor / ms |")  # fmt: skip
    print("|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    starts = (CAPACITY - lens).int()
    tiles = (decode.MIN_ROWS,) if length_q == 1 else (decode.MIN_ROWS, 64)
    grid = [None, *itertools.product(BLOCK_N, WARPS, STAGES, tiles)]
    rows = []
    reference = None
    for swept, factor in itertools.product(grid, (1, 2)):
        if swept is None and factor != 1:
            continue
        seen: list[int] = []

        def splits(*args, factor=factor, seen=seen, **kwargs):  # type: ignore[no-untyped-def]
            found = min(decode.MAX_SPLITS, splitting(*args, **kwargs) * factor)
            seen.append(found)
            return found

        if swept is not None:
            block_n, warps, stages, max_rows = swept
            config = decode.DecodeConfig(block_n, max_rows, warps, stages, full_enough=0.45)
            decode._GPU_CONFIGS[128] = decode._GPU_SMALL_TILE_CONFIGS[128] = config
        decode.num_splits = splits
        plan_cache.clear()  # (and new biases: nothing planned for another setting is reused)
        biases = {
            "contiguous": (k, v, KeyRangeBias(start=starts) + rest),
            "paged": (pool_k, pool_v, PagedKV(table, lens) + rest),
        }  # fmt: skip
        times = {}
        try:
            with torch.no_grad():
                for name, (keys, values, bias) in biases.items():

                    def call(keys=keys, values=values, bias=bias):  # type: ignore[no-untyped-def]
                        return attnbias.sdpa(q, keys, values, attn_mask=bias, enable_gqa=True)

                    out = call().float()
                    reference = out if reference is None else reference
                    if (error := (out - reference).abs().max().item()) > 1e-2:
                        raise AssertionError(f"{name} differs by {error:.1e}")
                    times[name] = graph_ms(call)
        except Exception as exc:  # out of shared memory, ...
            print(f"  {swept}: {type(exc).__name__}: {str(exc)[:100]}")
            times = {"contiguous": math.inf, "paged": math.inf}
        finally:
            decode._GPU_CONFIGS[128], decode._GPU_SMALL_TILE_CONFIGS[128] = tuned, tuned_small
            decode.num_splits = splitting
        label = "now" if swept is None else " | ".join(str(c) for c in swept)
        if swept is None:
            label += " | | |"
        rows.append((times["paged"], times["contiguous"], label, sorted(set(seen))))
    for paged, contiguous, label, used in sorted(rows)[:12] + [r for r in rows if "now" in r[2]]:
        print(f"| {label} | {used} | {contiguous:.4f} | {floor / contiguous:.2f} | "
              f"{paged:.4f} | {floor / paged:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ragged", action="store_true")
    parser.add_argument(
        "--queries", default="1,16", help="with --ragged: the L of the tables (each takes "
        "minutes: L = 1 alone ~5 on an H200)",
    )  # fmt: skip
    parser.add_argument("--page", type=int, default=64, help="with --ragged: tokens a page")
    parser.add_argument("--window", type=int, help="with --ragged: a sliding window of keys")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.ragged:
        for length_q in (int(n) for n in args.queries.split(",")):
            sweep_ragged(length_q, args.page, args.window)
            torch.cuda.empty_cache()
        return
    for name, case in CASES.items():
        sweep(name, *case)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

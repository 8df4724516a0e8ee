"""The decode kernel's launch parameters on this GPU: ``paged_bench.py``'s decode shapes (B = 8
rows of 4096 to 32768 tokens, Hq / Hkv = 32 / 8, E = 128, bf16, L = 1) on a contiguous cache
(a key range keeping each row's tokens) and on pages of 64, timed (CUDA-graph replays) under
each ``DecodeConfig`` (keys per block, warps, stages) and split count (the rule's, and twice
it) against the measured bytes floor (half a device-to-device copy of the kept keys and
values). Whether the kernel's parameters, tuned on an H100, leave bandwidth on another GPU.

    python benchmarks/probes/decode_sweep.py [--queries 16]

``--queries``: L, each row's last L tokens (the packed rows per tile, 16 or 64, swept too
where L > 1).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

import attnbias
import attnbias.kernels.decode as decode
import attnbias.plan_cache as plan_cache
from attnbias import KeyRangeBias, PagedKV, causal_lower_right

sys.path.insert(0, str(Path(__file__).parents[1]))
from decode_bench import floor_ms, graph_ms

HEADS_Q, HEADS_KV, HEAD_DIM, PAGE = 32, 8, 128, 64
LENGTHS = [4096, 8192, 12000, 16384, 20000, 24576, 28000, 32768]
CAPACITY = 32768


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=1)
    queries = parser.parse_args().queries
    torch.manual_seed(0)
    batch = len(LENGTHS)
    lens = torch.tensor(LENGTHS, dtype=torch.int32, device="cuda")
    per_row = CAPACITY // PAGE
    table = torch.randperm(batch * per_row, device="cuda").int().reshape(batch, per_row)
    shape = (batch * per_row, PAGE, HEADS_KV, HEAD_DIM)
    pool_k, pool_v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    # the same tokens contiguous, each row's at the end of its cache
    k = torch.zeros(batch, HEADS_KV, CAPACITY, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros_like(k)
    for b, n in enumerate(LENGTHS):
        t = torch.arange(n, device="cuda")
        rows = table[b, t // PAGE].long() * PAGE + t % PAGE
        k[b, :, CAPACITY - n :] = pool_k.reshape(-1, HEADS_KV, HEAD_DIM)[rows].transpose(0, 1)
        v[b, :, CAPACITY - n :] = pool_v.reshape(-1, HEADS_KV, HEAD_DIM)[rows].transpose(0, 1)
    q = torch.randn(batch, HEADS_Q, queries, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kept = torch.empty(sum(LENGTHS), HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    floor = floor_ms(kept, kept)
    del kept
    print(f"measured floor {floor:.3f} ms", flush=True)

    choose, splitting = decode.decode_config, decode.num_splits
    tiles = (decode.MIN_ROWS,) if queries == 1 else (decode.MIN_ROWS, 64)
    configs = [None] + [
        decode.DecodeConfig(block_n, tile_rows, warps, stages, full_enough=0.45)
        for tile_rows in tiles
        for block_n, warps, stages in (
            (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 4, 4),
            (128, 8, 3),
        )
    ]  # fmt: skip
    reference = None
    rows = []
    for config, factor in itertools.product(configs, (1.0, 2.0)):
        if config is None and factor != 1.0:
            continue
        seen: list[int] = []

        def config_of(*args, config=config, **kwargs):  # type: ignore[no-untyped-def]
            return choose(*args, **kwargs) if config is None else config

        def splits_of(*args, factor=factor, seen=seen, **kwargs):  # type: ignore[no-untyped-def]
            found = max(1, min(decode.MAX_SPLITS, round(splitting(*args, **kwargs) * factor)))
            seen.append(found)
            return found

        decode.decode_config, decode.num_splits = config_of, splits_of
        plan_cache.clear()
        paged_bias = PagedKV(table, lens) + causal_lower_right()
        range_bias = KeyRangeBias(start=(CAPACITY - lens).int()) + causal_lower_right()
        name = "as tuned" if config is None else (
            f"rows {config.max_rows} n{config.block_n} w{config.num_warps} "
            f"s{config.num_stages}")  # fmt: skip
        name += f" splits x{factor:g}"
        try:
            with torch.no_grad():
                times = {}
                for route, (keys, values, bias) in (
                    ("contiguous", (k, v, range_bias)),
                    ("paged", (pool_k, pool_v, paged_bias)),
                ):

                    def call(keys=keys, values=values, bias=bias):  # type: ignore[no-untyped-def]
                        return attnbias.sdpa(q, keys, values, attn_mask=bias, enable_gqa=True)

                    out = call().float()
                    if reference is None:
                        reference = out
                    error = (out - reference).abs().max().item()
                    if error > 1e-2:
                        raise AssertionError(f"{route} differs by {error:.1e}")
                    times[route] = graph_ms(call)
        except Exception as exc:  # a configuration that does not compile or fit: named
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        finally:
            decode.decode_config, decode.num_splits = choose, splitting
        said = f"splits {sorted(set(seen))}"
        rows.append((name, said, times["contiguous"], times["paged"]))
        print(f"  {name} ({said}): contiguous {times['contiguous']:.3f} ms, paged "
              f"{times['paged']:.3f} ms", flush=True)  # fmt: skip
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; L = {queries}; "
          f"measured floor {floor:.3f} ms")  # fmt: skip
    print("| config | splits | contiguous ms | % floor | paged ms | % floor |")
    print("|---|---|--:|--:|--:|--:|")
    for name, said, contiguous, paged in sorted(rows, key=lambda r: r[3]):
        print(f"| {name} | {said} | {contiguous:.3f} | {100 * floor / contiguous:.0f} | "
              f"{paged:.3f} | {100 * floor / paged:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()

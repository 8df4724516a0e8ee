"""Host time per forward call: attnbias.sdpa routed to FlashAttention 4 against calling
FlashAttention 4 directly, on a sliding window (bf16, B=1, H=16, S=4096, E=128, inputs that
require grad). Each loop issues calls without waiting for the GPU, so its time per call is the
host's; then the top of a profile of the attnbias call."""

from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

import torch
from flash_attn.cute import flash_attn_func

import attnbias
from attnbias import SlidingWindowBias

# isort: split
# benchmarks/measure.py, the folder above this script's
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from measure import host_us


def main() -> None:
    q, k, v = (
        torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    bias = SlidingWindowBias(1023)
    ours = lambda: attnbias.sdpa(q, k, v, attn_mask=bias)
    direct = lambda: flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_size=(1023, 0)
    )[0].transpose(1, 2)
    plan = lambda: attnbias.explain(q, k, v, attn_mask=bias)
    for name, fn in (("attnbias", ours), ("fa4 direct", direct), ("explain", plan)):
        print(f"| {name} | {min(host_us(fn, calls=50) for _ in range(3)):.1f} us per call |")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        ours()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

"""A decode loop on a key/value cache: one new token per step against a left-padded cache that
fills up, with one bias object for the whole loop instead of a mask per step.

The bias is each batch row's valid keys (``KeyRangeBias``: the left padding and the filled
length, as int32 tensors on the device that each step advances in place) plus lower-right
causal and a sliding window of 1024 keys. On a GPU the short queries take the Triton decode
kernel (the query heads of a key/value group packed into one tile, the cache split across
programs), which reads no key outside the range: the unfilled end of the buffer is never
touched. Nothing on the host depends on the positions, so such a step can also be captured in
a CUDA graph and replayed. Each step is checked against a bias made afresh for it; on a CPU
the same loop runs on the exact routes.

    python examples/decode_step.py
"""

from __future__ import annotations

import math
import time

import torch

import attnbias
from attnbias import KeyRangeBias, SlidingWindowBias, causal_lower_right

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, STEPS = 4, 32, 8, 128, 16


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    capacity, prompt = (8192, 6000) if cuda else (512, 400)
    padding = [0, prompt // 60, prompt // 6, prompt // 2]  # left padding of each batch row
    torch.manual_seed(0)

    # The cache buffer, its first `prompt` slots filled; the rest is garbage never to be read.
    cache_k = torch.randn(BATCH, HEADS_KV, capacity, HEAD_DIM, device=device, dtype=dtype)
    cache_v = torch.randn_like(cache_k)
    cache_k[:, :, prompt:] = math.nan
    cache_v[:, :, prompt:] = math.nan
    start = torch.tensor(padding, dtype=torch.int32, device=device)
    end = torch.full((BATCH,), prompt, dtype=torch.int32, device=device)
    # int32 (B,) positions on the device are read at each call, not copied: the loop advances
    # `end` in place and keeps this one bias
    bias = KeyRangeBias(start=start, end=end) + causal_lower_right() + SlidingWindowBias(1023)

    query = torch.randn(BATCH, HEADS_Q, 1, HEAD_DIM, device=device, dtype=dtype)
    with torch.no_grad():
        print(attnbias.explain(query, cache_k, cache_v, attn_mask=bias, enable_gqa=True))
        worst, elapsed = 0.0, 0.0
        for _ in range(STEPS):
            # the new token's key and value go in at `end`, then every row's range grows by one
            position = int(end[0])
            cache_k[:, :, position] = torch.randn_like(cache_k[:, :, position])
            cache_v[:, :, position] = torch.randn_like(cache_v[:, :, position])
            end += 1
            query.normal_()
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            out = attnbias.sdpa(query, cache_k, cache_v, attn_mask=bias, enable_gqa=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed += time.perf_counter() - began
            # the same step with a bias made for it, on the exact eager path
            fresh = (
                KeyRangeBias(start=padding, end=end.tolist())
                + causal_lower_right()
                + SlidingWindowBias(1023)
            )
            with attnbias.use_backends("reference"):
                expected = attnbias.sdpa(
                    query.double(), cache_k.double(), cache_v.double(), fresh, enable_gqa=True
                )
            worst = max(worst, (out.double() - expected).abs().max().item())
    print(
        f"\n{STEPS} steps on {device}, cache of {capacity} slots filled to {int(end[0])}: "
        f"{elapsed / STEPS * 1e3:.3f} ms per step; largest error against the float64 exact "
        f"path: {worst:.1e}"
    )
    assert math.isfinite(worst) and worst < (2e-2 if cuda else 1e-5), worst


if __name__ == "__main__":
    main()

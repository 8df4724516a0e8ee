"""A decode loop on a key/value cache: one new token per step against a left-padded cache that
fills up, with one bias object for the whole loop instead of a mask per step.

The bias is each batch row's valid keys, one ``KeyRangeBias``: from the later of its left
padding and 1024 keys before the filled end (a sliding window; 256 on a CPU) up to the filled
end. Its positions are int32 tensors on the device that each step advances in place. (A band
such as ``SlidingWindowBias`` is aligned with the end of the key/value tensor, the buffer's
capacity, not with the filled end: here it would keep only unfilled slots.) On a GPU the short
queries take the Triton decode kernel (the query heads of a key/value group packed into one
tile, the cache split across programs), which reads no key outside the range: the unfilled end
of the buffer is never touched. Nothing on the host depends on the positions, so such a step
can also be captured in a CUDA graph and replayed. On a CPU the same loop runs on the exact
routes. Each step is checked against an independent float64 computation with stock PyTorch: a
softmax over the filled slots, masked by comparing ``torch.arange`` with each row's padding
and filled length.

    python examples/decode_step.py
"""

from __future__ import annotations

import math
import time

import torch

import attnbias
from attnbias import KeyRangeBias

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, STEPS = 4, 32, 8, 128, 16


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    capacity, prompt, window = (8192, 6000, 1024) if cuda else (512, 400, 256)
    padding = [0, prompt // 60, prompt // 6, prompt // 2]  # left padding of each batch row
    torch.manual_seed(0)

    # The cache buffer, its first `prompt` slots filled; the rest is garbage never to be read.
    cache_k = torch.randn(BATCH, HEADS_KV, capacity, HEAD_DIM, device=device, dtype=dtype)
    cache_v = torch.randn_like(cache_k)
    cache_k[:, :, prompt:] = math.nan
    cache_v[:, :, prompt:] = math.nan
    left_padding = torch.tensor(padding, dtype=torch.int32, device=device)
    end = torch.full((BATCH,), prompt, dtype=torch.int32, device=device)
    start = torch.maximum(left_padding, end - window)
    # int32 (B,) positions on the device are read at each call, not copied: the loop advances
    # `start` and `end` in place and keeps this one bias
    bias = KeyRangeBias(start=start, end=end)

    query = torch.randn(BATCH, HEADS_Q, 1, HEAD_DIM, device=device, dtype=dtype)
    with torch.no_grad():
        print(attnbias.explain(query, cache_k, cache_v, attn_mask=bias, enable_gqa=True))
        worst, elapsed = 0.0, 0.0
        for step in range(STEPS):
            # the new token's key and value go in at `end`, then every row's range grows by one
            position = int(end[0])
            cache_k[:, :, position] = torch.randn_like(cache_k[:, :, position])
            cache_v[:, :, position] = torch.randn_like(cache_v[:, :, position])
            end += 1
            torch.maximum(left_padding, end - window, out=start)
            query.normal_()
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            out = attnbias.sdpa(query, cache_k, cache_v, attn_mask=bias, enable_gqa=True)
            if cuda:
                torch.cuda.synchronize()
            elapsed += time.perf_counter() - began
            # the same step in float64 with stock PyTorch, on the filled slots only
            filled = prompt + step + 1
            k, v = (
                c[:, :, :filled].double().repeat_interleave(HEADS_Q // HEADS_KV, dim=1)
                for c in (cache_k, cache_v)
            )
            slot = torch.arange(filled, device=device)
            after_padding = slot >= torch.tensor(padding, device=device)[:, None]  # (B, S)
            keep = (after_padding & (slot >= filled - window))[:, None, None, :]  # (B, 1, 1, S)
            scores = query.double() @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
            scores = scores.masked_fill(~keep, -math.inf)
            # a row that keeps no key gives 0, as attnbias's contract says
            weights = torch.softmax(scores.masked_fill(~keep.any(-1, keepdim=True), 0.0), -1)
            expected = (weights * keep) @ v
            worst = max(worst, (out.double() - expected).abs().max().item())
    print(
        f"\n{STEPS} steps on {device}, cache of {capacity} slots filled to {int(end[0])}: "
        f"{elapsed / STEPS * 1e3:.3f} ms per step; largest error against float64 stock "
        f"PyTorch: {worst:.1e}"
    )
    assert math.isfinite(worst) and worst < (2e-2 if cuda else 1e-5), worst


if __name__ == "__main__":
    main()

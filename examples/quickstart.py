"""attnbias in five minutes: every bias through one drop-in ``sdpa``.

Runs each built-in bias, and a Gemma 2 style composition, through ``attnbias.sdpa`` on the best
available device, checks each result against a float64 reference computed by stock PyTorch on
the materialized mask, and prints a table: the bias, the route ``sdpa`` took (see
``attnbias.explain``), the largest error, and the time of one call.

    python examples/quickstart.py
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

import attnbias
from attnbias import (
    AlibiBias,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    sdpa,
)


def reference(q, k, v, bias, enable_gqa=False):  # type: ignore[no-untyped-def]
    """Float64 attention on the materialized bias; soft-cap, which has no materialized form,
    is applied to the scores by hand."""
    q, k, v = q.double(), k.double(), v.double()
    parts = bias.parts if isinstance(bias, attnbias.biases.CompositeBias) else (bias,)
    caps = [p.cap for p in parts if isinstance(p, SoftcapBias)]
    rest = [p for p in parts if not isinstance(p, SoftcapBias)]
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    mask = sum(p.materialize(q.device, shape=shape, dtype=torch.float64) for p in rest)
    if not caps:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = caps[0] * torch.tanh(scores / caps[0]) + mask
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


def timed(fn, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of ``fn()`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    torch.manual_seed(0)
    if torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
        batch, heads_q, heads_kv, length, head_dim = 2, 16, 4, 2048, 128
    else:
        device, dtype = "cpu", torch.float32
        batch, heads_q, heads_kv, length, head_dim = 1, 4, 2, 256, 64
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, dtype {dtype}")
    print(f"shapes: query (B, Hq, L, E) = ({batch}, {heads_q}, {length}, {head_dim}), "
          f"key/value Hkv = {heads_kv} (grouped-query attention)\n")  # fmt: skip

    def draw(heads: int, seq: int) -> torch.Tensor:
        return torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    q, k, v = draw(heads_q, length), draw(heads_kv, length), draw(heads_kv, length)
    q_new = draw(heads_q, length // 8)  # chunked prefill: a chunk of queries against the cache
    documents = DocumentBias.from_seqlens(
        [length // 2, length // 4, length // 8, length // 8], device=device
    )
    cases = [
        ("causal (upper-left)", causal_upper_left(), q),
        ("causal (lower-right), L < S", causal_lower_right(), q_new),
        ("sliding window 128 + causal", SlidingWindowBias(127), q),
        ("documents + causal", documents + causal_upper_left(), q),
        ("ALiBi + causal", AlibiBias(num_heads=heads_q) + causal_upper_left(), q),
        ("soft-cap 50 + causal", SoftcapBias(50.0) + causal_upper_left(), q),
        (
            "Gemma 2: window 4096 + soft-cap + causal",
            SlidingWindowBias(4095) + SoftcapBias(50.0) + causal_lower_right(),
            q,
        ),
        ("tensor (materialized)", TensorBias(torch.randn(length, length, device=device)), q),
    ]

    rows = []
    for name, bias, query in cases:
        route = attnbias.explain(query, k, v, attn_mask=bias, enable_gqa=True).split(":")[0]
        out = sdpa(query, k, v, attn_mask=bias, enable_gqa=True)
        error = (out.double() - reference(query, k, v, bias, enable_gqa=True)).abs().max().item()
        ms = timed(lambda b=bias, qq=query: sdpa(qq, k, v, attn_mask=b, enable_gqa=True))
        rows.append((name, route, f"{error:.2e}", f"{ms:.3f}"))

    header = ("bias", "route", "max error", "ms")
    widths = [max(len(row[c]) for row in [*rows, header]) for c in range(4)]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    print(
        f"\nmax error is against a float64 reference; {dtype} rounding alone gives errors near "
        f"{torch.finfo(dtype).eps:.0e}. Ask attnbias.explain(...) why a route was chosen."
    )
    print("\n" + attnbias.explain(q, k, v, attn_mask=cases[6][1], enable_gqa=True))


if __name__ == "__main__":
    main()

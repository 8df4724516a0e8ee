"""The cost of being automatic, and a transformer block on the automatic route.

1. For a few calls, the automatic route (decided, then served from the plan cache) against the
   backend it chose pinned with ``use_backends``: the CUDA kernels one call launches (they must
   be the same), the host time of a call (issued without waiting for the GPU; the cost of
   entering ``use_backends`` is taken off the pinned call), and the time of a call as a loop
   sees it (rounds interleaved, medians).
2. A repeated tiny call (1×1×128×64, a window, forward + backward) against stock SDPA causal.
3. A transformer block (d=1024, 16 heads of 64, query/key/value views of one projection, a
   window of 511 + ALiBi): eager and under ``torch.compile``, automatic against
   ``use_backends("triton")``, forward without gradients and forward + backward; then the
   top of a profile of the compiled automatic forward.

    python benchmarks/auto_vs_pinned.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import attnbias
from attnbias import AlibiBias, SlidingWindowBias, causal_lower_right, use_backends

sys.path.insert(0, str(Path(__file__).parent))
from measure import host_us_interleaved


def kernels(fn: Callable[[], Any]) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches, in order."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def loop_ms(
    fns: dict[str, Callable[[], Any]], calls: int = 20, rounds: int = 9
) -> dict[str, float]:
    """Milliseconds per call of each of ``fns`` in a loop of ``calls`` calls (one
    synchronisation at its end), rounds interleaved, medians."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for index in range(rounds):
        order = list(fns.items()) if index % 2 == 0 else list(fns.items())[::-1]
        for name, fn in order:
            torch.cuda.synchronize()
            began = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append(1e3 * (time.perf_counter() - began) / calls)
    return {name: statistics.median(found) for name, found in times.items()}


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any, grad: bool) -> Any:
    grad_out = torch.ones_like(q) if grad else None

    def run() -> None:
        if grad_out is None:
            with torch.no_grad():
                attnbias.sdpa(q, k, v, attn_mask=bias)
            return
        out = attnbias.sdpa(q, k, v, attn_mask=bias)
        out.backward(grad_out)
        q.grad = k.grad = v.grad = None

    return run


def pinned(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> None:
        with use_backends(name):
            fn()

    return run


def auto_against_pinned() -> list[str]:
    rows = []
    cases = [
        ("B64 H12 S512 E64 window 128, f+b", (64, 12, 512, 64), 128, True),
        ("B64 H12 S512 E64 window 128, fwd", (64, 12, 512, 64), 128, False),
        ("B4 H16 S4096 E128 causal + window 1024, fwd (inputs require grad)",
         (4, 16, 4096, 128), 1024, None),
        ("B1 H1 S128 E64 window 32, f+b", (1, 1, 128, 64), 32, True),
    ]  # fmt: skip
    for label, (b, h, s, e), window, grad in cases:
        requires = grad is not False
        q, k, v = (
            torch.randn(b, h, s, e, device="cuda", dtype=torch.bfloat16).requires_grad_(requires)
            for _ in range(3)
        )
        bias = causal_lower_right() + SlidingWindowBias(window)
        if grad is None:  # forward only, with inputs that require grad
            auto = partial(attnbias.sdpa, q, k, v, attn_mask=bias)
        else:
            auto = step(q, k, v, bias, grad)
        auto()
        auto()  # decides
        route = attnbias.explain(q, k, v, attn_mask=bias).split(":")[0].split("(")[0]
        pin = pinned(route, auto)
        same = kernels(auto) == kernels(pin)
        null = pinned(route, lambda: None)
        host = host_us_interleaved({"auto": auto, "pinned": pin, "null": null}, rounds=9)
        times = loop_ms({"auto": auto, "pinned": pin})
        rows.append(
            f"| {label} | {route} | {same} | {host['auto']:.1f} | "
            f"{host['pinned'] - host['null']:.1f} | {times['auto']:.4f} | {times['pinned']:.4f} "
            f"| {times['auto'] / times['pinned']:.3f} |"
        )
        print(rows[-1], flush=True)
    return rows


def tiny() -> str:
    q, k, v = (
        torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    bias = causal_lower_right() + SlidingWindowBias(32)
    grad_out = torch.ones_like(q)

    def ours() -> None:
        attnbias.sdpa(q, k, v, attn_mask=bias).backward(grad_out)

    def stock() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)

    times = loop_ms({"ours": ours, "stock": stock}, calls=50)
    return (
        f"tiny 1x1x128x64 window 32 f+b: attnbias {times['ours']:.4f} ms, stock causal "
        f"{times['stock']:.4f} ms, ratio {times['ours'] / times['stock']:.3f}"
    )


class Block(nn.Module):
    def __init__(self, d: int = 1024, heads: int = 16) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.bias = causal_lower_right() + SlidingWindowBias(511) + AlibiBias(heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        o = attnbias.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.bias)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


def block() -> list[str]:
    model = Block().cuda().to(torch.bfloat16)
    x = torch.randn(8, 2048, 1024, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()

    def forward_auto(t: torch.Tensor) -> torch.Tensor:
        return model(t)

    def forward_pinned(t: torch.Tensor) -> torch.Tensor:
        return model(t)

    compiled_auto = torch.compile(forward_auto)
    compiled_pinned = torch.compile(forward_pinned)

    def fwd(fn: Callable[[torch.Tensor], torch.Tensor], pin: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                if pin:
                    with use_backends("triton"):
                        fn(x)
                else:
                    fn(x)

        return run

    def fb(fn: Callable[[torch.Tensor], torch.Tensor], pin: bool) -> Callable[[], None]:
        def run() -> None:
            if pin:
                with use_backends("triton"):
                    fn(xg).sum().backward()
            else:
                fn(xg).sum().backward()
            xg.grad = None
            model.zero_grad(set_to_none=True)

        return run

    for fn in (fwd(model, False), fb(model, False)):  # eager first: routing decides
        fn()
        fn()
    times = loop_ms(
        {
            "eager fwd auto": fwd(model, False),
            "eager fwd triton": fwd(model, True),
            "compiled fwd auto": fwd(compiled_auto, False),
            "compiled fwd triton": fwd(compiled_pinned, True),
        },
        calls=10,
    )
    times.update(
        loop_ms(
            {
                "eager f+b auto": fb(model, False),
                "eager f+b triton": fb(model, True),
                "compiled f+b auto": fb(compiled_auto, False),
                "compiled f+b triton": fb(compiled_pinned, True),
            },
            calls=10,
        )
    )
    rows = [f"| {name} | {ms:.3f} |" for name, ms in times.items()]
    route = attnbias.explain(
        *(t.transpose(1, 2) for t in model.qkv(x).view(8, 2048, 3, 16, 64).unbind(2)),
        attn_mask=model.bias,
    )
    rows.append("eager route: " + route.splitlines()[0][:200])
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            compiled_auto(x)
        torch.cuda.synchronize()
    rows.append(p.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            model(x)
        torch.cuda.synchronize()
    rows.append(p.key_averages().table(sort_by="cuda_time_total", row_limit=10))
    return rows


def main() -> None:
    print("| call | route | same kernels | host µs auto | host µs pinned | ms auto | ms pinned "
          "| auto / pinned |")  # fmt: skip
    rows = auto_against_pinned()
    line = tiny()
    print(line, flush=True)
    rows_block = block()
    print("\n".join(rows))
    print(line)
    print("\n".join(rows_block))


if __name__ == "__main__":
    main()

"""Host time of a repeated training call (forward + backward) on the Triton kernels, a GPU not
needed: the compiled kernels' launchers are no-ops (as in ``host_launch.py``), so what is left
is the Python the library runs around the launches, against the least a call through an
autograd function costs (``bare``: a custom ``autograd.Function`` that allocates the outputs
and the three gradients and calls a no-op launcher once forward, twice backward). Then the top
of a profile of the attnbias call.

Run: ``python benchmarks/probes/host_training.py`` (CPU tensors); ``SORT=cumtime ROWS=45``
for the profile by cumulative time and longer.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
from pathlib import Path
from typing import Any

import torch

os.environ.pop("TRITON_INTERPRET", None)  # the launch path of a GPU, not the interpreter

import attnbias
from attnbias import SlidingWindowBias
from attnbias import causal_lower_right as causal
from attnbias.kernels import backward, launch
from attnbias.kernels.record import flat_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from host_launch import _FakeJit, _noop, fake_launches
from measure import host_us_interleaved

B, H, L, E = 1, 1, 128, 64
DTYPE = torch.bfloat16


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        _noop(q, k, v, out, lse, *range(40))
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = q.new_empty(q.shape[:-1], dtype=torch.float32)
        _noop(q, k, v, out, grad, lse, delta, dq, *range(50))
        _noop(q, k, v, grad, lse, delta, dk, dv, *range(50))
        return dq, dk, dv


def main() -> None:
    fake_launches()
    for kernel in (backward._attn_bwd_dq, backward._attn_bwd_dkdv):
        flat = flat_kernel(kernel)  # what the plans launch
        launch.CACHED_LAUNCHES[flat] = launch.CachedLaunch(_FakeJit(flat))
    q, k, v = (torch.randn(B, H, L, E, dtype=DTYPE, requires_grad=True) for _ in range(3))
    grad = torch.ones_like(q)
    bias = causal() + SlidingWindowBias(32)

    def ours() -> None:
        with attnbias.use_backends("triton"):
            attnbias.sdpa(q, k, v, attn_mask=bias).backward(grad)
        q.grad = k.grad = v.grad = None

    def bare() -> None:
        _Bare.apply(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None

    def pin() -> None:
        with attnbias.use_backends("triton"):
            pass

    times = host_us_interleaved({"attnbias": ours, "bare": bare, "use_backends": pin},
                                calls=500, rounds=9)  # fmt: skip
    print(
        f"forward + backward, µs per call: attnbias {times['attnbias'] - times['use_backends']:.1f}"
        f" (use_backends taken off), bare autograd function {times['bare']:.1f}"
    )
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(500):
        ours()
    profile.disable()
    rows = int(os.environ.get("ROWS", "22"))
    pstats.Stats(profile).sort_stats(os.environ.get("SORT", "tottime")).print_stats(rows)


if __name__ == "__main__":
    main()

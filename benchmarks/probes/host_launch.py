"""Host time per forward call of the Triton kernels on any machine, a GPU not needed: the
compiled kernels' launchers are replaced by no-ops (``--fake-launch``, the default and only
mode), so what is left is the Python the library runs around each launch.

Per bias (causal, window, ALiBi, soft-cap, documents) and kernel (decode at L=4, training at
L=128; B=1, H=1, S=128, E=64, bf16, no grad), µs per call of:

- ``bare``: what any launch costs at least: the outputs allocated, the no-op launcher called
  with the call's arguments;
- ``launcher``: ``attention_forward`` / ``decode_forward`` called directly;
- ``sdpa``: ``attnbias.sdpa``, a repeated call (through the plan cache), and its overhead
  over ``bare``.

Run: ``python benchmarks/probes/host_launch.py`` (CPU tensors; the Triton backends are told
they may take them).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

os.environ.pop("TRITON_INTERPRET", None)  # the launch path of a GPU, not the interpreter

import attnbias
from attnbias import AlibiBias, DocumentBias, SlidingWindowBias, SoftcapBias
from attnbias import causal_lower_right as causal
from attnbias.backends import triton as triton_backend
from attnbias.kernels import decode, forward, launch
from attnbias.kernels.record import flat_kernel

# isort: split
# benchmarks/measure.py, the folder above this script's
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from measure import host_us

B, H, S, E = 1, 1, 128, 64
DTYPE = torch.bfloat16


def _noop(*args: Any) -> None:
    return None


class _FakeCompiled:
    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        return _noop


class _FakeJit:
    """A ``@triton.jit`` kernel whose launch compiles nothing and runs nothing."""

    def __init__(self, kernel: Any) -> None:
        self.params = kernel.params

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., _FakeCompiled]:
        return lambda *args, **options: _FakeCompiled()


def fake_launches() -> None:
    launch.current_device = lambda: 0
    # a CPU build's CUDA queries: never capturing, one stream
    torch._C._cuda_isCurrentStreamCapturing = lambda: False
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    triton_backend._interpreting = lambda: True  # the backends take CPU tensors
    for kernel in (forward._attn_fwd, decode._decode_fwd):
        flat = flat_kernel(kernel)  # what the plans launch
        launch.CACHED_LAUNCHES[flat] = launch.CachedLaunch(_FakeJit(flat))


def per_call_us(fn: Callable[[], object]) -> float:
    return host_us(fn, calls=2000, rounds=7, warmup=200)


def bare(length_q: int) -> Callable[[], object]:
    args = tuple(range(40))

    def run() -> object:
        out = torch.empty((B, H, length_q, E), dtype=DTYPE)
        lse = torch.empty((B, H, length_q), dtype=torch.float32)
        _noop(*args)
        return out, lse

    return run


def main() -> None:
    fake_launches()
    print("| kernel | bias | bare | launcher | sdpa | sdpa - bare |")
    print("|---|---|--:|--:|--:|--:|")
    for name, length_q, backend in (("decode", 4, "triton-decode"), ("training", 128, "triton")):
        q = torch.randn(B, H, length_q, E, dtype=DTYPE)
        k, v = (torch.randn(B, H, S, E, dtype=DTYPE) for _ in range(2))
        half = length_q // 2
        biases = {
            "causal": causal(),
            "window": causal() + SlidingWindowBias(31),
            "alibi": causal() + AlibiBias(H),
            "softcap": causal() + SoftcapBias(30.0),
            "documents": DocumentBias.from_seqlens([half, length_q - half], [S // 2] * 2),
        }
        for bias_name, bias in biases.items():
            with torch.no_grad(), attnbias.use_backends(backend):
                lowered = attnbias.spec.lower(bias, length_q, S, q.device, batch=B)
                kwargs = dict(program=lowered.program, scale=E**-0.5)
                direct = decode.decode_forward if name == "decode" else forward.attention_forward
                launcher_us = per_call_us(lambda: direct(q, k, v, **kwargs))  # noqa: B023
                sdpa_us = per_call_us(lambda: attnbias.sdpa(q, k, v, attn_mask=bias))  # noqa: B023
                bare_us = per_call_us(bare(length_q))
            print(
                f"| {name} (L={length_q}) | {bias_name} | {bare_us:.1f} | {launcher_us:.1f} "
                f"| {sdpa_us:.1f} | {sdpa_us - bare_us:.1f} |"
            )


if __name__ == "__main__":
    main()

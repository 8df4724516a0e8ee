"""Where the time of a T5 relative-position ``score_mod`` goes in the fused kernels.

Variants of the same bias (bf16, B=2, H=16, S=8192, E=128, causal, a learnable (16, 32)
table): as written (``.long()`` buckets, two divisions); int32 buckets; the divisions as
multiplications; the table read at the clamped distance alone (no bucket arithmetic); the
causal mask as a ``mask_mod`` with no score function; the built-in causal bias. Forward and
forward + backward ms on the GPU, medians of ``do_bench``, two rounds in alternating order.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

import attnbias
from attnbias import ModBias, causal_upper_left

HEADS, SEQ, BATCH = 16, 8192, 2


@dataclass(frozen=True, eq=False)
class AsWritten(ModBias):
    table: Tensor

    def score_mod(self, score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        exact = torch.clamp(q - kv, min=0)
        log_bucket = 16 + (torch.log(exact.float() / 16 + 1e-6) / math.log(8) * 16).long()
        return (
            score + self.table[h, torch.where(exact < 16, exact, torch.clamp(log_bucket, max=31))]
        )


@dataclass(frozen=True, eq=False)
class Int32(ModBias):
    table: Tensor

    def score_mod(self, score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        exact = torch.clamp(q - kv, min=0)
        log_bucket = 16 + (torch.log(exact.float() / 16 + 1e-6) / math.log(8) * 16).int()
        return (
            score + self.table[h, torch.where(exact < 16, exact, torch.clamp(log_bucket, max=31))]
        )


@dataclass(frozen=True, eq=False)
class Multiplied(ModBias):
    table: Tensor

    def score_mod(self, score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        exact = torch.clamp(q - kv, min=0)
        log_bucket = 16 + (torch.log(exact.float() * 0.0625 + 1e-6) * (16 / math.log(8))).int()
        return (
            score + self.table[h, torch.where(exact < 16, exact, torch.clamp(log_bucket, max=31))]
        )


@dataclass(frozen=True, eq=False)
class LookupOnly(ModBias):
    table: Tensor

    def score_mod(self, score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return score + self.table[h, torch.clamp(q - kv, 0, 31)]


@dataclass(frozen=True)
class CausalMod(ModBias):
    def mask_mod(self, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return kv <= q


def timed(fn: object) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def main() -> None:
    q, k, v = (
        torch.randn(BATCH, HEADS, SEQ, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    table = (torch.randn(HEADS, 32, device="cuda") * 0.5).requires_grad_()
    causal = causal_upper_left()
    biases = {
        "as written": AsWritten(table) + causal,
        "int32 buckets": Int32(table) + causal,
        "multiplied": Multiplied(table) + causal,
        "lookup only": LookupOnly(table) + causal,
        "causal mask_mod": CausalMod(),
        "built-in causal": causal,
    }
    reference = attnbias.sdpa(q, k, v, attn_mask=biases["as written"]).float()
    for name in ("int32 buckets", "multiplied"):
        diff = (attnbias.sdpa(q, k, v, attn_mask=biases[name]).float() - reference).abs().max()
        print(f"{name}: max diff vs as written {diff.item():.1e}")
    times: dict[str, list[float]] = {}
    for r in range(2):
        for name in list(biases) if r == 0 else list(biases)[::-1]:
            bias = biases[name]

            def fwd(bias: object = bias) -> None:
                with torch.no_grad(), attnbias.use_backends("triton"):
                    attnbias.sdpa(q, k, v, attn_mask=bias)

            def fwd_bwd(bias: object = bias, learns: bool = "causal" not in name) -> None:
                with attnbias.use_backends("triton"):
                    out = attnbias.sdpa(q, k, v, attn_mask=bias)
                inputs = (q, k, v, table) if learns else (q, k, v)
                torch.autograd.grad(out, inputs, grad)

            times.setdefault(name + " fwd", []).append(timed(fwd))
            times.setdefault(name + " f+b", []).append(timed(fwd_bwd))
    print("\n| variant | fwd ms | f+b ms |\n|---|--:|--:|")
    for name in biases:
        fwd_ms = statistics.fmean(times[name + " fwd"])
        fb_ms = statistics.fmean(times[name + " f+b"])
        print(f"| {name} | {fwd_ms:.3f} | {fb_ms:.3f} |")


if __name__ == "__main__":
    main()

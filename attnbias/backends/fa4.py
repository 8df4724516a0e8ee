"""FlashAttention 4 (``pip install "attnbias[fa4]"``, import ``flash_attn.cute``) on Hopper and
Blackwell GPUs.

It takes every band, soft-cap and grouped-query attention, forward and backward. A band
``band_lo <= j - i <= band_hi`` is FlashAttention's bottom-right aligned ``window_size``::

    window_size = ((S - L) - band_lo, band_hi - (S - L))      # None for an open side

which it computes exactly, negative sides included. What it does not take, and why, is listed
by :meth:`FlashAttention4.reasons`; the planner then moves on to the next backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnbias.backends.base import Backend
from attnbias.spec import Lowered, Spec

__all__ = ["FlashAttention4", "window_size"]

# Compute capabilities whose FlashAttention 4 kernels were checked against the oracle.
CAPABILITIES = (9, 10)


@functools.cache
def _installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


@functools.cache
def _flash_attn_func() -> Callable[..., Any]:
    # Importing it loads the CuTe DSL: seconds, so only on first use.
    module = importlib.import_module("flash_attn.cute")
    return module.flash_attn_func


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _on_cuda(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device (one function, so that the tests can fake a GPU)."""
    return device.type == "cuda"


def window_size(lowered: Lowered, length_q: int, length_kv: int) -> tuple[int | None, int | None]:
    """FlashAttention's ``window_size`` for the band of ``lowered`` (``None``: open side).

    FlashAttention keeps ``i + (S - L) - left <= j <= i + (S - L) + right``, so
    ``left = (S - L) - band_lo`` and ``right = band_hi - (S - L)``.
    """
    offset = length_kv - length_q
    left = None if lowered.band_lo is None else offset - lowered.band_lo
    right = None if lowered.band_hi is None else lowered.band_hi - offset
    return left, right


def _head_dim_reasons(major: int, head_dim: int, head_dim_v: int, dtype: torch.dtype) -> list[str]:
    alignment = 16 // (torch.finfo(dtype).bits // 8)
    if head_dim % alignment or head_dim_v % alignment:
        return [f"head dims ({head_dim}, {head_dim_v}) are not multiples of {alignment}"]
    if major == 9 and not (8 <= head_dim <= 256 and 8 <= head_dim_v <= 256):
        return [f"head dims ({head_dim}, {head_dim_v}) are outside 8..256 on compute capability 9"]
    if major == 10 and not (
        (head_dim <= 128 and head_dim_v <= 128)
        or (head_dim, head_dim_v) in ((192, 128), (256, 256))
    ):
        return [
            f"head dims ({head_dim}, {head_dim_v}) are not supported on compute capability 10 "
            f"(up to 128, or (192, 128), or (256, 256))"
        ]
    return []


class FlashAttention4(Backend):
    """Bands, soft-cap and GQA through ``flash_attn.cute.flash_attn_func``."""

    name = "fa4"
    dtypes = (torch.float16, torch.bfloat16)

    def reasons(self, spec: Spec) -> list[str]:
        reasons = []
        lowered = spec.lowered
        if not _installed():
            reasons.append('flash_attn.cute is not installed (pip install "attnbias[fa4]")')
        if not _on_cuda(spec.device):
            reasons.append(
                f"FlashAttention 4 needs CUDA tensors and these are on {spec.device.type}"
            )
        else:
            major = _capability(spec.device.index or 0)[0]
            if major not in CAPABILITIES:
                reasons.append(
                    f"compute capability {major}.x is not one of FlashAttention 4's here "
                    f"({', '.join(f'{c}.x' for c in CAPABILITIES)})"
                )
            elif spec.dtype in self.dtypes:
                reasons += _head_dim_reasons(major, spec.head_dim, spec.head_dim_v, spec.dtype)
                if (
                    major == 10
                    and spec.head_dim == 256
                    and lowered.softcap is not None
                    and spec.needs_grad
                ):
                    reasons.append("its backward at head dim 256 has no soft-cap on capability 10")
        if spec.compiling:
            reasons.append(
                "torch.compile cannot trace FlashAttention 4, so a compiled call takes the "
                "Triton kernel"
            )
        if spec.dropout_p > 0.0:
            reasons.append(f"dropout_p={spec.dropout_p}: FlashAttention 4 has no dropout")
        if lowered.q_doc is not None:
            reasons.append("documents are not taken by this backend")
        if lowered.slopes is not None:
            reasons.append("ALiBi is not taken by this backend")
        if lowered.others:
            names = ", ".join(type(p).__name__ for p in lowered.others)
            reasons.append(f"{names} has no FlashAttention 4 form")
        if lowered.band_is_empty:
            # FlashAttention reads a window whose sides are both negative as no window at all.
            reasons.append(f"{lowered.describe()} keeps no pair")
        if not spec.resolved_scale > 0.0:
            reasons.append(f"scale={spec.resolved_scale} is not positive")
        if spec.has_empty_dim:
            reasons.append(f"an empty dimension in (B, Hq, L, S)={spec.shape}")
        return reasons

    def how(self, spec: Spec) -> str:
        left, right = window_size(spec.lowered, spec.shape[2], spec.shape[3])
        terms = [f"window_size=({left}, {right})"]
        if spec.lowered.softcap is not None:
            terms.append(f"softcap={spec.lowered.softcap:g}")
        return f"FlashAttention 4 ({', '.join(terms)})"

    def run(self, spec: Spec) -> Tensor:
        left, right = window_size(spec.lowered, spec.shape[2], spec.shape[3])
        # FlashAttention takes (B, L, H, E): a transposed view, no copy.
        out, _ = _flash_attn_func()(
            spec.query.transpose(1, 2),
            spec.key.transpose(1, 2),
            spec.value.transpose(1, 2),
            softmax_scale=spec.resolved_scale,
            window_size=(left, right),
            softcap=spec.lowered.softcap or 0.0,
        )
        return out.transpose(1, 2)

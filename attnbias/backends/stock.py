"""Stock PyTorch SDPA: without a mask or with ``is_causal`` (its fused kernels: cuDNN,
FlashAttention 2), and with the bias materialized as an ``(L, S)``-sized mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnbias.backends.base import Backend
from attnbias.spec import Spec

__all__ = ["MaterializedSDPA", "StockSDPA", "stock_sdpa"]

# Kept at import so that patch_sdpa() can never make the library call itself.
_original_sdpa = F.scaled_dot_product_attention

_ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def stock_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` as it was before any patch."""
    return _original_sdpa(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _stock(spec: Spec, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    return stock_sdpa(
        spec.query,
        spec.key,
        spec.value,
        attn_mask=attn_mask,
        dropout_p=spec.dropout_p,
        is_causal=is_causal,
        scale=spec.scale,
        enable_gqa=spec.enable_gqa,
    )


class StockSDPA(Backend):
    """Stock SDPA with no mask, or with ``is_causal=True`` for plain upper-left causal."""

    name = "sdpa"
    dtypes = _ALL_FLOATS

    def reasons(self, spec: Spec) -> list[str]:
        if spec.lowered.is_empty or spec.lowered.is_plain_causal:
            return []
        return [
            f"{spec.lowered.describe()} is neither no mask nor plain upper-left causal, the two "
            f"forms stock SDPA fuses"
        ]

    def label(self, spec: Spec) -> str:
        return "sdpa(is_causal=True)" if spec.lowered.is_plain_causal else "sdpa"

    def how(self, spec: Spec) -> str:
        if spec.lowered.is_plain_causal:
            return "stock SDPA with is_causal=True (cuDNN / FlashAttention on CUDA)"
        return "stock SDPA without a mask"

    def run(self, spec: Spec) -> Tensor:
        return _stock(spec, None, spec.lowered.is_plain_causal)


class MaterializedSDPA(Backend):
    """Stock SDPA with the bias materialized: exact for every part that has a materialized
    form, at the cost of an ``(L, S)`` mask and SDPA's slowest kernels."""

    name = "sdpa+mask"
    dtypes = _ALL_FLOATS

    def reasons(self, spec: Spec) -> list[str]:
        reasons = []
        if spec.lowered.softcap is not None:
            reasons.append("soft-cap has no materialized form")
        if spec.lowered.slopes is not None and spec.dtype in (torch.float16, torch.bfloat16):
            reasons.append(
                f"ALiBi materialized in {spec.dtype} would lose precision (the reference path "
                f"computes it in float32)"
            )
        return reasons

    def how(self, spec: Spec) -> str:
        return "stock SDPA with the materialized (L, S) mask"

    def run(self, spec: Spec) -> Tensor:
        bias = spec.bias
        if bias is None:  # the planner sends masks only; an empty bias needs none
            return _stock(spec, None, False)
        mask = bias.materialize(spec.device, shape=spec.shape, dtype=spec.dtype)
        return _stock(spec, mask, False)

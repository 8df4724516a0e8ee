"""The exact eager path as a backend: takes every call, materializes the scores."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnbias.backends.base import Backend, LseGrads
from attnbias.reference import (
    attention_with_lse,
    attention_with_lse_backward,
    reference_attention,
)
from attnbias.spec import Spec

__all__ = ["Reference"]


class Reference(Backend):
    """Plain tensor operations, half precision computed in float32; the last resort."""

    name = "reference"
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    returns_lse = True

    def reasons(self, spec: Spec) -> list[str]:
        return []

    def how(self, spec: Spec) -> str:
        return "the exact eager path (it materializes the (B, Hq, L, S) scores, float32 or wider)"

    def run(self, spec: Spec) -> Tensor:
        return reference_attention(
            spec.query,
            spec.key,
            spec.value,
            spec.bias,
            scale=spec.scale,
            dropout_p=spec.dropout_p,
            enable_gqa=spec.enable_gqa,
        )

    def forward_lse(self, spec: Spec) -> tuple[Tensor, Tensor]:
        return attention_with_lse(
            spec.query,
            spec.key,
            spec.value,
            spec.bias,
            scale=spec.scale,
            enable_gqa=spec.enable_gqa,
        )

    def backward_lse(
        self, spec: Spec, grad_out: Tensor, out: Tensor, lse: Tensor, wrt: Sequence[Tensor]
    ) -> LseGrads:
        return attention_with_lse_backward(
            spec.query,
            spec.key,
            spec.value,
            spec.bias,
            grad_out,
            out,
            lse,
            scale=spec.scale,
            enable_gqa=spec.enable_gqa,
            wrt=wrt,
        )

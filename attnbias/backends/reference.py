"""The exact eager path as a backend: takes every call, materializes the scores."""

from __future__ import annotations

import torch
from torch import Tensor

from attnbias.backends.base import Backend
from attnbias.reference import reference_attention
from attnbias.spec import Spec

__all__ = ["Reference"]


class Reference(Backend):
    """Plain tensor operations, half precision computed in float32; the last resort."""

    name = "reference"
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

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

"""The route of a call with no output element (``B``, ``Hq`` or ``L`` equal to 0)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnbias.backends.base import Backend
from attnbias.kinds import Form
from attnbias.spec import Spec

__all__ = ["EmptyOutput"]


class _EmptyOutput(torch.autograd.Function):
    """The ``(B, Hq, L, Ev)`` output of a call with ``B``, ``Hq`` or ``L`` equal to 0, and
    zero gradients for query, key and value: no element of the output depends on them."""

    @staticmethod
    def forward(ctx: Any, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        ctx.inputs = [(x.shape, x.dtype, x.device) for x in (query, key, value)]
        return query.new_empty((*query.shape[:3], value.shape[-1]))

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, ...]:
        return tuple(
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs
        )


class EmptyOutput(Backend):
    """Runs nothing: the empty output, and zero gradients."""

    name = "empty"
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    forms = frozenset({Form.EMPTY})

    def reasons(self, spec: Spec) -> list[str]:
        return []

    def headline(self, spec: Spec) -> str:
        batch, heads_q, length_q, _ = spec.shape
        return (
            f"empty: the output (B, Hq, L, Ev)={(batch, heads_q, length_q, spec.head_dim_v)} "
            f"has no elements, so nothing runs (stock SDPA ends the process with a floating "
            f"point exception on some of these shapes)"
        )

    def how(self, spec: Spec) -> str:
        return "no kernel"

    def run(self, spec: Spec) -> Tensor:
        return _EmptyOutput.apply(spec.query, spec.key, spec.value)

"""The route of a bias class with its own ``dispatch`` (the RFC's extension point)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnbias.backends.base import Backend
from attnbias.kinds import Form
from attnbias.materialize import check_dispatched
from attnbias.spec import Spec

__all__ = ["OwnDispatch"]


class OwnDispatch(Backend):
    """Calls the bias class's ``dispatch`` with the call as made, and checks its result."""

    name = "dispatch"
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    forms = frozenset({Form.DISPATCH})

    def reasons(self, spec: Spec) -> list[str]:
        return []

    def headline(self, spec: Spec) -> str:
        cls = type(spec.bias).__name__
        return (
            f"{cls}.dispatch: {cls} does not need materialization and runs through its own "
            f"dispatch()"
        )

    def how(self, spec: Spec) -> str:
        return f"{type(spec.bias).__name__}.dispatch()"

    def run(self, spec: Spec) -> Tensor:
        bias = spec.bias
        assert bias is not None  # a "dispatch" call has a bias object
        result = type(bias).dispatch(
            spec.query, spec.key, spec.value, bias, spec.is_causal, spec.scale,
            spec.dropout_p, spec.enable_gqa,
        )  # fmt: skip
        return check_dispatched(bias, result, spec.query, spec.value)

"""What every backend states: its name, what it supports, why it cannot take a call, and how
it runs one."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnbias.kinds import Form
from attnbias.spec import Spec

__all__ = ["Backend", "LseGrads", "Prepared", "refuse_double_backward"]

# A backend's run for one call identity: takes the call's query, key and value.
Prepared = Callable[[Tensor, Tensor, Tensor], Tensor]
# (dq, dk, dv, [gradient of each tensor asked for, None where it has none])
LseGrads = tuple[Tensor, Tensor, Tensor, list[Tensor | None]]


def _refuse_graph(route: str, grad: Tensor) -> None:
    # Grad mode is on in a backward exactly when it was asked to build a graph.
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"attnbias: double backward (create_graph=True) through {route} is not supported: "
            f"its gradients are computed by kernels that are not themselves differentiable, so "
            f"the result would silently miss the second-order terms. Run this call on the exact "
            f'eager path with attnbias.use_backends("reference")'
        )


def refuse_double_backward(out: Tensor, route: str) -> Tensor:
    """``out``, whose backward raises instead of returning gradients detached from a graph.

    For backends whose backward is first-order only: without this, ``create_graph=True``
    would give gradients that silently do not depend on the inputs. (A hook on ``out``, not an
    autograd node: a few microseconds of host time instead of ten.)
    """
    if out.requires_grad:
        out.register_hook(functools.partial(_refuse_graph, route))
    return out


class Backend(ABC):
    """One way to run a lowered call.

    A backend never runs a call unless :meth:`not_supported_reasons` returned no reason for it,
    and it is only registered for calls it computes exactly as the library's semantics say.
    """

    #: The name used by :func:`attnbias.use_backends`, the priority tables and ``explain``.
    name: ClassVar[str]
    #: The input dtypes it takes (checked by :meth:`not_supported_reasons`).
    dtypes: ClassVar[tuple[torch.dtype, ...]]
    #: The call forms it runs (``attnbias.spec.FORMS``): "bias" for bias objects lowered into
    #: terms (the backends the priority lists choose among), others for the one route of a
    #: form (``attnbias.planner.FORM_ROUTES``).
    forms: ClassVar[frozenset[Form]] = frozenset({Form.BIAS})
    #: Whether it gives its rows' log-sum-exp (:meth:`forward_lse`) and the gradients of a
    #: share of a merged output (:meth:`backward_lse`): what context parallelism runs its
    #: shard pairs on (``spec.needs_lse``).
    returns_lse: ClassVar[bool] = False

    def not_supported_reasons(self, spec: Spec) -> list[str]:
        """Every reason this backend cannot run ``spec`` (empty: it can)."""
        reasons = []
        if spec.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"dtype {spec.dtype} is not one of {self.name}'s ({names})")
        if spec.needs_lse and not self.returns_lse:
            reasons.append(
                f"{self.name} does not give the log-sum-exp that context parallelism merges "
                f"partial outputs by"
            )
        return reasons + self.reasons(spec)

    @abstractmethod
    def reasons(self, spec: Spec) -> list[str]:
        """The backend's own reasons, beyond the dtype."""

    @abstractmethod
    def run(self, spec: Spec) -> Tensor:
        """``(B, Hq, L, Ev)`` attention for ``spec``."""

    def forward_lse(self, spec: Spec) -> tuple[Tensor, Tensor]:
        """``(out, lse)``: ``(B, Hq, L, Ev)`` attention (in the inputs' dtype or wider) and
        ``(B, Hq, L)`` float32-or-wider natural log-sum-exp of each row's kept scores (``-inf``
        for a row that keeps nothing, whose ``out`` is 0). Records no autograd graph: the
        gradients come from :meth:`backward_lse`. Only where :attr:`returns_lse`."""
        raise NotImplementedError(f"{self.name} does not give the log-sum-exp")

    def backward_lse(
        self, spec: Spec, grad_out: Tensor, out: Tensor, lse: Tensor, wrt: Sequence[Tensor]
    ) -> LseGrads:
        """The gradients of the share of ``spec``'s keys in a merged attention output:
        ``out`` ``(B, Hq, L, Ev)`` and ``lse`` ``(B, Hq, L)`` are the whole attention's output
        and log-sum-exp (this call's partial result merged with others'), ``grad_out`` the
        gradient of that output. Returns ``(dq, dk, dv)`` of this call's tensors and the
        gradients of ``wrt``, tensors the bias's terms are computed from (the spec is made
        with grad enabled, so that they are reached). Only where :attr:`returns_lse`."""
        raise NotImplementedError(f"{self.name} does not give the log-sum-exp")

    def prepare(self, spec: Spec) -> Prepared:
        """:meth:`run` for calls identical to ``spec`` but for their tensors: the returned
        function takes the call's query, key and value.

        A repeated call runs the returned function (see ``attnbias/plan_cache.py``), so
        whatever depends only on the call's identity (shapes, flags, the lowered bias) can be
        worked out here once. The function must not keep ``spec``'s query, key or value alive.
        """
        fields: dict[str, Any] = {
            name: getattr(spec, name)
            for name in spec.__dataclass_fields__
            # a prepared run is made for the call's tensors, and is never itself capturing
            if name not in ("query", "key", "value", "capturing")
        }
        run = self.run

        def run_call(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            return run(Spec(query=query, key=key, value=value, capturing=False, **fields))

        return run_call

    def headline(self, spec: Spec) -> str:
        """The first line of ``explain``: the route, what runs and how."""
        return f"{self.label(spec)}: {spec.terms.describe()} runs in {self.how(spec)}"

    def label(self, spec: Spec) -> str:
        """The route's name in ``explain`` (the backend's name unless a form is worth naming)."""
        return self.name

    @abstractmethod
    def how(self, spec: Spec) -> str:
        """One clause saying how this backend runs ``spec``."""

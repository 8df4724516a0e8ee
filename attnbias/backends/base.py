"""What every backend states: its name, what it supports, why it cannot take a call, and how
it runs one."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor

from attnbias.spec import Spec

__all__ = ["Backend"]


class Backend(ABC):
    """One way to run a lowered call.

    A backend never runs a call unless :meth:`not_supported_reasons` returned no reason for it,
    and it is only registered for calls it computes exactly as the library's semantics say.
    """

    #: The name used by :func:`attnbias.use_backends`, the priority tables and ``explain``.
    name: ClassVar[str]
    #: The input dtypes it takes (checked by :meth:`not_supported_reasons`).
    dtypes: ClassVar[tuple[torch.dtype, ...]]

    def not_supported_reasons(self, spec: Spec) -> list[str]:
        """Every reason this backend cannot run ``spec`` (empty: it can)."""
        reasons = []
        if spec.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"dtype {spec.dtype} is not one of {self.name}'s ({names})")
        return reasons + self.reasons(spec)

    @abstractmethod
    def reasons(self, spec: Spec) -> list[str]:
        """The backend's own reasons, beyond the dtype."""

    @abstractmethod
    def run(self, spec: Spec) -> Tensor:
        """``(B, Hq, L, Ev)`` attention for ``spec``."""

    def label(self, spec: Spec) -> str:
        """The route's name in ``explain`` (the backend's name unless a form is worth naming)."""
        return self.name

    @abstractmethod
    def how(self, spec: Spec) -> str:
        """One clause saying how this backend runs ``spec``."""

"""The names the routing tables are keyed by: a call's :class:`Form` and, for a bias that
lowers into the kernels' terms, its :class:`Kind`.

Both are string enums: a member equals, hashes and prints as its word (``Kind.MOD_MASK ==
"mod mask"``), so tables, messages, ``explain()`` and the routing cache read as before, while
a misspelt member in the library's own tables is an ``AttributeError`` at import.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Form", "Kind"]


class _Word(str, Enum):
    """A string enum that prints as its value (``str()`` and f-strings alike, on every
    supported Python)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(str.__str__(self), spec)


class Form(_Word):
    """What a call to :func:`attnbias.sdpa` is, before any bias is lowered
    (:func:`attnbias.spec.call_form`)."""

    EMPTY = "empty"  # no output element: no kernel at all
    TENSOR = "tensor"  # a plain tensor mask: stock SDPA unchanged
    NO_MASK = "no mask"  # attn_mask=None: stock SDPA
    MATERIALIZE = "materialize"  # a bias whose needs_materialization() is True
    DISPATCH = "dispatch"  # a bias class with its own dispatch()
    BIAS = "bias"  # a bias that lowers into the kernels' terms (the built-ins, their sums)


class Kind(_Word):
    """The costliest feature of a bias's lowered terms (:attr:`attnbias.terms.Terms.kind`):
    the key of the priority tables (``attnbias.policy``)."""

    NONE = "none"
    CAUSAL = "causal"
    BAND = "band"
    DOCUMENTS = "documents"
    SOFTCAP = "softcap"
    ALIBI = "alibi"
    MOD_MASK = "mod mask"  # ModBias mask functions
    MOD = "mod"  # ModBias score functions
    MATERIALIZED = "materialized"  # parts with no kernel form

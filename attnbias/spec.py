"""One call, validated and lowered once: its form, its bias's terms and everything a backend
looks at (:class:`Spec`).

Shape legend: B batch, Hq query heads, Hkv key/value heads, L query length, S key length,
E head dim, Ev value head dim.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnbias.biases import AttnBias, CausalBias, CausalVariant, KernelBias
from attnbias.biases.mod_state import compiled_mods
from attnbias.kernels.program import MaskProgram
from attnbias.kinds import Form, Kind
from attnbias.terms import Call, Terms

__all__ = [
    "FORMS",
    "Spec",
    "call_form",
    "capturable",
    "capturing",
    "lower",
    "make_spec",
    "with_causal",
]

# What a call passes as its mask, which decides the routes it may take (``planner.PRIORITY``
# keys its tables by the terms' kind for "bias" calls and by the form for the others):
#   empty        B, Hq or L is 0: no output element, nothing runs
#   tensor       a plain Tensor attn_mask: stock SDPA, unchanged
#   no mask      attn_mask=None: stock SDPA
#   materialize  a bias whose needs_materialization() is True: its materialized mask
#   dispatch     a bias class with its own dispatch()
#   bias         a bias that lowers into the kernels' terms (the built-ins, their sums)
FORMS = tuple(Form)


def call_form(query: Tensor, attn_mask: AttnBias | Tensor | None) -> Form:
    """The form of a call (see :data:`FORMS`)."""
    if query.shape[0] * query.shape[1] * query.shape[2] == 0:
        return Form.EMPTY
    if attn_mask is None:
        return Form.NO_MASK
    if isinstance(attn_mask, Tensor):
        return Form.TENSOR
    if attn_mask.needs_materialization():
        return Form.MATERIALIZE
    if type(attn_mask).dispatch is not KernelBias.dispatch:
        return Form.DISPATCH
    return Form.BIAS


def lower(
    bias: AttnBias | None,
    length_q: int,
    length_kv: int,
    device: torch.device,
    *,
    batch: int | None = None,
    heads: int = 1,
) -> Terms:
    """The terms of ``bias`` for a call with ``(B, L, S)``, each part lowering itself and the
    sum merging them; without ``batch``, key ranges keep their own rows (1 or B)."""
    if bias is None:
        return Terms.of().finish(length_q, length_kv)
    call = Call(batch, heads, length_q, length_kv, device)
    terms = bias.lower(call)
    return terms.finish(length_q, length_kv, compiled_mods(terms.mods) if len(terms.mods) else None)


# the terms of a call whose form has none (a plain tensor mask, a bias's own dispatch)
_NO_TERMS = Terms.of().finish(0, 0)


@dataclass(frozen=True, eq=False)
class Spec:
    """One validated call of :func:`attnbias.sdpa`.

    ``bias`` already holds ``is_causal`` (see :func:`with_causal`); ``terms`` are its lowered
    form (none for the forms other than "bias" and "materialize"), ``mask`` the plain tensor
    of a "tensor" call. Backends read the fields and properties; none of them changes the spec.
    """

    query: Tensor  # (B, Hq, L, E)
    key: Tensor  # (B, Hkv, S, E)
    value: Tensor  # (B, Hkv, S, Ev)
    bias: AttnBias | None
    terms: Terms
    scale: float | None  # None: 1 / sqrt(E)
    dropout_p: float
    enable_gqa: bool
    needs_grad: bool
    compiling: bool
    # being captured in a CUDA graph: its host time is paid once, at capture, so only the
    # GPU time of its route counts (``planner.plan``)
    capturing: bool = False
    form: Form = Form.BIAS
    mask: Tensor | None = None  # the attn_mask of a "tensor" call
    is_causal: bool = False  # the flag as passed (folded into ``bias`` for bias objects)
    # a shard pair of context parallelism: the backend must give the log-sum-exp
    # (``Backend.returns_lse``)
    needs_lse: bool = False
    # A per-shape fact of the lowering the planner reads where its rule needs it
    # (:func:`with_mask_reach`): the keys a ModBias mask's block lists visit per block of
    # query rows; None where not worked out.
    mask_reach: float | None = None
    # Another: the one-sequence-per-document layout of the call's documents
    # (``backends.documents.DocumentLayout``, read on the host once per bias), worked out by
    # the dispatcher before planning where the terms hold documents; None where not.
    documents: Any = None

    @property
    def program(self) -> MaskProgram:
        """The mask program the Triton kernels' launchers take, unchanged."""
        program = self.terms.program
        assert program is not None, "a spec's terms are finished (spec.lower)"
        return program

    @property
    def kind(self) -> Kind | Form:
        """What the priority tables are keyed by: the terms' kind for a "bias" call, the
        form otherwise."""
        return self.terms.kind if self.form == Form.BIAS else self.form

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, Hq, L, S)``: the shape of the scores and of a materialized mask."""
        batch, heads, length_q, _ = self.query.shape
        return (batch, heads, length_q, self.key.shape[-2])

    @property
    def head_dim(self) -> int:
        return int(self.query.shape[-1])

    @property
    def head_dim_v(self) -> int:
        return int(self.value.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def resolved_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)

    @property
    def has_empty_dim(self) -> bool:
        return 0 in self.shape or self.key.shape[1] == 0


def make_spec(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnBias | Tensor | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    enable_gqa: bool,
    *,
    form: Form = Form.BIAS,
    needs_lse: bool = False,
) -> Spec:
    """Lower a validated call once; everything the planner and the backends need.

    ``form`` is the call's form (:func:`call_form`, which the dispatcher passes); a spec made
    without it is a bias call, planned by its terms' kind. ``needs_lse``: only backends that
    give the log-sum-exp may run it (context parallelism's shard pairs)."""
    mask = attn_mask if isinstance(attn_mask, Tensor) else None
    bias = None if isinstance(attn_mask, Tensor) else attn_mask
    if form in (Form.BIAS, Form.MATERIALIZE):
        bias = with_causal(bias, causal)
    terms = _NO_TERMS
    tensors = [query, key, value]
    if form in (Form.BIAS, Form.MATERIALIZE):
        terms = lower(bias, query.shape[-2], key.shape[-2], query.device, batch=query.shape[0])
        if bias is not None:
            tensors += bias.parameters()
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    compiling = torch.compiler.is_compiling()
    return Spec(
        query=query,
        key=key,
        value=value,
        bias=bias,
        terms=terms,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=enable_gqa,
        needs_grad=needs_grad,
        compiling=compiling,
        capturing=not compiling and capturing(query),
        form=form,
        mask=mask,
        is_causal=causal,
        needs_lse=needs_lse,
        mask_reach=None,
        documents=None,
    )


def capturing(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a CUDA tensor and the current CUDA stream is capturing a graph."""
    return tensor.is_cuda and torch._C._cuda_isCurrentStreamCapturing()


def capturable(tensor: Tensor) -> bool:
    """Whether a call on ``tensor`` could ever be captured in a CUDA graph (a CUDA tensor)."""
    return tensor.is_cuda


def with_causal(bias: AttnBias | None, causal: bool) -> AttnBias | None:
    """``bias`` with ``is_causal=True`` folded in: ``bias + CausalBias(UPPER_LEFT)``."""
    if not causal:
        return bias
    causal_part = CausalBias(CausalVariant.UPPER_LEFT)
    return causal_part if bias is None else bias + causal_part


def with_mask_reach(spec: Spec) -> Spec:
    """``spec`` with :attr:`Spec.mask_reach`: the mean number of keys its ModBias mask's block
    lists visit per block of query rows. The lists are the kernels' own (built on the device
    once per program and shape, and kept for the launch); reading their counts is one host
    synchronisation, so the dispatcher asks for it only where the planner's rule reads it
    (``planner.needs_reach``), never while a CUDA graph is captured."""
    from attnbias.kernels.masks import visited_keys_per_row

    reach = visited_keys_per_row(spec.query, spec.key, spec.program)
    return dataclasses.replace(spec, mask_reach=reach)

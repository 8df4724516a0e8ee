"""Stock PyTorch SDPA: without a mask or with ``is_causal`` (its fused kernels: cuDNN,
FlashAttention 2), on documents of equal lengths as a batch of separate sequences, and with the
bias materialized as an ``(L, S)``-sized mask."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnbias.backends.base import Backend, Prepared
from attnbias.backends.documents import call_documents, document_part, flattens_as_view
from attnbias.biases import AttnBias
from attnbias.biases.base import materialize_masked
from attnbias.kinds import Form
from attnbias.materialize import MaskedBias
from attnbias.reference import FiniteInputs, masked_reference_attention, read_keys
from attnbias.spec import Spec

__all__ = ["MaterializedSDPA", "StockSDPA", "materialized_attention", "stock_sdpa"]

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


def _stock_mask(masked: MaskedBias, dtype: torch.dtype) -> tuple[bool, Tensor | None]:
    """``(exact, attn_mask)``: the mask stock SDPA gets for ``masked`` with inputs in ``dtype``;
    ``exact`` is False when stock SDPA cannot take it exactly.

    A pure keep-mask goes as bool (stock SDPA selects with it; 1 byte per pair). An additive
    part goes in the inputs' dtype, which stock SDPA requires on CUDA (its fused kernels refuse
    a float32 mask with half inputs, or give NaN), only when that cast is exact: in fp16 a bias
    of -1e9 would become -inf and, in bf16, 1000.3 would become 1000.
    """
    if masked.additive is None:
        return True, masked.keep
    additive = masked.additive.detach()
    if dtype != additive.dtype:
        if torch.compiler.is_compiling():
            return False, None  # no data-dependent choice while tracing: float32 is exact
        if not torch.equal(additive.to(dtype).to(additive.dtype), additive):
            return False, None
    return True, masked.additive_form(dtype)


def materialized_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias,
    *,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    """Stock SDPA with ``bias`` materialized: ``(B, Hq, L, S)`` scores' mask in, ``(B, Hq, L,
    Ev)`` out.

    The bias is materialized once as a keep-mask and a float32 (or float64) additive part
    (:func:`attnbias.biases.base.materialize_masked`, which checks a user class's result).
    On CPU only the keys some row keeps are read (:func:`attnbias.reference.read_keys`).
    Stock SDPA runs on the inputs with non-finite entries zeroed, and the rows that attend one
    are set to NaN after (:class:`attnbias.reference.FiniteInputs`): stock SDPA itself lets a
    masked NaN key or value reach every row. An additive part that the inputs' half precision
    cannot hold exactly runs in the float32 eager path instead, so the bias meets the scores in
    float32.
    """
    shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    masked = materialize_masked(bias, query.device, shape, query.dtype)
    # only the keys some row keeps are checked and attended: a cache's unfilled end (NaN,
    # often) is never read
    key, value, masked = read_keys(key, value, masked, dropout_p=dropout_p)
    exact, mask = _stock_mask(masked, query.dtype)
    if not exact:
        return masked_reference_attention(
            query,
            key,
            value,
            masked,
            cap=None,
            scale=scale,
            dropout_p=dropout_p,
            enable_gqa=enable_gqa,
        )
    inputs = FiniteInputs.of(query, key, value)
    out = stock_sdpa(
        inputs.query,
        inputs.key,
        inputs.value,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=False,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    out = inputs.poison(out, masked.keep)
    if masked.keep is None:
        return out
    # Rows that keep no key give 0, and send no gradient anywhere: stock SDPA's CUDA kernels
    # (torch 2.11) give such a row a value there, with gradients reaching keys it does not keep.
    return out.masked_fill(~masked.keep.any(-1, keepdim=True), 0.0)


@dataclass(frozen=True)
class _Sequences:
    """A call's documents of ``length`` positions each, ``count`` per row, as separate
    sequences of stock SDPA: ``(B, H, L, E)`` viewed as ``(B·count, H, length, E)``
    (``into="batch"``) or, keeping the batch, ``(B, H·count, length, E)`` (``into="heads"``,
    without grouped heads)."""

    count: int
    length: int
    causal: bool  # is_causal=True inside each document (else no mask)
    into: Literal["batch", "heads"]

    @property
    def shape(self) -> str:
        """The sequences' shape, in words."""
        n, c = self.count, self.length
        return f"(B·{n}, H, {c}, E)" if self.into == "batch" else f"(B, H·{n}, {c}, E)"

    def split(self, x: Tensor) -> Tensor:
        """``(B, H, L, E)`` as the sequences (a view where :func:`_split_as_view`)."""
        x = x.unflatten(2, (self.count, self.length))  # (B, H, n, C, E)
        return x.transpose(1, 2).flatten(0, 1) if self.into == "batch" else x.flatten(1, 2)

    def join(self, out: Tensor) -> Tensor:
        """The sequences' ``(B·n, H, C, Ev)`` or ``(B, H·n, C, Ev)`` output as ``(B, H, L,
        Ev)``."""
        if self.into == "batch":
            return out.unflatten(0, (-1, self.count)).transpose(1, 2).flatten(2, 3)
        return out.unflatten(1, (-1, self.count)).flatten(2, 3)

    def run(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        *,
        dropout_p: float,
        scale: float | None,
        enable_gqa: bool,
    ) -> Tensor:
        """Stock SDPA on the sequences of ``(B, H, L, E)`` inputs: ``(B, Hq, L, Ev)`` out."""
        out = stock_sdpa(
            self.split(query),
            self.split(key),
            self.split(value),
            attn_mask=None,
            dropout_p=dropout_p,
            is_causal=self.causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return self.join(out)


def _split_as_view(x: Tensor, into: Literal["batch", "heads"], count: int) -> bool:
    """Whether :meth:`_Sequences.split` of ``x`` ``(B, H, L, E)`` into ``count`` sequences
    per row merged with ``into`` is a view: one sequence, or the merged dimension flattening
    with the positions as a view."""
    return count == 1 or flattens_as_view(x, 0 if into == "batch" else 1)


def _sequences(spec: Spec) -> _Sequences | list[str]:
    """The call's documents as separate sequences of stock SDPA, or the reasons it cannot run
    them so. For terms of documents and a band alone."""
    _, heads_q, length_q, length_kv = spec.shape
    if spec.compiling or spec.capturing:
        return [
            "documents are read on the host to run them as separate sequences, which neither "
            "torch.compile nor CUDA-graph capture allows"
        ]
    part = document_part(spec)
    if part is None:
        return ["more than one DocumentBias in the sum"]
    if length_q != length_kv:
        return [
            f"documents with L = {length_q} != S = {length_kv}: stock SDPA runs documents only "
            f"as separate sequences of equal length"
        ]
    length = call_documents(spec).equal_length
    if length is None:
        return [
            "documents of unequal lengths: stock SDPA runs documents only as separate sequences "
            "of equal length"
        ]
    # the band inside each document, whose diagonal is the call's (equal documents)
    lo, hi = spec.terms.band_lo, spec.terms.band_hi
    lo = None if lo is not None and lo <= -(length - 1) else lo
    hi = None if hi is not None and hi >= length - 1 else hi
    if lo is not None or hi not in (None, 0):
        return [
            f"the band {'-inf' if lo is None else lo} <= j - i <= {'inf' if hi is None else hi} "
            f"inside documents of {length} is neither none nor causal, the two forms stock SDPA "
            f"fuses"
        ]
    tensors, count = (spec.query, spec.key, spec.value), length_q // length
    into: Literal["batch", "heads"]
    if all(_split_as_view(x, "batch", count) for x in tensors):
        into = "batch"
    elif heads_q == spec.key.shape[1] and all(_split_as_view(x, "heads", count) for x in tensors):
        into = "heads"
    else:
        return [
            "q, k and v do not view as a batch of the documents (batch size 1, (B, L, H, E) "
            "in memory, or (B, H, L, E) contiguous without grouped heads do)"
        ]
    return _Sequences(count, length, hi == 0, into)


def _causal_scale_reasons(spec: Spec) -> list[str]:
    """Why ``is_causal=True`` cannot run ``spec``'s scale: stock SDPA's fused causal kernels
    (torch 2.13 on CPU, every dtype) mask the scores before scaling them, so at a scale <= 0 a
    masked score becomes +inf or NaN and so does its row."""
    scale = spec.resolved_scale
    if scale > 0:
        return []
    return [
        f"scale {scale} <= 0 with is_causal=True: stock SDPA masks the scores before it scales "
        f"them, so its masked scores would become +inf or NaN"
    ]


def _stock(
    spec: Spec,
    attn_mask: Tensor | None,
    is_causal: bool,
    inputs: tuple[Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """Stock SDPA on ``spec``'s call (on ``inputs`` in place of its q, k, v where given)."""
    query, key, value = inputs or (spec.query, spec.key, spec.value)
    return stock_sdpa(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=spec.dropout_p,
        is_causal=is_causal,
        scale=spec.scale,
        enable_gqa=spec.enable_gqa,
    )


class StockSDPA(Backend):
    """Stock SDPA with no mask, or with ``is_causal=True`` for plain upper-left causal, also
    on each document where the documents are of equal length (a view of the inputs as a batch
    of separate sequences: chunked attention); and the route of calls with a plain tensor mask
    or none, which it runs unchanged."""

    name = "sdpa"
    dtypes = _ALL_FLOATS
    forms = frozenset({Form.BIAS, Form.TENSOR, Form.NO_MASK})

    def reasons(self, spec: Spec) -> list[str]:
        terms = spec.terms
        if terms.is_empty:
            return []
        if terms.is_plain_causal:
            return _causal_scale_reasons(spec)
        if terms.has_key_range:
            # Its fused kernels would read the padded keys (no mask to select them away), and
            # a NaN there would reach every row.
            return [
                "a key range (KeyRangeBias) needs a mask: stock SDPA fuses only no mask and "
                "plain upper-left causal"
            ]
        if terms.q_doc is not None and terms.is_mask_only:
            found = _sequences(spec)
            if isinstance(found, list):
                return found
            return _causal_scale_reasons(spec) if found.causal else []
        return [
            f"{terms.describe()} is neither no mask nor plain upper-left causal, the two "
            f"forms stock SDPA fuses"
        ]

    def headline(self, spec: Spec) -> str:
        if spec.form == Form.TENSOR:
            return (
                "sdpa: a plain Tensor mask goes to stock SDPA unchanged (wrap it in TensorBias, "
                "or use a structured bias such as CausalBias, to silence the warning)"
            )
        if spec.form == Form.NO_MASK:
            return "sdpa: no mask: stock SDPA"
        return super().headline(spec)

    def label(self, spec: Spec) -> str:
        if spec.form == "bias" and spec.terms.q_doc is not None:
            return "sdpa(documents as sequences)"
        return "sdpa(is_causal=True)" if spec.terms.is_plain_causal else "sdpa"

    def how(self, spec: Spec) -> str:
        if spec.form == "bias" and spec.terms.q_doc is not None:
            found = _sequences(spec)
            assert isinstance(found, _Sequences)  # reasons() took the call
            return (
                f"stock SDPA{' with is_causal=True' if found.causal else ' without a mask'} on "
                f"the {found.count} documents of {found.length} positions of each row as "
                f"separate sequences (q, k and v viewed as {found.shape})"
            )
        if spec.terms.is_plain_causal:
            return "stock SDPA with is_causal=True (cuDNN / FlashAttention on CUDA)"
        return "stock SDPA without a mask"

    def run(self, spec: Spec) -> Tensor:
        if spec.form != "bias":  # a plain tensor mask or none, and the flag, as given
            return _stock(spec, spec.mask, spec.is_causal)
        if spec.terms.q_doc is not None:
            return self.prepare(spec)(spec.query, spec.key, spec.value)
        # Stock SDPA's fused kernels as they are, on the fastest path there is: what they do
        # with non-finite inputs in masked positions is stock SDPA's documented behaviour.
        return _stock(spec, None, spec.terms.is_plain_causal)

    def prepare(self, spec: Spec) -> Prepared:
        """Stock SDPA with this call's flags bound once: a repeated call builds no spec."""
        if spec.form != "bias":
            mask, is_causal = spec.mask, spec.is_causal
        elif spec.terms.q_doc is not None:
            found = _sequences(spec)
            assert isinstance(found, _Sequences)  # reasons() took the call
            return functools.partial(
                found.run,
                dropout_p=spec.dropout_p,
                scale=spec.scale,
                enable_gqa=spec.enable_gqa,
            )
        else:
            mask, is_causal = None, spec.terms.is_plain_causal
        return functools.partial(
            stock_sdpa,
            attn_mask=mask,
            dropout_p=spec.dropout_p,
            is_causal=is_causal,
            scale=spec.scale,
            enable_gqa=spec.enable_gqa,
        )


class MaterializedSDPA(Backend):
    """Stock SDPA with the bias materialized: exact for every part that has a materialized
    form, at the cost of an ``(L, S)`` mask and SDPA's slowest kernels."""

    name = "sdpa+mask"
    dtypes = _ALL_FLOATS
    forms = frozenset({Form.BIAS, Form.MATERIALIZE})

    def reasons(self, spec: Spec) -> list[str]:
        reasons = []
        if spec.terms.softcap is not None:
            reasons.append("soft-cap has no materialized form")
        if any(not part.materializable for part in spec.terms.mods):
            reasons.append(
                "a ModBias score_mod runs in the Triton kernels or on the exact path (the "
                "materialized mask holds masks and additive terms only)"
            )
        if spec.terms.slopes is not None and spec.dtype in (torch.float16, torch.bfloat16):
            reasons.append(
                f"ALiBi materialized in {spec.dtype} would lose precision (the reference path "
                f"computes it in float32)"
            )
        return reasons

    def headline(self, spec: Spec) -> str:
        if spec.form == "materialize":
            return (
                f"sdpa+mask: {spec.bias!r} needs materialization, so stock SDPA runs with its "
                f"materialized mask"
            )
        return super().headline(spec)

    def how(self, spec: Spec) -> str:
        return (
            "stock SDPA with the materialized (L, S) mask (a bool keep-mask; on CPU only the "
            "keys some row keeps are read; non-finite inputs zeroed and the rows attending them "
            "set to NaN)"
        )

    def run(self, spec: Spec) -> Tensor:
        bias = spec.bias
        if bias is None:  # an empty bias (a pinned call with no mask) needs no mask
            inputs = FiniteInputs.of(spec.query, spec.key, spec.value)
            out = _stock(spec, None, False, (inputs.query, inputs.key, inputs.value))
            return inputs.poison(out, None)
        return materialized_attention(
            spec.query,
            spec.key,
            spec.value,
            bias,
            dropout_p=spec.dropout_p,
            scale=spec.scale,
            enable_gqa=spec.enable_gqa,
        )

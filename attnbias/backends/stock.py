"""Stock PyTorch SDPA: without a mask or with ``is_causal`` (its fused kernels: cuDNN,
FlashAttention 2), and with the bias materialized as an ``(L, S)``-sized mask."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from attnbias.backends.base import Backend, Prepared
from attnbias.biases import AttnBias
from attnbias.biases.base import materialize_masked
from attnbias.materialize import MaskedBias
from attnbias.reference import FiniteInputs, masked_reference_attention
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
    Stock SDPA runs on the inputs with non-finite entries zeroed, and the rows that attend one
    are set to NaN after (:class:`attnbias.reference.FiniteInputs`): stock SDPA itself lets a
    masked NaN key or value reach every row. An additive part that the inputs' half precision
    cannot hold exactly runs in the float32 eager path instead, so the bias meets the scores in
    float32.
    """
    shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    masked = materialize_masked(bias, query.device, shape, query.dtype)
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
    """Stock SDPA with no mask, or with ``is_causal=True`` for plain upper-left causal; and
    the route of calls with a plain tensor mask or none, which it runs unchanged."""

    name = "sdpa"
    dtypes = _ALL_FLOATS
    forms = frozenset({"bias", "tensor", "no mask"})

    def reasons(self, spec: Spec) -> list[str]:
        terms = spec.terms
        if terms.is_empty or terms.is_plain_causal:
            return []
        if terms.has_key_range:
            # Its fused kernels would read the padded keys (no mask to select them away), and
            # a NaN there would reach every row.
            return [
                "a key range (KeyRangeBias) needs a mask: stock SDPA fuses only no mask and "
                "plain upper-left causal"
            ]
        return [
            f"{terms.describe()} is neither no mask nor plain upper-left causal, the two "
            f"forms stock SDPA fuses"
        ]

    def headline(self, spec: Spec) -> str:
        if spec.form == "tensor":
            return (
                "sdpa: a plain Tensor mask goes to stock SDPA unchanged (wrap it in TensorBias, "
                "or use a structured bias such as CausalBias, to silence the warning)"
            )
        if spec.form == "no mask":
            return "sdpa: no mask: stock SDPA"
        return super().headline(spec)

    def label(self, spec: Spec) -> str:
        return "sdpa(is_causal=True)" if spec.terms.is_plain_causal else "sdpa"

    def how(self, spec: Spec) -> str:
        if spec.terms.is_plain_causal:
            return "stock SDPA with is_causal=True (cuDNN / FlashAttention on CUDA)"
        return "stock SDPA without a mask"

    def run(self, spec: Spec) -> Tensor:
        if spec.form != "bias":  # a plain tensor mask or none, and the flag, as given
            return _stock(spec, spec.mask, spec.is_causal)
        # Stock SDPA's fused kernels as they are, on the fastest path there is: what they do
        # with non-finite inputs in masked positions is stock SDPA's documented behaviour.
        return _stock(spec, None, spec.terms.is_plain_causal)

    def prepare(self, spec: Spec) -> Prepared:
        """Stock SDPA with this call's flags bound once: a repeated call builds no spec."""
        if spec.form != "bias":
            mask, is_causal = spec.mask, spec.is_causal
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
    forms = frozenset({"bias", "materialize"})

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
            "stock SDPA with the materialized (L, S) mask (a bool keep-mask, non-finite inputs "
            "zeroed and the rows attending them set to NaN)"
        )

    def run(self, spec: Spec) -> Tensor:
        bias = spec.bias
        if bias is None:  # the planner sends masks only; an empty bias needs none
            return _stock(spec, None, False)
        return materialized_attention(
            spec.query,
            spec.key,
            spec.value,
            bias,
            dropout_p=spec.dropout_p,
            scale=spec.scale,
            enable_gqa=spec.enable_gqa,
        )

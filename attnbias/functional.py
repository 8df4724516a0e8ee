"""The entry points: :func:`sdpa`, :func:`patch_sdpa` and :func:`explain`.

Shape legend::

    B   batch size              L   query sequence length
    Hq  query heads             S   key/value sequence length
    Hkv key/value heads         E   head dimension, Ev value head dimension
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from attnbias import plan_cache
from attnbias.backends import stock_sdpa
from attnbias.backends.stock import materialized_attention
from attnbias.bias import AttnBias, _BuiltinBias, check_dispatched
from attnbias.planner import current_policy, plan
from attnbias.spec import make_spec, with_causal

__all__ = ["explain", "patch_sdpa", "sdpa"]

AttnMask = AttnBias | Tensor | None


def _validate(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
) -> None:
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"sdpa: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"sdpa: {name} must be 4-D (B, H, seq, E), got shape {tuple(tensor.shape)}; "
                f"add the missing batch/head dimensions with .unsqueeze or .view"
            )
    if not query.is_floating_point():
        raise TypeError(f"sdpa: query must be a floating point tensor, got dtype={query.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"sdpa: query, key and value must share a dtype, got {query.dtype}, {key.dtype} and "
            f"{value.dtype}; cast them with .to(dtype)"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"sdpa: query, key and value must be on one device, got {query.device}, "
            f"{key.device} and {value.device}"
        )
    batch, heads_q, _, head_dim = query.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ValueError(
            f"sdpa: batch sizes differ: query B={batch}, key B={key.shape[0]}, value "
            f"B={value.shape[0]}"
        )
    if key.shape[-1] != head_dim:
        raise ValueError(
            f"sdpa: query and key head dims differ: E={head_dim} and {key.shape[-1]}; "
            f"q·k needs the same E"
        )
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ValueError(
            f"sdpa: key (B, Hkv, S, E)={tuple(key.shape)} and value {tuple(value.shape)} must "
            f"share Hkv and S"
        )
    heads_kv = key.shape[1]
    if heads_q % heads_kv != 0:
        raise ValueError(f"sdpa: got Hq={heads_q} and Hkv={heads_kv}. Hq must be a multiple of Hkv")
    if heads_q != heads_kv and not enable_gqa:
        raise ValueError(
            f"sdpa: query has Hq={heads_q} heads but key/value have Hkv={heads_kv}; pass "
            f"enable_gqa=True to share each key/value head among {heads_q // heads_kv} query heads"
        )
    if not (isinstance(dropout_p, (int, float)) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"sdpa: dropout_p must be in [0, 1), got {dropout_p!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"sdpa: scale must be a finite float or None, got {scale!r}")
    if attn_mask is not None and not isinstance(attn_mask, (AttnBias, Tensor)):
        raise TypeError(
            f"sdpa: attn_mask must be an AttnBias, a Tensor or None, got {type(attn_mask).__name__}"
        )
    if isinstance(attn_mask, AttnBias):
        attn_mask._validate_call(batch, heads_q, query.shape[2], key.shape[2])


def _choose(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    call: Hashable | None = None,
) -> tuple[Callable[[], str], Callable[[], Tensor]]:
    """``(explanation, thunk)``: the one decision both sdpa and explain report.

    ``call`` is the call's :func:`plan_cache.call_key`; a built-in bias's decision is kept
    under it.
    """
    if (
        isinstance(attn_mask, AttnBias)
        and not attn_mask.needs_materialization()
        and type(attn_mask).dispatch is _BuiltinBias.dispatch
    ):
        # The built-ins, first: theirs is the path whose host time counts.
        chosen = plan(
            make_spec(query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa)
        )
        if call is not None:
            plan_cache.store(call, chosen.spec, chosen.backend)
        return chosen.explain, chosen.run

    def stock(mask: Tensor | None, causal: bool) -> Callable[[], Tensor]:
        return partial(
            stock_sdpa,
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout_p,
            is_causal=causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    def says(text: str) -> Callable[[], str]:
        return lambda: text

    if isinstance(attn_mask, Tensor):
        return (
            says(
                "sdpa: a plain Tensor mask goes to stock SDPA unchanged (wrap it in TensorBias, "
                "or use a structured bias such as CausalBias, to silence the warning)"
            ),
            stock(attn_mask, is_causal),
        )
    if attn_mask is None:
        return says("sdpa: no mask: stock SDPA"), stock(None, is_causal)
    if attn_mask.needs_materialization():
        bias = with_causal(attn_mask, is_causal)
        assert bias is not None  # attn_mask is not None here

        def materialized() -> Tensor:
            return materialized_attention(
                query,
                key,
                value,
                bias,
                dropout_p=dropout_p,
                scale=scale,
                enable_gqa=enable_gqa,
            )

        return (
            says(
                f"sdpa+mask: {bias!r} needs materialization, so stock SDPA runs with its "
                f"materialized mask"
            ),
            materialized,
        )
    cls = type(attn_mask)
    return (
        says(
            f"{cls.__name__}.dispatch: {cls.__name__} does not need materialization and runs "
            f"through its own dispatch()"
        ),
        lambda: check_dispatched(
            attn_mask,
            cls.dispatch(query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa),
            query,
            value,
        ),
    )


def sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Scaled dot product attention that accepts bias objects as ``attn_mask``.

    A drop-in for :func:`torch.nn.functional.scaled_dot_product_attention` (same signature and
    defaults). ``attn_mask`` may be an :class:`AttnBias` (causal, ALiBi, sliding window,
    documents, soft-cap, a sum of them, or your own subclass), a plain tensor (stock SDPA, with
    a warning suggesting a bias object), or ``None``. ``is_causal=True`` together with a bias
    means ``bias + CausalBias(UPPER_LEFT)``. :func:`explain` says which route a call takes.

    Args:
        query: ``(B, Hq, L, E)``.
        key: ``(B, Hkv, S, E)``.
        value: ``(B, Hkv, S, Ev)``.
        attn_mask: the bias.
        dropout_p: dropout probability on the attention weights.
        is_causal: add an upper-left causal mask.
        scale: score scale, default ``1 / sqrt(E)``.
        enable_gqa: allow ``Hkv < Hq`` (``Hq`` a multiple of ``Hkv``); query head ``h`` uses
            key/value head ``h // (Hq // Hkv)``.

    Returns:
        ``(B, Hq, L, Ev)``. A query row that keeps no key gives 0 (and zero gradients).

    Example::

        >>> from attnbias import sdpa, SlidingWindowBias, SoftcapBias, causal_lower_right
        >>> q = k = v = torch.randn(1, 2, 8, 16)
        >>> bias = causal_lower_right() + SlidingWindowBias(3) + SoftcapBias(50.0)
        >>> sdpa(q, k, v, attn_mask=bias).shape
        torch.Size([1, 2, 8, 16])
    """
    call = plan_cache.call_key(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, current_policy()
    )
    if call is not None:
        cached = plan_cache.lookup(call)
        if cached is not None:
            # The same call, validated and planned before.
            return cached.run(query, key, value, scale, dropout_p, enable_gqa)
    _validate(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    if isinstance(attn_mask, Tensor):
        warnings.warn(
            "attnbias.sdpa got a plain Tensor attn_mask and passes it to stock SDPA unchanged; "
            "wrap it in attnbias.TensorBias, or use a structured bias (CausalBias, "
            "SlidingWindowBias, DocumentBias, ...) so the fastest kernel can be chosen",
            UserWarning,
            stacklevel=2,
        )
    _, run = _choose(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, call)
    return run()


def explain(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> str:
    """Say which route :func:`sdpa` takes for these arguments, and why; nothing is computed.

    The first word is the route: ``fa4`` (FlashAttention 4), ``triton`` (the block-sparse
    kernel), ``sdpa(is_causal=True)``, ``sdpa`` (stock, no mask), ``sdpa+mask`` (stock with the
    materialized mask), ``reference`` (the exact eager path) or ``<Class>.dispatch`` (a user
    bias's own dispatch). For the built-in biases the next lines give the order the backends
    were tried in (set per GPU generation and kind of bias, or by :func:`use_backends`) and
    every other backend's reasons::

        >>> q = k = v = torch.randn(1, 1, 4, 8)
        >>> print(explain(q, k, v, attn_mask=SoftcapBias(30.0)))  # doctest: +ELLIPSIS
        reference: soft-cap 30 runs in the exact eager path (...)
          order (cpu, softcap, inference): triton > sdpa > sdpa+mask > reference
          fa4: flash_attn.cute is not installed ...
          triton: the Triton kernel needs CUDA tensors and these are on cpu
          sdpa: soft-cap 30 is neither no mask nor plain upper-left causal, ...
          sdpa+mask: soft-cap has no materialized form
    """
    _validate(query, key, value, attn_mask, dropout_p, scale, enable_gqa)
    explanation, _ = _choose(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return explanation()


class _Patch(contextlib.AbstractContextManager["_Patch"]):
    """Returned by :func:`patch_sdpa`; restores the original function on exit."""

    def __init__(self) -> None:
        self._saved = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = sdpa

    def restore(self) -> None:
        F.scaled_dot_product_attention = self._saved

    def __exit__(self, *exc: object) -> None:
        self.restore()


def patch_sdpa() -> _Patch:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through :func:`sdpa`.

    As a context manager the original is restored on exit; as a plain call the patch stays
    until ``.restore()`` is called on the returned object::

        with attnbias.patch_sdpa():
            model(tokens, attn_mask=attnbias.causal_lower_right())  # code calling F.sdpa

    Model code that binds the function at import (``from torch.nn.functional import
    scaled_dot_product_attention``) keeps the original and is not affected.
    """
    return _Patch()

"""The entry points: :func:`sdpa`, :func:`patch_sdpa` and :func:`explain`.

Shape legend::

    B   batch size              L   query sequence length
    Hq  query heads             S   key/value sequence length
    Hkv key/value heads         E   head dimension, Ev value head dimension
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import sys
import threading
import warnings
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnbias import plan_cache, routing
from attnbias.backends.documents import call_documents
from attnbias.biases import AttnBias, TensorBias
from attnbias.biases.base import from_torch, set_router
from attnbias.kinds import Form
from attnbias.mods import eager as mod_reads
from attnbias.planner import Plan, current_policy, needs_reach, plan
from attnbias.spec import Spec, call_form, capturing, make_spec, with_mask_reach
from attnbias.terms import Call

__all__ = ["check_errors", "explain", "patch_sdpa", "sdpa"]

AttnMask = AttnBias | Tensor | None


def _flag(name: str, value: Any) -> None:
    # Stock SDPA takes only a Python bool here; a string such as "no" is truthy, so taking
    # truthiness would silently turn it into True.
    if not isinstance(value, bool):
        raise TypeError(
            f"sdpa: {name} must be True or False, got {value!r} of type {type(value).__name__}; "
            f"pass a Python bool (stock SDPA refuses other types too)"
        )


def _real(name: str, value: Any, allowed: str) -> Any:
    """``value`` as a float: a real number, or a 0-d real tensor (both of which stock SDPA
    takes); a symbolic number (``torch.compile`` with dynamic shapes) is returned as is."""
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return value
    if isinstance(value, Tensor):
        if value.dim() != 0 or value.is_complex() or value.device.type == "meta":
            what = "complex " if value.is_complex() else ""
            raise TypeError(
                f"sdpa: {name} must be {allowed}, got a {what}tensor of shape "
                f"{tuple(value.shape)} on {value.device}; pass a Python float"
            )
        if value.requires_grad:
            raise TypeError(
                f"sdpa: {name} is a tensor that requires grad, but attention is not "
                f"differentiated with respect to {name} (stock SDPA refuses it too); pass "
                f"{name}.item() or a Python float"
            )
        return float(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"sdpa: {name} must be {allowed}, got {value!r} of type {type(value).__name__}")


def _validate(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
) -> tuple[float, float | None]:
    """Check a call's arguments; return ``(dropout_p, scale)`` as floats.

    Raises ``TypeError`` / ``ValueError`` naming the offending values and the fix. The numbers
    take what stock SDPA takes (Python and NumPy numbers, 0-d tensors).
    """
    _flag("is_causal", is_causal)
    _flag("enable_gqa", enable_gqa)
    dropout = _real("dropout_p", dropout_p, "a number in [0, 1]")
    # Stock SDPA takes dropout_p=1.0 (every weight dropped: the output is 0), so it is kept.
    if not (isinstance(dropout, float) and 0.0 <= dropout <= 1.0):
        raise ValueError(f"sdpa: dropout_p must be in [0, 1], got {dropout_p!r}")
    if scale is not None:
        scale = _real("scale", scale, "a finite real number or None")
        if isinstance(scale, float) and not math.isfinite(scale):
            raise ValueError(
                f"sdpa: scale must be a finite real number or None (for 1/sqrt(E)), got "
                f"{scale!r}; zero and negative values are fine"
            )
    if attn_mask is not None and not isinstance(attn_mask, (AttnBias, Tensor)):
        hint = ""
        if isinstance(attn_mask, type) and issubclass(attn_mask, AttnBias):
            hint = f"; pass an instance, e.g. {attn_mask.__name__}(...), not the class"
        raise TypeError(
            f"sdpa: attn_mask must be an AttnBias, a Tensor or None, got "
            f"{type(attn_mask).__name__}{hint}"
        )
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"sdpa: {name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 4:
            raise ValueError(
                f"sdpa: {name} must be 4-D (B, H, seq, E), got shape {tuple(tensor.shape)}; "
                f"add the missing batch/head dimensions with .unsqueeze or .view"
            )
    if not query.is_floating_point():
        raise TypeError(
            f"sdpa: query must be a floating point tensor, got dtype={query.dtype}; cast query, "
            f"key and value with .to(torch.float32) (or float16, bfloat16, float64)"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(
            f"sdpa: query, key and value must share a dtype, got {query.dtype}, {key.dtype} and "
            f"{value.dtype}; cast them with .to(dtype)"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(
            f"sdpa: query, key and value must be on one device, got {query.device}, "
            f"{key.device} and {value.device}; move them with .to(device)"
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
    if heads_kv == 0 and heads_q != 0:
        raise ValueError(
            f"sdpa: got Hq={heads_q} and Hkv=0: query heads need at least one key/value head; "
            f"Hq must be a multiple of Hkv"
        )
    if heads_kv != 0 and heads_q % heads_kv != 0:
        raise ValueError(f"sdpa: got Hq={heads_q} and Hkv={heads_kv}. Hq must be a multiple of Hkv")
    if heads_q != heads_kv and not enable_gqa:
        raise ValueError(
            f"sdpa: query has Hq={heads_q} heads but key/value have Hkv={heads_kv}; pass "
            f"enable_gqa=True to share each key/value head among {heads_q // heads_kv} query heads"
        )
    if scale is None and head_dim == 0:
        # With E=0 every score q·k is an empty sum, 0 at any finite scale (stock SDPA gives
        # the same), while the default 1/sqrt(E) is undefined.
        scale = 1.0
    if isinstance(attn_mask, AttnBias):
        attn_mask.validate_call(Call(batch, heads_q, query.shape[2], key.shape[2], query.device))
    return dropout, scale


def _decide(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: AttnMask,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    call: Hashable | None = None,
    measure: bool = True,
) -> tuple[Callable[[], str], Callable[[], Tensor]]:
    """``(explanation, thunk)``: the one decision both sdpa and explain report, for a
    validated call of any form (a bias object, a plain tensor mask, none).

    ``call`` is the call's :func:`plan_cache.call_key`; the decision is kept under it and the
    chosen backend prepares its run once, for this call and the identical ones after it (both
    routes where the route depends on being captured in a CUDA graph).
    """
    form = call_form(query, attn_mask)
    if form in (Form.NO_MASK, Form.TENSOR) and _planned(query, is_causal, scale):
        # planned as a bias: a mask tensor as TensorBias, no mask as the empty sum
        if isinstance(attn_mask, Tensor):
            attn_mask = TensorBias(attn_mask)
            form = call_form(query, attn_mask)
        else:
            form = Form.BIAS
    chosen = routing.decide(
        plan_spec(
            make_spec(
                query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa, form=form
            )
        ),
        may_measure=measure,
    )
    if call is not None and not chosen.provisional:
        entry = plan_cache.store(call, chosen)
        if entry is not None:
            return chosen.explain, partial(entry.run, query, key, value)
    return chosen.explain, chosen.run


def plan_spec(spec: Spec) -> Plan:
    """The planner's decision for ``spec``, with the per-shape facts of the lowering that
    planning reads worked out first, where the device holds what they read: the reach of a
    ModBias mask (:func:`~attnbias.spec.with_mask_reach`, one launch and synchronisation) and
    the layout of the call's documents (their ids read on the host once per bias). Planning
    itself launches nothing and reads nothing from the device."""
    if needs_reach(spec):
        spec = with_mask_reach(spec)
    if (
        spec.form == Form.BIAS
        and spec.terms.q_doc is not None
        and len(spec.terms.doc_parts) == 1
        and not (spec.compiling or spec.capturing)
        and spec.documents is None
    ):
        spec = dataclasses.replace(spec, documents=call_documents(spec))
    return plan(spec)


def _planned(query: Tensor, is_causal: bool, scale: float | None) -> bool:
    """Whether a call without a bias object is planned as a bias rather than handed to stock
    SDPA: where :func:`use_backends` pins backends or excludes stock SDPA, and where stock
    SDPA's CPU kernel gives NaN (``is_causal`` with a scale that is not positive)."""
    policy = current_policy()
    if policy.only is not None or "sdpa" in policy.exclude:
        return True
    return is_causal and scale is not None and scale <= 0 and query.device.type == "cpu"


def _route(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: AttnBias,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    enable_gqa: bool = False,
) -> Tensor:
    """The ``dispatch`` of the built-in biases (``KernelBias.dispatch``): the dispatcher's
    decision for the call, run."""
    spec = make_spec(query, key, value, attn_bias, causal, scale, dropout_p, enable_gqa)
    return plan_spec(spec).run()


set_router(_route)


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
        dropout_p: dropout probability on the attention weights, in ``[0, 1]`` (``1.0`` drops
            every weight, as in stock SDPA); a number or a 0-d tensor.
        is_causal: add an upper-left causal mask; a Python bool, as stock SDPA requires.
        scale: score scale, default ``1 / sqrt(E)``; any finite number (0 and negative
            included) or a 0-d tensor.
        enable_gqa: allow ``Hkv < Hq`` (``Hq`` a multiple of ``Hkv``); query head ``h`` uses
            key/value head ``h // (Hq // Hkv)``. A Python bool.

    Returns:
        ``(B, Hq, L, Ev)``. A query row that keeps no key gives 0 (and zero gradients). An
        empty ``B``, ``Hq`` or ``L`` gives an empty result without running anything, and
        ``S = 0`` gives 0 for every row, as stock SDPA does; the gradients are zeros.

    Raises:
        TypeError: a flag that is not a bool, a number that is not a number, an ``attn_mask``
            of another type, or inputs that are not floating point tensors of one dtype.
        ValueError: shapes that do not fit together, tensors on different devices, a
            non-finite ``scale``, ``dropout_p`` outside ``[0, 1]``, a bias that does not fit
            the call. Each message names the values and the fix.

    Example::

        >>> from attnbias import sdpa, SlidingWindowBias, SoftcapBias, causal_lower_right
        >>> q = k = v = torch.randn(1, 2, 8, 16)
        >>> bias = causal_lower_right() + SlidingWindowBias(3) + SoftcapBias(50.0)
        >>> sdpa(q, k, v, attn_mask=bias).shape
        torch.Size([1, 2, 8, 16])
    """
    if mod_reads.pending_checks() and not torch.compiler.is_compiling() and not capturing(query):
        check_errors()  # an earlier call's reads, checked on the device
    attn_mask = from_torch(attn_mask) or attn_mask  # PyTorch's own causal bias, as ours
    if isinstance(attn_mask, AttnBias) and attn_mask.holds_pages:
        from attnbias.paged import paged_sdpa  # key and value are page pools

        return paged_sdpa(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )  # fmt: skip
    call = plan_cache.call_key(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, current_policy()
    )
    if call is not None:
        cached = plan_cache.lookup(call)
        if cached is not None:
            # The same call, validated and planned before.
            return cached.run(query, key, value)
    dropout_p, scale = _validate(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )
    if isinstance(attn_mask, Tensor):
        warnings.warn(
            "attnbias.sdpa got a plain Tensor attn_mask and passes it to stock SDPA unchanged; "
            "wrap it in attnbias.TensorBias, or use a structured bias (CausalBias, "
            "SlidingWindowBias, DocumentBias, ...) so the fastest kernel can be chosen",
            UserWarning,
            stacklevel=2,
        )
    _, run = _decide(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, call)
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
    materialized mask), ``reference`` (the exact eager path), ``empty`` (no output element:
    nothing runs) or ``<Class>.dispatch`` (a user bias's own dispatch). For the built-in
    biases the next lines give the order the backends were tried in (set per GPU generation
    and kind of bias, or by :func:`use_backends`) and every other backend's reasons::

        >>> q = k = v = torch.randn(1, 1, 4, 8)
        >>> print(explain(q, k, v, attn_mask=SoftcapBias(30.0)))  # doctest: +ELLIPSIS
        reference: soft-cap 30 runs in the exact eager path (...)
          order (cpu, softcap, inference): triton > sdpa > sdpa+mask > reference
          fa4: flash_attn.cute is not installed ...
          triton: the Triton kernel needs CUDA tensors and these are on cpu
          sdpa: soft-cap 30 is neither no mask nor plain upper-left causal, ...
          sdpa+mask: soft-cap has no materialized form
    """
    attn_mask = from_torch(attn_mask) or attn_mask
    if isinstance(attn_mask, AttnBias) and attn_mask.holds_pages:
        from attnbias.paged import paged_explain

        return paged_explain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    dropout_p, scale = _validate(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )
    explanation, _ = _decide(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, measure=False
    )
    return explanation()


# The parameters attnbias.sdpa takes; a call with a bias object and any other keyword is refused
# by name rather than by Python's generic message.
_SDPA_PARAMETERS = frozenset(
    ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
)
# Serializes patching and restoring across threads; calls of the patched function never take it.
_PATCH_LOCK = threading.Lock()


def _patch_of(function: Any) -> _Patch | None:
    """The patch that installed ``function``, or None for any other function."""
    patch = getattr(function, "_attnbias_patch", None)
    return patch if isinstance(patch, _Patch) else None


def _skip_restored(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``function`` without the restored patches on top of it (they only pass calls through)."""
    patch = _patch_of(function)
    while patch is not None and not patch.active:
        function = patch.replaced
        patch = _patch_of(function)
    return function


class _Patch(contextlib.AbstractContextManager["_Patch"]):
    """One active :func:`patch_sdpa`; :meth:`restore` (or leaving the ``with`` block) undoes it.

    The patches form a chain: each one's function passes on what it does not handle to the
    function it replaced (:attr:`replaced`). Restoring a patch unlinks it from the chain, so
    restoring in any order leaves the others working and, once all are restored, puts back
    exactly the function the first one replaced.
    """

    def __init__(self) -> None:
        with _PATCH_LOCK:
            self.active = True
            # What this patch replaced; relinked (under the lock) when a patch below it is
            # restored, so it always names the next function that does something.
            self.replaced: Callable[..., Tensor] = _skip_restored(F.scaled_dot_product_attention)
            self.function = self._make_function()
            F.scaled_dot_product_attention = self.function

    def _make_function(self) -> Callable[..., Tensor]:
        def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Tensor:
            attn_mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            if not (self.active and isinstance(attn_mask, AttnBias)):
                # Not ours to change: the replaced function sees the call exactly as made.
                return self.replaced(*args, **kwargs)
            unknown = sorted(set(kwargs) - _SDPA_PARAMETERS)
            if unknown:
                raise TypeError(
                    f"attnbias.sdpa (which runs calls whose attn_mask is a bias object while "
                    f"patch_sdpa() is active) takes no argument {', '.join(unknown)}; it takes "
                    f"{', '.join(sorted(_SDPA_PARAMETERS))}"
                )
            return sdpa(*args, **kwargs)

        scaled_dot_product_attention.__doc__ = (
            "torch.nn.functional.scaled_dot_product_attention, patched by "
            "attnbias.patch_sdpa(): a call whose attn_mask is an attnbias bias object runs "
            "through attnbias.sdpa; every other call goes to the function it replaced, untouched."
        )
        scaled_dot_product_attention._attnbias_patch = self  # type: ignore[attr-defined]
        return scaled_dot_product_attention

    def restore(self) -> None:
        """Undo this patch; a second call does nothing."""
        with _PATCH_LOCK:
            if not self.active:
                return
            self.active = False
            current = F.scaled_dot_product_attention
            if current is self.function:
                F.scaled_dot_product_attention = _skip_restored(self.replaced)
                return
            # Patched on top since: find the patch whose replaced function is this one and
            # link it past this one. Behind a function from elsewhere the chain cannot be
            # followed; this one then stays in it, passing every call through.
            above = _patch_of(current)
            while above is not None and above.replaced is not self.function:
                above = _patch_of(above.replaced)
            if above is not None:
                above.replaced = _skip_restored(self.replaced)

    def __enter__(self) -> _Patch:
        if not self.active:
            raise RuntimeError(
                "this patch_sdpa() patch was already restored and cannot be entered again; "
                "call attnbias.patch_sdpa() for a new one"
            )
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def patch_sdpa() -> _Patch:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` through :func:`sdpa`.

    The function is patched when ``patch_sdpa()`` is called. As a context manager it is restored
    on exit; as a plain call the patch stays until ``.restore()`` is called on the returned
    object::

        with attnbias.patch_sdpa():
            model(tokens, attn_mask=attnbias.causal_lower_right())  # code calling F.sdpa

    While patched, only a call whose ``attn_mask`` is a bias object (:class:`AttnBias`) runs
    through :func:`sdpa`. Every other call (no mask, a plain tensor mask, whatever shapes and
    arguments stock SDPA takes) goes to the function that was there before, untouched: the same
    result, the same errors, and no warning for a plain tensor mask (an unchanged model would
    otherwise warn on every call).

    Patches stack. Nested patches may be restored in any order, and from any thread: restoring
    one leaves the others in effect, and once every patch is restored the function is exactly
    the one the first patch replaced. ``.restore()`` twice does nothing the second time. A
    function someone else installed on top of a patch is never removed; if it is still there
    when the patch under it is restored, that patch stays in place, passing every call through,
    until a later ``patch_sdpa()`` finds it uncovered and drops it. The patch is process-wide:
    every thread sees it.

    Model code that binds the function at import (``from torch.nn.functional import
    scaled_dot_product_attention``) keeps the original and is not affected.
    """
    return _Patch()


def check_errors() -> None:
    """Raise the error an earlier call found on the device, if any.

    A ``ModBias`` function that indexes a tensor with an index whose range cannot be proven
    on the host (bounds unknown from its operations and more than 2**24 positions to
    evaluate) is checked on the device while the kernels run, without a synchronisation;
    the next eager call of :func:`sdpa` reads that check first and raises the ``IndexError``
    there, naming the tensor and the range reached (the earlier call's output is wrong).
    Call this to read the checks now, e.g. at the end of a step. Nothing is pending (and
    nothing synchronises) otherwise. Likewise the checks of a paged cache's tables
    (:class:`~attnbias.biases.paged.PagedKV`: a page outside the pools, a length beyond a row's
    pages, more queries than tokens), raised as ``ValueError``.

    Example::

        >>> import attnbias
        >>> attnbias.check_errors()  # nothing pending: returns at once
    """
    try:
        mod_reads.check_errors()
    except IndexError:
        plan_cache.clear()  # the calls of that bias validate again (and raise at once)
        raise
    if "attnbias.paged" in sys.modules:
        sys.modules["attnbias.paged"].check_pending(wait=True)

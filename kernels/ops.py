"""The launchers as PyTorch custom ops, with autograd, and the public attention function.

``attnbias::attention_fwd`` returns ``(out, lse)``, ``attnbias::attention_bwd`` returns
``(dq, dk, dv)`` and ``attnbias::decode_fwd`` (forward only) returns ``out``. They are
``torch.library.triton_op``s whose kernels are launched through
``wrap_triton``, so ``torch.compile(fullgraph=True)`` traces into them without a graph break.
Outside of tracing (eager mode, and Triton's interpreter on CPU tensors) the same launchers
run through a plain ``torch.autograd.Function`` instead: the custom-op boundary and
``wrap_triton`` cost about 0.1 ms of host time per kernel launch, which is the whole runtime
of a short sequence, and tracing interpreted kernels is not supported anyway. Both paths share
one backward function, which also refuses double backward.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.library import triton_op

from .backward import attention_backward
from .decode import decode_forward
from .forward import attention_forward
from .launch import traceable_launches

__all__ = ["block_sparse_attention", "decode_attention"]


@triton_op("attnbias::attention_fwd", mutates_args=())
def _attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    band_lo: int | None,
    band_hi: int | None,
    q_doc: Tensor | None,
    kv_doc: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float | None,
    kv_start: Tensor | None = None,
    kv_end: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    with traceable_launches():
        return attention_forward(
            q, k, v, scale=scale, band_lo=band_lo, band_hi=band_hi, q_doc=q_doc, kv_doc=kv_doc,
            alibi_slopes=alibi_slopes, softcap=softcap, kv_start=kv_start, kv_end=kv_end,
        )  # fmt: skip


@triton_op("attnbias::attention_bwd", mutates_args=())
def _attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_lse: Tensor | None,
    scale: float,
    band_lo: int | None,
    band_hi: int | None,
    q_doc: Tensor | None,
    kv_doc: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float | None,
    kv_start: Tensor | None = None,
    kv_end: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``. The ALiBi slopes' gradient is computed on the eager path only (an
    empty placeholder output broke inductor's compilation of the backward)."""
    with traceable_launches():
        dq, dk, dv, _ = attention_backward(
            grad_out, q, k, v, out, lse, scale=scale, band_lo=band_lo, band_hi=band_hi,
            q_doc=q_doc, kv_doc=kv_doc, alibi_slopes=alibi_slopes, softcap=softcap,
            kv_start=kv_start, kv_end=kv_end, grad_lse=grad_lse, slopes_grad=False,
        )  # fmt: skip
    return dq, dk, dv


@triton_op("attnbias::decode_fwd", mutates_args=())
def _decode_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    band_lo: int | None,
    band_hi: int | None,
    q_doc: Tensor | None,
    kv_doc: Tensor | None,
    alibi_slopes: Tensor | None,
    softcap: float | None,
    kv_start: Tensor | None = None,
    kv_end: Tensor | None = None,
) -> Tensor:
    with traceable_launches():
        return decode_forward(
            q, k, v, scale=scale, band_lo=band_lo, band_hi=band_hi, q_doc=q_doc, kv_doc=kv_doc,
            alibi_slopes=alibi_slopes, softcap=softcap, kv_start=kv_start, kv_end=kv_end,
        )  # fmt: skip


def decode_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, **mask: Any) -> Tensor:
    """:func:`~attnbias.kernels.decode.decode_forward` as the ``attnbias::decode_fwd`` op, which
    ``torch.compile`` traces without a graph break (no gradients: forward only). ``mask``: the
    keywords of :meth:`attnbias.spec.Lowered.kernel_args`."""
    return _decode_fwd(q, k, v, scale, **mask)


# Position of ``alibi_slopes`` among the inputs of the forward (both paths).
_SLOPES = 8

SECOND_ORDER_MESSAGE = (
    "attnbias: the gradients of the Triton attention kernel cannot be differentiated again "
    "(double backward, e.g. a gradient penalty, is not supported); run this attention call "
    'under attnbias.use_backends("reference"), whose gradients are exact to any order'
)


class _FirstOrderGradients(torch.autograd.Function):
    """The kernel's gradients as a function of what they are computed from (``sources``), for
    ``create_graph=True``: they then require grad, and differentiating them again raises
    instead of silently leaving out the second-order terms."""

    @staticmethod
    def forward(
        ctx: Any, compute: Callable[[], tuple[Tensor | None, ...]], *sources: Tensor
    ) -> tuple[Tensor | None, ...]:
        return compute()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        raise NotImplementedError(SECOND_ORDER_MESSAGE)


def _setup_context(
    ctx: Any,
    inputs: tuple[Any, ...],
    output: tuple[Tensor, Tensor],
    *,
    traceable: bool = True,
) -> None:
    q, k, v, scale, band_lo, band_hi, q_doc, kv_doc, alibi_slopes, softcap, kv_start, kv_end = (
        inputs
    )
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, q_doc, kv_doc, alibi_slopes, kv_start, kv_end)
    ctx.scale = scale
    ctx.band_lo = band_lo
    ctx.band_hi = band_hi
    ctx.softcap = softcap
    ctx.traceable = traceable  # False: eager, launch the kernels without the op boundary


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
    """The backward of both paths: gradients of q, k, v and the ALiBi slopes.

    Under ``create_graph=True`` (grad mode on here) the gradients come back attached to what
    they were computed from, through :class:`_FirstOrderGradients`, so that a second backward
    through them raises.
    """
    q, k, v, out, lse, q_doc, kv_doc, alibi_slopes, kv_start, kv_end = ctx.saved_tensors
    slopes_grad = alibi_slopes is not None and bool(ctx.needs_input_grad[_SLOPES])

    def compute() -> tuple[Tensor | None, ...]:
        if ctx.traceable:
            if slopes_grad:
                raise NotImplementedError(
                    "attnbias: gradients of ALiBi slopes through the Triton kernel are computed "
                    "in eager mode only, not under torch.compile; run the compiled call under "
                    'attnbias.use_backends("reference") or keep the slopes fixed'
                )
            dq, dk, dv = torch.ops.attnbias.attention_bwd(
                grad_out, q, k, v, out, lse, grad_lse, ctx.scale, ctx.band_lo, ctx.band_hi,
                q_doc, kv_doc, alibi_slopes, ctx.softcap, kv_start, kv_end,
            )  # fmt: skip
            dslopes = None
        else:
            dq, dk, dv, dslopes = attention_backward(
                grad_out, q, k, v, out, lse, scale=ctx.scale, band_lo=ctx.band_lo,
                band_hi=ctx.band_hi, q_doc=q_doc, kv_doc=kv_doc, alibi_slopes=alibi_slopes,
                softcap=ctx.softcap, kv_start=kv_start, kv_end=kv_end, grad_lse=grad_lse,
                slopes_grad=slopes_grad,
            )  # fmt: skip
        return dq, dk, dv, dslopes if slopes_grad else None

    sources = [
        t for t in (grad_out, grad_lse, q, k, v, alibi_slopes) if t is not None and t.requires_grad
    ]
    if torch.is_grad_enabled() and sources and not torch.compiler.is_compiling():
        dq, dk, dv, dslopes = _FirstOrderGradients.apply(compute, *sources)
    else:
        dq, dk, dv, dslopes = compute()
    # No gradient for the scale, the band, the document ids, the cap or the key range.
    return dq, dk, dv, None, None, None, None, None, dslopes, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same launchers without the custom-op boundary (eager mode, interpreter)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float,
        band_lo: int | None,
        band_hi: int | None,
        q_doc: Tensor | None,
        kv_doc: Tensor | None,
        alibi_slopes: Tensor | None,
        softcap: float | None,
        kv_start: Tensor | None,
        kv_end: Tensor | None,
    ) -> Tensor:
        out, lse = attention_forward(
            q, k, v, scale=scale, band_lo=band_lo, band_hi=band_hi, q_doc=q_doc, kv_doc=kv_doc,
            alibi_slopes=alibi_slopes, softcap=softcap, kv_start=kv_start, kv_end=kv_end,
        )  # fmt: skip
        _setup_context(
            ctx,
            (q, k, v, scale, band_lo, band_hi, q_doc, kv_doc, alibi_slopes, softcap, kv_start,
             kv_end),
            (out, lse),
            traceable=False,
        )  # fmt: skip
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        return _backward(ctx, grad_out, None)


def _any_requires_grad(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor | None) -> bool:
    return (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or bool(slopes is not None and slopes.requires_grad)
    )


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    band_lo: int | None = None,
    band_hi: int | None = None,
    q_doc: Tensor | None = None,
    kv_doc: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    kv_start: Tensor | None = None,
    kv_end: Tensor | None = None,
) -> Tensor:
    """Attention over the pairs kept by a band, packed documents and per-row key ranges.

    Shapes: ``q`` ``(B, Hq, L, E)``, ``k``/``v`` ``(B, Hkv, S, E)`` with ``Hq % Hkv == 0``;
    returns ``(B, Hq, L, E)`` in ``q.dtype``. A pair ``(i, j)`` is kept when
    ``band_lo <= j - i <= band_hi`` (``None`` leaves a side open) and, given document ids
    ``q_doc`` ``(1 | B, L)`` / ``kv_doc`` ``(1 | B, S)`` (non-decreasing), when
    ``q_doc[i] == kv_doc[j]``; given integer ``kv_start`` and ``kv_end`` ``(B,)`` (or ``(1,)``,
    both or neither), batch row ``b`` keeps only keys ``kv_start[b] <= j < kv_end[b]`` and
    reads no key or value outside them, so nothing there (NaN included) reaches any output or
    gradient, and their gradients are 0. Scores are ``scale * q.k``, then
    ``softcap * tanh(s / softcap)`` if ``softcap`` is set, then
    ``- slope[b, h] * |i + S - L - j|`` if ``alibi_slopes`` ``(1 | B, Hq)`` is set. Rows
    that keep nothing give 0 and zero gradients.

    Differentiable in ``q``, ``k``, ``v`` and ``alibi_slopes``, once: differentiating the
    gradients again (``create_graph=True``, then a backward through them) raises
    ``NotImplementedError``. Any finite ``scale`` works (0 and negative ones too). A NaN or Inf
    in a key, value, query or output gradient reaches only the pairs that keep it.

    Inputs are not validated here; the ``attnbias`` front-end does that.
    """
    if not torch.compiler.is_compiling():
        if not (torch.is_grad_enabled() and _any_requires_grad(q, k, v, alibi_slopes)):
            # nothing to record: no autograd node, just the launch
            out, _ = attention_forward(
                q, k, v, scale=scale, band_lo=band_lo, band_hi=band_hi, q_doc=q_doc,
                kv_doc=kv_doc, alibi_slopes=alibi_slopes, softcap=softcap, kv_start=kv_start,
                kv_end=kv_end,
            )  # fmt: skip
            return out
        return _EagerAttention.apply(
            q, k, v, scale, band_lo, band_hi, q_doc, kv_doc, alibi_slopes, softcap, kv_start,
            kv_end,
        )  # fmt: skip
    out, _ = torch.ops.attnbias.attention_fwd(
        q, k, v, scale, band_lo, band_hi, q_doc, kv_doc, alibi_slopes, softcap, kv_start, kv_end
    )
    return out

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

from .backward import BackwardPlan, attention_backward
from .decode import decode_forward
from .forward import ForwardPlan, attention_forward
from .launch import traceable_launches
from .masks import with_mod_lists
from .program import MaskProgram

__all__ = ["block_sparse_attention", "decode_attention"]


@triton_op("attnbias::attention_fwd", mutates_args=())
def _attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tensors: list[Tensor | None],
    ints: list[int],
    floats: list[float],
    scale: float,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of :func:`attention_forward`; the mask program packed
    (:meth:`MaskProgram.pack`)."""
    with traceable_launches():
        return attention_forward(q, k, v, MaskProgram.unpack(tensors, ints, floats), scale=scale)


@triton_op("attnbias::attention_bwd", mutates_args=())
def _attention_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_lse: Tensor | None,
    tensors: list[Tensor | None],
    ints: list[int],
    floats: list[float],
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)``. The ALiBi slopes' gradient is computed on the eager path only (an
    empty placeholder output broke inductor's compilation of the backward)."""
    program = MaskProgram.unpack(tensors, ints, floats)
    with traceable_launches():
        dq, dk, dv, _, _ = attention_backward(
            grad_out, q, k, v, out, lse, program, scale=scale, grad_lse=grad_lse,
            slopes_grad=False,
        )  # fmt: skip
    return dq, dk, dv


@triton_op("attnbias::decode_fwd", mutates_args=())
def _decode_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tensors: list[Tensor | None],
    ints: list[int],
    floats: list[float],
    scale: float,
) -> Tensor:
    with traceable_launches():
        return decode_forward(q, k, v, MaskProgram.unpack(tensors, ints, floats), scale=scale)


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, program: MaskProgram, *, scale: float
) -> Tensor:
    """:func:`~attnbias.kernels.decode.decode_forward` as the ``attnbias::decode_fwd`` op, which
    ``torch.compile`` traces without a graph break (no gradients: forward only)."""
    return _decode_fwd(q, k, v, *program.pack(), scale)


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


def _save(
    ctx: Any,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    scale: float,
    out: Tensor,
    lse: Tensor,
    *,
    traceable: bool,
) -> None:
    """What both backwards need: the tensors saved for backward, the program's other parts
    kept packed beside them (:func:`_program_of` gives the program back)."""
    ctx.program = None
    tensors, ints, floats = program.pack()
    ctx.save_for_backward(q, k, v, out, lse, *tensors)
    ctx.ints = ints
    ctx.floats = floats
    ctx.scale = scale
    ctx.traceable = traceable  # False: eager, launch the kernels without the op boundary
    # Autograd looks into a list argument of a registered op only when it holds no None: the
    # registered backward answers a gradient per tensor then, and one for the list otherwise.
    ctx.tensor_grads = [None] * len(tensors) if all(t is not None for t in tensors) else None


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, tensors, ints, floats, scale = inputs
    out, lse = output
    _save(ctx, q, k, v, MaskProgram.unpack(tensors, ints, floats), scale, out, lse, traceable=True)


def _backward_both(
    ctx: Any, grad_out: Tensor, grad_lse: Tensor | None, slopes_grad: bool, mod_grads: bool = False
) -> tuple[Any, ...]:
    """``(dq, dk, dv, dslopes, dmods)`` for both paths.

    Under ``create_graph=True`` (grad mode on here) the gradients come back attached to what
    they were computed from, through :class:`_FirstOrderGradients`, so that a second backward
    through them raises.
    """
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    program = _program_of(ctx)

    def compute() -> tuple[Any, ...]:
        if ctx.traceable:
            dq, dk, dv = torch.ops.attnbias.attention_bwd(
                grad_out, q, k, v, out, lse, grad_lse, tensors, ctx.ints, ctx.floats, ctx.scale
            )
            return dq, dk, dv, None, None
        return attention_backward(
            grad_out, q, k, v, out, lse, program, scale=ctx.scale, grad_lse=grad_lse,
            slopes_grad=slopes_grad, mod_grads=mod_grads,
        )  # fmt: skip

    sources = [
        t
        for t in (grad_out, grad_lse, q, k, v, program.alibi_slopes, *_mod_tensors(program))
        if t is not None and t.requires_grad
    ]
    if torch.is_grad_enabled() and sources and not torch.compiler.is_compiling():
        # a list is no tensor: the second-order guard takes the flat outputs
        dq, dk, dv, dslopes, *dmods = _FirstOrderGradients.apply(lambda: _flat(compute()), *sources)
        return dq, dk, dv, dslopes, dmods if mod_grads else None
    return compute()


def _program_of(ctx: Any) -> MaskProgram:
    """The program a forward saved: kept as it is (a planned eager call), or unpacked from
    the saved tensors and the packed scalars."""
    program = getattr(ctx, "program", None)
    if program is not None:
        return program
    return MaskProgram.unpack(ctx.saved_tensors[5:], ctx.ints, ctx.floats)


def _flat(grads: tuple[Any, ...]) -> tuple[Tensor | None, ...]:
    """``(dq, dk, dv, dslopes, dmods)`` with ``dmods`` spread out."""
    *first, dmods = grads
    return (*first, *(dmods or []))


def _mod_tensors(program: MaskProgram) -> list[Tensor]:
    """The float tensors generated score functions read: they may need a gradient."""
    mods = program.mods
    if mods is None or not mods.has_score:
        return []
    return [t for t in mods.traced.params if t.is_floating_point()]


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Any, ...]:
    """The registered op's backward: gradients of ``(q, k, v, tensors, ints, floats,
    scale)``; those of the packed tensors are ``None`` (the ALiBi slopes' gradient, at
    ``MaskProgram.tensor_slot("alibi_slopes")``, is computed on the eager path only)."""
    slopes = _program_of(ctx).alibi_slopes
    if slopes is not None and slopes.requires_grad:
        raise NotImplementedError(
            "attnbias: gradients of ALiBi slopes through the Triton kernel are computed "
            "in eager mode only, not under torch.compile; run the compiled call under "
            'attnbias.use_backends("reference") or keep the slopes fixed'
        )
    dq, dk, dv, _, _ = _backward_both(ctx, grad_out, grad_lse, slopes_grad=False)
    return dq, dk, dv, ctx.tensor_grads, None, None, None


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same launchers without the custom-op boundary (eager mode, interpreter). The ALiBi
    slopes and the float tensors of generated score functions are inputs of their own, so
    that autograd sees them and they get a gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        alibi_slopes: Tensor | None,
        program: MaskProgram,
        scale: float,
        plan: ForwardPlan | None,
        backward_plan: BackwardPlan | None,
        *mod_tensors: Tensor,
    ) -> Tensor:
        if plan is None:
            out, lse = attention_forward(q, k, v, program, scale=scale)
        else:
            out, lse = plan.launch(q, k, v, checked=False)
        ctx.backward_plan = backward_plan
        if backward_plan is None:
            _save(ctx, q, k, v, program, scale, out, lse, traceable=False)
        else:  # planned: the program is kept as it is (packing it is host time per call)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.program, ctx.scale, ctx.traceable = program, scale, False
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        needs = ctx.needs_input_grad
        planned = ctx.backward_plan
        if planned is not None and not any(needs[3:]) and not torch.is_grad_enabled():
            # the plan made once for this call identity: q, k and v's gradients only (no
            # slopes' or score functions' tensors', no gradient of a gradient)
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv, _, _ = planned.launch(grad_out, q, k, v, out, lse, checked=False)
            return dq, dk, dv, *(None,) * (len(needs) - 3)
        slopes_grad = bool(needs[3])
        wanted = needs[8:]
        dq, dk, dv, dslopes, dmods = _backward_both(
            ctx, grad_out, None, slopes_grad, mod_grads=any(wanted)
        )
        mod_out: list[Tensor | None] = [None] * len(wanted)
        if any(wanted):
            tensors = _mod_tensors(_program_of(ctx))
            mod_out = [
                grad.to(t.dtype) if want and grad is not None else None
                for want, grad, t in zip(
                    wanted, dmods or [None] * len(wanted), tensors, strict=True
                )
            ]
        # no gradient for the program (a tensor of it that needs one is an input of its own)
        return dq, dk, dv, dslopes if slopes_grad else None, None, None, None, None, *mod_out


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    forward_plan: ForwardPlan | None = None,
    backward_plan: BackwardPlan | None = None,
) -> Tensor:
    """Attention over the pairs a mask program keeps (:class:`~.program.MaskProgram`: a band,
    packed documents, per-row key ranges, ALiBi, soft-cap, block lists).

    Shapes: ``q`` ``(B, Hq, L, E)``, ``k``/``v`` ``(B, Hkv, S, E)`` with ``Hq % Hkv == 0``;
    returns ``(B, Hq, L, E)`` in ``q.dtype``. Batch row ``b`` reads no key or value outside
    its key range, so nothing there (NaN included) reaches any output or gradient, and their
    gradients are 0. Rows that keep nothing give 0 and zero gradients.

    Differentiable in ``q``, ``k``, ``v`` and ``program.alibi_slopes``, once: differentiating
    the gradients again (``create_graph=True``, then a backward through them) raises
    ``NotImplementedError``. Any finite ``scale`` works (0 and negative ones too). A NaN or Inf
    in a key, value, query or output gradient reaches only the pairs that keep it.

    ``forward_plan``: the forward planned once for calls of these tensors' shapes, dtypes and
    devices with this program and scale (:func:`~.forward.plan_forward`), launched instead of
    planning the forward again (the caller guarantees the match; not under torch.compile).
    ``backward_plan``: likewise the backward (:func:`~.backward.plan_backward` without
    slope, score-function or log-sum-exp gradients), used where the backward wants none of
    those and is not itself differentiated.

    Inputs are not validated here; the ``attnbias`` front-end does that.
    """
    slopes = program.alibi_slopes
    if not torch.compiler.is_compiling():
        learnable = any(t.requires_grad for t in _mod_tensors(program))
        if not (torch.is_grad_enabled() and (learnable or _any_requires_grad(q, k, v, slopes))):
            # nothing to record: no autograd node, just the launch
            if forward_plan is not None:
                return forward_plan.launch(q, k, v, checked=False)[0]
            return attention_forward(q, k, v, program, scale=scale)[0]
        # the block lists of mask functions, built once for the forward and the backward
        return _EagerAttention.apply(
            q,
            k,
            v,
            slopes,
            with_mod_lists(q, k, program),
            scale,
            forward_plan,
            backward_plan,
            *_mod_tensors(program),
        )
    out, _ = torch.ops.attnbias.attention_fwd(q, k, v, *program.pack(), scale)
    return out


def _any_requires_grad(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor | None) -> bool:
    return (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or bool(slopes is not None and slopes.requires_grad)
    )

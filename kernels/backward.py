"""The backward: dQ (one program per query block, which also stores the row terms ``delta``)
then dK/dV (one program per key block and key/value head, summing over its group of query
heads), and the ALiBi slopes' gradient. The kernels are in :mod:`.backward_dq` and
:mod:`.backward_dkdv`; here, their plan and launch."""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch import Tensor

from .backward_dkdv import _attn_bwd_dkdv
from .backward_dq import _attn_bwd_dq
from .configs import DKDV_CONFIGS, DQ_CONFIGS, dot_precision, padded_head_dim, pick_config
from .forward import check_identity, identity_of
from .launch import PreparedLaunch, empty_contiguous, empty_rows
from .masks import late_cols_first, late_rows_first, launch_mask
from .program import MaskProgram
from .record import MaskRecord

__all__ = ["BackwardPlan", "attention_backward", "plan_backward"]


@dataclass(frozen=True, eq=False)
class BackwardPlan:
    """The backward of one call identity, worked out once: :meth:`launch` only allocates the
    gradients and launches the dQ then the dK/dV kernel with the call's tensors.

    Made by :func:`plan_backward` for the shapes, dtypes and devices of ``q``, ``k``, ``v``
    (checked on each launch unless the caller has), the mask arguments (whose tensors it
    holds and the kernels read at each launch: they must not be written in place while the
    plan is used) and which gradients are wanted: the log-sum-exp's (``has_dlse``), the ALiBi
    slopes' and those of generated score functions' tensors. Strides and the data pointers'
    alignment may change from call to call (each combination gets its compiled kernel).
    """

    identity: tuple[object, ...]
    slopes: Tensor | None  # the program's ALiBi slopes, where their gradient is wanted
    mask: MaskRecord | None  # the kernels' mask record (its tensors are read at each launch)
    scalars: tuple[Any, ...]  # both kernels' runtime scalars after the strides
    dq_blocks: int  # dQ's programs along the query rows (the slope-gradient parts)
    mod_grads: tuple[Tensor, ...]  # the float tensors score functions read, gradient wanted
    has_dlse: bool
    kernels: tuple[PreparedLaunch, PreparedLaunch] | None  # None: an empty call

    def launch(
        self,
        grad_out: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        *,
        grad_lse: Tensor | None = None,
        checked: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor] | None]:
        """``(dq, dk, dv, dslopes, dmods)`` as :func:`attention_backward` returns them. No host
        synchronisation. ``grad_lse`` is given exactly where the plan has ``has_dlse``."""
        if checked:
            check_identity("backward", self.identity, q, k, v)
        if (grad_lse is not None) != self.has_dlse:
            raise ValueError(
                f"this backward plan was made {'with' if self.has_dlse else 'without'} a "
                "log-sum-exp gradient; make a new plan for this call"
            )
        dq, dk, dv = empty_contiguous(q), empty_contiguous(k), empty_contiguous(v)
        dmods = (
            [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in self.mod_grads]
            if self.mod_grads
            else None
        )
        slopes = self.slopes
        if self.kernels is None or self.mask is None:  # nothing depends on anything
            dslopes = None if slopes is None else torch.zeros_like(slopes)
            return dq.zero_(), dk.zero_(), dv.zero_(), dslopes, dmods
        dq_kernel, dkdv_kernel = self.kernels
        if lse.dtype is not torch.float32 or not lse.is_contiguous():  # (a forward's: it is)
            lse = lse.to(torch.float32).contiguous()
        if grad_lse is not None:
            grad_lse = grad_lse.to(torch.float32).contiguous()
        # (B, Hq, L) float32: made like the log-sum-exp where it is one (cheaper on the host)
        delta = empty_contiguous(lse) if lse.shape == q.shape[:-1] else empty_rows(q)
        dslope_parts = None
        if slopes is not None:
            dslope_parts = q.new_empty((*q.shape[:2], self.dq_blocks), dtype=torch.float32)
        q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
        o_stride, do_stride = out.stride(), grad_out.stride()
        # What the compiled kernels are specialised on beyond the plan: the strides (the
        # gradients and row terms are fresh and contiguous: theirs are fixed by the shapes),
        # and each tensor's 16-byte alignment, spelled out only when some tensor lacks it.
        key: tuple[object, ...] | None = None
        if dq_kernel.direct():
            key = (q_stride, k_stride, v_stride, o_stride, do_stride)
            pointers = (
                q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr() | grad_out.data_ptr()
                | lse.data_ptr() | dq.data_ptr() | dk.data_ptr() | dv.data_ptr()
                | delta.data_ptr()
            )  # fmt: skip
            others = (grad_lse, dslope_parts)
            if pointers % 16 or any(t is not None and t.data_ptr() % 16 for t in others):
                own = (q, k, v, out, grad_out, lse, grad_lse, dq, dk, dv, delta, dslope_parts)
                key += tuple(t is None or t.data_ptr() % 16 == 0 for t in own)
        mask = self.mask.values()
        dq_kernel(
            key, q, k, v, out, grad_out, lse, grad_lse, delta, dq, dslope_parts, *mask,
            *q_stride, *k_stride, *v_stride, *o_stride, *do_stride, *dq.stride(),
            *self.scalars, *(dmods or []),
        )  # fmt: skip
        dkdv_kernel(
            key, q, k, v, grad_out, lse, delta, dk, dv, *mask, *q_stride,
            *k_stride, *v_stride, *do_stride, *dk.stride(), *dv.stride(), *self.scalars,
        )  # fmt: skip
        dslopes = None
        if dslope_parts is not None and slopes is not None:
            dslopes = _reduce_to(dslope_parts.sum(-1), slopes)
        return dq, dk, dv, dslopes, dmods


def plan_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    has_dlse: bool = False,
    slopes_grad: bool = False,
    mod_grads: bool = False,
) -> BackwardPlan:
    """The :class:`BackwardPlan` of :func:`attention_backward` with these arguments; ``q``,
    ``k``, ``v`` give only their shapes, dtypes and devices (the plan keeps none of them)."""
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    identity = identity_of(q, k, v)
    alibi_slopes = program.alibi_slopes
    slopes = alibi_slopes if slopes_grad and alibi_slopes is not None else None
    mods = program.mods
    float_params: tuple[Tensor, ...] = ()
    if mod_grads and mods is not None and mods.has_score:
        float_params = tuple(t for t in mods.traced.params if t.is_floating_point())
    if batch * num_heads * seq_q * seq_k * head_dim == 0:
        return BackwardPlan(identity, slopes, None, (), 0, float_params, has_dlse, None)
    mask = launch_mask(q, k, program, scale=scale, rows=True, cols=True)
    block_e = padded_head_dim(head_dim)
    group_size = num_heads // num_kv_heads
    common: dict[str, Any] = dict(
        HEAD_DIM=head_dim,
        BLOCK_E=block_e,
        DOT_PRECISION=dot_precision(q),
        **mask.options(backward=True),
    )
    scalars = (num_heads, group_size, seq_q, seq_k, scale, *mask.mod_args())

    # The dQ kernel goes first: it also stores the row terms ``delta`` that dK/dV reads.
    cfg = pick_config(DQ_CONFIGS, q, block_e)
    block_m, block_n = mask.tiles(cfg.block_m, cfg.block_n)
    dq_grid = (triton.cdiv(seq_q, block_m), num_heads, batch)
    dq_kernel = PreparedLaunch(
        mask.kernel(_attn_bwd_dq, len(float_params), param_grads=bool(float_params)),
        dq_grid,
        dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            REVERSE=late_rows_first(seq_q, seq_k, mask),
            HAS_DLSE=has_dlse,
            EVEN_N=seq_k % block_n == 0,
            HAS_DSLOPE=slopes is not None,
            **mask.param_grad_option(),
            num_warps=cfg.num_warps,
            num_stages=mask.stages(cfg.num_stages),
            **common,
        ),
    )
    cfg = pick_config(DKDV_CONFIGS, q, block_e)
    block_m, block_n = mask.tiles(cfg.block_m, cfg.block_n)
    dkdv_kernel = PreparedLaunch(
        mask.kernel(_attn_bwd_dkdv),
        (triton.cdiv(seq_k, block_n), num_kv_heads, batch),
        dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            REVERSE=late_cols_first(seq_q, seq_k, mask),
            EVEN_M=seq_q % block_m == 0,
            num_warps=cfg.num_warps,
            num_stages=mask.stages(cfg.num_stages),
            **common,
        ),
    )
    return BackwardPlan(
        identity,
        slopes,
        mask.record,
        scalars,
        dq_grid[0],
        float_params,
        has_dlse,
        (dq_kernel, dkdv_kernel),
    )


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    grad_lse: Tensor | None = None,
    slopes_grad: bool = False,
    mod_grads: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, list[Tensor] | None]:
    """Gradients ``(dq, dk, dv, dslopes)`` of :func:`attention_forward`, in the inputs' dtypes
    and shapes: :func:`plan_backward`, then its launch.

    ``out`` and ``lse`` are the forward's outputs, ``grad_out`` ``(B, Hq, L, E)`` any strides;
    ``grad_lse`` ``(B, Hq, L)``, optional, is the gradient of ``lse`` when it was used.
    ``dslopes``, the gradient of ``program.alibi_slopes`` (same shape), is computed only when
    ``slopes_grad`` is set (and ALiBi is on), and is ``None`` otherwise. ``dmods``, with
    ``mod_grads`` and generated score functions, are the float32 gradients of the float
    tensors those functions read (``program.mods``), in their order; ``None`` otherwise.
    Rows that kept no key contribute nothing; keys that no row keeps get zero gradients, and
    keys and values outside a row's key range ``[kv_start[b], kv_end[b])`` are never read.
    """
    plan = plan_backward(
        q, k, v, program, scale=scale, has_dlse=grad_lse is not None, slopes_grad=slopes_grad,
        mod_grads=mod_grads,
    )  # fmt: skip
    return plan.launch(grad_out, q, k, v, out, lse, grad_lse=grad_lse, checked=False)


def _reduce_to(grad: Tensor, like: Tensor) -> Tensor:
    """``(B, Hq)`` per-slope gradients summed over the batch where ``like`` is ``(Hq,)`` or
    ``(1, Hq)``, in ``like``'s dtype."""
    if like.dim() == 1:
        grad = grad.sum(0)
    elif like.shape[0] == 1:
        grad = grad.sum(0, keepdim=True)
    return grad.to(like.dtype)

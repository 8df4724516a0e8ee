"""The library's own Triton block-sparse flash-attention kernels (``attnbias.kernels``)."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence

import torch
from torch import Tensor

from attnbias.backends.base import Backend, LseGrads, Prepared
from attnbias.kernels.limits import DTYPES, MAX_ALIBI_LENGTH, MAX_HEAD_DIM
from attnbias.kernels.limits import interpreting as _interpreting  # tests replace it
from attnbias.spec import Spec

__all__ = ["TritonKernel", "kernel_reasons"]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def kernel_reasons(spec: Spec, kernel: str) -> list[str]:
    """What every Triton kernel of the library refuses (``kernel`` names it in the reasons):
    devices, dropout, parts with no kernel form, head dims, ALiBi distances, Triton missing."""
    reasons = []
    device = spec.device.type
    if device != "cuda" and not (device == "cpu" and _interpreting()):
        reasons.append(f"{kernel} needs CUDA tensors and these are on {device}")
    if spec.dropout_p > 0.0:
        reasons.append(f"dropout_p={spec.dropout_p} is not fused in {kernel}")
    if spec.terms.others:
        names = ", ".join(type(p).__name__ for p in spec.terms.others)
        reasons.append(f"{names} has no kernel form")
    if spec.head_dim_v != spec.head_dim:
        reasons.append(
            f"the value head dim ({spec.head_dim_v}) differs from the query head dim "
            f"({spec.head_dim})"
        )
    if spec.head_dim > MAX_HEAD_DIM:
        reasons.append(f"head dim {spec.head_dim} is above the kernel's {MAX_HEAD_DIM}")
    _, _, length_q, length_kv = spec.shape
    if spec.terms.slopes is not None and max(length_q, length_kv) > MAX_ALIBI_LENGTH:
        reasons.append(
            f"ALiBi distances in (L, S)=({length_q}, {length_kv}) exceed "
            f"{MAX_ALIBI_LENGTH}, beyond which the kernel's float32 distances are inexact"
        )
    if spec.terms.slopes is not None and spec.terms.alibi_shift:
        from attnbias.kernels.masks import alibi_sign

        if alibi_sign(spec.program, length_q, length_kv) == 0:
            reasons.append(
                f"ALiBi shifted by {spec.terms.alibi_shift}: the band does not keep every pair "
                f"on one side of the shifted diagonal, which the kernels' form of a shift needs"
            )
    if not spec.compiling and not _triton_installed():
        reasons.append("Triton is not installed")
    return reasons


def _tile_counts(spec: Spec) -> str:
    """How the mask functions' block lists split the call's blocks: skipped, full, partial."""
    from attnbias.kernels.masks import with_mod_lists

    blocks = with_mod_lists(spec.query, spec.key, spec.program).blocks
    if blocks is None:
        return "no block lists"
    partial, full, total = blocks.counts()
    lists = blocks.kv_lists  # (Bl, Hl, Mb, 2, Nb + 1)
    return (
        f"of {total} blocks of {blocks.block_m}x{blocks.block_n} (per list row: "
        f"{lists.shape[0]} batch x {lists.shape[1]} head), {total - partial - full} skipped, "
        f"{full} full, {partial} partial"
    )


class TritonKernel(Backend):
    """Every band, documents, key ranges, ALiBi and soft-cap, forward and backward, skipping
    masked blocks.

    Any finite scale; a NaN or Inf in a position a row does not keep reaches neither that row
    nor any gradient, and one outside a batch row's key range (padding, unused cache slots) is
    never read at all; gradients for q, k, v and ALiBi slopes that require grad; double
    backward (differentiating the gradients again) raises ``NotImplementedError`` pointing to
    the reference path. On CPU tensors it runs only under Triton's interpreter
    (``TRITON_INTERPRET=1``).
    """

    name = "triton"
    dtypes = DTYPES
    returns_lse = True

    def reasons(self, spec: Spec) -> list[str]:
        reasons = kernel_reasons(spec, "the Triton kernel")
        terms = spec.terms
        if terms.mods and spec.needs_grad:
            if terms.slopes is not None and terms.slopes.requires_grad:
                reasons.append(
                    "ALiBi slopes that require grad together with a ModBias (their fused "
                    "gradient assumes no score function after them)"
                )
            program = spec.program.mods
            learnable = [t for t in program.traced.params if t.requires_grad]
            if learnable and program.has_score and spec.compiling:
                reasons.append(
                    f"ModBias tensors that require grad (shapes "
                    f"{[tuple(t.shape) for t in learnable]}) while torch.compile traces: the "
                    f"fused backward computes their gradient in eager mode only"
                )
        slopes = spec.terms.slopes
        if spec.compiling and spec.needs_grad and slopes is not None and slopes.requires_grad:
            reasons.append(
                "ALiBi slopes that require grad while torch.compile traces (the kernel computes "
                "their gradient in eager mode only)"
            )
        return reasons

    def how(self, spec: Spec) -> str:
        if spec.terms.has_key_range:
            return (
                "the block-sparse Triton kernel, skipping masked blocks and reading no key "
                "outside each batch row's key range"
            )
        mods = spec.program.mods
        if mods is not None and mods.has_mask:
            return f"the block-sparse Triton kernel, fused: {_tile_counts(spec)}"
        if mods is not None:
            return "the block-sparse Triton kernel, fused, skipping masked blocks"
        return "the block-sparse Triton kernel, skipping masked blocks"

    def run(self, spec: Spec) -> Tensor:
        from attnbias.kernels import block_sparse_attention

        return block_sparse_attention(
            spec.query, spec.key, spec.value, spec.program, scale=spec.resolved_scale
        )

    def forward_lse(self, spec: Spec) -> tuple[Tensor, Tensor]:
        from attnbias.kernels import attention_forward
        from attnbias.kernels.masks import alibi_score_offset

        out, lse = attention_forward(
            spec.query, spec.key, spec.value, spec.program, scale=spec.resolved_scale
        )
        offset = alibi_score_offset(spec.program, spec.shape[2], spec.shape[3])
        return out, lse if offset is None else lse - offset

    def backward_lse(
        self, spec: Spec, grad_out: Tensor, out: Tensor, lse: Tensor, wrt: Sequence[Tensor]
    ) -> LseGrads:
        """The kernels' backward with the merged output and log-sum-exp; the gradients of the
        program's ALiBi slopes and of its score functions' tensors are carried on to ``wrt``
        by autograd (through whatever made them from ``wrt``)."""
        from attnbias.kernels import attention_backward
        from attnbias.kernels.masks import alibi_score_offset

        program = spec.program
        offset = alibi_score_offset(program, spec.shape[2], spec.shape[3])
        if offset is not None:  # the kernels' scores of a shifted ALiBi, and so their lse
            lse = lse + offset
        slopes = program.alibi_slopes
        mod_tensors = (
            []
            if program.mods is None or not program.mods.has_score
            else [t for t in program.mods.traced.params if t.is_floating_point()]
        )
        wanted = [t for t in wrt if t.requires_grad]
        slopes_grad = bool(wanted and slopes is not None and slopes.requires_grad)
        mod_grads = bool(wanted and any(t.requires_grad for t in mod_tensors))
        dq, dk, dv, dslopes, dmods = attention_backward(
            grad_out.contiguous(), spec.query, spec.key, spec.value, out.contiguous(),
            lse.float().contiguous(), program, scale=spec.resolved_scale,
            slopes_grad=slopes_grad, mod_grads=mod_grads,
        )  # fmt: skip
        sources: list[Tensor] = []
        grads: list[Tensor] = []
        if slopes_grad and slopes is not None and dslopes is not None:
            sources.append(slopes)
            grads.append(dslopes)
        for tensor, grad in zip(mod_tensors, dmods or [], strict=False):
            if tensor.requires_grad:
                sources.append(tensor)
                grads.append(grad.to(tensor.dtype))
        found: list[Tensor | None] = [None] * len(wrt)
        if sources and wanted:
            reached = torch.autograd.grad(sources, wanted, grads, allow_unused=True)
            by_id = {id(t): g for t, g in zip(wanted, reached, strict=True)}
            found = [by_id.get(id(t)) for t in wrt]
        return dq, dk, dv, found

    def prepare(self, spec: Spec) -> Prepared:
        """The forward planned once (:func:`plan_forward`) and launched with each call's
        tensors: without gradients recording no autograd node, with them through the
        kernels' autograd function, whose backward is planned once too (:func:`plan_backward`;
        it serves the calls that want no gradient of the ALiBi slopes)."""
        if spec.compiling or spec.program.mods is not None:
            # ModBias calls: the block lists follow in-place changes of what they read, which
            # a plan made once would not see
            return super().prepare(spec)
        from attnbias.kernels import block_sparse_attention
        from attnbias.kernels.backward import plan_backward
        from attnbias.kernels.forward import plan_forward

        # The plans hold the lowered bias's device tensors; the plan-cache entry that holds
        # this function keeps the bias, and biases are not written in place.
        program, scale = spec.program, spec.resolved_scale
        plan = plan_forward(spec.query, spec.key, spec.value, program, scale=scale)
        if spec.needs_grad:
            backward = plan_backward(spec.query, spec.key, spec.value, program, scale=scale)

            def run_training(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
                return block_sparse_attention(
                    query, key, value, program, scale=scale, forward_plan=plan,
                    backward_plan=backward,
                )  # fmt: skip

            return run_training
        launch = plan.launch

        def run_prepared(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            # the plan cache's key already holds the shapes, dtypes and devices
            return launch(query, key, value, checked=False)[0]

        return run_prepared

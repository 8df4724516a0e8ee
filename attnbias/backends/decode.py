"""The library's Triton decode kernel (``attnbias.kernels.decode``): short queries against long
key/value caches, forward only."""

from __future__ import annotations

from torch import Tensor

from attnbias.backends.base import Backend, Prepared
from attnbias.backends.triton import kernel_reasons
from attnbias.kernels.limits import DTYPES, MAX_DECODE_QUERIES
from attnbias.spec import Spec

__all__ = ["TritonDecode"]


class TritonDecode(Backend):
    """Every band, documents, key ranges, ALiBi and soft-cap for at most
    ``MAX_DECODE_QUERIES`` queries, without gradients.

    The query heads that share a key/value head are packed with the queries into tiles of
    rows, so each key/value block is read once per group, and the visited key blocks are split
    across programs whose partial results are merged by log-sum-exp. Calls that need
    gradients take the training kernel (``triton``); a call traced by ``torch.compile`` runs
    the kernels through their registered op (``attnbias::decode_fwd``).
    """

    name = "triton-decode"
    dtypes = DTYPES

    def reasons(self, spec: Spec) -> list[str]:
        reasons = kernel_reasons(spec, "the decode kernel")
        length_q = spec.shape[2]
        if length_q > MAX_DECODE_QUERIES:
            reasons.append(
                f"L={length_q} queries is above the decode kernel's {MAX_DECODE_QUERIES} (it "
                f"serves short queries against long caches; the training kernel runs)"
            )
        if spec.needs_grad:
            reasons.append("gradients are required: the training kernel runs")
        if spec.program.blocks is not None:
            reasons.append("block lists are iterated by the training kernel only")

        return reasons

    def how(self, spec: Spec) -> str:
        from attnbias.kernels.decode import decode_layout

        layout = decode_layout(
            spec.query.shape,
            spec.key.shape,
            spec.device,
            spec.program,
            itemsize=spec.query.element_size(),
        )
        length_q = spec.shape[2]
        tiles = "1 tile" if layout.row_tiles == 1 else f"{layout.row_tiles} tiles"
        splits = (
            "one program per tile"
            if layout.splits == 1
            else f"its visited key blocks split {layout.splits} ways, merged by log-sum-exp"
        )
        return (
            f"the Triton decode kernel: {layout.group_size} query heads x {length_q} queries "
            f"per key/value head packed into {tiles} of {layout.block_m} rows, {splits}"
        )

    def run(self, spec: Spec) -> Tensor:
        from attnbias.kernels.decode import decode_forward

        if spec.compiling:
            from attnbias.kernels.ops import decode_attention

            return decode_attention(
                spec.query, spec.key, spec.value, spec.program, scale=spec.resolved_scale
            )
        return decode_forward(
            spec.query, spec.key, spec.value, spec.program, scale=spec.resolved_scale
        )

    def prepare(self, spec: Spec) -> Prepared:
        """The decode forward planned once (:func:`plan_decode`: layout, split count, mask
        arguments) and launched with each call's tensors."""
        from attnbias.kernels.decode import plan_decode

        # The plan holds the lowered bias's device tensors; the plan-cache entry that holds
        # this function keeps the bias, and biases are not written in place. The plan cache's
        # key already holds the shapes, dtypes and devices: no identity check per call.
        plan = plan_decode(
            spec.query, spec.key, spec.value, spec.program, scale=spec.resolved_scale
        )
        return plan.run

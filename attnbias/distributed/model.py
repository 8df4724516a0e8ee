"""The context-parallel cost model: the predicted time of a step in the sequence mode
(selective exchange) for a layout, and in the head mode (all-to-all), from rates fitted on
GPUs. It chooses the mode of a call and, for ``layout="auto"``, the layout."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from attnbias.biases import AttnBias
from attnbias.spec import lower
from attnbias.terms import Call

from .blocks import grain, layout_costs
from .exchange import Cover, Needs, pair_shapes
from .heads import heads_reasons
from .layouts import Layout

__all__ = ["RATES", "Choice", "Rates", "StepShape", "choose_mode", "sequence_seconds"]


@dataclass(frozen=True)
class Rates:
    """What the mode choice predicts with. Fitted to forward + backward steps on two H100s
    with NVLink (bf16, B=1, H=16, E=128, S = 32k and 128k; benchmarks/NOTES.md, "Context
    parallelism"), checked on two and four at 32k-512k: attention's work at FlashAttention
    4's pace, and how much slower shard pairs with mask functions or documents run (on the
    Triton kernel), a pair's fixed cost and the sequence mode's fixed cost per call (refitted
    to the steps with the merge in one kernel and each attention launched before its
    transfers: window, documents and causal at 32k-512k on two H200s and four H100s, within
    -4% to +17% of the measured step, the short calls over), the log-sum-exp merge per output
    element of the rows several pairs reach, the all-to-all's fixed cost (per direction) and
    rate, and the point-to-point rate."""

    flops: float = 6.5e14
    backward_factor: float = 3.5
    functions_slowdown: float = 1.9
    documents_slowdown: float = 1.6
    pair_s: float = 0.25e-3
    sequence_call_s: float = 0.2e-3
    merge_element_s: float = 2.6e-11
    all_to_all_s: float = 1.0e-3
    all_to_all_bytes: float = 1.4e11
    link_bytes: float = 1.4e11


RATES = Rates()


@dataclass(frozen=True)
class Choice:
    """The mode a call takes and why: the predicted seconds of each mode (``None`` where it
    cannot run) and the reasons the head mode cannot."""

    mode: str
    sequence_s: float
    heads_s: float | None
    heads_refused: tuple[str, ...]
    asked: str

    def describe(self) -> str:
        heads = (
            f"{self.heads_s * 1e3:.3f} ms" if self.heads_s is not None
            else "cannot run (" + "; ".join(self.heads_refused) + ")"
        )  # fmt: skip
        how = "asked for" if self.asked != "auto" else "least predicted time"
        return (
            f"mode {self.mode!r} ({how}); predicted per step: sequence "
            f"{self.sequence_s * 1e3:.3f} ms, heads {heads}"
        )


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on beyond the call and the layout: the key/value heads, the
    head dims, the bytes of an element, and whether the backward runs too."""

    heads_kv: int
    dim: int
    dim_v: int
    element: int
    needs_grad: bool


def _block_seconds(call: Call, layout: Layout, shape: StepShape) -> float:
    """The work of one block of the keep grid at ``layout``'s grains: its two products at
    FlashAttention 4's pace (the backward about 2.5 times more)."""
    pairs = grain(call.length_q, layout.pieces) * grain(call.length_kv, layout.pieces)
    passes = RATES.backward_factor if shape.needs_grad else 1.0
    width = shape.dim + shape.dim_v
    return 2.0 * pairs * call.heads * width * call.batch_size * passes / RATES.flops


def sequence_seconds(
    bias: AttnBias | None,
    call: Call,
    layout: Layout,
    grid: Tensor,
    needs: Needs,
    shape: StepShape,
) -> float:
    """The sequence mode's predicted seconds per step of ``call`` split by ``layout``: the
    slowest rank's kept blocks' work (slower on the Triton kernel for documents and mask
    functions), plus a cost per pair it runs (its host time) and the log-sum-exp merge of the
    rows several pairs reach, against its transfers, which overlap the work; ``grid``: the
    bias's keep grid at the layout's grains, ``needs``: what each rank receives
    (:func:`~.exchange.exchanged_runs`), ``shape``: the step's heads and dims. Rates from
    :data:`RATES`."""
    world = layout.world
    rates = RATES
    pass_factor = rates.backward_factor if shape.needs_grad else 1.0
    grain_kv = grain(call.length_kv, layout.pieces)
    batch = call.batch_size
    block_s = _block_seconds(call, layout, shape)
    # one key/value block's transfers: the keys and values, again in the backward with their
    # float32 gradients coming back
    moved = float(grain_kv * shape.heads_kv * (shape.dim + shape.dim_v) * batch * shape.element)
    moved *= (2.0 + 4.0 / shape.element) if shape.needs_grad else 1.0
    transfer_s = moved / rates.link_bytes
    costs = layout_costs(grid, layout, block_s, transfer_s)
    # a shard pair with documents or mask functions gives up FlashAttention 4 (no
    # log-sum-exp with documents there; a block's offsets are new numbers of the functions)
    terms = lower(bias, call.length_q, call.length_kv, call.device, batch=call.batch)
    pair_block_s = block_s * (
        rates.functions_slowdown if terms.mods
        else rates.documents_slowdown if terms.q_doc is not None
        else 1.0
    )  # fmt: skip
    sequence_s = 0.0
    for rank in range(world):
        shapes = [p for step in pair_shapes(grid, call, layout, rank, needs) for p in step]
        # rows that one pair reaches take its output as it comes; the others merge
        spans = [(rows.start, rows.stop) for rows, _, _ in shapes]
        once = Cover.of(spans, call.length_q // world).elements(1)
        merged = (sum(b - a for a, b in spans) - once) * call.heads * shape.dim_v * batch
        work = costs.compute[rank] * pair_block_s
        work += len(shapes) * rates.pair_s * pass_factor + merged * rates.merge_element_s
        sequence_s = max(sequence_s, work + rates.sequence_call_s * pass_factor,
                         costs.received[rank] * transfer_s)  # fmt: skip
    return sequence_s


def choose_mode(
    mode: str,
    bias: AttnBias | None,
    call: Call,
    layout: Layout,
    grid: Tensor,
    needs: Needs,
    shape: StepShape,
) -> Choice:
    """The mode of a call, by predicted time: the sequence mode's
    (:func:`sequence_seconds`) against the head mode's, a W-th of the whole work plus its
    all-to-all, which does not overlap. Rates from :data:`RATES`."""
    world, asked = layout.world, mode
    refused = tuple(heads_reasons(call.heads, shape.heads_kv, world, bias))
    if mode == "heads" and refused:
        raise ValueError(
            "attnbias.distributed.sdpa: mode='heads' cannot run this call: " + "; ".join(refused)
            + "; use mode='sequence' (or 'auto')"
        )  # fmt: skip
    rates = RATES
    sequence_s = sequence_seconds(bias, call, layout, grid, needs, shape)
    batch = call.batch_size
    block_s = _block_seconds(call, layout, shape)
    heads_s = None
    if not refused:
        total = int(grid.sum()) * block_s
        # q, k, v there and the output back, each (W - 1) / W of a part; the backward moves
        # the output's gradient there and q, k, v's back
        part_q = call.length_q // world * call.heads * batch
        part_kv = call.length_kv // world * shape.heads_kv * batch
        elements = float((part_q + part_kv) * (shape.dim + shape.dim_v))
        elements *= 2.0 if shape.needs_grad else 1.0
        exchange_s = rates.all_to_all_s * (2.0 if shape.needs_grad else 1.0)
        exchange_s += elements * shape.element * (world - 1) / world / rates.all_to_all_bytes
        heads_s = total / world + exchange_s
    if mode == "auto":
        mode = "heads" if heads_s is not None and heads_s < sequence_s else "sequence"
    return Choice(mode, sequence_s, heads_s, refused, asked)

"""The head-parallel mode of context parallelism (``attnbias.distributed.heads``) and the head
form of every bias kind (``AttnBias.sub_heads``).

``sub_heads`` is checked without processes: the bias of a range of heads, materialized, is the
whole call's materialized form at those heads, and its tensors' gradients reach the user's.

``heads_sdpa`` is checked in ``W`` spawned CPU processes joined by gloo on 127.0.0.1 (every
check of one ``W`` in one run, bounded by ``TIMEOUT_S``), each rank holding its part of the
sequence (zigzag and contiguous layouts, which the exchange writes in place, and a layout of
four chunks a rank in no order, which it reorders by an indexed copy; cut here with
``Layout.take``): in float64 against
single-process ``attnbias.sdpa`` on the whole tensors (output, dq, dk, dv and the bias's
tensors' gradients summed over the ranks), for every bias kind, sums, ``ModBias`` parts that
read the head, a user's materializing biases, GQA with whole and with shared (replicated)
key/value heads; in bfloat16 against the fp64 oracle (``attnbias.testing.oracle``); and
second-order gradients (double backward) in float64.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.distributed.heads import heads_reasons, heads_sdpa
from attnbias.distributed.layouts import Layout
from attnbias.terms import Call
from attnbias.testing.oracle import assert_close_to_oracle, attention

# isort: split
from test_distributed import RELATIVE, PrefixLM, RelativeTable, Strided, spawn

BATCH, HEAD_DIM = 2, 8


@dataclass(frozen=True)
class HeadWindow(ModBias):
    """A mask that reads the head: head ``h`` keeps the ``h + 1`` keys up to the query's."""

    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - h)


@dataclass(frozen=True)
class HeadStrided(AttnBias):
    """A user's bias that only materializes and depends on the head: head ``h`` keeps the keys
    ``j`` with ``j % (h + 1) == 0``, and the query's own, ``(H, L, S)``."""

    def materialize(
        self, device: Any = None, *, shape: Any = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        heads, length_q, length_kv = shape[-3], shape[-2], shape[-1]
        h = torch.arange(heads, device=device)[:, None, None]
        i = torch.arange(length_q, device=device)[None, :, None]
        j = torch.arange(length_kv, device=device)[None, None, :]
        keep = (j % (h + 1) == 0) | (i == j)
        zeros = torch.zeros(keep.shape, dtype=dtype or torch.float32, device=device)
        return zeros.masked_fill(~keep, -math.inf)

    def needs_materialization(self) -> bool:
        return True


class DispatchOnly(AttnBias):
    """A user's bias with only its own dispatch: no materialized form, no head form."""

    def needs_materialization(self) -> bool:
        return False

    @staticmethod
    def dispatch(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_bias: AttnBias,
        causal: bool,
        scale: float | None,
        dropout_p: float,
        enable_gqa: bool = False,
    ) -> Tensor:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value)


def _docs(length: int, count: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, count, (length,), generator=generator).sort().values


# -- sub_heads, without processes -----------------------------------------------------------


def _head_biases(batch: int, heads: int, length_q: int, length_kv: int) -> list[AttnBias]:
    docs_q = _docs(length_q, 3, 1)
    docs_kv = _docs(length_kv, 3, 1)
    return [
        causal_upper_left(),
        causal_lower_right(),
        SlidingWindowBias(3, 1),
        AlibiBias(num_heads=heads),
        AlibiBias(slopes=torch.rand(heads)),
        AlibiBias(slopes=torch.rand(batch, heads), shift=3),
        DocumentBias(docs_q, docs_kv),
        KeyRangeBias([1, 3], [9, 14]),
        TensorBias(torch.randn(batch, heads, length_q, length_kv)),
        TensorBias(torch.randn(heads, length_q, length_kv)),
        TensorBias(torch.randn(batch, 1, length_q, length_kv)),
        TensorBias(torch.randn(length_kv)),
        PrefixLM(5),
        RelativeTable(torch.randn(heads, 2 * RELATIVE + 1)),
        HeadWindow(),
        ModBias(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx + h) % 3 != 0),
        Strided(),
        HeadStrided(),
        causal_lower_right()
        + DocumentBias(docs_q, docs_kv)
        + AlibiBias(num_heads=heads)
        + HeadWindow()
        + HeadStrided(),
    ]


def test_the_heads_of_every_bias_are_its_materialized_form_at_those_heads() -> None:
    batch, heads, length_q, length_kv = 2, 4, 12, 16
    call = Call(batch, heads, length_q, length_kv)
    full = (batch, heads, length_q, length_kv)
    for bias in _head_biases(*full):
        whole = bias.materialize(shape=full).expand(full)
        for start, count in [(0, 4), (0, 1), (1, 2), (2, 2), (3, 1), (1, 3)]:
            sub = bias.sub_heads(call, start, count)
            shape = (batch, count, length_q, length_kv)
            part = sub.materialize(shape=shape).expand(shape)
            expected = whole[:, start : start + count]
            assert torch.equal(part, expected), (bias, start, count)


def test_a_bias_that_does_not_read_the_head_is_its_own_head_form() -> None:
    call = Call(2, 4, 12, 16)
    for bias in [
        causal_upper_left(),
        causal_lower_right(),
        SlidingWindowBias(3, 1),
        DocumentBias(_docs(12, 3, 1), _docs(16, 3, 1)),
        KeyRangeBias([1, 3], [9, 14]),
        SoftcapBias(30.0),
        TensorBias(torch.randn(2, 1, 12, 16)),
        PrefixLM(5),
        SoftcapBias(30.0) + causal_upper_left() + PrefixLM(2),
    ]:
        assert bias.sub_heads(call, 1, 2) is bias, bias
    # the range of every head
    for bias in [AlibiBias(num_heads=4), TensorBias(torch.randn(4, 12, 16)), Strided()]:
        assert bias.sub_heads(call, 0, 4) is bias, bias


def test_a_mod_bias_keeps_its_head_forms_per_start() -> None:
    call = Call(2, 4, 12, 16)
    bias = RelativeTable(torch.randn(4, 2 * RELATIVE + 1))
    first = bias.sub_heads(call, 2, 2)
    assert first is bias.sub_heads(call, 2, 1)
    assert first is not bias and "[h+2]" in repr(first), repr(first)
    assert bias.sub_heads(call, 0, 2) is bias  # h + 0 reads the same heads


def test_the_heads_of_a_learnable_tensor_are_views_so_gradients_reach_it() -> None:
    batch, heads, length_q, length_kv = 2, 4, 6, 6
    call = Call(batch, heads, length_q, length_kv)
    shape = (batch, 2, length_q, length_kv)
    slopes = torch.rand(batch, heads, dtype=torch.float64, requires_grad=True)
    tensor = torch.randn(batch, heads, length_q, length_kv, dtype=torch.float64).requires_grad_()
    table = torch.randn(heads, 2 * RELATIVE + 1, dtype=torch.float64, requires_grad=True)
    for bias, leaf in [
        (AlibiBias(slopes=slopes), slopes),
        (TensorBias(tensor), tensor),
        (RelativeTable(table), table),
    ]:
        sub = bias.sub_heads(call, 1, 2)
        (grad,) = torch.autograd.grad(sub.materialize(shape=shape, dtype=torch.float64).sum(), leaf)
        # the entries of the range's heads only
        heads_first = grad if leaf is table else grad.transpose(0, 1)
        assert heads_first[1:3].abs().sum() > 0, bias
        assert heads_first[[0, 3]].abs().sum() == 0, bias


def test_a_head_range_outside_the_call_and_a_bias_without_a_head_form_are_refused() -> None:
    call = Call(2, 4, 12, 16)
    for bias in (causal_upper_left(), AlibiBias(num_heads=4), TensorBias(torch.zeros(4, 12, 16))):
        with pytest.raises(ValueError, match=r"heads \[3, 5\).*Hq=4"):
            bias.sub_heads(call, 3, 2)
    with pytest.raises(ValueError, match="slopes for 2 heads but the query has Hq=4"):
        AlibiBias(num_heads=2).sub_heads(call, 0, 2)
    with pytest.raises(ValueError, match="has 3 heads but the call has Hq=4"):
        TensorBias(torch.zeros(3, 12, 16)).sub_heads(call, 0, 2)
    with pytest.raises(TypeError, match="DispatchOnly has no materialized form and no sub_heads"):
        DispatchOnly().sub_heads(call, 0, 2)


def test_the_head_mode_says_why_it_cannot_run_a_call() -> None:
    assert heads_reasons(4, 4, 2, None) == []
    assert heads_reasons(8, 2, 4, causal_upper_left() + Strided()) == []  # shared kv heads
    assert heads_reasons(8, 4, 2, RelativeTable(torch.zeros(8, 13))) == []  # whole kv heads
    (reason,) = heads_reasons(6, 6, 4, None)
    assert "Hq=6 is not a multiple of W=4" in reason and "divides 6" in reason, reason
    (reason,) = heads_reasons(12, 3, 2, None)  # 6 query heads a rank, 4 per kv head
    assert "Hq=12, Hkv=3 over W=2" in reason and "(Hq / W) % (Hq / Hkv) == 0" in reason, reason
    (reason,) = heads_reasons(4, 4, 2, causal_upper_left() + DispatchOnly())
    assert "DispatchOnly has no head form" in reason and "sub_heads(call, start, count)" in reason
    assert len(heads_reasons(6, 6, 4, DispatchOnly())) == 2


def test_over_nccl_a_rank_copies_its_own_share_and_sends_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The head mode's all-to-all over NCCL (simulated in one process: rank 1 of 3): the own
    share is copied on the device, the collective gets empty tensors in its place (NCCL
    would carry it through its channels at their bandwidth) and every other rank's share."""
    from attnbias.distributed import heads

    rank, world = 1, 3
    posted: list[tuple[list[Tensor], list[Tensor]]] = []

    def all_to_all(outputs: list[Tensor], inputs: list[Tensor], group: Any = None) -> None:
        posted.append((outputs, inputs))
        for j, out in enumerate(outputs):
            if j != rank:
                out.fill_(10.0 * j + rank)  # rank j's share for this rank

    monkeypatch.setattr(heads.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(heads.dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(heads.dist, "all_to_all", all_to_all)
    inputs = [torch.full((2, 3), float(j)) for j in range(world)]
    outputs = [torch.zeros(2, 3) for _ in range(world)]
    heads._all_to_all(outputs, inputs, None)
    ((sent_out, sent_in),) = posted
    assert sent_out[rank].numel() == 0 and sent_in[rank].numel() == 0
    assert all(sent_in[j] is inputs[j] for j in range(world) if j != rank)
    assert all(sent_out[j] is outputs[j] for j in range(world) if j != rank)
    assert torch.equal(outputs[rank], inputs[rank])  # copied, not sent
    assert torch.equal(outputs[0], torch.full((2, 3), 1.0))
    assert torch.equal(outputs[2], torch.full((2, 3), 21.0))


# -- heads_sdpa over gloo ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A call over the whole sequence: its bias from ``(Hq, L, S, parameters)``, the
    learnable parameters' shapes from ``(Hq, L, S)``, the lengths of a chunk of ``2W``."""

    name: str
    make: Callable[[int, int, int, list[Tensor]], AttnBias | None]
    params: Callable[[int, int, int], list[tuple[int, ...]]] = lambda h, L, S: []
    chunk_q: int = 4
    chunk_kv: int = 4


def _cases() -> list[Case]:
    return [
        Case("none", lambda H, L, S, p: None),
        Case("causal upper-left", lambda H, L, S, p: causal_upper_left()),
        # L = 2S: the first L - S rows of lower-right causal keep nothing
        Case("causal lower-right, L = 2S", lambda H, L, S, p: causal_lower_right(), chunk_kv=2),
        Case("window", lambda H, L, S, p: SlidingWindowBias(3, 1)),
        Case("alibi + causal", lambda H, L, S, p: AlibiBias(num_heads=H) + causal_upper_left()),
        # positive slopes, as ALiBi's are
        Case(
            "learnable alibi",
            lambda H, L, S, p: AlibiBias(slopes=p[0].abs()),
            lambda H, L, S: [(BATCH, H)],
        ),
        Case(
            "documents + causal",
            lambda H, L, S, p: DocumentBias(_docs(L, 3, 1)) + causal_lower_right(),
        ),
        Case("soft-cap + window", lambda H, L, S, p: SoftcapBias(1.5) + SlidingWindowBias(5)),
        Case(
            "tensor bias per head",
            lambda H, L, S, p: TensorBias(p[0]),
            lambda H, L, S: [(BATCH, H, L, S)],
        ),
        Case(
            "learnable score_mod + prefix-LM mask_mod",
            lambda H, L, S, p: RelativeTable(p[0]) + PrefixLM(2),
            lambda H, L, S: [(H, 2 * RELATIVE + 1)],
        ),
        Case("a mask_mod reading the head", lambda H, L, S, p: HeadWindow()),
        Case("a user's materialized bias", lambda H, L, S, p: Strided() + causal_upper_left()),
        Case("a user's materialized bias per head", lambda H, L, S, p: HeadStrided()),
        Case(
            "sum",
            lambda H, L, S, p: (
                causal_lower_right()
                + SlidingWindowBias(6)
                + DocumentBias(_docs(L, 2, 2))
                + AlibiBias(num_heads=H)
                + SoftcapBias(2.0)
                + RelativeTable(p[0])
            ),
            lambda H, L, S: [(H, 2 * RELATIVE + 1)],
        ),
    ]


def _gather(part: Tensor, layout: Layout) -> Tensor:
    """The whole tensor from every rank's part along the sequence (dim 2)."""
    parts = [torch.empty_like(part) for _ in range(layout.world)]
    dist.all_gather(parts, part.contiguous())
    return layout.assemble(parts, 2)


def _inputs(
    case: Case, world: int, heads_q: int, heads_kv: int, dtype: torch.dtype
) -> tuple[list[Tensor], Tensor, list[Tensor]]:
    """``([q, k, v], grad_out, parameters)`` of the whole call, the same on every rank."""
    torch.manual_seed(0)
    length_q, length_kv = case.chunk_q * 2 * world, case.chunk_kv * 2 * world
    q = torch.randn(BATCH, heads_q, length_q, HEAD_DIM, dtype=dtype)
    k = torch.randn(BATCH, heads_kv, length_kv, HEAD_DIM, dtype=dtype)
    v = torch.randn(BATCH, heads_kv, length_kv, HEAD_DIM, dtype=dtype)
    grad_out = torch.randn(BATCH, heads_q, length_q, HEAD_DIM, dtype=dtype)
    params = [
        (torch.randn(shape, dtype=dtype) / 2).requires_grad_()
        for shape in case.params(heads_q, length_q, length_kv)
    ]
    return [q, k, v], grad_out, params


def _whole(
    case: Case, inputs: list[Tensor], grad_out: Tensor, params: list[Tensor], fn: Any
) -> list[Tensor]:
    """``[out, dq, dk, dv, dparams...]`` of ``fn(q, k, v, bias)`` on the whole sequence."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    params = [p.detach().clone().requires_grad_() for p in params]
    heads, length_q, length_kv = inputs[0].shape[1], inputs[0].shape[2], inputs[1].shape[2]
    out = fn(*leaves, case.make(heads, length_q, length_kv, params))
    grads = torch.autograd.grad(out, leaves + params, grad_out.to(out.dtype))
    return [out.detach(), *(g.detach() for g in grads)]


def _head_parallel(
    case: Case,
    inputs: list[Tensor],
    grad_out: Tensor,
    params: list[Tensor],
    layout: Layout,
    rank: int,
) -> list[Tensor]:
    """The same from ``heads_sdpa`` on this rank's parts, gathered whole; the bias's tensors'
    gradients summed over the ranks (each rank's holds its own heads' entries)."""
    parts = [layout.take(t, rank, 2).detach().requires_grad_() for t in inputs]
    params = [p.detach().clone().requires_grad_() for p in params]
    heads, length_q, length_kv = inputs[0].shape[1], inputs[0].shape[2], inputs[1].shape[2]
    bias = case.make(heads, length_q, length_kv, params)
    gqa = inputs[0].shape[1] != inputs[1].shape[1]
    out = heads_sdpa(*parts, bias, scale=None, enable_gqa=gqa, group=None, layout=layout)
    assert out.shape == (*parts[0].shape[:3], inputs[2].shape[-1]), out.shape
    grads = torch.autograd.grad(out, parts + params, layout.take(grad_out, rank, 2))
    results = [_gather(t.detach(), layout) for t in (out, *grads[:3])]
    for grad in grads[3:]:
        grad = grad.detach().clone()
        dist.all_reduce(grad)
        results.append(grad)
    return results


def _names(count: int) -> tuple[str, ...]:
    return ("out", "dq", "dk", "dv", *(f"dparam{n}" for n in range(count - 4)))


def _check_float64(world: int, rank: int, heads_q: int, heads_kv: int, layout: Layout) -> None:
    def single(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias | None) -> Tensor:
        return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=heads_q != heads_kv)

    for case in _cases():
        where = f"{case.name}, W={world}, Hq={heads_q}, Hkv={heads_kv}, {layout.name}"
        inputs, grad_out, params = _inputs(case, world, heads_q, heads_kv, torch.float64)
        got = _head_parallel(case, inputs, grad_out, params, layout, rank)
        expected = _whole(case, inputs, grad_out, params, single)
        for name, result, wanted in zip(_names(len(got)), got, expected, strict=True):
            assert torch.isfinite(result).all(), f"{where}: {name} is not finite"
            error = (result - wanted).abs().max().item()
            assert error <= 1e-10 * max(1.0, wanted.abs().max().item()), (
                f"{where}: {name} differs by {error:.3g}"
            )


def _check_bfloat16(world: int, rank: int, heads_q: int, heads_kv: int) -> None:
    """The sum (ALiBi of the paper's slopes, soft-cap, a head-reading table) with shared
    key/value heads, in bfloat16, within the oracle's budget."""
    case = _cases()[-1]
    inputs, grad_out, params = _inputs(case, world, heads_q, heads_kv, torch.bfloat16)
    params = [p.detach().float().requires_grad_() for p in params]  # a float32 table
    layout = Layout.zigzag(world)
    got = _head_parallel(case, inputs, grad_out, params, layout, rank)
    assert all(t.dtype == torch.bfloat16 for t in got[:4])

    def oracle_in(dtype: torch.dtype) -> Any:
        def run(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias | None) -> Tensor:
            return attention(q, k, v, bias, enable_gqa=True, dtype=dtype)

        return run

    wide = [t.double() for t in inputs]
    exact = _whole(case, wide, grad_out.double(), params, oracle_in(torch.float64))
    low = _whole(case, inputs, grad_out, params, oracle_in(torch.bfloat16))
    assert_close_to_oracle(got, exact, low, torch.bfloat16, _names(len(got)))


# (Hq, Hkv) per W: no GQA, whole key/value heads per rank, key/value heads shared by ranks
HEADS = {
    2: [(4, 4), (4, 2), (4, 1)],
    3: [(6, 6), (6, 3), (6, 1)],
    4: [(4, 4), (4, 2), (8, 2), (8, 4)],
}


def _head_checks(rank: int, world: int) -> None:
    for index, (heads_q, heads_kv) in enumerate(HEADS[world]):
        assert heads_reasons(heads_q, heads_kv, world, None) == [], (heads_q, heads_kv)
        layouts = [Layout.zigzag(world), Layout.contiguous(world), _shuffled(world)]
        # every layout once; the further head counts on zigzag alone
        for layout in layouts if index == 0 else layouts[:1]:
            _check_float64(world, rank, heads_q, heads_kv, layout)
    _check_bfloat16(world, rank, *HEADS[world][-1])
    _check_double_backward(world, rank, *HEADS[world][-1])


def _check_double_backward(world: int, rank: int, heads_q: int, heads_kv: int) -> None:
    """Second-order gradients through the head mode (the exchanges' backward is itself
    differentiable) against single-process ``sdpa``, float64, on the exact eager route: the
    gradient of ``sum(dq * z)`` in q, k and v."""
    torch.manual_seed(1)
    length = 4 * world
    q, grad_out, z = (torch.randn(BATCH, heads_q, length, HEAD_DIM, dtype=torch.float64)
                      for _ in range(3))  # fmt: skip
    k, v = (torch.randn(BATCH, heads_kv, length, HEAD_DIM, dtype=torch.float64) for _ in range(2))
    bias, gqa = causal_upper_left(), heads_q != heads_kv
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    layout = Layout.zigzag(world)
    parts = [layout.take(t, rank, 2).detach().requires_grad_() for t in (q, k, v)]
    with attnbias.use_backends("reference"):  # the route whose double backward is exact
        out = attnbias.sdpa(*leaves, attn_mask=bias, enable_gqa=gqa)
        (dq,) = torch.autograd.grad(out, leaves[0], grad_out, create_graph=True)
        wanted = torch.autograd.grad((dq * z).sum(), leaves)
        out = heads_sdpa(*parts, bias, scale=None, enable_gqa=gqa, group=None, layout=layout)
        part_grad = layout.take(grad_out, rank, 2)
        (dq,) = torch.autograd.grad(out, parts[0], part_grad, create_graph=True)
        got = torch.autograd.grad((dq * layout.take(z, rank, 2)).sum(), parts)
    for name, part, whole in zip(("q", "k", "v"), got, wanted, strict=True):
        error = (_gather(part, layout) - whole).abs().max().item()
        assert error <= 1e-10 * max(1.0, whole.abs().max().item()), (
            f"W={world}, Hq={heads_q}, Hkv={heads_kv}: d(sum(dq z))/d{name} differs by {error:.3g}"
        )


def _shuffled(world: int) -> Layout:
    """Four chunks a rank, out of sequence order within each rank's part."""
    w = world
    return Layout(tuple((2 * w + r, r, 4 * w - 1 - r, 2 * w - 1 - r) for r in range(w)))


def _head_worker(rank: int, world: int, port: int) -> None:
    # the exact eager path runs each rank's call (the Triton interpreter would take minutes)
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        _head_checks(rank, world)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_attention_with_the_heads_split_over_the_ranks(world: int) -> None:
    """Every bias kind, sums, ModBias parts reading the head (a learnable table), a user's
    materializing biases, GQA with whole and with shared key/value heads, three layouts:
    output and every gradient against single-process sdpa in float64, and bfloat16 against
    the oracle."""
    spawn(_head_worker, world)

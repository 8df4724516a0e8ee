"""``attnbias.distributed``: a sequence split across the ranks of a process group.

Each test with ranks spawns ``W`` CPU processes joined by the gloo backend on 127.0.0.1, runs
every check of that ``W`` in them, and fails if they take longer than ``TIMEOUT_S``. The
expected values are built here from the layouts' definitions (rank ``r`` holds chunk ``r`` of
``W``, or chunks ``r`` and ``2W - 1 - r`` of ``2W``), not by the functions under test.

Attention over a sharded sequence (``distributed.sdpa``) is checked, for every bias kind, sums
and ``ModBias`` parts, against single-process ``attnbias.sdpa`` in float64 (output and every
gradient, the bias's tensors' included) and against the fp64 oracle (``attnbias.testing.oracle``) in
float32 and bfloat16 with the oracle's error budget.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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
    distributed,
    use_backends,
)
from attnbias.biases.band import BandBias
from attnbias.distributed import blocks, exchange
from attnbias.distributed.layouts import check_dim
from attnbias.testing.oracle import (
    assert_close_to_oracle,
    assert_shard_pair_close,
    attention,
    run_with_grads,
    shard_pair,
    whole_call,
)

TIMEOUT_S = 120


def expected_positions(length: int, world: int, rank: int, layout: str) -> list[int]:
    if layout == "contiguous":
        size = length // world
        return list(range(rank * size, (rank + 1) * size))
    size = length // (2 * world)
    first = list(range(rank * size, (rank + 1) * size))
    mirror = 2 * world - 1 - rank
    return first + list(range(mirror * size, (mirror + 1) * size))


NAMED = ("contiguous", "zigzag")


def _checks(rank: int, world: int) -> None:
    """Every check of one rank (run in each spawned process)."""
    for layout in NAMED:
        length = 4 * world
        want = expected_positions(length, world, rank, layout)
        assert distributed.positions(length, layout=layout).tolist() == want, layout
        # (B, H, S, E) of distinct values: a part is the whole's rows at the rank's positions
        whole = torch.arange(2 * 3 * length * 5, dtype=torch.float64).reshape(2, 3, length, 5)
        part = distributed.shard(whole, layout=layout)
        assert torch.equal(part, whole[:, :, want]), layout
        assert torch.equal(distributed.unshard(part, layout=layout), whole), layout
        # another dim, negative
        other = whole.transpose(1, 2).contiguous()  # (B, S, H, E)
        part = distributed.shard(other, layout=layout, dim=-3)
        assert torch.equal(part, other[:, want]), layout
        assert torch.equal(distributed.unshard(part, layout=layout, dim=1), other), layout

        # gradients: every rank's loss reads the whole tensor with its own weights
        weights = torch.arange(length, dtype=torch.float64) + 100 * rank
        leaf = whole.clone().requires_grad_()
        gathered = distributed.unshard(distributed.shard(leaf, layout=layout), layout=layout)
        (gathered * weights[:, None]).sum().backward()
        total = sum(torch.arange(length, dtype=torch.float64) + 100 * r for r in range(world))
        grad = torch.zeros_like(whole)
        grad[:, :, want] = total[want][:, None]  # a rank's shard sends back its positions only
        assert leaf.grad is not None
        assert torch.equal(leaf.grad, grad), layout

        # a length the layout cannot split
        bad = 2 * world + 1
        with pytest.raises(ValueError, match=f"length {bad}.*{layout!r}.*{world} ranks"):
            distributed.shard(torch.zeros(1, 1, bad, 1), layout=layout)


def _worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        _checks(rank, world)
    finally:
        dist.destroy_process_group()


# -- attention over a sharded sequence ---------------------------------------------------------

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = 2, 4, 2, 8
RELATIVE = 6  # the relative-position table's reach


@dataclass(frozen=True)
class PrefixLM(ModBias):
    prefix: int

    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)


@dataclass(frozen=True, eq=False)
class RelativeTable(ModBias):
    """A learnable per-head table of clipped relative positions (T5-like)."""

    table: Tensor  # (Hq, 2 * RELATIVE + 1)

    def score_mod(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + self.table[h, (kv_idx - q_idx).clamp(-RELATIVE, RELATIVE) + RELATIVE]


@dataclass(frozen=True)
class Case:
    """A call over the whole sequence: its bias from ``(L, S, parameters)``, the learnable
    parameters' shapes, the query and key lengths per rank (per chunk of 2W), flags."""

    name: str
    make: Callable[[int, int, list[Tensor]], AttnBias | None]
    params: tuple[tuple[int, ...], ...] = ()
    chunk_q: int = 4
    chunk_kv: int = 4
    is_causal: bool = False
    gqa: bool = True
    # key/value positions set to NaN, all masked for every row: they must reach nothing
    nan_keys: Callable[[int], list[int]] | None = None


@dataclass(frozen=True)
class Strided(AttnBias):
    """A user's bias that only materializes: every other key, and the query's own."""

    def materialize(
        self, device: Any = None, *, shape: Any = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        length_q, length_kv = shape[-2], shape[-1]
        i = torch.arange(length_q, device=device)[:, None]
        j = torch.arange(length_kv, device=device)[None, :]
        keep = (j % 2 == 0) | (i == j)
        zeros = torch.zeros(length_q, length_kv, dtype=dtype or torch.float32, device=device)
        return zeros.masked_fill(~keep, -math.inf)

    def needs_materialization(self) -> bool:
        return True


def _docs(length: int, count: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, count, (length,), generator=generator).sort().values


def _cases() -> list[Case]:
    return [
        Case("none", lambda L, S, p: None, gqa=False),
        Case("is_causal", lambda L, S, p: None, is_causal=True),
        Case("causal upper-left", lambda L, S, p: causal_upper_left()),
        # L = 2S: the first L - S rows of lower-right causal keep nothing anywhere
        Case("causal lower-right, L = 2S", lambda L, S, p: causal_lower_right(), chunk_kv=2),
        Case("window", lambda L, S, p: SlidingWindowBias(3, 1)),
        Case("alibi + causal", lambda L, S, p: AlibiBias(num_heads=HEADS_Q) + causal_upper_left()),
        # positive slopes, as ALiBi's are
        Case(
            "learnable alibi",
            lambda L, S, p: AlibiBias(slopes=p[0].abs()),
            ((BATCH, HEADS_Q),),
        ),
        Case(
            "documents",
            lambda L, S, p: DocumentBias(_docs(L, 3, 1)) + causal_lower_right(),
        ),
        # batch row 1 keeps no key: its rows give 0; keys outside the ranges are NaN
        Case(
            "key ranges",
            lambda L, S, p: KeyRangeBias([1, 3], [S - 2, 3]),
            nan_keys=lambda S: [0, S - 2, S - 1],
        ),
        Case("soft-cap", lambda L, S, p: SoftcapBias(1.5) + SlidingWindowBias(5)),
        Case(
            "tensor bias",
            lambda L, S, p: TensorBias(p[0]) + causal_upper_left(),
            ((BATCH, 1, None, None),),  # type: ignore[arg-type]
        ),
        Case(
            "sum",
            lambda L, S, p: (
                causal_lower_right()
                + SlidingWindowBias(6)
                + DocumentBias(_docs(L, 2, 2))
                + AlibiBias(num_heads=HEADS_Q)
                + SoftcapBias(2.0)
            ),
        ),
        Case("mask_mod", lambda L, S, p: PrefixLM(3)),
        Case("a user's materialized bias", lambda L, S, p: Strided() + causal_upper_left()),
        Case(
            "learnable score_mod + mask_mod + window",
            lambda L, S, p: RelativeTable(p[0]) + PrefixLM(2) + SlidingWindowBias(7),
            ((HEADS_Q, 2 * RELATIVE + 1),),
        ),
    ]


def _parameters(case: Case, length_q: int, length_kv: int, dtype: torch.dtype) -> list[Tensor]:
    shapes = [
        tuple(length_q if n is None and i == 2 else length_kv if n is None else n
              for i, n in enumerate(shape))
        for shape in case.params
    ]  # fmt: skip
    return [(torch.randn(shape, dtype=dtype) / 2).requires_grad_() for shape in shapes]


def _inputs(
    case: Case, world: int, dtype: torch.dtype
) -> tuple[list[Tensor], Tensor, list[Tensor]]:
    """``([q, k, v], grad_out, parameters)`` of the whole call, the same on every rank."""
    torch.manual_seed(0)
    length_q, length_kv = case.chunk_q * 2 * world, case.chunk_kv * 2 * world
    heads_kv = HEADS_KV if case.gqa else HEADS_Q
    q = torch.randn(BATCH, HEADS_Q, length_q, HEAD_DIM, dtype=dtype)
    k = torch.randn(BATCH, heads_kv, length_kv, HEAD_DIM, dtype=dtype)
    v = torch.randn(BATCH, heads_kv, length_kv, HEAD_DIM, dtype=dtype)
    if case.nan_keys is not None:
        for j in case.nan_keys(length_kv):
            k[0, :, j] = math.nan
            v[0, :, j] = math.nan
        k[1, :, 0] = math.nan  # batch row 1 keeps no key at all
    grad_out = torch.randn(BATCH, HEADS_Q, length_q, HEAD_DIM, dtype=dtype)
    return [q, k, v], grad_out, _parameters(case, length_q, length_kv, dtype)


def _whole(
    case: Case, inputs: list[Tensor], grad_out: Tensor, params: list[Tensor], fn: Any
) -> list[Tensor]:
    """``[out, dq, dk, dv, dparams...]`` of a call on the whole sequence."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    params = [p.detach().clone().requires_grad_() for p in params]
    length_q, length_kv = inputs[0].shape[2], inputs[1].shape[2]
    bias = case.make(length_q, length_kv, params)
    out = fn(*leaves, bias)
    grads = torch.autograd.grad(out, leaves + params, grad_out.to(out.dtype))
    return [out.detach(), *(g.detach() for g in grads)]


def _sharded(
    case: Case, inputs: list[Tensor], grad_out: Tensor, params: list[Tensor], layout: str
) -> list[Tensor]:
    """The same from ``distributed.sdpa`` on this rank's parts, gathered whole; the bias's
    parameters' gradients summed over the ranks (each rank's holds its own queries' part)."""
    parts = [distributed.shard(t, layout=layout).requires_grad_() for t in inputs]
    params = [p.detach().clone().requires_grad_() for p in params]
    length_q, length_kv = inputs[0].shape[2], inputs[1].shape[2]
    bias = case.make(length_q, length_kv, params)
    out = distributed.sdpa(
        *parts, attn_mask=bias, is_causal=case.is_causal, enable_gqa=case.gqa, layout=layout,
        mode="sequence",
    )  # fmt: skip
    grads = torch.autograd.grad(out, parts + params, distributed.shard(grad_out, layout=layout))
    results = [distributed.unshard(t.detach(), layout=layout) for t in (out, *grads[:3])]
    for grad in grads[3:]:
        grad = grad.detach().clone()
        dist.all_reduce(grad)
        results.append(grad)
    return results


def _names(case: Case) -> tuple[str, ...]:
    return ("out", "dq", "dk", "dv", *(f"dparam{n}" for n in range(len(case.params))))


def _check_case(case: Case, world: int, layout: str) -> None:
    where = f"{case.name}, W={world}, {layout}"

    def single(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias | None) -> Tensor:
        return attnbias.sdpa(q, k, v, attn_mask=bias, is_causal=case.is_causal,
                             enable_gqa=case.gqa)  # fmt: skip

    def oracle_in(dtype: torch.dtype) -> Any:
        def run(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias | None) -> Tensor:
            return attention(q, k, v, bias, is_causal=case.is_causal, enable_gqa=case.gqa,
                             dtype=dtype)  # fmt: skip

        return run

    # float64: the sharded call computes what the single-process call does
    inputs, grad_out, params = _inputs(case, world, torch.float64)
    got = _sharded(case, inputs, grad_out, params, layout)
    expected = _whole(case, inputs, grad_out, params, single)
    for name, result, wanted in zip(_names(case), got, expected, strict=True):
        assert torch.isfinite(result).all(), f"{where}: {name} is not finite"
        # ALiBi slopes become float32 on every route: their gradient is rounded to float32
        # there, once per rank here
        tolerance = 1e-6 * max(1.0, wanted.abs().max().item()) if "param" in name else 1e-11
        error = (result - wanted).abs().max().item()
        assert error <= tolerance, f"{where}: {name} differs by {error:.3g}"
    # float32: within the oracle's budget (twice stock float32's error, plus a floor)
    inputs, grad_out, params = _inputs(case, world, torch.float32)
    got = _sharded(case, inputs, grad_out, params, layout)
    wide = [t.double() for t in inputs]
    exact = _whole(
        case, wide, grad_out.double(), [p.double() for p in params], oracle_in(torch.float64)
    )
    low = _whole(case, inputs, grad_out, params, oracle_in(torch.float32))
    if case.nan_keys is not None:  # the oracle lets masked NaN keys reach every row
        exact = _whole(case, wide, grad_out.double(), [], single)
        low = _whole(case, inputs, grad_out, params, single)
    assert_close_to_oracle(got, exact, low, torch.float32, _names(case))


def _empty_rows(rank: int, world: int) -> None:
    """Rows that keep no key anywhere: output 0, gradients 0, all finite."""
    for layout in NAMED:
        case = _cases()[8]  # key ranges: batch row 1 keeps nothing
        inputs, grad_out, params = _inputs(case, world, torch.float32)
        got = _sharded(case, inputs, grad_out, params, layout)
        out, dq = got[0], got[1]
        assert torch.equal(out[1], torch.zeros_like(out[1])), layout
        assert torch.equal(dq[1], torch.zeros_like(dq[1])), layout
        assert all(torch.isfinite(g).all() for g in got), layout


def _half_precision(rank: int, world: int) -> None:
    """bfloat16 and GQA within the oracle's budget."""
    case = _cases()[11]  # the sum
    inputs, grad_out, params = _inputs(case, world, torch.bfloat16)
    for layout in NAMED:
        got = _sharded(case, inputs, grad_out, params, layout)
        exact = _whole(case, [t.double() for t in inputs], grad_out.double(), params,
                       lambda q, k, v, b: attention(q, k, v, b, enable_gqa=True))  # fmt: skip
        low = _whole(case, inputs, grad_out, params,
                     lambda q, k, v, b: attention(q, k, v, b, enable_gqa=True,
                                                  dtype=torch.bfloat16))  # fmt: skip
        assert all(t.dtype == torch.bfloat16 for t in got)
        assert_close_to_oracle(got, exact, low, torch.bfloat16, _names(case))


def _refusals(rank: int, world: int) -> None:
    """Errors every rank raises alike, after which the group still works."""
    part = torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match=f"length {3 * world}.*'zigzag'.*{world} ranks"):
        distributed.sdpa(part, part, part)
    mine = torch.zeros(1, 1, 4 if rank == 0 else 6, 4)
    with pytest.raises(ValueError, match="do not match \\(rank 0: query \\(1, 1, 4, 4\\)"):
        distributed.sdpa(mine, mine, mine, layout="contiguous")
    with pytest.raises(ValueError, match="dropout_p=0.5 is not supported"):
        distributed.sdpa(part, part, part, dropout_p=0.5, layout="contiguous")
    leaf = part.clone().requires_grad_()
    out = distributed.sdpa(leaf, part, part, attn_mask=causal_upper_left(), layout="contiguous")
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), leaf, create_graph=True)
    with pytest.raises(TypeError, match="TensorBias"):
        distributed.sdpa(part, part, part, attn_mask=torch.zeros(3, 3), layout="contiguous")
    # one rank's bias does not fit: that rank says why, the others that it refused
    bias = DocumentBias(torch.zeros(3 * world if rank else 5, dtype=torch.long))
    with pytest.raises(ValueError, match="DocumentBias q_doc_ids has length 5|rank\\(s\\) \\[0\\]"):
        distributed.sdpa(part, part, part, attn_mask=bias, layout="contiguous")
    part = torch.ones(1, 1, 2, 4)
    out = distributed.sdpa(part, part, part, layout="contiguous")
    assert torch.allclose(out, part)


def _transfers(rank: int, world: int) -> None:
    """Each rank receives only the key/value runs that hold kept pairs for its queries,
    straight from their owner, and returns their gradients straight to it. Under contiguous
    causal, rank ``r`` receives the parts of ranks ``r - 1, ..., 0`` (one a step), in the
    backward again, and its own part's gradients come home from ranks ``r + 1 .. W - 1``. A
    window of 3 keys back (blocks of 2 positions: 4 positions) reaches only the rank before;
    one document per rank moves nothing."""
    received: list[tuple[int, int, int]] = []  # (peer, positions, tag) of each receive
    original = exchange._receives

    def counting(tensors: Any, peer: int, group: Any, tag: int) -> Any:
        # positions: dim -2 of a part (B, H, n, E) and of keys and values joined (2, ...)
        received.extend((peer, t.shape[-2], tag + i) for i, t in enumerate(tensors))
        return original(tensors, peer, group, tag)

    def peers(tag: int) -> list[int]:
        return [peer for peer, _, t in received if t == tag]

    exchange._receives = counting  # type: ignore[assignment]
    try:
        q = torch.randn(1, 2, 8, 8, requires_grad=True)
        out = distributed.sdpa(
            q, q, q, attn_mask=causal_upper_left(), layout="contiguous", mode="sequence"
        )
        assert peers(0) == list(range(rank - 1, -1, -1)), received
        assert all(n == 8 for _, n, _ in received), received
        received.clear()
        out.sum().backward()
        assert peers(0) == list(range(rank - 1, -1, -1)), received
        assert peers(2) == list(range(rank + 1, world)), received
        received.clear()
        window = causal_upper_left() + SlidingWindowBias(3)
        distributed.sdpa(
            q, q, q, attn_mask=window, layout="contiguous", mode="sequence"
        ).sum().backward()
        want = [(rank - 1, 4)] * 2 if rank > 0 else []  # forward, then backward: keys
        assert [(p, n) for p, n, t in received if t == 0] == want, received
        home = [(rank + 1, 4)] if rank < world - 1 else []  # the gradients of its last 4
        assert [(p, n) for p, n, t in received if t == 2] == home, received
        received.clear()
        docs = DocumentBias(torch.arange(world).repeat_interleave(8))
        distributed.sdpa(
            q, q, q, attn_mask=docs, layout="contiguous", mode="sequence"
        ).sum().backward()
        assert received == [], received
    finally:
        exchange._receives = original  # type: ignore[assignment]


def _compiled(rank: int, world: int) -> None:
    """A compiled block runs the call eagerly with a graph break around it."""
    bias = causal_lower_right() + SlidingWindowBias(3)
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)

    def block(q: Tensor) -> Tensor:
        return distributed.sdpa(q * 2, q, q, attn_mask=bias).relu() + 1

    def whole_graph(q: Tensor) -> Tensor:
        return distributed.sdpa(q, q, q, attn_mask=bias)

    compiled = torch.compile(block, backend="eager")
    torch.testing.assert_close(compiled(q), block(q))
    with pytest.raises(Exception, match="does not trace"):
        torch.compile(whole_graph, backend="eager", fullgraph=True)(q)


def _auto_layouts(rank: int, world: int) -> None:
    """``layout="auto"`` and a balanced :class:`Layout`: every case whose bias does not read
    its parameters (the layout is worked out from the bias before the call), checked like the
    named layouts; the strings and the object agree."""
    for case in _cases():
        if case.params:
            continue
        length_q, length_kv = case.chunk_q * 2 * world, case.chunk_kv * 2 * world
        bias = case.make(length_q, length_kv, [])
        layout = distributed.layout_for(bias, length_q, length_kv)
        assert layout.world == world
        if length_q == length_kv and bias is not None:
            q = torch.arange(length_q)[None, None, :, None]
            assert torch.equal(
                distributed.shard(q, layout="auto", bias=bias), distributed.shard(q, layout=layout)
            )
        _check_case(case, world, layout)
    # a balanced assignment of 4 chunks a rank, given by hand
    custom = distributed.Layout(
        tuple(tuple(sorted((r, 2 * world + r, 4 * world - 1 - r, 2 * world - 1 - r)))
              for r in range(world))
    )  # fmt: skip
    _check_case(_cases()[7], world, custom)  # documents
    # head-tail within documents whose lengths 2W divides (L = 8W: documents of 2W and 6W)
    lengths = [2 * world, 6 * world]
    documents = Case(
        "documents, head-tail",
        lambda L, S, p: DocumentBias.from_seqlens(lengths) + causal_upper_left(),
    )
    layout = distributed.Layout.documents(lengths, world)
    _check_case(documents, world, layout)


def _explain_and_modes(rank: int, world: int) -> None:
    """explain names the mode, both predictions and what each rank receives; the head mode is
    refused by name where the heads do not split; a DeviceMesh dimension is a group."""
    part = torch.randn(1, 4, 8, 8)
    text = distributed.explain(part, part, part, attn_mask=causal_upper_left(),
                               layout="contiguous", mode="sequence")  # fmt: skip
    assert f"rank {rank} of {world}" in text, text
    assert "mode 'sequence' (asked for)" in text and "heads" in text, text
    assert f"rank {world - 1} receives {8 * (world - 1)} key/value positions" in text, text
    text = distributed.explain(part, part, part, attn_mask=causal_upper_left())
    assert "least predicted time" in text, text
    odd = torch.randn(1, 3, 8, 8)
    if 3 % world:
        with pytest.raises(ValueError, match="mode='heads' cannot run this call: .*Hq=3"):
            distributed.sdpa(odd, odd, odd, mode="heads")
        assert "mode 'sequence'" in distributed.explain(odd, odd, odd)
    with pytest.raises(ValueError, match="mode='ring'"):
        distributed.sdpa(part, part, part, mode="ring")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    by_mesh = distributed.sdpa(q, q, q, attn_mask=causal_upper_left(), group=mesh["cp"])
    assert torch.equal(by_mesh, distributed.sdpa(q, q, q, attn_mask=causal_upper_left()))


def _attention_checks(rank: int, world: int) -> None:
    for layout in NAMED:
        for case in _cases():
            _check_case(case, world, layout)
    _auto_layouts(rank, world)
    _explain_and_modes(rank, world)
    _empty_rows(rank, world)
    _half_precision(rank, world)
    _refusals(rank, world)
    _transfers(rank, world)
    if world == 2:
        _compiled(rank, world)


def _attention_worker(rank: int, world: int, port: int) -> None:
    # the exact eager path runs every shard pair (the Triton interpreter would take minutes)
    os.environ.pop("TRITON_INTERPRET", None)
    # blocks of 2 positions: the exchanged runs and the pairs are cut inside the chunks
    blocks.GRAIN = 2
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        _attention_checks(rank, world)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Any, world: int) -> None:
    """Run ``fn(rank, world, port)`` in ``world`` processes; fail on an error or a timeout."""
    context = mp.start_processes(
        fn, args=(world, _free_port()), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks took longer than {TIMEOUT_S} s")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_and_unshard_over_gloo(world: int) -> None:
    spawn(_worker, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_attention_over_a_sharded_sequence(world: int) -> None:
    """Every bias kind, sums, ModBias (a learnable table), GQA, both layouts: output and
    every gradient against single-process sdpa and the oracle; empty rows, masked NaN keys,
    bfloat16, refusals, skipped transfers, torch.compile."""
    spawn(_attention_worker, world)


def test_without_a_process_group_the_error_says_how_to_start_one() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.shard(torch.zeros(1, 1, 4, 1))


def test_an_unknown_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="layout='ring'.*'contiguous', 'zigzag', 'auto'"):
        distributed.Layout.named("ring", 2)


def test_a_dim_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="dim=4 is out of range"):
        check_dim(torch.zeros(1, 1, 4, 1), 4)


@dataclass(frozen=True, eq=False)
class _Relative(ModBias):
    table: Tensor  # (Hq, 9)

    def score_mod(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + self.table[h, (kv_idx - q_idx).clamp(-4, 4) + 4]


@pytest.mark.parametrize("kind", ["alibi", "mod"])
def test_the_triton_kernel_gives_a_shard_pair_what_the_exact_path_does(kind: str) -> None:
    """A shard pair's log-sum-exp and its share of a merged output's gradients (the bias's
    learnable tensors' included) from the Triton kernel (under Triton's interpreter on a CPU)
    within the oracle's budget (``oracle.shard_pair``: stock PyTorch in float64, and its error
    in bfloat16, the kernels' usual dtype)."""
    from attnbias.backends.registry import BACKENDS
    from attnbias.spec import make_spec

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    q = torch.randn(1, 2, 16, 16, device=device)
    k, v = (torch.randn(1, 1, 24, 16, device=device) for _ in range(2))
    grad_out = torch.randn_like(q)
    param = (torch.rand(2, device=device) / 2) if kind == "alibi" else torch.randn(2, 9)
    param = param.to(device)

    def bias_of(tensor: Tensor) -> AttnBias:
        if kind == "alibi":
            return causal_lower_right() + AlibiBias(slopes=tensor)
        return _Relative(tensor) + SlidingWindowBias(5)

    def leaf(dtype: torch.dtype) -> Tensor:
        return param.to(dtype).requires_grad_()

    # bfloat16 inputs, as the kernel's; its float32 table or slopes stay float32
    tensor = leaf(torch.float32)
    inputs = [t.to(torch.bfloat16) for t in (q, k, v)]
    with torch.enable_grad():
        spec = make_spec(*inputs, bias_of(tensor), False, None, 0.0, True, needs_lse=True)
    backend = BACKENDS["triton"]
    assert backend.not_supported_reasons(spec) == []
    out, lse = backend.forward_lse(spec)
    dq, dk, dv, (dparam,) = backend.backward_lse(
        spec, grad_out.to(torch.bfloat16), out.to(torch.bfloat16), lse, [tensor]
    )
    assert dparam is not None
    exact_tensor, low_tensor = leaf(torch.float64), leaf(torch.float32)
    exact = shard_pair(q, k, v, bias_of(exact_tensor), slice(None), grad_out, wrt=[exact_tensor])
    low = shard_pair(
        q, k, v, bias_of(low_tensor), slice(None), grad_out, wrt=[low_tensor],
        dtype=torch.bfloat16,
    )  # fmt: skip
    names = ("out", "lse", "dq", "dk", "dv", "dparam")
    assert_close_to_oracle([out, lse, dq, dk, dv, dparam], exact, low, torch.bfloat16, names)


# A shifted ALiBi (a block's view of a call's) with the band that decides where it runs:
# (bias, L, S, whether the Triton kernel takes it)
SHIFTED_ALIBI = {
    # causal: every kept pair on one side of the shifted diagonal, for any shift >= 0
    "causal_shift_29": (
        lambda: AlibiBias(num_heads=2, shift=29) + causal_lower_right(), 20, 36, True
    ),
    "causal_upper_left": (
        lambda: AlibiBias(num_heads=2, shift=20) + causal_upper_left(), 36, 20, True
    ),
    # j - i >= 20 and diagonal S - L + shift = 20 - 7: the other side
    "anti_causal": (
        lambda: AlibiBias(slopes=torch.tensor([0.5, 0.25]), shift=-7) + BandBias(20, None),
        24, 48, True,
    ),
    # a band across the shifted diagonal: materialized
    "window_across": (
        lambda: AlibiBias(num_heads=2, shift=-4) + SlidingWindowBias(6, 6), 24, 24, False
    ),
    # two shifts in one sum: no one kernel term, both materialized
    "two_shifts": (
        lambda: AlibiBias(num_heads=2, shift=2) + AlibiBias(num_heads=2, shift=5)
        + causal_lower_right(),
        24, 24, False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(SHIFTED_ALIBI))
def test_a_shifted_alibi_runs_on_the_triton_kernel_where_its_distances_have_one_sign(
    name: str,
) -> None:
    make_bias, length_q, length_kv, fused = SHIFTED_ALIBI[name]
    bias = make_bias()
    generator = torch.Generator().manual_seed(5)
    q, grad_out = (torch.randn(2, 2, length_q, 16, generator=generator) for _ in "qg")
    k, v = (torch.randn(2, 1, length_kv, 16, generator=generator) for _ in "kv")
    q, k, v, grad_out = (t.to(torch.bfloat16) for t in (q, k, v, grad_out))
    pinned = use_backends("triton") if fused else use_backends(exclude=["triton"])
    with pinned:
        route = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True)
        results = run_with_grads(
            lambda *t: attnbias.sdpa(*t, attn_mask=bias, enable_gqa=True), (q, k, v), grad_out
        )
    if not fused:
        reasons = (
            "ALiBi shifted by -4: the band does not keep"
            if name == "window_across"
            else ("AlibiBias, AlibiBias has no kernel form")
        )
        assert reasons in route, route
    expected = run_with_grads(
        lambda *t: attention(*t, bias, enable_gqa=True),
        (q.double(), k.double(), v.double()),
        grad_out.double(),
    )
    low = run_with_grads(
        lambda *t: attention(*t, bias, enable_gqa=True, dtype=torch.bfloat16), (q, k, v), grad_out
    )
    assert_close_to_oracle(results, expected, low, torch.bfloat16, ("out", "dq", "dk", "dv"))


def test_a_shifted_alibi_runs_on_the_decode_kernel() -> None:
    bias = AlibiBias(num_heads=4, shift=50) + causal_lower_right()
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 3, 16, generator=generator).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 70, 16, generator=generator).to(torch.bfloat16) for _ in "kv")
    with use_backends("triton-decode"):
        out = attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    expected = attention(q.double(), k.double(), v.double(), bias, enable_gqa=True)
    low = attention(q, k, v, bias, enable_gqa=True, dtype=torch.bfloat16)
    assert_close_to_oracle([out], [expected], [low], torch.bfloat16, ("out",))


def test_the_triton_kernel_gives_a_shifted_alibi_pair_its_log_sum_exp() -> None:
    """An ALiBi pair off the call's own alignment (context parallelism's blocks): its
    log-sum-exp and its share of the merged output's gradients from the Triton kernel."""
    from attnbias.backends.registry import BACKENDS
    from attnbias.spec import make_spec
    from attnbias.terms import Block, Call

    torch.manual_seed(1)
    length_q, length_kv = 16, 40
    q, grad_out = (torch.randn(1, 2, length_q, 16) for _ in "qg")
    k, v = (torch.randn(1, 2, length_kv, 16) for _ in "kv")
    bias = AlibiBias(num_heads=2) + causal_lower_right()
    merged_out, merged_lse = whole_call(q, k, v, bias)
    pair = bias.sub_block(Call(1, 2, length_q, length_kv), Block(0, 8, length_q, 16))
    assert "shift=" in repr(pair), repr(pair)
    inputs = [t.to(torch.bfloat16) for t in (q, k[:, :, 8:24], v[:, :, 8:24])]
    spec = make_spec(*inputs, pair, False, None, 0.0, False, needs_lse=True)
    assert BACKENDS["triton"].not_supported_reasons(spec) == []
    out, lse = BACKENDS["triton"].forward_lse(spec)
    dq, dk, dv, _ = BACKENDS["triton"].backward_lse(
        spec, grad_out.to(torch.bfloat16), merged_out.to(torch.bfloat16), merged_lse, []
    )
    assert_shard_pair_close(
        [out, lse, dq, dk, dv], q, k, v, bias, slice(8, 24), grad_out, torch.bfloat16
    )


def test_a_block_of_every_bias_is_its_materialized_form_sliced() -> None:
    """``AttnBias.sub_block`` of each kind, a sum and a user's materializing bias: exactly the
    whole call's materialized form at the block's rows and columns."""
    from attnbias.terms import Block, Call

    batch, heads, length_q, length_kv = 2, 2, 12, 16
    docs_q = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    docs_kv = torch.tensor([0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3])
    biases = [
        causal_upper_left(),
        causal_lower_right(),
        SlidingWindowBias(3, 1),
        SlidingWindowBias(None, 2),
        AlibiBias(num_heads=heads),
        AlibiBias(slopes=torch.rand(batch, heads)),
        DocumentBias(docs_q, docs_kv),
        KeyRangeBias([1, 3], [9, 14]),
        TensorBias(torch.randn(batch, 1, length_q, length_kv)),
        TensorBias(torch.randn(length_kv)),
        PrefixLM(5),
        RelativeTable(torch.randn(heads, 2 * RELATIVE + 1)),
        Strided(),
        causal_lower_right() + DocumentBias(docs_q, docs_kv) + AlibiBias(num_heads=heads),
    ]
    call = Call(batch, heads, length_q, length_kv)
    for bias in biases:
        whole = bias.materialize(shape=(batch, heads, length_q, length_kv))
        whole = whole.expand(batch, heads, length_q, length_kv)
        for q_start, kv_start, rows, cols in [(0, 0, 4, 4), (4, 8, 4, 8), (8, 0, 4, 4),
                                               (3, 5, 6, 7), (0, 0, 12, 16)]:  # fmt: skip
            block = Block(q_start, kv_start, rows, cols)
            part = bias.sub_block(call, block).materialize(shape=(batch, heads, rows, cols))
            expected = whole[..., q_start : q_start + rows, kv_start : kv_start + cols]
            assert torch.equal(part.expand(batch, heads, rows, cols), expected), (bias, block)


# -- the keep grid, layouts and the choice of layout (no processes) ----------------------------


def _true_grid(bias: AttnBias, batch: int, heads: int, length_q: int, length_kv: int,
               grain_q: int, grain_kv: int) -> Tensor:  # fmt: skip
    """Which blocks keep a pair, from the materialized mask (the oracle's form)."""
    shape = (batch, heads, length_q, length_kv)
    keep = bias.masked(None, shape, torch.float64).keep
    if keep is None:
        keep = torch.ones((), dtype=torch.bool)
    keep = keep.expand(shape).any(1).any(0)
    return keep.reshape(length_q // grain_q, grain_q, length_kv // grain_kv, grain_kv).any(3).any(1)


def _grid_cases() -> list[tuple[str, AttnBias, bool]]:
    """(name, bias over a (2, 3, 24, 24) call, whether the grid is exact at its blocks)."""
    docs = torch.tensor([0] * 5 + [1] * 9 + [2] * 3 + [3] * 7)
    return [
        ("causal", causal_upper_left(), True),
        ("lower-right window", causal_lower_right() + SlidingWindowBias(5), True),
        ("window both sides", SlidingWindowBias(3, 6), True),
        ("key ranges", KeyRangeBias([3, 10], [9, 13]), True),
        ("documents + causal", DocumentBias(docs) + causal_upper_left(), False),
        ("prefix-LM", PrefixLM(5), True),
        ("strided + causal", Strided() + causal_upper_left(), True),
        ("table (score only)", RelativeTable(torch.zeros(3, 2 * RELATIVE + 1)), True),
    ]


@pytest.mark.parametrize("grains", [(1, 1), (2, 4), (4, 3), (8, 8)])
def test_the_keep_grid_never_leaves_out_a_kept_block(grains: tuple[int, int]) -> None:
    """Every block that keeps a pair of the materialized mask is in the grid; where the bias's
    terms are bands, key ranges or evaluated masks, exactly those blocks are."""
    grain_q, grain_kv = grains
    call = attnbias.terms.Call(2, 3, 24, 24, torch.device("cpu"))
    for name, bias, exact in _grid_cases():
        grid = blocks.keep_grid(bias, call, grain_q, grain_kv)
        truth = _true_grid(bias, 2, 3, 24, 24, grain_q, grain_kv)
        assert grid.shape == truth.shape, name
        assert bool((grid | ~truth).all()), f"{name}: a kept block is left out"
        if exact:
            assert torch.equal(grid, truth), f"{name}: {grid.int()} != {truth.int()}"
        else:
            assert not bool(grid.all()), f"{name}: the grid keeps every block"


def test_a_layout_splits_and_assembles_any_assignment_of_chunks() -> None:
    layout = distributed.Layout(((4, 1), (0, 5), (3, 2)))
    assert layout.world == 3 and layout.pieces == 6
    assert layout.ranges(0, 12) == [(8, 10), (2, 4)]
    assert layout.positions(1, 12).tolist() == [0, 1, 10, 11]
    whole = torch.arange(2 * 12).reshape(2, 12)
    parts = [layout.take(whole, r, 1) for r in range(3)]
    assert torch.equal(parts[2], whole[:, [6, 7, 4, 5]])
    assert torch.equal(layout.assemble(parts, 1), whole)
    with pytest.raises(ValueError, match="each chunk id 0 .. P - 1 must appear exactly once"):
        distributed.Layout(((0, 1), (1, 2)))
    with pytest.raises(ValueError, match="same number of chunks"):
        distributed.Layout(((0, 1), (2,)))
    with pytest.raises(ValueError, match="length 10 .* 'custom' layout over 3 ranks.*pad it to 12"):
        layout.ranges(0, 10)


def test_a_document_layout_cuts_every_document_head_and_tail() -> None:
    """Head-tail within documents: rank r holds pieces r and 2W - 1 - r of every document
    (so each rank's part of each document keeps the same pairs under a causal mask); it
    splits the documents' total length only, and refuses lengths 2W does not divide."""
    layout = distributed.Layout.documents([8, 4, 12], world=2)
    assert layout.name == "head-tail" and layout.length == 24
    # pieces of 2, 1 and 3 positions: chunks of 1
    assert layout.spans(0, 24) == [(0, 2), (6, 9), (11, 15), (21, 24)]
    assert layout.spans(1, 24) == [(2, 6), (9, 11), (15, 21)]
    assert layout.positions(1, 24).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]
    whole = torch.arange(24)[None]
    parts = [layout.take(whole, r, 1) for r in range(2)]
    assert torch.equal(layout.assemble(parts, 1), whole)
    grid = torch.ones(24, 24, dtype=torch.bool).tril()
    ids = torch.tensor([0] * 8 + [1] * 4 + [2] * 12)
    grid &= ids[:, None] == ids[None, :]
    work = blocks.layout_costs(grid, layout, 1.0, 0.0).compute
    assert work[0] == work[1], work  # causal within documents: the same pairs
    with pytest.raises(ValueError, match=r"lengths \[6\] cannot be cut into 2W = 4 .*of 4"):
        distributed.Layout.documents([8, 6], world=2)
    with pytest.raises(ValueError, match="splits a sequence of 24 .*not 48"):
        layout.ranges(0, 48)


def test_the_document_layout_of_a_bias_and_what_auto_predicts_for_it() -> None:
    """``document_layout`` finds a bias's documents (lengths 2W divides) and evens out their
    causal work exactly; ``"auto"`` weighs it with the others by the sequence mode's predicted
    step, where its many pairs (two stretches a document on every rank) cost more than the
    balance gains, as measured on two H100s; ragged lengths have no head-tail layout."""
    from attnbias.distributed import model

    length = 65536
    lengths = [32768, 4096, 4096, 16384, 8192]
    docs = DocumentBias.from_seqlens(lengths) + causal_upper_left()
    call = attnbias.terms.Call(None, 1, length, length, torch.device("cpu"))
    layout = blocks.document_layout(docs, call, 2)
    assert layout == distributed.Layout.documents(lengths, 2)
    assert layout in blocks.candidate_layouts(docs, call, 2)
    grid = blocks.keep_grid(docs, call, 256, 256)
    work = blocks.layout_costs(grid, layout, 1.0, 0.0).compute
    assert work[0] == work[1], work

    def predicted(layout: distributed.Layout) -> float:
        step = attnbias.terms.Call(1, 16, length, length, torch.device("cpu"))
        grains = blocks.grain(length, layout.pieces)
        grid = blocks.keep_grid(docs, step, grains, grains)
        needs = exchange.exchanged_runs(grid, step, layout)
        shape = model.StepShape(16, 128, 128, 2, needs_grad=True)
        return model.sequence_seconds(docs, step, layout, grid, needs, shape)

    chosen = distributed.layout_for(docs, length, world=2)
    times = {c.name: predicted(c) for c in blocks.candidate_layouts(docs, call, 2)}
    assert predicted(chosen) <= 1.05 * min(times.values()), (chosen, times)
    assert times["head-tail"] > times["zigzag"], times
    ragged = DocumentBias.from_seqlens([30000, 3002, 32534]) + causal_upper_left()
    assert blocks.document_layout(ragged, call, 2) is None
    assert blocks.document_layout(causal_upper_left(), call, 2) is None


def test_the_auto_layout_follows_the_bias() -> None:
    """Causal: zigzag (balanced, every rank receives alike); a window shorter than a part:
    contiguous (balanced, and only the window's reach moves); no mask: contiguous (fewest
    chunks); documents of very different lengths: a balanced assignment whose slowest rank
    has less work than zigzag's or contiguous's. (Long enough that computation, not
    transfers, decides.)"""
    length = 65536
    assert distributed.layout_for(causal_upper_left(), length, world=4).chunks == (
        distributed.Layout.zigzag(4).chunks
    )
    window = causal_upper_left() + SlidingWindowBias(1023)
    assert distributed.layout_for(window, length, world=4).chunks == (
        distributed.Layout.contiguous(4).chunks
    )
    assert distributed.layout_for(None, length, world=2).chunks == ((0,), (1,))
    docs = DocumentBias.from_seqlens([32768, 4096, 4096, 16384, 8192]) + causal_upper_left()
    chosen = distributed.layout_for(docs, length, world=2)
    call = attnbias.terms.Call(None, 1, length, length, torch.device("cpu"))
    grid = blocks.keep_grid(docs, call, 256, 256)
    work = {
        layout.name: max(blocks.layout_costs(grid, layout, 1.0, 0.0).compute)
        for layout in (chosen, distributed.Layout.zigzag(2), distributed.Layout.contiguous(2))
    }
    assert work[chosen.name] < min(work["zigzag"], work["contiguous"]), work
    assert chosen.name.startswith("auto: balanced"), chosen


def test_the_balanced_assignment_evens_out_the_work() -> None:
    grid = torch.ones(16, 16, dtype=torch.bool).tril()  # causal, 16 chunks of one block
    layout = blocks.balanced_layout(grid, 4, 4)
    work = [sum(c + 1 for c in chunks) for chunks in layout.chunks]
    assert sorted(c for chunks in layout.chunks for c in chunks) == list(range(16))
    assert max(work) - min(work) <= 1, (layout, work)


def test_a_pair_keeps_only_the_rows_and_keys_that_keep_a_pair() -> None:
    """A window of 4096 over two contiguous parts of 65536: rank 1 receives rank 0's last 4096
    keys, and its pair with them is its first 4096 rows only (the merge and the backward
    touch no other row). Zigzag causal: rank 1's chunks 1 and 2 follow each other in its part
    and in the sequence, so its own keys are one pair; rank 0 attends rank 1's two chunks as
    one run."""
    length = 131072
    call = attnbias.terms.Call(1, 16, length, length, torch.device("cpu"))
    layout = distributed.Layout.contiguous(2)
    window = causal_upper_left() + SlidingWindowBias(4095)
    grid = blocks.keep_grid(window, call, 256, 256)
    needs = exchange.exchanged_runs(grid, call, layout)
    assert needs == [[[], []], [[(61440, 65536)], []]], needs
    own, remote = exchange.pair_shapes(grid, call, layout, 1, needs)
    assert [(r, c) for r, c, _ in remote] == [(slice(0, 4096), slice(0, 4096))], remote
    assert remote[0][2] == attnbias.terms.Block(65536, 61440, 4096, 4096)
    assert [b for _, _, b in own] == [attnbias.terms.Block(65536, 65536, 65536, 65536)]
    zigzag = distributed.Layout.zigzag(2)
    grid = blocks.keep_grid(causal_upper_left(), call, 256, 256)
    needs = exchange.exchanged_runs(grid, call, zigzag)
    own, remote = exchange.pair_shapes(grid, call, zigzag, 1, needs)
    assert [b for _, _, b in own] == [attnbias.terms.Block(32768, 32768, 65536, 65536)], own
    own, remote = exchange.pair_shapes(grid, call, zigzag, 0, needs)
    assert [b for _, _, b in remote] == [attnbias.terms.Block(98304, 32768, 32768, 65536)]


def test_a_repeated_pair_takes_its_kept_plan_with_the_new_tensors() -> None:
    """A schedule plans each pair once per layout of its slices and gives a repeated call the
    kept plan holding that call's tensors (the same result as planning it afresh); a bias with
    tensors of its own (learnable ALiBi slopes) plans each call again."""
    length, world = 64, 2
    call = attnbias.terms.Call(1, 2, length, length, torch.device("cpu"))
    layout = distributed.Layout.zigzag(world)

    def parts(seed: int) -> list[Tensor]:
        torch.manual_seed(seed)
        return [torch.randn(1, 2, length // world, 8, dtype=torch.float64) for _ in range(3)]

    window = causal_upper_left() + SlidingWindowBias(9)
    schedule = exchange.Schedule.make(window, call, layout, 0, None, scale=None,
                                      enable_gqa=False, needs_grad=False)  # fmt: skip
    pair = schedule.pairs[0][0]
    first = schedule.plan_pair(*parts(0), pair)
    q, k, v = parts(1)
    again = schedule.plan_pair(q, k, v, pair)
    assert len(schedule.plans) == 1 and again.backend is first.backend
    assert again.spec.query.data_ptr() == q[:, :, pair.rows].data_ptr()
    assert again.spec.key.data_ptr() == k[:, :, pair.cols].data_ptr()
    assert again.spec.value.data_ptr() == v[:, :, pair.cols].data_ptr()
    fresh = exchange.Schedule.make(window, call, layout, 0, None, scale=None,
                                   enable_gqa=False, needs_grad=False)  # fmt: skip
    planned = fresh.plan_pair(q, k, v, fresh.pairs[0][0])
    for got, want in zip(again.backend.forward_lse(again.spec),
                         planned.backend.forward_lse(planned.spec), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # another layout of the slices is planned apart
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
    schedule.plan_pair(q2, k, v, pair)
    assert len(schedule.plans) == 2
    learnable = causal_upper_left() + AlibiBias(slopes=torch.tensor([0.5, 0.25]).requires_grad_())
    schedule = exchange.Schedule.make(learnable, call, layout, 0, None, scale=None,
                                      enable_gqa=False, needs_grad=True)  # fmt: skip
    schedule.plan_pair(q, k, v, schedule.pairs[0][0])
    assert schedule.plans == {}


def _merge_inputs(device: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A running result in float32 and a bf16 partial one over a view of its rows (strided
    like a slice of a larger part), with rows that keep nothing in one or both, and a NaN."""
    torch.manual_seed(0)
    out = torch.randn(2, 3, 40, 24, dtype=torch.float32, device=device)[:, :, 5:37]
    lse = torch.randn(2, 3, 40, dtype=torch.float32, device=device)[:, :, 5:37] * 3
    part = torch.randn(2, 3, 32, 24, dtype=torch.bfloat16, device=device)
    part_lse = (torch.randn(2, 3, 48, dtype=torch.float32, device=device) * 3)[:, :, ::1][
        :, :, 8:40
    ]
    lse[0, 0, :4] = -float("inf")  # nothing kept yet: the part's rows as they are
    out[0, 0, :4] = 0.0
    part_lse[0, 1, :4] = -float("inf")  # the part keeps nothing: unchanged
    lse[1, 2, :3] = -float("inf")  # both keep nothing: 0 and -inf
    out[1, 2, :3] = 0.0
    part_lse[1, 2, :3] = -float("inf")
    part_lse[1, 0, 7] = float("nan")  # stays NaN
    return out, lse, part, part_lse


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_merge_kernel_merges_as_the_tensor_operations_do(device: str) -> None:
    """``kernels.merge.merge_partial`` (interpreted on the CPU) against the exchange's merge
    in float64 tensor operations: rows that keep nothing in one or both, NaN, strided views."""
    from attnbias.kernels.merge import merge_partial

    out, lse, part, part_lse = _merge_inputs(device)
    want_out, want_lse = out.double().clone(), lse.double().clone()
    exchange._merge(want_out, want_lse, slice(0, 32), part.double(), part_lse.double())
    merge_partial(out, lse, part, part_lse)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(out[1, 0, 7]).all() and torch.isnan(lse[1, 0, 7])
    assert (out[1, 2, :3] == 0).all() and (lse[1, 2, :3] == -float("inf")).all()


def test_a_cover_counts_the_results_reaching_each_stretch() -> None:
    """Stretches of none, one and several results, clipped where a result meets them."""
    cover = exchange.Cover.of([(0, 4), (2, 6), (3, 5)], 8)
    assert cover.stretches == ((0, 2, 1), (2, 5, 2), (5, 6, 1), (6, 8, 0)), cover
    assert cover.within(1, 3) == [(1, 2, 1, 0), (2, 3, 2, 2)]
    assert cover.elements(2) == 3 and cover.elements(1) == 3 and cover.elements(0) == 2
    assert exchange.Cover.of([], 3).stretches == ((0, 3, 0),)
    # a window's rank 1 over two contiguous parts: the neighbour's pair reaches its first
    # 4096 rows, its own part all of them
    assert exchange.Cover.of([(0, 65536), (0, 4096)], 65536).stretches == (
        (0, 4096, 2), (4096, 65536, 1),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "spans",
    [[(0, 6), (4, 9), (11, 14)], [(0, 16), (4, 9), (11, 14)], [(4, 9), (0, 16)]],
    ids=["gaps", "first-spans-all", "spanning-second"],
)
def test_partial_results_sum_and_merge_as_in_the_compute_dtype_from_zero(
    dtype: torch.dtype, spans: list[tuple[int, int]]
) -> None:
    """Gradients summed from pieces (some positions reached once, some several times, some
    never; a first piece spanning every position taken as the result) are the pieces summed
    in float32 from zeros, bit for bit; outputs merged by log-sum-exp are the float64 merge
    of the pieces within the dtype's rounding, rows reached by one piece exactly that piece,
    rows reached by none 0 with a log-sum-exp of -inf."""
    generator = torch.Generator().manual_seed(0)
    length, shape = 16, (2, 3, 16, 5)
    cpu = torch.device("cpu")
    pieces = [torch.randn(2, 3, b - a, 5, generator=generator).to(dtype) for a, b in spans]
    total = exchange._Sum(exchange.Cover.of(spans, length), shape, dtype, torch.float32, cpu)
    expected = torch.zeros(shape, dtype=torch.float32)
    for (a, b), piece in zip(spans, pieces, strict=True):
        total.add(a, piece.clone())
        expected[:, :, a:b] += piece
    assert torch.equal(total.finish(), expected.to(dtype))

    lses = [torch.randn(2, 3, b - a, generator=generator) for a, b in spans]
    lses[0][0, 0, 1] = -float("inf")  # a row of the first piece that keeps nothing
    pieces[0][0, 0, 1] = 0
    cover = exchange.Cover.of(spans, length)
    merged = exchange._Merged(cover, shape, dtype, torch.float32, cpu)
    weight = torch.zeros(2, 3, length, dtype=torch.float64)
    numerator = torch.zeros(shape, dtype=torch.float64)
    for (a, b), piece, lse in zip(spans, pieces, lses, strict=True):
        merged.add(a, piece.clone(), lse.clone())
        numerator[:, :, a:b] += piece.double() * lse.double().exp()[..., None]
        weight[:, :, a:b] += lse.double().exp()
    out, lse = merged.finish()
    assert out.dtype == dtype and lse.dtype == torch.float32
    expected_out = numerator / weight.clamp_min(1e-300)[..., None]
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out.double(), expected_out, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double(), weight.log(), atol=1e-6, rtol=1e-6)
    for a, b, count in cover.stretches:
        if count == 0:
            assert torch.equal(out[:, :, a:b], torch.zeros(2, 3, b - a, 5, dtype=dtype))
            assert torch.equal(lse[:, :, a:b], torch.full((2, 3, b - a), -float("inf")))
        elif count == 1:  # one piece: as it came
            ((index, start),) = [(i, s) for i, (s, e) in enumerate(spans) if s <= a and b <= e]
            assert torch.equal(out[:, :, a:b], pieces[index][:, :, a - start : b - start])


def test_the_mode_follows_the_predicted_time() -> None:
    """Training on two ranks (the rates fitted on H100s and H200s): causal, prefix-LM and
    ragged documents at 32k take the head mode (the whole work halves, the all-to-all costs
    less than the sequence mode's pairs); a window of 4096 over contiguous parts the sequence
    mode at 32k and 128k (it sends 4096 keys, the all-to-all would send half of q, k, v and
    the output; measured at 32k on two H200s: 5.12 ms a step against 6.47); six heads over
    four ranks cannot split and take the sequence mode, and naming the head mode raises."""
    from attnbias.distributed import model

    def choose(bias: Any, length: int, layout: Any, heads: int = 16, mode: str = "auto") -> Any:
        call = attnbias.terms.Call(1, heads, length, length, torch.device("cpu"))
        grid = blocks.keep_grid(bias, call, 256, 256)
        needs = exchange.exchanged_runs(grid, call, layout)
        shape = model.StepShape(heads, 128, 128, 2, needs_grad=True)
        return model.choose_mode(mode, bias, call, layout, grid, needs, shape)

    zigzag, contiguous = distributed.Layout.zigzag(2), distributed.Layout.contiguous(2)
    assert choose(causal_upper_left(), 32768, zigzag).mode == "heads"
    assert choose(PrefixLM(4096), 32768, zigzag).mode == "heads"
    window = choose(causal_upper_left() + SlidingWindowBias(4095), 131072, contiguous)
    assert window.mode == "sequence", window
    assert window.heads_s is not None and window.sequence_s < window.heads_s
    assert choose(causal_upper_left() + SlidingWindowBias(4095), 32768, contiguous).mode == (
        "sequence"
    )
    ragged = DocumentBias.from_seqlens([3072, 9216, 5120, 7168, 8192]) + causal_upper_left()
    assert choose(ragged, 32768, contiguous).mode == "heads"
    six = choose(causal_upper_left(), 32768, distributed.Layout.zigzag(4), heads=6)
    assert six.mode == "sequence" and six.heads_s is None
    assert "Hq=6 is not a multiple of W=4" in six.describe()
    with pytest.raises(ValueError, match="mode='heads' cannot run this call: Hq=6"):
        choose(causal_upper_left(), 32768, distributed.Layout.zigzag(4), heads=6, mode="heads")

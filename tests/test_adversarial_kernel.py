"""The Triton kernel route under adversarial input, through the public API.

Every call runs ``attnbias.sdpa`` pinned to the kernel (``use_backends("triton")``, which
raises rather than fall back), interpreted on CPU. Categories: any finite scale; NaN and Inf
where a row does not look (masked keys and values, queries and output gradients of rows that
keep nothing, memory past the ends of the tensors) and where it does (it must propagate, as in
stock SDPA); gradients of ALiBi slopes; double backward; degenerate and empty shapes; calls the
kernel refuses. The expected values are the oracle's (``attnbias.testing.oracle``), on the
same inputs with the positions that must not matter replaced by zeros.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    causal_upper_left,
    sdpa,
)
from attnbias.biases import parts_of
from attnbias.kernels.program import MaskProgram
from attnbias.testing.oracle import assert_close_to_oracle, attention, run_with_grads
from attnbias.testing.strategies import Problem, finite_scales, kernel_problems

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("out", "dq", "dk", "dv")


@pytest.fixture(autouse=True)
def kernel_route() -> Iterator[None]:
    with attnbias.use_backends("triton"):
        yield


def call_kwargs(problem: Problem) -> dict[str, object]:
    return dict(
        scale=problem.scale,
        is_causal=problem.is_causal,
        enable_gqa=problem.heads_q != problem.heads_kv,
    )


def expected_and_stock(
    problem: Problem, inputs: tuple[Tensor, Tensor, Tensor], grad_out: Tensor
) -> tuple[list[Tensor], list[Tensor]]:
    """``[out, dq, dk, dv]`` of the fp64 oracle and of stock PyTorch in the problem's dtype."""
    kwargs = call_kwargs(problem)

    def oracle(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, problem.bias, **kwargs)  # type: ignore[arg-type]

    def stock_low(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, problem.bias, dtype=problem.dtype, **kwargs)  # type: ignore[arg-type]

    expected = run_with_grads(oracle, [x.double() for x in inputs], grad_out.double())
    low = run_with_grads(stock_low, inputs, grad_out)
    return expected, low


def kernel_results(
    problem: Problem, inputs: tuple[Tensor, Tensor, Tensor], grad_out: Tensor
) -> list[Tensor]:
    def ours(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, attn_mask=problem.bias, **call_kwargs(problem))  # type: ignore[arg-type]

    leaves = [x.detach().requires_grad_(True) for x in inputs]  # views stay views
    out = ours(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return [out.detach(), *[g.detach() for g in grads]]


def keep_mask(problem: Problem) -> Tensor:
    """``(B, Hq, L, S)`` bool: the pairs the bias keeps, from its materialized form."""
    shape = (problem.batch, problem.heads_q, problem.length_q, problem.length_kv)
    rest = [p for p in parts_of(problem.bias) if not isinstance(p, SoftcapBias)]
    if problem.is_causal:
        rest.append(causal_upper_left())
    keep = torch.ones(shape, dtype=torch.bool)
    for part in rest:
        keep &= torch.isfinite(part.materialize("cpu", shape=shape, dtype=torch.float64))
    return keep.to(DEVICE)


def compare(
    results: list[Tensor], expected: list[Tensor], low: list[Tensor], dtype: torch.dtype
) -> None:
    """``assert_close_to_oracle`` for ``[out, dq, dk, dv, ...]``, leaving out of the gradients
    the entries that are exactly 0 in both the oracle and stock PyTorch.

    Those are gradients that cancel exactly (a row that keeps one key has ``dS = P (dP -
    delta) = 0``): stock PyTorch's softmax backward reproduces the 0 exactly, while a
    flash-attention backward computes ``dP`` and ``delta`` in two sums of different order and
    keeps their rounding (see ``rounding_sizes`` in ``tests/test_kernels.py``), which the
    oracle's budget has no term for. Those entries must still be finite.
    """
    kept: list[tuple[str, Tensor, Tensor, Tensor]] = []
    for n, (name, result, oracle, stock) in enumerate(
        zip((*NAMES, "dslopes"), results, expected, low, strict=False)
    ):
        if n > 0:
            exact_zero = (oracle == 0) & (stock == 0)
            assert torch.isfinite(result[exact_zero]).all(), f"{name}: non-finite"
            result, oracle, stock = result[~exact_zero], oracle[~exact_zero], stock[~exact_zero]
        if result.numel():
            kept.append((name, result, oracle, stock))
    if kept:
        names, kept_results, kept_expected, kept_low = zip(*kept, strict=True)
        assert_close_to_oracle(kept_results, kept_expected, kept_low, dtype, names)


def check(problem: Problem, seed: int) -> None:
    q, k, v, grad_out = (x.to(DEVICE) for x in problem.tensors(seed))
    results = kernel_results(problem, (q, k, v), grad_out)
    expected, low = expected_and_stock(problem, (q, k, v), grad_out)
    for result, like in zip(results, (q, q, k, v), strict=True):
        assert result.shape == like.shape and result.dtype == like.dtype
    compare(results, expected, low, problem.dtype)


# --------------------------------------------------------------------------------------------
# Any finite scale


@given(
    problem=kernel_problems(scales=finite_scales(), dtypes=(torch.float16, torch.bfloat16)),
    seed=st.integers(0, 2**16),
)
def test_any_finite_scale(problem: Problem, seed: int) -> None:
    """Half precision: in float32 a flash-attention backward keeps the rounding of the
    probabilities it recomputes from the stored log-sum-exp, about ``eps * (|s| + |lse|)``,
    which the oracle's budget has no term for (``tests/test_kernels.py`` budgets for it and
    covers float32); the float32 cases below stay within it."""
    check(problem, seed)


@pytest.mark.parametrize(
    ("scale", "dtype", "bias"),
    [
        (0.0, torch.float32, SlidingWindowBias(3)),
        (-0.7, torch.float32, causal_lower_right() + AlibiBias(num_heads=2)),
        (1e-45, torch.float32, SoftcapBias(2.0) + DocumentBias.from_seqlens([5, 0, 14], [9, 6, 2])),
        # large scores in half precision (see finite_scales for float32)
        (-30.0, torch.float16, SlidingWindowBias(3)),
        (12.0, torch.bfloat16, causal_lower_right() + AlibiBias(num_heads=2)),
        (-0.0, torch.bfloat16, SoftcapBias(2.0) + DocumentBias.from_seqlens([5, 0, 14], [9, 6, 2])),
    ],
    ids=["0-window", "negative-alibi", "subnormal-softcap", "large-negative", "large", "-0"],
)
def test_scales_that_gave_nan(scale: float, dtype: torch.dtype, bias: AttnBias) -> None:
    check(Problem(1, 2, 1, 19, 17, 16, dtype, bias, False, scale), seed=0)


# --------------------------------------------------------------------------------------------
# NaN and Inf where a row does not look, and where it does


POISONS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


@st.composite
def poisoned_calls(draw: st.DrawFn) -> tuple[Problem, int, str, str, int, bool]:
    """A problem, a seed, what to poison (``key``, ``value``, ``query``, ``grad_out``), with
    what (NaN, +Inf, -Inf), which positions (a seed for the draw) and whether the tensors are
    views into NaN-filled buffers (rows past L and S, head dims past E)."""
    problem = draw(kernel_problems())
    return (
        problem,
        draw(st.integers(0, 2**16)),
        draw(st.sampled_from(["key", "value", "query", "grad_out"])),
        draw(st.sampled_from(list(POISONS))),
        draw(st.integers(0, 2**16)),
        draw(st.booleans()),
    )


def in_nan_buffer(x: Tensor) -> Tensor:
    """``x`` as a view into a larger NaN-filled buffer: 5 more rows, 8 more head dims."""
    batch, heads, rows, dim = x.shape
    buffer = torch.full((batch, heads, rows + 5, dim + 8), math.nan, dtype=x.dtype, device=x.device)
    view = buffer[:, :, :rows, :dim]
    view.copy_(x)
    return view


def dependent_entries(pairs: Tensor, bad_rows: Tensor, heads_kv: int) -> tuple[Tensor, Tensor]:
    """Which query rows ``(B, Hq, L)`` and key rows ``(B, Hkv, S)`` of the results depend on
    poisoned inputs, given the rows ``bad_rows`` whose own computation sees a poison and the
    ``pairs`` through which a row reaches a key's gradients (through its log-sum-exp and
    output)."""
    batch, heads_q, _, length_kv = pairs.shape
    keys = (pairs & bad_rows[..., None]).any(dim=2)  # (B, Hq, S)
    keys = keys.view(batch, heads_kv, heads_q // heads_kv, length_kv).any(dim=2)
    return bad_rows, keys


def tile_pairs(keep: Tensor) -> Tensor:
    """``(B, Hq, L, S)``: the pairs whose tile the kernels may load, a superset of ``keep``.

    A query block visits the key blocks from the first to the last key any of its rows keeps
    (and a key block the query blocks from the first to the last row keeping one of its keys).
    Within such a tile the zero weights of masked pairs multiply their rows of keys, values,
    queries and output gradients, so a non-finite value there may reach every pair of the tile,
    as in the other fused kernels (the module docstring of ``attnbias.kernels.common``).
    Tiles: 16 x 16 under the interpreter; on a GPU 128 x 128 bounds every tile shape.
    """
    block = 16 if DEVICE == "cpu" else 128
    batch, heads, length_q, length_kv = keep.shape
    tiles = torch.zeros_like(keep)
    for b in range(batch):
        for h in range(heads):
            for start in range(0, length_q, block):
                cols = keep[b, h, start : start + block].any(dim=0).nonzero().flatten()
                if not len(cols):  # where an empty band falls is the kernel's own choice
                    tiles[b, h, start : start + block] = True
                    continue
                lo = int(cols.min()) // block * block
                hi = (int(cols.max()) // block + 1) * block
                tiles[b, h, start : start + block, lo:hi] = True
            for start in range(0, length_kv, block):
                rows = keep[b, h, :, start : start + block].any(dim=1).nonzero().flatten()
                if not len(rows):
                    tiles[b, h, :, start : start + block] = True
                    continue
                lo = int(rows.min()) // block * block
                hi = (int(rows.max()) // block + 1) * block
                tiles[b, h, lo:hi, start : start + block] = True
    return tiles


@given(poisoned_calls())
def test_poison_reaches_only_what_uses_it(
    call: tuple[Problem, int, str, str, int, bool],
) -> None:
    """Poisoned inputs, at random positions attended or not: a NaN that a kept pair uses makes
    what depends on it non-finite; nothing outside the tiles that load a poisoned row changes
    (compared with the oracle on the inputs with zeros there); rows past L and S and head dims
    past E (views into NaN-filled buffers) are never read."""
    problem, seed, target, poison, where_seed, buffered = call
    q, k, v, grad_out = (x.to(DEVICE) for x in problem.tensors(seed))
    keep = keep_mask(problem)
    tiles = tile_pairs(keep)
    generator = torch.Generator().manual_seed(where_seed)
    index = {"query": 0, "key": 1, "value": 2, "grad_out": 3}[target]
    clean = [q, k, v, grad_out]
    rows_shape = clean[index].shape[:3]
    positions = (torch.rand(rows_shape, generator=generator) < 0.3).to(DEVICE)
    poisoned = list(clean)
    poisoned[index] = clean[index].masked_fill(positions[..., None], POISONS[poison])
    clean[index] = clean[index].masked_fill(positions[..., None], 0.0)
    if buffered:
        poisoned = [in_nan_buffer(x) for x in poisoned]

    def reached(pairs: Tensor) -> list[Tensor]:
        """out, dq, dk, dv entries reached by the poison through ``pairs``."""
        if target in ("key", "value"):
            group = problem.heads_q // problem.heads_kv
            per_query_head = positions.repeat_interleave(group, dim=1)  # (B, Hq, S)
            bad_rows = (pairs & per_query_head[:, :, None, :]).any(dim=-1)
        else:  # a row's own query or output gradient
            bad_rows = positions & keep.any(dim=-1)
        rows, keys = dependent_entries(pairs, bad_rows, problem.heads_kv)
        if target in ("query", "grad_out"):  # dK, dV of every key a poisoned row's tiles load
            keys = keys | dependent_entries(pairs, positions, problem.heads_kv)[1]
        out_rows = rows if target != "grad_out" else torch.zeros_like(rows)
        # dV = P^T dO reads no value (P comes from the queries, keys and log-sum-exps)
        dv_keys = keys if target != "value" else torch.zeros_like(keys)
        return [out_rows, rows, keys, dv_keys]

    depends = reached(keep)
    may_differ = [d | m for d, m in zip(depends, reached(tiles), strict=True)]
    if target in ("key", "value"):  # the poisoned key rows' own gradients
        may_differ[2] = may_differ[2] | positions
        may_differ[3] = may_differ[3] | positions

    results = kernel_results(problem, tuple(poisoned[:3]), poisoned[3])  # type: ignore[arg-type]
    expected, low = expected_and_stock(problem, tuple(clean[:3]), clean[3])  # type: ignore[arg-type]
    for name, result, dep in zip(NAMES, results, depends, strict=True):
        if poison == "nan" and dep.any():
            assert not torch.isfinite(result[dep]).all(dim=-1).any(), (
                f"{name}: a NaN used by a kept pair was cleaned away"
            )
    compare(
        [r[~d] for r, d in zip(results, may_differ, strict=True)],
        [e[~d] for e, d in zip(expected, may_differ, strict=True)],
        [x[~d] for x, d in zip(low, may_differ, strict=True)],
        problem.dtype,
    )


def test_nan_in_a_key_reaches_exactly_the_rows_that_keep_it() -> None:
    """In the forward a key only makes scores, which masked pairs select away: exact. A value
    is multiplied by the zero weights of its tile too: the rows that keep it are NaN."""
    q, k, v = (torch.randn(1, 1, 20, 16, device=DEVICE) for _ in range(3))
    k[:, :, 7] = math.nan
    v[:, :, 18] = math.nan
    out = sdpa(q, k, v, attn_mask=SlidingWindowBias(2))  # row i keeps i - 2 .. i
    nan_rows = set(out.isnan().any(dim=-1)[0, 0].nonzero().flatten().tolist())
    assert {7, 8, 9} <= nan_rows and {18, 19} <= nan_rows
    v[:, :, 18] = 0.0
    k_only = sdpa(q, k, v, attn_mask=SlidingWindowBias(2))
    assert k_only.isnan().any(dim=-1)[0, 0].nonzero().flatten().tolist() == [7, 8, 9]


def test_rows_that_keep_nothing_give_zero_whatever_their_query() -> None:
    # documents 1 and 3 have queries but no keys
    bias = DocumentBias.from_seqlens([6, 5, 9, 4], [10, 0, 10, 0]) + causal_lower_right()
    q, grad_out = (torch.randn(2, 2, 24, 16, device=DEVICE) for _ in range(2))
    k, v = (torch.randn(2, 2, 20, 16, device=DEVICE) for _ in range(2))
    empty = torch.zeros(24, dtype=torch.bool, device=DEVICE)
    empty[6:11] = empty[20:] = True
    q[:, :, empty] = math.nan
    grad_out[:, :, empty] = math.inf
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = sdpa(*leaves, attn_mask=bias)
    dq, _, _ = torch.autograd.grad(out, leaves, grad_out)
    assert (out[:, :, empty] == 0).all() and (dq[:, :, empty] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    problem = Problem(2, 2, 2, 24, 20, 16, torch.float32, bias, False, None)
    clean_q, clean_grad_out = (x.detach().masked_fill(empty[:, None], 0.0) for x in (q, grad_out))
    expected, low = expected_and_stock(problem, (clean_q, k.detach(), v.detach()), clean_grad_out)
    # dK and dV multiply those rows by the zero weights of their tiles: not compared (the
    # kernels' module docstring); the outputs and dQ are exact
    compare([out.detach(), dq], expected[:2], low[:2], torch.float32)


# --------------------------------------------------------------------------------------------
# Gradients of ALiBi slopes


ALIBI_CALLS = {
    # per-batch slopes, a band on both sides, GQA, float32
    "batched": (
        Problem(2, 2, 1, 19, 23, 16, torch.float32,
                causal_lower_right() + SlidingWindowBias(5), False, None),
        (2, 2),
        False,
    ),
    # soft-cap and documents, a second ALiBi bias summed with the trainable one, bfloat16
    "softcap_documents": (
        Problem(1, 3, 1, 17, 17, 24, torch.bfloat16,
                SoftcapBias(3.0) + DocumentBias.from_seqlens([6, 11]), True, 0.4),
        (3,),
        True,
    ),
    # one slope shared by the batch, a negative scale, float16
    "shared_negative_scale": (
        Problem(2, 1, 1, 20, 9, 16, torch.float16, causal_upper_left(), False, -0.5),
        (1, 1),
        False,
    ),
    # scale 0: the scores are the ALiBi terms alone; bfloat16, a band on both sides
    "zero_scale": (
        Problem(2, 2, 2, 33, 47, 16, torch.bfloat16, SlidingWindowBias(9, 3), False, 0.0),
        (2, 2),
        False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ALIBI_CALLS))
def test_alibi_slope_gradients(name: str) -> None:
    """Trainable slopes (``(B, Hq)``, ``(Hq,)``, ``(1, Hq)``) get their gradient on the
    kernel, within the oracle's budget."""
    problem, shape, second = ALIBI_CALLS[name]
    seed = 7
    q, k, v, grad_out = (x.to(DEVICE) for x in problem.tensors(seed))
    slopes = torch.rand(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    fixed = AlibiBias(num_heads=problem.heads_q) if second else None
    kwargs = call_kwargs(problem)

    def run(dtype: torch.dtype | None, leaves: list[Tensor]) -> list[Tensor]:
        bias: AttnBias = problem.bias + AlibiBias(slopes=leaves[3])  # type: ignore[operator]
        bias = bias + fixed if fixed is not None else bias
        if dtype is None:
            out = sdpa(*leaves[:3], attn_mask=bias, **kwargs)  # type: ignore[arg-type]
        else:
            out = attention(*leaves[:3], bias, dtype=dtype, **kwargs)  # type: ignore[arg-type]
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        return [out.detach(), *[g.detach() for g in grads]]

    def leaves(dtype: torch.dtype) -> list[Tensor]:
        return [x.detach().to(dtype).requires_grad_() for x in (q, k, v)] + [
            slopes.detach().clone().requires_grad_()
        ]

    results = run(None, leaves(problem.dtype))
    expected = run(torch.float64, leaves(torch.float64))
    low = run(problem.dtype, leaves(problem.dtype))
    assert results[4].shape == slopes.shape
    compare(results, expected, low, problem.dtype)


# --------------------------------------------------------------------------------------------
# Double backward


Attention = Callable[[Tensor, Tensor, Tensor, AttnBias], Tensor]


def through_sdpa(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias) -> Tensor:
    return sdpa(q, k, v, attn_mask=bias)


def gradient_penalty(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, fn: Attention) -> Tensor:
    out = fn(q, k, v, bias)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    return out.sum() + dq.square().sum()


def test_double_backward_is_refused_with_the_way_out() -> None:
    bias = causal_lower_right() + SlidingWindowBias(4) + AlibiBias(num_heads=2)
    q, k, v = (torch.randn(1, 2, 12, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    loss = gradient_penalty(q, k, v, bias, through_sdpa)
    with pytest.raises(NotImplementedError, match=r'use_backends\("reference"\)'):
        loss.backward()

    # the way out that the message gives is exact: the reference path against the oracle
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    with attnbias.use_backends("reference"):
        got = torch.autograd.grad(gradient_penalty(*leaves, bias, through_sdpa), leaves)
    want = torch.autograd.grad(gradient_penalty(*leaves, bias, attention), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_create_graph_keeps_first_order_gradients_exact() -> None:
    bias = AlibiBias(slopes=torch.rand(2, device=DEVICE, requires_grad=True)) + SoftcapBias(3.0)
    q, k, v = (torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    tensors = (q, k, v, bias.parts[0].slopes)  # type: ignore[attr-defined]
    plain = torch.autograd.grad(sdpa(q, k, v, attn_mask=bias).sum(), tensors)
    graph = torch.autograd.grad(sdpa(q, k, v, attn_mask=bias).sum(), tensors, create_graph=True)
    for p, g in zip(plain, graph, strict=True):
        assert g.requires_grad
        torch.testing.assert_close(g.detach(), p)
    with pytest.raises(NotImplementedError, match="double backward"):
        sum(g.sum() for g in graph).backward()  # type: ignore[union-attr]


def test_double_backward_is_refused_on_the_registered_op() -> None:
    """The custom op that torch.compile traces shares the backward, and its refusal."""
    import attnbias.kernels.ops  # noqa: F401  (registers the op)

    q, k, v = (torch.randn(1, 1, 8, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    slopes = torch.rand(1, 1, device=DEVICE)
    program = MaskProgram(band_hi=0, alibi_slopes=slopes)
    out, _ = torch.ops.attnbias.attention_fwd(q, k, v, *program.pack(), 0.25)
    grads = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    assert all(g.requires_grad for g in grads)
    with pytest.raises(NotImplementedError, match="double backward"):
        grads[0].sum().backward()
    # slopes that require grad get their gradient on the eager path only: the op refuses them
    slopes.requires_grad_(True)
    out, _ = torch.ops.attnbias.attention_fwd(q, k, v, *program.pack(), 0.25)
    with pytest.raises(NotImplementedError, match="ALiBi slopes.*eager mode only"):
        torch.autograd.grad(out.sum(), (q, slopes))


# --------------------------------------------------------------------------------------------
# Degenerate and empty shapes


DEGENERATE_BIASES: dict[str, Callable[[int, int, int], AttnBias]] = {
    "causal": lambda heads, length_q, length_kv: causal_upper_left(),
    "window": lambda heads, length_q, length_kv: causal_lower_right() + SlidingWindowBias(2, 1),
    "one_document_alibi": lambda heads, length_q, length_kv: (
        DocumentBias.from_seqlens([length_q], [length_kv]) + AlibiBias(num_heads=heads)
    ),
}


@pytest.mark.parametrize(
    ("batch", "heads_q", "heads_kv", "length_q", "length_kv", "head_dim", "bias"),
    [
        (1, 1, 1, 1, 1, 16, "one_document_alibi"),
        (1, 3, 1, 1, 33, 16, "window"),  # decode-like, GQA group of 3
        (2, 1, 1, 33, 1, 16, "causal"),
        (1, 2, 1, 17, 40, 8, "one_document_alibi"),  # head dim below the tile's 16
        (1, 1, 1, 16, 32, 1, "causal"),
        (1, 2, 2, 31, 16, 40, "window"),  # padded head dim, L > S, L = S - 1 + 16
    ],
)
def test_degenerate_shapes(
    batch: int, heads_q: int, heads_kv: int, length_q: int, length_kv: int, head_dim: int,
    bias: str,
) -> None:  # fmt: skip
    problem = Problem(
        batch, heads_q, heads_kv, length_q, length_kv, head_dim, torch.float32,
        DEGENERATE_BIASES[bias](heads_q, length_q, length_kv), False, None,
    )  # fmt: skip
    check(problem, seed=length_q * 100 + length_kv)


@pytest.mark.parametrize(
    "shape",
    [(0, 2, 5, 7), (1, 2, 0, 7), (1, 2, 5, 0), (0, 2, 0, 0)],
    ids=["B=0", "L=0", "S=0", "B=L=S=0"],
)
def test_empty_dimensions_behave_like_stock_sdpa(shape: tuple[int, int, int, int]) -> None:
    batch, heads, length_q, length_kv = shape
    q = torch.randn(batch, heads, length_q, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(batch, heads, length_kv, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(batch, heads, length_kv, 16, device=DEVICE, requires_grad=True)
    bias = SlidingWindowBias(3) + SoftcapBias(5.0)
    out = sdpa(q, k, v, attn_mask=bias, scale=0.5)
    stock = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), scale=0.5)
    assert out.shape == stock.shape
    torch.testing.assert_close(out.detach(), stock, rtol=0, atol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for grad, like in zip(grads, (q, k, v), strict=True):
        assert grad is None or (grad.shape == like.shape and (grad == 0).all())


def test_empty_heads_on_the_kernel() -> None:
    from attnbias.kernels import block_sparse_attention

    q, k, v = (torch.randn(2, 0, 6, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    out = block_sparse_attention(q, k, v, MaskProgram(band_hi=0), scale=0.25)
    assert out.shape == (2, 0, 6, 16)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# --------------------------------------------------------------------------------------------
# Calls the kernel refuses, with the values and the reason


def refusal(q: Tensor, k: Tensor, v: Tensor, **kwargs: object) -> str:
    with pytest.raises(ValueError, match="no allowed backend") as info:
        sdpa(q, k, v, attn_mask=SlidingWindowBias(2), **kwargs)  # type: ignore[arg-type]
    return str(info.value)


def test_refusals_name_the_values() -> None:
    q = torch.randn(1, 2, 6, 16, device=DEVICE)
    assert "value head dim (8) differs from the query head dim (16)" in refusal(q, q, q[..., :8])
    wide = torch.randn(1, 1, 4, 272, device=DEVICE)
    assert "head dim 272 is above the kernel's 256" in refusal(wide, wide, wide)
    assert "dropout_p=0.5" in refusal(q, q, q, dropout_p=0.5)
    assert "torch.float64" in refusal(q.double(), q.double(), q.double())


def test_trainable_slopes_stay_on_the_kernel() -> None:
    q = torch.randn(1, 2, 6, 16, device=DEVICE, requires_grad=True)
    bias = AlibiBias(slopes=torch.rand(2, device=DEVICE, requires_grad=True)) + causal_lower_right()
    assert attnbias.explain(q, q, q, attn_mask=bias).startswith("triton")

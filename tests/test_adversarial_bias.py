"""Adversarial inputs on the materializing routes (the default CPU routes, the exact eager path
and stock SDPA with the materialized mask): non-finite values in attended and unattended
positions, half precision against float32 biases, large document ids, bad bias parameters, user
subclasses returning wrong things, and gradients of every tensor parameter.

Each case asserts the contract: the oracle's answer, or a ``ValueError`` / ``TypeError`` naming
the values and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    sdpa,
)
from attnbias.backends import triton as triton_backend
from attnbias.biases import CompositeBias, parts_of
from attnbias.reference import (
    FiniteInputs,
    attention_with_lse,
    attention_with_lse_backward,
    kept_key_span,
)
from attnbias.spec import lower
from attnbias.terms import Call
from attnbias.testing.oracle import (
    _split,
    assert_close_to_oracle,
    attention,
    flash_rounding,
    run_with_grads,
)
from attnbias.testing.strategies import Garbage, Problem, garbage, problems, unattended_keys

ROUTES = ("fallback", "reference", "sdpa+mask")
SETTINGS = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``fallback``: the route sdpa picks on CPU without the Triton kernel, less stock SDPA's
    fused kernels (no mask, plain causal: what they do with non-finite inputs in masked
    positions is stock SDPA's own behaviour, see the README); ``reference`` and ``sdpa+mask``:
    that backend pinned (user biases take their materialized path either way)."""
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    if request.param == "fallback":
        with attnbias.use_backends(exclude=["sdpa"]):
            yield "fallback"
    else:
        with attnbias.use_backends(request.param):
            yield str(request.param)


def for_route(bias: AttnBias | None, route: str) -> AttnBias | None:
    """Stock SDPA has no soft-cap: on the ``sdpa+mask`` route the bias goes without it."""
    if route != "sdpa+mask":
        return bias
    parts = [p for p in parts_of(bias) if not isinstance(p, SoftcapBias)]
    return None if not parts else parts[0] if len(parts) == 1 else CompositeBias(tuple(parts))


def keep_of(
    bias: AttnBias | None, shape: tuple[int, int, int, int], is_causal: bool
) -> torch.Tensor:
    """``(B, H, L, S)`` bool: the pairs the oracle's mask keeps."""
    if is_causal:
        bias = causal_upper_left() if bias is None else bias + causal_upper_left()
    _, rest = _split(bias)
    if rest is None:
        return torch.ones(shape, dtype=torch.bool)
    mask = rest.materialize("cpu", shape=shape, dtype=torch.float64)
    return (~torch.isneginf(mask)).expand(shape)


def poisoned_rows(keep: torch.Tensor, dirty: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``(B, H, L)``: rows that attend a non-finite key or value, or whose own non-finite query
    attends some key. The contract makes each of them NaN and leaves every other row exact."""
    q, k, v = dirty
    group = q.shape[1] // k.shape[1]
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))
    bad_kv = bad_kv.repeat_interleave(group, dim=1)  # (B, Hq, S)
    bad_q = ~torch.isfinite(q).all(-1)
    return (keep & bad_kv[:, :, None, :]).any(-1) | (bad_q & keep.any(-1))


@SETTINGS
@given(
    problem=problems(max_len=10, head_dims=(8,), dtypes=(torch.float32,)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_non_finite_inputs(route: str, problem: Problem, seed: int, data: st.DataObject) -> None:
    bias = for_route(problem.bias, route)
    where: Garbage = data.draw(garbage(problem))
    q, k, v, grad_out = problem.tensors(seed)
    dirty = where.apply(q, k, v, clean=False)
    # every route here pins or excludes stock SDPA: a call with no mask is planned too
    clean = where.apply(q, k, v, clean=True)
    kwargs = dict(
        scale=problem.scale,
        is_causal=problem.is_causal,
        enable_gqa=problem.heads_q != problem.heads_kv,
    )
    results = run_with_grads(lambda *x: sdpa(*x, attn_mask=bias, **kwargs), dirty, grad_out)
    expected = run_with_grads(
        lambda *x: attention(*x, bias, **kwargs), [t.double() for t in clean], grad_out.double()
    )
    low = run_with_grads(
        lambda *x: attention(*x, bias, dtype=torch.float32, **kwargs), clean, grad_out
    )
    shape = (problem.batch, problem.heads_q, problem.length_q, problem.length_kv)
    poisoned = poisoned_rows(keep_of(bias, shape, problem.is_causal), dirty)
    out = results[0]
    assert torch.isnan(out[poisoned]).all(), "a row attending a non-finite value is not NaN"
    fine = ~poisoned
    names = ("out", "dq")
    if fine.any():
        assert_close_to_oracle(
            [results[0][fine], results[1][fine]],
            [expected[0][fine], expected[1][fine]],
            [low[0][fine], low[1][fine]],
            torch.float32,
            names,
        )
    if not poisoned.any():  # nothing attended is non-finite: every gradient is exact
        assert_close_to_oracle(results[2:], expected[2:], low[2:], torch.float32, ("dk", "dv"))


@SETTINGS
@given(
    case=unattended_keys(), seed=st.integers(0, 2**16), value=st.sampled_from([math.nan, math.inf])
)
def test_unattended_keys_reach_nothing(
    route: str, case: tuple[AttnBias, int, int, list[int]], seed: int, value: float
) -> None:
    bias, length_q, length_kv, keys = case
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, length_q, 8, generator=generator)
    k, v = (torch.randn(2, 2, length_kv, 8, generator=generator) for _ in range(2))
    grad_out = torch.randn(2, 2, length_q, 8, generator=generator)
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[:, :, keys] = value
    dirty_v[:, :, keys] = -value
    clean_k, clean_v = k.clone(), v.clone()
    clean_k[:, :, keys] = 0.0
    clean_v[:, :, keys] = 0.0
    results = run_with_grads(lambda *x: sdpa(*x, attn_mask=bias), (q, dirty_k, dirty_v), grad_out)
    expected = run_with_grads(
        lambda *x: attention(*x, bias),
        [t.double() for t in (q, clean_k, clean_v)],
        grad_out.double(),
    )
    low = run_with_grads(
        lambda *x: attention(*x, bias, dtype=torch.float32), (q, clean_k, clean_v), grad_out
    )
    # stock SDPA's backward forms dS = P * (dP - delta) as the kernels do: where a row keeps
    # one key, dP and delta are equal in exact arithmetic and their fp32 rounding is what dq
    # and dk hold, relative to the sizes that cancel (the fp32 reference can cancel exactly)
    rounding = flash_rounding(q, clean_k, clean_v, bias, grad_out)
    assert_close_to_oracle(
        results, expected, low, torch.float32, ("out", "dq", "dk", "dv"), rounding
    )
    assert (results[2][:, :, keys] == 0).all() and (results[3][:, :, keys] == 0).all()


def test_fully_masked_row_with_nan_query_is_zero(route: str) -> None:
    q, k, v = (torch.randn(1, 1, 4, 8, requires_grad=True) for _ in range(3))
    q_dirty = q.detach().clone()
    q_dirty[0, 0, 0] = math.nan  # row 0 keeps no key under lower-right causal with L > S
    q_dirty.requires_grad_(True)
    out = sdpa(q_dirty, k[:, :, :2], v[:, :, :2], attn_mask=causal_lower_right())
    assert torch.equal(out[0, 0, :2], torch.zeros(2, 8))
    out.sum().backward()
    assert torch.equal(q_dirty.grad[0, 0, :2], torch.zeros(2, 8))  # type: ignore[index]
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()  # type: ignore[arg-type]


# -- the exact routes read only the keys some row keeps ------------------------------------------
# A cache of S = 24 slots (B = 3, Hq = 4, Hkv = 2): each case's bias keeps, over all its rows,
# only the keys [start, stop) of SPANS; every slot outside holds NaN / Inf (the unfilled end of
# a cache, left padding), which must reach nothing and must not even be read.

CACHE_LENGTH = 24
CACHE_CASES = {
    # a decode step: row b keeps [start[b], end[b]); the window reaches past the cache
    "decode": (1, lambda: (
        KeyRangeBias(start=[2, 5, 9], end=[13, 17, 15]) + causal_lower_right()
        + SlidingWindowBias(1023)
    )),
    # the window sets the first key (23 - 8 = 15); two rows keep no key at all
    "decode_window": (1, lambda: (
        KeyRangeBias(end=[13, 17, 15]) + causal_lower_right() + SlidingWindowBias(8)
    )),
    # speculative decoding: four queries at the end, left padding, keys up to the last
    "speculative": (4, lambda: KeyRangeBias(start=[2, 5, 9]) + causal_lower_right()),
    # a chunk prefilled into a larger buffer: the band alone ends the keys
    "prefill_chunk": (4, causal_upper_left),
    # ALiBi's additive part, made for the whole cache, narrowed with the keys
    "alibi": (2, lambda: (
        KeyRangeBias(start=[3, 1, 6], end=[11, 19, 12]) + AlibiBias(num_heads=4)
        + causal_lower_right()
    )),
}  # fmt: skip
SPANS = {
    "decode": (2, 17),
    "decode_window": (15, 17),
    "speculative": (2, 24),
    "prefill_chunk": (0, 4),
    "alibi": (1, 19),
}


def cache_call(name: str, seed: int = 0) -> tuple[AttnBias, tuple[torch.Tensor, ...], torch.Tensor]:
    """``(bias, (q, k, v), grad_out)`` of a case, with NaN in the keys and Inf in the values
    outside its span."""
    length_q, make = CACHE_CASES[name]
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 4, length_q, 8, generator=generator)
    k, v = (torch.randn(3, 2, CACHE_LENGTH, 8, generator=generator) for _ in range(2))
    grad_out = torch.randn(3, 4, length_q, 8, generator=generator)
    start, stop = SPANS[name]
    for tensor, poison in ((k, math.nan), (v, math.inf)):
        tensor[:, :, :start] = poison
        tensor[:, :, stop:] = -poison
    return make(), (q, k, v), grad_out


def outside_span(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s keys outside the span of case ``name``, as one tensor."""
    start, stop = SPANS[name]
    return torch.cat([tensor[:, :, :start], tensor[:, :, stop:]], dim=2)


@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_keys_no_row_keeps_are_never_read(
    route: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outputs and gradients match the oracle on the cache with zeros in place of the NaN
    (the gradients of the keys outside the span exactly 0), and the finiteness check, so the
    attention, sees only the span's keys: nothing outside it is read (copied, checked or
    multiplied), not one key more nor less."""
    bias, (q, k, v), grad_out = cache_call(name)
    seen: list[int] = []
    check = FiniteInputs.of.__func__  # type: ignore[attr-defined]

    def spy(cls: type[FiniteInputs], *tensors: torch.Tensor) -> FiniteInputs:
        seen.append(tensors[1].shape[-2])
        return check(cls, *tensors)  # type: ignore[no-any-return]

    monkeypatch.setattr(FiniteInputs, "of", classmethod(spy))
    results = run_with_grads(
        lambda *x: sdpa(*x, attn_mask=bias, enable_gqa=True), (q, k, v), grad_out
    )
    start, stop = SPANS[name]
    assert seen and set(seen) == {stop - start}, f"keys read: {seen}, the span has {stop - start}"
    clean = [q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)]
    expected = run_with_grads(
        lambda *x: attention(*x, bias, enable_gqa=True),
        [t.double() for t in clean],
        grad_out.double(),
    )
    low = run_with_grads(
        lambda *x: attention(*x, bias, enable_gqa=True, dtype=torch.float32), clean, grad_out
    )
    assert_close_to_oracle(results, expected, low, torch.float32, ("out", "dq", "dk", "dv"))
    assert (outside_span(name, results[2]) == 0).all() and (
        outside_span(name, results[3]) == 0
    ).all()


def test_a_non_finite_key_the_span_holds_reaches_exactly_the_rows_that_keep_it(
    route: str,
) -> None:
    """Inside the span the contract is the one of every key: a NaN key reaches the rows that
    keep it (batch row 1 keeps key 15, rows 0 and 2 do not), an Inf value at the span's first
    key the one row that keeps it (batch row 0); the other rows stay exact."""
    bias, (q, k, v), _ = cache_call("decode")
    clean = [q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)]
    k[:, :, 15] = math.nan
    v[:, :, 2] = math.inf
    out = sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    assert out[:2].isnan().all(), "a row that keeps a non-finite key or value is not NaN"
    expected = attention(*(t.double() for t in clean), bias, enable_gqa=True)
    low = attention(*clean, bias, enable_gqa=True, dtype=torch.float32)
    assert_close_to_oracle([out[2]], [expected[2]], [low[2]], torch.float32)


@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_log_sum_exp_route_reads_only_the_span(name: str) -> None:
    """The exact path's log-sum-exp form (context parallelism's shard pairs), forward and
    backward: the same with NaN outside the span as with zeros there, bit for bit, and no
    gradient outside it."""
    bias, (q, k, v), grad_out = cache_call(name)
    clean = (q, k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0))
    results = []
    for tensors in ((q, k, v), clean):
        out, lse = attention_with_lse(*tensors, bias, scale=None, enable_gqa=True)
        grads = attention_with_lse_backward(
            *tensors, bias, grad_out, out, lse, scale=None, enable_gqa=True
        )
        results.append((out, lse, *grads[:3]))
    for label, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(got, want), f"{label}: a key outside the span reached it"
    out, lse, _, dk, dv = results[0]
    assert (outside_span(name, dk) == 0).all() and (outside_span(name, dv) == 0).all()
    expected = attention(*(t.double() for t in clean), bias, enable_gqa=True)
    low = attention(*clean, bias, enable_gqa=True, dtype=torch.float32)
    assert_close_to_oracle([out], [expected], [low], torch.float32)


def test_kept_key_span() -> None:
    cols = torch.arange(10)
    # (B, 1, 1, S): the union of the rows' ranges
    keep = ((cols >= torch.tensor([[3], [6]])) & (cols < torch.tensor([[5], [8]])))[:, None, None]
    assert kept_key_span(keep, 10) == (3, 8)
    assert kept_key_span(keep[1], 10) == (6, 8)
    # every key kept by some row, a mask broadcast over the keys, none at all: nothing to narrow
    causal = torch.ones(4, 10, dtype=torch.bool)
    assert kept_key_span(causal.tril(6), 10) is None  # lower-right: the last row keeps all
    assert kept_key_span(causal.tril(), 10) == (0, 4)  # upper-left: a band ends the keys
    assert kept_key_span(torch.ones(2, 1, 4, 1, dtype=torch.bool), 10) is None
    assert kept_key_span(None, 10) is None
    # no row keeps a key: one key is read, masked for every row
    assert kept_key_span(torch.zeros(3, 10, dtype=torch.bool), 10) == (0, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_keeps_float32_biases(route: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=generator) for _ in range(3))
    bias = torch.randn(6, 6, generator=generator) * 3 + 1000.0
    bias[0] = -1e9  # a whole row at -1e9 is uniform attention, not a masked row
    bias[1, :3] = -math.inf
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    out = sdpa(qh, kh, vh, attn_mask=TensorBias(bias))
    expected = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=bias.double()
    )
    # stock SDPA on the same call, on CPU, keeps a float32 mask in float32
    stock = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias)
    assert out.dtype == dtype
    assert_close_to_oracle([out], [expected], [stock], dtype)


def test_half_precision_mask_that_fits_runs_in_stock_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    # a 0 / -inf float mask is exact in bf16: no reason for the float32 eager path
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    calls = []
    real = attnbias.backends.stock._original_sdpa  # type: ignore[attr-defined]
    monkeypatch.setattr(
        attnbias.backends.stock,
        "_original_sdpa",
        lambda *a, **kw: calls.append(kw) or real(*a, **kw),
    )
    q = torch.randn(1, 1, 5, 8, dtype=torch.bfloat16)
    mask = torch.zeros(5, 5).masked_fill(torch.ones(5, 5).triu(1).bool(), -math.inf)
    out = sdpa(q, q, q, attn_mask=TensorBias(mask))
    assert len(calls) == 1
    expected = attention(q, q, q, causal_upper_left())
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


@st.composite
def two_document_layouts(draw: st.DrawFn) -> tuple[DocumentBias, DocumentBias, int, int, int]:
    """Two packed layouts of one batch, ids shifted anywhere in int64, ``(L,)`` or ``(B, L)``."""
    batch = draw(st.integers(1, 3))
    length_q, length_kv = draw(st.integers(1, 9)), draw(st.integers(1, 9))

    def layout() -> DocumentBias:
        rows = 1 if draw(st.booleans()) else batch
        q_ids, kv_ids = [], []
        for _ in range(rows):
            count = draw(st.integers(1, 4))
            q_cuts = sorted(
                draw(st.lists(st.integers(0, length_q), min_size=count - 1, max_size=count - 1))
            )
            kv_cuts = sorted(
                draw(st.lists(st.integers(0, length_kv), min_size=count - 1, max_size=count - 1))
            )
            q_ids.append([sum(c <= i for c in q_cuts) for i in range(length_q)])
            kv_ids.append([sum(c <= j for c in kv_cuts) for j in range(length_kv)])
        scale = draw(st.sampled_from([1, 2**40, 2**61]))
        offset = draw(st.integers(-(2**62), 2**62 - 4 * scale))
        q = torch.tensor(q_ids, dtype=torch.long) * scale + offset
        kv = torch.tensor(kv_ids, dtype=torch.long) * scale + offset
        return DocumentBias(q[0] if rows == 1 and draw(st.booleans()) else q, kv)

    return layout(), layout(), batch, length_q, length_kv


@given(case=two_document_layouts())
def test_summed_documents_never_overflow(
    case: tuple[DocumentBias, DocumentBias, int, int, int],
) -> None:
    first, second, batch, length_q, length_kv = case
    try:
        (first + second).validate_call(Call(batch, 1, length_q, length_kv))
    except ValueError:
        return  # a (B, L) layout whose rows do not match the batch: refused, as for one bias
    lowered = lower(first + second, length_q, length_kv, torch.device("cpu"))
    assert lowered.q_doc is not None and lowered.kv_doc is not None
    assert lowered.q_doc.dtype == torch.long
    for ids in (lowered.q_doc, lowered.kv_doc):
        assert (ids[:, 1:] >= ids[:, :-1]).all(), "merged ids must stay non-decreasing"
    same = lowered.q_doc[:, :, None] == lowered.kv_doc[:, None, :]
    expected = (first.materialize() == 0) & (second.materialize() == 0)  # oracle: both layouts
    assert torch.equal(
        same.expand(batch, -1, -1), expected.reshape(-1, length_q, length_kv).expand(batch, -1, -1)
    )


def test_from_seqlens_refuses_what_it_would_truncate() -> None:
    for lengths in (
        [6.5, 6.5],
        [6.0, 6.0],
        [True, 2],
        [math.nan],
        torch.tensor([2.0, 3.0]),
        np.array([1.5, 2.0]),
    ):
        with pytest.raises(TypeError, match="int lengths"):
            DocumentBias.from_seqlens(lengths)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int lengths"):
        DocumentBias.from_seqlens([2, 3], [2.5, 2.5])
    with pytest.raises(ValueError, match=r"non-negative .* got \[3, -1\]"):
        DocumentBias.from_seqlens(np.array([3, -1]))
    with pytest.raises(TypeError, match="list or 1-D tensor"):
        DocumentBias.from_seqlens(["two", "three"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"non-empty 1-D .* shape \(0,\)"):
        DocumentBias.from_seqlens([])
    assert torch.equal(
        DocumentBias.from_seqlens(np.array([2, 1])).q_doc_ids, torch.tensor([0, 0, 1])
    )
    assert torch.equal(
        DocumentBias.from_seqlens(torch.tensor([1, 2], dtype=torch.int32)).q_doc_ids,
        torch.tensor([0, 1, 1]),
    )


def test_bias_parameters_are_checked() -> None:
    for slopes in (torch.tensor([0.5, math.nan]), torch.tensor([[math.inf, 0.5]])):
        with pytest.raises(ValueError, match=r"slopes must be finite, got (nan|inf) at index"):
            AlibiBias(slopes=slopes)
    with pytest.raises(
        TypeError, match=r"real floating point tensor, got dtype=torch.int64; .*\.float\(\)"
    ):
        AlibiBias(slopes=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="dtype=torch.complex64"):
        AlibiBias(slopes=torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"\(Hq,\) or \(B, Hq\) with Hq > 0, got shape \(0,\)"):
        AlibiBias(slopes=torch.ones(0))
    with pytest.raises(ValueError, match="meta"):
        AlibiBias(slopes=torch.ones(2, device="meta"))
    for heads in (True, 2.0):
        with pytest.raises(TypeError, match="num_heads must be a positive int"):
            AlibiBias(num_heads=heads)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="positive float, got True"):
        SoftcapBias(True)
    for cap in (math.nan, math.inf, 0.0, -2.0):
        with pytest.raises(ValueError, match="cap must be finite and > 0"):
            SoftcapBias(cap)
    assert SoftcapBias(np.float32(2.5)).cap == 2.5  # type: ignore[arg-type]
    for window in (True, 2.5, "3"):
        with pytest.raises(TypeError, match="window_left must be an int or None"):
            SlidingWindowBias(window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_right must be >= 0"):
        SlidingWindowBias(2, -1)
    assert SlidingWindowBias(np.int64(3)).window_left == 3  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seq_len_q must be a positive int or None, got True"):
        CausalBias(seq_len_q=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta tensor of shape"):
        TensorBias(torch.zeros(4, 4, device="meta"))


def test_tensor_bias_of_any_rank_that_broadcasts(route: str) -> None:
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    for bias in (
        torch.randn(5, dtype=torch.float64),
        torch.tensor(0.5, dtype=torch.float64),
        torch.randn(2, 1, 1, 5, dtype=torch.float64),
    ):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.expand(2, 2, 5, 5))
        torch.testing.assert_close(sdpa(q, k, v, attn_mask=TensorBias(bias)), expected)
    with pytest.raises(ValueError, match=r"shape \(6,\) does not broadcast .*\(2, 2, 5, 5\)"):
        sdpa(q, k, v, attn_mask=TensorBias(torch.zeros(6)))


def test_tensor_bias_and_slopes_get_their_gradients(route: str) -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    table = torch.randn(5, 5, generator=generator, dtype=torch.float64)
    table[0, 3] = -math.inf
    slopes = torch.rand(2, 3, generator=generator, dtype=torch.float64)

    def grads(make_bias, attend):  # type: ignore[no-untyped-def]
        leaf_table = table.clone().requires_grad_(True)
        leaf_slopes = slopes.clone().requires_grad_(True)
        out = attend(make_bias(leaf_table, leaf_slopes))
        dt, ds = torch.autograd.grad(out.sum(), [leaf_table, leaf_slopes], allow_unused=True)
        return out, dt, ds

    def ours_bias(t, s):  # type: ignore[no-untyped-def]
        return TensorBias(t) + AlibiBias(slopes=s) + causal_lower_right()

    out, d_table, d_slopes = grads(ours_bias, lambda b: sdpa(q, k, v, attn_mask=b))
    expected, e_table, e_slopes = grads(
        ours_bias,
        lambda b: F.scaled_dot_product_attention(
            q, k, v, attn_mask=b.materialize(shape=(2, 3, 5, 5), dtype=torch.float64)
        ),
    )
    assert d_table is not None and d_slopes is not None, "a parameter that requires grad got None"
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(d_table, e_table)
    torch.testing.assert_close(d_slopes, e_slopes)


class Returns(AttnBias):
    """A user bias whose ``materialize`` returns whatever it was given."""

    def __init__(self, result: object) -> None:
        self.result = result

    def materialize(self, device=None, *, shape=None, dtype=None):  # type: ignore[no-untyped-def]
        return self.result

    def needs_materialization(self) -> bool:
        return True


class Dispatches(AttnBias):
    """A user bias whose ``dispatch`` returns ``attn_bias.result``."""

    def __init__(self, result: object) -> None:
        self.result = result

    def needs_materialization(self) -> bool:
        return False

    @staticmethod
    def dispatch(query, key, value, attn_bias, causal, scale, dropout_p, enable_gqa=False):  # type: ignore[no-untyped-def]
        return attn_bias.result


WRONG_RESULTS = [
    (
        None,
        TypeError,
        r"Returns.materialize returned NoneType, not a tensor; return a bool keep-mask",
    ),
    ([[0.0]], TypeError, "returned list, not a tensor"),
    (torch.zeros(4, 4, dtype=torch.long), TypeError, r"dtype=torch.int64; .*\.bool\(\)"),
    (torch.zeros(4, 4, dtype=torch.complex64), TypeError, "dtype=torch.complex64"),
    (
        torch.zeros(3, 4),
        ValueError,
        r"shape \(3, 4\), which does not broadcast to \(B, H, L, S\)=\(1, 2, 4, 4\)",
    ),
    (torch.zeros(4, 4, device="meta"), ValueError, "on meta but the inputs are on cpu"),
    (
        torch.zeros(4, 4).index_fill(1, torch.tensor([2]), math.nan),
        ValueError,
        r"returned nan at index \(0, 2\) \(4 NaN or \+inf",
    ),
    (
        torch.zeros(4, 4).index_fill(0, torch.tensor([1]), math.inf),
        ValueError,
        r"returned inf at index \(1, 0\)",
    ),
]


@pytest.mark.parametrize(("result", "error", "message"), WRONG_RESULTS)
def test_user_materialize_returning_wrong_things(
    route: str, result: object, error: type, message: str
) -> None:
    q = torch.randn(1, 2, 4, 8)
    biases = [Returns(result), Returns(result) + causal_upper_left()]
    if route != "sdpa+mask":  # stock SDPA has no soft-cap
        biases.append(Returns(result) + SoftcapBias(2.0))
    for bias in biases:
        with pytest.raises(error, match=message):
            sdpa(q, q, q, attn_mask=bias)
    with pytest.raises(error, match=message):
        (Returns(result) + causal_upper_left()).materialize(shape=(1, 2, 4, 4))


def test_user_bool_keep_mask_is_a_mask_everywhere(route: str) -> None:
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.4
    additive = torch.zeros(5, 5, dtype=torch.float64).masked_fill(~keep, -math.inf)
    window = SlidingWindowBias(2)
    both = additive + window.materialize(shape=(5, 5), dtype=torch.float64)
    cases = [
        (Returns(keep), additive, None),
        (Returns(keep) + window, both, None),
        (
            Returns(keep) + AlibiBias(num_heads=2),
            additive + AlibiBias(num_heads=2).materialize(shape=(1, 2, 5, 5), dtype=torch.float64),
            None,
        ),
        (Returns(keep) + window + SoftcapBias(2.0), both, 2.0),
    ]
    for bias, mask, cap in cases:
        if cap is not None and route == "sdpa+mask":
            continue
        expected = attention(
            q, k, v, TensorBias(mask) + SoftcapBias(cap) if cap else TensorBias(mask)
        )
        torch.testing.assert_close(sdpa(q, k, v, attn_mask=bias), expected)
    torch.testing.assert_close(
        (Returns(keep) + window).materialize(shape=(1, 2, 5, 5), dtype=torch.float64), both
    )


@pytest.mark.parametrize(
    ("result", "error", "message"),
    [
        (None, TypeError, r"Dispatches.dispatch returned NoneType, not a tensor; .*\(1, 2, 4, 8\)"),
        (torch.zeros(1, 2, 4, 7), ValueError, r"returned shape \(1, 2, 4, 7\); .*\(1, 2, 4, 8\)"),
        (
            torch.zeros(1, 2, 4, 8, dtype=torch.float64),
            TypeError,
            "dtype=torch.float64 on cpu; .*dtype=torch.float32",
        ),
        (
            torch.zeros(1, 2, 4, 8, device="meta"),
            TypeError,
            "on meta; the output must match the query",
        ),
    ],
)
def test_user_dispatch_returning_wrong_things(result: object, error: type, message: str) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(error, match=message):
        sdpa(q, q, q, attn_mask=Dispatches(result))

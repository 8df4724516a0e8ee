"""``attnbias.sdpa`` against the fp64 oracle: every bias, random sums, every route."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from in_turn import in_turn

import attnbias
from attnbias import (
    AlibiBias,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    sdpa,
)
from attnbias.backends import triton as triton_backend
from attnbias.testing.oracle import (
    assert_call_close,
    assert_close_to_oracle,
    attention,
    flash_rounding,
    run_with_grads,
)
from attnbias.testing.strategies import Problem, problems

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=["default", "fallback"])
def route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``default``: the route sdpa picks (the Triton kernel, interpreted on CPU in CI).
    ``fallback``: with the kernel unavailable, the materialized / eager routes."""
    if request.param == "fallback":
        monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
        if DEVICE == "cuda":
            pytest.skip("the fallback routes are exercised on CPU")
    return str(request.param)


def check_problem(problem: Problem, seed: int) -> None:
    q, k, v, grad_out = (x.to(DEVICE) for x in problem.tensors(seed))
    kwargs = dict(
        scale=problem.scale,
        is_causal=problem.is_causal,
        enable_gqa=problem.heads_q != problem.heads_kv,
    )

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, attn_mask=problem.bias, **kwargs)

    def oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, problem.bias, **kwargs)

    def stock_low(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(q, k, v, problem.bias, dtype=problem.dtype, **kwargs)

    results = run_with_grads(ours, (q, k, v), grad_out)
    expected = run_with_grads(oracle, (q.double(), k.double(), v.double()), grad_out.double())
    low = run_with_grads(stock_low, (q, k, v), grad_out)
    assert results[0].dtype == problem.dtype
    assert results[0].shape == (problem.batch, problem.heads_q, problem.length_q, problem.head_dim)
    assert_close_to_oracle(results, expected, low, problem.dtype, ("out", "dq", "dk", "dv"))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems(), seed=st.integers(0, 2**16))
def test_matches_oracle(route: str, problem: Problem, seed: int) -> None:
    check_problem(problem, seed)


BIASES = {
    "causal_upper_left": causal_upper_left(),
    "causal_lower_right": causal_lower_right(),
    "window": SlidingWindowBias(5),
    "window_two_sided": SlidingWindowBias(3, 4),
    "window_left_unbounded": SlidingWindowBias(None, 2),
    "documents": DocumentBias.from_seqlens([7, 1, 12, 10], [9, 3, 10, 8]),
    "alibi": AlibiBias(num_heads=4),
    "alibi_batched_slopes": AlibiBias(slopes=torch.tensor([[0.5, 0.25, 0.1, 0.9]] * 2)),
    "softcap": SoftcapBias(1.5),
    "gemma2": causal_lower_right() + SlidingWindowBias(7) + SoftcapBias(2.0),
    "alibi_causal": AlibiBias(num_heads=4) + causal_lower_right(),
    "docs_causal_alibi_softcap": DocumentBias.from_seqlens([7, 1, 12, 10], [9, 3, 10, 8])
    + causal_lower_right()
    + AlibiBias(num_heads=4)
    + SoftcapBias(3.0),
    "tensor": TensorBias(torch.randn(30, 30)),
    "tensor_softcap": TensorBias(torch.randn(4, 30, 30)) + SoftcapBias(2.0),
}


def _each_bias_runs() -> list[Any]:
    """Every bias in every dtype on both routes, except the interpreted kernel on the CPU
    (~4 s a case): there one dtype per bias, in turn (each dtype still runs, over a third of
    the biases); the GPU runs every pair."""
    dtypes = ((torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16"))
    return [
        pytest.param(route, name, dtype, id=f"{route}-{name}-{label}")
        for route in ("default", "fallback")
        for name, dtype, label in in_turn(BIASES, dtypes, route == "default" and DEVICE == "cpu")
    ]


@pytest.mark.parametrize(("route", "name", "dtype"), _each_bias_runs(), indirect=["route"])
def test_each_bias(route: str, name: str, dtype: torch.dtype) -> None:
    bias = BIASES[name]
    problem = Problem(2, 4, 2, 30, 30, 16, dtype, bias, False, None)
    check_problem(problem, seed=0)


@pytest.mark.parametrize(("length_q", "length_kv"), [(9, 30), (30, 9), (1, 17)])
@pytest.mark.parametrize(
    "name", ["causal_lower_right", "window", "alibi", "softcap", "gemma2", "documents"]
)
def test_unequal_lengths(route: str, name: str, length_q: int, length_kv: int) -> None:
    bias = BIASES[name]
    if name == "documents":
        bias = DocumentBias.from_seqlens([length_q], [length_kv])
    problem = Problem(1, 4, 4, length_q, length_kv, 16, torch.float32, bias, False, None)
    check_problem(problem, seed=1)


def test_is_causal_adds_upper_left(route: str) -> None:
    bias = SlidingWindowBias(None, 3)
    problem = Problem(1, 2, 2, 12, 20, 16, torch.float32, bias, True, None)
    check_problem(problem, seed=2)
    # is_causal=True with a bias means bias + CausalBias(UPPER_LEFT): compare the two spellings
    q, k, v, _ = problem.tensors(3)
    a = sdpa(q, k, v, attn_mask=bias, is_causal=True)
    b = sdpa(q, k, v, attn_mask=bias + causal_upper_left())
    torch.testing.assert_close(a, b, rtol=0, atol=0)


FULLY_MASKED = {
    # rows i < L - S see no key
    "lower_right": (causal_lower_right(), 12, 5),
    # window (0, 0) keeps j = i + (S - L) only, and causal lower-right then drops rows with j < 0
    "empty_band": (SlidingWindowBias(0, 0) + causal_upper_left(), 12, 5),
    # the queries of document 1 find no key of document 1, which has none
    "documents": (DocumentBias.from_seqlens([4, 4, 4], [6, 0, 6]), 12, 12),
}


@pytest.mark.parametrize("name", list(FULLY_MASKED))
def test_fully_masked_rows_are_zero_with_zero_grads(route: str, name: str) -> None:
    bias, length_q, length_kv = FULLY_MASKED[name]
    q = torch.randn(1, 2, length_q, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 2, length_kv, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 2, length_kv, 16, device=DEVICE, requires_grad=True)
    masked = bias.materialize(DEVICE, shape=(1, 2, length_q, length_kv)).isinf().all(-1)
    masked = masked.expand(1, 2, length_q)
    assert masked.any(), "the case must contain a fully masked row"

    out = sdpa(q, k, v, attn_mask=bias)
    out.backward(torch.randn_like(out))
    assert (out.detach()[masked] == 0).all()
    for tensor in (q, k, v):
        assert tensor.grad is not None and torch.isfinite(tensor.grad).all()
    assert q.grad is not None and (q.grad[masked] == 0).all()
    expected = attention(q.detach(), k.detach(), v.detach(), bias)
    torch.testing.assert_close(out.detach().double(), expected, atol=1e-5, rtol=1e-5)


def test_tensor_bias_gets_its_gradient() -> None:
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    table = torch.randn(2, 6, 6, dtype=torch.float64, requires_grad=True)
    out = sdpa(q, k, v, attn_mask=TensorBias(table))
    grad_out = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, table, grad_out)
    leaf = table.detach().clone().requires_grad_(True)
    expected_out = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5 + leaf, -1) @ v
    (expected,) = torch.autograd.grad(expected_out, leaf, grad_out)
    torch.testing.assert_close(grad, expected)


def test_plain_tensor_mask_warns_and_matches_stock() -> None:
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    mask = torch.randn(6, 6)
    with pytest.warns(UserWarning, match="TensorBias"):
        out = sdpa(q, k, v, attn_mask=mask)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_no_mask_and_is_causal_match_stock() -> None:
    q, k, v = (torch.randn(2, 2, 7, 8) for _ in range(3))
    for causal in (False, True):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(sdpa(q, k, v, is_causal=causal), expected, rtol=0, atol=0)


def test_dropout(route: str) -> None:
    q, k, v = (torch.randn(1, 2, 16, 8, device=DEVICE) for _ in range(3))
    for bias in (SoftcapBias(2.0) + causal_lower_right(), SlidingWindowBias(3)):
        torch.manual_seed(0)
        first = sdpa(q, k, v, attn_mask=bias, dropout_p=0.5)
        torch.manual_seed(0)
        again = sdpa(q, k, v, attn_mask=bias, dropout_p=0.5)
        plain = sdpa(q, k, v, attn_mask=bias)
        assert "dropout" in attnbias.explain(q, k, v, attn_mask=bias, dropout_p=0.5) or (
            DEVICE == "cpu"
        )
        torch.testing.assert_close(first, again)
        assert not torch.allclose(first, plain)
        # inverted dropout keeps the expectation: average many draws
        mean = torch.stack([sdpa(q, k, v, attn_mask=bias, dropout_p=0.5) for _ in range(400)]).mean(
            0
        )
        torch.testing.assert_close(mean, plain, atol=0.35, rtol=0)


# --------------------------------------------------------------------------------------------
# Documents of equal length on stock SDPA, as a batch of separate sequences


def _projected(batch: int, heads: int, length: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``(B, H, L, E)`` laid out ``(B, L, H, E)`` in memory, as a projection leaves it."""
    return torch.randn(batch, length, heads, dim, device=DEVICE).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("batch", "heads_kv", "layout", "view"),
    [
        (1, 2, "contiguous", "(B·4, H, 4, E)"),  # one row: always a batch of its documents
        (2, 2, "projected", "(B·4, H, 4, E)"),  # (B, L, H, E) in memory, grouped heads
        (2, 4, "contiguous", "(B, H·4, 4, E)"),  # (B, H, L, E) in memory: the heads take them
    ],
)
def test_equal_documents_run_as_separate_sequences(
    monkeypatch: pytest.MonkeyPatch,
    causal: bool,
    batch: int,
    heads_kv: int,
    layout: str,
    view: str,
) -> None:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    documents = DocumentBias.from_seqlens([4, 4, 4, 4])
    bias = documents + causal_upper_left() if causal else documents
    torch.manual_seed(0)
    if layout == "projected":
        q = _projected(batch, 4, 16, 8, dtype)
        k, v = (_projected(batch, heads_kv, 16, 8, dtype) for _ in range(2))
    else:
        q = torch.randn(batch, 4, 16, 8, device=DEVICE).to(dtype)
        k, v = (torch.randn(batch, heads_kv, 16, 8, device=DEVICE).to(dtype) for _ in range(2))
    grouped = heads_kv != 4
    with attnbias.use_backends("sdpa"):
        text = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=grouped)
    assert text.startswith("sdpa(documents as sequences)") and view in text, text
    assert ("is_causal=True" in text.splitlines()[0]) == causal
    # stock SDPA sees the documents as sequences of 4, views of the inputs (no copy)
    seen = []
    stock = attnbias.backends.stock._original_sdpa

    def spy(query: torch.Tensor, key: torch.Tensor, *args: object, **kwargs: object) -> object:
        seen.append((query.shape, query.untyped_storage().data_ptr(), kwargs["is_causal"]))
        return stock(query, key, *args, **kwargs)

    monkeypatch.setattr(attnbias.backends.stock, "_original_sdpa", spy)
    with attnbias.use_backends("sdpa"):
        sdpa(q, k, v, attn_mask=bias, enable_gqa=grouped)
        shape, storage, is_causal = seen.pop()
        assert shape[-2:] == (4, 8) and shape[0] * shape[1] == batch * 4 * 4, shape
        assert storage == q.untyped_storage().data_ptr() and is_causal == causal
        assert_call_close(
            lambda *t: sdpa(*t, attn_mask=bias, enable_gqa=grouped),
            bias,
            (q, k, v),
            torch.randn_like(q),
            enable_gqa=grouped,
        )
    assert len(seen) == 1  # the call against the oracle took the same route


@given(
    batch=st.integers(1, 3),
    heads_kv=st.integers(1, 2),
    group=st.integers(1, 2),
    count=st.integers(1, 4),
    length=st.integers(1, 6),
    head_dim=st.sampled_from([8, 16]),
    causal=st.booleans(),
    projected=st.booleans(),
    scale=st.sampled_from([None, 0.3, -1.0]),
    seed=st.integers(0, 2**16),
)
def test_equal_documents_of_any_shape(
    batch: int,
    heads_kv: int,
    group: int,
    count: int,
    length: int,
    head_dim: int,
    causal: bool,
    projected: bool,
    scale: float | None,
    seed: int,
) -> None:
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    documents = DocumentBias.from_seqlens([length] * count)
    bias = documents + causal_upper_left() if causal else documents
    heads_q, total = heads_kv * group, length * count
    torch.manual_seed(seed)

    def draw(heads: int) -> torch.Tensor:
        if projected:
            return _projected(batch, heads, total, head_dim, dtype)
        return torch.randn(batch, heads, total, head_dim, device=DEVICE).to(dtype)

    q, k, v = draw(heads_q), draw(heads_kv), draw(heads_kv)
    grouped = group > 1
    text = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=grouped, scale=scale)
    viewable = batch == 1 or count == 1 or projected or not grouped
    # stock SDPA masks causal scores before scaling them: a scale <= 0 goes elsewhere
    masks_inside = causal and length > 1
    takes = viewable and not (masks_inside and scale is not None and scale <= 0)
    assert text.startswith("sdpa(documents as sequences)") == takes, text
    grad_out = torch.randn_like(q)
    assert_call_close(
        lambda *t: sdpa(*t, attn_mask=bias, enable_gqa=grouped, scale=scale),
        bias,
        (q, k, v),
        grad_out,
        enable_gqa=grouped,
        scale=scale,
        # every route here but the exact ones is a flash kernel (stock SDPA's, the Triton
        # kernel): their own rounding (with one key per row, dq's exact 0 comes out of a
        # difference of rounded terms)
        rounding=flash_rounding(q, k, v, bias, grad_out, scale=scale),
    )


@pytest.mark.parametrize(
    ("bias", "length_kv", "batch", "heads_kv", "reason"),
    [
        (DocumentBias.from_seqlens([4, 12]) + causal_upper_left(), 16, 1, 2, "unequal lengths"),
        (
            DocumentBias.from_seqlens([8, 8]) + causal_upper_left() + SlidingWindowBias(2),
            16,
            1,
            2,
            "the band -2 <= j - i <= 0 inside documents of 8 is neither none nor causal",
        ),
        (DocumentBias.from_seqlens([8, 8], [4, 4]), 8, 1, 2, "L = 16 != S = 8"),
        (DocumentBias.from_seqlens([8, 8]), 16, 2, 1, "do not view as a batch"),
        (
            DocumentBias.from_seqlens([8, 8]) + DocumentBias.from_seqlens([4, 12]),
            16,
            1,
            2,
            "more than one DocumentBias",
        ),
    ],
)
def test_documents_stock_sdpa_does_not_take(
    bias: attnbias.AttnBias, length_kv: int, batch: int, heads_kv: int, reason: str
) -> None:
    q = torch.randn(batch, 2, 16, 8, device=DEVICE)
    k, v = (torch.randn(batch, heads_kv, length_kv, 8, device=DEVICE) for _ in range(2))
    grouped = heads_kv != 2
    text = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=grouped)
    assert not text.startswith("sdpa(documents"), text
    assert reason in text, text
    expected = attention(q.double(), k.double(), v.double(), bias, enable_gqa=grouped)
    got = sdpa(q, k, v, attn_mask=bias, enable_gqa=grouped)
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_a_causal_call_with_scale_at_most_zero_leaves_stock_sdpa(scale: float) -> None:
    # stock SDPA's causal kernels mask the scores before scaling them (torch 2.13 on CPU: NaN
    # rows at scale <= 0); the call takes another route and keeps the contract
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 8, device=DEVICE) for _ in range(3))
    for bias in (causal_upper_left(), DocumentBias.from_seqlens([4, 4]) + causal_upper_left()):
        text = attnbias.explain(q, k, v, attn_mask=bias, scale=scale)
        assert not text.startswith("sdpa("), text
        assert f"scale {scale} <= 0 with is_causal=True" in text, text
        got = sdpa(q, k, v, attn_mask=bias, scale=scale)
        expected = attention(q.double(), k.double(), v.double(), bias, scale=scale)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_equal_documents_on_stock_sdpa_never_read_other_documents() -> None:
    # NaN keys and values in the first document reach no row of the second (which, causal
    # over the whole row, would attend them), forward or backward: separate sequences
    torch.manual_seed(0)
    bias = DocumentBias.from_seqlens([4, 4]) + causal_upper_left()
    q, k, v = (torch.randn(1, 2, 8, 8, device=DEVICE) for _ in range(3))
    k[:, :, :4], v[:, :, :4] = float("nan"), float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with attnbias.use_backends("sdpa"):
        assert attnbias.explain(*leaves, attn_mask=bias).startswith("sdpa(documents")
        out = sdpa(*leaves, attn_mask=bias)
    grad_out = torch.zeros_like(out)
    grad_out[:, :, 4:] = 1.0  # the second document's rows only
    grads = torch.autograd.grad(out, leaves, grad_out)
    second = [x[:, :, 4:] for x in (q, k, v)]
    expected = attention(*(x.double() for x in second), causal_upper_left())
    torch.testing.assert_close(out[:, :, 4:].double(), expected, atol=1e-5, rtol=1e-5)
    assert all(torch.isfinite(g[:, :, 4:]).all() for g in grads)


# -- calls without a bias object: scales that are not positive, pins ----------------------------


def _causal_oracle(q: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 stock PyTorch on the materialized causal mask (and ``mask``, added)."""
    length = q.shape[2]
    bias = causal_upper_left().materialize(shape=(1, 1, length, length), dtype=torch.float64)
    if mask is not None:
        bias = bias + mask.double()
    wide = q.double()
    return torch.nn.functional.scaled_dot_product_attention(
        wide, wide, wide, attn_mask=bias, scale=scale
    )


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_is_causal_with_a_scale_that_is_not_positive_is_exact_on_cpu(scale: float) -> None:
    """Stock SDPA's CPU kernel gives NaN for ``is_causal`` with such a scale: the call is
    planned as a causal bias instead, and explain says so."""
    q = torch.randn(1, 2, 8, 16)
    out = attnbias.sdpa(q, q, q, is_causal=True, scale=scale)
    assert torch.isfinite(out).all()
    assert (out.double() - _causal_oracle(q, scale)).abs().max() < 1e-5
    assert "band -inf <= j - i <= 0" in attnbias.explain(q, q, q, is_causal=True, scale=scale)


@pytest.mark.filterwarnings("ignore:attnbias.sdpa got a plain Tensor")
@pytest.mark.parametrize("pin", ["reference", "triton"])
def test_a_pin_applies_to_calls_without_a_bias_object(pin: str) -> None:
    """``use_backends`` pins calls with no mask and with a plain tensor mask too (they run
    there, right, or raise with its reasons); outside the pin they go to stock SDPA."""
    q = torch.randn(1, 2, 16, 16)
    mask = torch.randn(16, 16)
    with attnbias.use_backends(pin):
        for attn_mask, causal in ((None, False), (None, True), (mask, False)):
            if pin == "triton" and attn_mask is not None:  # the kernel takes no tensor
                with pytest.raises(ValueError, match="triton: TensorBias has no kernel form"):
                    attnbias.sdpa(q, q, q, attn_mask=attn_mask)
                continue
            said = attnbias.explain(q, q, q, attn_mask=attn_mask, is_causal=causal)
            assert said.startswith(f"{pin}:"), said
            out = attnbias.sdpa(q, q, q, attn_mask=attn_mask, is_causal=causal)
            wide = q.double()
            if causal:
                expected = _causal_oracle(q, q.shape[-1] ** -0.5)
            else:
                extra = None if attn_mask is None else attn_mask.double()
                expected = torch.nn.functional.scaled_dot_product_attention(
                    wide, wide, wide, attn_mask=extra
                )
            assert (out.double() - expected).abs().max() < 1e-5, (pin, attn_mask, causal)
    with attnbias.use_backends(exclude=["sdpa"]):
        assert not attnbias.explain(q, q, q).startswith("sdpa:")
    assert attnbias.explain(q, q, q).startswith("sdpa: no mask")

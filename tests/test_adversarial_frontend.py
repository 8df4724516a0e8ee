"""The entry points under bad and unusual input: flags, numbers, empty dimensions, devices,
dtypes, and ``patch_sdpa`` in every order, from threads, with calls that need nothing of it.

Each test asserts the contract: stock SDPA's result (the fp64 oracle for bias objects), or a
``TypeError`` / ``ValueError`` whose message names the offending value.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    patch_sdpa,
    sdpa,
)
from attnbias.biases import parts_of
from attnbias.testing.oracle import assert_close_to_oracle, attention, run_with_grads
from attnbias.testing.strategies import document_bias

# The unpatched function, taken before any test patches it.
STOCK = F.scaled_dot_product_attention
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qkv(
    batch: int = 1,
    heads_q: int = 2,
    heads_kv: int = 2,
    length_q: int = 5,
    length_kv: int = 5,
    head_dim: int = 8,
    head_dim_v: int | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    options.setdefault("device", DEVICE)
    return (
        torch.randn(batch, heads_q, length_q, head_dim, **options),
        torch.randn(batch, heads_kv, length_kv, head_dim, **options),
        torch.randn(batch, heads_kv, length_kv, head_dim_v, **options),
    )


@st.composite
def bias_sums(
    draw: st.DrawFn, batch: int, heads_q: int, length_q: int, length_kv: int
) -> AttnBias | None:
    """A sum of up to three built-in biases that fits a ``(B, Hq, L, S)`` call (any of them 0)."""
    kinds = ["causal", "window", "softcap", "tensor"]
    if heads_q > 0:
        kinds.append("alibi")
    if length_q > 0 and length_kv > 0:
        kinds.append("docs")
    parts: list[AttnBias] = []
    for kind in draw(st.lists(st.sampled_from(kinds), max_size=3, unique=True)):
        if kind == "causal":
            parts.append(CausalBias(draw(st.sampled_from(list(CausalVariant)))))
        elif kind == "window":
            sides = st.one_of(st.none(), st.integers(0, 6))
            parts.append(SlidingWindowBias(draw(sides), draw(sides)))
        elif kind == "softcap":
            parts.append(SoftcapBias(draw(st.sampled_from([0.5, 3.0]))))
        elif kind == "tensor":
            parts.append(TensorBias(torch.randn(length_q, length_kv)))
        elif kind == "alibi":
            parts.append(AlibiBias(num_heads=heads_q))
        else:
            parts.append(draw(document_bias(max(batch, 1), length_q, length_kv)))
    bias: AttnBias | None = None
    for part in parts:
        bias = part if bias is None else bias + part
    return bias


# --------------------------------------------------------------------------------------------
# Flags of the wrong type


def not_bools() -> st.SearchStrategy[Any]:
    """Values stock SDPA refuses for is_causal / enable_gqa, truthy and falsy alike."""
    return st.one_of(
        st.text(max_size=4),
        st.integers(),
        st.floats(allow_nan=True),
        st.none(),
        st.sampled_from(
            [np.bool_(True), np.bool_(False), np.int64(1), torch.tensor(True), [True], (False,)]
        ),
    )


@given(flag=st.sampled_from(["is_causal", "enable_gqa"]), value=not_bools(), biased=st.booleans())
def test_flags_must_be_bools_as_stock_requires(flag: str, value: Any, biased: bool) -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError):
        STOCK(q, k, v, **{flag: value})
    bias = SlidingWindowBias(2) if biased else None
    for entry in (sdpa, attnbias.explain):
        with pytest.raises(TypeError) as caught:
            entry(q, k, v, attn_mask=bias, **{flag: value})
        message = str(caught.value)
        assert flag in message and repr(value) in message and "Python bool" in message


def test_is_causal_string_is_not_taken_as_true() -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError, match="is_causal must be True or False, got 'no' of type str"):
        sdpa(q, k, v, attn_mask=SlidingWindowBias(3), is_causal="no")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# dropout_p and scale: the numbers stock SDPA takes


def typed_numbers(value: float) -> st.SearchStrategy[Any]:
    """``value`` spelled as each number type stock SDPA accepts."""
    spellings: list[Any] = [value, np.float64(value), np.float32(value), torch.tensor(value)]
    if float(value).is_integer():
        spellings += [int(value), np.int64(int(value)), torch.tensor(int(value))]
    return st.sampled_from(spellings)


@st.composite
def scales(draw: st.DrawFn) -> tuple[Any, float]:
    """``(spelling, value)``: a finite scale, zero and negative included, in any number type."""
    value = draw(st.sampled_from([0.0, -1.0, 2.0, -0.25, 0.7]))
    return draw(typed_numbers(value)), value


ROUTES = ("default", "sdpa+mask", "reference")


@contextlib.contextmanager
def route(name: str) -> Iterator[None]:
    if name == "default":
        yield
    else:
        with attnbias.use_backends(name):
            yield


@given(scale=scales(), bias=bias_sums(1, 2, 5, 7), name=st.sampled_from(ROUTES))
def test_any_finite_scale_in_any_number_type(
    scale: tuple[Any, float], bias: AttnBias | None, name: str
) -> None:
    spelling, value = scale
    q, k, v = qkv(length_kv=7)
    if name == "sdpa+mask" and any(isinstance(p, SoftcapBias) for p in parts_of(bias)):
        name = "reference"  # soft-cap has no materialized form
    if name == "default" and value <= 0:
        # The default route here is the Triton kernel, whose scale <= 0 is checked with the
        # kernels; this test is about the entry point taking every spelling.
        name = "reference"
    with route(name):
        out = sdpa(q, k, v, attn_mask=bias, scale=spelling)
    expected = attention(q, k, v, bias, scale=value)
    low = attention(q, k, v, bias, scale=value, dtype=torch.float32)
    assert_close_to_oracle([out], [expected], [low], torch.float32)


@given(
    value=st.one_of(
        st.sampled_from([math.nan, math.inf, -math.inf]),
        st.sampled_from([math.inf, math.nan]).map(torch.tensor),
    )
)
def test_non_finite_scale_is_refused(value: Any) -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"scale must be a finite real number") as caught:
        sdpa(q, k, v, attn_mask=SlidingWindowBias(2), scale=value)
    assert str(float(value)) in str(caught.value)


@given(
    name=st.sampled_from(["scale", "dropout_p"]),
    value=st.sampled_from(
        [
            "0.5",
            [0.5],
            torch.tensor([0.5]),
            torch.tensor(0.5 + 0j),
            torch.tensor(0.5, device="meta"),
            torch.tensor(0.5, requires_grad=True),
            1j,
        ]
    ),
)
def test_numbers_of_the_wrong_type(name: str, value: Any) -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError) as caught:
        sdpa(q, k, v, attn_mask=SlidingWindowBias(2), **{name: value})
    message = str(caught.value)
    assert name in message
    if isinstance(value, torch.Tensor):
        assert str(tuple(value.shape)) in message or "requires grad" in message
    else:
        assert repr(value) in message


@given(
    value=st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0 + 1e-9), st.just(math.nan))
)
def test_dropout_out_of_range_is_refused(value: float) -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]") as caught:
        sdpa(q, k, v, attn_mask=causal_lower_right(), dropout_p=value)
    assert repr(value) in str(caught.value)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="stock SDPA's CUDA kernels give NaN for dropout_p=1.0 (a 1 / (1 - p) scale), so there "
    "is no zero result to match",
)
@given(spelling=typed_numbers(1.0), bias=bias_sums(1, 2, 5, 5))
def test_dropout_one_drops_everything_like_stock(spelling: Any, bias: AttnBias | None) -> None:
    q, k, v = qkv()
    expected = STOCK(q, k, v, dropout_p=1.0)
    assert torch.equal(expected, torch.zeros_like(expected))
    if any(isinstance(p, SoftcapBias) for p in parts_of(bias)):
        out = sdpa(q, k, v, attn_mask=bias, dropout_p=spelling)
    else:
        with attnbias.use_backends("sdpa+mask", "reference"):
            out = sdpa(q, k, v, attn_mask=bias, dropout_p=spelling)
    assert torch.equal(out, expected)


# --------------------------------------------------------------------------------------------
# attn_mask, tensors, dtypes and devices of the wrong kind


@given(
    mask=st.sampled_from(
        ["causal", 1, 0.5, [[0.0]], np.zeros((5, 5)), CausalBias, SlidingWindowBias, object()]
    )
)
def test_attn_mask_of_the_wrong_type(mask: Any) -> None:
    q, k, v = qkv()
    with pytest.raises(TypeError, match="attn_mask must be an AttnBias, a Tensor or None") as c:
        sdpa(q, k, v, attn_mask=mask)
    assert type(mask).__name__ in str(c.value)
    if isinstance(mask, type):
        assert f"{mask.__name__}(...), not the class" in str(c.value)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8]
)
def test_non_floating_inputs_are_refused(dtype: torch.dtype) -> None:
    q, k, v = (t.to(dtype) for t in qkv())
    with pytest.raises(TypeError, match=f"floating point tensor, got dtype={dtype}"):
        sdpa(q, k, v, attn_mask=causal_lower_right())
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"share a dtype, got torch.float32, {dtype}"):
        sdpa(q, k.to(dtype), v, attn_mask=causal_lower_right())


@given(which=st.sampled_from(["key", "value", "query"]))
def test_tensors_on_different_devices(which: str) -> None:
    tensors = dict(zip(("query", "key", "value"), qkv(), strict=True))
    tensors[which] = tensors[which].to("meta")
    with pytest.raises(ValueError, match="must be on one device") as caught:
        sdpa(**tensors, attn_mask=SlidingWindowBias(2))
    assert "meta" in str(caught.value) and DEVICE in str(caught.value)


@given(bias=bias_sums(2, 2, 5, 7), is_causal=st.booleans(), head_dim_v=st.sampled_from([8, 3]))
def test_meta_tensors_give_a_meta_result_like_stock(
    bias: AttnBias | None, is_causal: bool, head_dim_v: int
) -> None:
    q, k, v = qkv(batch=2, length_kv=7, head_dim_v=head_dim_v, device="meta")
    expected = STOCK(q, k, v, is_causal=is_causal)
    assert expected.device.type == "meta"
    out = sdpa(q, k, v, attn_mask=bias, is_causal=is_causal)
    assert out.device.type == "meta" and out.shape == expected.shape and out.dtype == q.dtype
    assert attnbias.explain(q, k, v, attn_mask=bias, is_causal=is_causal)


def test_meta_tensors_on_the_kernel_route_are_refused_by_name() -> None:
    q, k, v = qkv(device="meta")
    with (
        attnbias.use_backends("triton"),
        pytest.raises(ValueError, match="needs CUDA tensors and these are on meta"),
    ):
        sdpa(q, k, v, attn_mask=SlidingWindowBias(2))


# --------------------------------------------------------------------------------------------
# Empty dimensions


@st.composite
def empty_calls(draw: st.DrawFn) -> dict[str, Any]:
    """A call with at least one of B, Hq (with Hkv), L, S, E equal to 0, and a bias for it."""
    sizes = {
        "batch": draw(st.integers(1, 2)),
        "heads": draw(st.integers(1, 2)),
        "length_q": draw(st.integers(1, 6)),
        "length_kv": draw(st.integers(1, 6)),
        "head_dim": draw(st.sampled_from([4, 8])),
    }
    for name in draw(st.lists(st.sampled_from(sorted(sizes)), min_size=1, max_size=2)):
        sizes[name] = 0
    group = 1 if sizes["heads"] == 0 else draw(st.integers(1, 2))
    head_dim_v = draw(st.sampled_from([sizes["head_dim"], 3]))
    return {
        **sizes,
        "group": group,
        "head_dim_v": head_dim_v,
        "bias": draw(
            bias_sums(sizes["batch"], sizes["heads"] * group, sizes["length_q"], sizes["length_kv"])
        ),
        "is_causal": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.5])),
    }


def routes_for(call: dict[str, Any]) -> list[str]:
    """The routes that can take the call: the default, and each backend pinned."""
    names = ["default", "reference"]
    kernel_form = not any(isinstance(p, TensorBias) for p in parts_of(call["bias"]))
    if call["head_dim"] == call["head_dim_v"] and kernel_form:
        names.append("triton")
    if not any(isinstance(p, SoftcapBias) for p in parts_of(call["bias"])):
        names.append("sdpa+mask")
    return names


@pytest.mark.parametrize("name", ["default", "triton", "sdpa+mask", "reference"])
def test_no_keys_gives_zeros_like_stock(name: str) -> None:
    q, k, v = qkv(length_kv=0, requires_grad=True)
    expected = STOCK(q, k, v)
    with route(name):
        out = sdpa(q, k, v, attn_mask=causal_lower_right() + SlidingWindowBias(2))
    assert torch.equal(out, expected) and torch.equal(out, torch.zeros_like(out))
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", ["default", "triton", "sdpa+mask", "reference"])
@pytest.mark.parametrize(
    ("batch", "heads", "length_q", "enable_gqa"),
    [(2, 0, 5, True), (2, 0, 5, False), (0, 2, 5, False), (2, 2, 0, True)],
)
def test_an_empty_output_runs_nothing(
    name: str, batch: int, heads: int, length_q: int, enable_gqa: bool
) -> None:
    # Hq = 0 is where stock SDPA (torch 2.11) ends the process with a floating point exception
    q, k, v = qkv(batch, heads * 2 if enable_gqa else heads, heads, length_q, 6, 8, 3)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    bias = causal_lower_right() + SlidingWindowBias(2)
    kwargs = dict(attn_mask=bias, is_causal=True, enable_gqa=enable_gqa)
    with route(name):
        assert attnbias.explain(q, k, v, **kwargs).startswith("empty: the output")
        out = sdpa(*leaves, **kwargs)
    assert out.shape == (batch, q.shape[1], length_q, 3) and out.dtype == q.dtype
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    for grad, leaf in zip(grads, leaves, strict=True):
        assert grad.shape == leaf.shape and not grad.any()


@given(call=empty_calls(), seed=st.integers(0, 2**16))
def test_empty_dimensions_behave_like_stock(call: dict[str, Any], seed: int) -> None:
    torch.manual_seed(seed)
    q, k, v = qkv(
        call["batch"],
        call["heads"] * call["group"],
        call["heads"],
        call["length_q"],
        call["length_kv"],
        call["head_dim"],
        call["head_dim_v"],
    )
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], device=DEVICE)
    kwargs = dict(is_causal=call["is_causal"], enable_gqa=call["group"] > 1)
    # With E=0 every score is an empty sum, 0 at any scale; the oracle's eager soft-cap would
    # divide by sqrt(0) for the default scale.
    oracle_scale = 1.0 if call["head_dim"] == 0 and call["scale"] is None else call["scale"]
    expected = run_with_grads(
        lambda q, k, v: attention(q, k, v, call["bias"], scale=oracle_scale, **kwargs),
        (q.double(), k.double(), v.double()),
        grad_out.double(),
    )
    low = run_with_grads(
        lambda q, k, v: attention(
            q, k, v, call["bias"], scale=oracle_scale, dtype=torch.float32, **kwargs
        ),
        (q, k, v),
        grad_out,
    )
    for name in routes_for(call):
        with route(name):
            taken = attnbias.explain(q, k, v, attn_mask=call["bias"], scale=call["scale"], **kwargs)
            if taken.startswith("reference") and call["length_kv"] == 0:
                continue  # test_no_keys_gives_zeros_like_stock marks this one
            # twice: a repeated call may take a shorter path than the first
            runs = [
                run_with_grads(
                    lambda q, k, v: sdpa(
                        q, k, v, attn_mask=call["bias"], scale=call["scale"], **kwargs
                    ),
                    (q, k, v),
                    grad_out,
                )
                for _ in range(2)
            ]
        names = ("out", "dq", "dk", "dv")
        for results in runs:
            for what, result, oracle, stock in zip(names, results, expected, low, strict=True):
                assert result.shape == oracle.shape, (name, what)
                if oracle.numel():  # the oracle's budget needs a value to scale by
                    assert_close_to_oracle([result], [oracle], [stock], torch.float32, (what,))


def test_query_heads_without_key_heads_are_refused() -> None:
    q, k, v = qkv(heads_q=2, heads_kv=0)
    with pytest.raises(ValueError, match="Hq=2 and Hkv=0"):
        sdpa(q, k, v, attn_mask=causal_lower_right(), enable_gqa=True)


# --------------------------------------------------------------------------------------------
# patch_sdpa: a stack, restored in any order, from threads


@pytest.fixture
def unpatched() -> Iterator[None]:
    """Each patch test starts from stock SDPA; a failure inside it cannot leak the patch."""
    assert F.scaled_dot_product_attention is STOCK
    try:
        yield
    finally:
        F.scaled_dot_product_attention = STOCK


def routes_biases() -> bool:
    """Whether F.scaled_dot_product_attention currently takes a bias object."""
    q, k, v = qkv(dtype=torch.float64)
    bias = SlidingWindowBias(1)
    try:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # type: ignore[arg-type]
    except TypeError:
        return False
    torch.testing.assert_close(out, attention(q, k, v, bias))
    return True


class Opened:
    """A patch opened by a plain call or by entering a ``with`` block by hand."""

    def __init__(self, as_context: bool) -> None:
        self.stack = contextlib.ExitStack()
        if as_context:
            self.patch = self.stack.enter_context(patch_sdpa())
        else:
            self.patch = patch_sdpa()

    def close(self, as_context: bool) -> None:
        if as_context:
            self.stack.close()
        else:
            self.patch.restore()


@given(
    order=st.integers(1, 5).flatmap(lambda n: st.permutations(range(n))),
    contexts=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_nested_patches_restored_in_any_order(order: list[int], contexts: list[bool]) -> None:
    assert F.scaled_dot_product_attention is STOCK
    try:
        opened = [Opened(contexts[n]) for n in range(len(order))]
        for done, n in enumerate(order, start=1):
            opened[n].close(contexts[n])
            opened[n].close(contexts[n])  # a second restore does nothing
            assert routes_biases() == (done < len(order))
        assert F.scaled_dot_product_attention is STOCK
    finally:
        F.scaled_dot_product_attention = STOCK


def foreign_wrapper(below: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Another library's patch: counts calls and passes them on."""

    def wrapper(*args: Any, **kwargs: Any) -> torch.Tensor:
        wrapper.calls += 1  # type: ignore[attr-defined]
        return below(*args, **kwargs)

    wrapper.calls = 0  # type: ignore[attr-defined]
    return wrapper


@given(steps=st.permutations(["ours_a", "ours_b", "foreign"]))
def test_a_foreign_patch_is_never_dropped(steps: list[str]) -> None:
    """Patch A, a foreign patch and patch B, applied in that order, undone in any order."""
    assert F.scaled_dot_product_attention is STOCK
    try:
        first = patch_sdpa()
        foreign = foreign_wrapper(F.scaled_dot_product_attention)
        saved_by_foreign = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = foreign
        second = patch_sdpa()
        undo = {
            "ours_a": first.restore,
            "ours_b": second.restore,
            "foreign": lambda: setattr(F, "scaled_dot_product_attention", saved_by_foreign),
        }
        for n, step in enumerate(steps):
            undo[step]()
            left = set(steps[n + 1 :])
            if "foreign" in left:
                q, k, v = qkv()
                calls = foreign.calls  # type: ignore[attr-defined]
                F.scaled_dot_product_attention(q, k, v)
                assert foreign.calls == calls + 1  # type: ignore[attr-defined]
            # Undone before patch B, the foreign patch puts back patch A's function and so
            # drops B itself: what routes then is the foreign code's doing.
            if not ("ours_b" in left and "foreign" not in left):
                assert routes_biases() == bool(left & {"ours_a", "ours_b"})
        # A restored patch behind the foreign one may remain, passing every call through;
        # the next patch drops it, and its restore puts back stock SDPA.
        with patch_sdpa():
            assert routes_biases()
        assert F.scaled_dot_product_attention is STOCK
    finally:
        F.scaled_dot_product_attention = STOCK


def test_a_foreign_patch_below_is_restored(unpatched: None) -> None:
    foreign = foreign_wrapper(STOCK)
    F.scaled_dot_product_attention = foreign
    with patch_sdpa():
        q, k, v = qkv()
        F.scaled_dot_product_attention(q, k, v)
        assert foreign.calls == 1  # type: ignore[attr-defined]
        assert routes_biases()
    assert F.scaled_dot_product_attention is foreign


def test_a_restored_patch_cannot_be_entered(unpatched: None) -> None:
    patch = patch_sdpa()
    patch.restore()
    with pytest.raises(RuntimeError, match=r"already restored .* call attnbias.patch_sdpa\(\)"):
        patch.__enter__()
    assert F.scaled_dot_product_attention is STOCK


# Seconds a thread waits for another before the test fails (instead of hanging).
WAIT = 20.0


def run_threads(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.daemon = True
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * WAIT)
        assert not thread.is_alive(), "a thread is stuck"


@given(order=st.permutations(range(4)))
def test_patches_from_threads_restored_in_any_order(order: list[int]) -> None:
    assert F.scaled_dot_product_attention is STOCK
    turn = threading.Condition()
    state = {"next": 0}
    patched = threading.Barrier(len(order))
    errors: list[BaseException] = []

    def worker(me: int) -> None:
        try:
            with patch_sdpa():
                patched.wait(timeout=WAIT)
                with turn:
                    assert turn.wait_for(lambda: order[state["next"]] == me, timeout=WAIT)
                # every patch restored before this one leaves this one in effect
                assert routes_biases()
        except BaseException as error:  # reported by the main thread
            errors.append(error)
        finally:
            with turn:
                state["next"] += 1
                turn.notify_all()

    try:
        run_threads([threading.Thread(target=worker, args=(n,)) for n in range(len(order))])
        assert not errors, errors
        assert F.scaled_dot_product_attention is STOCK
    finally:
        F.scaled_dot_product_attention = STOCK


def test_patching_from_many_threads_at_once(unpatched: None) -> None:
    """Unsynchronised patch / call / restore loops: every call sees a patch of its own
    thread in effect, and stock SDPA is back at the end."""
    errors: list[BaseException] = []
    q, k, v = qkv()
    expected = attention(q, k, v, SlidingWindowBias(1))

    def worker() -> None:
        try:
            # use_backends holds per thread; stock SDPA with the mask keeps the loop fast
            with attnbias.use_backends("sdpa+mask"):
                for _ in range(25):
                    with patch_sdpa():
                        bias = SlidingWindowBias(1)
                        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
                        assert (out.double() - expected).abs().max() < 1e-5
        except BaseException as error:
            errors.append(error)

    run_threads([threading.Thread(target=worker) for _ in range(6)])
    assert not errors, errors
    assert F.scaled_dot_product_attention is STOCK


# --------------------------------------------------------------------------------------------
# Passthrough: a call that needs nothing of attnbias reaches the replaced function untouched

PARAMETERS = ("attn_mask", "dropout_p", "is_causal", "scale")


@st.composite
def stock_calls(draw: st.DrawFn) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` of a call stock SDPA takes or refuses, with no bias object."""
    ndim = draw(st.integers(2, 5))
    lead = tuple(draw(st.lists(st.integers(1, 2), min_size=ndim - 2, max_size=ndim - 2)))
    length_q, length_kv = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    head_dim, head_dim_v = draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8, 3]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q = randn(*lead, length_q, head_dim)
    k = randn(*lead, length_kv, head_dim)
    v = randn(*lead, length_kv, head_dim_v)
    breakage = draw(st.sampled_from([None, None, None, "1-D", "head dims", "is_causal"]))
    if breakage == "1-D":
        q = randn(head_dim)
    elif breakage == "head dims":
        k = randn(*lead, length_kv, head_dim + 1)
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    mask = None
    if mask_kind == "bool":
        mask = randn(length_q, length_kv) > 0
    elif mask_kind == "float":
        mask = randn(length_q, length_kv)
    values: dict[str, Any] = {
        "attn_mask": mask,
        "dropout_p": draw(st.sampled_from([0.0, 1.0, 0, torch.tensor(0.0), np.float64(1.0)])),
        "is_causal": "no" if breakage == "is_causal" else draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.3, -1.0, 0, 2, torch.tensor(0.5), np.float32(1)])),
    }
    positional = draw(st.integers(0, len(PARAMETERS)))
    args = (q, k, v, *(values[name] for name in PARAMETERS[:positional]))
    kwargs = {name: values[name] for name in PARAMETERS[positional:] if draw(st.booleans())}
    return args, kwargs


def outcome(function: Callable[..., torch.Tensor], args: Any, kwargs: Any) -> Any:
    try:
        return function(*args, **kwargs)
    except Exception as error:
        return type(error), str(error)


@given(call=stock_calls())
def test_calls_without_a_bias_get_stock_results_and_errors(
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> None:
    args, kwargs = call
    assert F.scaled_dot_product_attention is STOCK
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning of its own, for plain tensor masks too
            expected = outcome(STOCK, args, kwargs)
            with patch_sdpa():
                got = outcome(F.scaled_dot_product_attention, args, kwargs)
    finally:
        F.scaled_dot_product_attention = STOCK
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected)
    else:
        assert got == expected


def test_passthrough_hands_over_the_very_arguments(unpatched: None) -> None:
    """Arguments reach the replaced function as the same objects, unknown keywords included
    (a future torch may add some)."""
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def recorder(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((args, kwargs))
        return args[0]

    F.scaled_dot_product_attention = recorder
    q, k, v = qkv()
    mask = torch.zeros(5, 5)
    scale = torch.tensor(0.5)
    extra = object()
    with patch_sdpa():
        F.scaled_dot_product_attention(q, k, v, mask, scale=scale, future_flag=extra)
        F.scaled_dot_product_attention(q, k, v, None, 1.0, True, None, True, extra)
    assert len(seen) == 2
    (args, kwargs), (args2, kwargs2) = seen
    assert all(a is b for a, b in zip(args, (q, k, v, mask), strict=True))
    assert kwargs.keys() == {"scale", "future_flag"}
    assert kwargs["scale"] is scale and kwargs["future_flag"] is extra
    assert args2[-1] is extra and len(args2) == 9 and not kwargs2


def test_bias_calls_while_patched(unpatched: None) -> None:
    q, k, v = qkv(dtype=torch.float64)
    bias = causal_lower_right() + SlidingWindowBias(2)
    with patch_sdpa():
        positional = F.scaled_dot_product_attention(q, k, v, bias, 0.0, False, 0.5)
        with pytest.raises(TypeError, match="takes no argument future_flag"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias, future_flag=True)
        with pytest.raises(TypeError, match="is_causal must be True or False, got 1"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=1)
    torch.testing.assert_close(positional, attention(q, k, v, bias, scale=0.5))


def test_direct_calls_keep_their_checks_and_warning() -> None:
    q, k, v = (t[0] for t in qkv())
    with pytest.raises(ValueError, match=r"query must be 4-D"):
        sdpa(q, k, v)
    q, k, v = qkv()
    with pytest.warns(UserWarning, match="plain Tensor attn_mask"):
        sdpa(q, k, v, attn_mask=torch.zeros(5, 5, device=q.device))


def test_every_restore_order_leaves_stock_in_place(unpatched: None) -> None:
    """Exhaustive over three patches: each restore order, each mix of context and plain."""
    for order, contexts in itertools.product(
        itertools.permutations(range(3)), itertools.product([False, True], repeat=3)
    ):
        opened = [Opened(contexts[n]) for n in range(3)]
        for n in order:
            opened[n].close(contexts[n])
        assert F.scaled_dot_product_attention is STOCK, (order, contexts)

"""A repeated call reuses its decision, and only an identical call does.

Every result is checked against the fp64 oracle, so a decision reused for a call it does not
fit (another document layout, another band, another route) fails here. Calls run on the CPU
routes (stock SDPA, the materialized mask, the eager reference), which need no kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    functional,
    plan_cache,
    use_backends,
)
from attnbias.backends import triton as triton_backend
from attnbias.testing.oracle import assert_close_to_oracle, attention, run_with_grads


@pytest.fixture(autouse=True)
def cpu_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every decision the planner makes (a cached call makes none)."""
    made: list[Any] = []
    original = functional.plan

    def counting(spec: Any) -> Any:
        chosen = original(spec)
        made.append(chosen)
        return chosen

    monkeypatch.setattr(functional, "plan", counting)
    return made


def inputs(
    length_q: int = 8, length_kv: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(  # type: ignore[return-value]
        torch.randn(1, 2, length, 16, generator=generator).to(dtype)
        for length in (length_q, length_kv, length_kv)
    )


def check(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, out: Tensor, **kwargs: Any) -> None:
    oracle = attention(q, k, v, bias, **kwargs)
    stock = attention(q, k, v, bias, dtype=q.dtype, **kwargs)
    assert_close_to_oracle([out], [oracle], [stock], q.dtype)


def test_a_repeated_call_reuses_its_decision(plans: list[Any]) -> None:
    q, k, v = inputs()
    for _ in range(3):
        # a new but equal bias each time, as a model builds it in every step
        bias = causal_lower_right() + SlidingWindowBias(2) + SoftcapBias(5.0)
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
    assert len(plans) == 1


@pytest.mark.parametrize("empty", ["keys", "head_dim"])
def test_a_call_with_an_empty_dimension_is_not_kept(plans: list[Any], empty: str) -> None:
    """S = 0 or E = 0: planned on every call and never stored (its key is never found)."""
    plan_cache.clear()
    q, k, v = inputs()
    if empty == "keys":
        k, v = k[:, :, :0], v[:, :, :0]
    else:
        q, k = q[..., :0], k[..., :0]
    bias = causal_lower_right() + SoftcapBias(5.0)
    for _ in range(2):
        out = attnbias.sdpa(q, k, v, attn_mask=bias)
        assert out.shape == (*q.shape[:3], v.shape[-1])
        if empty == "keys":
            assert (out == 0).all()  # no key: every row gives 0
    assert len(plans) == 2
    assert not plan_cache._ENTRIES


VARIANTS: dict[str, Callable[[Tensor, Tensor, Tensor], dict[str, Any]]] = {
    "another length": lambda q, k, v: {"q": q[:, :, :5]},
    "another dtype": lambda q, k, v: {"q": q.double(), "k": k.double(), "v": v.double()},
    "another scale": lambda q, k, v: {"scale": 0.5},
    "is_causal": lambda q, k, v: {"is_causal": True},
    "an int where a float was": lambda q, k, v: {"scale": 1},
    "gradients": lambda q, k, v: {"q": q.clone().requires_grad_()},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_call_that_differs_is_planned_again(plans: list[Any], variant: str) -> None:
    q, k, v = inputs()
    bias = SlidingWindowBias(3) + SoftcapBias(4.0)
    attnbias.sdpa(q, k, v, attn_mask=bias, scale=1.0)
    changed: dict[str, Any] = {"q": q, "k": k, "v": v, "scale": 1.0, "is_causal": False}
    changed.update(VARIANTS[variant](q, k, v))
    q2, k2, v2 = changed.pop("q"), changed.pop("k"), changed.pop("v")
    out = attnbias.sdpa(q2, k2, v2, attn_mask=bias, **changed)
    assert len(plans) == 2
    check(q2.detach(), k2, v2, bias, out.detach(), **changed)


def test_grad_mode_is_part_of_a_call(plans: list[Any]) -> None:
    q, k, v = (x.requires_grad_() for x in inputs())
    bias = SlidingWindowBias(2) + SoftcapBias(4.0)
    with torch.no_grad():
        attnbias.sdpa(q, k, v, attn_mask=bias)
    out = attnbias.sdpa(q, k, v, attn_mask=bias)
    assert len(plans) == 2
    assert out.requires_grad


def test_documents_are_told_apart_by_identity(plans: list[Any]) -> None:
    q, k, v = inputs(length_q=9, length_kv=9)
    for seqlens in ([3, 6], [6, 3], [3, 6], [9]):
        bias = DocumentBias.from_seqlens(seqlens) + causal_lower_right()
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
    assert len(plans) == 4


def test_key_ranges_are_told_apart_by_identity(plans: list[Any]) -> None:
    """Two ranges that differ only in their contents are two calls; one bias used again is one."""
    q, k, v = inputs(length_q=6, length_kv=9)
    q, k, v = (x.expand(2, -1, -1, -1) for x in (q, k, v))
    cache = KeyRangeBias(end=torch.tensor([9, 4]))
    for end in ([5, 9], [9, 5], [5, 9]):
        bias = KeyRangeBias(start=[1, 0], end=end) + causal_lower_right()
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
    for _ in range(2):
        check(q, k, v, cache, attnbias.sdpa(q, k, v, attn_mask=cache))
    assert len(plans) == 4


def test_an_entry_keeps_its_key_range_alive() -> None:
    """The entry holds the range's device tensors: the bias must outlive it, or a new bias
    could take its identity and run on the old range."""
    import gc
    import weakref

    q, k, v = inputs(length_kv=9)
    bias = KeyRangeBias(start=[2])
    ref = weakref.ref(bias)
    attnbias.sdpa(q, k, v, attn_mask=bias)
    del bias
    gc.collect()
    assert ref() is not None
    plan_cache.clear()
    gc.collect()
    assert ref() is None


def test_use_backends_is_part_of_a_call(plans: list[Any]) -> None:
    q, k, v = inputs()
    bias = SlidingWindowBias(2)
    attnbias.sdpa(q, k, v, attn_mask=bias)
    with use_backends("reference"):
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
    attnbias.sdpa(q, k, v, attn_mask=bias)
    assert [p.backend.name for p in plans] == ["sdpa+mask", "reference"]


def test_slopes_of_your_own_are_never_cached(plans: list[Any]) -> None:
    """Their conversion must be recorded on every call, or the gradient would stop flowing."""
    q, k, v = inputs(dtype=torch.float64)
    grad_out = torch.randn_like(q)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    for _ in range(2):
        leaf = slopes.clone().requires_grad_()
        out = attnbias.sdpa(q, k, v, attn_mask=AlibiBias(slopes=leaf) + causal_lower_right())
        (got,) = torch.autograd.grad(out, leaf, grad_out)
        expected = run_with_grads(
            lambda s: attention(q, k, v, AlibiBias(slopes=s) + causal_lower_right()),
            [slopes],
            grad_out,
        )[1]
        torch.testing.assert_close(got, expected)
    assert len(plans) == 2


def test_sums_are_told_apart_by_their_parts_however_often_used(plans: list[Any]) -> None:
    """A sum works out its key once and keeps it: the same sum object used again, and an
    equal one, hit; a sum that differs in one part's value is another call. One of your own
    slopes stays uncached on every use of the same sum."""
    q, k, v = inputs()
    narrow = causal_lower_right() + SlidingWindowBias(2)
    wide = causal_lower_right() + SlidingWindowBias(3)
    for bias in (narrow, wide, narrow, wide, causal_lower_right() + SlidingWindowBias(3)):
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
    assert len(plans) == 2
    own = AlibiBias(slopes=torch.tensor([0.5, 0.25])) + causal_lower_right()
    for _ in range(2):
        check(q, k, v, own, attnbias.sdpa(q, k, v, attn_mask=own))
    assert len(plans) == 4


def test_the_paper_slopes_are_cached_by_head_count(plans: list[Any]) -> None:
    q, k, v = inputs(dtype=torch.float64)
    for _ in range(2):
        bias = AlibiBias(num_heads=2) + SoftcapBias(3.0)
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
    assert len(plans) == 1


def test_the_cache_is_bounded() -> None:
    bias = SlidingWindowBias(1) + SoftcapBias(2.0)
    for length in range(1, plan_cache.MAX_ENTRIES + 10):
        q, k, v = inputs(length_q=length, length_kv=length)
        attnbias.sdpa(q, k, v, attn_mask=bias)
    assert len(plan_cache._ENTRIES) == plan_cache.MAX_ENTRIES


def test_no_entry_keeps_the_inputs_alive() -> None:
    """An entry holds the decision, not the tensors of the call that made it."""
    import weakref

    q, k, v = inputs()
    refs = [weakref.ref(x) for x in (q, k, v)]
    attnbias.sdpa(q, k, v, attn_mask=SlidingWindowBias(2) + SoftcapBias(3.0))
    del q, k, v
    assert all(ref() is None for ref in refs)
    assert len(plan_cache._ENTRIES) == 1


def test_a_tensor_bias_that_requires_grad_makes_a_training_call() -> None:
    from attnbias import TensorBias
    from attnbias.spec import make_spec

    q, k, v = inputs()
    table = torch.zeros(8, 8, requires_grad=True)
    spec = make_spec(q, k, v, TensorBias(table) + SoftcapBias(3.0), False, None, 0.0, False)
    assert spec.needs_grad
    with torch.no_grad():
        spec = make_spec(q, k, v, TensorBias(table) + SoftcapBias(3.0), False, None, 0.0, False)
    assert not spec.needs_grad


@pytest.mark.parametrize("route", ["sdpa+mask", "reference"])
def test_a_captured_call_lowers_its_bias_again(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    """A call warmed up eagerly keeps its lowered terms in its entry, tensors its lowering
    made included (two document layouts merged into one); a serving loop that warms up inside
    the memory pool its CUDA graphs share has them where other graphs write. The same call
    captured afterwards (faked here) reuses the entry's decision but lowers the bias again:
    with the entry's merged ids overwritten, it still matches the oracle."""
    import attnbias.biases.base as base
    import attnbias.planner as planner
    import attnbias.spec as spec_module

    query, key, value = inputs(8, 8)
    bias = (
        DocumentBias.from_seqlens([3, 5], [3, 5])
        + DocumentBias.from_seqlens([6, 2], [6, 2])
        + causal_lower_right()
    )
    expected = attention(query, key, value, bias)
    with use_backends(route):
        plan_cache.clear()
        attnbias.sdpa(query, key, value, attn_mask=bias)
        (entry,) = plan_cache._ENTRIES.values()
        made = [t for t in (entry.terms.q_doc, entry.terms.kv_doc) if t is not None]
        assert made, "the lowering made no tensor: nothing to check"
        for tensor in made:
            tensor.fill_(-7)  # what another graph's replay could leave there
        for module in (spec_module, plan_cache):
            monkeypatch.setattr(module, "capturing", lambda tensor: True)
        for module in (planner, plan_cache):
            monkeypatch.setattr(module, "capturable", lambda tensor: True)
        monkeypatch.setattr(base, "capturing_now", lambda: True)
        captured = attnbias.sdpa(query, key, value, attn_mask=bias)
    assert list(plan_cache._ENTRIES.values()) == [entry]  # the eager call's entry, reused
    assert_close_to_oracle([captured], [expected], [expected], torch.float32)

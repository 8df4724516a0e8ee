"""The planner on CPU: its walk over the priority lists, ``use_backends``, ``explain``, the choice
for every kind of bias on a faked Hopper GPU, the weighing of predicted times (FlashAttention 4's
own reasons and arguments: ``tests/test_fa4_backend.py``).

Nothing here needs a GPU: the GPU generation, FlashAttention 4's install and device checks and
``flash_attn.cute.flash_attn_func`` itself are replaced with monkeypatch.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import logging
import re
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from planning import (
    fake_gpu,
    qkv,
    set_generation,
    skip_without_the_interpreter,
    spec_of,
)
from torch import Tensor

import attnbias
import attnbias.backends.fa4 as fa4
import attnbias.backends.triton as triton_backend
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    PagedKV,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    planner,
    use_backends,
)
from attnbias.backends import BACKENDS, Backend
from attnbias.biases import parts_of
from attnbias.planner import PRIORITY, kept_pairs, plan
from attnbias.policy import Cost
from attnbias.spec import Spec, make_spec

# the priority lists alone (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("lists_alone")

NAMES = ("fa4", "triton-decode", "triton", "gluon", "sdpa", "sdpa+mask", "reference")
# The backends a priority list leaves out are tried after it, in this order; FlashAttention 4
# is tried only where a list names it.
FALLBACK = ("triton-decode", "triton", "sdpa", "sdpa+mask", "reference")


# ------------------------------------------------------------------------------------------
# Building calls


# One bias per kind of spec (``Lowered.kind``), for L = S = 16 and two query heads.
KIND_BIASES: dict[str, Callable[[], AttnBias | None]] = {
    "none": lambda: None,
    "causal": causal_upper_left,
    "band": lambda: SlidingWindowBias(3),
    "documents": lambda: DocumentBias.from_seqlens([6, 10]),
    "softcap": lambda: SoftcapBias(20.0),
    "alibi": lambda: AlibiBias(num_heads=2),
    "mod mask": lambda: ModBias(
        mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < 4)
    ),
    "mod": lambda: ModBias(
        mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < 4),
        score_mod=lambda score, b, h, q_idx, kv_idx: score * 0.5,
    ),
    "materialized": lambda: TensorBias(torch.zeros(16, 16)) + SlidingWindowBias(3),
}


def test_kind_biases_cover_every_kind_of_the_priority_tables() -> None:
    for kind, make in KIND_BIASES.items():
        assert spec_of(make()).terms.kind == kind
    listed = {kind for table in PRIORITY.values() for kind in table}
    assert listed <= set(KIND_BIASES)


def test_registry_and_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tuple(BACKENDS) == NAMES
    assert all(backend.name == name for name, backend in BACKENDS.items())
    assert planner.BACKENDS is attnbias.backends.BACKENDS  # what the fakes below patch
    assert planner.generation(torch.device("cpu")) == "cpu"
    for major, name in ((9, "hopper"), (10, "blackwell"), (8, "cuda"), (12, "cuda")):
        monkeypatch.setattr(planner, "_major", lambda index, major=major: major)
        assert planner.generation(torch.device("cuda", 0)) == name


# ------------------------------------------------------------------------------------------
# 1. The walk, with every backend faked


class FakeBackend(Backend):
    """Takes every dtype, refuses with ``refusals``, and fills its output with ``marker``."""

    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

    def __init__(self, marker: float, log: list[str]) -> None:
        self.marker = marker
        self.refusals: list[str] = []
        self.log = log

    def reasons(self, spec: Spec) -> list[str]:
        self.log.append(self.name)
        return list(self.refusals)

    def run(self, spec: Spec) -> Tensor:
        batch, heads, length_q, _ = spec.shape
        return torch.full((batch, heads, length_q, spec.head_dim_v), self.marker, dtype=spec.dtype)

    def label(self, spec: Spec) -> str:
        return f"{self.name}-route"

    def how(self, spec: Spec) -> str:
        return f"the fake {self.name}"


@dataclasses.dataclass
class Fakes:
    backends: dict[str, FakeBackend]
    log: list[str]  # the names whose reasons were asked for, in order

    def refuse(self, name: str, *reasons: str) -> None:
        self.backends[name].refusals = list(reasons)


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> Fakes:
    log: list[str] = []
    backends = {}
    for marker, name in enumerate(NAMES, start=1):
        cls = type(f"Fake{marker}", (FakeBackend,), {"name": name})
        backends[name] = cls(float(marker), log)
        monkeypatch.setitem(BACKENDS, name, backends[name])
    return Fakes(backends, log)


@pytest.mark.parametrize("needs_grad", [False, True])
@pytest.mark.parametrize("kind", list(KIND_BIASES))
@pytest.mark.parametrize("gen", list(PRIORITY))
def test_walk_follows_the_priority_list_then_the_fallback(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch, gen: str, kind: str, needs_grad: bool
) -> None:
    set_generation(monkeypatch, gen)
    spec = spec_of(KIND_BIASES[kind](), dtype=torch.float32, needs_grad=needs_grad)
    for name in NAMES:
        fakes.refuse(name, f"{name} says no")
    with pytest.raises(ValueError, match="no allowed backend") as info:
        plan(spec)
    listed = PRIORITY[gen].get(kind)
    if listed is None:
        preferred: tuple[str, ...] = ()
    elif needs_grad and listed.training is not None:
        preferred = listed.training
    else:
        preferred = listed.inference
    walked = preferred + tuple(name for name in FALLBACK if name not in preferred)
    assert fakes.log == list(walked)
    message = str(info.value)
    assert f"({gen}, {kind}, {'training' if needs_grad else 'inference'})" in message
    for name in walked:
        assert f"{name}: {name} says no" in message


@pytest.mark.parametrize(
    ("gen", "kind", "needs_grad", "order"),
    [
        (
            "hopper",
            "band",
            False,
            ("triton-decode", "fa4", "triton", "gluon", "sdpa", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "causal",
            True,
            ("fa4", "sdpa", "triton", "triton-decode", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "none",
            False,
            ("triton-decode", "fa4", "sdpa", "gluon", "triton", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "softcap",
            False,
            ("triton-decode", "fa4", "triton", "gluon", "sdpa", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "alibi",
            False,
            ("triton-decode", "triton", "gluon", "fa4", "sdpa", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "alibi",
            True,
            ("fa4", "triton", "triton-decode", "sdpa", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "documents",
            True,
            ("fa4", "sdpa", "triton", "triton-decode", "sdpa+mask", "reference"),
        ),
        (
            "cpu",
            "documents",
            False,
            ("sdpa", "triton-decode", "triton", "sdpa+mask", "reference"),
        ),
        (
            "blackwell",
            "band",
            True,
            ("fa4", "triton", "triton-decode", "sdpa", "sdpa+mask", "reference"),
        ),
        ("cuda", "band", False, ("triton-decode", "triton", "sdpa", "sdpa+mask", "reference")),
        ("cpu", "causal", False, ("sdpa", "triton-decode", "triton", "sdpa+mask", "reference")),
        (
            "cpu",
            "materialized",
            False,
            ("triton-decode", "triton", "sdpa", "sdpa+mask", "reference"),
        ),
    ],
)
def test_orders(
    fakes: Fakes,
    monkeypatch: pytest.MonkeyPatch,
    gen: str,
    kind: str,
    needs_grad: bool,
    order: tuple[str, ...],
) -> None:
    set_generation(monkeypatch, gen)
    chosen = plan(spec_of(KIND_BIASES[kind](), needs_grad=needs_grad))
    assert chosen.order == order
    assert chosen.backend is fakes.backends[order[0]]
    assert fakes.log == [order[0]]


HOPPER_BAND = ("triton-decode", "fa4", "triton", "gluon", "sdpa", "sdpa+mask", "reference")


# ------------------------------------------------------------------------------------------
# Weighing predicted times


@pytest.mark.parametrize("length_q", [0, 1, 5, 16, 23])
@pytest.mark.parametrize("length_kv", [0, 1, 7, 16, 40])
def test_kept_pairs_counts_the_band(length_q: int, length_kv: int) -> None:
    for lo, hi in itertools.product([None, -50, -9, -1, 0, 3], [None, -20, -2, 0, 1, 12, 60]):
        rows = torch.arange(length_q)[:, None]
        cols = torch.arange(length_kv)[None, :]
        keep = torch.ones(length_q, length_kv, dtype=torch.bool)
        if lo is not None:
            keep &= cols - rows >= lo
        if hi is not None:
            keep &= cols - rows <= hi
        assert kept_pairs(length_q, length_kv, lo, hi) == int(keep.sum()), (lo, hi)


# A backend of large host time and high rate against two of small host time and lower rates.
WEIGHED = {
    "fa4": Cost(host_us=200.0, host_us_training=800.0, tflops=600.0, tflops_training=500.0),
    "sdpa": Cost(host_us=25.0, host_us_training=300.0, tflops=300.0, tflops_training=250.0),
    "triton": Cost(host_us=20.0, host_us_training=250.0, tflops=400.0, tflops_training=350.0),
}


def weigh_on_hopper(monkeypatch: pytest.MonkeyPatch, costs: dict[str, Cost] = WEIGHED) -> None:
    set_generation(monkeypatch, "hopper")
    monkeypatch.setattr(planner, "COSTS", {"hopper": costs})


@pytest.mark.parametrize("needs_grad", [False, True])
def test_a_tiny_call_skips_the_backend_of_large_host_time(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch, needs_grad: bool
) -> None:
    weigh_on_hopper(monkeypatch)
    fakes.refuse("triton-decode", "not a decode")  # first in the inference list, unweighed
    spec = spec_of(SlidingWindowBias(3), needs_grad=needs_grad)  # (1, 2, 16, 16): band
    chosen = plan(spec)
    # the list: fa4 then triton; predicted: fa4 its host time, triton 10x (forward) or 3.2x
    # (training) less, the GPU's share a few ns; sdpa's host time above triton's
    assert chosen.order[:3] == (
        ("fa4", "triton", "triton-decode") if needs_grad else HOPPER_BAND[:3]
    )
    assert chosen.backend is fakes.backends["triton"]
    assert set(chosen.predicted) == {"fa4", "triton", "sdpa"}
    host, gpu = chosen.predicted["fa4"]
    assert host == (800.0 if needs_grad else 200.0) and gpu < 0.01
    assert "triton before fa4: predicted" in chosen.heading
    # a backend that refuses the call is not weighed
    fakes.refuse("triton", "no")
    chosen = plan(spec)
    assert chosen.backend is fakes.backends["sdpa"]
    assert set(chosen.predicted) == {"fa4", "sdpa"}


def test_a_large_call_keeps_the_lists_choice(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    weigh_on_hopper(monkeypatch)
    fakes.refuse("triton-decode", "not a decode")
    # B=1, H=2, L=S=8192, E=64, causal: 2 * 2 * 33.6M pairs * 128 flops = 17 GFLOP, 29 µs on
    # fa4 at 600 TFLOP/s, below its host time of 200 µs; 1.5x that is 300 µs > triton's 43 µs
    spec = spec_of(SlidingWindowBias(8191), length_q=8192, length_kv=8192, dtype=torch.float32)
    assert plan(spec).backend is fakes.backends["triton"]
    # at 32x the heads and a quarter of the head dim, fa4's GPU time (229 µs) is above its
    # host time and the fastest (triton's 344 µs)
    spec = spec_of(
        SlidingWindowBias(8191),
        length_q=8192,
        length_kv=8192,
        heads_q=64,
        heads_kv=64,
        head_dim=16,
        dtype=torch.float32,
    )
    chosen = plan(spec)
    assert chosen.backend is fakes.backends["fa4"], chosen.predicted
    host, gpu = chosen.predicted["fa4"]
    assert host == 200.0
    pairs = 8192 * 8193 // 2
    assert gpu == pytest.approx(2 * 64 * pairs * 32 / 600e6)
    assert chosen.heading == "hopper, causal, inference"  # the window covers every key


@pytest.mark.parametrize(
    ("bias", "batch"),
    [
        (DocumentBias.from_seqlens([6, 10]) + causal_upper_left(), 1),
        (DocumentBias.from_seqlens([6, 10]) + SlidingWindowBias(2), 3),
        (DocumentBias.from_seqlens([2, 3, 11], [4, 3, 9]) + causal_lower_right(), 1),
        (DocumentBias(torch.tensor([[0] * 5 + [1] * 11, [2] * 16])) + causal_upper_left(), 2),
    ],
)
def test_predictions_count_the_pairs_each_document_keeps(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch, bias: AttnBias, batch: int
) -> None:
    weigh_on_hopper(monkeypatch)
    fakes.refuse("triton-decode", "not a decode")
    spec = spec_of(bias, batch=batch, dtype=torch.float32)
    _, heads, length_q, length_kv = spec.shape
    kept = bias.materialize(shape=(batch, heads, length_q, length_kv), dtype=torch.float32)
    pairs = int(torch.isfinite(kept).expand(batch, 1, length_q, length_kv).sum())
    _, gpu = plan(spec).predicted["fa4"]
    assert gpu == pytest.approx(2 * heads * pairs * 128 / 600e6)


def test_equal_documents_take_the_backend_of_small_host_time(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    weigh_on_hopper(monkeypatch)
    fakes.refuse("triton-decode", "not a decode")
    fakes.refuse("triton", "not weighed here")
    big = {"length_q": 8192, "length_kv": 8192, "heads_q": 64, "heads_kv": 64, "head_dim": 16}
    # causal alone: fa4's GPU time (229 µs) is above its host time and the fastest (sdpa 458)
    spec = spec_of(causal_upper_left() + SlidingWindowBias(8191), dtype=torch.float32, **big)
    assert plan(spec).backend is fakes.backends["fa4"]
    # the same in documents of 64: 1/128 of the pairs, so fa4 waits on its host time (200 µs)
    # and the list's next backend, sdpa (25 µs, its GPU time 4 µs), is 8x faster
    documents = DocumentBias.from_seqlens([64] * 128) + causal_upper_left()
    chosen = plan(spec_of(documents, dtype=torch.float32, **big))
    assert chosen.order[:4] == ("triton-decode", "fa4", "sdpa", "triton")
    assert chosen.backend is fakes.backends["sdpa"], chosen.predicted
    assert "sdpa before fa4: predicted 8.0x faster per call" in chosen.heading


def test_a_backend_only_somewhat_faster_does_not_move_ahead(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    close = dict(WEIGHED, fa4=Cost(25.0, 300.0, 600.0, 500.0))  # triton 20 µs: 1.25x faster
    weigh_on_hopper(monkeypatch, close)
    fakes.refuse("triton-decode", "not a decode")
    chosen = plan(spec_of(SlidingWindowBias(3)))
    assert chosen.backend is fakes.backends["fa4"]
    assert max(chosen.predicted["fa4"]) / max(chosen.predicted["triton"]) == pytest.approx(1.25)
    assert planner.SWITCH_FACTOR > 1.25


def test_a_captured_call_pays_no_host_time(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    weigh_on_hopper(monkeypatch)
    fakes.refuse("triton-decode", "not a decode")
    spec = dataclasses.replace(spec_of(SlidingWindowBias(3)), capturing=True)
    chosen = plan(spec)
    assert chosen.backend is fakes.backends["fa4"]
    assert all(host == 0.0 for host, _ in chosen.predicted.values())


def test_pinned_or_unweighed_backends_are_not_weighed(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    weigh_on_hopper(monkeypatch)
    with use_backends("fa4", "triton"):
        chosen = plan(spec_of(SlidingWindowBias(3)))
    assert chosen.backend is fakes.backends["fa4"] and not chosen.predicted
    # the decode kernel, first for a short query, has no cost: the list's choice stands
    chosen = plan(spec_of(SlidingWindowBias(3), length_q=1))
    assert chosen.backend is fakes.backends["triton-decode"] and not chosen.predicted


def test_explain_shows_the_predictions(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    weigh_on_hopper(monkeypatch)
    fakes.refuse("triton-decode", "not a decode")
    text = plan(spec_of(SlidingWindowBias(3))).explain()
    assert "triton before fa4: predicted 10.0x faster per call" in text
    assert "predicted per call: fa4 200 µs (host 200, GPU 0), triton 20 µs (host 20, GPU 0)" in text


@pytest.mark.parametrize("refusing", range(len(HOPPER_BAND)))
def test_first_backend_without_reasons_runs_the_call(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch, refusing: int
) -> None:
    set_generation(monkeypatch, "hopper")
    for name in HOPPER_BAND[:refusing]:
        fakes.refuse(name, "no")
    q, k, v = qkv()
    out = attnbias.sdpa(q, k, v, attn_mask=SlidingWindowBias(3))
    chosen = HOPPER_BAND[refusing]
    assert fakes.log == list(HOPPER_BAND[: refusing + 1])
    assert (out == fakes.backends[chosen].marker).all()
    assert out.shape == q.shape


def test_pinned_backends_are_tried_in_the_order_given(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_generation(monkeypatch, "hopper")
    spec = spec_of(SlidingWindowBias(3))
    with use_backends("sdpa+mask"):
        chosen = plan(spec)
        assert chosen.backend is fakes.backends["sdpa+mask"]
        assert chosen.order == ("sdpa+mask",)
        assert chosen.heading == "pinned by use_backends"
    fakes.refuse("reference", "no")
    fakes.log.clear()
    with use_backends("reference", "sdpa"):
        assert plan(spec).backend is fakes.backends["sdpa"]
    assert fakes.log == ["reference", "sdpa"]


def test_a_pinned_backend_that_cannot_run_raises_with_every_reason(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_generation(monkeypatch, "hopper")
    fakes.refuse("triton", "reason one", "reason two")
    q, k, v = qkv()
    with use_backends("triton"), pytest.raises(ValueError) as info:
        attnbias.sdpa(q, k, v, attn_mask=SlidingWindowBias(3))
    message = str(info.value)
    assert "triton: reason one; reason two" in message
    assert "pinned by use_backends" in message
    assert message.endswith("Allow more backends in use_backends(...)")
    assert fakes.log == ["triton"]  # no silent fallback


def test_the_real_fa4_pinned_on_cpu_names_its_reasons() -> None:
    q, k, v = qkv()
    with use_backends("fa4"), pytest.raises(ValueError) as info:
        attnbias.sdpa(q, k, v, attn_mask=SlidingWindowBias(3))
    assert "FlashAttention 4 needs CUDA tensors and these are on cpu" in str(info.value)


def test_exclude_removes_backends(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    set_generation(monkeypatch, "hopper")
    spec = spec_of(SlidingWindowBias(3))
    with use_backends(exclude=["fa4"]):
        chosen = plan(spec)
    assert chosen.backend is fakes.backends["triton-decode"]
    assert chosen.order == ("triton-decode", "triton", "gluon", "sdpa", "sdpa+mask", "reference")
    assert chosen.excluded == {"fa4"}
    assert chosen.heading == "hopper, band, inference; excluded fa4"
    assert "fa4" not in fakes.log
    with use_backends("triton", exclude=["triton"]), pytest.raises(ValueError, match="Allow more"):
        plan(spec)


def test_nesting(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    set_generation(monkeypatch, "hopper")
    spec = spec_of(SlidingWindowBias(3))
    with use_backends("fa4", "triton"):
        with use_backends("sdpa"):  # the inner pin replaces the outer one
            assert plan(spec).order == ("sdpa",)
        assert plan(spec).order == ("fa4", "triton")
        with use_backends(exclude=["fa4"]):  # no inner pin: the outer one stays
            assert plan(spec).order == ("triton",)
    with use_backends(exclude=["fa4"]):
        with use_backends(exclude=["triton"]):  # exclusions add up
            chosen = plan(spec)
            assert chosen.order == ("triton-decode", "gluon", "sdpa", "sdpa+mask", "reference")
            assert chosen.excluded == {"fa4", "triton"}
            assert chosen.heading.endswith("; excluded fa4, triton")
        order = ("triton-decode", "triton", "gluon", "sdpa", "sdpa+mask", "reference")
        assert plan(spec).order == order
    assert plan(spec).order == HOPPER_BAND


def test_regions_are_restored_after_an_exception(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_generation(monkeypatch, "hopper")
    spec = spec_of(SlidingWindowBias(3))
    with use_backends(exclude=["sdpa"]):
        with pytest.raises(RuntimeError, match="inside"), use_backends("reference"):
            assert plan(spec).order == ("reference",)
            raise RuntimeError("inside")
        order = ("triton-decode", "fa4", "triton", "gluon", "sdpa+mask", "reference")
        assert plan(spec).order == order
    assert plan(spec).order == HOPPER_BAND


def test_regions_are_per_thread(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    set_generation(monkeypatch, "hopper")
    spec = spec_of(SlidingWindowBias(3))
    seen: list[tuple[str, ...]] = []
    with use_backends("reference"):
        thread = threading.Thread(target=lambda: seen.append(plan(spec).order))
        thread.start()
        thread.join()
        assert plan(spec).order == ("reference",)
    assert seen == [HOPPER_BAND]


def test_bad_names(fakes: Fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    known = r"the backends are fa4, triton-decode, triton, gluon, sdpa, sdpa\+mask, reference"
    pinned = rf"unknown backend 'flash' in the pinned names; {known}"
    with pytest.raises(ValueError, match=pinned), use_backends("flash"):
        pass
    excluded = rf"unknown backend 'cudnn' in exclude; {known}"
    with pytest.raises(ValueError, match=excluded), use_backends(exclude=["cudnn"]):
        pass
    string = r"got the string 'fa4'; write exclude=\['fa4'\]"
    with pytest.raises(TypeError, match=string), use_backends(exclude="fa4"):
        pass
    set_generation(monkeypatch, "hopper")  # a refused region leaves nothing behind
    assert plan(spec_of(SlidingWindowBias(3))).order == HOPPER_BAND


def test_explain_lists_the_route_the_order_and_every_other_backend(
    fakes: Fakes, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_generation(monkeypatch, "hopper")
    fakes.refuse("fa4", "no A", "no B")
    fakes.refuse("triton-decode", "no D")
    fakes.refuse("reference", "no C")
    q, k, v = qkv()
    with use_backends(exclude=["sdpa+mask"]):
        text = attnbias.explain(q, k, v, attn_mask=SlidingWindowBias(3))
    assert text.splitlines() == [
        "triton-route: band -3 <= j - i <= 0 runs in the fake triton",
        "  order (hopper, band, inference; excluded sdpa+mask): "
        "triton-decode > fa4 > triton > gluon > sdpa > reference",
        "  fa4: no A; no B",
        "  triton-decode: no D",
        "  gluon: could run it, after triton in the order",
        "  sdpa: could run it, after triton in the order",
        "  sdpa+mask: could run it, but use_backends excludes it",
        "  reference: no C",
    ]
    with use_backends("sdpa"):
        text = attnbias.explain(q, k, v, attn_mask=SlidingWindowBias(3))
    assert text.splitlines() == [
        "sdpa-route: band -3 <= j - i <= 0 runs in the fake sdpa",
        "  order (pinned by use_backends): sdpa",
        "  fa4: no A; no B",
        "  triton-decode: no D",
        "  triton: could run it, but use_backends leaves it out",
        "  gluon: could run it, but use_backends leaves it out",
        "  sdpa+mask: could run it, but use_backends leaves it out",
        "  reference: no C",
    ]


# ------------------------------------------------------------------------------------------
# 2. The choice for every kind of spec on a faked Hopper GPU, and FlashAttention 4's reasons


@dataclasses.dataclass(frozen=True)
class Case:
    bias: Callable[[], AttnBias | None]
    kind: str
    # the backend chosen (inference, training) with FlashAttention 4 installed, then without;
    # every call here has L <= 16, so the decode kernel, first on Hopper and Blackwell, takes
    # what the Triton kernels take without gradients
    with_fa4: tuple[str, str]
    without_fa4: tuple[str, str]
    shape: dict[str, Any] = dataclasses.field(default_factory=dict)
    is_causal: bool = False
    dropout_p: float = 0.0
    # with FlashAttention 4 installed, on Blackwell, where that differs from Hopper
    blackwell: tuple[str, str] | None = None


CASES = {
    # attn_mask=None: what the planner would choose, though sdpa sends it to stock SDPA
    "none": Case(KIND_BIASES["none"], "none", ("triton-decode", "fa4"), ("triton-decode", "sdpa")),
    "no_op_window": Case(
        lambda: SlidingWindowBias(None, None),
        "none",
        ("triton-decode", "fa4"),
        ("triton-decode", "sdpa"),
    ),
    # is_causal=True with a bias (attn_mask=None goes to stock SDPA without the planner)
    "is_causal": Case(
        lambda: SlidingWindowBias(None, None),
        "causal",
        ("triton-decode", "fa4"),
        ("triton-decode", "sdpa"),
        is_causal=True,
    ),
    "causal_upper_left": Case(
        causal_upper_left, "causal", ("triton-decode", "fa4"), ("triton-decode", "sdpa")
    ),
    "causal_lower_right_square": Case(
        causal_lower_right, "causal", ("triton-decode", "fa4"), ("triton-decode", "sdpa")
    ),
    "causal_float32": Case(
        causal_upper_left,
        "causal",
        ("triton-decode", "sdpa"),
        ("triton-decode", "sdpa"),
        {"dtype": torch.float32},
    ),
    "causal_lower_right_l_lt_s": Case(
        causal_lower_right,
        "band",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
        {"length_q": 8, "length_kv": 16},
    ),
    "window": Case(
        KIND_BIASES["band"], "band", ("triton-decode", "fa4"), ("triton-decode", "triton")
    ),
    "window_lower_right_l_gt_s": Case(
        lambda: SlidingWindowBias(3) + causal_lower_right(),
        "band",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
        {"length_q": 16, "length_kv": 8},
    ),
    "window_gqa_fp16": Case(
        lambda: SlidingWindowBias(4, 2),
        "band",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
        {"heads_q": 4, "heads_kv": 1, "dtype": torch.float16},
    ),
    "empty_band": Case(  # band 4 <= j - i <= 0
        lambda: causal_upper_left() + SlidingWindowBias(0, None),
        "band",
        ("triton-decode", "triton"),
        ("triton-decode", "triton"),
        {"length_q": 4, "length_kv": 8},
    ),
    "softcap": Case(
        KIND_BIASES["softcap"], "softcap", ("triton-decode", "fa4"), ("triton-decode", "triton")
    ),
    "gemma2": Case(
        lambda: causal_lower_right() + SlidingWindowBias(7) + SoftcapBias(30.0),
        "softcap",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
    ),
    "documents": Case(
        KIND_BIASES["documents"], "documents", ("triton-decode", "fa4"), ("triton-decode", "triton")
    ),
    "documents_causal": Case(
        lambda: DocumentBias.from_seqlens([6, 10]) + causal_lower_right(),
        "documents",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
    ),
    # queries that end before their document's keys do, by a different amount per document
    "documents_uneven_causal": Case(
        lambda: DocumentBias.from_seqlens([6, 10], [10, 6]) + causal_lower_right(),
        "documents",
        ("triton-decode", "triton"),
        ("triton-decode", "triton"),
    ),
    "alibi": Case(
        KIND_BIASES["alibi"], "alibi", ("triton-decode", "fa4"), ("triton-decode", "triton")
    ),
    "alibi_gqa": Case(
        KIND_BIASES["alibi"],
        "alibi",
        ("triton-decode", "triton"),
        ("triton-decode", "triton"),
        {"heads_q": 2, "heads_kv": 1},
    ),
    "alibi_softcap": Case(
        lambda: AlibiBias(num_heads=2) + SoftcapBias(5.0),
        "alibi",
        ("triton-decode", "triton"),
        ("triton-decode", "triton"),
    ),
    # ModBias functions: FlashAttention 4's callbacks on Hopper only
    "mod mask": Case(
        KIND_BIASES["mod mask"],
        "mod mask",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
        blackwell=("triton-decode", "triton"),
    ),
    "mod": Case(
        KIND_BIASES["mod"],
        "mod",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
        blackwell=("triton-decode", "triton"),
    ),
    # past the decode kernel's queries: score functions take the Triton kernel first without
    # gradients (masks alone: test_mod_masks_without_gradients_go_by_their_reach)
    "mod_long": Case(
        KIND_BIASES["mod"],
        "mod",
        ("triton", "fa4"),
        ("triton", "triton"),
        {"length_q": 80, "length_kv": 80},
        blackwell=("triton", "triton"),
    ),
    # a mask function that is a built-in mask written as a function runs as it
    "mod as band": Case(
        lambda: ModBias(
            mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < 4)
        ),
        "band",
        ("triton-decode", "fa4"),
        ("triton-decode", "triton"),
    ),
    "materialized": Case(
        KIND_BIASES["materialized"],
        "materialized",
        ("sdpa+mask", "sdpa+mask"),
        ("sdpa+mask", "sdpa+mask"),
    ),
    "materialized_softcap": Case(
        lambda: TensorBias(torch.zeros(16, 16)) + SoftcapBias(5.0),
        "materialized",
        ("reference", "reference"),
        ("reference", "reference"),
    ),
    # a key range adds no kind: it goes where the other features go, and only the Triton
    # kernel among the fused backends takes it
    "key_range": Case(
        lambda: KeyRangeBias(end=[9]),
        "none",
        ("triton-decode", "triton"),
        ("triton-decode", "triton"),
    ),
    "key_range_causal": Case(
        lambda: KeyRangeBias(start=[2], end=[15]) + causal_upper_left(),
        "causal",
        ("triton-decode", "triton"),
        ("triton-decode", "triton"),
    ),
    "key_range_window_softcap": Case(
        lambda: KeyRangeBias(start=[5]) + SlidingWindowBias(4) + SoftcapBias(20.0),
        "softcap",
        ("triton-decode", "triton"),
        ("triton-decode", "triton"),
    ),
    "key_range_dropout": Case(
        lambda: KeyRangeBias(end=[9]) + causal_lower_right(),
        "causal",
        ("sdpa+mask", "sdpa+mask"),
        ("sdpa+mask", "sdpa+mask"),
        dropout_p=0.1,
    ),
    "causal_dropout": Case(
        causal_upper_left, "causal", ("sdpa", "sdpa"), ("sdpa", "sdpa"), dropout_p=0.1
    ),
    "band_dropout": Case(
        KIND_BIASES["band"],
        "band",
        ("sdpa+mask", "sdpa+mask"),
        ("sdpa+mask", "sdpa+mask"),
        dropout_p=0.1,
    ),
    "softcap_dropout": Case(
        KIND_BIASES["softcap"],
        "softcap",
        ("reference", "reference"),
        ("reference", "reference"),
        dropout_p=0.1,
    ),
}


@pytest.mark.parametrize(
    ("name", "expected"), [("prefix", "fa4"), ("diagonal", "triton")], ids=["long", "short"]
)
def test_mod_masks_without_gradients_go_by_their_reach(
    monkeypatch: pytest.MonkeyPatch, name: str, expected: str
) -> None:
    """Without gradients a ModBias mask takes FlashAttention 4 first where its block lists
    visit at least MOD_MASK_FA4_MIN_KEYS keys per block of query rows, else the Triton kernel
    (160 x 160 under the interpreter: blocks of 16, so a prefix-causal mask visits 5.5 blocks
    per row block on average and a diagonal of width 3 about 2.8)."""
    skip_without_the_interpreter()
    fake_gpu(monkeypatch)
    monkeypatch.setattr(planner, "MOD_MASK_FA4_MIN_KEYS", 64)
    masks = {
        "prefix": lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < 4),
        # |j - i| <= 1 through a minimum, so no band form: the mask runs as its function (a
        # square of j - i would leave 32 bits, which FlashAttention 4 refuses)
        "diagonal": lambda b, h, q_idx, kv_idx: torch.minimum(kv_idx - q_idx, q_idx - kv_idx) >= -1,
    }
    bias = ModBias(mask_mod=masks[name])
    assert bias.builtin_form() is None
    spec = spec_of(bias, length_q=160, length_kv=160)
    assert spec.terms.kind == "mod mask" and planner.needs_reach(spec)
    # planning launches nothing: without the reach worked out, the order of masks stands
    from attnbias.kernels import masks as kernel_masks

    with monkeypatch.context() as patch:
        patch.setattr(kernel_masks, "visited_keys_per_row", _no_launch)
        assert plan(spec).backend.name == "fa4"
    # the dispatcher works the reach out first (on the device, the lists kept for the launch)
    chosen = attnbias.functional.plan_spec(spec)
    assert chosen.spec.mask_reach is not None
    assert chosen.backend.name == expected
    if expected == "triton":
        assert chosen.order[0] == "triton-decode" and chosen.order[1] == "triton"
        assert "keys per block of query rows, below 64" in chosen.heading, chosen.heading
    else:
        assert chosen.heading == "hopper, mod mask, inference"
    # with gradients, FlashAttention 4 first whatever the reach
    assert plan(spec_of(bias, length_q=160, length_kv=160, needs_grad=True)).backend.name == "fa4"


def _no_launch(*args: Any) -> float:
    raise AssertionError("planning launched the block lists' kernels")


def test_cases_cover_every_kind() -> None:
    assert {case.kind for case in CASES.values()} == set(KIND_BIASES)


@pytest.mark.parametrize("needs_grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("fa4_installed", [True, False], ids=["fa4", "no_fa4"])
@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["hopper", "blackwell"])
@pytest.mark.parametrize("name", list(CASES))
def test_choice_on_a_faked_gpu(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    capability: tuple[int, int],
    fa4_installed: bool,
    needs_grad: bool,
) -> None:
    case = CASES[name]
    if case.kind in ("mod", "mod mask"):
        skip_without_the_interpreter()
    fake_gpu(monkeypatch, capability=capability, fa4_installed=fa4_installed)
    spec = spec_of(
        case.bias(),
        is_causal=case.is_causal,
        dropout_p=case.dropout_p,
        needs_grad=needs_grad,
        **case.shape,
    )
    assert spec.terms.kind == case.kind
    assert spec.needs_grad == needs_grad
    with_fa4 = case.with_fa4
    if capability[0] == 10 and case.blackwell is not None:
        with_fa4 = case.blackwell
    expected = (with_fa4 if fa4_installed else case.without_fa4)[needs_grad]
    chosen = plan(spec)
    assert chosen.backend.name == expected
    # the order starts with the list of the priority table for this generation and kind
    gen = {9: "hopper", 10: "blackwell"}[capability[0]]
    assert chosen.heading == f"{gen}, {case.kind}, {'training' if needs_grad else 'inference'}"
    listed = PRIORITY[gen].get(case.kind)
    if listed is not None:
        preferred = listed.training if needs_grad and listed.training else listed.inference
        assert chosen.order[: len(preferred)] == preferred
    # every backend before the chosen one was refused, with its reasons
    before = chosen.order[: chosen.order.index(expected)]
    assert list(chosen.skipped) == list(before)
    assert all(chosen.skipped[n] for n in before)
    if case.dropout_p > 0:
        assert expected not in ("fa4", "triton")
        assert any("dropout" in r for r in BACKENDS["triton"].not_supported_reasons(spec))
    # explain (the public entry point) names the same route; without a bias object sdpa
    # does not plan at all and calls stock SDPA
    q, k, v = qkv(needs_grad=needs_grad, **case.shape)
    bias = case.bias()
    route = attnbias.explain(
        q,
        k,
        v,
        attn_mask=bias,
        is_causal=case.is_causal,
        dropout_p=case.dropout_p,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    if bias is None:
        assert route == "sdpa: no mask: stock SDPA"
    else:
        assert route.split(":")[0].split("(")[0] == expected, route


def test_a_compiled_call_takes_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch)
    for bias, needs_grad in ((SlidingWindowBias(3), True), (SoftcapBias(20.0), True)):
        spec = spec_of(bias, needs_grad=needs_grad)
        assert plan(spec).backend.name == "fa4"
        compiled = plan(dataclasses.replace(spec, compiling=True))
        assert compiled.backend.name == "triton"
        assert "fa4: torch.compile cannot trace FlashAttention 4" in compiled.explain()


@pytest.mark.parametrize(
    "make",
    [
        causal_upper_left,
        lambda: SlidingWindowBias(2),
        lambda: SlidingWindowBias(2) + SoftcapBias(3.0),
        lambda: DocumentBias.from_seqlens([3, 5]) + causal_lower_right(),
    ],
)
def test_the_planner_traces_under_torch_compile(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[], AttnBias]
) -> None:
    """fullgraph tracing of the whole route choice (a graph break would raise), FlashAttention 4
    present or not; the compiled call gives what the eager call gives."""
    # The routes that run on CPU. (Not by setting TRITON_INTERPRET=0: Triton modules imported
    # while tracing would then be compiled for a GPU, and break the interpreted tests after.)
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    monkeypatch.setattr(fa4, "_installed", lambda: True)
    torch._dynamo.reset()
    bias = make()
    q, k, v = qkv(length_q=8, length_kv=8, dtype=torch.float32)
    compiled = torch.compile(
        lambda q, k, v: attnbias.sdpa(q, k, v, attn_mask=bias), fullgraph=True, backend="eager"
    )
    torch.testing.assert_close(compiled(q, k, v), attnbias.sdpa(q, k, v, attn_mask=bias))


def _dataclass_default_guards(call: Callable[..., Tensor], *args: Tensor) -> list[str]:
    """The guards on a frozen dataclass's defaults (``___dataclass_fields``) that compiling
    ``call`` on ``args`` installs, from the guards' log."""
    torch._dynamo.reset()
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    guards = logging.getLogger("torch._dynamo.guards.__guards")
    torch._logging.set_logs(guards=True)
    guards.addHandler(handler)
    try:
        torch.compile(call, fullgraph=True, backend="eager")(*args)
    finally:
        guards.removeHandler(handler)
        torch._logging.set_logs()
    text = log.getvalue()
    assert "TENSOR_MATCH" in text  # the guards were logged
    return sorted(set(re.findall(r"___dataclass_fields\([^)]*\)", text)))


@pytest.mark.parametrize(
    "make",
    [
        lambda: causal_lower_right() + SlidingWindowBias(31) + AlibiBias(2),
        lambda: DocumentBias.from_seqlens([3, 5]) + causal_lower_right() + SoftcapBias(3.0),
        lambda: KeyRangeBias(end=torch.tensor([6])) + causal_upper_left(),
    ],
)
def test_a_compiled_call_guards_no_dataclass_default(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[], AttnBias]
) -> None:
    """The route's records (terms, plan, mask program) are built with every field named:
    torch.compile (2.11) guards a default that a frozen dataclass's constructor takes through
    ``___dataclass_fields``, a Python call on each run of the compiled function, ~6 of them a
    call (a third of a compiled block's host time on an H100's host)."""
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    bias = make()
    q, k, v = qkv(length_q=8, length_kv=8, dtype=torch.float32)
    found = _dataclass_default_guards(
        lambda q, k, v: attnbias.sdpa(q, k, v, attn_mask=bias), q, k, v
    )
    assert not found, f"guards on a dataclass's defaults: {found}"


def _prefix(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (kv_idx <= q_idx) | (kv_idx < 64)


@pytest.mark.gpu
@pytest.mark.parametrize("needs_grad", [False, True])
@pytest.mark.parametrize("length_q", [1, 256])
@pytest.mark.parametrize(
    "make",
    [
        lambda: causal_lower_right() + SlidingWindowBias(31) + AlibiBias(2),
        lambda: (
            DocumentBias.from_seqlens([100, 156], device="cuda")
            + causal_lower_right()
            + SoftcapBias(30.0)
        ),
        lambda: KeyRangeBias(end=torch.tensor([200], device="cuda")) + causal_lower_right(),
        lambda: ModBias(mask_mod=_prefix),
    ],
    ids=["window_alibi", "documents_softcap", "key_range", "mod_prefix"],
)
def test_on_the_gpu_a_compiled_call_guards_no_dataclass_default(
    make: Callable[[], AttnBias], length_q: int, needs_grad: bool
) -> None:
    """The GPU routes under torch.compile (the Triton kernel, the decode kernel), as the CPU
    test above; the guard exists on torch 2.11, whose host pays a Python call per guard."""
    if needs_grad and length_q == 1:
        pytest.skip("a decode call trains no differently from a short training call")
    bias = make()
    if length_q == 1 and any(isinstance(p, DocumentBias) for p in parts_of(bias)):
        pytest.skip("its documents have one id per query of a 256-row call")
    q, k, v = (
        t.cuda().requires_grad_(needs_grad)
        for t in qkv(length_q=length_q, length_kv=256, dtype=torch.bfloat16)
    )
    found = _dataclass_default_guards(
        lambda q, k, v: attnbias.sdpa(q, k, v, attn_mask=bias), q, k, v
    )
    assert not found, f"guards on a dataclass's defaults: {found}"


def _frozen_records() -> list[type]:
    """Every frozen dataclass the library defines."""
    found = []
    for name, module in list(sys.modules.items()):
        if name == "attnbias" or name.startswith("attnbias."):
            for value in vars(module).values():
                if (
                    isinstance(value, type)
                    and dataclasses.is_dataclass(value)
                    and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
                    and value.__module__ == name
                ):
                    found.append(value)
    return found


@pytest.mark.parametrize("needs_grad", [False, True])
def test_a_call_builds_its_records_with_every_field_named(
    monkeypatch: pytest.MonkeyPatch, needs_grad: bool
) -> None:
    """What torch.compile traces of a call (lowering, planning, the exact route) builds each
    frozen dataclass with every field given: a default taken there becomes a guard that costs
    a Python call on each run of the compiled function in torch 2.11 (the test above shows it
    where that version runs). Checked on the eager route, any torch version."""
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    missing: list[tuple[str, tuple[str, ...]]] = []

    def named(patch: pytest.MonkeyPatch, cls: type) -> None:
        init = cls.__init__
        names = [f.name for f in dataclasses.fields(cls) if f.init]

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            left = tuple(n for n in names[len(args) :] if n not in kwargs)
            if left:
                missing.append((cls.__qualname__, left))
            init(self, *args, **kwargs)

        patch.setattr(cls, "__init__", __init__)

    # the training kernel's calls (L = 16), and the decode kernel's (L = 1) where the bias
    # holds no tensor of the query's length
    makers = [
        *((make, (16,) if kind in ("documents", "materialized") else (16, 1))
          for kind, make in KIND_BIASES.items()),
        (lambda: causal_lower_right() + SlidingWindowBias(5) + AlibiBias(2), (16, 1)),
        (lambda: DocumentBias.from_seqlens([6, 10]) + causal_lower_right() + SoftcapBias(3.0),
         (16,)),
        (lambda: KeyRangeBias(end=torch.tensor([12])) + causal_upper_left(), (16, 1)),
    ]  # fmt: skip
    for make, lengths in makers:
        for length_q in lengths:
            bias = make()  # (built by the user, before any trace)
            q, k, v = qkv(
                length_q=length_q, length_kv=16, dtype=torch.float32, needs_grad=needs_grad
            )
            with pytest.MonkeyPatch.context() as patch:
                for cls in _frozen_records():
                    named(patch, cls)
                out = attnbias.sdpa(q, k, v, attn_mask=bias)
                spec = make_spec(q, k, v, bias, False, None, 0.0, False)
                plan(dataclasses.replace(spec, compiling=True))
                if needs_grad:
                    out.sum().backward()
            assert not missing, f"records built with defaults: {sorted(set(missing))}"
    if needs_grad:
        return  # a paged cache serves inference only
    pool_k, pool_v = (torch.randn(10, 4, 2, 16) for _ in range(2))  # pages of 4 tokens
    table = torch.tensor([[7, 2, 9, 0], [7, 2, 4, 4], [1, 0, 0, 0]], dtype=torch.int32)
    paged = PagedKV(table, torch.tensor([13, 10, 3], dtype=torch.int32))
    for rest in (causal_lower_right(), causal_lower_right() + SlidingWindowBias(3)):
        query = torch.randn(3, 4, 2, 16)
        with pytest.MonkeyPatch.context() as patch:
            for cls in _frozen_records():
                named(patch, cls)
            attnbias.sdpa(query, pool_k, pool_v, attn_mask=paged + rest, enable_gqa=True)
        assert not missing, f"paged: records built with defaults: {sorted(set(missing))}"


def test_triton_refuses_trainable_slopes_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their gradient comes from the kernel's eager path only: a traced call goes elsewhere."""
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: True)
    q, k, v = qkv(head_dim=16, needs_grad=True)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    spec = make_spec(q, k, v, AlibiBias(slopes=slopes), False, None, 0.0, False)
    assert not BACKENDS["triton"].not_supported_reasons(spec)
    traced = dataclasses.replace(spec, compiling=True)
    (reason,) = BACKENDS["triton"].not_supported_reasons(traced)
    assert "ALiBi slopes that require grad while torch.compile traces" in reason


def test_the_policy_tables_name_only_real_kinds_forms_and_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mistyped name in the tables is an error at import, not an empty backend order."""
    from attnbias import policy
    from attnbias.terms import KINDS

    planner.check_policy()  # the tables as they are
    assert {spec_of(make()).terms.kind for make in KIND_BIASES.values()} == set(KINDS)
    mistyped_kind = {**PRIORITY["hopper"], "casual": policy.Order(("fa4",))}
    typos = [
        ("PRIORITY", {**PRIORITY, "hopper": mistyped_kind}, "'casual'"),
        ("FALLBACK", ("triton", "sdpa+msk"), "'sdpa+msk'"),
        ("FORM_ROUTES", {**policy.FORM_ROUTES, "nomask": "sdpa"}, "'nomask'"),
    ]
    for name, value, named in typos:
        with monkeypatch.context() as patch:
            patch.setattr(planner, name, value)
            with pytest.raises(ValueError, match=re.escape(named)):
                planner.check_policy()


def test_kinds_and_forms_are_enums_that_read_as_their_words() -> None:
    """Kinds and forms are enum members: the tables are keyed by them (a misspelt member is
    an error where it is written), and they read as the words they were (messages,
    explain(), the routing cache's classes)."""
    from attnbias import policy
    from attnbias.kinds import Form, Kind
    from attnbias.spec import call_form

    kinds = {spec_of(make()).terms.kind for make in KIND_BIASES.values()}
    assert all(isinstance(kind, Kind) for kind in kinds)
    assert all(isinstance(kind, Kind) for table in PRIORITY.values() for kind in table)
    assert all(isinstance(form, Form) for form in policy.FORM_ROUTES)
    assert all(isinstance(form, Form) for b in BACKENDS.values() for form in b.forms)
    q, k, v = qkv()
    assert call_form(q, None) is Form.NO_MASK and call_form(q, q[0, 0] @ k[0, 0].T) is Form.TENSOR
    assert str(Kind.MOD_MASK) == f"{Kind.MOD_MASK}" == "mod mask" == Kind.MOD_MASK
    assert f"{Form.NO_MASK:>8}" == " no mask"
    window = attnbias.causal_lower_right() + attnbias.SlidingWindowBias(4)
    assert "order (cpu, band, inference)" in attnbias.explain(q, k, v, attn_mask=window)


@pytest.mark.parametrize("needs_grad", [False, True])
def test_planning_launches_nothing(monkeypatch: pytest.MonkeyPatch, needs_grad: bool) -> None:
    """Planning is arithmetic on the spec and the tables: on a faked Hopper GPU, every kind of
    bias, long enough to pass the decode's query limit, is planned with every kernel launch and
    the block lists' reach refused."""
    from attnbias.kernels import launch
    from attnbias.kernels import masks as kernel_masks

    fake_gpu(monkeypatch)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("planning launched a kernel")

    monkeypatch.setattr(launch, "launcher", refuse)
    monkeypatch.setattr(kernel_masks, "visited_keys_per_row", refuse)
    for kind, make in KIND_BIASES.items():
        spec = spec_of(make(), length_q=40, length_kv=40, needs_grad=needs_grad)
        chosen = plan(spec)
        assert chosen.backend.name in BACKENDS, kind
    # the documents' layout (their ids read on the host) is a fact the dispatcher works out
    # before planning: planning a spec that has it reads no ids
    from attnbias.backends import documents as backend_documents

    spec = spec_of(DocumentBias.from_seqlens([16, 24]) + causal_lower_right(), length_q=40,
                   length_kv=40, needs_grad=needs_grad)  # fmt: skip
    ready = attnbias.functional.plan_spec(spec).spec
    assert ready.documents is not None
    monkeypatch.setattr(backend_documents, "documents_layout", refuse)
    assert plan(ready).backend.name in BACKENDS

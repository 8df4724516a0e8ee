"""The planner on CPU: its walk over the priority lists, ``use_backends``, ``explain``, the choice
for every kind of bias on a faked Hopper GPU, the weighing of predicted times, FlashAttention 4's
reasons, and FlashAttention 4's argument translation checked against the oracle through a
pure-torch stand-in.

Nothing here needs a GPU: the GPU generation, FlashAttention 4's install and device checks and
``flash_attn.cute.flash_attn_func`` itself are replaced with monkeypatch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor

import attnbias
import attnbias.backends.fa4 as fa4
import attnbias.backends.triton as triton_backend
from attnbias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    planner,
    use_backends,
)
from attnbias.backends import BACKENDS, Backend
from attnbias.backends.documents import documents_layout
from attnbias.planner import PRIORITY, kept_pairs, plan
from attnbias.policy import Cost
from attnbias.spec import Spec, make_spec
from attnbias.testing.oracle import (
    assert_close_to_oracle,
    assert_shard_pair_close,
    attention,
    run_with_grads,
    whole_call,
)
from attnbias.testing.strategies import Problem

NAMES = ("fa4", "triton-decode", "triton", "sdpa", "sdpa+mask", "reference")
# The backends a priority list leaves out are tried after it, in this order; FlashAttention 4
# is tried only where a list names it.
FALLBACK = ("triton-decode", "triton", "sdpa", "sdpa+mask", "reference")


# ------------------------------------------------------------------------------------------
# Building calls


@pytest.fixture(autouse=True)
def lists_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests of the walk see the priority lists alone (their small calls would otherwise
    be weighed by predicted host time); the weighing's tests set the costs they need."""
    monkeypatch.setattr(planner, "COSTS", {})


def qkv(
    *,
    length_q: int = 16,
    length_kv: int = 16,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    heads_q: int = 2,
    heads_kv: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    needs_grad: bool = False,
    batch: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)

    def draw(heads: int, length: int, dim: int) -> Tensor:
        x = torch.randn(batch, heads, length, dim, generator=generator).to(dtype)
        return x.requires_grad_(needs_grad)

    return (
        draw(heads_q, length_q, head_dim),
        draw(heads_kv, length_kv, head_dim),
        draw(heads_kv, length_kv, head_dim if head_dim_v is None else head_dim_v),
    )


def spec_of(
    bias: AttnBias | None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    **shape: Any,
) -> Spec:
    q, k, v = qkv(**shape)
    return make_spec(q, k, v, bias, is_causal, scale, dropout_p, q.shape[1] != k.shape[1])


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


def set_generation(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(planner, "generation", lambda device: name)


def skip_without_the_interpreter() -> None:
    """ModBias calls on a faked GPU build their block lists with the Triton kernels on CPU
    tensors (the planner's reach, explain's tile counts): under Triton's interpreter only, which
    a machine with CUDA does not run (it is chosen when Triton is first imported)."""
    if torch.cuda.is_available():
        pytest.skip("block lists of CPU tensors need Triton's interpreter (CPU-only machines)")


def fake_gpu(
    monkeypatch: pytest.MonkeyPatch,
    *,
    capability: tuple[int, int] = (9, 0),
    fa4_installed: bool = True,
) -> None:
    """CPU tensors that the planner and FlashAttention 4's checks take for a GPU's."""
    set_generation(monkeypatch, {9: "hopper", 10: "blackwell"}.get(capability[0], "cuda"))
    monkeypatch.setattr(fa4, "_on_cuda", lambda device: True)
    monkeypatch.setattr(fa4, "_capability", lambda index: capability)
    monkeypatch.setattr(fa4, "_installed", lambda: fa4_installed)
    # the Triton kernel takes CPU tensors only under its interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_backend, "_triton_installed", lambda: True)


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
            ("triton-decode", "fa4", "triton", "sdpa", "sdpa+mask", "reference"),
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
            ("triton-decode", "fa4", "sdpa", "triton", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "softcap",
            False,
            ("triton-decode", "fa4", "triton", "sdpa", "sdpa+mask", "reference"),
        ),
        (
            "hopper",
            "alibi",
            False,
            ("triton-decode", "triton", "fa4", "sdpa", "sdpa+mask", "reference"),
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


HOPPER_BAND = ("triton-decode", "fa4", "triton", "sdpa", "sdpa+mask", "reference")


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
    assert chosen.order == ("triton-decode", "triton", "sdpa", "sdpa+mask", "reference")
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
            assert chosen.order == ("triton-decode", "sdpa", "sdpa+mask", "reference")
            assert chosen.excluded == {"fa4", "triton"}
            assert chosen.heading.endswith("; excluded fa4, triton")
        assert plan(spec).order == ("triton-decode", "triton", "sdpa", "sdpa+mask", "reference")
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
        assert plan(spec).order == ("triton-decode", "fa4", "triton", "sdpa+mask", "reference")
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
    known = r"the backends are fa4, triton-decode, triton, sdpa, sdpa\+mask, reference"
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
        "triton-decode > fa4 > triton > sdpa > reference",
        "  fa4: no A; no B",
        "  triton-decode: no D",
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
    assert spec.terms.kind == "mod mask"
    chosen = plan(spec)
    assert chosen.backend.name == expected
    if expected == "triton":
        assert chosen.order[0] == "triton-decode" and chosen.order[1] == "triton"
        assert "keys per block of query rows, below 64" in chosen.heading, chosen.heading
    else:
        assert chosen.heading == "hopper, mod mask, inference"
    # with gradients, FlashAttention 4 first whatever the reach
    assert plan(spec_of(bias, length_q=160, length_kv=160, needs_grad=True)).backend.name == "fa4"


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


def fa4_reasons(spec: Spec) -> list[str]:
    return BACKENDS["fa4"].not_supported_reasons(spec)


@pytest.mark.parametrize(
    ("capability", "bias", "kwargs"),
    [
        ((9, 0), causal_upper_left(), {}),
        ((9, 0), SlidingWindowBias(5, 2), {"length_q": 5, "length_kv": 16}),
        ((9, 0), SoftcapBias(1.0) + causal_lower_right(), {"length_q": 16, "length_kv": 5}),
        ((9, 0), None, {"heads_q": 4, "heads_kv": 1, "dtype": torch.float16}),
        ((9, 0), SlidingWindowBias(3), {"head_dim": 128}),
        ((9, 0), SlidingWindowBias(3), {"head_dim": 64, "dtype": torch.float16}),
        ((9, 0), SlidingWindowBias(3), {"head_dim": 256, "needs_grad": True}),
        ((9, 0), SlidingWindowBias(3), {"scale": 1e-3}),
        ((10, 0), SoftcapBias(2.0), {"head_dim": 256}),
        ((10, 0), SoftcapBias(2.0), {"head_dim": 128, "needs_grad": True}),
    ],
)
def test_fa4_takes(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    bias: AttnBias | None,
    kwargs: dict[str, Any],
) -> None:
    fake_gpu(monkeypatch, capability=capability)
    assert fa4_reasons(spec_of(bias, **kwargs)) == []


# Each differs from a call FlashAttention 4 takes by one thing, and gets one reason naming it.
REFUSALS: dict[str, tuple[dict[str, Any], Callable[[], Spec], str]] = {
    "float32": ({}, lambda: spec_of(None, dtype=torch.float32), "dtype torch.float32 is not"),
    "head_dim_36_bf16": (
        {},
        lambda: spec_of(None, head_dim=36),
        "head dims (36, 36) are not multiples of 8",
    ),
    "head_dim_v_20_fp16": (
        {},
        lambda: spec_of(None, head_dim_v=20, dtype=torch.float16),
        "head dims (64, 20) are not multiples of 8",
    ),
    "head_dim_80": (
        {},
        lambda: spec_of(None, head_dim=80),
        "head dims (80, 80) are not among those checked against the oracle",
    ),
    "head_dim_512": (
        {},
        lambda: spec_of(None, head_dim=512),
        "head dims (512, 512) are outside 8..256 on compute capability 9",
    ),
    "head_dim_512_blackwell": (
        {"capability": (10, 0)},
        lambda: spec_of(None, head_dim=512),
        "head dims (512, 512) are not supported on compute capability 10",
    ),
    "softcap_backward_256_blackwell": (
        {"capability": (10, 0)},
        lambda: spec_of(SoftcapBias(2.0), head_dim=256, needs_grad=True),
        "its backward at head dim 256 has no soft-cap on capability 10",
    ),
    "capability_8": (
        {"capability": (8, 0)},
        lambda: spec_of(causal_upper_left()),
        "compute capability 8.x is not one of FlashAttention 4's here (9.x, 10.x)",
    ),
    "capability_12": (
        {"capability": (12, 0)},
        lambda: spec_of(causal_upper_left()),
        "compute capability 12.x is not one of",
    ),
    "scale_0": ({}, lambda: spec_of(causal_upper_left(), scale=0.0), "scale=0.0 is not positive"),
    "scale_negative": (
        {},
        lambda: spec_of(causal_upper_left(), scale=-0.5),
        "scale=-0.5 is not positive",
    ),
    "empty_band": (
        {},
        lambda: spec_of(causal_upper_left() + SlidingWindowBias(0, None), length_q=4, length_kv=8),
        "4 <= j - i <= 0 keeps no pair",
    ),
    "compiling": (
        {},
        lambda: dataclasses.replace(spec_of(causal_upper_left()), compiling=True),
        "torch.compile cannot trace FlashAttention 4",
    ),
    "dropout": (
        {},
        lambda: spec_of(causal_upper_left(), dropout_p=0.25),
        "dropout_p=0.25: FlashAttention 4 has no dropout",
    ),
    "documents_of_rows_that_would_be_copied": (
        {},
        lambda: spec_of(DocumentBias.from_seqlens([6, 10]), batch=2),
        "documents at batch size 2 where q, k and v are not (B, L, H, E) in memory",
    ),
    "documents_one_sided_in_a_later_row": (
        {},
        lambda: spec_of(
            DocumentBias(
                torch.tensor([[0] * 8 + [1] * 8, [0] * 8 + [1] * 8]),
                torch.tensor([[0] * 8 + [1] * 8, [0] * 16]),
            ),
            batch=2,
            heads_q=1,  # one head: (B, H, L, E) memory is (B, L, H, E) too
            heads_kv=1,
        ),
        "a document has queries but no keys, or keys but no queries (batch row 1)",
    ),
    "documents_one_sided": (
        {},
        lambda: spec_of(
            DocumentBias(torch.tensor([0] * 8 + [1] * 8), torch.tensor([0] * 8 + [2] * 8))
        ),
        "a document has queries but no keys, or keys but no queries",
    ),
    "documents_uneven_ends_with_band": (
        {},
        lambda: spec_of(
            DocumentBias.from_seqlens([4, 12], [10, 6]) + causal_lower_right(),
        ),
        "do not end at one offset, so the band is no single window",
    ),
    "two_document_biases": (
        {},
        lambda: spec_of(DocumentBias.from_seqlens([6, 10]) + DocumentBias.from_seqlens([8, 8])),
        "more than one DocumentBias in the sum",
    ),
    "documents_with_alibi": (
        {},
        lambda: spec_of(DocumentBias.from_seqlens([6, 10]) + AlibiBias(num_heads=2)),
        "ALiBi with documents",
    ),
    "alibi_with_softcap": (
        {},
        lambda: spec_of(AlibiBias(num_heads=2) + SoftcapBias(5.0)),
        "ALiBi together with soft-cap",
    ),
    "alibi_gqa": (
        {},
        lambda: spec_of(AlibiBias(num_heads=4), heads_q=4, heads_kv=2),
        "ALiBi with grouped-query attention (Hq != Hkv)",
    ),
    "alibi_slopes_require_grad": (
        {},
        lambda: spec_of(AlibiBias(slopes=torch.tensor([0.5, 0.25], requires_grad=True))),
        "ALiBi slopes that require grad",
    ),
    "tensor_bias": (
        {},
        lambda: spec_of(TensorBias(torch.zeros(16, 16)) + SoftcapBias(2.0)),
        "TensorBias has no FlashAttention 4 form",
    ),
    "key_range": (
        {},
        lambda: spec_of(KeyRangeBias(end=[9]) + causal_lower_right()),
        "a key range (KeyRangeBias): its seqused_k form, for ranges from 0, is not checked",
    ),
    "empty_dim": (
        {},
        lambda: spec_of(None, length_q=0),
        "an empty dimension in (B, Hq, L, S)=(1, 2, 0, 16)",
    ),
    "not_installed": (
        {"fa4_installed": False},
        lambda: spec_of(causal_upper_left()),
        'flash_attn.cute is not installed (pip install "attnbias[fa4]")',
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_fa4_reasons_name_the_value(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    gpu, make, expected = REFUSALS[name]
    fake_gpu(monkeypatch, **gpu)
    reasons = fa4_reasons(make())
    assert len(reasons) == 1, reasons
    assert expected in reasons[0]


def test_fa4_on_cpu_tensors_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa4, "_installed", lambda: True)
    assert fa4_reasons(spec_of(causal_upper_left())) == [
        "FlashAttention 4 needs CUDA tensors and these are on cpu"
    ]


def test_the_empty_band_is_empty_and_would_be_unmasked_on_fa4() -> None:
    """Why FlashAttention 4 refuses the empty band: its window has left + right < 0, which
    FlashAttention reads as no window at all."""
    bias = causal_upper_left() + SlidingWindowBias(0, None)
    assert torch.isneginf(bias.materialize(shape=(4, 8))).all()
    spec = spec_of(bias, length_q=4, length_kv=8)
    assert spec.terms.band_is_empty
    assert fa4.window_size(spec.terms, 8 - 4) == (0, -4)
    q, k, v = (x.transpose(1, 2) for x in qkv(length_q=4, length_kv=8))
    out, _ = fa4_standin(q, k, v, window_size=(0, -4))
    assert out.abs().sum() > 0  # not the zeros the bias asks for


# ------------------------------------------------------------------------------------------
# 3. FlashAttention 4's argument translation, through a stand-in with its documented semantics


def fa4_standin(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    score_mod: Any = None,
    score_mod_bwd: Any = None,
    aux_tensors: list[Tensor] | None = None,
    pack_gqa: bool | None = None,
    return_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``flash_attn.cute.flash_attn_func`` in float64 torch, on ``(B, L, H, E)`` tensors.

    The library's score modifiers arrive as markers: ``("softcap", cap)`` for
    ``cap * tanh(s / cap)``, and ``"alibi"`` with ``aux_tensors=[slopes]`` for FlashAttention 2's
    ``alibi_slopes``, ``-slope[h] * |i + (S - L) - j|``.

    FlashAttention keeps ``i + (S - L) - left <= j <= i + (S - L) + right`` (``None``: that
    side is open); ``causal=True`` means ``right = 0``; a window with ``left + right < 0``
    (in particular two negative sides) is read as no window at all. Soft-cap is
    ``cap * tanh(s / cap)`` on the scaled scores, and a query head ``h`` uses the key/value
    head ``h // (Hq // Hkv)``. A row that keeps no key gives 0 (and a log-sum-exp of ``-inf``:
    ``return_lse=True`` gives it, ``(B, H, L)`` float32, natural log).
    """
    scores, value = _standin_scores(
        q, k, v, softmax_scale, causal, window_size, softcap, score_mod, score_mod_bwd,
        aux_tensors, pack_gqa,
    )  # fmt: skip
    any_kept = scores.isfinite().any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~any_kept, 0.0), dim=-1) * any_kept
    out = (weights @ value).transpose(1, 2).to(q.dtype)
    return out, (torch.logsumexp(scores, dim=-1).float() if return_lse else None)


def _standin_scores(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None,
    causal: bool,
    window_size: tuple[int | None, int | None],
    softcap: float,
    score_mod: Any,
    score_mod_bwd: Any,
    aux_tensors: list[Tensor] | None,
    pack_gqa: bool | None,
) -> tuple[Tensor, Tensor]:
    """The stand-in's float64 ``(B, Hq, L, S)`` scores (``-inf`` where not kept) and its
    values repeated to ``Hq`` heads, ``(B, Hq, S, Ev)``."""
    for tensor in (q, k, v):
        assert tensor.dim() == 4 and tensor.stride(-1) == 1, tensor.stride()
    _, length_q, heads_q, head_dim = q.shape
    length_kv, heads_kv = k.shape[1], k.shape[2]
    assert heads_q % heads_kv == 0
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
    query, key, value = (x.double().transpose(1, 2) for x in (q, k, v))  # (B, H, seq, E)
    key = key.repeat_interleave(heads_q // heads_kv, dim=1)
    value = value.repeat_interleave(heads_q // heads_kv, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scale
    assert softcap == 0.0, "the library passes soft-cap as a score modifier"
    assert (score_mod is None) == (score_mod_bwd is None)
    if isinstance(score_mod, tuple):
        kind, cap = score_mod
        assert kind == "softcap" and score_mod_bwd == ("softcap_bwd", cap)
        scores = cap * torch.tanh(scores / cap)
    assert (score_mod == "alibi") == (aux_tensors is not None)
    if aux_tensors is not None:
        (slopes,) = aux_tensors
        assert slopes.shape == (heads_q,) and pack_gqa is False
        rows = torch.arange(length_q)[:, None] + (length_kv - length_q)
        distance = (rows - torch.arange(length_kv)[None, :]).abs().double()
        scores = scores - slopes.double()[:, None, None] * distance
    left, right = window_size
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    rows = torch.arange(length_q)[:, None] + (length_kv - length_q)
    cols = torch.arange(length_kv)[None, :]
    keep = torch.ones(length_q, length_kv, dtype=torch.bool)
    if left is not None:
        keep &= cols >= rows - left
    if right is not None:
        keep &= cols <= rows + right
    return scores.masked_fill(~keep, -math.inf), value


def fa4_bwd_standin(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    dout: Tensor,
    lse: Tensor,
    softmax_scale: float,
    causal: bool = False,
    softcap: float = 0.0,
    window_size_left: int | None = None,
    window_size_right: int | None = None,
    score_mod: Any = None,
    score_mod_bwd: Any = None,
    aux_tensors: list[Tensor] | None = None,
    pack_gqa: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``flash_attn.cute.interface._flash_attn_bwd`` in float64 torch: the gradients of the
    share ``P = exp(S - lse)`` of the keys in an output ``out`` whose log-sum-exp is ``lse``,
    ``dS = P (dP - rowsum(dO * out))``, by autograd of the scores."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    scores, value = _standin_scores(
        *leaves, softmax_scale, causal, (window_size_left, window_size_right), softcap,
        score_mod, score_mod_bwd, aux_tensors, pack_gqa,
    )  # fmt: skip
    lse = lse.double()[..., None]
    probs = torch.exp(scores - torch.where(lse == -math.inf, math.inf, lse))
    out, dout = (x.double().transpose(1, 2) for x in (out, dout))
    delta = (out * dout).sum(-1, keepdim=True)
    objective = (dout * (probs @ value)).sum() - (delta * probs.sum(-1, keepdim=True)).sum()
    dq, dk, dv = torch.autograd.grad(objective, leaves)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# A shard pair's bias for context parallelism: keys 8..20 of a 12 x 20 call (ALiBi unshifted).
# (bias, key/value heads for 4 query heads)
FA4_PAIR_BIASES: dict[str, tuple[Callable[[], AttnBias], int]] = {
    "causal": (causal_lower_right, 2),
    "window_softcap": (lambda: SlidingWindowBias(9, 2) + SoftcapBias(3.0), 1),
    # rows 0..7 keep nothing in this pair, and something in the whole call
    "alibi_causal": (lambda: AlibiBias(num_heads=4) + causal_upper_left(), 4),
}


@pytest.mark.parametrize("name", list(FA4_PAIR_BIASES))
def test_fa4_gives_a_shard_pair_what_the_exact_path_does(standin: Recorder, name: str) -> None:
    """A shard pair's output, log-sum-exp and share of a merged output's gradients through
    FlashAttention 4's translation (the stand-ins) within the oracle's budget."""
    from attnbias.terms import Block, Call

    make_bias, heads_kv = FA4_PAIR_BIASES[name]
    batch, heads_q, length_q, length_kv = 2, 4, 12, 20
    generator = torch.Generator().manual_seed(3)
    q, grad_out = (torch.randn(batch, heads_q, length_q, 16, generator=generator) for _ in "qg")
    k, v = (torch.randn(batch, heads_kv, length_kv, 16, generator=generator) for _ in "kv")
    bias = make_bias()
    merged_out, merged_lse = whole_call(q, k, v, bias)
    pair = bias.sub_block(Call(batch, heads_q, length_q, length_kv), Block(0, 8, length_q, 12))
    inputs = [t.to(torch.bfloat16) for t in (q, k[:, :, 8:], v[:, :, 8:])]
    spec = make_spec(*inputs, pair, False, None, 0.0, True, needs_lse=True)
    assert BACKENDS["fa4"].not_supported_reasons(spec) == []
    out, lse = BACKENDS["fa4"].forward_lse(spec)
    dq, dk, dv, found = BACKENDS["fa4"].backward_lse(
        spec, grad_out.to(torch.bfloat16), merged_out.to(torch.bfloat16), merged_lse, []
    )
    assert found == []
    empty = assert_shard_pair_close(
        [out, lse, dq, dk, dv], q, k, v, bias, slice(8, None), grad_out, torch.bfloat16
    )
    assert bool(empty.any()) == (name == "alibi_causal")


def test_fa4_refuses_the_log_sum_exp_of_documents(standin: Recorder) -> None:
    q, k, v = qkv()
    spec = make_spec(q, k, v, DocumentBias.from_seqlens([6, 10]), False, None, 0.0, False,
                     needs_lse=True)  # fmt: skip
    reasons = BACKENDS["fa4"].not_supported_reasons(spec)
    assert reasons == ["log-sum-exp of documents (context parallelism) is not wired"], reasons


def test_the_standin_matches_the_oracle_on_flash_attention_windows() -> None:
    """The stand-in itself, on windows ``SlidingWindowBias`` defines as FlashAttention's."""
    q, k, v = qkv(length_q=7, length_kv=12, heads_q=4, heads_kv=2, dtype=torch.float64)
    for left, right in ((None, None), (2, 0), (None, 0), (3, None), (1, 4), (0, 0)):
        out, _ = fa4_standin(*(x.transpose(1, 2) for x in (q, k, v)), window_size=(left, right))
        expected = attention(q, k, v, SlidingWindowBias(left, right), enable_gqa=True)
        torch.testing.assert_close(out.transpose(1, 2), expected)
    out, _ = fa4_standin(
        *(x.transpose(1, 2) for x in (q, k, v)),
        causal=True,
        score_mod=("softcap", 2.0),
        score_mod_bwd=("softcap_bwd", 2.0),
    )
    expected = attention(q, k, v, causal_lower_right() + SoftcapBias(2.0), enable_gqa=True)
    torch.testing.assert_close(out.transpose(1, 2), expected)


def fa4_varlen_standin(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``flash_attn_varlen_func`` on ``(total, H, E)``: each sequence on its own, with its own
    ``S - L`` in the window."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in itertools.pairwise(bounds_q))
    assert max_seqlen_k == max(b - a for a, b in itertools.pairwise(bounds_k))
    outs = [
        fa4_standin(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], **kwargs)[0][0]
        for (q0, q1), (k0, k1) in zip(
            itertools.pairwise(bounds_q), itertools.pairwise(bounds_k), strict=True
        )
    ]
    assert bounds_q[-1] == q.shape[0] and bounds_k[-1] == k.shape[0]
    return torch.cat(outs), None


class Recorder:
    """Stands in for ``flash_attn_func`` and keeps the arguments of each call."""

    def __init__(self, function: Any = fa4_standin) -> None:
        self.calls: list[dict[str, Any]] = []
        self.function = function

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> tuple[Tensor, None]:
        self.calls.append(kwargs)
        return self.function(q, k, v, **kwargs)  # type: ignore[no-any-return]


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    fake_gpu(monkeypatch)
    recorder = Recorder()
    monkeypatch.setattr(fa4, "_flash_attn_func", lambda: recorder)
    monkeypatch.setattr(fa4, "_flash_attn_varlen_func", lambda: Recorder(fa4_varlen_standin))
    monkeypatch.setattr(fa4, "_flash_attn_bwd", lambda: fa4_bwd_standin)
    # the stand-in checks the translation at small head dims
    monkeypatch.setattr(fa4, "CHECKED_HEAD_DIMS", tuple(range(8, 257, 8)))
    # the score modifiers are CuTe code: the stand-in gets markers for them
    monkeypatch.setattr(fa4, "_alibi_score_mods", lambda: ("alibi", "alibi_bwd"))
    monkeypatch.setattr(
        fa4, "_softcap_score_mods", lambda cap: (("softcap", cap), ("softcap_bwd", cap))
    )
    return recorder


def check_on_fa4(problem: Problem, recorder: Recorder, seed: int = 0) -> None:
    """Twice, on new contents: the second call runs on the decision the first one cached."""
    recorder.calls.clear()
    for attempt in range(2):
        _check_once_on_fa4(problem, seed + attempt)
    assert len(recorder.calls) == 2
    assert recorder.calls[0]["window_size"] == recorder.calls[1]["window_size"]


def _check_once_on_fa4(problem: Problem, seed: int) -> None:
    q, k, v, grad_out = problem.tensors(seed)
    kwargs = dict(
        scale=problem.scale,
        is_causal=problem.is_causal,
        enable_gqa=problem.heads_q != problem.heads_kv,
    )
    with use_backends("fa4"):
        route = attnbias.explain(q, k, v, attn_mask=problem.bias, **kwargs)
        results = run_with_grads(
            lambda *t: attnbias.sdpa(*t, attn_mask=problem.bias, **kwargs), (q, k, v), grad_out
        )
    assert route.startswith("fa4:"), route
    expected = run_with_grads(
        lambda *t: attention(*t, problem.bias, **kwargs),
        (q.double(), k.double(), v.double()),
        grad_out.double(),
    )
    low = run_with_grads(
        lambda *t: attention(*t, problem.bias, dtype=problem.dtype, **kwargs), (q, k, v), grad_out
    )
    assert results[0].dtype == problem.dtype
    assert results[0].shape == q.shape
    assert_close_to_oracle(results, expected, low, problem.dtype, ("out", "dq", "dk", "dv"))


@dataclasses.dataclass(frozen=True)
class FA4Case:
    bias: AttnBias
    length_q: int
    length_kv: int
    window: tuple[int | None, int | None]  # the window_size FlashAttention 4 gets
    softcap: float = 0.0  # the softcap it gets
    is_causal: bool = False
    heads: tuple[int, int] = (2, 2)  # (Hq, Hkv)
    scale: float | None = None


FA4_CASES = {
    "causal_upper_left_l_lt_s": FA4Case(causal_upper_left(), 8, 16, (None, -8)),
    "causal_upper_left_l_gt_s": FA4Case(causal_upper_left(), 16, 8, (None, 8)),
    "causal_lower_right_l_gt_s": FA4Case(causal_lower_right(), 16, 8, (None, 0)),
    "causal_lower_right_l_lt_s": FA4Case(causal_lower_right(), 8, 16, (None, 0)),
    "is_causal": FA4Case(SlidingWindowBias(None, None), 10, 10, (None, 0), is_causal=True),
    "window": FA4Case(SlidingWindowBias(3), 12, 12, (3, 0)),
    "window_two_sided": FA4Case(SlidingWindowBias(2, 3), 9, 15, (2, 3)),
    "window_left_open_l_gt_s": FA4Case(SlidingWindowBias(None, 2), 15, 9, (None, 2)),
    "window_l_gt_s_empty_rows": FA4Case(SlidingWindowBias(1, 1), 12, 5, (1, 1)),
    "window_upper_left": FA4Case(causal_upper_left() + SlidingWindowBias(10), 6, 12, (10, -6)),
    "is_causal_window_right": FA4Case(
        SlidingWindowBias(None, 3), 12, 20, (None, -8), is_causal=True
    ),
    "wide_window_is_none": FA4Case(SlidingWindowBias(20, 20), 8, 8, (None, None)),
    "gemma2_gqa_scale": FA4Case(
        causal_lower_right() + SlidingWindowBias(7) + SoftcapBias(2.0),
        16,
        16,
        (7, 0),
        softcap=2.0,
        heads=(4, 2),
        scale=0.3,
    ),
    "softcap_gqa": FA4Case(SoftcapBias(1.5), 10, 14, (None, None), softcap=1.5, heads=(4, 2)),
    "softcap_mqa_scale": FA4Case(
        SoftcapBias(0.5) + causal_upper_left(),
        9,
        6,
        (None, 3),
        softcap=0.5,
        heads=(4, 1),
        scale=1.7,
    ),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(FA4_CASES))
def test_fa4_arguments_against_the_oracle(standin: Recorder, name: str, dtype: torch.dtype) -> None:
    case = FA4_CASES[name]
    problem = Problem(
        batch=2,
        heads_q=case.heads[0],
        heads_kv=case.heads[1],
        length_q=case.length_q,
        length_kv=case.length_kv,
        head_dim=16,
        dtype=dtype,
        bias=case.bias,
        is_causal=case.is_causal,
        scale=case.scale,
    )
    check_on_fa4(problem, standin)
    call = standin.calls[0]
    assert call["window_size"] == case.window
    assert call.get("score_mod") == (("softcap", case.softcap) if case.softcap else None)
    assert call["softmax_scale"] == pytest.approx(0.25 if case.scale is None else case.scale)


def test_explain_shows_fa4_window_size(standin: Recorder) -> None:
    q, k, v = qkv(length_q=6, length_kv=12, needs_grad=True)
    text = attnbias.explain(q, k, v, attn_mask=causal_upper_left() + SlidingWindowBias(10))
    assert text.startswith("fa4: band -4 <= j - i <= 0 runs in FlashAttention 4 (")
    assert "window_size=(10, -6)" in text.splitlines()[0]
    with use_backends("fa4"):  # soft-cap without gradients prefers the Triton kernel
        text = attnbias.explain(
            q, k, v, attn_mask=causal_lower_right() + SlidingWindowBias(2) + SoftcapBias(30.0)
        )
    assert "FlashAttention 4 (window_size=(2, 0), softcap=30)" in text.splitlines()[0]
    assert standin.calls == []  # explain computes nothing


@st.composite
def fa4_problems(draw: st.DrawFn, max_len: int = 24) -> Problem:
    """Calls FlashAttention 4 takes: any band (never an empty one), soft-cap, GQA, a scale."""
    length_q = draw(st.integers(1, max_len))
    length_kv = draw(st.integers(1, max_len))
    heads_q, heads_kv = draw(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2), (4, 1)]))
    is_causal = draw(st.booleans())
    variant = draw(st.sampled_from([None, CausalVariant.UPPER_LEFT, CausalVariant.LOWER_RIGHT]))
    parts: list[AttnBias] = [] if variant is None else [CausalBias(variant)]
    if draw(st.integers(0, 2)) > 0:  # a window in two calls out of three
        # Under an upper-left causal mask (j - i <= 0) the window must reach back to j - i = 0,
        # i.e. window_left >= S - L, or the band keeps no pair.
        upper_left = is_causal or variant is CausalVariant.UPPER_LEFT
        least = max(0, length_kv - length_q) if upper_left else 0
        left = draw(st.one_of(st.none(), st.integers(least, least + max_len)))
        right = draw(st.one_of(st.none(), st.integers(0, max_len)))
        parts.append(SlidingWindowBias(left, right))
    if draw(st.booleans()):
        parts.append(SoftcapBias(draw(st.sampled_from([0.5, 2.0, 20.0]))))
    # with attn_mask=None sdpa goes to stock SDPA: an empty window keeps the call on the planner
    bias: AttnBias = SlidingWindowBias(None, None)
    for n, part in enumerate(parts):
        bias = part if n == 0 else bias + part
    return Problem(
        batch=draw(st.integers(1, 2)),
        heads_q=heads_q,
        heads_kv=heads_kv,
        length_q=length_q,
        length_kv=length_kv,
        head_dim=draw(st.sampled_from([8, 16, 24])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
        bias=bias,
        is_causal=is_causal,
        scale=draw(st.sampled_from([None, 0.3, 1.7])),
    )


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=fa4_problems(), seed=st.integers(0, 2**16))
def test_fa4_bands_against_the_oracle(standin: Recorder, problem: Problem, seed: int) -> None:
    check_on_fa4(problem, standin, seed)


VARLEN_CASES = {
    "packed_causal": (
        DocumentBias.from_seqlens([3, 6, 5]) + causal_lower_right(), 14, 14, (None, 0)
    ),
    "packed_window": (
        DocumentBias.from_seqlens([7, 2, 5]) + SlidingWindowBias(2) + causal_upper_left(),
        14, 14, (2, 0),
    ),
    "packed_bidirectional": (DocumentBias.from_seqlens([4, 9]), 13, 13, (None, None)),
    # every document's keys end 2 after its queries: the band shifts by that offset
    "suffix_queries": (
        DocumentBias.from_seqlens([2, 3], [4, 3]) + causal_lower_right(), 5, 7, (None, 0)
    ),
    "suffix_queries_upper_left": (
        DocumentBias.from_seqlens([2, 3], [4, 3]) + causal_upper_left(), 5, 7, (None, -2)
    ),
    "suffix_queries_softcap": (
        DocumentBias.from_seqlens([3, 1], [5, 1]) + causal_lower_right() + SoftcapBias(3.0),
        4, 6, (None, 0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(VARLEN_CASES))
def test_documents_through_the_varlen_standin_match_the_oracle(
    standin: Recorder, monkeypatch: pytest.MonkeyPatch, name: str, batch: int, dtype: torch.dtype
) -> None:
    bias, length_q, length_kv, window = VARLEN_CASES[name]
    varlen = Recorder(fa4_varlen_standin)
    monkeypatch.setattr(fa4, "_flash_attn_varlen_func", lambda: varlen)
    # several rows: (B, L, H, E) in memory, so that the flattened rows are views
    problem = Problem(batch, 4, 2, length_q, length_kv, 16, dtype, bias, False, None, batch > 1)
    check_on_fa4(problem, varlen)
    assert varlen.calls[0]["window_size"] == window
    bounds = varlen.calls[0]["cu_seqlens_q"].tolist()
    per_row = (len(bounds) - 1) // batch  # every row's documents, row after row
    assert len(bounds) == batch * per_row + 1 and bounds[per_row] == length_q
    assert not standin.calls  # documents never take the dense entry point


# Documents per batch row (ids of shape (B, L)): each row's own documents, one offset for all.
VARLEN_ROW_CASES = {
    "rows_differ_causal": (
        DocumentBias(torch.tensor([[0] * 5 + [1] * 9, [3] * 14, [0, 1, 1, 2, 2, 2] + [7] * 8]))
        + causal_lower_right(),
        14, 14, (None, 0),
    ),
    "rows_differ_suffix_queries": (
        DocumentBias(
            torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [4, 4, 4, 4, 4]]),
            torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1], [4] * 7]),
        )
        + SlidingWindowBias(2) + causal_lower_right(),
        5, 7, (2, 0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(VARLEN_ROW_CASES))
def test_documents_per_batch_row_through_the_varlen_standin_match_the_oracle(
    standin: Recorder, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    bias, length_q, length_kv, window = VARLEN_ROW_CASES[name]
    varlen = Recorder(fa4_varlen_standin)
    monkeypatch.setattr(fa4, "_flash_attn_varlen_func", lambda: varlen)
    problem = Problem(3, 4, 2, length_q, length_kv, 16, torch.bfloat16, bias, False, None, True)
    check_on_fa4(problem, varlen)
    assert varlen.calls[0]["window_size"] == window


def test_documents_of_several_rows_run_on_views_of_the_inputs(
    standin: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch, heads, length, head_dim = 2, 2, 12, 16
    generator = torch.Generator().manual_seed(7)
    # as a projection followed by .view(B, L, H, E).transpose(1, 2) leaves them
    q, k, v, grad_out = (
        torch.randn(batch, length, heads, head_dim, generator=generator)
        .transpose(1, 2)
        .to(torch.bfloat16)
        .requires_grad_()
        for _ in range(4)
    )
    bias = DocumentBias.from_seqlens([5, 7]) + causal_upper_left()
    seen: list[int] = []

    def varlen_seeing_storage(q_: Tensor, k_: Tensor, v_: Tensor, **kwargs: Any) -> Any:
        seen.extend(x.untyped_storage().data_ptr() for x in (q_, k_, v_))
        return fa4_varlen_standin(q_, k_, v_, **kwargs)

    monkeypatch.setattr(fa4, "_flash_attn_varlen_func", lambda: varlen_seeing_storage)
    with use_backends("fa4"):
        text = attnbias.explain(q, k, v, attn_mask=bias)
        out = attnbias.sdpa(q, k, v, attn_mask=bias)
    assert "the 2 batch rows flattened as views" in text, text
    assert seen == [x.untyped_storage().data_ptr() for x in (q, k, v)]
    results = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)]
    q, k, v, grad_out = (x.detach() for x in (q, k, v, grad_out))
    expected = run_with_grads(
        lambda *t: attention(*t, bias), (q.double(), k.double(), v.double()), grad_out.double()
    )
    low = run_with_grads(lambda *t: attention(*t, bias, dtype=torch.bfloat16), (q, k, v), grad_out)
    assert_close_to_oracle(results, expected, low, torch.bfloat16, ("out", "dq", "dk", "dv"))
    # the same call on (B, H, L, E) memory would copy: another backend takes it
    q_, k_, v_ = (x.contiguous().requires_grad_() for x in (q, k, v))
    text = attnbias.explain(q_, k_, v_, attn_mask=bias)
    assert not text.startswith("fa4:") and "are not (B, L, H, E) in memory" in text, text
    # the call key holds the strides: the views' decision does not serve it, and a pin on
    # FlashAttention 4 raises its reason
    with use_backends("fa4"), pytest.raises(ValueError, match=r"not \(B, L, H, E\) in memory"):
        attnbias.sdpa(q_, k_, v_, attn_mask=bias)
    assert len(seen) == 3


def test_varlen_layout_of_documents() -> None:
    layout = documents_layout(DocumentBias.from_seqlens([2, 3], [4, 3]), torch.device("cpu"))
    assert layout.cu_seqlens_q.tolist() == [0, 2, 5]
    assert layout.cu_seqlens_k.tolist() == [0, 4, 7]
    assert (layout.max_seqlen_q, layout.max_seqlen_k) == (3, 4)
    assert layout.end_offset == 2 and layout.problem is None
    # per document: its query and key lengths, its first key minus its first query
    assert layout.documents == ((2, 4, 0), (3, 3, 2)) and layout.equal_length is None
    uneven = documents_layout(DocumentBias.from_seqlens([2, 3], [3, 4]), torch.device("cpu"))
    assert uneven.end_offset is None and uneven.problem is None
    bias = DocumentBias.from_seqlens([5, 5])
    assert documents_layout(bias, torch.device("cpu")) is documents_layout(
        bias, torch.device("cpu")
    )
    assert documents_layout(bias, torch.device("cpu"), 2).equal_length == 5
    # queries of equal lengths, keys not
    assert (
        documents_layout(
            DocumentBias.from_seqlens([2, 2], [4, 2]), torch.device("cpu")
        ).equal_length
        is None
    )
    # three rows: the 1-D ids repeat per row; ids per row give each row its own documents
    rows = documents_layout(DocumentBias.from_seqlens([2, 3], [4, 3]), torch.device("cpu"), 3)
    assert rows.cu_seqlens_q.tolist() == [0, 2, 5, 7, 10, 12, 15]
    assert rows.cu_seqlens_k.tolist() == [0, 4, 7, 11, 14, 18, 21]
    assert rows.end_offset == 2 and rows.problem is None
    per_row = DocumentBias(torch.tensor([[0, 0, 0, 1], [5, 5, 5, 5]]))
    layout = documents_layout(per_row, torch.device("cpu"), 2)
    assert layout.cu_seqlens_q.tolist() == layout.cu_seqlens_k.tolist() == [0, 3, 4, 8]
    assert (layout.max_seqlen_q, layout.end_offset) == (4, 0)
    assert layout.equal_length is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("bias", "length_q", "length_kv"),
    [
        (AlibiBias(num_heads=4) + causal_upper_left(), 9, 9),
        (AlibiBias(num_heads=4) + causal_lower_right(), 6, 11),
        (AlibiBias(slopes=torch.tensor([0.5, 0.1, 0.02, 1.0])) + SlidingWindowBias(3, 2), 11, 7),
    ],
)
def test_alibi_through_the_standin_matches_the_oracle(
    standin: Recorder, bias: AttnBias, length_q: int, length_kv: int, dtype: torch.dtype
) -> None:
    problem = Problem(2, 4, 4, length_q, length_kv, 16, dtype, bias, False, None)
    check_on_fa4(problem, standin)
    call = standin.calls[0]
    assert call["pack_gqa"] is False and call["score_mod"] == "alibi"


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


def test_fa4_refuses_double_backward(standin: Recorder) -> None:
    """Its backward is first-order only: a gradient penalty must fail, not silently vanish."""
    q, k, v = qkv(length_q=8, length_kv=8, head_dim=16, needs_grad=True)
    bias = causal_lower_right() + SlidingWindowBias(3)
    with use_backends("fa4"):
        out = attnbias.sdpa(q, k, v, attn_mask=bias)
    with pytest.raises(RuntimeError, match=r"double backward.*use_backends\(\"reference\"\)"):
        torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    # first order is unaffected
    (dq,) = torch.autograd.grad(out.float().square().sum(), q)
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0
    # and the exact eager path gives the second-order terms the error points to
    with use_backends("reference"):
        out = attnbias.sdpa(q.double(), k.double(), v.double(), attn_mask=bias)
    (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    assert dq.requires_grad


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

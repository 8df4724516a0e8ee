"""The Gluon forward for Hopper (``use_backends("gluon")``): what it refuses and why (CPU, a
GPU faked), how it sees tensors in memory, and on a Hopper GPU its output against the oracle
(fp64 stock PyTorch on the bias's materialized mask), lengths off its tiles, GQA, both
layouts, every band it takes and rows that keep no key."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from planning import set_generation, spec_of
from torch import Tensor

import attnbias
import attnbias.backends.gluon as gluon
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    causal_upper_left,
    use_backends,
)
from attnbias.planner import plan
from attnbias.spec import make_spec
from attnbias.testing.oracle import assert_close_to_oracle, attention, flash_rounding


def _fake_hopper(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] = (9, 0)) -> None:
    monkeypatch.setattr(gluon, "_on_cuda", lambda device: True)
    monkeypatch.setattr(gluon, "_capability", lambda device: capability)
    monkeypatch.setattr(gluon, "gluon_ready", lambda: None)
    monkeypatch.setattr(gluon, "_layout", lambda x: "bhse")


def _reasons(bias: AttnBias | None, **shape: object) -> list[str]:
    """Every reason the backend gives for ``bias`` on a call of ``shape`` (head dim 128 unless
    given; ``scale`` among the keys)."""
    shape = {"head_dim": 128, **shape}
    scale = shape.pop("scale", None)
    spec = spec_of(bias, scale=scale, **shape)  # type: ignore[arg-type]
    return gluon.GluonForward().not_supported_reasons(spec)


def test_on_cpu_tensors_it_says_so() -> None:
    reasons = _reasons(causal_upper_left())
    assert "the Gluon kernel needs CUDA tensors and these are on cpu" in reasons


def test_a_faked_hopper_takes_causal_windows_and_no_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_hopper(monkeypatch)
    takes = (
        None, causal_upper_left(), causal_lower_right(), SlidingWindowBias(7, 3),
        causal_lower_right() + AlibiBias(num_heads=2), SoftcapBias(30.0),
        SlidingWindowBias(9) + SoftcapBias(5.0) + AlibiBias(num_heads=2),
        DocumentBias.from_seqlens([16]) + causal_upper_left(),
    )  # fmt: skip
    for bias in takes:
        assert _reasons(bias, length_q=16, length_kv=40) == []


def test_alibi_distances_past_float32_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(gluon, "MAX_ALIBI_LENGTH", 32)
    reasons = _reasons(AlibiBias(num_heads=2), length_q=16, length_kv=40)
    assert any("ALiBi distances in (L, S)=(16, 40) exceed 32" in r for r in reasons)


REFUSALS: dict[str, tuple[Callable[[], AttnBias | None], dict[str, object], str]] = {
    "gradients": (causal_upper_left, {"needs_grad": True}, "forward only"),
    "key range": (
        lambda: KeyRangeBias(start=[0], end=[7]) + causal_lower_right(),
        {"batch": 1},
        "documents, ALiBi and soft-cap; not ",
    ),
    "a user's mask": (
        lambda: ModBias(mask_mod=lambda b, h, q_idx, kv_idx: kv_idx % 2 == 0),
        {},
        "the Gluon kernel takes no mask, a band (causal, windows), documents, ALiBi and "
        "soft-cap; not ",
    ),
    "head dim": (causal_upper_left, {"head_dim": 256}, "head dims (E, Ev)=(256, 256)"),
    "value head dim": (causal_upper_left, {"head_dim_v": 64}, "head dims (E, Ev)=(128, 64)"),
    "scale": (causal_upper_left, {"scale": -0.5}, "scale=-0.5: the Gluon kernel takes scale > 0"),
    "float32": (causal_upper_left, {"dtype": torch.float32}, "dtype torch.float32 is not one"),
    "no keys": (lambda: None, {"length_kv": 0}, "S=0: the Gluon kernel needs at least one key"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_each_refusal_names_the_value(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    _fake_hopper(monkeypatch)
    make, shape, expected = REFUSALS[name]
    reasons = _reasons(make(), **shape)
    assert len(reasons) == 1, reasons
    assert expected in reasons[0], reasons


def test_other_gpus_and_other_tritons_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_hopper(monkeypatch, capability=(10, 0))
    assert _reasons(causal_upper_left()) == [
        "the Gluon kernel is written for Hopper (capability 9.x); this GPU is 10.0"
    ]
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(gluon, "gluon_ready", lambda: "no Gluon here")
    assert _reasons(causal_upper_left()) == ["no Gluon here"]


def test_strides_it_cannot_describe_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_hopper(monkeypatch)
    monkeypatch.setattr(gluon, "_layout", lambda x: None)
    (reason,) = _reasons(causal_upper_left())
    assert "the Gluon kernel's TMA descriptors take (B, H, L, E) tensors" in reason


def test_the_planner_lists_it_after_the_backends_it_was_measured_against(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On Hopper, calls without gradients list it after stock SDPA (no mask, causal) or the
    Triton kernel (bands): routing by measurement times it, the planner alone never picks it
    over them; training calls and Blackwell do not list it."""
    _fake_hopper(monkeypatch)
    set_generation(monkeypatch, "hopper")
    orders = {
        "causal": plan(spec_of(causal_upper_left(), head_dim=128)).order,
        "band": plan(
            spec_of(SlidingWindowBias(64), head_dim=128, length_q=256, length_kv=256)
        ).order,
        "none": plan(spec_of(None, head_dim=128)).order,
    }
    assert orders["causal"][orders["causal"].index("sdpa") + 1] == "gluon"
    assert orders["none"][orders["none"].index("sdpa") + 1] == "gluon"
    assert orders["band"][orders["band"].index("triton") + 1] == "gluon"
    training = plan(spec_of(causal_upper_left(), head_dim=128, needs_grad=True))
    assert training.backend.name != "gluon"
    assert "gluon" not in training.order[: training.order.index("triton")]
    with use_backends("gluon"):
        assert plan(spec_of(causal_upper_left(), head_dim=128)).order == ("gluon",)
    set_generation(monkeypatch, "blackwell")
    assert "gluon" not in plan(spec_of(causal_upper_left(), head_dim=128)).order


def test_layouts_it_describes() -> None:
    from attnbias.kernels.gluon_forward import layout_of

    contiguous = torch.zeros(2, 3, 40, 128, dtype=torch.bfloat16)
    projected = torch.zeros(2, 40, 3, 128, dtype=torch.bfloat16).transpose(1, 2)
    assert layout_of(contiguous) == "bhse"
    assert layout_of(projected) == "bshe"
    assert layout_of(contiguous[:, :, 1:]) is None  # rows of one head do not start together
    assert layout_of(contiguous.transpose(2, 3)) is None  # the head dim is not contiguous
    heads = torch.zeros(2, 40, 5, 128, dtype=torch.bfloat16).transpose(1, 2)[:, 1:4]
    assert layout_of(heads) is None  # three heads of five: not (B, L, H * E) rows


def test_a_plan_keeps_no_tensor_of_the_call_it_was_made_for() -> None:
    """The plan cache holds prepared runs for as long as their calls repeat: a plan made from
    a call's tensors (here on the CPU: planning launches nothing) must not keep them alive."""
    import gc
    import weakref

    from attnbias.kernels.gluon_forward import plan_gluon_forward

    query, key, value = (torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16) for _ in range(3))
    documents = (torch.zeros(1, 256, dtype=torch.int64), torch.zeros(1, 256, dtype=torch.int64))
    planned = [
        plan_gluon_forward(query, key, value, None, 0, 0.1, softcap=30.0),
        plan_gluon_forward(query, key, value, -5, 5, 0.1, slopes=torch.ones(1, 2)),
        plan_gluon_forward(query, key, value, None, None, 0.1, documents=documents),
    ]
    kept = [weakref.ref(t) for t in (query, key, value)]
    del query, key, value
    gc.collect()
    assert planned and all(ref() is None for ref in kept)


# ------------------------------------------------------------------------------------------
# On a Hopper GPU


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# (batch, Hq, Hkv, L, S, bias, layout of q / k / v, dtype, head dim)
Case = tuple[int, int, int, int, int, Callable[[], AttnBias | None], str, torch.dtype, int]
CASES: dict[str, Case] = {
    "causal, lengths off the tiles": (2, 3, 3, 300, 300, causal_upper_left, "bhse",
                                      torch.bfloat16, 128),
    "lower-right causal, GQA, projections": (
        2, 4, 2, 200, 517, causal_lower_right, "bshe", torch.float16, 128,
    ),
    "window 100 + causal": (1, 2, 2, 1000, 1000, lambda: causal_upper_left()
                            + SlidingWindowBias(100), "bhse", torch.bfloat16, 128),
    "two-sided window": (1, 2, 1, 777, 777, lambda: SlidingWindowBias(64, 64), "bshe",
                         torch.bfloat16, 128),
    "no mask, one block of keys": (3, 2, 2, 130, 70, lambda: None, "bhse", torch.bfloat16,
                                   128),
    "rows that keep no key": (1, 2, 2, 300, 100, causal_lower_right, "bhse", torch.float16,
                              128),
    "head dim 64, window, GQA": (2, 4, 2, 333, 333, lambda: causal_lower_right()
                                 + SlidingWindowBias(100), "bshe", torch.bfloat16, 64),
    "head dim 64, no mask": (1, 3, 3, 200, 517, lambda: None, "bhse", torch.float16, 64),
    "ALiBi, lower-right causal, GQA": (2, 4, 2, 300, 517, lambda: causal_lower_right()
                                       + AlibiBias(num_heads=4), "bshe", torch.bfloat16, 128),
    "soft-cap 20, window 100 + causal": (1, 2, 2, 400, 400, lambda: causal_upper_left()
                                         + SlidingWindowBias(100) + SoftcapBias(20.0), "bhse",
                                         torch.bfloat16, 128),
    "ALiBi and soft-cap, no band, head dim 64": (2, 2, 2, 200, 300, lambda: SoftcapBias(10.0)
                                                 + AlibiBias(num_heads=2), "bhse", torch.float16,
                                                 64),
    "documents + causal": (2, 2, 2, 400, 400, lambda: DocumentBias.from_seqlens([100, 37, 200, 63])
                           + causal_upper_left(), "bhse", torch.bfloat16, 128),
    "documents per batch row, window, ALiBi, GQA": (2, 4, 2, 300, 300, lambda: DocumentBias(
        torch.tensor([[0] * 120 + [1] * 180, [0] * 10 + [1] * 250 + [2] * 40]))
        + causal_lower_right() + SlidingWindowBias(64) + AlibiBias(num_heads=4), "bshe",
        torch.float16, 64),
    "documents across L != S, soft-cap": (1, 2, 2, 200, 517, lambda: DocumentBias(
        torch.tensor([0] * 50 + [1] * 150), torch.tensor([0] * 300 + [1] * 217))
        + SoftcapBias(20.0), "bhse", torch.bfloat16, 128),
}  # fmt: skip


def _laid_out(x: Tensor, layout: str) -> Tensor:
    return x if layout == "bhse" else x.transpose(1, 2).contiguous().transpose(1, 2)


def _pinned_against_the_oracle(
    shape: tuple[int, int, int, int, int, int],
    bias: AttnBias | None,
    layout: str,
    dtype: torch.dtype,
    seed: int,
    scale: float | None = None,
) -> Tensor:
    """``attnbias.sdpa`` pinned to the Gluon backend on random inputs of ``shape`` = ``(B, Hq,
    Hkv, L, S, E)`` in ``layout``, checked against the oracle (and said to be the route);
    returns the output."""
    batch, heads_q, heads_kv, length_q, length_kv, dim = shape
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def draw(heads: int, length: int) -> Tensor:
        x = torch.randn(batch, heads, length, dim, device="cuda", generator=generator)
        return _laid_out(x.to(dtype), layout)

    q, k, v = draw(heads_q, length_q), draw(heads_kv, length_kv), draw(heads_kv, length_kv)
    kwargs: dict[str, Any] = {"scale": scale, "enable_gqa": heads_q != heads_kv}
    with use_backends("gluon"):
        assert attnbias.explain(q, k, v, attn_mask=bias, **kwargs).startswith("gluon")
        got = attnbias.sdpa(q, k, v, attn_mask=bias, **kwargs)
    assert got.shape == q.shape and got.stride() == q.stride()  # the query's layout
    oracle = attention(q, k, v, bias, **kwargs)
    low = attention(q, k, v, bias, dtype=dtype, **kwargs)
    rounding = flash_rounding(q, k, v, bias, torch.ones_like(q), scale=scale)[:1]
    assert_close_to_oracle([got], [oracle], [low], dtype, ("out",), rounding)
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_against_the_oracle(name: str) -> None:
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    problem = gluon.gluon_ready()
    if problem is not None:
        pytest.skip(problem)
    batch, heads_q, heads_kv, length_q, length_kv, make, layout, dtype, dim = CASES[name]
    shape = (batch, heads_q, heads_kv, length_q, length_kv, dim)
    got = _pinned_against_the_oracle(shape, make(), layout, dtype, seed=0)
    if name == "rows that keep no key":
        empty = got[:, :, : length_q - length_kv]
        assert torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("bias", "layout", "dtype"),
    [(causal_upper_left, "bhse", torch.bfloat16), (causal_lower_right, "bshe", torch.float16)],
)
def test_the_kernel_at_head_dim_256(
    bias: Callable[[], AttnBias], layout: str, dtype: torch.dtype
) -> None:
    """The kernel compiles and is exact at head dim 256 (two stages of 64 keys), though the
    backend does not offer it there: lower-right causal + a window of 80 with GQA over
    L=150, S=400, and upper-left causal."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    problem = gluon.gluon_ready()
    if problem is not None:
        pytest.skip(problem)
    from attnbias.kernels.gluon_forward import gluon_forward

    made = bias() if bias is causal_upper_left else bias() + SlidingWindowBias(80)
    generator = torch.Generator(device="cuda").manual_seed(3)

    def draw(heads: int, length: int) -> Tensor:
        x = torch.randn(2, heads, length, 256, device="cuda", generator=generator)
        return _laid_out(x.to(dtype), layout)

    q, k, v = draw(2, 150), draw(1, 400), draw(1, 400)
    program = make_spec(q, k, v, made, False, None, 0.0, True).program  # the band's sides
    got = gluon_forward(q, k, v, program.band_lo, program.band_hi, 256**-0.5)
    oracle = attention(q, k, v, made, enable_gqa=True)
    low = attention(q, k, v, made, enable_gqa=True, dtype=dtype)
    rounding = flash_rounding(q, k, v, made, torch.ones_like(q), scale=None)[:1]
    assert_close_to_oracle([got], [oracle], [low], dtype, ("out",), rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhse", "bshe"])
def test_non_finite_keys_reach_only_the_rows_that_keep_them(layout: str) -> None:
    """Lower-right causal + a window of 64 over L=200, S=333: row i keeps keys i + 69 ..
    i + 133, so tiles are cut by the lengths and by both edges of the band. NaN keys that no
    row keeps and NaN past the last key in the same memory (the tensors are views of longer
    ones) change no row; a NaN key that rows 7 .. 71 keep makes exactly those rows NaN. An
    infinite value of a masked key reaches no row whose block of 128 rows skips its tile
    (within a tile some row keeps, a masked key's non-finite value meets a zero weight in the
    PV product, as in the Triton kernels: ``kernels/common.py``)."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    problem = gluon.gluon_ready()
    if problem is not None:
        pytest.skip(problem)
    heads = 1 if layout == "bhse" else 2  # (a bhse view of a longer tensor: one head)
    length_q, length_kv, extra = 200, 333, 64
    bias = causal_lower_right() + SlidingWindowBias(64)
    generator = torch.Generator(device="cuda").manual_seed(1)

    def draw(length: int) -> Tensor:
        # (1, H, length, E) in the layout, the first `length` positions of a longer tensor
        # whose tail is NaN (one batch row, so the view is a layout TMA takes)
        x = torch.randn(1, heads, length + extra, 128, device="cuda", generator=generator)
        x[:, :, length:] = float("nan")
        x = _laid_out(x.to(torch.bfloat16), layout)
        return x[:, :, :length]

    q, k, v = draw(length_q), draw(length_kv), draw(length_kv)
    assert gluon._layout(k) == layout and gluon._layout(q) == layout
    oracle = attention(q, k, v, bias)
    low = attention(q, k, v, bias, dtype=torch.bfloat16)
    rounding = flash_rounding(q, k, v, bias, torch.ones_like(q), scale=None)[:1]

    def run(k: Tensor, v: Tensor) -> Tensor:
        with use_backends("gluon"):
            assert attnbias.explain(q, k, v, attn_mask=bias).startswith("gluon")
            return attnbias.sdpa(q, k, v, attn_mask=bias)

    def assert_exact(got: Tensor, rows: Tensor) -> None:
        assert torch.isfinite(got[rows]).all(), "a NaN or Inf reached a row that keeps none"
        assert_close_to_oracle(
            [got[rows]], [oracle[rows]], [low[rows]], torch.bfloat16, ("out",), rounding
        )

    dirty_k = k.clone()
    dirty_k[:, :, [0, 5, 68], 7] = float("nan")  # kept by no row
    dirty_k[:, 0, 140, 11] = float("nan")  # kept by rows 7 .. 71
    got = run(dirty_k, v)
    poisoned = torch.zeros(1, heads, length_q, dtype=torch.bool, device="cuda")
    poisoned[:, 0, 7:72] = True
    assert torch.isnan(got[poisoned]).any(-1).all(), "a row keeping a NaN key is not NaN"
    assert_exact(got, ~poisoned)
    dirty_v = v.clone()
    dirty_v[:, :, 5, 3] = float("inf")  # in keys 0 .. 127, which rows 128 on skip
    got = run(k, dirty_v)
    later = torch.zeros(1, heads, length_q, dtype=torch.bool, device="cuda")
    later[:, :, 128:] = True
    assert_exact(got, later)


@pytest.mark.gpu
def test_a_repeated_call_on_misaligned_memory_runs_on_copies() -> None:
    """The plan cache keys on strides, not on the data pointers' alignment the TMA
    descriptors need: a call of the same shapes and strides on tensors 2 bytes off a 16-byte
    boundary, after an aligned one was prepared, gives the oracle's result."""
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    problem = gluon.gluon_ready()
    if problem is not None:
        pytest.skip(problem)
    shape = (1, 2, 130, 128)
    size = math.prod(shape)
    generator = torch.Generator(device="cuda").manual_seed(2)
    storage = torch.randn(3, size + 8, device="cuda", generator=generator).to(torch.bfloat16)
    aligned = [storage[i, :size].view(shape) for i in range(3)]
    shifted = [storage[i, 1 : size + 1].view(shape) for i in range(3)]
    assert all(x.data_ptr() % 16 for x in shifted)
    assert [x.stride() for x in shifted] == [x.stride() for x in aligned]
    bias = causal_upper_left()
    with use_backends("gluon"):
        attnbias.sdpa(*aligned, attn_mask=bias)  # planned and prepared
        got = attnbias.sdpa(*shifted, attn_mask=bias)
    q, k, v = shifted
    oracle = attention(q, k, v, bias)
    low = attention(q, k, v, bias, dtype=torch.bfloat16)
    rounding = flash_rounding(q, k, v, bias, torch.ones_like(q), scale=None)[:1]
    assert_close_to_oracle([got], [oracle], [low], torch.bfloat16, ("out",), rounding)


@st.composite
def gluon_calls(draw: st.DrawFn) -> tuple[Any, ...]:
    """A call the backend takes: shapes off its tiles, GQA, both layouts, fp16 / bf16, head
    dims 64 and 128, packed documents or not, a band (or none) with ALiBi and a soft-cap or
    not, any positive scale."""
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 3))
    shape = (
        draw(st.integers(1, 2)), heads_q, heads_kv, draw(st.integers(1, 400)),
        draw(st.integers(1, 400)), draw(st.sampled_from([64, 128])),
    )  # fmt: skip
    if draw(st.booleans()):  # packed documents over a self-attention call
        batch, heads_q, heads_kv, length_q, _, dim = shape
        shape = (batch, heads_q, heads_kv, length_q, length_q, dim)
        cuts = sorted(draw(st.sets(st.integers(1, max(1, length_q - 1)), max_size=4)))
        cuts = [c for c in cuts if c < length_q]
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, length_q], strict=True)]
        documents: list[AttnBias] = [DocumentBias.from_seqlens(lengths)]
    else:
        documents = []
    band = draw(st.sampled_from(["none", "upper-left", "lower-right", "window", "two-sided"]))
    width = draw(st.integers(1, 300))
    parts: list[AttnBias] = documents
    if band == "upper-left":
        parts.append(causal_upper_left())
    elif band == "lower-right":
        parts.append(causal_lower_right())
    elif band == "window":
        parts += [causal_lower_right(), SlidingWindowBias(width)]
    elif band == "two-sided":
        parts.append(SlidingWindowBias(width, draw(st.integers(0, 300))))
    if draw(st.booleans()):
        parts.append(SoftcapBias(draw(st.sampled_from([5.0, 30.0]))))
    if draw(st.booleans()):
        parts.append(AlibiBias(num_heads=heads_q))
    layout = draw(st.sampled_from(["bhse", "bshe"]))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    scale = draw(st.sampled_from([None, 0.05, 0.3]))
    return shape, parts, layout, dtype, scale, draw(st.integers(0, 2**16))


@pytest.mark.gpu
@settings(max_examples=25, deadline=None)
@given(gluon_calls())
def test_drawn_calls_against_the_oracle(call: tuple[Any, ...]) -> None:
    if not _hopper():
        pytest.skip("needs a Hopper GPU")
    problem = gluon.gluon_ready()
    if problem is not None:
        pytest.skip(problem)
    shape, parts, layout, dtype, scale, seed = call
    bias = sum(parts[1:], parts[0]) if parts else None
    _pinned_against_the_oracle(shape, bias, layout, dtype, seed, scale)

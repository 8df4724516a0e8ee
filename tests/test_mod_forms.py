"""``ModBias`` masks that are built-in masks written as functions: a band (``kv_idx - q_idx``
compared with numbers) and equal chunks (``q_idx // C == kv_idx // C``) run as the built-in
band and documents (``attnbias.kernels.modforms``).

The forms found are checked against the functions themselves called on real index tensors (not
through the tracer), over drawn conjunctions; look-alikes that are no such form are left to the
generated code; calls through the Triton kernel (interpreted on CPU) and the exact path match
the fp64 oracle, which evaluates the functions on the grid; ``explain`` names the form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import assert_call_close, flash_rounding
from strategies import draw_inputs
from torch import Tensor

import attnbias
from attnbias import KeyRangeBias, ModBias, SoftcapBias, explain, sdpa, use_backends
from attnbias.kernels.modforms import BuiltinForm
from attnbias.terms import Block, Call

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Window(ModBias):
    window: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.window)


@dataclass(frozen=True)
class Chunked(ModBias):
    chunk: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx // self.chunk == kv_idx // self.chunk)


@dataclass(frozen=True)
class Prefix(ModBias):
    prefix: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)


def form(fn: Callable[..., Any]) -> BuiltinForm | None:
    return ModBias(mask_mod=fn).builtin_form()


# --------------------------------------------------------------------------------------------
# What is found, and what is not


FOUND: dict[str, tuple[Callable[..., Any], BuiltinForm]] = {
    "causal": (lambda b, h, q, kv: kv <= q, BuiltinForm(None, 0)),
    "causal, flipped": (lambda b, h, q, kv: q >= kv, BuiltinForm(None, 0)),
    "strictly causal": (lambda b, h, q, kv: kv < q, BuiltinForm(None, -1)),
    "window": (lambda b, h, q, kv: (q - kv >= 0) & (q - kv < 8), BuiltinForm(-7, 0)),
    "shifted sides": (lambda b, h, q, kv: (kv + 3 <= q + 5) & ~(kv < q - 4), BuiltinForm(-4, 2)),
    "diagonal": (lambda b, h, q, kv: kv - q == 2, BuiltinForm(2, 2)),
    "negated": (lambda b, h, q, kv: -(q - kv) > -3, BuiltinForm(-2, None)),
    "times one": (lambda b, h, q, kv: 1 * kv - q * 1 <= 0, BuiltinForm(None, 0)),
    "as int64": (lambda b, h, q, kv: kv.long() <= q.to(torch.int64), BuiltinForm(None, 0)),
    "and True": (lambda b, h, q, kv: (kv <= q) & True, BuiltinForm(None, 0)),
    "chunks": (lambda b, h, q, kv: q // 16 == kv // 16, BuiltinForm(chunk=16)),
    "chunks, keys first": (
        lambda b, h, q, kv: ((kv + 2) // 16 == (q + 1) // 16) & (kv <= q),
        BuiltinForm(None, 0, 16, 1, 2),
    ),
}

NOT_FOUND: dict[str, Callable[..., Any]] = {
    "or": lambda b, h, q, kv: (kv <= q) | (kv < 4),
    "a key range": lambda b, h, q, kv: kv < 4,
    "a query range": lambda b, h, q, kv: (q >= 3) & (kv <= q),
    "not equal": lambda b, h, q, kv: kv != q,
    "twice the distance": lambda b, h, q, kv: 2 * kv - 2 * q <= 4,
    "a float bound": lambda b, h, q, kv: q - kv < 2.5,
    "a head's window": lambda b, h, q, kv: q - kv <= h,
    "a batch row": lambda b, h, q, kv: (kv <= q) & (b == 0),
    "an absolute distance": lambda b, h, q, kv: torch.abs(q - kv) <= 3,
    "a 32-bit cast": lambda b, h, q, kv: kv.int() <= q.int(),
    "two chunk sizes": lambda b, h, q, kv: (q // 16 == kv // 16) & (q // 8 == kv // 8),
    "different divisors": lambda b, h, q, kv: q // 16 == kv // 8,
    "a negative divisor": lambda b, h, q, kv: q // -4 == kv // -4,
    "remainders": lambda b, h, q, kv: q % 4 == kv % 4,
    "always False": lambda b, h, q, kv: (kv <= q) & False,
}


@pytest.mark.parametrize("name", list(FOUND))
def test_forms_found(name: str) -> None:
    fn, expected = FOUND[name]
    assert form(fn) == expected


@pytest.mark.parametrize("name", list(NOT_FOUND))
def test_look_alikes_stay_functions(name: str) -> None:
    assert form(NOT_FOUND[name]) is None


def test_a_score_function_or_the_class_switch_keeps_the_functions() -> None:
    def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return kv <= q

    def doubled(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return 2 * score

    assert ModBias(mask_mod=causal, score_mod=doubled).builtin_form() is None

    class Own(Window):
        run_as_builtin = False

    assert Own(4).builtin_form() is None
    assert Window(4).builtin_form() == BuiltinForm(-3, 0)


def test_blocks_of_a_call_shift_the_form() -> None:
    """A block at ``(q_start, kv_start)`` (context parallelism's shard pairs) reads the call's
    indices: the band moves by ``q_start - kv_start`` and the chunks' offsets by the starts."""
    block = Block(q_start=64, kv_start=32, length_q=16, length_kv=16)
    call = Call(1, 1, 128, 128)
    assert Window(16).sub_block(call, block).builtin_form() == BuiltinForm(17, 32)
    assert Chunked(8).sub_block(call, block).builtin_form() == BuiltinForm(None, 32, 8, 64, 32)


# Atoms of drawn conjunctions: each a function of real or traced indices, and what form it is
# (``None``: none; ``("band",)``; ``("chunks", size, q_offset, kv_offset)``)
Atom = tuple[Callable[[Any, Any], Any], tuple[Any, ...] | None]


@st.composite
def atoms(draw: st.DrawFn) -> Atom:
    a, c = draw(st.integers(-20, 20)), draw(st.integers(-20, 20))
    op = draw(st.sampled_from(["lt", "le", "gt", "ge", "eq", "ne"]))
    compare: Callable[[Any, Any], Any] = {
        "lt": lambda x, y: x < y,
        "le": lambda x, y: x <= y,
        "gt": lambda x, y: x > y,
        "ge": lambda x, y: x >= y,
        "eq": lambda x, y: x == y,
        "ne": lambda x, y: x != y,
    }[op]
    band = None if op == "ne" else ("band",)
    shape = draw(st.sampled_from(["q - kv", "kv vs q", "q vs kv", "chunks", "q alone"]))
    if shape == "q - kv":
        return (lambda q, kv: compare(q - kv + a, c)), band
    if shape == "kv vs q":
        return (lambda q, kv: compare(kv + a, q + c)), band
    if shape == "q vs kv":
        return (lambda q, kv: compare(c - kv, a - q)), band
    if shape == "chunks":
        size = draw(st.integers(1, 24))
        a, c = a + 20, c + 20
        return (lambda q, kv: (q + a) // size == (kv + c) // size), ("chunks", size, a, c)
    return (lambda q, kv: compare(q, abs(c))), None


@settings(max_examples=60)
@given(
    drawn=st.lists(atoms(), min_size=1, max_size=4),
    length_q=st.integers(1, 70),
    length_kv=st.integers(1, 70),
)
def test_found_forms_keep_what_the_function_keeps(
    drawn: list[Atom], length_q: int, length_kv: int
) -> None:
    """Over drawn conjunctions: a form is found exactly where every atom is a band side or
    chunks (of one layout), and where found it keeps the pairs that the function keeps when
    called on real index tensors."""

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        keep = drawn[0][0](q, kv)
        for atom, _ in drawn[1:]:
            keep = keep & atom(q, kv)
        return keep

    found = form(mask_mod)
    kinds = [kind for _, kind in drawn]
    layouts = {kind for kind in kinds if kind is not None and kind[0] == "chunks"}
    assert (found is not None) == (None not in kinds and len(layouts) <= 1)
    if found is None:
        return
    i = torch.arange(length_q)[:, None]
    j = torch.arange(length_kv)[None, :]
    truth = torch.as_tensor(mask_mod(None, None, i, j)).expand(length_q, length_kv)
    keep = torch.ones(length_q, length_kv, dtype=torch.bool)
    if found.band_lo is not None:
        keep &= j - i >= found.band_lo
    if found.band_hi is not None:
        keep &= j - i <= found.band_hi
    if found.chunk is not None:
        keep &= (i + found.q_offset) // found.chunk == (j + found.kv_offset) // found.chunk
    assert torch.equal(keep, truth)


# --------------------------------------------------------------------------------------------
# Calls run as the built-ins, against the oracle


CASES: dict[str, tuple[Callable[[], Any], tuple[int, int, int, int, int], torch.dtype]] = {
    "window": (lambda: Window(20), (1, 2, 1, 64, 64), torch.float32),
    "window, L < S": (lambda: Window(9), (2, 2, 2, 24, 70), torch.float16),
    "chunks": (lambda: Chunked(16), (1, 2, 1, 64, 64), torch.float32),
    "chunks, L > S": (lambda: Chunked(12), (1, 2, 2, 50, 40), torch.float16),
    "chunks + key range": (
        lambda: Chunked(16) + KeyRangeBias(start=[3, 0], end=[60, 33]),
        (2, 2, 1, 64, 64),
        torch.float32,
    ),
    "window + soft-cap": (lambda: Window(12) + SoftcapBias(2.0), (1, 2, 1, 48, 48), torch.float16),
}


@pytest.mark.parametrize("route", ["triton", "reference"])
@pytest.mark.parametrize("name", list(CASES))
def test_runs_as_the_builtin_and_matches_the_oracle(name: str, route: str) -> None:
    make, shape, dtype = CASES[name]
    bias = make()
    parts = [p for p in attnbias.biases.parts_of(bias) if isinstance(p, ModBias)]
    assert all(p.builtin_form() is not None for p in parts)
    q, k, v, grad_out = draw_inputs(shape, 32, dtype, 0, DEVICE)
    gqa = shape[1] != shape[2]
    text = explain(q, k, v, attn_mask=bias, enable_gqa=gqa)
    assert "generated functions" not in text and "its mask_mod as" in text, text

    def ours(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with use_backends(route):
            return sdpa(q, k, v, attn_mask=bias, enable_gqa=gqa)

    rounding = flash_rounding(q, k, v, bias, grad_out) if route == "triton" else None
    assert_call_close(ours, bias, (q, k, v), grad_out, enable_gqa=gqa, rounding=rounding)


def test_the_builtin_route_is_the_one_of_the_same_builtin() -> None:
    """A window written as a function and the built-in window lower to the same band, so the
    planner sees the same kind of call."""
    q = torch.randn(1, 2, 64, 32, device=DEVICE)
    ours = explain(q, q, q, attn_mask=Window(20)).splitlines()[1]
    window = attnbias.causal_upper_left() + attnbias.SlidingWindowBias(19)
    builtin = explain(q, q, q, attn_mask=window)
    assert ours == builtin.splitlines()[1]  # the order line names the kind: band


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["window", "chunks"])
def test_torch_compile_fullgraph_over_a_form(name: str) -> None:
    """Under ``torch.compile(fullgraph=True)`` a band form lowers as the built-in band (known
    from when the bias was built), equal chunks as the generated functions (their document ids
    are built on the host, outside a trace): both match the eager call."""
    bias = Window(300) if name == "window" else Chunked(256)
    q, k, v = (
        torch.randn(1, 4, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, attn_mask=bias)

    compiled = torch.compile(call, fullgraph=True)
    got = compiled(q, k, v)
    got.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = call(q, k, v)
    want.sum().backward()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    for got_grad, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got_grad, t.grad, atol=5e-2, rtol=0)


@pytest.mark.parametrize("name", ["window", "chunks"])
def test_torch_compile_fullgraph_traces_the_lowering(name: str) -> None:
    """``torch.compile(fullgraph=True)`` traces a call whose mask has a built-in form (the
    lowering reads only what the bias kept when it was built), on the exact path; forward and
    gradients against the fp64 oracle (the GPU test above compiles the kernels)."""
    torch._dynamo.reset()
    bias = Window(9) if name == "window" else Chunked(16)
    q, k, v, grad_out = draw_inputs((1, 2, 2, 48, 48), 16, torch.float32, 0, DEVICE)

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # the exact path: the Triton op does not compile under the interpreter
        with use_backends("reference"):
            return sdpa(q, k, v, attn_mask=bias)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    assert_call_close(compiled, bias, (q, k, v), grad_out)

"""``ModBias`` functions that are built-in biases written as functions: a band (``kv_idx -
q_idx`` compared with numbers), equal chunks (``q_idx // C == kv_idx // C``) and document ids
(``docs[b, q_idx] == docs[b, kv_idx]``) run as the built-in band and documents, and a score
function ``cap * tanh(score / cap)`` as the built-in soft-cap (``attnbias.mods.forms``).

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
from torch import Tensor

import attnbias
from attnbias import KeyRangeBias, ModBias, SoftcapBias, explain, sdpa, use_backends
from attnbias.mods.forms import BuiltinForm
from attnbias.terms import Block, Call
from attnbias.testing.oracle import assert_call_close
from attnbias.testing.strategies import draw_inputs

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

    flash = route == "triton"  # a flash kernel: its own rounding joins the budget
    assert_call_close(ours, bias, (q, k, v), grad_out, enable_gqa=gqa, flash=flash)


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


# --------------------------------------------------------------------------------------------
# Document ids and soft-cap: FlexAttention's packed documents and Gemma 2's soft-cap


def packed_ids(rows: int, length: int, cuts: int, seed: int) -> Tensor:
    """``(rows, length)`` non-decreasing document ids, ``cuts`` random boundaries per row."""
    generator = torch.Generator().manual_seed(seed)
    bounds = torch.randint(1, max(length, 2), (rows, cuts), generator=generator).sort(-1).values
    return torch.searchsorted(bounds, torch.arange(length).repeat(rows, 1), right=True)


def documents_of(docs: Tensor) -> Callable[..., Any]:
    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    return document_causal


def soft_cap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return 20.0 * torch.tanh(score / 20.0)


DOCS = packed_ids(2, 80, 4, 0)
ONE_ROW = packed_ids(1, 80, 3, 1)[0]

IDS_FOUND: dict[str, Callable[..., Any]] = {
    "per batch row": lambda b, h, q, kv: DOCS[b, q] == DOCS[b, kv],
    "indexed twice": lambda b, h, q, kv: DOCS[b][q] == DOCS[b][kv],
    "keys first, causal": lambda b, h, q, kv: (kv <= q) & (DOCS[b, kv] == DOCS[b, q]),
    "one row": lambda b, h, q, kv: ONE_ROW[q] == ONE_ROW[kv],
    "shifted": lambda b, h, q, kv: ONE_ROW[q + 1] == ONE_ROW[kv],
    "a cast": lambda b, h, q, kv: DOCS[b, q].int() == DOCS[b, kv].long(),
    "two divisors": lambda b, h, q, kv: q // 16 == kv // 8,
    "remainders": lambda b, h, q, kv: q % 4 == kv % 4,
    "a negative divisor": lambda b, h, q, kv: q // -4 == kv // -4,
}

IDS_NOT_FOUND: dict[str, Callable[..., Any]] = {
    "a head's ids": lambda b, h, q, kv: DOCS[h, q] == DOCS[h, kv],
    "not equal": lambda b, h, q, kv: DOCS[b, q] != DOCS[b, kv],
    "one side reads both": lambda b, h, q, kv: DOCS[b, q] == DOCS[b, kv] + q - q,
    "float ids": lambda b, h, q, kv: DOCS[b, q] * 0.5 == DOCS[b, kv] * 0.5,
    "a query position": lambda b, h, q, kv: DOCS[b, q] == 2,
    "two layouts of ids": lambda b, h, q, kv: (DOCS[b, q] == DOCS[b, kv]) & (q % 4 == kv % 4),
}


@pytest.mark.parametrize("name", list(IDS_FOUND))
def test_document_ids_found(name: str) -> None:
    found = form(IDS_FOUND[name])
    assert found is not None and found.ids is not None and found.softcap is None


@pytest.mark.parametrize("name", list(IDS_NOT_FOUND))
def test_document_id_look_alikes_stay_functions(name: str) -> None:
    assert form(IDS_NOT_FOUND[name]) is None


def test_the_ids_read_tensors_by_slot() -> None:
    other = ONE_ROW.clone()
    found = form(lambda b, h, q, kv: ONE_ROW[q] + 0 * DOCS[0, 0] == other[kv])
    assert found is not None and found.id_params == (0, 1, 2)
    assert form(IDS_FOUND["two divisors"]).id_params == ()  # type: ignore[union-attr]


SOFTCAP_FOUND: dict[str, Callable[..., Any]] = {
    "cap first": lambda s, b, h, q, kv: 30 * torch.tanh(s / 30),
    "cap last": lambda s, b, h, q, kv: (s / 2.5).tanh() * 2.5,
}
SOFTCAP_NOT_FOUND: dict[str, Callable[..., Any]] = {
    "two caps": lambda s, b, h, q, kv: 30 * torch.tanh(s / 20),
    "a negative cap": lambda s, b, h, q, kv: -30 * torch.tanh(s / -30),
    "times the inverse": lambda s, b, h, q, kv: 30 * torch.tanh(s * (1 / 30)),
    "plus one": lambda s, b, h, q, kv: 30 * torch.tanh(s / 30) + 1,
    "a head's cap": lambda s, b, h, q, kv: (h + 1) * torch.tanh(s / (h + 1)),
    "doubled": lambda s, b, h, q, kv: 2 * s,
}


@pytest.mark.parametrize("name", list(SOFTCAP_FOUND))
def test_softcap_score_functions_found(name: str) -> None:
    alone = ModBias(score_mod=SOFTCAP_FOUND[name]).builtin_form()
    with_mask = ModBias(mask_mod=IDS_FOUND["per batch row"], score_mod=SOFTCAP_FOUND[name])
    cap = 30.0 if name == "cap first" else 2.5
    assert alone == BuiltinForm(softcap=cap)
    assert with_mask.builtin_form().softcap == cap


@pytest.mark.parametrize("name", list(SOFTCAP_NOT_FOUND))
def test_softcap_look_alikes_stay_functions(name: str) -> None:
    assert ModBias(score_mod=SOFTCAP_NOT_FOUND[name]).builtin_form() is None
    assert (
        ModBias(
            mask_mod=lambda b, h, q, kv: kv <= q, score_mod=SOFTCAP_NOT_FOUND[name]
        ).builtin_form()
        is None
    )


def ids_call(
    bias: Any, shape: tuple[int, int, int, int, int], dtype: torch.dtype, route: str, seed: int = 0
) -> str:
    """One call of ``bias`` through ``route`` against the oracle; returns ``explain``'s first
    line."""
    q, k, v, grad_out = draw_inputs(shape, 16, dtype, seed, DEVICE)
    gqa = shape[1] != shape[2]

    def ours(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        with use_backends(route):
            return sdpa(q, k, v, attn_mask=bias, enable_gqa=gqa)

    flash = route == "triton"  # a flash kernel: its own rounding joins the budget
    assert_call_close(ours, bias, (q, k, v), grad_out, enable_gqa=gqa, flash=flash)
    with use_backends(route):
        return explain(q, k, v, attn_mask=bias, enable_gqa=gqa).splitlines()[0]


IDS_SHAPES: dict[str, tuple[tuple[int, int, int, int, int], torch.dtype]] = {
    "square": ((2, 2, 1, 80, 80), torch.float32),
    "L < S, GQA": ((2, 4, 2, 33, 80), torch.float16),
    "L > S": ((2, 2, 2, 80, 41), torch.float32),
}


@pytest.mark.parametrize("route", ["triton", "reference"])
@pytest.mark.parametrize("name", list(IDS_SHAPES))
def test_flexattention_documents_and_softcap_run_as_the_builtins(name: str, route: str) -> None:
    """``examples/flex_port.py``'s functions: the ids become documents, the score function a
    soft-cap, and the call matches the oracle (which evaluates the functions themselves)."""
    shape, dtype = IDS_SHAPES[name]
    docs = packed_ids(shape[0], max(shape[3], shape[4]), 4, 2).to(DEVICE)
    bias = ModBias(mask_mod=documents_of(docs), score_mod=soft_cap)
    line = ids_call(bias, shape, dtype, route)
    assert "documents of the ids it compares" in line and "soft-cap 20" in line, line
    assert "generated functions" not in line, line


def test_ids_that_decrease_run_the_functions() -> None:
    """Ids that decrease along a row are no documents: the functions run as they are."""
    for name in ("remainders", "a negative divisor"):
        line = ids_call(
            ModBias(mask_mod=IDS_FOUND[name]), (1, 2, 1, 40, 40), torch.float32, "triton"
        )
        assert "generated functions" in line, (name, line)
    line = ids_call(
        ModBias(mask_mod=IDS_FOUND["two divisors"]), (1, 2, 1, 48, 24), torch.float32, "triton"
    )
    assert "documents of the ids it compares" in line, line


def test_ids_written_in_place_are_seen_by_the_next_call() -> None:
    """The ids are read again after an in-place write, whether the call was planned before
    (the plan cache) or not: sorted again into other documents, then made to decrease (the
    functions run), then sorted back."""
    shape = (2, 2, 1, 40, 40)
    docs = packed_ids(2, 40, 3, 3).to(DEVICE)
    bias = ModBias(mask_mod=documents_of(docs), score_mod=soft_cap)
    summed = bias + KeyRangeBias(start=[0, 2], end=[40, 36])
    for target in (bias, summed):
        assert "documents of the ids" in ids_call(target, shape, torch.float32, "triton")
        ids_call(target, shape, torch.float32, "triton", seed=1)  # planned, then cached
        docs.copy_(packed_ids(2, 40, 5, 4))
        assert "documents of the ids" in ids_call(target, shape, torch.float32, "triton")
        docs[1, 10] = 7  # decreases after it
        assert "generated functions" in ids_call(target, shape, torch.float32, "triton")
        docs.copy_(packed_ids(2, 40, 3, 3))


def test_ids_of_an_inference_tensor() -> None:
    """Tensors without a version counter: not cached, read at every call."""
    with torch.inference_mode():
        docs = packed_ids(1, 48, 3, 5).to(DEVICE)
    bias = ModBias(mask_mod=documents_of(docs))
    assert bias.cache_key() is None
    assert "documents of the ids" in ids_call(bias, (1, 2, 2, 48, 48), torch.float32, "triton")
    with torch.inference_mode():
        docs[0, 20:] = docs[0, 20]  # an in-place write, inside inference mode
    assert "documents of the ids" in ids_call(bias, (1, 2, 2, 48, 48), torch.float32, "triton")


SUMS: dict[str, tuple[Callable[[Any], Any], bool]] = {
    # (the sum of the port's bias, whether its score function still runs as the soft-cap)
    "causal first": (lambda port: attnbias.causal_upper_left() + port, True),
    "key range after": (lambda port: port + KeyRangeBias(start=[1, 0], end=[40, 33]), True),
    "ALiBi first": (lambda port: attnbias.AlibiBias(2) + port, False),
    "ALiBi after": (lambda port: port + attnbias.AlibiBias(2), False),
    "a soft-cap": (lambda port: SoftcapBias(3.0) + port, False),
    "a score function first": (lambda port: ModBias(score_mod=doubled) + port, False),
    "a score function after": (lambda port: port + ModBias(score_mod=doubled), True),
    "twice": (lambda port: port + ModBias(mask_mod=port.mask_mod, score_mod=soft_cap), False),
}


def doubled(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return 2 * score


@pytest.mark.parametrize("name", list(SUMS))
def test_a_softcap_score_function_keeps_its_place_in_a_sum(name: str) -> None:
    """A score function applies after the additive terms and the score functions before it,
    a soft-cap before them all: in a sum where that order matters, the soft-cap runs as its
    function (the oracle applies the functions in the semantics' order)."""
    make, as_softcap = SUMS[name]
    docs = packed_ids(2, 40, 3, 6).to(DEVICE)
    bias = make(ModBias(mask_mod=documents_of(docs), score_mod=soft_cap))
    line = ids_call(bias, (2, 2, 1, 40, 40), torch.float32, "triton")
    assert ("its score_mod as soft-cap 20" in line) == as_softcap, line

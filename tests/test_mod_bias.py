"""``ModBias``: mask and score functions with FlexAttention's signatures (``mask_mod``,
``score_mod``) through ``attnbias.sdpa``, against the fp64 oracle (``attnbias.testing.oracle``),
which evaluates each function itself on broadcast index grids.

Routes: the Triton kernel (``use_backends("triton")``, interpreted on CPU tensors with 16 x 16
tiles, so the shapes here are small but span full, partial and empty tiles), the exact eager
path (``use_backends("reference")``) and the default route on CPU without the interpreter.
Covered: the biases of the examples (prefix-LM, chunked local attention, 2-D neighbourhood
attention, a T5 relative-position table, a speculative-decoding tree, a FlexAttention pair of
closures), sums with the built-ins, GQA, L != S, fp32 / fp16 / bf16, gradients of q, k, v and
of tensors a ``score_mod`` reads, in-place changes of those tensors, rows that keep nothing,
the errors for functions that cannot be compiled, ``materialize``, and a property test over
lengths and parameters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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
    causal_upper_left,
    explain,
    sdpa,
    use_backends,
)
from attnbias.backends import triton as triton_backend
from attnbias.biases import parts_of
from attnbias.kernels import modemit
from attnbias.mods import eager as mod_reads
from attnbias.mods.trace import trace_mods
from attnbias.testing.oracle import (
    assert_close_to_oracle,
    attention,
    flash_rounding,
    grid_mask,
    grid_score,
    index_grids,
    is_mod_bias,
    mod_functions,
    pointwise,
)
from attnbias.testing.strategies import DTYPES, Problem, draw_inputs

ModBias: Any = getattr(attnbias, "ModBias", None)
pytestmark = [
    pytest.mark.skipif(ModBias is None, reason="attnbias.ModBias is not in this tree"),
    # the generated code of every mask here, the band- and chunk-shaped ones included (those
    # run as the built-ins by default: tests/test_mod_forms.py)
    pytest.mark.usefixtures("generated_mods"),
]
# the bias classes below derive from ModBias; a stand-in base keeps the module importable
# (and its tests skipped) where the class is missing
_Base: Any = ModBias if ModBias is not None else object

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
NAMES = ("out", "dq", "dk", "dv")
HEAD_DIM = 32
ROUTES = ("triton", "reference")


# --------------------------------------------------------------------------------------------
# The biases: subclasses (fields are parameters) and wrappers of plain functions


@dataclass(frozen=True)
class PrefixLM(_Base):
    """Bidirectional over the first ``prefix`` keys, causal after them."""

    prefix: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)


@dataclass(frozen=True)
class ChunkedLocal(_Base):
    """Llama 4's chunked attention: causal inside chunks of ``chunk`` tokens."""

    chunk: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx // self.chunk == kv_idx // self.chunk) & (kv_idx <= q_idx)


@dataclass(frozen=True)
class Neighbourhood2D(_Base):
    """2-D neighbourhood attention over a ``height x width`` image in row-major order: a
    ``window_h x window_w`` window whose centre is shifted inside the image at the border, so
    every query keeps exactly ``window_h * window_w`` keys."""

    height: int
    width: int
    window_h: int
    window_w: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        half_h, half_w = self.window_h // 2, self.window_w // 2
        centre_row = (q_idx // self.width).clamp(half_h, self.height - 1 - half_h)
        centre_col = (q_idx % self.width).clamp(half_w, self.width - 1 - half_w)
        row, col = kv_idx // self.width, kv_idx % self.width
        return ((row - centre_row).abs() <= half_h) & ((col - centre_col).abs() <= half_w)


@dataclass(frozen=True)
class HeadWindows(_Base):
    """A symmetric window per batch row and query head, ``|i - j| <= base + 8 h + 16 b``: a
    function of ``b`` and ``h`` (the query head, under GQA too)."""

    base: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx).abs() <= self.base + 8 * h + 16 * b


BUCKETS, MAX_DISTANCE = 8, 96


def t5_bucket(relative: Tensor) -> Tensor:
    """T5's causal buckets of ``relative = kv_idx - q_idx``: distances below ``BUCKETS // 2``
    exact, log-spaced up to ``MAX_DISTANCE``, the last bucket beyond. At 96 no integer distance
    lies within 0.01 of a bucket edge, so every float32 log puts it in the same bucket."""
    distance = (-relative).clamp(min=0)
    exact = BUCKETS // 2
    ratio = torch.log(distance.clamp(min=exact).to(torch.float32) / exact)
    ratio = ratio / math.log(MAX_DISTANCE / exact)
    large = (exact + (ratio * (BUCKETS - exact)).to(torch.int64)).clamp(max=BUCKETS - 1)
    return torch.where(distance < exact, distance, large)


@dataclass(frozen=True, eq=False)
class T5Bias(_Base):
    """T5's relative-position bias: a learnable ``(H, BUCKETS)`` table added to the scores."""

    table: Tensor

    def score_mod(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return score + self.table[h, t5_bucket(kv_idx - q_idx)]


def tanh_cap(cap: float) -> Callable[..., Tensor]:
    """A FlexAttention soft-cap ``score_mod`` (not additive: it has no materialized form)."""

    def soft_cap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return soft_cap


def flex_document_pair(docs: Tensor, cap: float) -> tuple[Callable[..., Tensor], ...]:
    """A FlexAttention ``mask_mod`` / ``score_mod`` pair as people write them: causal inside
    packed documents, read from a closure over ``docs`` (``(B, S)`` ids), and a soft-cap."""

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)

    return document_causal, tanh_cap(cap)


# A draft tree of 4 tokens: 0 the root, 1 and 2 its children, 3 a child of 1. Row i keeps the
# nodes on its path from the root (itself included).
ANCESTORS = torch.tensor(
    [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
)


def speculative_tree(ancestors: Tensor, length_kv: int) -> AttnBias:
    """A decode step verifying a draft tree: the ``L`` queries are the last ``L`` keys; every
    key before them (the cache) is visible, the tree's keys by ``ancestors[L, L]``."""
    cache = length_kv - ancestors.shape[0]

    def tree_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        node = (kv_idx - cache).clamp(min=0)
        return (kv_idx < cache) | ancestors[q_idx, node]

    return ModBias(mask_mod=tree_mask)


def documents(batch: int, length: int) -> Tensor:
    """``(B, S)`` non-decreasing document ids, different per batch row."""
    cuts = [[length // 3, length // 2], [length // 8, length - 9]][:batch]
    ids = [torch.bucketize(torch.arange(length), torch.tensor(row), right=True) for row in cuts]
    return torch.stack(ids).to(DEVICE)


def random_table(heads: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(heads, BUCKETS, generator=generator).to(DEVICE)


@dataclass
class Case:
    """A bias built from its tensor parameters (each run gives it fresh leaves), the call's
    ``(B, Hq, Hkv, L, S)`` and the dtype of its run on the kernel."""

    make: Callable[..., AttnBias]
    shape: tuple[int, int, int, int, int]
    dtype: torch.dtype = FP32
    params: tuple[Tensor, ...] = ()
    head_dim: int = HEAD_DIM


def flex_documents_case() -> Case:
    mask_mod, score_mod = flex_document_pair(documents(2, 64), 2.0)
    return Case(lambda: ModBias(mask_mod=mask_mod, score_mod=score_mod), (2, 2, 1, 64, 64))


CASES: dict[str, Callable[[], Case]] = {
    # the examples' biases
    "prefix_lm": lambda: Case(lambda: PrefixLM(20), (2, 2, 1, 64, 64), FP32),
    "chunked_local": lambda: Case(lambda: ChunkedLocal(32), (1, 2, 2, 96, 96), BF16),
    "neighbourhood_2d": lambda: Case(lambda: Neighbourhood2D(8, 12, 3, 5), (1, 2, 1, 96, 96), FP16),
    "t5_causal": lambda: Case(
        lambda table: T5Bias(table) + causal_lower_right(),
        (1, 4, 2, 40, 72), FP32, (random_table(4, 0),),
    ),
    # keys up to 160 back: the tiles past MAX_DISTANCE read the last bucket only, and the
    # kernels add it once per tile (modemit._score_cut); the tiles across bucket edges per pair
    "t5_far": lambda: Case(
        lambda table: T5Bias(table) + causal_lower_right(),
        (1, 2, 2, 48, 160), FP32, (random_table(2, 1),),
    ),
    "speculative_tree": lambda: Case(
        lambda: speculative_tree(ANCESTORS.to(DEVICE), 40) + causal_lower_right(),
        (2, 4, 2, 4, 40), BF16,
    ),
    "flex_documents": flex_documents_case,
    "head_windows": lambda: Case(lambda: HeadWindows(3), (2, 4, 2, 48, 48), FP16),
    # sums with the built-ins (masks intersect; soft-cap, then ALiBi, then each score_mod)
    "prefix_window": lambda: Case(
        lambda: PrefixLM(16) + SlidingWindowBias(24), (1, 2, 1, 64, 80), BF16
    ),
    "prefix_documents": lambda: Case(
        lambda: PrefixLM(8) + DocumentBias.from_seqlens([30, 34], device=DEVICE),
        (2, 2, 1, 64, 64), FP32,
    ),
    "chunked_key_range": lambda: Case(
        lambda: ChunkedLocal(16) + KeyRangeBias(start=[5, 0], end=[60, 41]),
        (2, 2, 1, 64, 64), FP16,
    ),
    "t5_softcap": lambda: Case(
        lambda table: T5Bias(table) + SoftcapBias(2.0) + causal_upper_left(),
        (1, 2, 2, 48, 48), BF16, (random_table(2, 1),),
    ),
    "tanh_alibi": lambda: Case(
        lambda: ModBias(score_mod=tanh_cap(1.5)) + AlibiBias(num_heads=4) + causal_lower_right(),
        (1, 4, 2, 40, 56), FP32,
    ),
    "tanh_then_t5": lambda: Case(
        lambda table: ModBias(score_mod=tanh_cap(1.5)) + T5Bias(table),
        (1, 2, 1, 32, 48), FP32, (random_table(2, 2),),
    ),
    "t5_then_tanh": lambda: Case(
        lambda table: T5Bias(table) + ModBias(score_mod=tanh_cap(1.5)),
        (1, 2, 1, 32, 48), BF16, (random_table(2, 2),),
    ),
}  # fmt: skip

MASK_ONLY = ("prefix_lm", "chunked_local", "neighbourhood_2d", "speculative_tree", "head_windows")


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest) -> Iterator[str]:
    with use_backends(request.param):
        yield str(request.param)


# --------------------------------------------------------------------------------------------
# Running a call against the oracle


def tensors(
    shape: tuple[int, int, int, int, int],
    dtype: torch.dtype,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``q, k, v, grad_out`` drawn in ``dtype`` on the device."""
    return draw_inputs(shape, head_dim, dtype, seed, DEVICE)


def results(
    fn: Callable[..., Tensor],
    case: Case,
    inputs: tuple[Tensor, Tensor, Tensor],
    grad_out: Tensor,
    param_grads: bool,
    param_dtype: torch.dtype | None = None,
) -> list[Tensor]:
    """``[out, dq, dk, dv, *dparams]`` of ``fn(q, k, v, bias)`` on fresh leaves, the bias made
    from fresh copies of the case's parameters (requiring grad when ``param_grads``). Every
    gradient must exist: a parameter left out of the graph raises here."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    params = [
        p.detach().clone().to(param_dtype or p.dtype).requires_grad_(param_grads)
        for p in case.params
    ]
    out = fn(*leaves, case.make(*params))
    sources = leaves + (params if param_grads else [])
    grads = torch.autograd.grad(out, sources, grad_out.to(out.dtype))
    return [out.detach(), *(g.detach() for g in grads)]


def check(
    case: Case,
    dtype: torch.dtype,
    *,
    fused: bool,
    param_grads: bool,
    call: Callable[..., Tensor] = sdpa,
    seed: int = 0,
) -> list[Tensor]:
    """Forward and every gradient of ``call`` within the oracle's budget (a fused kernel's own
    rounding included when ``fused``); returns ``[out, dq, dk, dv, *dparams]``."""
    q, k, v, grad_out = tensors(case.shape, dtype, seed, case.head_dim)
    gqa = case.shape[1] != case.shape[2]

    def ours(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias) -> Tensor:
        return call(q, k, v, attn_mask=bias, enable_gqa=gqa)

    def oracle(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias) -> Tensor:
        return attention(q, k, v, bias, enable_gqa=gqa)

    def stock_low(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias) -> Tensor:
        return attention(q, k, v, bias, enable_gqa=gqa, dtype=dtype)

    got = results(ours, case, (q, k, v), grad_out, param_grads)
    expected = results(
        oracle,
        case,
        (q.double(), k.double(), v.double()),
        grad_out.double(),
        param_grads,
        torch.float64,
    )
    low = results(stock_low, case, (q, k, v), grad_out, param_grads)
    names = NAMES + tuple(f"dparam{n}" for n in range(len(case.params) if param_grads else 0))
    rounding = None
    if fused:
        params = [p.detach().clone().requires_grad_() for p in case.params]
        rounding = flash_rounding(
            q, k, v, case.make(*params), grad_out, parameters=params if param_grads else ()
        )
    assert_close_to_oracle(got, expected, low, dtype, names, rounding)
    for name, result in zip(names, got, strict=True):
        assert torch.isfinite(result).all(), f"{name}: non-finite values"
    return got


def mod_parts(bias: AttnBias) -> list[Any]:
    return [p for p in parts_of(bias) if is_mod_bias(p)]


# --------------------------------------------------------------------------------------------
# The biases themselves, evaluated by the oracle


@pytest.mark.parametrize("name", list(CASES))
def test_functions_on_the_grid_agree_with_pointwise_calls(name: str) -> None:
    """The oracle's grid evaluation of each function is what FlexAttention's element-wise
    calls give (0-d int64 indices), at a handful of points."""
    case = CASES[name]()
    batch, heads_q, _, length_q, length_kv = case.shape
    bias = case.make(*case.params)
    grids = index_grids(batch, heads_q, length_q, length_kv, device=DEVICE)
    for part in mod_parts(bias):
        mask_mod, score_mod = mod_functions(part)
        assert mask_mod is not None or score_mod is not None
        if mask_mod is not None:
            positions, values = pointwise(mask_mod, *grids)
            keep = grid_mask(part, batch, heads_q, length_q, length_kv, device=DEVICE)
            assert torch.equal(torch.stack([keep[p] for p in positions]), values.to(DEVICE))
        if score_mod is not None:
            generator = torch.Generator().manual_seed(3)
            score = torch.randn(batch, heads_q, length_q, length_kv, generator=generator)
            score = score.to(DEVICE, torch.float64)
            positions, values = pointwise(score_mod, score, *grids)
            modified = grid_score(part, score)
            at = torch.stack([modified[p] for p in positions])
            torch.testing.assert_close(at, values.to(DEVICE, torch.float64), rtol=0, atol=0)


def test_the_neighbourhood_window_keeps_fifteen_keys_per_query() -> None:
    keep = grid_mask(Neighbourhood2D(8, 12, 3, 5), 1, 1, 96, 96, device=DEVICE)
    assert (keep.sum(-1) == 15).all()
    # a corner pixel's window is shifted inside the image: rows 0-2, columns 0-4
    corner = keep[0, 0, 0].reshape(8, 12)
    assert corner[:3, :5].all() and corner.sum() == 15


# --------------------------------------------------------------------------------------------
# Against the oracle, forward and every gradient


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_oracle(route: str, name: str) -> None:
    """On the kernel in the case's dtype; on the exact path in fp32, with the gradient of
    every tensor a score_mod reads (on the kernel: the next test)."""
    case = CASES[name]()
    fused = route == "triton"
    check(case, case.dtype if fused else FP32, fused=fused, param_grads=not fused)


@pytest.mark.parametrize("name", ["t5_causal", "t5_far", "t5_softcap", "tanh_then_t5"])
def test_a_score_mod_parameter_that_requires_grad(name: str) -> None:
    """The kernel gives a table's exact gradient, or refuses the call by name (the contract:
    never a silent ``None``); then a route that takes it gives the exact gradient."""
    case = CASES[name]()
    try:
        with use_backends("triton"):
            check(case, case.dtype, fused=True, param_grads=True)
        return
    except ValueError as refused:
        assert "grad" in str(refused), str(refused)
    check(case, FP32, fused=False, param_grads=True)


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", ["prefix_window", "t5_causal", "flex_documents"])
def test_dtypes_on_the_kernel(name: str, dtype: torch.dtype) -> None:
    with use_backends("triton"):
        check(CASES[name](), dtype, fused=True, param_grads=False, seed=1)


def test_the_order_of_score_mods_is_the_order_of_the_sum() -> None:
    """Soft-capping before adding a table and after it differ, and each matches the oracle
    (``test_matches_the_oracle`` runs both); this makes sure the two cases test something."""
    table = random_table(2, 2) * 4
    q, k, v, _ = tensors((1, 2, 1, 32, 48), FP32)
    with use_backends("reference"):
        first = sdpa(
            q, k, v, attn_mask=ModBias(score_mod=tanh_cap(1.5)) + T5Bias(table), enable_gqa=True
        )
        second = sdpa(
            q, k, v, attn_mask=T5Bias(table) + ModBias(score_mod=tanh_cap(1.5)), enable_gqa=True
        )
    assert (first - second).abs().max() > 1e-3


# --------------------------------------------------------------------------------------------
# The route


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU route")
@pytest.mark.parametrize("name", list(CASES))
def test_on_cpu_without_the_interpreter_the_exact_path_runs(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    case = CASES[name]()
    q, k, v, _ = tensors(case.shape, FP32)
    gqa = case.shape[1] != case.shape[2]
    q.requires_grad_(True)
    taken = explain(q, k, v, attn_mask=case.make(*case.params), enable_gqa=gqa)
    assert taken.split(":")[0] in ("reference", "sdpa+mask"), taken
    check(case, FP32, fused=False, param_grads=True)


@pytest.mark.parametrize("name", ["prefix_lm", "t5_causal", "flex_documents", "tanh_alibi"])
def test_explain_names_the_triton_kernel(name: str) -> None:
    case = CASES[name]()
    q, k, v, _ = tensors(case.shape, case.dtype)
    q.requires_grad_(True)
    gqa = case.shape[1] != case.shape[2]
    with use_backends("triton"):
        text = explain(q, k, v, attn_mask=case.make(*case.params), enable_gqa=gqa)
    assert text.startswith("triton:"), text


def gapped_cache(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Key blocks kept whole, dropped whole and cut (by the band): the decode kernel's tile
    bounds skip the function on the first and must not on the others."""
    return (kv_idx < 40) | (kv_idx >= 70)


@pytest.mark.parametrize(
    "name",
    ["tree", "tree_t5", "head_windows", "gapped"],
    ids=["tree", "tree+T5", "head_windows", "gapped"],
)
def test_a_decode_step_on_the_decode_kernel(name: str) -> None:
    """Few queries, no gradients: the decode kernel runs the functions too (forward), with
    its packed rows of several query heads (GQA: ``h`` differs between rows of a tile)."""
    shape = (2, 4, 2, 4, 40)
    if name == "head_windows":
        bias: AttnBias = HeadWindows(3)
    elif name == "gapped":
        shape = (2, 4, 2, 4, 100)
        bias = ModBias(mask_mod=gapped_cache) + causal_lower_right()
    else:
        bias = speculative_tree(ANCESTORS.to(DEVICE), 40) + causal_lower_right()
        if name == "tree_t5":
            bias = bias + T5Bias(random_table(4, 3))
    q, k, v, _ = tensors(shape, BF16)
    with use_backends("triton-decode"):
        assert explain(q, k, v, attn_mask=bias, enable_gqa=True).startswith("triton-decode:")
        out = sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    expected = attention(q.double(), k.double(), v.double(), bias, enable_gqa=True)
    low = attention(q, k, v, bias, enable_gqa=True, dtype=BF16)
    rounding = flash_rounding(q, k, v, bias, torch.zeros_like(q))[:1]
    assert_close_to_oracle([out], [expected], [low], BF16, ("out",), rounding)


# --------------------------------------------------------------------------------------------
# Tensors the functions read: in-place changes are seen


def test_an_in_place_change_of_a_closure_tensor_is_seen(route: str) -> None:
    docs = documents(2, 64)
    mask_mod, score_mod = flex_document_pair(docs, 2.0)
    bias = ModBias(mask_mod=mask_mod, score_mod=score_mod)
    case = Case(lambda: bias, (2, 2, 1, 64, 64), BF16 if route == "triton" else FP32)
    fused = route == "triton"
    before = check(case, case.dtype, fused=fused, param_grads=False)
    docs.copy_(torch.stack([torch.arange(64) // 7, torch.arange(64) // 40]).to(DEVICE))
    # the oracle reads the same closure: it sees the new ids too
    after = check(case, case.dtype, fused=fused, param_grads=False)
    assert not torch.equal(before[0], after[0]), "the new documents changed nothing"


def test_an_in_place_change_of_a_field_tensor_is_seen(route: str) -> None:
    table = random_table(4, 0)
    bias = T5Bias(table) + causal_lower_right()
    case = Case(lambda: bias, (1, 4, 2, 40, 72), FP32)
    fused = route == "triton"
    before = check(case, FP32, fused=fused, param_grads=False)
    table.mul_(-3.0)
    after = check(case, FP32, fused=fused, param_grads=False)
    assert not torch.equal(before[0], after[0]), "the new table changed nothing"


# --------------------------------------------------------------------------------------------
# Rows that keep nothing


def test_rows_that_keep_nothing_give_zero_and_zero_gradients(route: str) -> None:
    """Query rows 10-39 keep no key (a whole 16-row tile among them): output 0, and every
    gradient from them 0 and finite, the table's included (on the exact path)."""

    def rows_outside_ten_to_forty(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx < 10) | (q_idx >= 40)

    case = Case(
        lambda table: ModBias(mask_mod=rows_outside_ten_to_forty) + T5Bias(table),
        (1, 2, 1, 48, 40),
        FP32,
        (random_table(2, 4),),
    )
    fused = route == "triton"
    got = check(case, FP32, fused=fused, param_grads=not fused)
    out, dq = got[0], got[1]
    assert (out[:, :, 10:40] == 0).all() and (dq[:, :, 10:40] == 0).all()
    assert out[:, :, :10].abs().amax() > 0


# --------------------------------------------------------------------------------------------
# Functions that cannot be compiled: clear errors at the first call


def early_queries_only(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    if q_idx > 3:  # a Python branch on an index: data-dependent control flow
        return kv_idx <= q_idx
    return kv_idx >= 0


def running_total(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return torch.cumsum(kv_idx, dim=-1) <= q_idx


def cumulative_score(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return torch.cumsum(score, dim=-1)


def test_a_python_branch_on_an_index_is_refused_by_name(route: str) -> None:
    bias = ModBias(mask_mod=early_queries_only)
    q, k, v, _ = tensors((1, 2, 2, 32, 32), FP32)
    with pytest.raises((TypeError, ValueError)) as caught:
        sdpa(q, k, v, attn_mask=bias)
    message = str(caught.value)
    assert "early_queries_only" in message, message
    assert re.search(r"data[- ]dependent", message, re.IGNORECASE), message


@pytest.mark.parametrize(
    ("kind", "function"),
    [("mask_mod", running_total), ("score_mod", cumulative_score)],
    ids=["mask_mod", "score_mod"],
)
def test_an_unsupported_operator_is_refused_by_name(
    route: str, kind: str, function: Callable[..., Tensor]
) -> None:
    bias = ModBias(**{kind: function})
    q, k, v, _ = tensors((1, 2, 2, 32, 32), FP32)
    with pytest.raises((TypeError, ValueError)) as caught:
        sdpa(q, k, v, attn_mask=bias)
    message = str(caught.value)
    assert "cumsum" in message and function.__name__ in message, message


def test_a_table_read_through_a_bucket_is_checked_for_one_value_per_tile() -> None:
    """A table read at a bucket of the positions is checked per tile for one bucket (the
    T5 case); a score that reads a position as a number (ALiBi's distance) never is."""
    table = random_table(2, 0)
    traced = trace_mods([], [T5Bias(table).score_mod])
    cut = modemit._score_cut(traced)
    assert cut is not None and len(cut) == 1
    (node,) = (traced.nodes[i] for i in cut)
    assert node.kind == "int" and node.op == "where", node  # t5_bucket's last step

    def alibi(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score - 0.5 * (q_idx - kv_idx).abs()

    assert modemit._score_cut(trace_mods([], [alibi])) is None
    source = modemit.generate(traced)
    assert "if UNIFORM:" in source and "TILED: tl.constexpr = False" in source


# --------------------------------------------------------------------------------------------
# materialize: derived from the functions


@pytest.mark.parametrize("name", MASK_ONLY)
def test_materialize_of_a_mask_is_its_grid(name: str) -> None:
    case = CASES[name]()
    batch, heads_q, _, length_q, length_kv = case.shape
    shape = (batch, heads_q, length_q, length_kv)
    for part in mod_parts(case.make()):
        made = part.materialize(DEVICE, shape=shape, dtype=FP32)
        assert made.dtype == FP32 and made.device.type == torch.device(DEVICE).type
        keep = grid_mask(part, *shape, device=DEVICE)
        expected = torch.zeros(shape, device=DEVICE).masked_fill(~keep, -math.inf)
        assert torch.equal(made.broadcast_to(shape), expected)


def test_materialize_of_an_additive_score_mod_is_the_added_term() -> None:
    shape = (1, 4, 40, 72)
    table = random_table(4, 0)
    zeros = torch.zeros(shape, dtype=FP32, device=DEVICE)
    added = grid_score(T5Bias(table), zeros)  # score + g(...) at score 0: g
    made = T5Bias(table).materialize(DEVICE, shape=shape, dtype=FP32)
    torch.testing.assert_close(made.broadcast_to(shape), added, rtol=0, atol=0)

    def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx

    causal_t5 = ModBias(mask_mod=causal, score_mod=T5Bias(table).score_mod)
    keep = grid_mask(causal_t5, *shape, device=DEVICE)
    made = causal_t5.materialize(DEVICE, shape=shape, dtype=FP32)
    torch.testing.assert_close(
        made.broadcast_to(shape), added.masked_fill(~keep, -math.inf), rtol=0, atol=0
    )


@pytest.mark.parametrize("name", ["flex_documents", "tanh_alibi"])
def test_materialize_of_a_score_mod_with_no_additive_form_raises(name: str) -> None:
    case = CASES[name]()
    batch, heads_q, _, length_q, length_kv = case.shape
    (part,) = mod_parts(case.make())
    with pytest.raises(TypeError):
        part.materialize(DEVICE, shape=(batch, heads_q, length_q, length_kv), dtype=FP32)


# --------------------------------------------------------------------------------------------
# Property test: lengths and parameters on the kernel


@st.composite
def mod_problems(draw: st.DrawFn) -> Problem:
    """A prefix-LM or chunked mask of drawn parameters over drawn lengths (L < S, L = S,
    L > S), alone or with lower-right causal; GQA groups up to 2, at most 2 (b, h) pairs."""
    length_q = draw(st.integers(1, 64))
    length_kv = draw(st.integers(1, 64))
    bias: AttnBias
    if draw(st.booleans()):
        bias = PrefixLM(draw(st.integers(0, length_kv)))
    else:
        bias = ChunkedLocal(draw(st.integers(1, 40)))
    if draw(st.booleans()):
        bias = bias + causal_lower_right()
    batch, heads_kv, group = draw(st.sampled_from([(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1)]))
    return Problem(
        batch=batch,
        heads_q=heads_kv * group,
        heads_kv=heads_kv,
        length_q=length_q,
        length_kv=length_kv,
        head_dim=draw(st.sampled_from([16, 32])),
        dtype=draw(st.sampled_from(DTYPES)),
        bias=bias,
        is_causal=False,
        scale=draw(st.sampled_from([None, 0.3])),
    )


@settings(max_examples=15)
@given(problem=mod_problems(), seed=st.integers(0, 2**16))
def test_the_kernel_over_lengths_and_parameters(problem: Problem, seed: int) -> None:
    q, k, v, _ = (t.to(DEVICE) for t in problem.tensors(seed))
    gqa = problem.heads_q != problem.heads_kv
    kwargs: dict[str, Any] = dict(scale=problem.scale, enable_gqa=gqa)
    with use_backends("triton"):
        out = sdpa(q, k, v, attn_mask=problem.bias, **kwargs)
    expected = attention(q.double(), k.double(), v.double(), problem.bias, **kwargs)
    low = attention(q, k, v, problem.bias, dtype=problem.dtype, **kwargs)
    rounding = flash_rounding(q, k, v, problem.bias, torch.zeros_like(q), scale=problem.scale)
    assert_close_to_oracle([out], [expected], [low], problem.dtype, ("out",), rounding[:1])


# --------------------------------------------------------------------------------------------
# Real sizes on the GPU: the default route, and torch.compile


def gpu_case(name: str) -> Case:
    """B=2, Hq=4, Hkv=2, L=S=1024, E=64."""
    shape = (2, 4, 2, 1024, 1024)
    if name == "prefix_t5":
        table = random_table(4, 5)
        return Case(lambda: PrefixLM(100) + T5Bias(table), shape, BF16, head_dim=64)
    if name == "chunked_local":
        return Case(lambda: ChunkedLocal(256), shape, BF16, head_dim=64)
    mask_mod, score_mod = flex_document_pair(documents(2, 1024), 30.0)
    bias = ModBias(mask_mod=mask_mod, score_mod=score_mod)
    return Case(lambda: bias, shape, BF16, head_dim=64)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["prefix_t5", "chunked_local", "flex_documents"])
def test_real_size_on_the_gpu(name: str) -> None:
    case = gpu_case(name)
    q, k, v, _ = tensors(case.shape, BF16, head_dim=case.head_dim)
    q.requires_grad_(True)
    text = explain(q, k, v, attn_mask=case.make(), enable_gqa=True)
    # FlashAttention 4 where it is installed and takes the call (Hopper), else the Triton kernel
    assert text.startswith(("triton:", "fa4:")), text
    check(case, BF16, fused=True, param_grads=False)


@pytest.mark.gpu
@pytest.mark.slow
def test_torch_compile_fullgraph_on_the_gpu() -> None:
    torch._dynamo.reset()

    def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: AttnBias, enable_gqa: bool) -> Tensor:
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)

    compiled = torch.compile(attend, fullgraph=True)
    case = gpu_case("prefix_t5")
    # twice, on new contents: the second call runs what the first one compiled
    for seed in (0, 1):
        check(case, BF16, fused=True, param_grads=False, call=compiled, seed=seed)


def test_torch_compile_fullgraph_over_a_bias_never_called_before() -> None:
    """A ModBias traces its functions when it is built, so ``torch.compile(fullgraph=True)``
    takes a call whose bias (a sum of two ModBias parts and a built-in, with a learnable table)
    meets the library for the first time inside the compiled function; forward and every
    gradient against the oracle (the CPU's route here: the GPU test compiles the kernels)."""
    torch._dynamo.reset()

    def attend(q: Tensor, k: Tensor, v: Tensor, attn_mask: AttnBias, enable_gqa: bool) -> Tensor:
        return sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    case = Case(
        lambda table: PrefixLM(12) + T5Bias(table) + causal_lower_right(),
        (2, 4, 2, 40, 56),
        FP32,
        (random_table(4, 3),),
    )
    for seed in (0, 1):
        check(case, FP32, fused=False, param_grads=True, call=compiled, seed=seed)


def test_a_bias_built_inside_torch_compile_is_refused_naming_the_fix() -> None:
    torch._dynamo.reset()
    table = random_table(2, 0)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, attn_mask=PrefixLM(8) + T5Bias(table))

    q = torch.randn(1, 2, 16, 8, device=DEVICE)
    with pytest.raises(Exception, match="build the bias outside the compiled function and pass"):
        torch.compile(attend, fullgraph=True, backend="eager")(q, q, q)


def test_a_bias_built_inside_torch_compile_without_fullgraph_is_built_eagerly() -> None:
    """Without ``fullgraph=True`` the build runs eagerly at a graph break: the call is right,
    forward and gradients, on two calls with new contents."""
    torch._dynamo.reset()
    table = random_table(4, 3)

    def make() -> AttnBias:
        return PrefixLM(12) + T5Bias(table) + causal_lower_right()

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return sdpa(q, k, v, attn_mask=make(), enable_gqa=True)

    compiled = torch.compile(attend, backend="aot_eager")
    case = Case(make, (2, 4, 2, 40, 56), FP32)
    # the kernels do not run under torch.compile on the interpreter: the CPU's exact route
    with attnbias.use_backends(exclude=["triton"]):
        for seed in (0, 1):
            check(
                case,
                FP32,
                fused=False,
                param_grads=False,
                seed=seed,
                call=lambda q, k, v, attn_mask, enable_gqa: compiled(q, k, v),
            )


def test_a_sum_keeps_the_code_of_its_parts_together() -> None:
    """A sum of ModBias parts generates its code once, when built: its calls and a second
    identical-parts sum reuse it, a sum of other parts gets its own."""
    from attnbias.biases.mod_state import compiled_mods

    prefix, t5 = PrefixLM(8), T5Bias(random_table(2, 0))
    made = compiled_mods((prefix, t5))
    assert compiled_mods((prefix, t5)) is made
    assert (prefix + t5 + causal_lower_right()).parts[:2] == (prefix, t5)
    assert compiled_mods((prefix, t5)) is made
    other = compiled_mods((prefix, T5Bias(random_table(2, 1))))
    assert other is not made and other.traced.params[0] is not made.traced.params[0]


def test_a_sum_keeps_no_other_parts_tensors_alive() -> None:
    """The compiled form of a sum, kept by its first part, holds every part's tensors: it goes
    when another part is freed, so the first part keeps no other part's table alive."""
    import gc
    import weakref

    from attnbias.biases.mod_state import compiled_mods

    prefix = PrefixLM(8)
    t5 = T5Bias(random_table(2, 0))
    table = weakref.ref(t5.table)
    made = compiled_mods((prefix, t5))
    assert compiled_mods((prefix, t5)) is made
    del made, t5
    gc.collect()
    assert table() is None, "the first part of a sum kept another part's table alive"
    assert prefix._state.combined == []


def test_a_mod_bias_keeps_what_it_works_out_in_one_bounded_state() -> None:
    """Everything a ModBias works out lives in one object (one entry of its __dict__, left
    out of copies); its per-shape tables are bounded, and a change of the values its functions
    read drops them all together."""
    import copy

    from attnbias.biases import mod_state
    from attnbias.terms import Block, Call

    bias = PrefixLM(8)
    assert [name for name in vars(bias) if name.startswith("_")] == ["_modbias_state"]
    state = bias._state
    assert state.traced is not None and state.compiled is not None
    call = Call(1, 2, 64, 64, torch.device(DEVICE))
    for start in range(mod_state.MAX_BLOCKS + 40):
        bias.sub_block(call, Block(start, 0, 1, 64))
    assert len(state.blocks) == mod_state.MAX_BLOCKS
    t5 = T5Bias(random_table(2, 0))  # reads the head: each start is a copy of its own
    for start in range(1, mod_state.MAX_HEAD_STARTS + 10):
        t5.sub_heads(Call(1, 200, 64, 64, torch.device(DEVICE)), start, 1)
    assert len(t5._state.head_ranges) == mod_state.MAX_HEAD_STARTS
    assert "_modbias_state" not in copy.deepcopy(bias).__getstate__()
    object.__setattr__(bias, "prefix", 9)  # a value its function reads
    bias._traced()
    assert len(state.blocks) == 0 and state.compiled is None


def test_terms_are_compiled_when_the_lowering_finishes_not_when_built() -> None:
    """Building or merging terms compiles nothing: the program and its generated functions
    come with :meth:`Terms.finish`, which wants the compiled form exactly where there are
    ModBias parts."""
    from attnbias.biases.mod_state import compiled_mods
    from attnbias.terms import Terms

    bias = PrefixLM(8)
    terms = Terms(mods=(bias,)).merge(Terms(band_hi=0))
    assert terms.program is None
    with pytest.raises(ValueError, match="compiled form"):
        terms.finish(16, 16)
    with pytest.raises(ValueError, match="compiled form"):
        Terms().finish(16, 16, compiled_mods((bias,)))
    program = terms.finish(16, 16, compiled_mods((bias,))).program
    assert program is not None and program.mods is compiled_mods((bias,))


def test_double_backward_through_a_learnable_table_is_refused() -> None:
    """The fused gradient of a table is first order: differentiating it again raises, it
    never comes back silently detached."""
    table = random_table(2, 11).requires_grad_(True)
    q, k, v = (
        torch.randn(1, 2, 32, 16, device=DEVICE, dtype=FP32, requires_grad=True) for _ in range(3)
    )
    with use_backends("triton"):
        out = sdpa(q, k, v, attn_mask=T5Bias(table))
    grad_q, grad_table = torch.autograd.grad(out.sum(), (q, table), create_graph=True)
    assert grad_table.requires_grad
    with pytest.raises(NotImplementedError, match="double backward"):
        (grad_q.sum() + grad_table.sum()).backward()


def test_new_numbers_and_lengths_compile_nothing_new() -> None:
    """Numbers are runtime arguments of the generated code: two prefix lengths, two chunk
    sizes and two closures over different tensors share one generated function each."""
    from attnbias.biases.mod_state import compiled_mods

    assert compiled_mods((PrefixLM(16),)).mask_fn is compiled_mods((PrefixLM(40),)).mask_fn
    assert compiled_mods((ChunkedLocal(32),)).mask_fn is compiled_mods((ChunkedLocal(64),)).mask_fn
    first, second = documents(2, 64), documents(2, 64) * 3
    pair_a = flex_document_pair(first, 2.0)
    pair_b = flex_document_pair(second, 5.0)
    made_a = compiled_mods((ModBias(mask_mod=pair_a[0], score_mod=pair_a[1]),))
    made_b = compiled_mods((ModBias(mask_mod=pair_b[0], score_mod=pair_b[1]),))
    assert made_a.mask_fn is made_b.mask_fn and made_a.score_fn is made_b.score_fn
    # the values differ, the code does not
    assert made_a.traced.consts != made_b.traced.consts
    assert made_a.traced.params[0] is first and made_b.traced.params[0] is second


# --------------------------------------------------------------------------------------------
# Integer widths: a cast to int64 runs in 32 bits only where no value derived from it can leave
# 32 bits


def test_a_bounded_bucket_cast_runs_in_32_bits() -> None:
    """T5's ``.to(torch.int64)`` of a log-spaced bucket is bounded by the trace's numbers."""
    traced = T5Bias(random_table(2, 0))._traced()
    casts = [i for i, n in enumerate(traced.nodes) if n.op == "cast" and n.args[1:] == ("int", 64)]
    assert len(casts) == 1
    assert traced.narrow_casts() == frozenset(casts)


def _scaled_index(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # kv * 1e10 leaves 32 bits: int64's remainder differs from a saturated int32's (a term of
    # the key position: one of the query's alone would cancel in the softmax)
    bucket = (kv_idx.to(torch.float32) * 1e10).to(torch.int64) % 7
    return score + TABLE_7[bucket]


def _multiplied_index(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # the cast fits in 32 bits, its product with 2**28 does not
    bucket = (kv_idx.to(torch.float32).to(torch.int64) * 2**28 + q_idx) % 7
    return score + TABLE_7[bucket]


def _log_index(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # log of a negative distance is NaN, and a NaN's integer is undefined
    bucket = torch.log((q_idx - kv_idx).to(torch.float32)).to(torch.int64)
    return score + TABLE_7[bucket.clamp(0, 6)]


TABLE_7 = torch.linspace(-1.0, 1.0, 7, device=DEVICE)


@pytest.mark.parametrize("fn", [_scaled_index, _multiplied_index, _log_index])
def test_casts_that_may_leave_32_bits_stay_64_bits(fn: Callable[..., Tensor]) -> None:
    traced = ModBias(score_mod=fn)._traced()
    assert traced.narrow_casts() == frozenset()


@pytest.mark.parametrize("fn", [_scaled_index, _multiplied_index])
def test_an_index_past_32_bits_matches_the_oracle_on_the_kernel(fn: Callable[..., Tensor]) -> None:
    case = Case(lambda: ModBias(score_mod=fn) + causal_upper_left(), (1, 2, 2, 40, 40))
    with use_backends("triton"):
        check(case, FP32, fused=True, param_grads=False)


# --------------------------------------------------------------------------------------------
# Block states from the masks' bounds: a block settled by intervals (all dropped, all kept) is
# exactly what the pairs say; an unsettled one is evaluated pair by pair


def _every_operator(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    distance = q_idx - kv_idx
    stepped = torch.where(distance >= 0, distance * 3 // 2, (-distance) % 5)
    clamped = torch.clamp(torch.abs(kv_idx - 40), 3, 30)
    same = torch.minimum(q_idx // 7, kv_idx // 7) == torch.maximum(q_idx % 9, kv_idx % 11)
    narrow = q_idx.to(torch.int32) != kv_idx
    late = ((h * 8 + b) > 5) & (kv_idx > q_idx)
    return ((stepped < 20) | ~(clamped > 10)) ^ (same & narrow) | late


def _bands(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # bands of keys by a product and a floor division of both positions
    return ((q_idx // 16) * 2 - kv_idx // 16 >= 0) & ((q_idx * 3) // 50 <= kv_idx // 10 + 2)


def _assert_lists_match_the_pairs(bias: ModBias, batch: int, heads: int, length_q: int,
                                  length_kv: int) -> None:  # fmt: skip
    """The block lists the kernels build for ``bias`` (its tile function, then the pairs of
    the blocks it leaves unsettled) are the lists of its exact keep-mask."""
    from attnbias.kernels.blocks import block_lists_of_keep
    from attnbias.kernels.masks import list_block_sizes, with_mod_lists
    from attnbias.spec import lower

    q = torch.zeros(batch, heads, length_q, 16, device=DEVICE)
    k = torch.zeros(batch, heads, length_kv, 16, device=DEVICE)
    program = lower(bias, length_q, length_kv, q.device, batch=batch).program
    got = with_mod_lists(q, k, program).blocks
    assert got is not None
    keep = grid_mask(bias, batch, heads, length_q, length_kv, device=DEVICE)
    expected = block_lists_of_keep(keep, *list_block_sizes())
    rows, list_heads = got.kv_lists.shape[:2]
    for name in ("kv_lists", "q_lists"):
        # [..., slot, 0] counts the blocks, [..., slot, 1:] lists them first (the rest differs)
        mine = getattr(got, name)
        exact = getattr(expected, name)[:rows, :list_heads].expand_as(mine)
        assert torch.equal(mine[..., 0], exact[..., 0]), name
        listed = torch.arange(mine.shape[-1] - 1, device=DEVICE) < mine[..., :1]
        assert torch.equal(mine[..., 1:][listed], exact[..., 1:][listed]), name


ROW_ENDS = torch.tensor([50, 81], device=DEVICE)  # per batch row of two
TREE_4 = torch.tensor(
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=DEVICE
)  # node n's ancestors (parent (n - 1) // 2) and itself
HEAD_REACH = torch.tensor([5, 17, 33, -1], device=DEVICE)  # per head of four
HEAD_SLOPES = torch.tensor([0.5, 0.25, 0.125, 2.0], device=DEVICE)


def _tree_at_row_end(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # a draft tree of four nodes ending at a per-row position, as over a paged cache
    cache = ROW_ENDS[b] - 4
    return (kv_idx < cache) | TREE_4[q_idx % 4, (kv_idx - cache).clamp(0, 3)]


def _per_head_reach(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    # an integer and a float read per head, and a read of a read
    slope = HEAD_SLOPES[h] * (q_idx - kv_idx).to(torch.float32)
    return (kv_idx <= q_idx + HEAD_REACH[h]) & (slope > -4.0) | (kv_idx == ROW_ENDS[b % 2] // 2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: PrefixLM(20),
        lambda: ChunkedLocal(32),
        lambda: Neighbourhood2D(8, 12, 3, 5),
        lambda: HeadWindows(3),
        lambda: ModBias(mask_mod=_every_operator),
        lambda: ModBias(mask_mod=_bands),
        lambda: ModBias(mask_mod=flex_document_pair(documents(2, 96), 2.0)[0]),
        lambda: ModBias(mask_mod=_tree_at_row_end),
        lambda: ModBias(mask_mod=_per_head_reach),
    ],
    ids=[
        "prefix", "chunked", "2d", "head_windows", "every_operator", "bands", "documents",
        "tree_at_row_end", "per_head_reach",
    ],
)  # fmt: skip
@pytest.mark.parametrize("lengths", [(96, 96), (40, 90), (90, 37)])
def test_block_states_from_bounds_match_the_pairs(
    make: Callable[[], ModBias], lengths: tuple[int, int]
) -> None:
    _assert_lists_match_the_pairs(make(), 2, 4, *lengths)


@settings(max_examples=8)
@given(
    form=st.integers(0, 4),
    rows=st.lists(st.integers(-10, 60), min_size=2, max_size=2),
    reach=st.lists(st.integers(-5, 40), min_size=4, max_size=4),
    slopes=st.lists(st.floats(-1.0, 1.0, width=32), min_size=4, max_size=4),
    shift=st.lists(st.integers(-20, 20), min_size=8, max_size=8),
    lengths=st.sampled_from([(40, 40), (33, 47)]),
)
def test_reads_of_one_element_per_block_keep_the_lists_exact(
    form: int, rows: list[int], reach: list[int], slopes: list[float], shift: list[int],
    lengths: tuple[int, int],
) -> None:  # fmt: skip
    """Masks reading per-row, per-head and per-(row, head) values (ints and floats, a read
    indexed by another read), as the tile function now loads them: the lists are exact for
    any values."""
    row = torch.tensor(rows, device=DEVICE)
    head = torch.tensor(reach, device=DEVICE)
    slope = torch.tensor(slopes, device=DEVICE)
    both = torch.tensor(shift, device=DEVICE).reshape(2, 4)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if form == 0:
            return kv_idx < row[b] + q_idx // 2
        if form == 1:
            return (kv_idx - row[b]).abs() <= head[h]
        if form == 2:
            ahead = slope[h] * (q_idx - kv_idx).to(torch.float32) > -3.0
            return ahead & (kv_idx <= q_idx + both[b, h])
        if form == 3:
            return kv_idx >= head[row[b] % 4]
        return (kv_idx < row[b]) | (q_idx == kv_idx)

    _assert_lists_match_the_pairs(ModBias(mask_mod=mask_mod), 2, 4, *lengths)


def _tile_verdict(
    bias: ModBias, b: int, h: int, q: tuple[int, int], kv: tuple[int, int]
) -> tuple[bool, bool]:
    """``(may_keep, may_drop)`` of the generated tile function of ``bias`` for queries
    ``[q[0], q[1]]`` and keys ``[kv[0], kv[1]]`` of batch row ``b`` and head ``h``."""
    from attnbias.biases.mod_state import compiled_mods
    from attnbias.kernels.modfn import jit_from_source

    made = compiled_mods((bias,))
    args = made.args()
    flat = ", ".join(f"MOD{i}" for i in range(len(args)))
    source = (
        "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
        f"def probe(Out, b, h, q_lo, q_hi, kv_lo, kv_hi, {flat}):\n"
        f"    keep, drop = tile_fn(b, h, q_lo, q_hi, kv_lo, kv_hi, ({flat},))\n"
        "    tl.store(Out, keep.to(tl.int32))\n"
        "    tl.store(Out + 1, drop.to(tl.int32))\n"
    )
    probe = jit_from_source(source, "tile_probe", {"tile_fn": made.tile_fn})["probe"]
    out = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    probe[(1,)](out, b, h, *q, *kv, *args)
    return bool(out[0]), bool(out[1])


def test_a_read_of_one_element_per_block_settles_blocks() -> None:
    """``ROW_ENDS[b]`` and ``HEAD_REACH[h]`` are one element per block: the tile function
    loads it, so that blocks wholly inside or outside what they keep are settled (no pair
    evaluated, a full block run unmasked), as for a constant."""
    tree = ModBias(mask_mod=_tree_at_row_end)
    # row 1 ends at 81: keys [0, 77) are its earlier tokens, kept by every node
    assert _tile_verdict(tree, 1, 0, (0, 3), (0, 63)) == (True, False)
    assert _tile_verdict(tree, 0, 0, (0, 3), (0, 45)) == (True, False)
    # the tree's own keys: some kept, some dropped
    assert _tile_verdict(tree, 0, 0, (0, 3), (46, 49)) == (True, True)
    reach = ModBias(mask_mod=lambda b, h, q_idx, kv_idx: kv_idx > q_idx + HEAD_REACH[h])
    assert _tile_verdict(reach, 0, 1, (0, 15), (0, 15)) == (False, True)  # all dropped
    assert _tile_verdict(reach, 0, 3, (10, 15), (20, 40)) == (True, False)  # all kept
    assert _tile_verdict(reach, 0, 3, (0, 15), (0, 15)) == (True, True)


def test_a_read_that_varies_over_a_block_stays_unsettled() -> None:
    """A read whose index moves over the block (``TREE_4[q_idx % 4, ...]``), or is negative
    (counting from the end), is left unknown: the block's pairs are evaluated."""
    tree = ModBias(mask_mod=_tree_at_row_end)
    assert _tile_verdict(tree, 0, 0, (0, 3), (46, 46)) == (True, True)
    from_end = ModBias(mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= HEAD_REACH[h - 4])
    assert _tile_verdict(from_end, 0, 1, (0, 3), (0, 3)) == (True, True)


# --------------------------------------------------------------------------------------------
# Reads as eager PyTorch indexes them: a negative index within the size counts from the end,
# any other index outside the tensor raises IndexError (on every route, before a kernel runs);
# integer arithmetic in 64 bits where 32 could wrap


def _documents_40(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return DOCS_40[q_idx] == DOCS_40[kv_idx]


def _one_row(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score + ROW_OF_ONE[b, kv_idx]


def _two_heads(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return score + TWO_HEADS[h]


DOCS_40 = (torch.arange(40) // 10).to(DEVICE)  # ids of 40 positions, for calls of 64
ROW_OF_ONE = torch.randn(1, 64).to(DEVICE)  # one batch row, for calls of two
TWO_HEADS = torch.randn(2).to(DEVICE)  # two heads' entries, for calls of four

# (function, as mask_mod or score_mod, (B, Hq, L, S), what the error says)
OUT_OF_RANGE = {
    "documents": (_documents_40, "mask_mod", (1, 2, 64, 64), "size 40", "[0, 63]"),
    "batch_row": (_one_row, "score_mod", (2, 2, 32, 64), "size 1", "[0, 1]"),
    "head": (_two_heads, "score_mod", (1, 4, 32, 32), "size 2", "[0, 3]"),
}


@pytest.mark.parametrize("path", ["materialize", "reference", "triton"])
@pytest.mark.parametrize("name", list(OUT_OF_RANGE))
def test_a_read_outside_its_tensor_raises_index_error(name: str, path: str) -> None:
    """Eager PyTorch raises for ``docs[63]`` of 40 ids; so do materialize, the exact path and
    the kernel's route (before anything runs), naming the function, the size and the range
    the indices reach, never reading a clamped element instead."""
    function, kind, shape, size, reach = OUT_OF_RANGE[name]
    bias = ModBias(**{kind: function})
    batch, heads, length_q, length_kv = shape
    with pytest.raises(IndexError) as caught:
        if path == "materialize":
            bias.materialize(DEVICE, shape=shape, dtype=FP32)
        else:
            q = torch.randn(batch, heads, length_q, 16, device=DEVICE)
            k = torch.randn(batch, heads, length_kv, 16, device=DEVICE)
            with use_backends(path):
                sdpa(q, k, k, attn_mask=bias)
    message = str(caught.value)
    assert function.__name__ in message and size in message and reach in message, message


def test_a_sum_checks_the_reads_of_every_part() -> None:
    bias = PrefixLM(8) + ModBias(mask_mod=_documents_40)
    q = torch.randn(1, 2, 64, 16, device=DEVICE)
    with use_backends("triton"), pytest.raises(IndexError, match="_documents_40"):
        sdpa(q, q, q, attn_mask=bias)


def test_a_block_of_a_call_checks_its_own_positions() -> None:
    """A context-parallel shard pair's bias reads ``q_idx + q_start``: the block of the first
    32 queries of a call of 64 reads ids 0-31 of 40 (in range), the block after it 32-63."""
    from attnbias.terms import Block, Call

    bias = ModBias(mask_mod=_documents_40)
    device = DOCS_40.device
    first = bias.sub_block(Call(1, 2, 64, 64, device), Block(0, 0, 32, 32))
    first.validate_call(Call(1, 2, 32, 32, device))
    second = bias.sub_block(Call(1, 2, 64, 64, device), Block(32, 0, 32, 32))
    with pytest.raises(IndexError, match=re.escape("[32, 63]")):
        second.validate_call(Call(1, 2, 32, 32, device))


@dataclass(frozen=True, eq=False)
class RelativeTable(_Base):
    """A learnable ``(H, N)`` table read at ``kv_idx - q_idx``: a query after its key reads
    from the end, as eager PyTorch indexes (``table[h, -3]`` is the third entry from the
    end); ``modulo`` (when set) reads ``(kv_idx - q_idx) % modulo - modulo // 2`` instead, a
    small table the kernels gather per tile."""

    table: Tensor
    modulo: int = 0

    def score_mod(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        distance = kv_idx - q_idx
        if self.modulo:
            distance = distance % self.modulo - self.modulo // 2
        return score + self.table[h, distance]


@pytest.mark.parametrize(("entries", "modulo"), [(96, 0), (5, 5)], ids=["from_memory", "gathered"])
def test_a_negative_index_reads_from_the_end_on_the_kernel(entries: int, modulo: int) -> None:
    """Forward and every gradient, the table's included, against the oracle (the function
    evaluated by eager PyTorch): a clamped read would take entry 0 for every negative index."""
    table = torch.randn(2, entries, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    case = Case(
        lambda t: RelativeTable(t, modulo) + causal_upper_left(), (1, 2, 1, 40, 48), FP32, (table,)
    )
    with use_backends("triton"):
        check(case, FP32, fused=True, param_grads=True)


def _wide_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx * 1000003 * 1000003 + kv_idx) % 10 < 6


def test_integer_arithmetic_past_32_bits_matches_the_oracle_on_the_kernel() -> None:
    """``q_idx * 1000003 * 1000003`` leaves 32 bits: the kernel computes it in 64, as eager
    PyTorch does with int64 indices (in 32 bits it wraps, and the mask differs)."""
    case = Case(lambda: ModBias(mask_mod=_wide_mask), (1, 2, 1, 40, 40), FP32)
    with use_backends("triton"):
        check(case, FP32, fused=True, param_grads=False)


def test_index_arithmetic_that_fits_stays_in_32_bits() -> None:
    wide = ModBias(mask_mod=_wide_mask)._traced()
    products = [i for i, n in enumerate(wide.nodes) if n.op in ("mul", "add")]
    assert wide.wide_nodes() == frozenset(products)
    relative = RelativeTable(torch.zeros(2, 8))._traced()
    assert relative.wide_nodes() == frozenset()
    assert T5Bias(random_table(2, 0))._traced().wide_nodes() == frozenset()


@pytest.mark.parametrize("route", ["triton", "reference"])
def test_an_index_read_from_a_tensor_is_checked_against_its_values(route: str) -> None:
    """``table[ids[q_idx]]``: the ids' least and greatest values bound the index (one host
    synchronisation per version of ``ids``); an id written in place out of range raises at
    the next call."""
    ids = (torch.arange(40) % 5).to(DEVICE)
    table = torch.randn(2, 8, generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def by_id(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[h, ids[q_idx]]

    bias = ModBias(score_mod=by_id) + causal_upper_left()
    case = Case(lambda: bias, (1, 2, 1, 40, 40), FP32)
    q, k, v, _ = tensors(case.shape, FP32)
    with use_backends(route):
        check(case, FP32, fused=route == "triton", param_grads=False)
        sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
        ids[3] = 99  # the same call again, after the write
        with pytest.raises(IndexError, match=re.escape("reaching [0, 99]")):
            sdpa(q, k, v, attn_mask=bias, enable_gqa=True)


def test_a_read_that_cannot_be_proven_is_refused_naming_the_fix() -> None:
    """An index of the score, or of float values over more than ``EXACT_LIMIT`` positions,
    has no bound the host can find: a ValueError that says to bound it."""
    table = torch.randn(8)

    def of_score(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[(score * 2).long()]

    with pytest.raises(ValueError, match=r"depends on the score.*\.clamp\(0, 7\)"):
        mod_reads.check_reads(ModBias(score_mod=of_score)._traced(), 1, 1, 16, 16)
    weights = torch.rand(5000)

    def of_floats(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[(weights[q_idx] + weights[kv_idx]).long()]

    traced = ModBias(score_mod=of_floats)._traced()
    mod_reads.check_reads(traced, 1, 1, 64, 64)  # evaluated: sums of two values in [0, 1)
    with pytest.raises(ValueError, match="25000000 positions"):
        mod_reads.check_reads(traced, 1, 1, 5000, 5000)


def test_under_torch_compile_a_read_is_proven_by_bounds_alone() -> None:
    """A traced call reads no tensor values to prove its reads: ``table[ids[q_idx]]`` is
    refused naming the fix, the same read bounded by ``.clamp`` runs."""
    torch._dynamo.reset()
    ids = (torch.arange(40) % 5).to(DEVICE)
    table = torch.randn(8).to(DEVICE)

    def unbounded(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[ids[q_idx]]

    def bounded(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[ids[q_idx].clamp(0, 7)]

    q = torch.randn(1, 2, 40, 16, device=DEVICE)
    for function in (unbounded, bounded):
        bias = ModBias(score_mod=function)

        def attend(q: Tensor, bias: AttnBias = bias) -> Tensor:
            with use_backends("reference"):
                return sdpa(q, q, q, attn_mask=bias)

        compiled = torch.compile(attend, fullgraph=True, backend="eager")
        if function is unbounded:
            with pytest.raises(Exception, match="cannot be read while torch.compile traces"):
                compiled(q)
        else:
            torch.testing.assert_close(compiled(q), attend(q), rtol=0, atol=0)


@pytest.mark.parametrize("route", ["triton", "reference"])
def test_a_read_past_the_host_limit_is_checked_on_the_device_and_raised_at_the_next_call(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read the host cannot bound within :data:`EXACT_LIMIT` positions is checked on the
    device without a synchronisation: in range, the calls run (the check read once, then
    kept); out of range, the next call (or ``attnbias.check_errors()``) raises the
    ``IndexError`` naming the earlier call, and the same call after it raises at once. Here
    on the CPU with a limit of 100 positions."""
    monkeypatch.setattr(mod_reads, "EXACT_LIMIT", 100)
    monkeypatch.setattr(mod_reads, "_defers", lambda device: True)
    table = torch.randn(8, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights = torch.rand(40, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def of_floats(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[(weights[q_idx] + weights[kv_idx]).long()]

    case = Case(lambda: ModBias(score_mod=of_floats), (1, 2, 1, 40, 40), FP32)
    with use_backends(route):
        check(case, FP32, fused=route == "triton", param_grads=False)
        attnbias.check_errors()  # in range: nothing raised, and nothing left pending
        assert not mod_reads.pending_checks()
        weights.mul_(6.0)  # sums now reach 11: outside the table of 8
        q, k, v, _ = tensors(case.shape, FP32)
        bias = case.make()
        if route == "triton":
            sdpa(q, k, v, attn_mask=bias, enable_gqa=True)  # runs; its check is left on the device
            assert mod_reads.pending_checks()
            with pytest.raises(IndexError, match=r"an earlier call .* reaching \[0, 1[01]\]"):
                sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
            # the same call again: known out of range, raised at once
            with pytest.raises(IndexError, match=r"reaching \[0, 1[01]\]"):
                sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
            assert not mod_reads.pending_checks()
            other = torch.randn(1, 2, 24, 8)  # another shape: checked on the device again
            sdpa(other, other[:, :1], other[:, :1], attn_mask=bias, enable_gqa=True)
            with pytest.raises(IndexError, match="an earlier call"):
                attnbias.check_errors()
        else:  # the exact path reads the values it indexes with: raises at once
            with pytest.raises(IndexError, match=r"reaching \[0, 1[01]\]"):
                sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    attnbias.check_errors()  # nothing left


@pytest.mark.gpu
def test_a_read_past_the_host_limit_on_the_gpu() -> None:
    """The same at the real limit: 8192 x 8192 positions are more than ``EXACT_LIMIT``; the
    check runs on the GPU beside the kernel (no synchronisation), is read at the next call,
    and an index written out of range raises there."""
    generator = torch.Generator().manual_seed(4)
    table = torch.randn(8, generator=generator).cuda()
    weights = torch.rand(8192, generator=generator).cuda()

    def of_floats(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[(weights[q_idx] + weights[kv_idx]).long()]

    bias = ModBias(score_mod=of_floats)
    q = torch.randn(1, 1, 8192, 64, device="cuda", dtype=torch.bfloat16)
    with use_backends("triton"):
        sdpa(q, q, q, attn_mask=bias)
        assert mod_reads.pending_checks()
        sdpa(q, q, q, attn_mask=bias)  # reads the first call's check: in range
        weights.mul_(6.0)
        sdpa(q, q, q, attn_mask=bias)
        with pytest.raises(IndexError, match=r"an earlier call .* reaching \[0, 1[01]\]"):
            sdpa(q, q, q, attn_mask=bias)

"""ModBias functions on FlashAttention 4, on CPU: the generated CuTe source run against a torch
stand-in of the DSL (``cute_standin``), inside a stand-in of ``flash_attn_func`` that applies
the callbacks and the block sparsity as FlashAttention 4 documents them; results against the
oracle (fp64 stock PyTorch on the bias's own functions). The real kernels are checked in
``test_gpu.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import cute_standin
import pytest
import torch
from cute_standin import SSA
from planning import fake_gpu, qkv, spec_of
from torch import Tensor

import attnbias
import attnbias.backends.fa4 as fa4
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    causal_upper_left,
    use_backends,
)
from attnbias.backends import BACKENDS, fa4_mods
from attnbias.kernels.blocks import tile_states
from attnbias.kernels.masks import mod_block_lists
from attnbias.planner import plan
from attnbias.testing.oracle import assert_call_close, attention, grid_mask, grid_score

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from chunked_local import ChunkedLocal
from custom_bias import PrefixLM
from neighbourhood_2d import Neighbourhood2D
from t5_bias import T5Bias

# the generated callbacks of every mask here, the chunked one included (which runs as the
# built-in documents by default)
pytestmark = pytest.mark.usefixtures("generated_mods")

BF16 = torch.bfloat16
BLOCK = (32, 16)  # the stand-in's block sparsity: small, so that short calls have many blocks


class BlockSparse(NamedTuple):
    """Stands in for FlashAttention 4's ``BlockSparseTensorsTorch``."""

    mask_block_cnt: Tensor
    mask_block_idx: Tensor
    full_block_cnt: Tensor | None = None
    full_block_idx: Tensor | None = None
    block_size: tuple[int, int] | None = None


def dense_states(sparse: BlockSparse, columns: int) -> Tensor:
    """``(Bl, Hl, rows, columns)`` int8 states (0 none, 1 partial, 2 full) of FlashAttention 4's
    lists, each list's columns checked to be increasing and partial and full disjoint."""
    states = []
    for count, index, state in (
        (sparse.mask_block_cnt, sparse.mask_block_idx, 1),
        (sparse.full_block_cnt, sparse.full_block_idx, 2),
    ):
        assert count is not None and index is not None
        assert count.dtype == index.dtype == torch.int32
        assert count.is_contiguous() and index.is_contiguous()
        dense = torch.zeros((*count.shape, columns), dtype=torch.int8)
        for position in torch.cartesian_prod(*(torch.arange(n) for n in count.shape)):
            at = tuple(position.tolist())
            listed = index[at][: int(count[at])].tolist()
            assert listed == sorted(set(listed)), listed
            dense[at][listed] = state
        states.append(dense)
    assert not ((states[0] > 0) & (states[1] > 0)).any()
    return states[0] + states[1]


class _ScoreMod(torch.autograd.Function):
    """The generated ``score_mod`` forward and its ``score_mod_bwd`` backward, on float32."""

    @staticmethod
    def forward(ctx: Any, scores: Tensor, call: Callable[..., Any], backward: Any) -> Tensor:  # type: ignore[override]
        ctx.call, ctx.backward = call, backward
        ctx.save_for_backward(scores)
        return call(None, scores).double()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        assert ctx.backward is not None, "a backward through a score_mod without score_mod_bwd"
        (scores,) = ctx.saved_tensors
        return ctx.call(grad, scores).double(), None, None


def mods_standin(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    window_size: tuple[int | None, int | None] = (None, None),
    mask_mod: Any = None,
    score_mod: Any = None,
    score_mod_bwd: Any = None,
    aux_tensors: list[Tensor] | None = None,
    aux_scalars: tuple[Any, ...] | None = None,
    block_sparse_tensors: BlockSparse | None = None,
    block_sparse_tensors_bwd: BlockSparse | None = None,
    pack_gqa: bool | None = None,
) -> tuple[Tensor, None]:
    """``flash_attn_func`` on ``(B, L, H, E)`` with callbacks, in float64 torch: scores
    ``scale * q.k``, then ``score_mod`` (its backward through ``score_mod_bwd``), then masking:
    the window where there is no ``mask_mod`` (with one FlashAttention 4 applies no window, so
    the library must pass none); with block sparsity, unlisted blocks are dropped, full ones
    kept without ``mask_mod`` and partial ones kept where it says so."""
    assert pack_gqa is False, "callbacks see one query head per tile"
    batch, length_q, heads_q, _ = q.shape
    length_kv, heads_kv = k.shape[1], k.shape[2]
    query, key, value = (x.double().transpose(1, 2) for x in (q, k, v))
    key, value = (x.repeat_interleave(heads_q // heads_kv, dim=1) for x in (key, value))
    scores = (query @ key.transpose(-1, -2)) * softmax_scale
    grids = [
        SSA(torch.arange(n, dtype=torch.int32).reshape([n if d == i else 1 for d in range(4)]))
        for i, n in enumerate((batch, heads_q, length_q, length_kv))
    ]
    aux = cute_standin.aux(aux_tensors)
    if score_mod is not None:

        def call(grad: Tensor | None, s: Tensor) -> Tensor:
            if grad is None:
                return score_mod(SSA(s.float()), *grids, None, aux, aux_scalars).t
            return score_mod_bwd(
                SSA(grad.float()), SSA(s.float()), *grids, None, aux, aux_scalars
            ).t

        scores = _ScoreMod.apply(scores, call, score_mod_bwd)
    keep = torch.ones(batch, heads_q, length_q, length_kv, dtype=torch.bool)
    if mask_mod is not None:
        assert window_size == (None, None), "FlashAttention 4 takes no window with a mask_mod"
        kept = mask_mod(*grids, None, aux, aux_scalars).t.broadcast_to(keep.shape)
        if block_sparse_tensors is None:
            keep = kept
        else:
            assert block_sparse_tensors_bwd is not None
            block_m, block_n = block_sparse_tensors.block_size  # type: ignore[misc]
            columns = -(-length_kv // block_n)
            states = dense_states(block_sparse_tensors, columns)
            transposed = dense_states(block_sparse_tensors_bwd, -(-length_q // block_m))
            torch.testing.assert_close(transposed, states.transpose(-1, -2))
            per_pair = states.repeat_interleave(block_m, 2).repeat_interleave(block_n, 3)
            per_pair = per_pair[..., :length_q, :length_kv].expand(keep.shape)
            keep = (per_pair == 2) | ((per_pair == 1) & kept)
    else:
        assert block_sparse_tensors is None
        left, right = window_size
        rows = torch.arange(length_q)[:, None] + (length_kv - length_q)
        cols = torch.arange(length_kv)[None, :]
        if left is not None:
            keep = keep & (cols >= rows - left)
        if right is not None:
            keep = keep & (cols <= rows + right)
    scores = scores.masked_fill(~keep, -math.inf)
    any_kept = keep.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~any_kept, 0.0), dim=-1) * any_kept
    return (weights @ value).transpose(1, 2).to(q.dtype), None


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> tuple[Tensor, None]:
        self.calls.append(kwargs)
        return mods_standin(q, k, v, **kwargs)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    fake_gpu(monkeypatch)
    recorder = Recorder()
    monkeypatch.setattr(fa4, "_flash_attn_func", lambda: recorder)
    monkeypatch.setattr(fa4, "_block_sparse_tensors", lambda: BlockSparse)
    monkeypatch.setattr(fa4, "CHECKED_HEAD_DIMS", tuple(range(8, 257, 8)))
    monkeypatch.setattr(fa4_mods, "_cute_names", lambda: cute_standin.NAMES)
    monkeypatch.setattr(fa4_mods, "block_size", lambda head_dim: BLOCK)
    return recorder


def document_ids(batch: int, length: int) -> Tensor:
    """``(B, L)`` int64 non-decreasing ids, a different packing per row."""
    cuts = [[length // 3, length // 2], [length // 8, length - 9]][:batch]
    return torch.stack(
        [torch.bucketize(torch.arange(length), torch.tensor(c), right=True) for c in cuts]
    )


def flex_port(batch: int, length: int, cap: float) -> ModBias:
    """FlexAttention's document-causal mask and tanh soft-cap, as ``examples/flex_port.py``
    writes them: closures over an int64 ``(B, L)`` id tensor."""
    docs = document_ids(batch, length)

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    def soft_cap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    return ModBias(mask_mod=document_causal, score_mod=soft_cap)


# name: (bias, (B, Hq, Hkv, L, S))
EXAMPLES: dict[str, tuple[Callable[[], AttnBias], tuple[int, int, int, int, int]]] = {
    "prefix_lm": (lambda: PrefixLM(37), (2, 4, 2, 100, 100)),
    "prefix_lm_softcap": (lambda: PrefixLM(37) + SoftcapBias(3.0), (1, 2, 2, 90, 90)),
    "prefix_lm_window": (lambda: PrefixLM(20) + SlidingWindowBias(30), (1, 2, 1, 70, 100)),
    "chunked_local": (lambda: ChunkedLocal(24), (1, 4, 2, 96, 96)),
    "neighbourhood_2d": (lambda: Neighbourhood2D(8, 12, 3, 5), (1, 2, 2, 96, 96)),
    "t5_causal": (
        lambda: (
            T5Bias(2 * torch.randn(2, 32, generator=torch.Generator().manual_seed(1)))
            + causal_lower_right()
        ),
        (2, 2, 2, 80, 100),
    ),
    "t5_prefix_lm": (
        lambda: (
            PrefixLM(30) + T5Bias(torch.randn(2, 32, generator=torch.Generator().manual_seed(2)))
        ),
        (1, 2, 2, 64, 64),
    ),
    "flex_port": (lambda: flex_port(2, 80, 2.0), (2, 4, 2, 80, 80)),
}


def check(bias: AttnBias, shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> list[Any]:
    batch, heads_q, heads_kv, length_q, length_kv = shape
    generator = torch.Generator().manual_seed(seed)
    q, grad_out = (torch.randn(batch, heads_q, length_q, 16, generator=generator) for _ in "qg")
    k, v = (torch.randn(batch, heads_kv, length_kv, 16, generator=generator) for _ in "kv")
    q, k, v, grad_out = (x.to(dtype) for x in (q, k, v, grad_out))
    gqa = heads_q != heads_kv
    with use_backends("fa4"):
        leaf = q.detach().requires_grad_()
        route = attnbias.explain(leaf, k, v, attn_mask=bias, enable_gqa=gqa)
        assert_call_close(
            lambda *t: attnbias.sdpa(*t, attn_mask=bias, enable_gqa=gqa),
            bias, (q, k, v), grad_out, enable_gqa=gqa,
        )  # fmt: skip
    assert route.startswith("fa4:"), route
    return [route]


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_examples_against_the_oracle(standin: Recorder, name: str) -> None:
    make, shape = EXAMPLES[name]
    bias = make()
    for seed in (0, 1):  # the second call runs on the decision the first one cached
        check(bias, shape, BF16, seed)
    call = standin.calls[-1]
    has_mask = name != "t5_causal"
    assert (call.get("mask_mod") is not None) == has_mask
    assert (call.get("block_sparse_tensors") is not None) == has_mask
    if name == "t5_causal":  # a score function alone: the band is FlashAttention 4's window
        assert call["window_size"] == (None, 0)
        (table,) = call["aux_tensors"]
        assert table.shape == (64,) and table.dtype == torch.float32


def test_explain_names_the_fa4_form(standin: Recorder) -> None:
    q, k, v = (x.requires_grad_() for x in qkv(length_q=100, length_kv=100))
    bias = PrefixLM(37) + SoftcapBias(3.0)
    text = attnbias.explain(q, k, v, attn_mask=bias)
    assert text.startswith("fa4: "), text
    first = text.splitlines()[0]
    assert "mask_mod / score_mod / score_mod_bwd generated from mask_mod PrefixLM.mask_mod" in first
    assert "soft-cap 3 inside score_mod" in first
    assert "block sparsity of 32x16" in first and "skipped" in first, first
    assert standin.calls == []  # explain runs no attention


def test_new_numbers_share_the_source_and_change_the_scalars(
    standin: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With runtime ``aux_scalars`` (off by default: flash-attn-4 4.0.0b36 compiles no kernel
    with them on the H100), a new number reuses the compiled callback."""
    monkeypatch.setattr(fa4_mods, "NUMBERS_AS_AUX_SCALARS", True)
    q, k, v = qkv(length_q=48, length_kv=48, needs_grad=True)
    for prefix in (5, 20):
        attnbias.sdpa(q, k, v, attn_mask=PrefixLM(prefix))
    first, second = standin.calls
    assert first["mask_mod"] is second["mask_mod"]  # one compiled callback
    assert first["aux_scalars"] == (5,) and second["aux_scalars"] == (20,)


def test_numbers_as_literals(standin: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa4_mods, "NUMBERS_AS_AUX_SCALARS", False)
    q, k, v = qkv(length_q=48, length_kv=48, needs_grad=True)
    calls = []
    for prefix in (5, 20):
        attnbias.sdpa(q, k, v, attn_mask=PrefixLM(prefix))
        calls.append(standin.calls[-1])
    assert "aux_scalars" not in calls[0]
    assert calls[0]["mask_mod"] is not calls[1]["mask_mod"]
    expected = [attention(q, k, v, PrefixLM(p), dtype=torch.float64) for p in (5, 20)]
    for prefix, want in zip((5, 20), expected, strict=True):
        got = attnbias.sdpa(q, k, v, attn_mask=PrefixLM(prefix))
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0.0)


def test_past_the_count_of_number_sets_new_numbers_go_to_the_triton_kernel(
    standin: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Numbers written as literals compile anew per set of numbers: after MAX_NUMBER_SETS sets
    for the same functions, a call with yet other numbers runs on the Triton kernel (saying
    why), while the numbers compiled already keep FlashAttention 4."""
    monkeypatch.setattr(fa4_mods, "NUMBERS_AS_AUX_SCALARS", False)
    monkeypatch.setattr(fa4_mods, "MAX_NUMBER_SETS", 2)
    monkeypatch.setattr(fa4_mods, "_NUMBER_SETS", {})
    q, k, v = qkv(length_q=48, length_kv=48, needs_grad=True)
    for prefix in (5, 20):
        attnbias.sdpa(q, k, v, attn_mask=PrefixLM(prefix))
    assert len(standin.calls) == 2
    text = attnbias.explain(q, k, v, attn_mask=PrefixLM(30))
    assert text.startswith("triton:"), text
    assert "compiled for 2 sets of numbers already and these (30)" in text, text
    got = attnbias.sdpa(q, k, v, attn_mask=PrefixLM(30))
    assert len(standin.calls) == 2  # not FlashAttention 4
    want = attention(q, k, v, PrefixLM(30), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0.0)
    # a number compiled already, in a new bias: FlashAttention 4 again
    assert attnbias.explain(q, k, v, attn_mask=PrefixLM(20)).startswith("fa4:")
    # other functions have their own count
    assert attnbias.explain(q, k, v, attn_mask=ChunkedLocal(7)).startswith("fa4:")


# -- the callbacks themselves on the index grids ------------------------------------------------


RELATIVE = torch.randn(2, 48, generator=torch.Generator().manual_seed(0))


def _grids(shape: tuple[int, int, int, int]) -> list[SSA]:
    return [
        SSA(torch.arange(n, dtype=torch.int32).reshape([n if d == i else 1 for d in range(4)]))
        for i, n in enumerate(shape)
    ]


@pytest.mark.parametrize(
    "bias",
    [
        PrefixLM(9),
        ChunkedLocal(5),
        Neighbourhood2D(4, 6, 3, 3),
        flex_port(2, 24, 1.5),
        ModBias(score_mod=lambda s, b, h, q, kv: torch.sigmoid(s) * 3.0 - (q - kv).float() / 7),
        ModBias(score_mod=lambda s, b, h, q, kv: torch.where(kv > q, torch.exp(s / 2), s * s)),
        ModBias(mask_mod=lambda b, h, q, kv: (q % 3 != -kv % 4) ^ (h == 1) | ~(kv // 5 == b)),
        # kv - q < 0 reads from the end of the row, as eager PyTorch indexes
        ModBias(score_mod=lambda s, b, h, q, kv: s + RELATIVE[h, kv - q]),
    ],
    ids=[
        "prefix_lm",
        "chunked",
        "neighbourhood",
        "flex_port",
        "sigmoid",
        "where_exp",
        "logic",
        "negative_index",
    ],
)
def test_callbacks_on_the_grid_match_the_functions(standin: Recorder, bias: ModBias) -> None:
    """The generated callbacks against the bias's own functions on torch grids (fp64 autograd
    for the score's derivative), negative divisors and remainders included."""
    traced = bias._traced()
    shape = (2, 2, 24, 24)
    options = fa4_mods.Options(band_lo=True, scalars=True)
    scalars = fa4_mods.aux_scalars(traced, options, (-7, None), None)
    calls = fa4_mods.callbacks(
        traced, options, scalars, names=lambda: cute_standin.NAMES, flavour="standin"
    )
    grids = _grids(shape)
    aux = cute_standin.aux(fa4_mods.aux_tensors(traced))
    kv_minus_q = torch.arange(24)[None, :] - torch.arange(24)[:, None]
    keep = calls.mask_mod(*grids, None, aux, scalars).t.broadcast_to(shape)
    assert torch.equal(keep, grid_mask(bias, *shape) & (kv_minus_q >= -7))
    if traced.scores:
        scores = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        expected = grid_score(bias, scores)
        got = calls.score_mod(SSA(scores.detach().float()), *grids, None, aux, scalars).t
        torch.testing.assert_close(got.double(), expected.detach(), atol=1e-5, rtol=1e-5)
        grad = torch.randn(shape, dtype=torch.float64)
        (want,) = torch.autograd.grad(expected, scores, grad)
        back = calls.score_mod_bwd(
            SSA(grad.float()), SSA(scores.detach().float()), *grids, None, aux, scalars
        ).t
        torch.testing.assert_close(back.double(), want, atol=1e-4, rtol=1e-4)


# -- block sparsity -------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [(32, 16), (128, 128), (128, 64)])
@pytest.mark.parametrize(
    ("bias", "heads"),
    [
        (PrefixLM(50) + SlidingWindowBias(70, 10), 1),
        (ChunkedLocal(40), 1),
        (ModBias(mask_mod=lambda b, h, q, kv: (kv <= q + 3 * h) & (kv + b * 40 >= q)), 2),
    ],
    ids=["prefix_window", "chunked", "per_row_and_head"],
)
def test_block_sparsity_matches_the_dense_block_states(
    bias: AttnBias, heads: int, block: tuple[int, int]
) -> None:
    """FlashAttention 4's lists, forward and backward, hold exactly the blocks of the dense
    keep-mask (oracle: the bias's functions on the grid), partial and full."""
    batch, length_q, length_kv = 2, 300, 270
    q = torch.zeros(batch, heads, length_q, 16)
    k = torch.zeros(batch, 1, length_kv, 16)
    spec = spec_of(bias, length_q=length_q, length_kv=length_kv, heads_q=heads, heads_kv=1,
                   batch=batch)  # fmt: skip
    lists = mod_block_lists(q, k, spec.program, *block)
    forward, backward = fa4_mods.block_sparse_fields(lists.kv_lists, lists.q_lists)
    keep = torch.isfinite(bias.materialize(shape=(batch, heads, length_q, length_kv)))
    keep = keep.broadcast_to(batch, heads, length_q, length_kv)
    expected = tile_states(keep, *block)
    got = dense_states(BlockSparse(**forward), expected.shape[-1])
    assert torch.equal(got.expand_as(expected), expected)
    got_bwd = dense_states(BlockSparse(**backward), expected.shape[-2])
    assert torch.equal(got_bwd.expand_as(expected.transpose(-1, -2)), expected.transpose(-1, -2))


def test_block_size_follows_the_sm90_tiles() -> None:
    assert fa4_mods.block_size(64) == fa4_mods.block_size(128) == (128, 128)
    assert fa4_mods.block_size(256) == (128, 64)


# -- what stays on the Triton kernel, and why --------------------------------------------------


def _reasons(bias: AttnBias, needs_grad: bool = True, **shape: Any) -> list[str]:
    return BACKENDS["fa4"].not_supported_reasons(spec_of(bias, needs_grad=needs_grad, **shape))


def test_refusals_name_the_reason(standin: Recorder) -> None:
    table = torch.randn(2, 32, requires_grad=True)
    assert any(
        "requires grad: FlashAttention 4 computes no gradient" in r for r in _reasons(T5Bias(table))
    )
    with torch.no_grad():  # no gradient wanted: the table's flag does not matter
        assert _reasons(T5Bias(table), needs_grad=False) == []
    floor_of_float = ModBias(score_mod=lambda s, b, h, q, kv: s + (kv.float() // 3.0))
    assert "// of float values" in _reasons(floor_of_float, needs_grad=False)
    wide = ModBias(mask_mod=lambda b, h, q, kv: q.long() * 2**40 > kv)
    assert any("64-bit integers" in r for r in _reasons(wide, needs_grad=False))
    clamped = ModBias(score_mod=lambda s, b, h, q, kv: torch.minimum(s, torch.tensor(2.0)))
    assert _reasons(clamped, needs_grad=False) == []
    assert any("the derivative of minimum of the score" in r for r in _reasons(clamped))
    t5 = T5Bias(torch.randn(2, 32))
    assert any("grouped-query attention" in r for r in _reasons(t5, heads_q=2, heads_kv=1))
    assert _reasons(t5, needs_grad=False, heads_q=2, heads_kv=1) == []
    assert _reasons(PrefixLM(4), heads_q=2, heads_kv=1) == []
    assert "ALiBi together with ModBias functions" in _reasons(PrefixLM(4) + AlibiBias(num_heads=2))
    documents = PrefixLM(4) + DocumentBias.from_seqlens([6, 10])
    assert any("documents together with ModBias" in r for r in _reasons(documents))


def _hashed_columns(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return (q_idx * 1000003 * 1000003 + kv_idx) % 10 < 6


def test_integers_past_32_bits_stay_on_the_triton_kernel(standin: Recorder) -> None:
    """The callbacks compute integers in 32 bits, where ``q_idx * 1000003 * 1000003`` wraps;
    the Triton kernel computes it in 64."""
    reasons = _reasons(ModBias(mask_mod=_hashed_columns), needs_grad=False)
    assert any("_hashed_columns computes 64-bit integers" in r for r in reasons), reasons
    assert _reasons(ModBias(mask_mod=lambda b, h, q, kv: (kv - q) % 10 < 6), needs_grad=False) == []


def test_a_score_function_without_a_written_derivative_runs_without_gradients(
    standin: Recorder,
) -> None:
    """Its callbacks have no ``score_mod_bwd`` (it is not written for ``minimum``), and a call
    without gradients runs on them."""
    clamped = ModBias(score_mod=lambda s, b, h, q, kv: torch.minimum(s, torch.tensor(0.5)))
    q, k, v = qkv(length_q=40, length_kv=40)
    with torch.no_grad(), use_backends("fa4"):
        got = attnbias.sdpa(q, k, v, attn_mask=clamped)
    assert standin.calls[-1]["score_mod_bwd"] is None
    want = attention(q, k, v, clamped, dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0.0)


def test_a_refused_call_runs_on_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch)
    table = torch.randn(2, 32, requires_grad=True)
    chosen = plan(spec_of(T5Bias(table) + causal_upper_left(), needs_grad=True))
    assert chosen.backend.name == "triton"
    assert "requires grad" in chosen.explain()
    assert plan(spec_of(PrefixLM(4), needs_grad=True)).backend.name == "fa4"


def test_only_on_capability_9(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, capability=(10, 0))
    reasons = _reasons(PrefixLM(4))
    assert any("compute capability 9.x only" in r for r in reasons), reasons
    assert plan(spec_of(PrefixLM(4), needs_grad=True)).backend.name == "triton"


def test_an_int64_tensor_outside_int32_is_refused_when_handed_over() -> None:
    ids = torch.tensor([0, 1, 2**33])
    bias = ModBias(mask_mod=lambda b, h, q, kv: ids[q % 3] == ids[kv % 3])
    with pytest.raises(ValueError, match="values outside int32"):
        fa4_mods.aux_tensors(bias._traced())
    ids[2] = 2
    assert fa4_mods.aux_tensors(bias._traced())[0].tolist() == [0, 1, 2]  # type: ignore[index]


def _standard_strides(t: torch.Tensor) -> tuple[int, ...]:
    return torch.empty(t.shape).stride()


def test_handed_over_tensors_have_standard_strides_on_dims_of_size_one() -> None:
    """FlashAttention 4 checks the innermost stride even where the dim has size 1, which
    ``Tensor.contiguous`` leaves as it was: one query block (L <= 128) gave counts of shape
    ``(1, 1, 1)`` with an innermost stride of 4. Every field and every aux tensor has the
    standard strides, and a one-element parameter sliced out of a larger tensor is still a
    view (in-place changes seen)."""
    bias = PrefixLM(4)
    q = torch.zeros(1, 2, 96, 16)
    spec = spec_of(bias, length_q=96, length_kv=96, heads_q=2, heads_kv=2, batch=1)
    lists = mod_block_lists(q, q, spec.program, 128, 128)
    for fields in fa4_mods.block_sparse_fields(lists.kv_lists, lists.q_lists):
        for name, t in fields.items():
            assert t.stride() == _standard_strides(t), (name, t.shape, t.stride())
    table = torch.arange(12.0).reshape(3, 4)
    one = table[1:2, 2:3]
    column = table[:, 3:4].reshape(-1)[:1]
    assert column.stride() == (4,)
    made = ModBias(score_mod=lambda s, b, h, q, kv: s + column[0] + one[0, 0])
    aux = fa4_mods.aux_tensors(made._traced())
    assert aux is not None
    for t in aux:
        assert t.stride() == _standard_strides(t), (t.shape, t.stride())
    table[0, 3] = 100.0  # column's element, written in place: seen through the aux view
    assert 100.0 in [float(t[0]) for t in aux]

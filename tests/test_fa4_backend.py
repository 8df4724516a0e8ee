"""FlashAttention 4's backend on the CPU: the calls it takes and its reasons for the others, and
its argument translation (windows, soft-cap, ALiBi, documents through the variable-length call,
the shard pairs of context parallelism) checked against the oracle through a pure-torch
stand-in of ``flash_attn.cute``.

Nothing here needs a GPU: the GPU generation, FlashAttention 4's install and device checks and
``flash_attn.cute.flash_attn_func`` itself are replaced with monkeypatch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning import fake_gpu, qkv, spec_of
from torch import Tensor

import attnbias
import attnbias.backends.fa4 as fa4
from attnbias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    use_backends,
)
from attnbias.backends import BACKENDS
from attnbias.backends.documents import documents_layout
from attnbias.spec import Spec, make_spec
from attnbias.testing.oracle import (
    assert_close_to_oracle,
    assert_shard_pair_close,
    attention,
    run_with_grads,
    whole_call,
)
from attnbias.testing.strategies import Problem

# the priority lists alone (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("lists_alone")


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

"""Tests of the Triton kernels in ``kernels`` directly, against an fp64 eager oracle.

Error budget: inputs are drawn in the target dtype and copied to fp64 for the oracle; the
kernel's largest error against the oracle must stay within twice the error that the same
eager composition makes in the target dtype (plus one unit of that dtype's epsilon, relative
to the largest reference value), for the output, the log-sum-exp and every gradient. The
floor also covers what the kernel's own rounding is relative to (``rounding_sizes``): the
size of the terms of each product whose operands it rounds to the inputs' dtype (they can
exceed the result where they cancel), probabilities recomputed as exp(s - lse), which carry
fp32's eps * (|s| + |lse|) that eager softmax avoids, and the terms that cancel in dP - delta
(with one key per row the exact dK is 0, and eager PyTorch happens to cancel exactly), and
the log-sum-exp's round trip through base 2 (fp32's eps times twice its size).

Without CUDA the kernels run under Triton's interpreter (``conftest.py`` sets it), with
16x16 tiles, so the shapes here are small but span several partial and full blocks.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from torch import Tensor

from attnbias.kernels import attention_backward, attention_forward, block_sparse_attention
from attnbias.kernels.program import MaskProgram
from attnbias.testing.oracle import flash_rounding_sizes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


# --------------------------------------------------------------------------------------
# Oracle
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mask:
    """The arguments of the kernels other than the tensors q, k, v: the scale and the mask
    program."""

    scale: float
    program: MaskProgram = field(default_factory=MaskProgram)

    def kwargs(self) -> dict[str, Any]:
        return {"program": self.program, "scale": self.scale}


def keep_mask(mask: Mask, batch: int, seq_q: int, seq_k: int, device: Any) -> Tensor:
    """``(B, 1, L, S)`` bool: the pairs the mask keeps, straight from the definition."""
    i = torch.arange(seq_q, device=device)[:, None]
    j = torch.arange(seq_k, device=device)[None, :]
    keep = torch.ones(seq_q, seq_k, dtype=torch.bool, device=device)
    if mask.program.band_lo is not None:
        keep &= j - i >= mask.program.band_lo
    if mask.program.band_hi is not None:
        keep &= j - i <= mask.program.band_hi
    keep = keep.expand(batch, 1, seq_q, seq_k)
    if mask.program.q_doc is not None and mask.program.kv_doc is not None:
        same_doc = mask.program.q_doc[:, :, None] == mask.program.kv_doc[:, None, :]
        keep = keep & same_doc[:, None].expand(batch, 1, seq_q, seq_k)
    if mask.program.kv_start is not None and mask.program.kv_end is not None:
        cols = torch.arange(seq_k, device=device)
        inside = (cols >= mask.program.kv_start.to(device)[:, None]) & (
            cols < mask.program.kv_end.to(device)[:, None]
        )
        keep = keep & inside[:, None, None, :].expand(batch, 1, seq_q, seq_k)
    return keep


def scores(q: Tensor, k: Tensor, mask: Mask) -> tuple[Tensor, Tensor]:
    """Eager scores ``(B, Hq, L, S)`` in ``q.dtype`` (masked pairs -inf, rows that keep nothing
    0) and the ``(B, 1, L, 1)`` bool of those empty rows."""
    batch, num_heads, seq_q, _ = q.shape
    seq_k = k.shape[2]
    k = k.repeat_interleave(num_heads // k.shape[1], dim=1)
    keep = keep_mask(mask, batch, seq_q, seq_k, q.device)
    s = (q @ k.transpose(-1, -2)) * mask.scale
    if mask.program.softcap is not None:
        s = mask.program.softcap * torch.tanh(s / mask.program.softcap)
    if mask.program.alibi_slopes is not None:
        i = torch.arange(seq_q, device=q.device)[:, None]
        j = torch.arange(seq_k, device=q.device)[None, :]
        distance = (i + (seq_k - seq_q) - j).abs().double()
        slopes = mask.program.alibi_slopes.double().expand(batch, num_heads)
        # a materialised additive bias is in the query dtype, as stock SDPA requires
        s = s + (-slopes[:, :, None, None] * distance).to(q.dtype)
    empty = ~keep.any(dim=-1, keepdim=True)
    # empty rows get finite dummy scores so that nothing (forward or backward) turns NaN
    return s.masked_fill(~keep, float("-inf")).masked_fill(empty, 0.0), empty


def reference(q: Tensor, k: Tensor, v: Tensor, mask: Mask) -> tuple[Tensor, Tensor]:
    """Eager attention in ``q.dtype``: ``(out, lse)``; rows that keep nothing give 0, -inf."""
    s, empty = scores(q, k, mask)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.softmax(s, dim=-1).masked_fill(empty, 0.0) @ v
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty.squeeze(-1), float("-inf"))
    return out, lse


@torch.no_grad()
def rounding_sizes(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, mask: Mask
) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`oracle.flash_rounding_sizes` for the scores of ``mask`` (fp64 inputs)."""
    group = q.shape[1] // k.shape[1]
    s, empty = scores(q, k.repeat_interleave(group, dim=1), mask)
    return flash_rounding_sizes(q, k, v, out, lse, grad_out, s, empty, mask.scale)


def make_qkv(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    seq_k: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, head_dim, generator=gen)
    k = torch.randn(batch, kv_heads, seq_k, head_dim, generator=gen)
    v = torch.randn(batch, kv_heads, seq_k, head_dim, generator=gen)
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (q, k, v))  # type: ignore[return-value]


def docs_from_seqlens(seqlens: list[int]) -> Tensor:
    return torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens)).to(DEVICE)


def max_error(got: Tensor, ref: Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    return (got.double() - ref.double()).abs().max().item()


def assert_within_budget(
    name: str,
    got: Tensor,
    oracle: Tensor,
    eager: Tensor,
    rounding: tuple[float, float] = (0.0, 0.0),
) -> None:
    """``got`` within 2x the eager error, plus eps of its dtype times the largest of 1, the
    oracle's largest value and ``rounding[0]``, plus fp32's eps times ``rounding[1]`` (see
    rounding_sizes)."""
    assert got.shape == oracle.shape, f"{name}: shape {tuple(got.shape)} != {tuple(oracle.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values in the kernel's result"
    err = max_error(got, oracle)
    eager_err = max_error(eager, oracle)
    magnitude = max(oracle.abs().max().item() if oracle.numel() else 0.0, rounding[0])
    floor = torch.finfo(eager.dtype).eps * max(1.0, magnitude)
    floor += torch.finfo(torch.float32).eps * rounding[1]
    assert err <= 2 * eager_err + floor, (
        f"{name}: kernel error {err:.3g} exceeds 2 x eager {eager.dtype} error {eager_err:.3g}"
        f" + {floor:.3g}"
    )


def check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    *,
    grads: bool = True,
    seed: int = 1,
    grad_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Run forward (and backward) and hold every result to the error budget."""
    out, lse = attention_forward(q, k, v, **mask.kwargs())
    assert out.dtype == q.dtype and out.is_contiguous()
    assert lse.dtype == torch.float32

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    qe, ke, ve = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out64, lse64 = reference(q64, k64, v64, mask)
    out_e, lse_e = reference(qe, ke, ve, mask)

    if grad_out is None:
        gen = torch.Generator().manual_seed(seed)
        grad_out = torch.randn(out.shape, generator=gen).to(device=DEVICE, dtype=q.dtype)
    in_dtype, in_fp32 = rounding_sizes(
        q64, k64, v64, out64.detach(), lse64.detach(), grad_out.double(), mask
    )
    assert_within_budget("out", out, out64, out_e, (in_dtype["out"], in_fp32["out"]))
    assert torch.equal(torch.isinf(lse), torch.isinf(lse64)), "lse: -inf rows differ"
    finite = torch.isfinite(lse64)
    # the kernel keeps the log-sum-exp in base 2 and converts it back: two roundings in fp32
    # relative to |lse| that eager's natural-log logsumexp does not make (where a row keeps one
    # key, eager's lse is its score, rounded once)
    lse_size = lse64[finite].abs().max().item() if finite.any() else 0.0
    assert_within_budget("lse", lse[finite], lse64[finite], lse_e[finite], (0.0, 2.0 * lse_size))
    assert (out[torch.isinf(lse)] == 0).all(), "rows that keep nothing must be 0"
    if not grads:
        return out, lse

    dq, dk, dv, *_ = attention_backward(grad_out, q, k, v, out, lse, **mask.kwargs())
    g64 = torch.autograd.grad(out64, (q64, k64, v64), grad_out.double())
    g_e = torch.autograd.grad(out_e, (qe, ke, ve), grad_out)
    for name, got, ref64, ref_e, like in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), g64, g_e, (q, k, v), strict=True
    ):
        assert got.dtype == like.dtype and got.shape == like.shape
        assert_within_budget(name, got, ref64, ref_e, (in_dtype[name], in_fp32[name]))
    return out, lse


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` start as NaN
    (or a huge int) so unwritten outputs fail."""

    def poisoning(real: Any) -> Any:
        def poisoned(*args: Any, **kwargs: Any) -> Tensor:
            t = real(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype in (torch.int32, torch.int64):
                t.fill_(torch.iinfo(t.dtype).max)
            return t

        return poisoned

    monkeypatch.setattr(torch, "empty", poisoning(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoning(torch.empty_like))
    monkeypatch.setattr(Tensor, "new_empty", poisoning(Tensor.new_empty))


def scale_of(head_dim: int) -> float:
    return head_dim**-0.5


# --------------------------------------------------------------------------------------
# Bands
# --------------------------------------------------------------------------------------

BANDS = {
    "none": lambda L, S: (None, None),
    "causal_upper_left": lambda L, S: (None, 0),
    "causal_lower_right": lambda L, S: (None, S - L),
    "sliding_window": lambda L, S: (S - L - 7, S - L),
    "window_both_sides": lambda L, S: (S - L - 5, S - L + 9),
    "left_only": lambda L, S: (-3, None),
    "anti_causal_lower_right": lambda L, S: (S - L, None),
    "narrow_off_diagonal": lambda L, S: (2, 3),
    "empty_band": lambda L, S: (5, 2),
}


@pytest.mark.parametrize("band", list(BANDS))
@pytest.mark.parametrize(("seq_q", "seq_k"), [(40, 56), (56, 37)])
def test_bands(band: str, seq_q: int, seq_k: int) -> None:
    band_lo, band_hi = BANDS[band](seq_q, seq_k)
    q, k, v = make_qkv(2, 2, 1, seq_q, seq_k, 32, BF16)
    check(q, k, v, Mask(scale_of(32), MaskProgram(band_lo=band_lo, band_hi=band_hi)))


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32])
@pytest.mark.parametrize("band", ["none", "causal_lower_right", "window_both_sides"])
def test_dtypes(dtype: torch.dtype, band: str) -> None:
    band_lo, band_hi = BANDS[band](33, 48)
    q, k, v = make_qkv(1, 2, 2, 33, 48, 32, dtype)
    check(q, k, v, Mask(scale_of(32), MaskProgram(band_lo=band_lo, band_hi=band_hi)))


# --------------------------------------------------------------------------------------
# Documents, ALiBi, soft-cap
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc_batch", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_documents(doc_batch: int, causal: bool) -> None:
    q_lens = [[10, 0, 21, 14], [3, 30, 5, 7]][:doc_batch]
    kv_lens = [[20, 6, 10, 20], [1, 40, 0, 15]][:doc_batch]  # S = 56 != L = 45
    q_doc = torch.stack([docs_from_seqlens(x) for x in q_lens])
    kv_doc = torch.stack([docs_from_seqlens(x) for x in kv_lens])
    q, k, v = make_qkv(2, 2, 1, 45, 56, 32, FP16)
    band_hi = 56 - 45 if causal else None
    mask = Mask(scale_of(32), MaskProgram(band_hi=band_hi, q_doc=q_doc, kv_doc=kv_doc))
    check(q, k, v, mask)


def test_document_ranges_are_reused_and_follow_in_place_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real_searchsorted = torch.searchsorted

    def counting(*args: Any, **kwargs: Any) -> Tensor:
        calls.append(1)
        return real_searchsorted(*args, **kwargs)

    monkeypatch.setattr(torch, "searchsorted", counting)
    q_doc = docs_from_seqlens([10, 20, 18])[None]
    kv_doc = docs_from_seqlens([25, 5, 18])[None]
    q, k, v = make_qkv(1, 2, 2, 48, 48, 16, FP32)
    mask = Mask(0.25, MaskProgram(band_hi=0, q_doc=q_doc, kv_doc=kv_doc))
    check(q, k, v, mask)
    assert len(calls) == 4, "one forward computes the row and the column ranges"
    check(q, k, v, mask)
    assert len(calls) == 4, "the same id tensors reuse their ranges"
    q_doc.copy_(docs_from_seqlens([30, 2, 16])[None])  # same tensor, new documents
    check(q, k, v, mask)  # the oracle reads the new ids
    assert len(calls) == 8


@pytest.mark.parametrize("slope_batch", [1, 2])
# ALiBi's distance has one sign over causal bands and their mirror images: the kernel drops
# its |.| there, so cover both signs, a band crossing the diagonal and no band.
@pytest.mark.parametrize(
    "band", ["none", "causal_lower_right", "anti_causal_lower_right", "window_both_sides"]
)
def test_alibi(slope_batch: int, band: str) -> None:
    band_lo, band_hi = BANDS[band](40, 50)
    slopes = torch.rand(slope_batch, 3, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q, k, v = make_qkv(2, 3, 3, 40, 50, 16, BF16)
    check(
        q,
        k,
        v,
        Mask(scale_of(16), MaskProgram(band_lo=band_lo, band_hi=band_hi, alibi_slopes=slopes)),
    )


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32])
@pytest.mark.parametrize("cap", [0.5, 20.0])
def test_softcap(dtype: torch.dtype, cap: float) -> None:
    q, k, v = make_qkv(1, 2, 1, 35, 40, 32, dtype)
    check(q, k, v, Mask(1.0, MaskProgram(band_hi=40 - 35, softcap=cap)))


@pytest.mark.parametrize("dtype", [FP16, BF16, FP32])
@pytest.mark.parametrize("with_key_range", [False, True], ids=["no_key_range", "key_range"])
def test_all_features_with_gqa(dtype: torch.dtype, with_key_range: bool) -> None:
    q_doc = torch.stack([docs_from_seqlens([30, 20]), docs_from_seqlens([5, 45])])
    kv_doc = torch.stack([docs_from_seqlens([25, 19]), docs_from_seqlens([10, 34])])
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.3, 0.2, 0.1, 0.05]], device=DEVICE)
    start, end = key_range((3, 41), (0, 19)) if with_key_range else (None, None)
    q, k, v = make_qkv(2, 4, 2, 50, 44, 24, dtype)
    mask = Mask(
        scale_of(24),
        MaskProgram(
            band_lo=44 - 50 - 20,
            band_hi=44 - 50 + 2,
            q_doc=q_doc,
            kv_doc=kv_doc,
            alibi_slopes=slopes,
            softcap=5.0,
            kv_start=start,
            kv_end=end,
        ),
    )
    check(q, k, v, mask)


# --------------------------------------------------------------------------------------
# Shapes, head dims, layouts
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq_q", "seq_k", "band"),
    [
        (6, 2, 33, 33, "causal_upper_left"),
        (4, 1, 17, 50, "none"),
        (2, 2, 1, 45, "causal_lower_right"),
        (2, 2, 1, 45, "sliding_window"),
        (2, 1, 70, 20, "causal_upper_left"),
        (2, 1, 64, 1, "none"),
        (3, 3, 16, 16, "window_both_sides"),
    ],
)
def test_shapes(heads: int, kv_heads: int, seq_q: int, seq_k: int, band: str) -> None:
    band_lo, band_hi = BANDS[band](seq_q, seq_k)
    q, k, v = make_qkv(2, heads, kv_heads, seq_q, seq_k, 16, FP16)
    check(q, k, v, Mask(scale_of(16), MaskProgram(band_lo=band_lo, band_hi=band_hi)))


@pytest.mark.parametrize("head_dim", [16, 80, 96, 128, 160, 256])
def test_head_dims(head_dim: int) -> None:
    q, k, v = make_qkv(1, 2, 1, 20, 23, head_dim, FP16)
    check(q, k, v, Mask(scale_of(head_dim), MaskProgram(band_hi=3)))


def test_zero_keys() -> None:
    q, k, v = make_qkv(1, 2, 1, 5, 0, 16, FP32)
    out, lse = attention_forward(q, k, v, **Mask(0.25).kwargs())
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("dtype", [FP16, FP32])
def test_non_contiguous(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    # (B, L, H, E) storage seen as (B, H, L, E), and a head dim with stride 2
    q = torch.randn(2, 37, 4, 32, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    kv = torch.randn(2, 41, 2, 2, 64, generator=gen).to(DEVICE, dtype)
    k = kv[:, :, 0, :, ::2].transpose(1, 2)
    v = kv[:, :, 1, :, 1::2].transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    grad_out = torch.randn(2, 37, 4, 32, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    q_doc = docs_from_seqlens([20, 17])[None]
    kv_doc = docs_from_seqlens([21, 20])[None]
    mask = Mask(scale_of(32), MaskProgram(band_hi=4, q_doc=q_doc, kv_doc=kv_doc))
    check(q, k, v, mask, grad_out=grad_out)


@pytest.mark.parametrize(("block_m", "block_n"), [(32, 16), (16, 32)])
def test_unequal_tiles(monkeypatch: pytest.MonkeyPatch, block_m: int, block_n: int) -> None:
    if DEVICE == "cuda":
        pytest.skip("tile sizes come from the GPU tables on a GPU")
    from attnbias.kernels import configs

    monkeypatch.setattr(configs, "INTERPRETER_CONFIG", configs.KernelConfig(block_m, block_n, 1, 1))
    q_doc = docs_from_seqlens([13, 40, 18])[None]
    kv_doc = docs_from_seqlens([30, 20, 21])[None]
    q, k, v = make_qkv(1, 2, 1, 71, 71, 16, BF16)
    check(
        q, k, v, Mask(scale_of(16), MaskProgram(band_lo=-20, band_hi=0, q_doc=q_doc, kv_doc=kv_doc))
    )


# --------------------------------------------------------------------------------------
# Rows that keep nothing
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_fully_masked_rows(dtype: torch.dtype) -> None:
    # Document 1 has queries but no keys and document 2 keys but no queries; the band also
    # leaves the first rows of document 3 without keys.
    q_doc = docs_from_seqlens([12, 9, 0, 19])[None]
    kv_doc = docs_from_seqlens([15, 0, 11, 14])[None]
    slopes = torch.full((1, 2), 0.3, device=DEVICE)
    q, k, v = make_qkv(1, 2, 2, 40, 40, 16, dtype)
    mask = Mask(
        scale_of(16),
        MaskProgram(band_lo=-2, band_hi=1, q_doc=q_doc, kv_doc=kv_doc, alibi_slopes=slopes),
    )
    out, lse = check(q, k, v, mask)
    empty_rows = torch.isinf(lse)
    assert empty_rows[..., 12:21].all(), "document 1 has no keys"
    grad_out = torch.randn_like(out)
    dq, dk, dv, *_ = attention_backward(grad_out, q, k, v, out, lse, **mask.kwargs())
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert (dq[empty_rows] == 0).all()
    assert (dk[:, :, 15:26] == 0).all() and (dv[:, :, 15:26] == 0).all()  # keys nobody sees


def test_everything_masked() -> None:
    q, k, v = make_qkv(1, 2, 1, 20, 30, 16, FP16)
    mask = Mask(0.25, MaskProgram(band_lo=3, band_hi=-3))
    out, lse = attention_forward(q, k, v, **mask.kwargs())
    assert (out == 0).all() and torch.isneginf(lse).all()
    grads = attention_backward(torch.randn_like(out), q, k, v, out, lse, **mask.kwargs())[:3]
    for g in grads:
        assert (g == 0).all()


# --------------------------------------------------------------------------------------
# Key ranges (padding, the filled part of a cache)
# --------------------------------------------------------------------------------------


def key_range(*rows: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(kv_start, kv_end)`` int32 ``(B,)`` from one ``(start, end)`` per batch row."""
    start = torch.tensor([row[0] for row in rows], dtype=torch.int32, device=DEVICE)
    end = torch.tensor([row[1] for row in rows], dtype=torch.int32, device=DEVICE)
    return start, end


def outside_range(start: Tensor, end: Tensor, seq_k: int) -> Tensor:
    """``(B, S)`` bool: the keys outside each batch row's range."""
    cols = torch.arange(seq_k, device=start.device)
    return (cols < start[:, None]) | (cols >= end[:, None])


# (start, end) per batch row for S = 56: 16-key tiles under the interpreter, so the ends fall
# on and between tile edges, inside one tile, at 0 and at S, and ranges may be empty
KEY_RANGES = {
    "left_padding": [(13, 56), (0, 56)],
    "right_padding": [(0, 37), (0, 16)],
    "both_ends": [(5, 50), (17, 31)],
    "inside_one_tile": [(33, 35), (48, 49)],
    "one_row_empty": [(20, 20), (3, 44)],
    "all_empty": [(0, 0), (56, 56)],
}


@pytest.mark.parametrize("ranges", list(KEY_RANGES))
@pytest.mark.parametrize("band", ["none", "causal_lower_right", "window_both_sides"])
def test_key_ranges(ranges: str, band: str) -> None:
    seq_q, seq_k = 40, 56
    band_lo, band_hi = BANDS[band](seq_q, seq_k)
    start, end = key_range(*KEY_RANGES[ranges])
    q, k, v = make_qkv(2, 2, 1, seq_q, seq_k, 16, BF16)
    mask = Mask(
        scale_of(16), MaskProgram(band_lo=band_lo, band_hi=band_hi, kv_start=start, kv_end=end)
    )
    out, lse = check(q, k, v, mask)
    empty = start >= end
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()


def test_key_range_shared_by_the_batch() -> None:
    """A ``(1,)`` range applies to every batch row."""
    start, end = key_range((7, 45))
    q, k, v = make_qkv(3, 2, 2, 33, 50, 16, FP32)
    check(q, k, v, Mask(scale_of(16), MaskProgram(band_hi=50 - 33, kv_start=start, kv_end=end)))


@pytest.mark.parametrize(("block_m", "block_n"), [(32, 16), (16, 32)])
def test_key_ranges_with_unequal_tiles(
    monkeypatch: pytest.MonkeyPatch, block_m: int, block_n: int
) -> None:
    if DEVICE == "cuda":
        pytest.skip("tile sizes come from the GPU tables on a GPU")
    from attnbias.kernels import configs

    monkeypatch.setattr(configs, "INTERPRETER_CONFIG", configs.KernelConfig(block_m, block_n, 1, 1))
    start, end = key_range((9, 70), (0, 33))
    q, k, v = make_qkv(2, 2, 1, 71, 71, 16, BF16)
    check(
        q, k, v, Mask(scale_of(16), MaskProgram(band_lo=-40, band_hi=0, kv_start=start, kv_end=end))
    )


NON_FINITE = {"nan": float("nan"), "inf": float("inf")}  # values get its negation


@pytest.mark.parametrize("poison", list(NON_FINITE))
@pytest.mark.parametrize("features", ["band", "documents_alibi_softcap"])
def test_nothing_outside_the_key_range_is_read(poison: str, features: str) -> None:
    """Non-finite values in every key and value outside the ranges (and in the queries and
    output gradients of a batch row whose range is empty) change no output, log-sum-exp or
    gradient by a single bit against the same call with zeros there; the keys outside get
    zero gradients and the row with no key zero output and gradients."""
    seq_q, seq_k = 40, 56
    start, end = key_range((5, 50), (17, 31), (20, 20))
    extra: dict[str, Any] = {}
    if features == "documents_alibi_softcap":
        extra = {
            "q_doc": docs_from_seqlens([25, 15])[None],
            "kv_doc": docs_from_seqlens([30, 26])[None],
            "alibi_slopes": torch.tensor([[0.2, 0.1]], device=DEVICE),
            "softcap": 4.0,
        }
    mask = Mask(
        scale_of(16),
        MaskProgram(band_lo=-20, band_hi=seq_k - seq_q, kv_start=start, kv_end=end, **extra),
    )
    q, k, v = make_qkv(3, 2, 1, seq_q, seq_k, 16, FP16)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE, FP16)
    outside = outside_range(start, end, seq_k)[:, None, :, None]  # (B, 1, S, 1)
    value = NON_FINITE[poison]
    dirty_k, dirty_v = k.masked_fill(outside, value), v.masked_fill(outside, -value)
    clean_k, clean_v = k.masked_fill(outside, 0.0), v.masked_fill(outside, 0.0)
    dirty_q, dirty_grad = q.clone(), grad_out.clone()
    dirty_q[2], dirty_grad[2] = value, value  # batch row 2 keeps no key
    clean_q, clean_grad = q.clone(), grad_out.clone()
    clean_q[2], clean_grad[2] = 0.0, 0.0

    dirty = attention_forward(dirty_q, dirty_k, dirty_v, **mask.kwargs())
    clean = attention_forward(clean_q, clean_k, clean_v, **mask.kwargs())
    for got, want in zip(dirty, clean, strict=True):
        assert torch.equal(got, want)
    dirty_grads = attention_backward(
        dirty_grad, dirty_q, dirty_k, dirty_v, *dirty, **mask.kwargs()
    )[:3]
    clean_grads = attention_backward(
        clean_grad, clean_q, clean_k, clean_v, *clean, **mask.kwargs()
    )[:3]
    for got, want in zip(dirty_grads, clean_grads, strict=True):
        assert torch.equal(got, want)
    dq, dk, dv = dirty_grads
    assert (dk.masked_select(outside) == 0).all() and (dv.masked_select(outside) == 0).all()
    assert (dirty[0][2] == 0).all() and (dq[2] == 0).all()
    check(clean_q, clean_k, clean_v, mask, grad_out=clean_grad)  # and the clean call is right


def test_the_registered_ops_pass_key_ranges_on() -> None:
    """The ops that ``torch.compile`` traces take the key range, forward and backward, and
    give what the eager path gives, bit for bit (a key outside the range is NaN here)."""
    import attnbias.kernels.ops  # noqa: F401  (registers the ops)

    start, end = key_range((3, 33), (17, 17))
    q, k, v = make_qkv(2, 2, 1, 20, 40, 16, FP32)
    k[0, :, 35] = float("nan")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    program = MaskProgram(band_hi=20, kv_start=start, kv_end=end)
    out, _ = torch.ops.attnbias.attention_fwd(*leaves, *program.pack(), 0.25)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = block_sparse_attention(*eager_leaves, program, scale=0.25)
    eager_grads = torch.autograd.grad(eager.square().sum(), eager_leaves)
    assert torch.equal(out, eager) and torch.isfinite(out).all()
    for got, want in zip(grads, eager_grads, strict=True):
        assert torch.equal(got, want) and torch.isfinite(got).all()


# --------------------------------------------------------------------------------------
# Autograd wrapper, gradient of lse, lazy import
# --------------------------------------------------------------------------------------


def test_block_sparse_attention_autograd() -> None:
    q, k, v = make_qkv(2, 4, 2, 30, 30, 16, FP32)
    slopes = torch.tensor([[0.1, 0.2, 0.3, 0.4]], device=DEVICE)
    mask = Mask(scale_of(16), MaskProgram(band_lo=-8, band_hi=0, alibi_slopes=slopes, softcap=3.0))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = block_sparse_attention(*leaves, **mask.kwargs())
    gen = torch.Generator().manual_seed(2)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    out.backward(grad_out)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*ref_leaves, mask)
    ref.backward(grad_out.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


def test_gradient_of_lse() -> None:
    q, k, v = make_qkv(1, 2, 1, 24, 40, 16, FP32)
    mask = Mask(scale_of(16), MaskProgram(band_hi=40 - 24))
    out, lse = attention_forward(q, k, v, **mask.kwargs())
    gen = torch.Generator().manual_seed(4)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    grad_lse = torch.randn(lse.shape, generator=gen).to(DEVICE)
    grads = attention_backward(grad_out, q, k, v, out, lse, **mask.kwargs(), grad_lse=grad_lse)[:3]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, mask)
    want = torch.autograd.grad((ref_out, ref_lse), leaves, (grad_out.double(), grad_lse.double()))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)


class _FakeParam:
    def __init__(self, name: str) -> None:
        self.name = name
        self.is_constexpr = name == "BLOCK"
        self.do_not_specialize = name == "n"


class _FakeKernel:
    """Records how ``CachedLaunch`` launches: through the jit function or a compiled kernel."""

    def __init__(self) -> None:
        self.params = [_FakeParam(n) for n in ("X", "Y", "stride_x", "n", "scale", "BLOCK")]
        self.compiles: list[tuple[Any, ...]] = []
        self.launches: list[tuple[str, tuple[int, ...], tuple[Any, ...]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def jit_launch(*args: Any, **options: Any) -> Any:
            self.compiles.append(args)
            self.launches.append(("jit", grid, args))
            kernel = self

            class Compiled:
                def __getitem__(self, grid: tuple[int, ...]) -> Any:
                    # a compiled kernel's launcher reads grid[0], grid[1] and grid[2]
                    assert len(grid) == 3, grid
                    return lambda *a: kernel.launches.append(("compiled", grid, a))

            return Compiled()

        return jit_launch


def test_cached_launch_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch cache reuses a compiled kernel only for equal scalars (integers of a
    ``do_not_specialize`` parameter: equal width), constexprs, launch options and tensor
    dtypes and 16-byte alignment; it passes the constexprs through, and a grid of one or two
    dimensions as three."""
    from attnbias.kernels import launch as launch_module
    from attnbias.kernels.launch import CachedLaunch

    monkeypatch.setattr(launch_module, "current_device", lambda: 0)
    fake = _FakeKernel()
    launch = CachedLaunch(fake)
    assert (launch.num_args, launch.constexpr_names) == (5, ["BLOCK"])
    base = torch.zeros(64)
    x, y = base[:16], base[16:32]  # both 16-byte aligned
    launch[(1,)](x, None, 1, 7, 0.5, BLOCK=16, num_warps=4)
    launch[(2,)](y, None, 1, 7, 0.5, BLOCK=16, num_warps=4)  # same key: compiled launcher
    assert fake.launches[-1] == ("compiled", (2, 1, 1), (y, None, 1, 7, 0.5, 16))
    launch[(2, 3)](y, None, 1, 9, 0.5, BLOCK=16, num_warps=4)  # n is not specialized on
    assert fake.launches[-1] == ("compiled", (2, 3, 1), (y, None, 1, 9, 0.5, 16))
    variants = [
        (base[1:17], None, 1, 7, 0.5),  # misaligned
        (x.double(), None, 1, 7, 0.5),  # dtype
        (x, y, 1, 7, 0.5),  # None -> tensor
        (x, None, 2, 7, 0.5),  # scalar
        (x, None, 1, 7, 0.25),  # float scalar
        (x, None, True, 7, 0.5),  # bool for int
        (x, None, 1, 2**31, 0.5),  # n's width
    ]
    for args in variants:
        launch[(1,)](*args, BLOCK=16, num_warps=4)
        assert fake.launches[-1][0] == "jit", args
    launch[(1,)](x, None, 1, 7, 0.5, BLOCK=32, num_warps=4)
    launch[(1,)](x, None, 1, 7, 0.5, BLOCK=16, num_warps=8)
    assert len(fake.compiles) == 1 + len(variants) + 2
    with pytest.raises(TypeError, match="expected 5 runtime arguments"):
        launch[(1,)](x, None, 1, 7, BLOCK=16)

    # a launch that hands back no compiled kernel is never reused
    class NoCompiledKernel(_FakeKernel):
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            return lambda *args, **options: self.launches.append(("jit", grid, args))

    plain = NoCompiledKernel()
    launch = CachedLaunch(plain)
    launch[(1,)](x, None, 1, 7, 0.5, BLOCK=16)
    launch[(1,)](x, None, 1, 7, 0.5, BLOCK=16)
    assert [kind for kind, _, _ in plain.launches] == ["jit", "jit"] and not launch.compiled


def test_import_is_lazy() -> None:
    code = (
        "import sys\n"
        "from attnbias import kernels\n"
        "assert 'triton' not in sys.modules, 'import attnbias.kernels imported triton'\n"
        "assert kernels.__all__ == sorted(kernels.__all__)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------
# Property test
# --------------------------------------------------------------------------------------


def _split(draw: st.DrawFn, total: int, parts: int) -> list[int]:
    """Non-negative lengths of ``parts`` documents summing to ``total``."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0, *cuts, total]
    return [b - a for a, b in itertools.pairwise(bounds)]


@st.composite
def lengths_and_band(draw: st.DrawFn) -> tuple[int, int, int | None, int | None]:
    """Lengths and a band whose edges fall inside the score matrix or are open."""
    seq_q, seq_k = draw(st.integers(2, 200)), draw(st.integers(2, 200))
    edge = st.one_of(st.none(), st.integers(-seq_q, seq_k))
    return seq_q, seq_k, draw(edge), draw(edge)


@example((2, 96, 47, 48))  # both ends cut short, more columns at the start
@given(lengths_and_band())
def test_launch_order_puts_the_longer_half_first(
    lengths_band: tuple[int, int, int | None, int | None],
) -> None:
    """Programs start with the end of the sequence only when the band gives that end more
    work: in launch order, the first half of the rows (columns) keeps at least as many pairs
    as the second half, whenever the band cuts short at most half of them at each end."""
    from attnbias.kernels.masks import late_cols_first, late_rows_first, launch_mask

    seq_q, seq_k, band_lo, band_hi = lengths_band
    args = launch_mask(
        torch.empty(1, 1, seq_q, 16), torch.empty(1, 1, seq_k, 16),
        **Mask(1.0, MaskProgram(band_lo=band_lo, band_hi=band_hi)).kwargs(), rows=False, cols=False,
    )  # fmt: skip
    keep = keep_mask(
        Mask(1.0, MaskProgram(band_lo=band_lo, band_hi=band_hi)), 1, seq_q, seq_k, "cpu"
    )[0, 0]
    for work, late_first, cut_start, cut_end in (
        (
            keep.sum(1),
            late_rows_first(seq_q, seq_k, args),
            -band_lo if band_lo is not None else seq_q,
            seq_q - seq_k + band_hi if band_hi is not None else seq_q,
        ),
        (
            keep.sum(0),
            late_cols_first(seq_q, seq_k, args),
            band_hi if band_hi is not None else seq_k,
            seq_k - seq_q - band_lo if band_lo is not None else seq_k,
        ),
    ):
        half = len(work) // 2
        both_ends_cut = band_lo is not None and band_hi is not None
        if both_ends_cut and (cut_start > half or cut_end > half):
            continue  # the two cut-short ends overlap: no simple order to check
        order = work.flip(0) if late_first else work
        assert order[:half].sum() >= order[len(work) - half :].sum()


@st.composite
def attention_configs(draw: st.DrawFn) -> tuple[tuple[int, ...], torch.dtype, Mask, int]:
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 2))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    seq_q = draw(st.integers(1, 48))
    seq_k = draw(st.integers(1, 48))
    head_dim = draw(st.sampled_from([16, 24, 32]))
    dtype = draw(st.sampled_from([FP16, BF16, FP32]))
    offset = st.integers(-seq_q - 2, seq_k + 2)
    band_lo = draw(st.none() | offset)
    band_hi = draw(st.none() | offset)
    q_doc = kv_doc = slopes = None
    if draw(st.booleans()):
        doc_batch = draw(st.sampled_from([1, batch]))
        num_docs = draw(st.integers(1, 4))
        q_doc = torch.stack(
            [docs_from_seqlens(_split(draw, seq_q, num_docs)) for _ in range(doc_batch)]
        )
        kv_doc = torch.stack(
            [docs_from_seqlens(_split(draw, seq_k, num_docs)) for _ in range(doc_batch)]
        )
    if draw(st.booleans()):
        slope_batch = draw(st.sampled_from([1, batch]))
        count = slope_batch * heads
        values = draw(st.lists(st.floats(0.0, 1.0), min_size=count, max_size=count))
        slopes = torch.tensor(values, device=DEVICE).reshape(slope_batch, heads)
    softcap = draw(st.none() | st.floats(0.5, 30.0))
    kv_start = kv_end = None
    if draw(st.booleans()):
        bounds = [
            sorted(draw(st.lists(st.integers(0, seq_k), min_size=2, max_size=2)))
            for _ in range(draw(st.sampled_from([1, batch])))
        ]
        kv_start = torch.tensor([b[0] for b in bounds], dtype=torch.int32, device=DEVICE)
        kv_end = torch.tensor([b[1] for b in bounds], dtype=torch.int32, device=DEVICE)
    mask = Mask(
        scale_of(head_dim),
        MaskProgram(
            band_lo=band_lo,
            band_hi=band_hi,
            q_doc=q_doc,
            kv_doc=kv_doc,
            alibi_slopes=slopes,
            softcap=softcap,
            kv_start=kv_start,
            kv_end=kv_end,
        ),
    )
    shape = (batch, heads, kv_heads, seq_q, seq_k, head_dim)
    return shape, dtype, mask, draw(st.integers(0, 2**16))


def _ids(*rows: list[int]) -> Tensor:
    return torch.tensor(rows, device=DEVICE)


# Examples that random draws once found beyond the budget, before the budget covered the
# kernel's own rounding (see rounding_sizes): one key per row, fp32 (dK is exactly 0); a
# steep ALiBi slope in fp32 (P from exp(s - lse)); one query keeping two keys, bf16 (delta
# from the stored output).
@example(((1, 1, 1, 1, 1, 16), FP32, Mask(0.25), 0))
@example(
    (
        (2, 4, 2, 47, 36, 32),
        FP32,
        Mask(
            32**-0.5,
            MaskProgram(
                q_doc=_ids(
                    [0] * 25 + [1] * 2 + [2] * 6 + [3] * 14, [0] * 12 + [1] * 2 + [2] * 5 + [3] * 28
                ),
                kv_doc=_ids([0] * 8 + [1] * 23 + [2] * 5, [0] * 13 + [1] * 4 + [2] * 11 + [3] * 8),
                alibi_slopes=torch.tensor(
                    [[0.0, 0.5534, 0.6696, 0.0], [0.0, 0.8523, 0.4236, 0.0]]
                ).to(DEVICE),
            ),
        ),
        1,
    )
)
@example(
    (
        (1, 2, 2, 1, 4, 16),
        BF16,
        Mask(0.25, MaskProgram(q_doc=_ids([1]), kv_doc=_ids([0, 0, 1, 1]))),
        5071,
    )
)
@given(attention_configs())
def test_property(config: tuple[tuple[int, ...], torch.dtype, Mask, int]) -> None:
    shape, dtype, mask, seed = config
    q, k, v = make_qkv(*shape, dtype, seed=seed)  # type: ignore[misc]
    check(q, k, v, mask, seed=seed + 1)


# --------------------------------------------------------------------------------------
# Real sizes on a GPU
# --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_causal_gqa(dtype: torch.dtype, head_dim: int) -> None:
    seq = 1024 if head_dim == 256 or dtype == FP32 else 2048
    q, k, v = make_qkv(1, 4, 2, seq, seq, head_dim, dtype)
    check(q, k, v, Mask(scale_of(head_dim), MaskProgram(band_hi=0)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_gpu_all_features(dtype: torch.dtype) -> None:
    seq_q, seq_k = 1000, 1100
    q_doc = torch.stack([docs_from_seqlens([300, 450, 250]), docs_from_seqlens([999, 0, 1])])
    kv_doc = torch.stack([docs_from_seqlens([330, 470, 300]), docs_from_seqlens([1000, 50, 50])])
    slopes = torch.rand(2, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE) * 0.1
    q, k, v = make_qkv(2, 8, 2, seq_q, seq_k, 128, dtype)
    mask = Mask(
        scale_of(128),
        MaskProgram(
            band_lo=seq_k - seq_q - 256,
            band_hi=seq_k - seq_q,
            q_doc=q_doc,
            kv_doc=kv_doc,
            alibi_slopes=slopes,
            softcap=30.0,
        ),
    )
    check(q, k, v, mask)


@pytest.mark.gpu
@pytest.mark.parametrize("band", ["none", "sliding_window", "left_only"])
def test_gpu_bands_real_size(band: str) -> None:
    band_lo, band_hi = BANDS[band](2048, 2048)
    band_lo = None if band_lo is None else band_lo - 250
    q, k, v = make_qkv(2, 4, 4, 2048, 2048, 128, BF16)
    check(q, k, v, Mask(scale_of(128), MaskProgram(band_lo=band_lo, band_hi=band_hi)))


@pytest.mark.gpu
@pytest.mark.parametrize("user_stream", [False, True])
def test_gpu_backward_in_stream_order(user_stream: bool) -> None:
    """The backward's kernels run on the caller's current stream, a stream of its own too,
    and its gradients are complete in that stream's order."""
    q_doc = torch.stack([docs_from_seqlens([300, 450, 250]), docs_from_seqlens([999, 0, 1])])
    q, k, v = make_qkv(2, 8, 2, 1000, 1000, 128, BF16)
    mask = Mask(scale_of(128), MaskProgram(band_hi=0, q_doc=q_doc, kv_doc=q_doc, softcap=30.0))
    stream = torch.cuda.Stream() if user_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        check(q, k, v, mask)
        # the gradients are complete in stream order: scale them on the caller's stream now
        out, lse = attention_forward(q, k, v, **mask.kwargs())
        grads = attention_backward(torch.ones_like(out), q, k, v, out, lse, **mask.kwargs())[:3]
        doubled = [2 * g.float() for g in grads]
        again = attention_backward(torch.ones_like(out), q, k, v, out, lse, **mask.kwargs())[:3]
    torch.cuda.current_stream().wait_stream(stream)
    for twice, single in zip(doubled, again, strict=True):
        torch.testing.assert_close(twice, 2 * single.float(), rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_misaligned_inputs_after_aligned() -> None:
    """Launches reuse compiled kernels per tensor alignment: inputs at an odd element offset
    after aligned ones of the same shapes must get a kernel compiled for them."""
    from attnbias.kernels import forward, launch
    from attnbias.kernels.record import flat_kernel

    mask = Mask(
        scale_of(64), MaskProgram(band_lo=-100, band_hi=0, alibi_slopes=torch.rand(4).to(DEVICE))
    )
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, BF16)
    check(q, k, v, mask)
    shifted = []
    for t in (q, k, v):
        storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        view = storage[1:].view(t.shape)
        view.copy_(t)
        assert view.data_ptr() % 16 != 0
        shifted.append(view)
    check(*shifted, mask)
    launches = launch.CACHED_LAUNCHES[flat_kernel(forward._attn_fwd)].compiled
    assert len(launches) >= 2


@pytest.mark.gpu
def test_gpu_compile_fullgraph() -> None:
    q, k, v = make_qkv(2, 8, 2, 1024, 1024, 128, BF16)
    doc = docs_from_seqlens([400, 624])[None]
    mask = Mask(scale_of(128), MaskProgram(band_hi=0, q_doc=doc, kv_doc=doc, softcap=20.0))

    def loss(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return block_sparse_attention(q, k, v, **mask.kwargs()).float().square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward()
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*eager_leaves).backward()
    for got, want in zip(leaves, eager_leaves, strict=True):
        assert got.grad is not None and want.grad is not None
        torch.testing.assert_close(got.grad, want.grad)

"""The benchmark's cases: configuration, attention patterns, inputs, the eager reference and the
counts of attended pairs and FLOPs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnbias import (
    AlibiBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
)

SOFTCAP = 50.0
MIN_DOCS, MAX_DOCS = 2, 12
CASE_NAMES = ("full", "causal", "window", "documents", "alibi", "softcap")
# Query scale for the random inputs: scores of std ~4 make soft-capping at 50 change the
# output measurably, so a kernel that skipped the cap would fail the spot-check.
QUERY_STD = 4.0

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Config:
    mode: str  # "full", "quick" or "smoke"
    device: torch.device
    dtype: torch.dtype
    tokens: int  # B * S, fixed across sequence lengths
    num_heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    window: int  # keys seen by each query in the sliding-window case, itself included
    warmup_ms: int
    rep_ms: int
    rounds: int  # timing rounds per case, contenders in alternating order (see bench_case)
    cpu_reps: int
    compile_flex: bool
    seed: int = 0
    chunk_rows: int = 256  # query rows per chunk of the eager reference and the pair count

    def batch(self, seq_len: int) -> int:
        return max(1, self.tokens // seq_len)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class FlashArgs:
    """A pattern in FlashAttention's arguments. `window_size` follows its convention, aligned
    to the bottom right: key j is kept when i + S - L - left <= j <= i + S - L + right, None
    leaving that side open. `doc_seqlens`, the documents of every batch row, calls for the
    variable-length API, one sequence per document."""

    causal: bool = False
    window_size: tuple[int | None, int | None] = (None, None)
    softcap: float = 0.0
    doc_seqlens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Case:
    """One attention pattern, expressed once per contender family.

    `make_bias` builds what `attnbias.sdpa` receives as `attn_mask` (lazily, so a failing
    constructor is recorded against the contenders that need it). `mask_mod` / `score_mod`
    are FlexAttention's description of the same pattern; the eager reference and the pair
    count evaluate them too, on broadcast index tensors. Every mask here is the same for all
    batches and heads, and keeps the diagonal, so no row is fully masked.
    """

    name: str
    label: str
    make_bias: Callable[[], Any]
    mask_mod: MaskMod | None  # None: every pair kept
    score_mod: ScoreMod | None
    stock_is_causal: bool | None  # is_causal for stock flash / cuDNN; None: they cannot do it
    flash: FlashArgs | None  # None: FlashAttention's arguments cannot express it
    materializable: bool
    details: str = ""


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's head slopes: a geometric sequence starting at 2^(-8/n) for a power
    of two n; otherwise the slopes of the nearest lower power of two, completed by every
    other slope of the next power of two."""

    def geometric(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 2 ** math.floor(math.log2(num_heads))
    if lower == num_heads:
        return geometric(num_heads)
    return geometric(lower) + geometric(2 * lower)[0::2][: num_heads - lower]


def document_seqlens(seq_len: int, seed: int) -> list[int]:
    """Random document lengths summing to `seq_len`, MIN_DOCS..MAX_DOCS of them."""
    generator = torch.Generator().manual_seed(seed)
    num_docs = int(torch.randint(MIN_DOCS, MAX_DOCS + 1, (), generator=generator))
    num_docs = min(num_docs, seq_len)
    cuts = torch.randperm(seq_len - 1, generator=generator)[: num_docs - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), seq_len]
    return [end - start for start, end in itertools.pairwise(bounds)]


def causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def softcap_score(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def build_case(name: str, seq_len: int, cfg: Config) -> Case:
    # L = S in every case, so FlashAttention's bottom-right causal alignment coincides with
    # the upper-left one of the biases.
    upper_left = lambda: CausalBias(CausalVariant.UPPER_LEFT)
    if name == "full":
        return Case(
            name,
            label="no mask",
            make_bias=lambda: None,
            mask_mod=None,
            score_mod=None,
            stock_is_causal=False,
            flash=FlashArgs(),
            materializable=False,
        )
    if name == "causal":
        return Case(
            name,
            label="causal, upper-left (j <= i)",
            make_bias=upper_left,
            mask_mod=causal_mask,
            score_mod=None,
            stock_is_causal=True,
            flash=FlashArgs(causal=True),
            materializable=True,
        )
    if name == "window":
        window = cfg.window

        def window_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        return Case(
            name,
            label=f"sliding window of {window} keys, causal: SlidingWindowBias({window - 1}) "
            f"keeps i-{window - 1} <= j <= i",
            make_bias=lambda: SlidingWindowBias(window - 1),
            mask_mod=window_mask,
            score_mod=None,
            stock_is_causal=None,
            flash=FlashArgs(window_size=(window - 1, 0)),
            materializable=True,
        )
    if name == "documents":
        seqlens = document_seqlens(seq_len, cfg.seed + seq_len)
        doc_ids = torch.repeat_interleave(
            torch.arange(len(seqlens), device=cfg.device),
            torch.tensor(seqlens, device=cfg.device),
        )

        def document_causal_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

        return Case(
            name,
            label="packed documents + causal: DocumentBias.from_seqlens(seqlens) + CausalBias, "
            "same layout in every batch",
            make_bias=lambda: DocumentBias.from_seqlens(seqlens) + upper_left(),
            mask_mod=document_causal_mask,
            score_mod=None,
            stock_is_causal=None,
            flash=FlashArgs(causal=True, doc_seqlens=tuple(seqlens)),
            materializable=True,
            details=f"seqlens={seqlens}",
        )
    if name == "alibi":
        slopes = torch.tensor(alibi_slopes(cfg.num_heads), device=cfg.device)

        def alibi_score(
            score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
        ) -> Tensor:
            return score - slopes[h] * (q_idx - kv_idx).abs()

        return Case(
            name,
            label=f"ALiBi (paper's slopes, H={cfg.num_heads}) + causal",
            make_bias=lambda: AlibiBias(num_heads=cfg.num_heads) + upper_left(),
            mask_mod=causal_mask,
            score_mod=alibi_score,
            stock_is_causal=None,
            flash=None,
            materializable=True,
        )
    if name == "softcap":
        return Case(
            name,
            label=f"soft-cap {SOFTCAP:g} (exact tanh) + causal",
            make_bias=lambda: SoftcapBias(SOFTCAP) + upper_left(),
            mask_mod=causal_mask,
            score_mod=softcap_score,
            stock_is_causal=None,
            flash=FlashArgs(causal=True, softcap=SOFTCAP),
            materializable=False,
        )
    raise ValueError(f"unknown case {name!r}; choose from {', '.join(CASE_NAMES)}")


# --------------------------------------------------------------------------- inputs, reference


@dataclass
class Inputs:
    q: Tensor  # (B, H, L, E), leaf requiring grad
    k: Tensor  # (B, H, S, E)
    v: Tensor  # (B, H, S, E)
    dout: Tensor  # (B, H, L, E)

    def leaves(self) -> list[Tensor]:
        return [self.q, self.k, self.v]

    def clear_grads(self) -> None:
        for t in self.leaves():
            t.grad = None


@dataclass
class Reference:
    out: Tensor
    grads: tuple[Tensor, Tensor, Tensor]  # dq, dk, dv


def make_inputs(cfg: Config, seq_len: int) -> Inputs:
    generator = torch.Generator(device=cfg.device).manual_seed(cfg.seed + seq_len)
    shape = (cfg.batch(seq_len), cfg.num_heads, seq_len, cfg.head_dim)

    def draw(std: float, requires_grad: bool) -> Tensor:
        x = torch.randn(shape, generator=generator, device=cfg.device) * std
        return x.to(cfg.dtype).requires_grad_(requires_grad)

    return Inputs(draw(QUERY_STD, True), draw(1.0, True), draw(1.0, True), draw(1.0, False))


def reference(case: Case, inputs: Inputs, cfg: Config) -> Reference:
    """Eager attention in fp32 (fp64 for fp32 inputs), a block of query rows at a time so the
    (B, H, rows, S) scores stay small; gradients by autograd per block."""
    ref_dtype = torch.float64 if cfg.dtype == torch.float32 else torch.float32
    q, k, v = (t.detach().to(ref_dtype) for t in inputs.leaves())
    dout = inputs.dout.to(ref_dtype)
    k.requires_grad_(True)
    v.requires_grad_(True)
    batch, heads, q_len, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim)
    b = torch.arange(batch, device=cfg.device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=cfg.device).view(1, -1, 1, 1)
    kv_idx = torch.arange(k.shape[2], device=cfg.device).view(1, 1, 1, -1)
    outs, dqs = [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for start in range(0, q_len, cfg.chunk_rows):
        stop = min(start + cfg.chunk_rows, q_len)
        q_rows = q[:, :, start:stop].clone().requires_grad_(True)
        q_idx = torch.arange(start, stop, device=cfg.device).view(1, 1, -1, 1)
        scores = q_rows @ k.transpose(-2, -1) * scale  # [B, H, rows, S]
        if case.score_mod is not None:
            scores = case.score_mod(scores, b, h, q_idx, kv_idx)
        if case.mask_mod is not None:
            scores = scores.masked_fill(~case.mask_mod(b, h, q_idx, kv_idx), -math.inf)
        out = torch.softmax(scores, dim=-1) @ v  # [B, H, rows, E]
        dq_rows, dk_rows, dv_rows = torch.autograd.grad(out, (q_rows, k, v), dout[:, :, start:stop])
        outs.append(out.detach())
        dqs.append(dq_rows)
        dk += dk_rows
        dv += dv_rows
    return Reference(torch.cat(outs, dim=2), (torch.cat(dqs, dim=2), dk, dv))


# --------------------------------------------------------------------------- counts


def count_kept(case: Case, seq_len: int, cfg: Config) -> int:
    """Exact number of attended (i, j) pairs for one batch and head, chunk by chunk."""
    if case.mask_mod is None:
        return seq_len * seq_len
    zero = torch.zeros((), dtype=torch.long, device=cfg.device)
    kv_idx = torch.arange(seq_len, device=cfg.device)[None, :]
    kept = 0
    for start in range(0, seq_len, 4 * cfg.chunk_rows):
        q_idx = torch.arange(start, min(start + 4 * cfg.chunk_rows, seq_len), device=cfg.device)
        kept += int(case.mask_mod(zero, zero, q_idx[:, None], kv_idx).sum())
    return kept


def forward_flops(inputs: Inputs, kept: int) -> int:
    """Forward FLOPs counting only attended pairs: 4·B·H·kept·E."""
    batch, heads, _, head_dim = inputs.q.shape
    return 4 * batch * heads * kept * head_dim

"""Benchmark `attnbias.sdpa` against FlexAttention and stock SDPA.

For each case (full, causal, sliding window, packed documents, ALiBi, soft-cap) and each
sequence length, every contender is first checked against an fp32 eager reference on the
same inputs, then timed for the forward and for forward + backward, and its peak memory is
measured. Results go to a markdown report, a JSON file and (when matplotlib is importable) a
PNG plot; `benchmarks/plot.py results.json out.png` redraws the plot elsewhere.

Usage::

    PYTHONPATH=. python benchmarks/bench.py                 # full run, writes benchmarks/RESULTS.md
    PYTHONPATH=. python benchmarks/bench.py --quick         # S = 4096 only, fewer reps
    PYTHONPATH=. python benchmarks/bench.py --cases causal,softcap --out /tmp/bench
    PYTHONPATH=. python benchmarks/bench.py --smoke         # CPU, tiny shapes: plumbing only

Shape legend: B batch, H heads, L query length, S key length (L = S here), E head dim.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attnbias
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
FLEX_TARGET = 1.0
SOFTCAP_FLEX_TARGET = 1.5
MASK_TARGET = 5.0
CASE_NAMES = ("full", "causal", "window", "documents", "alibi", "softcap")
CONTENDER_NAMES = ("attnbias", "flex", "sdpa-flash", "sdpa-cudnn", "sdpa-eff-mask", "sdpa-mask")
# Query scale for the random inputs: scores of std ~4 make soft-capping at 50 change the
# output measurably, so a kernel that skipped the cap would fail the spot-check.
QUERY_STD = 4.0

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
Forward = Callable[[], Tensor]


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


def make_config(args: argparse.Namespace) -> Config:
    if args.smoke:
        return Config(
            mode="smoke",
            device=torch.device("cpu"),
            dtype=torch.float32,
            tokens=256,
            num_heads=2,
            head_dim=64,
            seq_lens=(256,),
            window=64,
            warmup_ms=0,
            rep_ms=0,
            rounds=1,
            cpu_reps=1,
            compile_flex=False,
        )
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke to exercise the script on CPU")
    return Config(
        mode="quick" if args.quick else "full",
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        tokens=16 * 1024,
        num_heads=16,
        head_dim=128,
        seq_lens=(4096,) if args.quick else (4096, 16384),
        window=1024,
        warmup_ms=25 if args.quick else 100,
        rep_ms=100 if args.quick else 500,
        rounds=2,
        cpu_reps=1,
        compile_flex=True,
    )


# --------------------------------------------------------------------------- cases


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
    upper_left = lambda: CausalBias(CausalVariant.UPPER_LEFT)
    if name == "full":
        return Case(
            name,
            label="no mask",
            make_bias=lambda: None,
            mask_mod=None,
            score_mod=None,
            stock_is_causal=False,
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


# --------------------------------------------------------------------------- contenders


@dataclass
class Prepared:
    forward: Forward
    note: str = ""
    has_backward: bool = True


class NotApplicable(Exception):
    """The contender cannot express this case at all (no row is reported)."""


class Skipped(Exception):
    """The contender applies but is not run here (a row with the reason is reported)."""


def prepare_attnbias(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    bias = case.make_bias()
    q, k, v = inputs.leaves()
    return Prepared(lambda: attnbias.sdpa(q, k, v, attn_mask=bias))


def prepare_flex(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    q, k, v = inputs.leaves()
    _, _, q_len, _ = q.shape
    kv_len = k.shape[2]
    block_mask = None
    if case.mask_mod is not None:
        # The masks do not depend on batch or head, so one (1, 1) block mask broadcasts.
        block_mask = create_block_mask(case.mask_mod, None, None, q_len, kv_len, device=q.device)
    score_mod = case.score_mod
    if cfg.compile_flex:
        flex = torch.compile(flex_attention, dynamic=False)
        return Prepared(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask))

    # Uncompiled FlexAttention (the CPU smoke run) has no backward: check the forward only.
    def forward() -> Tensor:
        return flex_attention(
            q.detach(), k.detach(), v.detach(), score_mod=score_mod, block_mask=block_mask
        )

    return Prepared(forward, "uncompiled, forward only", has_backward=False)


def _prepare_stock(case: Case, inputs: Inputs, backend: SDPBackend) -> Forward:
    if case.stock_is_causal is None:
        raise NotApplicable
    q, k, v = inputs.leaves()
    is_causal = case.stock_is_causal

    def forward() -> Tensor:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return forward


def prepare_sdpa_flash(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    return Prepared(_prepare_stock(case, inputs, SDPBackend.FLASH_ATTENTION))


def prepare_sdpa_cudnn(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    if case.stock_is_causal is not None and cfg.device.type != "cuda":
        raise Skipped("cuDNN needs CUDA")
    return Prepared(_prepare_stock(case, inputs, SDPBackend.CUDNN_ATTENTION))


def prepare_sdpa_mask(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    return _prepare_mask(case, inputs, cfg, backend=None)


def prepare_sdpa_eff_mask(case: Case, inputs: Inputs, cfg: Config) -> Prepared:
    if cfg.device.type != "cuda":
        raise Skipped("the memory-efficient kernel with a mask is measured on CUDA")
    return _prepare_mask(case, inputs, cfg, backend=SDPBackend.EFFICIENT_ATTENTION)


def _prepare_mask(case: Case, inputs: Inputs, cfg: Config, backend: SDPBackend | None) -> Prepared:
    if case.mask_mod is None and case.score_mod is None:
        raise NotApplicable
    if not case.materializable:
        raise Skipped("SoftcapBias cannot be materialised")
    q, k, v = inputs.leaves()
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    if cfg.device.type == "cuda":
        # Worst case: one mask value per (head, i, j), plus a temporary of the same size.
        worst_bytes = 2 * heads * q_len * kv_len * q.element_size()
        free_bytes, _ = torch.cuda.mem_get_info(cfg.device)
        if worst_bytes > 0.8 * free_bytes:
            raise Skipped(
                f"a materialised mask may need {worst_bytes / 2**30:.1f} GiB, "
                f"{free_bytes / 2**30:.1f} GiB free"
            )
    bias = case.make_bias()
    mask = bias.materialize(q.device, shape=(batch, heads, q_len, kv_len), dtype=q.dtype)
    # A 4-D view (leading singleton dims, no copy) lets stock SDPA pick cuDNN, which on
    # torch 2.11 / H100 is ~2.5x faster with a float mask than the memory-efficient kernel
    # it falls back to for a 3-D (H, L, S) mask. The peer gets its best stock route.
    mask = mask[(None,) * (4 - mask.dim())]

    def forward() -> Tensor:
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    note = (
        f"{'default dispatch' if backend is None else 'pinned'} "
        f"({stock_backend_used(forward)}), mask "
        f"{'x'.join(map(str, mask.shape))} {mask.numel() * mask.element_size() / 2**20:.0f} MiB"
    )
    return Prepared(forward, note)


def stock_backend_used(forward: Forward) -> str:
    """Which of stock SDPA's kernels one call runs, read from the profiler's op names."""
    backends = {
        "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
        "aten::_scaled_dot_product_efficient_attention": "efficient",
        "aten::_scaled_dot_product_flash_attention": "flash",
        "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
        "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
        "aten::_scaled_dot_product_attention_math": "math",
    }
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        forward()
    ops = {event.key for event in profile.key_averages()}
    used = [name for op, name in backends.items() if op in ops]
    return "+".join(used) if used else "unknown backend"


CONTENDERS: dict[str, Callable[[Case, Inputs, Config], Prepared]] = {
    "attnbias": prepare_attnbias,
    "flex": prepare_flex,
    "sdpa-flash": prepare_sdpa_flash,
    "sdpa-cudnn": prepare_sdpa_cudnn,
    "sdpa-eff-mask": prepare_sdpa_eff_mask,
    "sdpa-mask": prepare_sdpa_mask,
}


# --------------------------------------------------------------------------- measuring


@dataclass
class Row:
    case: str
    seq_len: int
    batch: int
    contender: str
    fwd_ms: float | None = None
    fwd_tflops: float | None = None
    fwdbwd_ms: float | None = None
    fwdbwd_tflops: float | None = None
    fwd_extra_mib: float | None = None
    fwdbwd_extra_mib: float | None = None
    err_out: float | None = None
    err_grad: float | None = None
    notes: list[str] = field(default_factory=list)
    fwd_ms_rounds: list[float] = field(default_factory=list)
    fwdbwd_ms_rounds: list[float] = field(default_factory=list)


def error_note(stage: str, exc: BaseException) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"error ({stage}): {type(exc).__name__}: {message[:160]}"


def time_ms(fn: Callable[[], Any], inputs: Inputs, cfg: Config) -> float:
    if cfg.device.type == "cuda":
        from triton.testing import do_bench

        return float(
            do_bench(
                fn,
                warmup=cfg.warmup_ms,
                rep=cfg.rep_ms,
                grad_to_none=inputs.leaves(),
                return_mode="median",
            )
        )
    times = []
    for _ in range(cfg.cpu_reps):
        inputs.clear_grads()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def peak_extra_mib(fn: Callable[[], Any], base_bytes: int, cfg: Config) -> float | None:
    """Peak memory of one call above what was allocated before the contender was set up, so
    it counts the contender's own state (mask, block mask), outputs and gradients."""
    if cfg.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base_bytes) / 2**20


def allocated_bytes(cfg: Config) -> int:
    return torch.cuda.memory_allocated() if cfg.device.type == "cuda" else 0


def release(cfg: Config) -> None:
    gc.collect()
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """Max abs difference; a NaN or inf anywhere counts as an infinite error."""
    diff = (actual.detach().to(expected.dtype) - expected).abs()
    return float(diff.nan_to_num(nan=math.inf).max())


def forward_flops(inputs: Inputs, kept: int) -> int:
    """Forward FLOPs counting only attended pairs: 4·B·H·kept·E."""
    batch, heads, _, head_dim = inputs.q.shape
    return 4 * batch * heads * kept * head_dim


def with_backward(forward: Callable[[], Tensor], inputs: Inputs) -> Callable[[], None]:
    def forward_backward() -> None:
        forward().backward(inputs.dout)

    return forward_backward


def set_times(row: Row, fwd_flops: int) -> None:
    """The row's times as the mean over its timing rounds, and the TFLOP/s they give."""
    if row.fwd_ms_rounds:
        row.fwd_ms = statistics.fmean(row.fwd_ms_rounds)
        row.fwd_tflops = fwd_flops / (row.fwd_ms * 1e-3) / 1e12
    if row.fwdbwd_ms_rounds:
        row.fwdbwd_ms = statistics.fmean(row.fwdbwd_ms_rounds)
        row.fwdbwd_tflops = 3.5 * fwd_flops / (row.fwdbwd_ms * 1e-3) / 1e12


def run_contender(
    name: str, case: Case, inputs: Inputs, ref: Reference, kept: int, cfg: Config
) -> Row | None:
    q = inputs.q
    fwd_flops = forward_flops(inputs, kept)
    row = Row(case.name, q.shape[2], q.shape[0], name)
    inputs.clear_grads()
    base = allocated_bytes(cfg)
    try:
        prepared = CONTENDERS[name](case, inputs, cfg)
    except NotApplicable:
        return None
    except Skipped as exc:
        row.notes.append(f"skipped: {exc}")
        return row
    except Exception as exc:
        row.notes.append(error_note("setup", exc))
        release(cfg)
        return row
    if prepared.note:
        row.notes.append(prepared.note)
    forward = prepared.forward
    forward_backward = with_backward(forward, inputs)
    stage = "forward"
    try:
        # The first call also compiles / autotunes, so it doubles as the warm-up.
        row.err_out = max_abs_error(forward(), ref.out)
        row.fwd_ms_rounds.append(time_ms(forward, inputs, cfg))
        set_times(row, fwd_flops)
        row.fwd_extra_mib = peak_extra_mib(forward, base, cfg)
        if not prepared.has_backward:
            return row
        stage = "backward"
        inputs.clear_grads()
        forward_backward()
        grads = [t.grad for t in inputs.leaves()]
        if any(g is None for g in grads):
            raise RuntimeError("backward left a gradient unset")
        row.err_grad = max(max_abs_error(g, r) for g, r in zip(grads, ref.grads, strict=True))
        inputs.clear_grads()
        row.fwdbwd_ms_rounds.append(time_ms(forward_backward, inputs, cfg))
        set_times(row, fwd_flops)
        inputs.clear_grads()
        row.fwdbwd_extra_mib = peak_extra_mib(forward_backward, base, cfg)
    except Exception as exc:
        row.notes.append(error_note(stage, exc))
    finally:
        inputs.clear_grads()
        release(cfg)
    return row


def retime(name: str, case: Case, inputs: Inputs, kept: int, cfg: Config, row: Row) -> None:
    """One more timing round of a contender that ran: set up again (compiled code is
    cached), time, and make the row's times the mean of all rounds."""
    inputs.clear_grads()
    try:
        forward = CONTENDERS[name](case, inputs, cfg).forward
        forward()
        row.fwd_ms_rounds.append(time_ms(forward, inputs, cfg))
        if row.fwdbwd_ms is not None:
            forward_backward = with_backward(forward, inputs)
            inputs.clear_grads()
            forward_backward()
            inputs.clear_grads()
            row.fwdbwd_ms_rounds.append(time_ms(forward_backward, inputs, cfg))
    except Exception as exc:
        row.notes.append(error_note(f"timing round {len(row.fwd_ms_rounds) + 1}", exc))
    finally:
        inputs.clear_grads()
        release(cfg)
    set_times(row, forward_flops(inputs, kept))


@dataclass
class CaseRun:
    case: str
    label: str
    seq_len: int
    batch: int
    kept: int
    density: float
    route: str
    details: str


def explain_route(case: Case, inputs: Inputs) -> str:
    try:
        text = str(attnbias.explain(inputs.q, inputs.k, inputs.v, attn_mask=case.make_bias()))
    except Exception as exc:
        return error_note("explain", exc)
    return " ".join(text.split())


def bench_case(
    name: str, seq_len: int, contenders: Sequence[str], cfg: Config
) -> tuple[CaseRun, list[Row]]:
    case = build_case(name, seq_len, cfg)
    inputs = make_inputs(cfg, seq_len)
    kept = count_kept(case, seq_len, cfg)
    info = CaseRun(
        name,
        case.label,
        seq_len,
        cfg.batch(seq_len),
        kept,
        kept / seq_len**2,
        explain_route(case, inputs),
        case.details,
    )
    print(f"[{name} S={seq_len}] kept {info.density:.3f} of pairs; route: {info.route[:120]}")
    ref = reference(case, inputs, cfg)
    release(cfg)
    rows = []
    for contender in contenders:
        row = run_contender(contender, case, inputs, ref, kept, cfg)
        if row is not None:
            print("   " + format_row_brief(row))
            rows.append(row)
    # The GPU's clock follows its power draw, so a time depends on what ran just before.
    # Later rounds time the contenders again, in reverse order, then in forward order, and
    # so on; each time is the mean over the rounds, so a drift linear in time cancels.
    timed = [row for row in rows if row.fwd_ms is not None]
    for round_index in range(1, cfg.rounds):
        for row in timed[::-1] if round_index % 2 else timed:
            retime(row.contender, case, inputs, kept, cfg, row)
    if cfg.rounds > 1 and timed:
        print(
            "   means over rounds: "
            + "; ".join(
                f"{row.contender} {fmt(row.fwd_ms, 3)} / {fmt(row.fwdbwd_ms, 3)} ms"
                for row in timed
            )
        )
    return info, rows


# --------------------------------------------------------------------------- reporting


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def fmt_err(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def format_row_brief(row: Row) -> str:
    return (
        f"{row.contender:<11} fwd {fmt(row.fwd_ms, 3):>8} ms  f+b {fmt(row.fwdbwd_ms, 3):>8} ms  "
        f"err {fmt_err(row.err_out)}/{fmt_err(row.err_grad)}  {'; '.join(row.notes)}"
    )


def speedup(peer_ms: float | None, attnbias_ms: float | None) -> float | None:
    if peer_ms is None or attnbias_ms is None:
        return None
    return peer_ms / attnbias_ms


def check_verdict(rows: list[Row]) -> str:
    """attnbias passes when its errors are at most twice the best peer's (plus a little)."""
    mine = next((r for r in rows if r.contender == "attnbias"), None)
    if mine is None or mine.err_out is None:
        return "not run"
    peers = [r for r in rows if r.contender != "attnbias" and r.err_out is not None]
    if not peers:
        return "no peer"
    failures = []
    for attr in ("err_out", "err_grad"):
        own = getattr(mine, attr)
        peer_errors = [getattr(r, attr) for r in peers if getattr(r, attr) is not None]
        if own is None or not peer_errors:
            continue
        bound = 2 * min(peer_errors) + 1e-6
        if own > bound:
            failures.append(f"{attr} {own:.1e} > {bound:.1e}")
    return "ok" if not failures else "FAIL: " + ", ".join(failures)


def targets(infos: list[CaseRun], rows: list[Row]) -> list[dict[str, Any]]:
    result = []
    for info in infos:
        case_rows = [r for r in rows if r.case == info.case and r.seq_len == info.seq_len]
        mine = next((r for r in case_rows if r.contender == "attnbias"), None)
        entry: dict[str, Any] = {"case": info.case, "seq_len": info.seq_len}
        verdicts = []
        for peer, need in (
            ("flex", SOFTCAP_FLEX_TARGET if info.case == "softcap" else FLEX_TARGET),
            ("sdpa-eff-mask", MASK_TARGET),
        ):
            other = next((r for r in case_rows if r.contender == peer), None)
            fwd = bwd = None
            if mine is not None and other is not None:
                fwd = speedup(other.fwd_ms, mine.fwd_ms)
                bwd = speedup(other.fwdbwd_ms, mine.fwdbwd_ms)
            entry[peer] = {"need": need, "fwd": fwd, "fwdbwd": bwd}
            if fwd is not None and bwd is not None:
                verdicts.append(min(fwd, bwd) >= need)
        entry["check"] = check_verdict(case_rows)
        met = bool(verdicts) and all(verdicts) and entry["check"] == "ok"
        if mine is not None and mine.fwd_ms is None:
            entry["verdict"] = "missed (attnbias did not run)"
        elif entry["check"].startswith("FAIL"):
            entry["verdict"] = "missed (wrong results)"
        else:
            entry["verdict"] = "met" if met else ("n/a" if not verdicts else "missed")
        result.append(entry)
    return result


def environment(cfg: Config) -> dict[str, str]:
    # ATTNBIAS_COMMIT names the commit of a copied tree, whose .git (if any) may be stale
    commit = os.environ.get("ATTNBIAS_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    pythonpath = os.environ.get("PYTHONPATH")
    command = ("PYTHONPATH=" + pythonpath + " " if pythonpath else "") + shlex.join(
        ["python", *sys.argv]
    )
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "device": torch.cuda.get_device_name(cfg.device) if cfg.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "cudnn": str(cudnn),
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git_commit": commit,
        "command": command,
    }


def markdown_table(rows: list[Row], infos: list[CaseRun], seq_len: int) -> list[str]:
    lines = [
        "| case | contender | fwd ms | fwd TFLOP/s | f+b ms | f+b TFLOP/s | fwd MiB | f+b MiB "
        "| attnbias × fwd | attnbias × f+b | max err out / grad | note |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for info in (i for i in infos if i.seq_len == seq_len):
        case_rows = [r for r in rows if r.case == info.case and r.seq_len == seq_len]
        mine = next((r for r in case_rows if r.contender == "attnbias"), None)
        for row in case_rows:
            fwd_x = speedup(row.fwd_ms, mine.fwd_ms) if mine else None
            bwd_x = speedup(row.fwdbwd_ms, mine.fwdbwd_ms) if mine else None
            cells = [
                info.case,
                row.contender,
                fmt(row.fwd_ms, 3),
                fmt(row.fwd_tflops, 1),
                fmt(row.fwdbwd_ms, 3),
                fmt(row.fwdbwd_tflops, 1),
                fmt(row.fwd_extra_mib, 0),
                fmt(row.fwdbwd_extra_mib, 0),
                fmt(fwd_x),
                fmt(bwd_x),
                f"{fmt_err(row.err_out)} / {fmt_err(row.err_grad)}",
                "; ".join(row.notes).replace("|", "/"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets_table(entries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| case | S | vs flex fwd / f+b | need | vs sdpa-eff-mask fwd / f+b | need | check "
        "| verdict |",
        "|---|--:|--:|--:|--:|--:|---|---|",
    ]
    for e in entries:
        flex, mask = e["flex"], e["sdpa-eff-mask"]
        lines.append(
            f"| {e['case']} | {e['seq_len']} | {fmt(flex['fwd'])} / {fmt(flex['fwdbwd'])} "
            f"| ≥{flex['need']:g}× | {fmt(mask['fwd'])} / {fmt(mask['fwdbwd'])} "
            f"| ≥{mask['need']:g}× | {e['check']} | {e['verdict']} |"
        )
    return lines


def report(
    cfg: Config, env: dict[str, str], infos: list[CaseRun], rows: list[Row], entries: list
) -> str:
    dtype = str(cfg.dtype).removeprefix("torch.")
    lines = [
        "# attnbias benchmarks",
        "",
        f"- device: {env['device']}",
        f"- torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, "
        f"cuDNN {env['cudnn']}, Python {env['python']}",
        f"- date: {env['date']}, commit {env['git_commit']}",
        f"- command: `{env['command']}`",
        f"- mode: {cfg.mode}; {dtype}, H={cfg.num_heads}, E={cfg.head_dim}, "
        f"B·S={cfg.tokens} tokens, self-attention (L = S); inputs random normal "
        f"(queries ×{QUERY_STD:g})",
        "",
        "How to read: times are medians of `triton.testing.do_bench` "
        f"(warmup {cfg.warmup_ms} ms, rep {cfg.rep_ms} ms; compile and autotune excluded), "
        f"averaged over {cfg.rounds} timing round(s) per case that time the contenders in "
        "alternating order (forward, then reverse), because the GPU's clock follows its power "
        "draw and so depends on what ran just before; "
        "fwd is a training forward (inputs require grad), f+b adds the backward of a random "
        "output gradient. TFLOP/s count only attended pairs: fwd = 4·B·H·kept·E, "
        "f+b = 3.5 × fwd. MiB = peak allocated during one call minus what was allocated before "
        "the contender's setup (so it includes its mask or block mask, outputs and "
        "gradients). attnbias × = peer ms / attnbias ms (above 1: attnbias faster). "
        "Errors are max abs differences from an fp32 eager reference on the same inputs.",
        "",
        "Contenders: `attnbias` = `attnbias.sdpa(q, k, v, attn_mask=bias)`; `flex` = "
        "`torch.compile(flex_attention)` with `create_block_mask(mask_mod)` built once and a "
        "`score_mod` for ALiBi / soft-cap; `sdpa-flash`, `sdpa-cudnn` = stock SDPA pinned to "
        "that backend (`is_causal=True` for causal); `sdpa-eff-mask` = stock SDPA's "
        "memory-efficient kernel with `bias.materialize(...)` (the materialised-mask peer of "
        "the targets); `sdpa-mask` = stock SDPA's default dispatch with the same mask viewed "
        "as 4-D, which on recent PyTorch reaches cuDNN (the note names the kernel it ran).",
        "",
        "## Cases",
        "",
        "| case | meaning | S | B | kept pairs per head | density |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for info in infos:
        lines.append(
            f"| {info.case} | {info.label} | {info.seq_len} | {info.batch} | {info.kept} "
            f"| {info.density:.3f} |"
        )
    lines += ["", "Routes taken by `attnbias.sdpa` (`attnbias.explain`) and case details:", ""]
    for info in infos:
        extra = f" ({info.details})" if info.details else ""
        lines.append(f"- {info.case}, S={info.seq_len}: {info.route}{extra}")
    for seq_len in cfg.seq_lens:
        lines += ["", f"## S = {seq_len} (B = {cfg.batch(seq_len)})", ""]
        lines += markdown_table(rows, infos, seq_len)
    lines += [
        "",
        "## Targets",
        "",
        f"attnbias vs FlexAttention ≥{FLEX_TARGET:g}× per case (soft-cap + causal "
        f"≥{SOFTCAP_FLEX_TARGET:g}×), vs a materialised mask on the memory-efficient kernel "
        f"≥{MASK_TARGET:g}×, in both fwd and "
        "f+b, and the correctness check passed (attnbias error ≤ 2 × the best peer's).",
        "",
        *targets_table(entries),
        "",
    ]
    return "\n".join(lines)


def write_outputs(
    out_dir: Path, cfg: Config, env: dict[str, str], infos: list[CaseRun], rows: list[Row]
) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = targets(infos, rows)
    text = report(cfg, env, infos, rows, entries)
    (out_dir / "RESULTS.md").write_text(text)
    results = {
        "environment": env,
        "config": {
            "mode": cfg.mode,
            "dtype": str(cfg.dtype),
            "tokens": cfg.tokens,
            "num_heads": cfg.num_heads,
            "head_dim": cfg.head_dim,
            "seq_lens": list(cfg.seq_lens),
            "warmup_ms": cfg.warmup_ms,
            "rep_ms": cfg.rep_ms,
            "rounds": cfg.rounds,
        },
        "cases": [asdict(i) for i in infos],
        "rows": [asdict(r) for r in rows],
        "targets": entries,
    }
    json_path = out_dir / "results.json"
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    png_path = out_dir / "results.png"
    try:
        # plot.py sits next to this script, which Python puts first on sys.path.
        from plot import plot_results

        plot_results(results, png_path)
        print(f"plot: {png_path}")
    except ImportError as exc:
        print(f"no plot ({exc}); elsewhere run: python benchmarks/plot.py {json_path} {png_path}")
    return text


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="S = 4096 only, fewer reps")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny fp32 shapes, one rep: plumbing check"
    )
    parser.add_argument("--cases", help=f"comma list out of {','.join(CASE_NAMES)}")
    parser.add_argument("--contenders", help=f"comma list out of {','.join(CONTENDER_NAMES)}")
    parser.add_argument(
        "--out",
        type=Path,
        help="directory for RESULTS.md, results.json, results.png "
        "(default: benchmarks/, or a temporary directory with --smoke)",
    )
    return parser.parse_args(argv)


def pick(requested: str | None, known: Sequence[str], what: str) -> list[str]:
    if requested is None:
        return list(known)
    names = [n.strip() for n in requested.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = make_config(args)
    case_names = pick(args.cases, CASE_NAMES, "cases")
    contenders = pick(args.contenders, CONTENDER_NAMES, "contenders")
    if args.out is not None:
        out_dir = args.out
    elif cfg.mode == "smoke":
        out_dir = Path(tempfile.gettempdir()) / "attnbias-bench-smoke"
    else:
        out_dir = Path(__file__).resolve().parent
    # Every case and length compiles FlexAttention anew; the default limit would make later
    # ones fall back to eager.
    dynamo_config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, limit):
            setattr(dynamo_config, limit, max(getattr(dynamo_config, limit), 64))

    if not cfg.compile_flex:
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    env = environment(cfg)
    print(f"{env['device']}; torch {env['torch']}, triton {env['triton']}; mode {cfg.mode}")
    infos, rows = [], []
    for seq_len in cfg.seq_lens:
        for name in case_names:
            info, case_rows = bench_case(name, seq_len, contenders, cfg)
            infos.append(info)
            rows += case_rows
    text = write_outputs(out_dir, cfg, env, infos, rows)
    # The tables and targets, the part of the run that gets read.
    print("\n" + text[text.index("## S = ") :])
    print(f"written: {out_dir / 'RESULTS.md'}, {out_dir / 'results.json'}")


if __name__ == "__main__":
    main()

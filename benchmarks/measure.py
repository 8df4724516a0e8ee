"""Measuring one case: the correctness check of every contender, its times over alternating
rounds and its peak memory."""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import attnbias

# isort: split
# Siblings, found through the folder of bench.py on sys.path.
from cases import (
    Case,
    Config,
    Inputs,
    Reference,
    build_case,
    count_kept,
    forward_flops,
    make_inputs,
    reference,
)
from contenders import CONTENDERS, NotApplicable, Skipped, describe


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


@dataclass
class CaseRun:
    case: str
    label: str
    seq_len: int
    batch: int
    kept: int
    density: float
    backend: str | None  # the route's name, the first word of `route`; None: explain failed
    route: str
    details: str


def fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def fmt_err(value: float | None) -> str:
    return "—" if value is None else f"{value:.1e}"


def format_row_brief(row: Row) -> str:
    return (
        f"{row.contender:<11} fwd {fmt(row.fwd_ms, 3):>8} ms  f+b {fmt(row.fwdbwd_ms, 3):>8} ms  "
        f"err {fmt_err(row.err_out)}/{fmt_err(row.err_grad)}  {'; '.join(row.notes)}"
    )


def error_note(stage: str, exc: BaseException) -> str:
    return f"error ({stage}): {describe(exc)}"


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


def host_us(fn: Callable[[], Any], calls: int = 500, rounds: int = 5, warmup: int = 20) -> float:
    """Host time of one call, µs: the median over ``rounds`` of ``calls`` calls issued
    without waiting for the GPU, so where the GPU keeps up each costs what the host spends on
    it (without a GPU: the time of a call)."""
    return host_us_interleaved({"fn": fn}, calls=calls, rounds=rounds, warmup=warmup)["fn"]


def host_us_interleaved(
    fns: dict[str, Callable[[], Any]], calls: int = 300, rounds: int = 15, warmup: int = 50
) -> dict[str, float]:
    """Host time of one call of each of ``fns``, µs, as :func:`host_us` measures it, with the
    rounds of the functions interleaved (a round of each, then again), so that a host whose
    speed drifts during the run weighs on all of them alike; the median round of each."""

    def settle() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            settle()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    settle()
    return {name: statistics.median(values) for name, values in times.items()}


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


def explain_route(case: Case, inputs: Inputs) -> tuple[str | None, str]:
    """The route `attnbias.sdpa` takes: its name (the text before the first ':' of
    `attnbias.explain`'s first line) and the whole explanation on one line."""
    try:
        text = str(attnbias.explain(inputs.q, inputs.k, inputs.v, attn_mask=case.make_bias()))
    except Exception as exc:
        return None, error_note("explain", exc)
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    return first_line.split(":", 1)[0].strip(), " ".join(text.split())


def bench_case(
    name: str, seq_len: int, contenders: Sequence[str], cfg: Config
) -> tuple[CaseRun, list[Row]]:
    case = build_case(name, seq_len, cfg)
    inputs = make_inputs(cfg, seq_len)
    kept = count_kept(case, seq_len, cfg)
    backend, route = explain_route(case, inputs)
    info = CaseRun(
        name,
        case.label,
        seq_len,
        cfg.batch(seq_len),
        kept,
        kept / seq_len**2,
        backend,
        route,
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

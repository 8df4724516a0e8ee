"""The report: per-contender tables, the targets and their verdicts, RESULTS.md, results.json and
the plot."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

# isort: split
# Siblings, found through the folder of bench.py on sys.path.
from cases import CASE_NAMES, QUERY_STD, Config
from measure import CaseRun, Row, fmt, fmt_err

# The benchmarks with harnesses of their own, named at the end of RESULTS.md.
OTHER_RESULTS = (
    "## Other results",
    "",
    "- Custom biases (`ModBias`: prefix-LM, chunked local, 2-D neighbourhood, T5 table, a "
    "window as `mask_mod`) against FlexAttention, with peak memory and first-call times: "
    "`benchmarks/MOD_RESULTS.md` (`benchmarks/mod_bench.py`).",
    "- Short queries against long caches: `benchmarks/DECODE_RESULTS.md` "
    "(`benchmarks/decode_bench.py`).",
    "- Hugging Face models: `benchmarks/TRANSFORMERS_RESULTS.md` "
    "(`benchmarks/transformers_bench.py`).",
    "- Context parallelism on several GPUs, against one GPU and PyTorch's context_parallel: "
    "`benchmarks/CP_RESULTS.md` (`benchmarks/cp_bench.py`).",
    "",
)

FLEX_TARGET = 1.0
SOFTCAP_FLEX_TARGET = 1.5
MASK_TARGET = 5.0
PEER_TARGET = 1.0
FLEX_FLASH_TARGET = 1.0
BEST_PEER = "best_peer"
# Per peer, the cases on which attnbias must reach the speed-up (peer ms / attnbias ms) in
# fwd and in f+b. BEST_PEER stands for the fastest other contender that passed the check.
TARGETS: dict[str, dict[str, float]] = {
    BEST_PEER: dict.fromkeys(("causal", "window", "documents", "softcap"), PEER_TARGET),
    "flex": {**dict.fromkeys(CASE_NAMES, FLEX_TARGET), "softcap": SOFTCAP_FLEX_TARGET},
    # FlashAttention 4 has no ALiBi argument, so its kernels reach ALiBi only through
    # FlexAttention's FLASH backend, with the ALiBi score_mod.
    "flex-flash": {"alibi": FLEX_FLASH_TARGET},
    "sdpa-eff-mask": dict.fromkeys(CASE_NAMES, MASK_TARGET),
}
ERRORS = ("err_out", "err_grad")


def speedup(peer_ms: float | None, attnbias_ms: float | None) -> float | None:
    if peer_ms is None or attnbias_ms is None:
        return None
    return peer_ms / attnbias_ms


def error_excess(row: Row, others: list[Row]) -> list[str]:
    """Those of the row's errors above twice the smallest of their kind among `others` (plus a
    little): every exact kernel shares the rounding of bf16 inputs and outputs, while a wrong
    mask or a missing score term gives errors far above it."""
    failures = []
    for attr in ERRORS:
        own = getattr(row, attr)
        errors = [getattr(r, attr) for r in others if getattr(r, attr) is not None]
        if own is None or not errors:
            continue
        bound = 2 * min(errors) + 1e-6
        if own > bound:
            failures.append(f"{attr} {own:.1e} > {bound:.1e}")
    return failures


def is_peer(contender: str) -> bool:
    """Peers are the other libraries; attnbias pinned to one backend is a diagnostic row."""
    return not contender.startswith("attnbias")


def check_verdict(rows: list[Row]) -> str:
    """attnbias passes when its errors are at most twice the best peer's (plus a little)."""
    mine = next((r for r in rows if r.contender == "attnbias"), None)
    if mine is None or mine.err_out is None:
        return "not run"
    peers = [r for r in rows if is_peer(r.contender) and r.err_out is not None]
    if not peers:
        return "no peer"
    failures = error_excess(mine, peers)
    return "ok" if not failures else "FAIL: " + ", ".join(failures)


def passed_check(row: Row, case_rows: list[Row]) -> bool:
    """A contender passes when it was checked, its errors are finite and none is above twice
    the smallest of its kind among the case's contenders (plus a little)."""
    errors = [getattr(row, attr) for attr in ERRORS if getattr(row, attr) is not None]
    if row.err_out is None or not all(math.isfinite(e) for e in errors):
        return False
    return not error_excess(row, [r for r in case_rows if r.err_out is not None])


def fastest_peer(case_rows: list[Row], attr: str) -> Row | None:
    """The contender other than attnbias with the least `attr` ("fwd_ms" or "fwdbwd_ms")
    among those that ran and passed the check."""
    peers = [
        r
        for r in case_rows
        if is_peer(r.contender) and getattr(r, attr) is not None and passed_check(r, case_rows)
    ]
    return min(peers, key=lambda r: getattr(r, attr), default=None)


def compare(mine: Row | None, case_rows: list[Row], peer: str) -> dict[str, Any]:
    """attnbias's speed-up over `peer` in fwd and f+b; for BEST_PEER also the peer's names."""
    result: dict[str, Any] = {}
    for mode, attr in (("fwd", "fwd_ms"), ("fwdbwd", "fwdbwd_ms")):
        if peer == BEST_PEER:
            other = fastest_peer(case_rows, attr)
            result[f"{mode}_peer"] = other.contender if other is not None else None
        else:
            other = next((r for r in case_rows if r.contender == peer), None)
        result[mode] = None
        if mine is not None and other is not None:
            result[mode] = speedup(getattr(other, attr), getattr(mine, attr))
    return result


def targets(infos: list[CaseRun], rows: list[Row]) -> list[dict[str, Any]]:
    result = []
    for info in infos:
        case_rows = [r for r in rows if r.case == info.case and r.seq_len == info.seq_len]
        mine = next((r for r in case_rows if r.contender == "attnbias"), None)
        entry: dict[str, Any] = {
            "case": info.case,
            "seq_len": info.seq_len,
            "backend": info.backend,
            "fwd_ms": mine.fwd_ms if mine is not None else None,
            "fwdbwd_ms": mine.fwdbwd_ms if mine is not None else None,
        }
        verdicts = []
        for peer, needs in TARGETS.items():
            need = needs.get(info.case)
            comparison = compare(mine, case_rows, peer)
            entry[peer] = {"need": need, **comparison}
            fwd, bwd = comparison["fwd"], comparison["fwdbwd"]
            if need is not None and fwd is not None and bwd is not None:
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
    try:
        fa4_version = importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        fa4_version = "absent"
    return {
        "device": torch.cuda.get_device_name(cfg.device) if cfg.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "cudnn": str(cudnn),
        "flash-attn-4": fa4_version,
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


def fmt_need(need: float | None) -> str:
    return "—" if need is None else f"≥{need:g}×"


def targets_text() -> list[str]:
    """One line per peer of TARGETS: the speed-ups attnbias needs, and on which cases."""
    lines = []
    for peer, needs in TARGETS.items():
        by_need: dict[float, list[str]] = {}
        for case, need in needs.items():
            by_need.setdefault(need, []).append(case)
        name = "the best peer" if peer == BEST_PEER else f"`{peer}`"
        parts = [
            f"≥{need:g}× on {'every case' if cases == list(CASE_NAMES) else ', '.join(cases)}"
            for need, cases in by_need.items()
        ]
        lines.append(f"- vs {name}: {'; '.join(parts)}")
    return lines


def targets_table(entries: list[dict[str, Any]]) -> list[str]:
    named = [peer for peer in TARGETS if peer != BEST_PEER]
    lines = [
        "| case | S | route | fwd ms | f+b ms | best peer fwd | best peer f+b | need | "
        + "".join(f"vs {peer} fwd / f+b | need | " for peer in named)
        + "check | verdict |",
        "|---|--:|---|--:|--:|---|---|--:|" + "--:|--:|" * len(named) + "---|---|",
    ]
    for e in entries:
        best = e[BEST_PEER]
        cells = [
            e["case"],
            str(e["seq_len"]),
            e["backend"] or "—",
            fmt(e["fwd_ms"], 3),
            fmt(e["fwdbwd_ms"], 3),
            *(
                "—" if best[mode] is None else f"{best[f'{mode}_peer']} {fmt(best[mode])}×"
                for mode in ("fwd", "fwdbwd")
            ),
            fmt_need(best["need"]),
        ]
        for peer in named:
            cells += [
                f"{fmt(e[peer]['fwd'])} / {fmt(e[peer]['fwdbwd'])}",
                fmt_need(e[peer]["need"]),
            ]
        cells += [e["check"], e["verdict"]]
        lines.append("| " + " | ".join(cells) + " |")
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
        f"cuDNN {env['cudnn']}, flash-attn-4 {env['flash-attn-4']}, Python {env['python']}",
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
        "Errors are max abs differences from an fp32 eager reference on the same inputs. "
        "The best peer is, for fwd and for f+b separately, the fastest contender other than "
        "attnbias that passed the check: finite errors, none above twice the smallest of its "
        "kind among the case's contenders.",
        "",
        "Contenders: `attnbias` = `attnbias.sdpa(q, k, v, attn_mask=bias)`; `flex` = "
        "`torch.compile(flex_attention)` with `create_block_mask(mask_mod)` built once and a "
        "`score_mod` for ALiBi / soft-cap; `flex-flash` = the same compiled with "
        '`kernel_options={"BACKEND": "FLASH"}` (FlashAttention 4\'s CuTe kernels behind '
        "FlexAttention); `fa4` = FlashAttention 4 called directly, `flash_attn.cute."
        "flash_attn_func` on (B, S, H, E) views with `causal`, `window_size` or `softcap`, "
        "`flash_attn_varlen_func` over the documents of all rows for documents, no ALiBi "
        "argument; `sdpa-flash`, `sdpa-cudnn` = stock SDPA pinned to "
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
        "attnbias's speed-up (peer ms / attnbias ms), needed in both fwd and f+b:",
        "",
        *targets_text(),
        "",
        "and the correctness check passed (attnbias errors ≤ 2 × the smallest peer's). A target "
        "whose peer has no fwd or no f+b time here (— in the table) does not count. route = "
        "the route `attnbias.sdpa` took; fwd ms, f+b ms are attnbias's.",
        "",
        *targets_table(entries),
        "",
        *OTHER_RESULTS,
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
        # plot.py sits next to bench.py, whose folder Python puts first on sys.path.
        from plot import plot_results

        plot_results(results, png_path)
        print(f"plot: {png_path}")
    except ImportError as exc:
        print(f"no plot ({exc}); elsewhere run: python benchmarks/plot.py {json_path} {png_path}")
    return text

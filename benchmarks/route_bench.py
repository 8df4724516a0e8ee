"""The automatic route against the best backend pinned, over a grid of calls off the main
benchmark's grid.

For each case (head dim, batch, lengths, layout, GQA, dtype, bias, forward or forward +
backward) it times ``attnbias.sdpa`` as it routes the call (after the call that lets routing by
measurement decide) and under ``use_backends(name)`` for every backend that can take it, in two
rounds of alternating order; the best pinned backend runs twice, as a control row whose spread
is the noise band. It prints auto ÷ best per case, and the distribution.

    python benchmarks/route_bench.py --out route.json            # the whole grid (GPU)
    python benchmarks/route_bench.py --routing policy --out p.json  # the static policy alone
    python benchmarks/route_bench.py --smoke                      # a few cases, any device
    python benchmarks/route_bench.py --report a.json b.json       # the table of saved runs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import attnbias
from attnbias import (
    AlibiBias,
    DocumentBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    routing,
    use_backends,
)

BACKENDS = ("fa4", "triton-decode", "triton", "gluon", "sdpa", "sdpa+mask")


@dataclass
class Case:
    name: str
    batch: int
    heads_q: int
    heads_kv: int
    length_q: int
    length_kv: int
    head_dim: int
    dtype: str
    layout: str  # "bhse" or "bshe"
    bias: str
    grad: bool


@dataclass
class Result:
    case: Case
    route: str = ""
    policy_route: str = ""  # the static policy's choice (routing "policy")
    measuring_call_s: float | None = None  # the call that measured, as the user waited
    warm_up_s: float | None = None  # its untimed first calls of each candidate (compiles)
    timing_s: float | None = None  # its timing, the rest
    auto_ms: float | None = None
    pinned_ms: dict[str, float] = field(default_factory=dict)
    control_spread: float | None = None  # the best backend's two runs, larger / smaller
    ratio: float | None = None
    policy_ratio: float | None = None  # the policy's backend pinned ÷ the best pinned
    error: str = ""


def _prefix_lm(prefix: int) -> ModBias:
    return ModBias(mask_mod=lambda b, h, q, kv: (kv <= q) | (kv < prefix))


def _tanh_cap(score: Any, b: Any, h: Any, q: Any, kv: Any) -> Any:
    return 30.0 * torch.tanh(score / 30.0)


def make_bias(name: str, case: Case) -> Any:
    """The bias ``name`` for ``case``'s lengths."""
    length = case.length_kv
    biases: dict[str, Callable[[], Any]] = {
        "causal": causal_lower_right,
        "window": lambda: causal_lower_right() + SlidingWindowBias(min(255, length - 1)),
        "window+alibi": lambda: (
            causal_lower_right() + SlidingWindowBias(min(511, length - 1)) + AlibiBias(case.heads_q)
        ),
        "alibi": lambda: causal_lower_right() + AlibiBias(case.heads_q),
        "softcap": lambda: causal_lower_right() + SoftcapBias(30.0),
        "documents": lambda: _documents_bias(case) + causal_lower_right(),
        "prefix-lm": lambda: _prefix_lm(max(1, length // 8)),
        "score-mod": lambda: ModBias(score_mod=_tanh_cap) + causal_lower_right(),
    }
    return biases[name]()


def _documents_bias(case: Case) -> DocumentBias:
    """Packed documents over the keys; the queries are the last ``L`` positions (a chunk)."""
    whole = DocumentBias.from_seqlens(_documents(case.length_kv))
    if case.length_q == case.length_kv:
        return whole
    ids = whole.q_doc_ids
    return DocumentBias(ids[-case.length_q :].clone(), ids)


def _documents(length: int) -> list[int]:
    generator = random.Random(length)
    left, out = length, []
    while left > 0:
        size = min(left, generator.randint(max(1, length // 8), max(2, length // 2)))
        out.append(size)
        left -= size
    return out


def grid(smoke: bool = False) -> Iterator[Case]:
    """At least 150 cases: head dims 64/128/256, B 1-64, S 256-32k, prefill chunks (L < S)
    and decode, both layouts, GQA, fp16/bf16, the built-ins, sums, ModBias masks and score
    functions, forward and forward + backward."""
    shapes = [  # (B, Hq, Hkv, L, S, E)
        (64, 12, 12, 512, 512, 64), (8, 12, 12, 1024, 1024, 64), (4, 16, 4, 2048, 2048, 128),
        (1, 16, 16, 8192, 8192, 128), (2, 16, 8, 4096, 4096, 128), (4, 8, 8, 2048, 2048, 256),
        (1, 32, 8, 32768, 32768, 128), (16, 16, 16, 256, 256, 64), (2, 16, 4, 512, 4096, 128),
        (8, 32, 8, 1, 8192, 128), (32, 32, 8, 1, 2048, 128), (1, 16, 16, 16384, 16384, 64),
    ]  # fmt: skip
    biases = ["causal", "window", "window+alibi", "alibi", "softcap", "documents",
              "prefix-lm", "score-mod"]  # fmt: skip
    count = 0
    for (b, hq, hkv, lq, lkv, e), bias in itertools.product(shapes, biases):
        decode = lq == 1
        for grad, dtype, layout in (
            (False, "bfloat16", "bhse"),
            (not decode, "float16" if e == 256 else "bfloat16", "bshe"),
        ):
            if decode and bias in ("documents",):
                continue
            case = Case(
                f"B{b} H{hq}/{hkv} L{lq} S{lkv} E{e} {dtype} {layout} {bias} "
                f"{'f+b' if grad else 'fwd'}",
                b, hq, hkv, lq, lkv, e, dtype, layout, bias, grad,
            )  # fmt: skip
            count += 1
            yield case
            if smoke and count >= 4:
                return


def _inputs(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    dtype = getattr(torch, case.dtype) if device == "cuda" else torch.float32

    def one(heads: int, length: int) -> torch.Tensor:
        if case.layout == "bshe":
            t = torch.randn(case.batch, length, heads, case.head_dim, device=device, dtype=dtype)
            t = t.transpose(1, 2)
        else:
            t = torch.randn(case.batch, heads, length, case.head_dim, device=device, dtype=dtype)
        return t.requires_grad_(case.grad)

    return (
        one(case.heads_q, case.length_q),
        one(case.heads_kv, case.length_kv),
        one(case.heads_kv, case.length_kv),
    )


def _step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any, grad: bool
) -> Callable[[], None]:
    gqa = q.shape[1] != k.shape[1]
    grad_out = torch.ones_like(q) if grad else None

    def run() -> None:
        out = attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=gqa)
        if grad_out is not None:
            out.backward(grad_out)
            for t in (q, k, v):
                t.grad = None

    if not grad:

        def forward() -> None:
            with torch.no_grad():
                run()

        return forward
    return run


def _seconds_per_call(step: Callable[[], None], device: str, calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``step`` back to back, synchronised before and
    after (once: as a model's loop runs them)."""
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) / calls


def _calls(step: Callable[[], None], device: str) -> int:
    """How many calls back to back fill ~2 ms (at most 20): one count for every contender of
    a case, so that each is timed alike (one call per synchronisation serialises the host's
    work and the GPU's, several overlap them)."""
    fastest = min(_seconds_per_call(step, device, 1) for _ in range(3))
    return max(1, min(20, int(2e-3 / max(fastest, 1e-6))))


def _time(step: Callable[[], None], device: str, repeats: int, calls: int) -> float:
    """Milliseconds per call: the median of ``repeats`` timings of ``calls`` calls back to
    back."""
    step()
    return 1e3 * statistics.median(_seconds_per_call(step, device, calls) for _ in range(repeats))


def bench(case: Case, device: str, repeats: int) -> Result:
    result = Result(case)
    q, k, v = _inputs(case, device)
    bias = make_bias(case.bias, case)
    auto = _step(q, k, v, bias, case.grad)
    gqa = q.shape[1] != k.shape[1]
    try:
        mode = routing.routing_mode()
        routing.set_routing("policy")
        result.policy_route = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=gqa)
        result.policy_route = result.policy_route.split(":")[0].split("(")[0]
        routing.set_routing(mode)
        auto()
        if device == "cuda":
            torch.cuda.synchronize()
        routing.LAST_COST.clear()
        began = time.perf_counter()
        auto()  # the second call of a class measures and decides
        if device == "cuda":
            torch.cuda.synchronize()
        result.measuring_call_s = time.perf_counter() - began
        result.warm_up_s = routing.LAST_COST.get("warm_up_s")
        result.timing_s = routing.LAST_COST.get("timing_s")
        result.route = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=gqa)
        result.route = result.route.split(":")[0].split("(")[0]
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    usable = []
    for name in BACKENDS:
        try:
            with use_backends(name):
                auto()
            usable.append(name)
        except Exception:
            continue
    calls = _calls(auto, device)
    rounds: dict[str, list[float]] = {"auto": []}
    for name in usable:
        rounds[name] = []
    for order in (1, -1):  # two rounds, alternating order
        for name in list(rounds)[::order]:
            if name == "auto":
                rounds[name].append(_time(auto, device, repeats, calls))
            else:
                with use_backends(name):
                    rounds[name].append(_time(auto, device, repeats, calls))
    result.auto_ms = min(rounds.pop("auto"))
    result.pinned_ms = {name: min(found) for name, found in rounds.items()}
    if result.pinned_ms:
        best = min(result.pinned_ms, key=result.pinned_ms.__getitem__)
        with use_backends(best):  # the control row: the best backend once more
            again = _time(auto, device, repeats, calls)
        first = result.pinned_ms[best]
        result.control_spread = max(first, again) / min(first, again)
        result.ratio = result.auto_ms / min(first, again)
        if result.policy_route in result.pinned_ms:
            result.policy_ratio = result.pinned_ms[result.policy_route] / min(first, again)
    return result


def summary(results: list[Result]) -> None:
    """The distribution of auto ÷ best pinned, and of the static policy's choice ÷ best."""
    for label, ratios in (
        ("auto (measured)", sorted(r.ratio for r in results if r.ratio is not None)),
        ("policy", sorted(r.policy_ratio for r in results if r.policy_ratio is not None)),
    ):
        if not ratios:
            continue
        print(
            f"{label}: {len(ratios)} cases, ÷ best pinned median "
            f"{statistics.median(ratios):.3f}, worst {ratios[-1]:.2f}; within 1.05x: "
            f"{sum(r <= 1.05 for r in ratios) / len(ratios):.0%}, within 1.15x: "
            f"{sum(r <= 1.15 for r in ratios) / len(ratios):.0%}"
        )
    costs = sorted(r.timing_s for r in results if r.timing_s is not None)
    if costs:
        print(
            f"measuring (timing, compiles apart): median {statistics.median(costs):.3f} s, "
            f"worst {costs[-1]:.3f} s over {len(costs)} classes"
        )


def report(paths: list[str]) -> str:
    """A markdown table of saved runs (``--out`` files of one setting, e.g. the shards of one
    run): for the automatic route and for the static policy's choice, auto (or policy) ÷ the
    best pinned backend over the cases, within 5% and 15% plainly and beyond the noise band
    (a case counts as within where its ratio is inside the control row's spread); then the
    cost of measuring, and the cases beyond the noise."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as handle:
            rows += json.load(handle)
    timed = [r for r in rows if r["ratio"] is not None]
    lines = [
        f"{len(rows)} cases, {len(timed)} timed"
        + (
            f"; failed: {', '.join(r['case']['name'] for r in rows if r['error'])}"
            if any(r["error"] for r in rows)
            else ""
        ),
        "",
        "| route | median | worst | <= 1.05x | <= 1.15x | <= 1.05x beyond noise | "
        "<= 1.15x beyond noise |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for label, key in (("automatic (measured)", "ratio"), ("static policy", "policy_ratio")):
        found = [r for r in timed if r[key] is not None]
        if not found:
            continue
        ratios = sorted(r[key] for r in found)

        def share(
            limit: float, noise: bool, found: list[dict[str, Any]] = found, key: str = key
        ) -> str:
            hits = sum(
                r[key] <= (max(limit, r["control_spread"]) if noise else limit) for r in found
            )
            return f"{hits / len(found):.0%}"

        lines.append(
            f"| {label} | {statistics.median(ratios):.3f} | {ratios[-1]:.2f} | "
            f"{share(1.05, False)} | {share(1.15, False)} | {share(1.05, True)} | "
            f"{share(1.15, True)} |"
        )
    spreads = sorted(r["control_spread"] for r in timed)
    costs = sorted(r["timing_s"] for r in timed if r["timing_s"])
    warm = sorted(r["warm_up_s"] for r in timed if r["warm_up_s"])
    lines.append("")
    lines.append(
        f"Control rows (the best backend timed again): spread median "
        f"{statistics.median(spreads):.3f}, largest {spreads[-1]:.2f}."
    )
    if costs:
        lines.append(
            f"Measuring, over the {len(costs)} calls that measured: timing median "
            f"{statistics.median(costs):.3f} s, largest {costs[-1]:.3f} s; the untimed first "
            f"calls (compiling included) median {statistics.median(warm):.3f} s, largest "
            f"{warm[-1]:.2f} s."
        )
    lines.append("")
    lines.append("Beyond the noise band (ratio > max(1.05, control spread)):")
    for r in timed:
        if r["ratio"] > max(1.05, r["control_spread"]):
            best = min(r["pinned_ms"], key=r["pinned_ms"].get)
            lines.append(
                f"- {r['case']['name']}: auto {r['route']} {r['auto_ms']:.3f} ms, best {best} "
                f"{r['pinned_ms'][best]:.3f} ms ({r['ratio']:.2f}x, control "
                f"{r['control_spread']:.2f})"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--routing", choices=routing.MODES, default="measure")
    parser.add_argument("--out", default="")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="a few cases, small, any device")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th case from the i-th")
    parser.add_argument("--resume", default="", help="a JSON of results: its cases are kept")
    parser.add_argument("--report", nargs="+", default=[], help="saved runs: print their table")
    args = parser.parse_args()
    if args.report:
        print(report(args.report))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("ATTNBIAS_ROUTING_CACHE", "off")  # measure afresh in this run
    routing.set_routing(args.routing)
    results: list[Result] = []
    done: list[dict[str, Any]] = []
    if args.resume and os.path.exists(args.resume):
        with open(args.resume) as handle:
            done = json.load(handle)
    names = {row["case"]["name"] for row in done}
    index, count = (int(part) for part in args.shard.split("/"))
    for number, case in enumerate(grid(args.smoke)):
        if number % count != index or case.name in names:
            continue
        if args.smoke or device == "cpu":
            scale = max(1, case.length_kv // 128)
            case.length_kv = max(1, case.length_kv // scale)
            case.length_q = max(1, case.length_q // scale)
            case.batch = min(case.batch, 2)
        result = bench(case, device, args.repeats)
        results.append(result)
        ratio = "-" if result.ratio is None else f"{result.ratio:.2f}"
        print(
            f"{case.name}: {result.route} (policy {result.policy_route}) auto {result.auto_ms} "
            f"ratio {ratio} {result.error}",
            flush=True,
        )
        if args.out:  # after each case: a run stopped midway keeps what it measured
            with open(args.out, "w") as handle:
                json.dump(done + [asdict(r) for r in results], handle, indent=1)
    summary(results)


if __name__ == "__main__":
    main()

"""Routing by measurement (``attnbias.routing``), on the CPU.

The call class keeps apart what decides speed (layouts, strides, head dims, dtype, GQA ratio,
gradients) and nothing else; decisions are measured on the second sighting of a class, kept
past a margin only, read back from the cache file by another process (or after this one
forgot them), never measured while compiling or capturing; the file survives corruption,
stale versions and concurrent writers; and measuring leaves no trace in the user's state
(gradients of the inputs and of the bias's tensors, the random number generator). Measuring
itself needs a CUDA device: here ``routed`` and ``can_measure`` are switched on for the CPU
and, where the decision is what is tested, the timings are given.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import attnbias
from attnbias import AlibiBias, SlidingWindowBias, causal_lower_right, routing
from attnbias.planner import plan
from attnbias.spec import make_spec


def _spec(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any = None, gqa: bool = False
) -> Any:
    bias = causal_lower_right() + SlidingWindowBias(7) if bias is None else bias
    return make_spec(q, k, v, bias, False, None, 0.0, gqa)


def _qkv(b: int = 2, h: int = 4, length: int = 32, e: int = 16, **kw: Any) -> list[torch.Tensor]:
    return [torch.randn(b, h, length, e, **kw) for _ in range(3)]


@pytest.fixture
def measuring(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Routing by measurement on, for the CPU, with a cache file of its own."""
    path = tmp_path / "routing.json"
    monkeypatch.setenv("ATTNBIAS_ROUTING_CACHE", str(path))
    monkeypatch.setattr(routing, "routed", lambda spec: True)
    monkeypatch.setattr(routing, "can_measure", routing.measurable)
    routing.clear_routing(file=False)
    routing.set_routing("measure")
    yield path
    routing.set_routing("policy")
    routing.clear_routing(file=False)


def _counted_measure(monkeypatch: pytest.MonkeyPatch, *, reference_s: float) -> list[int]:
    """``routing.measure`` replaced by timings given here (the exact path ``reference_s``
    seconds, every other candidate 2); returns the list its calls append to."""
    calls: list[int] = []

    def fake(spec: Any, candidates: list[str]) -> dict[str, float]:
        calls.append(1)
        return {name: (reference_s if name == "reference" else 2.0) for name in candidates}

    monkeypatch.setattr(routing, "measure", fake)
    return calls


def test_the_call_class_keeps_apart_what_decides_speed() -> None:
    q, k, v = _qkv()
    base = routing.call_class(_spec(q, k, v))
    # the same class: other values, the same shape
    assert routing.call_class(_spec(*_qkv())) == base
    assert routing.call_class(_spec(*_qkv(length=30))) == base  # L and S in powers of two
    others = {
        "layout (B, S, H, E)": _spec(
            *[torch.randn(2, 32, 4, 16).transpose(1, 2) for _ in range(3)]
        ),
        "strided views": _spec(*[torch.randn(2, 4, 32, 32)[..., :16] for _ in range(3)]),
        "head dim": _spec(*_qkv(e=32)),
        "dtype": _spec(*_qkv(dtype=torch.float64)),
        "GQA": _spec(q, k[:, :2], v[:, :2], gqa=True),
        "gradients": _spec(*[t.clone().requires_grad_() for t in (q, k, v)]),
        "length": _spec(*_qkv(length=64)),
        "batch x heads": _spec(*_qkv(b=8)),
        "window": _spec(q, k, v, causal_lower_right() + SlidingWindowBias(20)),
        "soft-cap": _spec(q, k, v, causal_lower_right() + attnbias.SoftcapBias(5.0)),
    }
    keys = {name: routing.call_class(spec) for name, spec in others.items()}
    for name, key in keys.items():
        assert key != base, f"{name} merged with the base class"
    assert len(set(keys.values())) == len(keys)


def test_a_class_is_measured_when_met_again_and_the_fastest_kept(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measured: list[list[str]] = []

    def fake(spec: Any, candidates: list[str]) -> dict[str, float]:
        measured.append(list(candidates))
        return {name: (1.0 if name == "reference" else 3.0) for name in candidates}

    monkeypatch.setattr(routing, "measure", fake)
    spec = _spec(*_qkv())
    first = routing.decide(plan(spec))
    assert first.provisional and not measured  # met once: the policy, not kept
    assert first.backend.name == plan(spec).backend.name
    second = routing.decide(plan(spec))
    assert second.backend.name == "reference" and not second.provisional
    assert len(measured) == 1 and "reference" in measured[0] and len(measured[0]) >= 2
    assert second.decision.startswith("measured now: reference 1000.000 ms")
    # kept: not measured again, in this process or from the file in another
    assert routing.decide(plan(spec)).backend.name == "reference"
    routing.clear_routing(file=False)
    third = routing.decide(plan(spec))
    assert third.backend.name == "reference" and third.decision.startswith("measured earlier")
    assert len(measured) == 1
    stored = json.loads(measuring.read_text())["decisions"]
    assert list(stored.values()) == [
        {"backend": "reference", "times_ms": {name: fake(spec, measured[0])[name] * 1e3
                                              for name in measured[0]}}
    ]  # fmt: skip


def test_the_planners_choice_stays_within_the_margin(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(*_qkv())
    policy = plan(spec).backend.name

    def fake(spec: Any, candidates: list[str]) -> dict[str, float]:
        # another backend 4% faster: within the margin, the policy's stays
        return {name: (1.0 if name == policy else 0.96) for name in candidates}

    monkeypatch.setattr(routing, "measure", fake)
    routing.decide(plan(spec))
    assert routing.decide(plan(spec)).backend.name == policy


def test_no_measuring_while_compiling_but_the_kept_decision_is_used(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counted_measure(monkeypatch, reference_s=1.0)
    spec = _spec(*_qkv())
    traced = dataclasses.replace(spec, compiling=True)
    for _ in range(3):
        assert routing.decide(plan(traced)).backend.name == plan(traced).backend.name
    assert not calls
    routing.decide(plan(spec))
    routing.decide(plan(spec))  # measured here
    assert calls == [1]
    assert plan(traced).backend.name != "reference"
    assert routing.decide(plan(traced)).backend.name == "reference"
    # and through torch.compile itself, the whole graph traced
    torch._dynamo.reset()
    q, k, v = _qkv()
    bias = causal_lower_right() + SlidingWindowBias(7)
    compiled = torch.compile(
        lambda q, k, v: attnbias.sdpa(q, k, v, attn_mask=bias), backend="eager", fullgraph=True
    )
    with attnbias.use_backends(exclude=["triton"]):  # (not traceable on the interpreter)
        out = compiled(q, k, v)
    torch.testing.assert_close(out, attnbias.sdpa(q, k, v, attn_mask=bias))
    assert calls == [1]
    routing.set_routing("policy")  # switched off: no measuring, the kept decision still used
    other = _spec(*_qkv(e=32))
    for _ in range(3):
        assert not routing.decide(plan(other)).provisional
    assert routing.decide(plan(spec)).backend.name == "reference"
    assert calls == [1]


def test_a_corrupt_or_stale_file_is_ignored_and_written_anew(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        routing, "measure", lambda spec, names: {n: float(i + 1) for i, n in enumerate(names)}
    )
    spec = _spec(*_qkv())
    key = routing.call_class(spec)
    stale = key.rsplit(" | ", 1)[0] + " | torch 0.0"
    for text in ("{not json", json.dumps([1, 2]), json.dumps({"version": 99}),
                 json.dumps({"version": 1, "decisions": {key: {"backend": 3}}})):  # fmt: skip
        routing.clear_routing(file=False)
        measuring.write_text(text)
        assert routing.decide(plan(spec)).provisional  # nothing usable in the file
    measuring.write_text(
        json.dumps({"version": 1, "decisions": {stale: {"backend": "reference", "times_ms": {}}}})
    )
    routing.clear_routing(file=False)
    routing.decide(plan(spec))
    chosen = routing.decide(plan(spec))  # measured: the first candidate is fastest here
    decisions = json.loads(measuring.read_text())["decisions"]
    assert list(decisions) == [key]  # the stale entry dropped
    assert decisions[key]["backend"] == chosen.backend.name


def _write(path: str, index: int) -> None:
    import os

    os.environ["ATTNBIAS_ROUTING_CACHE"] = path
    from attnbias import routing as own

    for n in range(5):
        own._keep(f"process {index} key {n} | {own._versions()}", "reference", {"reference": 1.0})


def test_concurrent_writers_lose_nothing(measuring: Path) -> None:
    threads = [
        threading.Thread(
            target=lambda i=i: [
                routing._keep(f"thread {i} key {n} | {routing._versions()}", "sdpa", {"sdpa": 2.0})
                for n in range(5)
            ]
        )
        for i in range(4)
    ]
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_write, args=(str(measuring), i)) for i in range(2)]
    for worker in (*threads, *processes):
        worker.start()
    for worker in (*threads, *processes):
        worker.join(timeout=120)
    assert all(p.exitcode == 0 for p in processes)
    decisions = json.loads(measuring.read_text())["decisions"]
    assert len(decisions) == 4 * 5 + 2 * 5


def test_measuring_leaves_no_trace(measuring: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real measurement (on the CPU's backends): the inputs' and the bias's gradients and
    the random number generator are as they were."""
    monkeypatch.setattr(routing, "PRUNE", float("inf"))  # both timed, however far apart
    slopes = torch.rand(4, requires_grad=True)
    slopes.grad = torch.full((4,), 7.0)
    bias = AlibiBias(slopes=slopes) + causal_lower_right()
    q, k, v = (t.requires_grad_() for t in _qkv())
    spec = _spec(q, k, v, bias)
    state = torch.get_rng_state()
    times = routing.measure(spec, ["sdpa+mask", "reference"])
    assert set(times) == {"sdpa+mask", "reference"} and all(t > 0 for t in times.values())
    assert torch.equal(torch.get_rng_state(), state)
    assert all(t.grad is None for t in (q, k, v))
    assert torch.equal(slopes.grad, torch.full((4,), 7.0))


def test_explain_says_where_the_decision_came_from(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        routing, "measure", lambda spec, names: {n: (0.5 if n == "reference" else 2.0)
                                                 for n in names}
    )  # fmt: skip
    q, k, v = _qkv()
    bias = causal_lower_right() + SlidingWindowBias(7)
    attnbias.sdpa(q, k, v, attn_mask=bias)
    attnbias.sdpa(q, k, v, attn_mask=bias)  # measured
    text = attnbias.explain(q, k, v, attn_mask=bias)
    assert text.startswith("reference:"), text
    assert "decided by: measured now: reference 500.000 ms" in text, text


def _sync_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from attnbias import routing as own

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        own.clear_routing(file=False)
        suffix = f" | {own._versions()}"
        # every rank decided "shared" (differently), and one class of its own
        own._keep("shared" + suffix, f"backend of rank {rank}", {"x": float(rank)})
        own._keep(f"rank {rank}" + suffix, "sdpa", {"sdpa": 1.0})
        from attnbias import plan_cache

        plan_cache._ENTRIES["a plan kept before"] = None  # type: ignore[assignment]
        assert attnbias.sync_routing() == world + 1
        # decisions changed: the kept plans are dropped (a call served from them would keep
        # this rank's own backend)
        assert "a plan kept before" not in plan_cache._ENTRIES
        decisions = own._STATE.decisions
        assert decisions["shared" + suffix]["backend"] == "backend of rank 0"
        assert all(f"rank {r}{suffix}" in decisions for r in range(world))
    finally:
        dist.destroy_process_group()


def test_sync_routing_makes_every_rank_hold_the_same_decisions() -> None:
    """Over gloo on 127.0.0.1, three ranks: the lowest rank's decision wins a class decided
    differently; every rank's own classes reach the others."""
    import socket
    import time

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    world = 3
    context = mp.start_processes(
        _sync_worker,
        args=(world, port),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the ranks took longer than 120 s")


def test_forgetting_decisions_drops_the_plans_that_hold_them(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call served from the plan cache never reaches routing: after ``clear_routing`` (or a
    change of mode) the next calls plan, and measure, again."""
    calls = _counted_measure(monkeypatch, reference_s=0.5)
    q, k, v = _qkv()
    bias = causal_lower_right() + SlidingWindowBias(7)
    for _ in range(3):
        attnbias.sdpa(q, k, v, attn_mask=bias)
    assert calls == [1]
    routing.clear_routing()
    for _ in range(3):
        attnbias.sdpa(q, k, v, attn_mask=bias)
    assert calls == [1, 1]
    routing.set_routing("policy")
    routing.set_routing("measure")
    routing.clear_routing(file=False)  # (the file still holds it: read back, not measured)
    attnbias.sdpa(q, k, v, attn_mask=bias)
    assert calls == [1, 1]
    assert "measured earlier" in attnbias.explain(q, k, v, attn_mask=bias)


def test_no_measuring_while_captured_but_the_kept_decision_is_used(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call being captured in a CUDA graph (or with dropout) is never timed; once its class
    is decided, the capture runs on the kept decision."""
    calls = _counted_measure(monkeypatch, reference_s=1.0)
    spec = _spec(*_qkv())
    captured = dataclasses.replace(spec, capturing=True)
    dropping = dataclasses.replace(spec, dropout_p=0.1)
    for _ in range(3):
        for other in (captured, dropping):
            chosen = routing.decide(plan(other))
            assert chosen.backend.name == plan(other).backend.name and not chosen.provisional
    assert not calls
    routing.decide(plan(spec))
    routing.decide(plan(spec))  # measured here
    assert calls == [1]
    assert routing.decide(plan(captured)).backend.name == "reference"
    assert calls == [1]


class _Timings:
    """Stand-ins for the timing of each candidate: ``_runner`` hands back a tagged step and
    ``_timed`` answers the tag's time, counting the timings of each."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.counts: dict[str, int] = dict.fromkeys(seconds, 0)

    def runner(self, spec: Any, backend: Any) -> Any:
        def step() -> None:
            pass

        step.name = backend.name  # type: ignore[attr-defined]
        return step

    def timed(self, step: Any, device: Any, calls: int, primed: bool = True) -> float:
        self.counts[step.name] += 1
        return self.seconds[step.name]


def test_a_candidate_far_slower_than_the_fastest_is_not_timed_further(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stand_in = _Timings({"sdpa+mask": 1e-4, "reference": 1e-4 * (routing.PRUNE + 0.5)})
    monkeypatch.setattr(routing, "_runner", stand_in.runner)
    monkeypatch.setattr(routing, "_timed", stand_in.timed)
    times = routing.measure(_spec(*_qkv()), ["sdpa+mask", "reference"])
    assert list(times) == ["sdpa+mask"]  # the slow one dropped after its estimate
    # the estimate (after a synchronisation, then again primed: a short call), nothing more
    assert stand_in.counts["reference"] == 1 + routing.ESTIMATES
    assert stand_in.counts["sdpa+mask"] == 1 + routing.ESTIMATES + routing.REPEATS
    # within the factor: both timed in full, the median kept
    stand_in = _Timings({"sdpa+mask": 1e-4, "reference": 1.5e-4})
    monkeypatch.setattr(routing, "_runner", stand_in.runner)
    monkeypatch.setattr(routing, "_timed", stand_in.timed)
    times = routing.measure(_spec(*_qkv()), ["sdpa+mask", "reference"])
    assert times == {"sdpa+mask": 1e-4, "reference": 1.5e-4}
    assert set(stand_in.counts.values()) == {1 + routing.ESTIMATES + routing.REPEATS}
    assert routing.LAST_COST["timing_s"] >= 0 and routing.LAST_COST["warm_up_s"] >= 0


def test_one_slow_timing_does_not_prune_the_fastest_candidate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short call's estimate is the fastest of several timings: one call that reads several
    times its usual (host noise) does not drop the fastest backend before it is timed in
    full, so the decision goes to it."""
    stand_in = _Timings({"sdpa+mask": 1e-4, "reference": 2e-4})
    noisy = iter([1e-4, 5e-4])  # the unprimed estimate, then one primed call 5x its usual

    def timed(step: Any, device: Any, calls: int, primed: bool = True) -> float:
        seconds = stand_in.timed(step, device, calls, primed)
        return next(noisy, seconds) if step.name == "sdpa+mask" else seconds

    monkeypatch.setattr(routing, "_runner", stand_in.runner)
    monkeypatch.setattr(routing, "_timed", timed)
    times = routing.measure(_spec(*_qkv()), ["sdpa+mask", "reference"])
    assert set(times) == {"sdpa+mask", "reference"}, "the fastest was pruned on one timing"
    assert min(times, key=times.__getitem__) == "sdpa+mask"


def test_a_large_materialized_mask_is_not_timed_beside_a_fused_kernel() -> None:
    side = 1 << 12  # L·S = 2**24 scores per head
    q, k, v = (torch.randn(1, 1, side, 4) for _ in range(3))
    spec = _spec(q, k, v)
    assert side * side >= routing.MATERIALIZED_MAX_SCORES
    assert not routing._fits(spec, "sdpa+mask", ["triton", "sdpa+mask"])
    assert routing._fits(spec, "triton", ["triton", "sdpa+mask"])
    # nothing fused among the candidates (the CPU): the materialized ones are what there is
    assert routing._fits(spec, "sdpa+mask", ["sdpa+mask", "reference"])
    small = _spec(*_qkv())
    assert routing._fits(small, "sdpa+mask", ["triton", "sdpa+mask"])


def _calls_in_sdpa(fn: Any) -> list[str]:
    """The Python functions (and builtins) one call of ``fn`` runs inside ``attnbias.sdpa``,
    in order; dataclasses' generated ``__eq__`` / ``__hash__`` (a pinned policy compared in
    the plan cache's key) left out."""
    names: list[str] = []
    depth = [0]

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_name == "sdpa" and code.co_filename.endswith("functional.py"):
                depth[0] += 1
            elif depth[0] and code.co_filename != "<string>":
                names.append(f"{Path(code.co_filename).name}:{code.co_name}")
        elif event == "return":
            code = frame.f_code
            if code.co_name == "sdpa" and code.co_filename.endswith("functional.py"):
                depth[0] -= 1
        elif event == "c_call" and depth[0]:
            names.append(getattr(arg, "__name__", "?"))

    import sys

    sys.setprofile(profiler)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


def test_a_cached_automatic_call_runs_exactly_what_the_pinned_backend_runs(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No cost for being automatic: once decided, a repeated call does the same work inside
    ``sdpa`` as the same call with the decided backend pinned (the plan cache's lookup, then
    the backend's prepared run), function for function."""
    monkeypatch.setattr(
        routing, "measure", lambda spec, names: {n: (0.5 if n == "sdpa+mask" else 2.0)
                                                 for n in names}
    )  # fmt: skip
    q, k, v = _qkv()
    bias = causal_lower_right() + SlidingWindowBias(7)

    def auto() -> None:
        attnbias.sdpa(q, k, v, attn_mask=bias)

    for _ in range(3):
        auto()
    assert attnbias.explain(q, k, v, attn_mask=bias).startswith("sdpa+mask:")
    with attnbias.use_backends("sdpa+mask"):
        auto()
        pinned = _calls_in_sdpa(auto)
    automatic = _calls_in_sdpa(auto)
    assert automatic == pinned, (automatic, pinned)
    assert "call_key" in " ".join(automatic) and "_validate" not in " ".join(automatic)


@pytest.fixture
def measuring_on_the_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Routing by measurement on, as a user gets it, with a cache file of its own."""
    path = tmp_path / "routing.json"
    monkeypatch.setenv("ATTNBIAS_ROUTING_CACHE", str(path))
    routing.clear_routing(file=False)
    routing.set_routing("measure")
    yield path
    routing.set_routing("policy")
    routing.clear_routing(file=False)


def _cuda_kernels(fn: Any) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
def test_on_the_gpu_a_cached_automatic_call_launches_what_the_pinned_one_does(
    measuring_on_the_gpu: Path,
) -> None:
    q, k, v = (
        torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    )
    bias = causal_lower_right() + SlidingWindowBias(100)
    grad = torch.ones_like(q)

    def step() -> None:
        attnbias.sdpa(q, k, v, attn_mask=bias).backward(grad)
        q.grad = k.grad = v.grad = None

    for _ in range(3):
        step()
    text = attnbias.explain(q, k, v, attn_mask=bias)
    assert "decided by: measured now" in text, text
    route = text.split(":")[0].split("(")[0]
    with attnbias.use_backends(route):
        step()
        pinned = _calls_in_sdpa(step), _cuda_kernels(step)
    automatic = _calls_in_sdpa(step), _cuda_kernels(step)
    assert automatic[0] == pinned[0]
    assert automatic[1] == pinned[1] and automatic[1], (automatic[1], pinned[1])


@pytest.mark.gpu
def test_on_the_gpu_a_captured_call_is_not_timed_and_runs_the_kept_decision(
    measuring_on_the_gpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnbias import plan_cache

    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bias = causal_lower_right() + SlidingWindowBias(100)
    for _ in range(3):
        expected = attnbias.sdpa(q, k, v, attn_mask=bias)
    assert "decided by: measured now" in attnbias.explain(q, k, v, attn_mask=bias)

    def refuse(spec: Any, candidates: list[str]) -> dict[str, float]:
        raise AssertionError("timed while captured")

    monkeypatch.setattr(routing, "measure", refuse)
    plan_cache.clear()  # the captured call routes again
    routing._STATE.seen.clear()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attnbias.sdpa(q, k, v, attn_mask=bias)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    plan_cache.clear()
    with torch.cuda.graph(graph):
        out = attnbias.sdpa(q, k, v, attn_mask=bias)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected)


@pytest.mark.gpu
def test_on_the_gpu_a_timing_counts_host_time_only_where_it_outlasts_the_gpu() -> None:
    """As in a loop: a call whose host time is shorter than its GPU time reads its GPU time
    (its host time hidden behind the call in flight), one whose host time is longer reads
    its host time."""
    import time

    device = torch.device("cuda")
    cycles = 1_000_000

    def gpu_only() -> None:
        torch.cuda._sleep(cycles)

    routing._warm(gpu_only, device)
    cycles = int(cycles * 4e-3 / routing._timed(gpu_only, device, 2))  # ~4 ms on the GPU
    gpu = min(routing._timed(gpu_only, device, 2) for _ in range(3))

    def host_then_gpu(host: float) -> Any:
        def step() -> None:
            time.sleep(host)
            torch.cuda._sleep(cycles)

        return step

    hidden = min(routing._timed(host_then_gpu(gpu / 2), device, 2) for _ in range(3))
    assert gpu * 0.95 < hidden < gpu * 1.1, (hidden, gpu)  # after a synchronisation: 1.25x
    exposed = min(routing._timed(host_then_gpu(2 * gpu), device, 2) for _ in range(3))

    def slept(seconds: float) -> float:  # a sleep overshoots on a loaded host
        start = time.perf_counter()
        time.sleep(seconds)
        return time.perf_counter() - start

    host = min(slept(2 * gpu) for _ in range(3))
    assert 1.8 * gpu < exposed < 1.2 * max(host, 2 * gpu), (exposed, host, gpu)


def test_measuring_runs_on_copies_with_the_inputs_strides() -> None:
    """Query, key and value as views of one projection keep their gaps in the copies that
    are timed (kernels run differently on them than on contiguous tensors); an expanded
    tensor, whose elements overlap, is copied contiguous. The user's tensors are not used."""
    qkv = torch.randn(2, 32, 3, 4, 16)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    seen: list[list[torch.Tensor]] = []

    class Recording:
        name = "recording"

        def prepare(self, spec: Any) -> Any:
            def run(*qkv: torch.Tensor) -> torch.Tensor:
                seen.append(list(qkv))
                return torch.zeros_like(qkv[0])

            return run

    routing._runner(_spec(q, k, v), Recording())()
    assert [t.stride() for t in seen[0]] == [t.stride() for t in (q, k, v)]
    assert all(c.data_ptr() != t.data_ptr() for c, t in zip(seen[0], (q, k, v), strict=True))
    assert all(torch.equal(c, t) for c, t in zip(seen[0], (q, k, v), strict=True))
    expanded = torch.randn(2, 1, 32, 16).expand(2, 4, 32, 16)
    seen.clear()
    routing._runner(_spec(q.contiguous(), expanded, expanded), Recording())()
    assert seen[0][1].is_contiguous() and torch.equal(seen[0][1], expanded)

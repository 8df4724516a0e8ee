"""Routing by measurement: the backend a class of calls runs fastest on, timed once and kept.

The planner's priority lists and cost model (:mod:`attnbias.policy`) are a prior measured on
one grid of shapes; off it they can pick a slower backend. Here, after the planner has chosen,
a call of a *call class* met on a CUDA device for the second time (a call met once may never
come back, and timing it could compile kernels for nothing) times every backend that can run
it exactly, as the user would see it (forward alone, or forward and backward where gradients
flow: after each candidate's first call, which compiles where it must, one timed call estimates
it; those past :data:`PRUNE` times the fastest estimate are dropped and the rest timed in
interleaved rounds within :data:`BUDGET_S` seconds), and keeps the fastest, unless the
planner's choice is within :data:`MARGIN` of it (so that noise does not flip decisions).
Decisions are kept in memory and in a file per user (:func:`cache_path`), so that a job
measures a class once.

A call class is what decides the speed of a call: the lowered mask's form (its kind, the band's
width, documents, key ranges, ALiBi, soft-cap, the structure of ``ModBias`` functions), dtype,
head dims, the GQA ratio, the memory layout of query, key and value, ``B·H``, ``L`` and ``S``
in powers of two, gradients or not, the device, and the versions of the library, PyTorch,
Triton and FlashAttention 4.

Measuring has no side effects: it runs on copies of the inputs, restores the gradients of the
bias's tensors, skips a materialized mask that would not fit in free memory, and is not done
for calls with dropout (their random numbers), while ``torch.compile`` traces, while a CUDA
graph is captured, on the CPU, with backends pinned by :func:`~attnbias.use_backends`, or
when switched off (:func:`set_routing`, ``ATTNBIAS_ROUTING=policy``). There the decision kept
for the class is used where there is one, else the planner's. Nothing here talks to other
processes: ranks of a distributed job agree through the file (measure on one rank first, or
point ``ATTNBIAS_ROUTING_CACHE`` at a shared file).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["cache_path", "clear_routing", "routing_mode", "set_routing", "sync_routing"]

#: The planner's choice stays unless another backend is faster by more than this fraction.
MARGIN = 0.05
#: Repetitions of each backend, interleaved, after one timed call that estimates it: at most
#: :data:`REPEATS`, at least :data:`MIN_REPEATS`, fewer than the most where another round
#: would take the timing of the class past :data:`BUDGET_S` seconds (the untimed first calls,
#: which compile, apart).
REPEATS = 5
MIN_REPEATS = 1
BUDGET_S = 0.5
#: A candidate whose estimate is this many times the fastest one's is not timed further.
PRUNE = 2.0
#: A short call's estimate is the fastest of this many timings of one call: a single call's
#: host time can read several times its usual (a collection, an allocation, a first use),
#: which would prune the fastest candidate before its repetitions are timed.
ESTIMATES = 3
#: Calls back to back per timing (queued behind one untimed call, as in a model's loop), at
#: most :data:`CALLS` and as many as fit in :data:`CALL_SPAN_S` seconds (one for slow calls).
CALLS = 8
CALL_SPAN_S = 2e-3
#: Calls estimated below this many seconds are timed behind an untimed call in flight (their
#: host time would weigh, timed after a synchronisation); longer ones are not (priming would
#: double their cost for a host time of ~1% of theirs).
PRIMED_BELOW_S = 10e-3
#: How many times a class is met before it is measured.
MEASURE_AT = 2

MODES = ("measure", "policy")
_FILE_VERSION = 1
_LOCK = threading.Lock()


@dataclasses.dataclass
class _State:
    mode: str = "measure"
    decisions: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    loaded: Path | None = None  # the file the decisions were read from
    seen: dict[str, int] = dataclasses.field(default_factory=dict)


def _initial_mode() -> str:
    mode = os.environ.get("ATTNBIAS_ROUTING", "measure")
    if mode not in MODES:
        warnings.warn(
            f"ATTNBIAS_ROUTING={mode!r} is not one of {MODES}; routing by measurement is on",
            stacklevel=1,
        )
        return "measure"
    return mode


_STATE = _State(mode=_initial_mode())


def set_routing(mode: str) -> None:
    """``"measure"`` (the default): the second call of a class on a CUDA device times the
    backends that can run it and keeps the fastest (see :mod:`attnbias.routing`);
    ``"policy"``: the planner's static choice, or a decision already kept for the class.
    The environment variable ``ATTNBIAS_ROUTING`` sets the mode a process starts with."""
    if mode not in MODES:
        raise ValueError(f"set_routing takes one of {MODES}, got {mode!r}")
    if mode != _STATE.mode:
        _STATE.mode = mode
        _forget_plans()


def _forget_plans() -> None:
    """Drop the plans the calls kept (:mod:`attnbias.plan_cache`): they hold the backends of
    decisions that no longer stand, and a call served from them never reaches :func:`decide`."""
    from attnbias import plan_cache

    plan_cache.clear()


def routing_mode() -> str:
    """The mode :func:`set_routing` set."""
    return _STATE.mode


def cache_path() -> Path | None:
    """The file decisions are kept in: ``ATTNBIAS_ROUTING_CACHE`` where set (empty or
    ``off``: no file), else ``$XDG_CACHE_HOME/attnbias/routing.json`` (``~/.cache`` where
    ``XDG_CACHE_HOME`` is not set). Delete it, or call :func:`clear_routing`, to measure
    again."""
    chosen = os.environ.get("ATTNBIAS_ROUTING_CACHE")
    if chosen is not None:
        return None if chosen in ("", "off") else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "attnbias" / "routing.json"


def clear_routing(*, file: bool = True) -> None:
    """Forget every decision in this process, and in the cache file where ``file``."""
    with _LOCK:
        _STATE.decisions.clear()
        _STATE.seen.clear()
        _STATE.loaded = None
        path = cache_path()
        if file and path is not None:
            with _file_lock(path):
                path.unlink(missing_ok=True)
    _forget_plans()


def sync_routing(group: Any = None) -> int:
    """Make every rank of ``group`` (a ``torch.distributed`` process group; ``None``: the
    default one) hold the same decisions: each rank's are gathered and, where ranks decided
    a class differently, the lowest rank's is kept; the merged decisions are kept on every
    rank (and in its cache file). A collective: call it on every rank at a point where all of
    them are, e.g. after the first training step, so that later calls of a class run on one
    backend on every rank. Routing itself never communicates. Returns how many decisions
    each rank holds now."""
    import torch.distributed as dist

    own = {key: {"backend": v["backend"], "times_ms": v["times_ms"]} for key, v in
           list(_STATE.decisions.items())}  # fmt: skip
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, own, group=group)
    merged: dict[str, dict[str, Any]] = {}
    for decisions in reversed(gathered):  # the lowest rank's last, so it wins
        merged.update(decisions or {})
    changed = False
    for key, entry in merged.items():
        if _STATE.decisions.get(key, {}).get("backend") != entry["backend"]:
            _keep(key, entry["backend"], entry["times_ms"])
            _STATE.decisions[key]["source"] = "measured on another rank"
            changed = True
    if changed:
        _forget_plans()
    return len(merged)


# -- the call class ----------------------------------------------------------------------------


def _bucket(n: int) -> int:
    """``n`` rounded up to a power of two (0 for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def layout_of(t: Tensor) -> str:
    """How ``t`` ``(B, H, N, E)`` lies in memory: ``bhse`` (contiguous), ``bshe`` (a view of a
    ``(B, S, H, E)`` tensor), or its stride order."""
    if t.is_contiguous():
        return "bhse"
    if t.dim() == 4 and t.transpose(1, 2).is_contiguous():
        return "bshe"
    order = sorted(range(t.dim()), key=lambda d: -int(t.stride()[d]))
    unit = "u" if t.stride(-1) == 1 else "s"
    return "".join(str(d) for d in order) + unit


def _versions() -> str:
    found = _VERSIONS.get("all")
    if found is None:
        from importlib import metadata

        parts = [f"torch {torch.__version__}"]
        for name in ("attnbias", "triton", "flash-attn-4"):
            try:
                parts.append(f"{name} {metadata.version(name)}")
            except metadata.PackageNotFoundError:
                parts.append(f"{name} -")
        found = _VERSIONS["all"] = ", ".join(parts)
    return found


_VERSIONS: dict[str, str] = {}


_DEVICE_NAMES: dict[Any, str] = {}


def _device_name(device: torch.device) -> str:
    """The device's name, asked once (``torch.compile`` cannot trace the question: under it,
    the name kept from an eager call)."""
    found = _DEVICE_NAMES.get((device.type, device.index))
    if found is None:
        found = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        _DEVICE_NAMES[device.type, device.index] = found
    return found


def _band(value: int | None) -> str:
    return "-" if value is None else f"{'-' if value < 0 else ''}{_bucket(abs(value))}"


def call_class(spec: Any) -> str:
    """The key of ``spec``'s call class (see :mod:`attnbias.routing`), as a string."""
    terms = spec.terms
    batch, heads_q, length_q, length_kv = spec.shape
    heads_kv = spec.key.shape[1]
    mods = ""
    if terms.mods:
        mods = ",".join(str(part._current_values()[0]) for part in terms.mods)
    mask = (
        f"{spec.kind} band {_band(terms.band_lo)}..{_band(terms.band_hi)} "
        f"docs {terms.q_doc is not None} range {terms.has_key_range} "
        f"alibi {terms.slopes is not None} cap {terms.softcap is not None} "
        f"others {len(terms.others)} mods {mods}"
    )
    name = _device_name(spec.query.device)
    shape = (
        f"{spec.query.dtype} E {spec.query.shape[-1]} Ev {spec.value.shape[-1]} "
        f"gqa {heads_q // max(heads_kv, 1)} "
        f"layout {layout_of(spec.query)}/{layout_of(spec.key)}/{layout_of(spec.value)} "
        f"BH {_bucket(batch * heads_q)} L {_bucket(length_q)} S {_bucket(length_kv)} "
        f"grad {spec.needs_grad}"
    )
    return f"{mask} | {shape} | {name} | {_versions()}"


# -- the decisions kept --------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path``'s lock file (POSIX; nothing elsewhere)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path.with_suffix(path.suffix + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_file(path: Path) -> dict[str, dict[str, Any]]:
    """The decisions in ``path``; nothing where it is missing, unreadable or of another
    format (it is written anew at the next decision)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _FILE_VERSION:
        return {}
    decisions = data.get("decisions")
    if not isinstance(decisions, dict):
        return {}
    return {
        key: value
        for key, value in decisions.items()
        if isinstance(key, str)
        and isinstance(value, dict)
        and isinstance(value.get("backend"), str)
        and isinstance(value.get("times_ms"), dict)
    }


def _kept(key: str) -> dict[str, Any] | None:
    """The decision kept for ``key``: this process's, else the file's."""
    found = _STATE.decisions.get(key)
    if found is not None:
        return found
    path = cache_path()
    if path is None:
        return None
    with _LOCK:
        if _STATE.loaded != path:
            for name, value in _read_file(path).items():
                _STATE.decisions.setdefault(name, {**value, "source": "measured earlier"})
            _STATE.loaded = path
    return _STATE.decisions.get(key)


def _keep(key: str, backend: str, times_ms: dict[str, float]) -> None:
    """Keep a decision here and in the file (read, merged and replaced atomically under the
    file's lock, so that processes writing at once lose nothing). Decisions of other
    versions are dropped from the file."""
    entry = {"backend": backend, "times_ms": times_ms}
    with _LOCK:
        _STATE.decisions[key] = {**entry, "source": "measured now"}
    path = cache_path()
    if path is None:
        return
    versions = _versions()
    try:
        with _file_lock(path):
            decisions = {
                name: value for name, value in _read_file(path).items() if name.endswith(versions)
            }
            decisions[key] = entry
            text = json.dumps({"version": _FILE_VERSION, "decisions": decisions}, indent=1)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".routing.")
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.replace(temporary, path)
    except OSError:  # a read-only home: the decision is kept in this process only
        pass


# -- measuring -------------------------------------------------------------------------------


def can_measure(spec: Any) -> bool:
    """Whether ``spec`` may be timed now (see :mod:`attnbias.routing`): on a CUDA device,
    where :func:`measurable`."""
    return bool(spec.query.device.type == "cuda") and measurable(spec)


def measurable(spec: Any) -> bool:
    """Whether timing ``spec`` would leave the user's state as it was: not while
    ``torch.compile`` traces or a CUDA graph is captured (a timing synchronises the device),
    and not with dropout (it draws random numbers)."""
    return (
        not spec.compiling
        and not spec.capturing
        and spec.dropout_p == 0.0
        and not torch.compiler.is_compiling()
    )


def _mask_bytes(spec: Any) -> int:
    batch, heads, length_q, length_kv = spec.shape
    return batch * heads * length_q * length_kv * 4


#: Backends that materialize the mask (or the scores): ``B·H·L·S`` floats of memory.
MATERIALIZED = frozenset({"sdpa+mask", "reference"})
#: From this many scores per head (``L·S``) on, a materialized mask is not timed where a fused
#: kernel can run the call: it reads ``L·S`` mask entries a fused kernel does not and skips no
#: block, and at these sizes one call of it costs more than the whole timing budget.
MATERIALIZED_MAX_SCORES = 1 << 24


def _fits(spec: Any, name: str, candidates: Sequence[str] = ()) -> bool:
    """Whether ``name`` is worth timing on ``spec`` and can run it within free memory (a
    materialized mask and scores are ``B·H·L·S`` floats; the fused kernels need no more than
    the call's own tensors)."""
    if name not in MATERIALIZED:
        return True
    _, _, length_q, length_kv = spec.shape
    if length_q * length_kv >= MATERIALIZED_MAX_SCORES and any(
        other not in MATERIALIZED for other in candidates
    ):
        return False
    if spec.query.device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(spec.query.device)
    return 3 * _mask_bytes(spec) < free // 2


def _copy(t: Tensor, requires_grad: bool) -> Tensor:
    """A copy of ``t`` with its strides (a view of one projection keeps its gaps: kernels run
    differently on it than on a contiguous tensor); a tensor whose elements overlap (an
    expanded one) is copied contiguous."""
    t = t.detach()
    try:
        copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        copy.copy_(t)
    except RuntimeError:
        copy = t.clone(memory_format=torch.contiguous_format)
    return copy.requires_grad_(requires_grad)


def _runner(spec: Any, backend: Any) -> Callable[[], None]:
    """One call of ``backend``'s prepared run (as a repeated call runs it, from the plan
    cache) on copies of ``spec``'s inputs with their strides, as the user's would run:
    forward without gradients, or forward and backward. Each call also works out the plan
    cache's key first, as the user's call does: the same host time for every candidate,
    which decides between them where the host is the bottleneck."""
    from attnbias import plan_cache
    from attnbias.planner import current_policy

    query, key, value = copies = [
        _copy(t, spec.needs_grad and t.requires_grad) for t in (spec.query, spec.key, spec.value)
    ]
    prepared = backend.prepare(spec)
    policy = current_policy()

    def call() -> Tensor:
        plan_cache.call_key(
            query, key, value, spec.bias, spec.dropout_p, False, spec.scale, spec.enable_gqa,
            policy,
        )  # fmt: skip
        return prepared(query, key, value)

    if not spec.needs_grad:

        def forward() -> None:
            with torch.no_grad():
                call()

        return forward
    grad: list[Tensor] = []

    def step() -> None:
        out = call()
        if not grad:
            grad.append(torch.ones_like(out))  # (no random numbers drawn)
        out.backward(grad[0])
        for t in copies:
            t.grad = None

    return step


def _warm(step: Callable[[], None], device: torch.device) -> None:
    """One untimed call of ``step``, waited for (it compiles there where it needs to)."""
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(
    step: Callable[[], None], device: torch.device, calls: int, primed: bool = True
) -> float:
    """Seconds per call of ``calls`` calls of ``step`` back to back, as a model's loop runs
    them. On a GPU, ``primed``: one untimed call goes first and CUDA events time the rest on
    the GPU, so the timed calls are issued while work is in flight and a backend's host time
    per call counts only where it is longer than its GPU time (as in a loop), not once in full
    as it would after a synchronisation; not ``primed``: the first call's host time counts too
    (for calls too long for it to matter, which priming would time twice). Elsewhere, the wall
    clock."""
    if device.type != "cuda":
        began = time.perf_counter()
        for _ in range(calls):
            step()
        return (time.perf_counter() - began) / calls
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    if primed:
        step()  # in flight while the timed calls are issued
    else:
        torch.cuda.synchronize(device)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls


def measure(spec: Any, candidates: list[str]) -> dict[str, float]:
    """Median seconds per call of each of ``candidates`` on ``spec``; a backend that runs out
    of memory or fails is left out. The gradients of the bias's tensors are restored.

    Each candidate first runs once untimed and waited for (it compiles there where it needs
    to), then is timed on one call (where it is shorter than :data:`PRIMED_BELOW_S`, again
    :data:`ESTIMATES` times behind an untimed one, see :func:`_timed`, and the fastest of those
    kept), which estimates it; a candidate more than
    :data:`PRUNE` times slower than the fastest estimate cannot win and is not timed further.
    The rest are timed in interleaved repetitions (:data:`CALLS` calls each, fewer for slow
    calls) while another round fits in
    :data:`BUDGET_S` seconds of timing, at least :data:`MIN_REPEATS` times. The seconds spent are
    kept in :data:`LAST_COST` (``warm_up_s``: the untimed calls, compilation included;
    ``timing_s``: the rest)."""
    from attnbias.planner import BACKENDS

    params = spec.bias.parameters() if spec.bias is not None else ()
    saved = [(p, p.grad) for p in params]
    for p in params:  # accumulated into fresh tensors, dropped after: the user's untouched
        p.grad = None
    device = spec.query.device
    steps: dict[str, Callable[[], None]] = {}
    times: dict[str, list[float]] = {}
    warm_up = timing = 0.0
    try:
        for name in candidates:
            if not _fits(spec, name, candidates):
                continue
            began = time.perf_counter()
            try:
                step = _runner(spec, BACKENDS[name])
                _warm(step, device)
                warm_up += time.perf_counter() - began
                began = time.perf_counter()
                estimate = _timed(step, device, 1, primed=False)
                if estimate < PRIMED_BELOW_S:  # host time may weigh: timed as a loop sees it
                    estimate = min(_timed(step, device, 1) for _ in range(ESTIMATES))
            except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError):
                warm_up += time.perf_counter() - began
                continue
            timing += time.perf_counter() - began
            steps[name], times[name] = step, [estimate]
        if steps:
            fastest = min(found[0] for found in times.values())
            steps = {name: s for name, s in steps.items() if times[name][0] <= PRUNE * fastest}
            calls = max(1, min(CALLS, int(CALL_SPAN_S / max(fastest, 1e-9))))
            primed = {name: times[name][0] < PRIMED_BELOW_S for name in steps}
            round_s = sum((calls + primed[name]) * times[name][0] for name in steps)
            began = time.perf_counter()
            for repeat in range(REPEATS):
                spent = timing + time.perf_counter() - began
                if repeat >= MIN_REPEATS and spent + round_s > BUDGET_S:
                    break
                for name, step in steps.items():
                    times[name].append(_timed(step, device, calls, primed[name]))
            timing += time.perf_counter() - began
    finally:
        for p, grad in saved:
            p.grad = grad
        LAST_COST.update(warm_up_s=warm_up, timing_s=timing)
    return {name: statistics.median(times[name]) for name in steps}


#: What the last :func:`measure` spent, in seconds (``warm_up_s``, ``timing_s``).
LAST_COST: dict[str, float] = {}


def candidates_of(plan: Any) -> list[str]:
    """The backends of ``plan``'s order that can run its spec exactly (its choice first). On a
    GPU the exact eager path is left out unless it is the choice: it materializes the scores
    and is never the fastest where a kernel takes the call, and timing it costs the most."""
    from attnbias.planner import BACKENDS

    spec = plan.spec
    names = [plan.backend.name]
    for name in plan.order:
        if (
            name not in names
            and name not in plan.excluded
            and not (name == "reference" and spec.query.device.type == "cuda")
            and not BACKENDS[name].not_supported_reasons(spec)
        ):
            names.append(name)
    return names


def routed(spec: Any) -> bool:
    """Whether routing by measurement applies to ``spec`` at all: a CUDA device (the CPU has
    one route per form, the exact one)."""
    return bool(spec.query.device.type == "cuda")


def decide(plan: Any, *, may_measure: bool = True) -> Any:
    """``plan`` with the backend measured fastest for its call class (measured now, or kept
    earlier), or ``plan`` itself; the plan says which (:attr:`Plan.decision`). While
    ``torch.compile`` traces, the decisions this process holds are used (the file and the
    device are not asked there: a class first met inside a compiled function runs on the
    planner's choice)."""
    from attnbias.planner import BACKENDS

    spec = plan.spec
    if plan.fixed or plan.pinned or not routed(spec):
        return plan
    if spec.compiling or torch.compiler.is_compiling():
        if (
            not _STATE.decisions
            or (spec.query.device.type, spec.query.device.index) not in _DEVICE_NAMES
            or "all" not in _VERSIONS
        ):
            return plan
        found = _STATE.decisions.get(call_class(spec))
        return plan if found is None else _chosen(plan, found, BACKENDS)
    key = call_class(spec)
    found = _kept(key)
    if found is None:
        if not (may_measure and _STATE.mode == "measure" and can_measure(spec)):
            return plan
        candidates = candidates_of(plan)
        if len(candidates) < 2:
            return plan
        with _LOCK:
            _STATE.seen[key] = _STATE.seen.get(key, 0) + 1
            count = _STATE.seen[key]
        if count < MEASURE_AT:
            return dataclasses.replace(
                plan,
                decision="policy (the class is measured when it is met again)",
                provisional=True,
            )
        times = measure(spec, candidates)
        if not times:
            return plan
        best = min(times, key=times.__getitem__)
        first = plan.backend.name
        if first in times and times[first] <= (1 + MARGIN) * times[best]:
            best = first
        _keep(key, best, {name: 1e3 * t for name, t in times.items()})
        found = _STATE.decisions[key]
    return _chosen(plan, found, BACKENDS)


def _chosen(plan: Any, found: dict[str, Any], backends: dict[str, Any]) -> Any:
    """``plan`` on the backend of the kept decision ``found``, where the call may have it."""
    name = found["backend"]
    backend = backends.get(name)
    if (
        backend is None
        or name in plan.excluded
        or name not in plan.order
        or (name != plan.backend.name and backend.not_supported_reasons(plan.spec))
    ):
        return plan  # kept for backends this call cannot have: the planner's choice
    measured = sorted(
        (ms, backend_name)
        for backend_name, ms in found["times_ms"].items()
        if isinstance(ms, (int, float)) and math.isfinite(ms)
    )
    shown = ", ".join(f"{backend_name} {ms:.3f} ms" for ms, backend_name in measured)
    return dataclasses.replace(plan, backend=backend, decision=f"{found['source']}: {shown}")

"""Choosing the backend of a call: the policy's priority list for it (``attnbias.policy``),
walked in order, then weighed by predicted time.

The first backend in the list that gives no reason against the call is the list's choice.
Where the policy has costs for the GPU generation (``attnbias.policy.COSTS``), the planner
predicts the time of a call on each weighed backend that can take it, the larger of its host
time and its GPU time (calls issued back to back overlap one call's host work with the GPU
work of those before it; a call captured in a CUDA graph pays no host time), and takes a
backend predicted ``SWITCH_FACTOR`` times faster than the list's choice: a tiny call then
skips a backend whose host time is far above its GPU time. ``explain`` shows the list, the
predictions and every other backend's reasons. The lists come from the measurements in
``benchmarks/RESULTS.md``; :func:`use_backends` pins or excludes backends for a region.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from attnbias.backends import BACKENDS, ROUTES, Backend
from attnbias.backends.documents import call_documents, document_part
from attnbias.kernels.limits import MAX_DECODE_QUERIES
from attnbias.kinds import Form, Kind
from attnbias.policy import (
    CAPTURED_FA4_FIRST,
    COSTS,
    FALLBACK,
    FORM_ROUTES,
    MOD_MASK_FA4_MIN_KEYS,
    PRIORITY,
    SWITCH_FACTOR,
    Cost,
    Order,
)
from attnbias.spec import Spec, capturable

__all__ = [
    "CAPTURED_FA4_FIRST",
    "FORM_ROUTES",
    "PRIORITY",
    "Order",
    "Plan",
    "capture_alternative",
    "captured_fa4_first",
    "current_policy",
    "generation",
    "kept_pairs",
    "needs_reach",
    "plan",
    "predict",
    "use_backends",
]


def check_policy() -> None:
    """Check the policy tables against the names they refer to, so that a mistyped kind, form
    or backend is an error at import rather than an empty backend order: every kind keying a
    priority table is a :data:`~attnbias.terms.KINDS` value, every form of
    :data:`FORM_ROUTES` and of each backend's ``forms`` is a :data:`~attnbias.spec.FORMS`
    value, and every backend named in an order, the fallback, the routes of the forms and the
    costs is a registered one."""
    from attnbias.spec import FORMS
    from attnbias.terms import KINDS

    problems = []
    for gen, table in PRIORITY.items():
        for kind, order in table.items():
            if kind not in KINDS:
                problems.append(f"PRIORITY[{gen!r}] has the kind {kind!r}, not one of {KINDS}")
            for name in (*order.inference, *(order.training or ())):
                if name not in BACKENDS:
                    problems.append(f"PRIORITY[{gen!r}][{kind!r}] names the backend {name!r}")
    problems += [f"FALLBACK names the backend {n!r}" for n in FALLBACK if n not in BACKENDS]
    problems += [
        f"CAPTURED_FA4_FIRST has the kind {k!r}" for k in CAPTURED_FA4_FIRST.kinds
        if k not in KINDS
    ]  # fmt: skip
    for form, route in FORM_ROUTES.items():
        if form not in FORMS:
            problems.append(f"FORM_ROUTES has the form {form!r}, not one of {FORMS}")
        if route not in ROUTES:
            problems.append(f"FORM_ROUTES[{form!r}] names the route {route!r}")
    for gen, costs in COSTS.items():
        problems += [f"COSTS[{gen!r}] names the backend {n!r}" for n in costs if n not in BACKENDS]
    for name, backend in ROUTES.items():
        problems += [
            f"the backend {name!r} declares the form {f!r}, not one of {FORMS}"
            for f in backend.forms
            if f not in FORMS
        ]
    if problems:
        raise ValueError("attnbias's routing policy is inconsistent: " + "; ".join(problems))


def generation(device: torch.device) -> str:
    """``hopper`` (capability 9), ``blackwell`` (10), ``cuda`` (other GPUs) or ``cpu``."""
    if device.type != "cuda":
        return "cpu"
    return {9: "hopper", 10: "blackwell"}.get(_major(device.index or 0), "cuda")


@functools.cache
def _major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@dataclass(frozen=True)
class _Policy:
    only: tuple[str, ...] | None = None
    exclude: frozenset[str] = frozenset()


_NO_POLICY = _Policy()
# Per thread, and a threading.local rather than a ContextVar: torch.compile traces reads of
# the former, not of the latter.
_STATE = threading.local()
# Set for the importing thread: reading a missing attribute with a default costs more per
# call than reading a set one (another thread reads the default until it sets one).
_STATE.policy = _NO_POLICY


def current_policy() -> _Policy:
    """The :func:`use_backends` policy of this thread (hashable: part of a call's identity)."""
    return getattr(_STATE, "policy", _NO_POLICY)


def _check_names(names: Iterable[str], what: str) -> None:
    for name in names:
        if name not in BACKENDS:
            raise ValueError(
                f"use_backends: unknown backend {name!r} in {what}; the backends are "
                f"{', '.join(BACKENDS)}"
            )


@contextlib.contextmanager
def use_backends(*only: str, exclude: Iterable[str] = ()) -> Iterator[None]:
    """Pin or exclude backends for the calls of :func:`attnbias.sdpa` in this region.

    ``use_backends("triton")`` runs every call on the Triton kernel, or raises ``ValueError``
    with its reasons when it cannot take a call (no silent fallback); several names (as
    arguments, or a list or tuple of them) are tried in the order given.
    ``use_backends(exclude=["fa4"])`` keeps the normal choice without FlashAttention 4.
    Nested regions: the inner pin replaces the outer one, exclusions add up. Backends:
    ``fa4``, ``triton-decode``, ``triton``, ``gluon`` (Hopper, no gradients), ``sdpa``,
    ``sdpa+mask``, ``reference``.

    Under ``torch.compile`` the region is read when the call is traced.

    Example::

        with attnbias.use_backends("triton"):
            out = attnbias.sdpa(q, k, v, attn_mask=SlidingWindowBias(255))
    """
    if isinstance(exclude, str):
        raise TypeError(
            f"use_backends: exclude must be a list of names, got the string {exclude!r}; "
            f"write exclude=[{exclude!r}]"
        )
    exclude = tuple(exclude)
    # names, lists and tuples of names, as exclude= takes them
    only = tuple(
        name for item in only for name in (item if isinstance(item, (list, tuple)) else (item,))
    )
    for name in (*only, *exclude):
        if not isinstance(name, str):
            raise TypeError(
                f"use_backends: a backend is named by a string, got {name!r} of type "
                f"{type(name).__name__}; the backends are {', '.join(BACKENDS)}"
            )
    _check_names(only, "the pinned names")
    _check_names(exclude, "exclude")
    outer = current_policy()
    _STATE.policy = _Policy(
        only=tuple(only) if only else outer.only, exclude=outer.exclude | set(exclude)
    )
    try:
        yield
    finally:
        _STATE.policy = outer


@dataclass(frozen=True)
class Plan:
    """The chosen backend for a spec, the order tried, and why the ones before it were not."""

    spec: Spec
    backend: Backend
    order: tuple[str, ...]
    heading: str  # what decided the order
    excluded: frozenset[str]  # by use_backends
    pinned: bool  # the order is use_backends' own
    skipped: dict[str, list[str]] = field(default_factory=dict)  # reasons, in order
    fixed: bool = False  # the call's form has one route (FORM_ROUTES): nothing was weighed
    # the weighed backends' predicted (host µs, GPU µs), in the order tried
    predicted: dict[str, tuple[float, float]] = field(default_factory=dict)
    # where routing by measurement decided (attnbias.routing): how, with the times measured
    decision: str = ""
    # chosen for now, to be measured when the call's class is met again: not kept
    provisional: bool = False
    # (Plans are made with every field named: torch.compile (2.11) guards a default taken by
    # a frozen dataclass's constructor by a Python call on each run of the compiled function.)

    def run(self) -> torch.Tensor:
        return self.backend.run(self.spec)

    def explain(self) -> str:
        """The route, the order, and every other backend's reasons (computed here)."""
        spec = self.spec
        if self.fixed:
            return self.backend.headline(spec)
        lines = [
            self.backend.headline(spec),
            f"  order ({self.heading}): {' > '.join(self.order)}",
        ]
        if self.predicted:
            times = ", ".join(
                f"{name} {max(host, gpu):.0f} µs (host {host:.0f}, GPU {gpu:.0f})"
                for name, (host, gpu) in self.predicted.items()
            )
            lines.append(f"  predicted per call: {times}")
        if self.decision:
            lines.append(f"  decided by: {self.decision}")
        for name, backend in BACKENDS.items():
            if backend is self.backend:
                continue
            reasons = self.skipped.get(name) or backend.not_supported_reasons(spec)
            if reasons:
                verdict = "; ".join(reasons)
            elif name in self.excluded:
                verdict = "could run it, but use_backends excludes it"
            elif name in self.order:
                verdict = f"could run it, after {self.backend.name} in the order"
            elif self.pinned:
                verdict = "could run it, but use_backends leaves it out"
            else:
                verdict = "could run it, but is not in the order"
            lines.append(f"  {name}: {verdict}")
        return "\n".join(lines)


def captured_fa4_first(gen: str, spec: Spec) -> bool:
    """Whether ``spec``, captured in a CUDA graph, tries FlashAttention 4 before the decode
    kernel (:data:`CAPTURED_FA4_FIRST`)."""
    if gen not in ("hopper", "blackwell") or spec.needs_grad:
        return False
    terms = spec.terms
    if spec.kind not in CAPTURED_FA4_FIRST.kinds or terms.has_key_range:
        return False
    _, heads_q, length_q, length_kv = spec.shape
    heads_kv = spec.key.shape[1]
    if length_q > MAX_DECODE_QUERIES:  # not a decode: the decode kernel refuses it anyway
        return False
    if heads_kv == 0 or heads_q // heads_kv * length_q < CAPTURED_FA4_FIRST.min_rows:
        return False
    # the decode kernel's own count of the keys some query keeps (blocks of one key);
    # imported here, as the backends import the kernels, when a call gets this far
    from attnbias.kernels.decode import visited_key_blocks

    keys = visited_key_blocks(length_q, length_kv, terms.band_lo, terms.band_hi, False, 1)
    return keys <= CAPTURED_FA4_FIRST.max_keys


def capture_alternative(spec: Spec) -> Plan | None:
    """The plan of ``spec`` in the other capture state (captured in a CUDA graph, or not)
    where it may choose another backend (:func:`captured_fa4_first`), else ``None``."""
    if (
        spec.form != Form.BIAS
        or spec.compiling
        or not capturable(spec.query)
        or not captured_fa4_first(generation(spec.device), spec)
    ):
        return None
    return plan(dataclasses.replace(spec, capturing=not spec.capturing))


def _order(
    gen: str, kind: Kind | Form, needs_grad: bool, policy: _Policy, fa4_first: bool = False
) -> tuple[tuple[str, ...], str]:
    """The backends to try, in order, and what decided it (for ``explain``); ``fa4_first``
    moves FlashAttention 4 before the decode kernel (:func:`captured_fa4_first`)."""
    if policy.only is not None:
        order = policy.only
        heading = "pinned by use_backends"
    else:
        found = PRIORITY[gen].get(kind) if isinstance(kind, Kind) else None  # a form: none
        preferred = (found or Order((), None)).pick(needs_grad)
        order = tuple(dict.fromkeys(preferred + FALLBACK))
        heading = f"{gen}, {kind}, {'training' if needs_grad else 'inference'}"
        if fa4_first and "fa4" in order:
            decode = order.index("triton-decode")
            if order.index("fa4") > decode:
                rest = tuple(name for name in order if name != "fa4")
                order = (*rest[:decode], "fa4", *rest[decode:])
            heading += (
                f"; captured in a CUDA graph, a decode of at least "
                f"{CAPTURED_FA4_FIRST.min_rows} packed rows over at most "
                f"{CAPTURED_FA4_FIRST.max_keys} keys: fa4 before triton-decode"
            )
    if policy.exclude:
        order = tuple(name for name in order if name not in policy.exclude)
        heading += f"; excluded {', '.join(sorted(policy.exclude))}"
    return order, heading


# The same few orders come back call after call: kept, as a call's host time is its whole
# runtime at short sequence lengths.
_cached_order = functools.lru_cache(maxsize=256)(_order)


def kept_pairs(length_q: int, length_kv: int, band_lo: int | None, band_hi: int | None) -> int:
    """How many pairs ``(i, j)``, ``0 <= i < L``, ``0 <= j < S``, have ``band_lo <= j - i <=
    band_hi`` (``None``: no limit on that side): exact, in O(1)."""

    def at_most(offset: int) -> int:
        # pairs with j - i <= offset: row i keeps min(max(i + offset + 1, 0), S) keys
        first, last = offset + 1, offset + length_q  # the rows' counts before clamping
        return _clamped_sum(last, length_kv) - _clamped_sum(first - 1, length_kv)

    hi = at_most(length_kv if band_hi is None else band_hi)
    lo = 0 if band_lo is None else at_most(band_lo - 1)
    return max(hi - lo, 0)


def _clamped_sum(n: int, cap: int) -> int:
    """``sum(min(max(t, 0), cap) for t in range(n + 1))`` for ``n`` of any sign."""
    if n <= 0:
        return 0
    if n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def _kept_in_all_rows(spec: Spec) -> int:
    """The pairs a call keeps per head over its batch rows: those of the band in each
    document (the documents' layout, read on the host once per bias, as FlashAttention 4's
    reasons read it; not while a CUDA graph is captured), else of the band in each row. Key
    ranges are not counted: an upper bound."""
    batch, _, length_q, length_kv = spec.shape
    lo, hi = spec.terms.band_lo, spec.terms.band_hi
    part = document_part(spec) if spec.terms.q_doc is not None and not spec.capturing else None
    layout = None if part is None else call_documents(spec)
    if layout is None or layout.problem is not None:
        return batch * kept_pairs(length_q, length_kv, lo, hi)
    return sum(
        kept_pairs(
            length,
            keys,
            None if lo is None else lo - start,
            None if hi is None else hi - start,
        )
        for length, keys, start in layout.documents
    )


def predict(spec: Spec, cost: Cost, pairs: int) -> tuple[float, float]:
    """``(host µs, GPU µs)`` of ``spec`` on a backend of ``cost``: the GPU's share from the
    ``pairs`` it keeps per head (:func:`_kept_in_all_rows`)."""
    heads = spec.shape[1]
    flops = 2.0 * heads * pairs * (spec.head_dim + spec.head_dim_v)
    if spec.needs_grad:
        host, gpu = cost.host_us_training, 3.5 * flops / (cost.tflops_training * 1e6)
    else:
        host, gpu = cost.host_us, flops / (cost.tflops * 1e6)
    return (0.0 if spec.capturing else host), gpu


def needs_reach(spec: Spec) -> bool:
    """Whether planning ``spec`` reads :attr:`~attnbias.spec.Spec.mask_reach`: a call of
    ModBias masks without gradients that FlashAttention 4 would take first (``"mod mask"``),
    neither captured nor traced nor pinned, longer than a decode (whose short queries go to the
    decode kernel first anyway). Arithmetic only: the dispatcher works the reach out on the
    device (:func:`~attnbias.spec.with_mask_reach`) before it plans."""
    if (
        spec.kind != Kind.MOD_MASK
        or spec.needs_grad
        or spec.capturing
        or spec.compiling
        or spec.shape[2] <= MAX_DECODE_QUERIES
        or current_policy().only is not None
    ):
        return False
    return Kind.MOD_MASK in PRIORITY[generation(spec.device)]


def _short_reach(spec: Spec) -> float | None:
    """The reach of ``spec``'s ModBias mask where it is below
    :data:`~attnbias.policy.MOD_MASK_FA4_MIN_KEYS` and planning reads it (the call then takes
    the order of score functions, the Triton kernel first), else ``None`` (unknown: the order
    of masks stands)."""
    keys = spec.mask_reach
    if keys is None or not needs_reach(spec):
        return None
    return keys if keys < MOD_MASK_FA4_MIN_KEYS else None


def _weigh(
    spec: Spec, order: tuple[str, ...], costs: dict[str, Cost]
) -> tuple[str, dict[str, tuple[float, float]]]:
    """The backend to run ``spec``: ``order[0]`` (the list's choice, which takes it) unless a
    weighed backend after it that takes it too is predicted ``SWITCH_FACTOR`` times faster;
    and the predictions."""
    first = order[0]
    if first not in costs:
        return first, {}
    pairs = _kept_in_all_rows(spec)  # the same for every backend
    predicted = {first: predict(spec, costs[first], pairs)}
    for name in order[1:]:
        if name in costs and not BACKENDS[name].not_supported_reasons(spec):
            predicted[name] = predict(spec, costs[name], pairs)
    best = min(predicted, key=lambda name: max(predicted[name]))
    if max(predicted[first]) > SWITCH_FACTOR * max(predicted[best]):
        return best, predicted
    return first, predicted


def plan(spec: Spec) -> Plan:
    """Walk the priority list for ``spec`` and take the first backend with no reason against it
    (a call of a form with one route takes that route, :data:`FORM_ROUTES`). Arithmetic on the
    spec and the tables: nothing is launched (what needs the device is a fact of the spec,
    worked out before planning: :func:`needs_reach`)."""
    fixed = FORM_ROUTES.get(spec.form)
    policy = current_policy()
    # a bias that materializes goes where its mask can go, unless backends are pinned
    if fixed is not None and not (spec.form == Form.MATERIALIZE and policy.only is not None):
        return Plan(
            spec, ROUTES[fixed], (fixed,), spec.form, frozenset(), False,
            skipped={}, fixed=True, predicted={}, decision="", provisional=False,
        )  # fmt: skip
    kind = spec.kind
    if spec.compiling:
        # Only traceable backends can run while torch.compile traces (not FlashAttention 4),
        # and neither the device query behind the generation nor the cache is traced: the
        # generic order holds.
        gen = "cuda" if spec.device.type == "cuda" else "cpu"
        order, heading = _order(gen, kind, spec.needs_grad, policy)
    else:
        gen = generation(spec.device)
        fa4_first = spec.capturing and captured_fa4_first(gen, spec)
        reach = _short_reach(spec)
        if reach is None:
            order, heading = _cached_order(gen, kind, spec.needs_grad, policy, fa4_first)
        else:
            order, heading = _cached_order(gen, Kind.MOD, spec.needs_grad, policy, fa4_first)
            heading = (
                f"{gen}, {kind}, inference; its mask visits {reach:.0f} keys per block of query "
                f"rows, below {MOD_MASK_FA4_MIN_KEYS}: the order of score functions"
            )
    skipped: dict[str, list[str]] = {}
    for at, name in enumerate(order):
        reasons = BACKENDS[name].not_supported_reasons(spec)
        if not reasons:
            costs = {} if spec.compiling or policy.only is not None else COSTS.get(gen, {})
            chosen, predicted = _weigh(spec, order[at:], costs)
            if chosen != name:
                ratio = max(predicted[name]) / max(predicted[chosen])
                heading += f"; {chosen} before {name}: predicted {ratio:.1f}x faster per call"
            return Plan(
                spec,
                BACKENDS[chosen],
                order,
                heading,
                policy.exclude,
                policy.only is not None,
                skipped,
                fixed=False,
                predicted=predicted,
                decision="",
                provisional=False,
            )
        skipped[name] = reasons
    detail = "; ".join(f"{name}: {'; '.join(reasons)}" for name, reasons in skipped.items())
    if not skipped:
        detail = (
            f"Every backend that could run it is excluded (use_backends: pinned "
            f"{list(policy.only) if policy.only is not None else 'none'}, excluded "
            f"{sorted(policy.exclude)})"
        )
    raise ValueError(
        f"attnbias: no allowed backend can run {spec.terms.describe()} with (B, Hq, L, S)="
        f"{spec.shape} in {spec.dtype} ({heading}). {detail}. Allow more backends in "
        f"use_backends(...)"
    )


check_policy()  # the tables as imported

"""The decisions of recent calls, so that a repeated call skips validation, lowering and planning.

At short sequence lengths a call's host time is its whole runtime, and most of it went into
deciding the same thing again: a model calls attention with the same bias, shapes and flags in
every layer and every step. A call is identified here by everything the decision reads:

- the bias, by its :meth:`~attnbias.AttnBias.cache_key`: the built-ins that hold no tensor
  (causal, sliding window, soft-cap, ALiBi with the paper's slopes) by value, so a bias
  rebuilt each step still hits; a :class:`DocumentBias` and a :class:`KeyRangeBias` by
  identity, and the entry keeps them alive so that their identity cannot be reused (the terms
  it stores hold their tensors on the device); any other bias is not kept (``None``);
- the shapes, strides, dtypes, devices and ``requires_grad`` of query, key and value, and
  grad mode (the strides: the fastest backend depends on the memory layout, which routing by
  measurement, :mod:`attnbias.routing`, tells apart);
- every flag with its type (``1`` and ``True`` are different calls: validation may treat them
  differently);
- the :func:`~attnbias.use_backends` policy in force.

A call warmed up eagerly and then captured in a CUDA graph reuses its entry's decision
(validating it again during the capture could need a host synchronisation, which a capture does
not allow), on the route the planner takes while captured
(:func:`attnbias.planner.captured_fa4_first`), with its bias lowered again inside the capture:
the graph reads no device tensor the eager lowering made (merged document ids, contiguous
copies), which may lie in memory other graphs write at their replays (a serving loop that
warms each step up inside the memory pool its graphs share). A call first planned while
captured is not kept: what its lowering made then (a key range's default ends, copies of small
tensors) is filled by the captured work, which runs only when that graph is replayed.

Not cached: calls traced by ``torch.compile`` (tracing cost is paid once anyway), calls with
an empty dimension, flags that are not plain Python numbers or bools, tensor subclasses, user
biases, :class:`TensorBias`, and ALiBi with user slopes (converted on each call, so that their
gradient is recorded each time). Biases are immutable except for their tensors' contents:
the positions of a :class:`KeyRangeBias` given as int32 ``(B,)`` tensors on the inputs'
device are read at each call, so a cache that grows writes ``end += 1`` in place; where two
ranges intersect, the kept plan recomputes the intersection on the device before each run
(:attr:`Terms.refresh`). Tensors a bias copies (document ids, positions of another dtype or
device) are named by their version counters in its key, so a write makes a new plan. Writes
that bypass the version counter (``.data``, a NumPy view) are not seen by such copies.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias.backends.base import Backend, Prepared
from attnbias.biases import AttnBias
from attnbias.planner import Plan, capture_alternative
from attnbias.spec import Form, Spec, capturable, capturing, lower
from attnbias.terms import Terms

__all__ = ["CachedPlan", "call_key", "clear", "lookup", "store"]

# Entries kept; the oldest goes first. A model has a handful of distinct attention calls.
MAX_ENTRIES = 64


@dataclass(frozen=True, slots=True)
class CachedPlan:
    """What a call decided: its bias (``is_causal`` folded in), terms and backend, and the
    backend's function prepared for it."""

    bias: AttnBias | None
    terms: Terms
    # the call's query, key and value -> its output (flags and bias are fixed by the key)
    run: Prepared


_ENTRIES: dict[Hashable, CachedPlan] = {}
_LOCK = threading.Lock()


# Flags of other types (tensors, numpy numbers) are not cached; each flag goes in the key
# with its type: ``1`` and ``True`` are different calls.
_FLAG_TYPES = frozenset({type(None), bool, int, float})


def call_key(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
    policy: Hashable,
) -> Hashable | None:
    """The identity of an :func:`attnbias.sdpa` call, or ``None`` when it is not cached."""
    if torch.compiler.is_compiling() or not isinstance(attn_mask, AttnBias):
        return None
    bias_key = attn_mask.cache_key()
    if bias_key is None:
        return None
    if not (type(query) is Tensor and type(key) is Tensor and type(value) is Tensor):
        return None
    flags = (
        type(dropout_p), dropout_p, type(is_causal), is_causal, type(scale), scale,
        type(enable_gqa), enable_gqa,
    )  # fmt: skip
    if not _FLAG_TYPES.issuperset(flags[::2]):
        return None
    return (
        bias_key,
        flags,
        query.shape,
        key.shape,
        value.shape,
        query.stride(),  # the layout: routing by measurement tells layouts apart
        key.stride(),
        value.stride(),
        query.dtype,
        key.dtype,
        value.dtype,
        query.device,
        key.device,
        value.device,
        query.requires_grad,
        key.requires_grad,
        value.requires_grad,
        torch.is_grad_enabled(),
        policy,
    )


# ``lookup(key)``: the entry of a call key, or ``None``. The dict's own method (one call
# fewer per call than a function around it); the dict is only ever changed in place.
lookup: Callable[[Hashable], CachedPlan | None] = _ENTRIES.get


def store(key: Hashable, chosen: Plan) -> CachedPlan | None:
    """Remember the decision ``chosen``; the caller checked that ``key`` identifies its call.

    Where the planner routes the same call to another backend in the other capture state
    (captured in a CUDA graph, or not: :func:`attnbias.planner.capture_alternative`), the
    entry's run takes the backend of each call's state. Returns the entry, whose prepared run
    also serves the call that made it, or ``None`` for a call with an empty dimension, which
    is not kept (rare, and validation adjusts some of them: the scale at E = 0): its key is
    never found, and it runs unprepared."""
    spec, backend = chosen.spec, chosen.backend
    if 0 in spec.query.shape or 0 in spec.key.shape or 0 in spec.value.shape:
        return None
    if spec.capturing:
        # not kept: tensors made while capturing (the terms' copies and defaults) are filled
        # by the captured work, which runs only when this graph is replayed
        return CachedPlan(spec.bias, spec.terms, _with_refresh(backend.prepare(spec), spec.terms))
    alternative = capture_alternative(spec)
    captured = backend if alternative is None else alternative.backend
    run = _with_refresh(backend.prepare(spec), spec.terms)
    if captured is not backend:
        captured.prepare(spec)  # (what preparing compiles, compiled before any capture)
    if capturable(spec.query):
        run = _by_capture(uncaptured=run, captured=_lowered_again(spec, captured))
    entry = CachedPlan(spec.bias, spec.terms, run)
    with _LOCK:
        _ENTRIES[key] = entry
        while len(_ENTRIES) > MAX_ENTRIES:
            del _ENTRIES[next(iter(_ENTRIES))]
    return entry


def _with_refresh(run: Prepared, terms: Terms) -> Prepared:
    """``run`` after the work :attr:`Terms.refresh` asks of each call (on the device; a CUDA
    graph that captures the call captures it too)."""
    if not terms.refresh:
        return run
    refresh = terms.refresh

    def refreshed(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        for work in refresh:
            work()
        return run(query, key, value)

    return refreshed


def _lowered_again(spec: Spec, backend: Backend) -> Prepared:
    """The run of an entry planned eagerly for its calls captured in a CUDA graph: the bias
    lowered again inside the capture and ``backend`` prepared for those terms, so that the
    graph reads no device tensor the eager lowering made and the entry holds (merged document
    ids, contiguous copies; what the biases keep from call to call is made outside memory
    pools, ``biases.base.cached_on``, and read as it is). Those may lie in memory that other
    graphs write at their replays: a serving loop that runs each step's eager warm-up inside
    the memory pool its graphs share (transformers' continuous batching) allocates them where
    an earlier graph's temporaries live. The decision and the validation are the entry's;
    only the lowering is redone."""

    def run(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        terms = spec.terms
        if spec.form in (Form.BIAS, Form.MATERIALIZE):
            terms = lower(
                spec.bias, query.shape[-2], key.shape[-2], query.device, batch=query.shape[0]
            )
        fresh = dataclasses.replace(
            spec, query=query, key=key, value=value, terms=terms, capturing=True
        )
        return _with_refresh(backend.prepare(fresh), terms)(query, key, value)

    return run


def _by_capture(*, uncaptured: Prepared, captured: Prepared) -> Prepared:
    """A prepared run that takes ``captured`` while the call's CUDA stream is capturing a
    graph and ``uncaptured`` otherwise."""

    def run(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        return (captured if capturing(query) else uncaptured)(query, key, value)

    return run


def clear() -> None:
    """Forget every decision (after changing what a backend's availability depends on)."""
    with _LOCK:
        _ENTRIES.clear()

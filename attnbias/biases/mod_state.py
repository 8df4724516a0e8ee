"""What a :class:`~attnbias.biases.mod.ModBias` works out for its calls, in one object it
holds (:class:`ModState`), and the compiled form of a sum's ModBias parts.

A bias traces its functions when it is built (tracing cannot run inside ``torch.compile``):
the trace, the values it was made with, its built-in form (band, documents, soft-cap) and its
compiled form (:class:`~attnbias.kernels.modfn.CompiledMods`). Lowering a call adds per-shape
facts (chunk and id documents, shifted copies for blocks and head ranges). Every kept table is
bounded, and everything is dropped together where the values the functions read change. The
compiled form of several parts of a sum is kept by the first part, and dropped when any other
part of it is freed, so no part keeps another's tensors alive.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch

from attnbias.mods.symbols import ModTraceError

if TYPE_CHECKING:
    from attnbias.kernels.modfn import CompiledMods
    from attnbias.kernels.modgraph import TracedMods

__all__ = ["Bounded", "ModState", "compiled_mods", "prepare", "refuse_inside_compile"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

LOCK = threading.Lock()
# Document layouts kept per bias (chunks, id documents), one per call shape
MAX_LAYOUTS = 16
# Blocks kept per bias: the places of a context-parallel call's shard pairs, 4 W^2 at most for
# W ranks
MAX_BLOCKS = 256
# Head ranges kept per bias: one per rank of a head-parallel call (each rank uses one; a
# process that plays several ranks, several)
MAX_HEAD_STARTS = 64
# Combinations of ModBias parts of sums whose compiled form a part keeps (as their first part)
MAX_COMBINED = 8
UNSET: Any = object()


class ModBias(Protocol):
    """What this module asks of a :class:`~attnbias.biases.mod.ModBias` (which imports it)."""

    @property
    def _state(self) -> ModState: ...

    def _traced(self) -> TracedMods: ...

    def _current_values(self) -> Any: ...

    def functions(self) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]: ...

    def builtin_form(self) -> Any: ...

    def describe(self) -> str: ...


class Bounded(Generic[K, V]):
    """A table of at most ``limit`` entries: the oldest is dropped first to make room."""

    __slots__ = ("entries", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.entries: dict[K, V] = {}

    def get(self, key: K) -> V | None:
        return self.entries.get(key)

    def put(self, key: K, value: V) -> None:
        with LOCK:
            if key not in self.entries and len(self.entries) >= self.limit:
                self.entries.pop(next(iter(self.entries)))
            self.entries[key] = value

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(eq=False)
class _Combined:
    """The compiled form of one combination of parts: the other parts by weak reference."""

    others: tuple[weakref.ref[Any], ...]
    keys: tuple[Any, ...]  # each part's values (:func:`values_key`) when it was made
    compiled: CompiledMods


@dataclass(eq=False)
class ModState:
    """Everything a ModBias worked out, held in one place (left out of copies, pickles and
    of the values its functions read).

    Made with the trace (at construction): ``traced`` (the functions with the values they read
    then), ``values_key`` (those values as the plan cache tells them apart), ``seen_values``
    (where each value lives, read again at each call), ``value_slots`` (which numbers are
    runtime numbers of the trace) and ``no_slots`` (such numbers were tried and refused),
    ``form`` (the built-in form, or ``None``) and ``compiled`` (the kernels' form of this bias
    alone). Built while lowering calls: ``combined`` (the kernels' form of sums this bias
    begins), ``chunk_docs`` and ``id_docs`` (documents per call shape), ``blocks`` and
    ``head_ranges`` (shifted copies)."""

    traced: TracedMods | None = None
    values_key: tuple[Any, ...] | None = None
    seen_values: Any = None
    value_slots: dict[int, tuple[int, ...]] | None = None
    no_slots: bool = False
    form: Any = UNSET
    compiled: CompiledMods | None = None
    combined: list[_Combined] = field(default_factory=list)
    chunk_docs: Bounded[tuple[int, int], Any] = field(default_factory=lambda: Bounded(MAX_LAYOUTS))
    id_docs: Bounded[Any, tuple[Any, Any]] = field(default_factory=lambda: Bounded(MAX_LAYOUTS))
    blocks: Bounded[tuple[int, int], Any] = field(default_factory=lambda: Bounded(MAX_BLOCKS))
    head_ranges: Bounded[int, Any] = field(default_factory=lambda: Bounded(MAX_HEAD_STARTS))

    def keep_trace(
        self, traced: TracedMods, probes: Any, slots: dict[int, tuple[int, ...]] | None
    ) -> TracedMods:
        """Keep ``traced`` unless it has the values of the kept trace, dropping everything
        worked out from other values (``no_slots`` stays); returns the trace kept."""
        key = values_key(traced)
        with LOCK:
            found = self.traced
            if found is None or key != self.values_key:
                fresh = ModState(no_slots=self.no_slots)
                self.__dict__.update(fresh.__dict__)
                self.traced, self.values_key = traced, key
                found = traced
            self.seen_values, self.value_slots = probes, slots
        return found

    def forget_combined(self, entry: _Combined) -> None:
        with LOCK, contextlib.suppress(ValueError):
            self.combined.remove(entry)


def values_key(traced: TracedMods) -> tuple[Any, ...]:
    """A trace as the plan cache tells traces apart: its structure (the graph, by a number
    per distinct graph in the process), its numbers (typed, NaN equal to NaN) and its
    tensors by identity."""
    structure = (
        tuple(traced.nodes),
        tuple(f.result for f in traced.masks),
        tuple(f.result for f in traced.scores),
        tuple((t.dtype, t.dim()) for t in traced.params),
    )
    number = _STRUCTURES.get(structure)
    if number is None:
        with LOCK:
            number = _STRUCTURES.setdefault(structure, len(_STRUCTURES))
    values = tuple(
        (type(c), "nan") if isinstance(c, float) and math.isnan(c) else (type(c), c)
        for c in traced.consts
    )
    return number, values, tuple(Identity(t) for t in traced.params)


_STRUCTURES: dict[tuple[Any, ...], int] = {}


class Identity:
    """An object compared by identity in a key (a bias's fields or a trace's tensors, whose
    ``==`` is elementwise)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Identity) and other.obj is self.obj


def compiled_mods(parts: tuple[ModBias, ...]) -> CompiledMods:
    """The kernels' form (:class:`~attnbias.kernels.modfn.CompiledMods`) of the ModBias parts
    of a sum: masks intersect, score functions apply in the order of the sum.

    Made once per bias (or per combination, kept by its first part while the others live),
    when the bias or the sum is built, and again where the values a part's functions read
    changed (the same structure generates the same source: nothing compiles again); inside
    ``torch.compile`` only the kept form is read."""
    from attnbias.kernels.modfn import CompiledMods
    from attnbias.mods.trace import trace_mods

    first = parts[0]
    # each part's values as they are now (a part whose values changed drops its forms)
    keys = tuple(part._current_values() for part in parts)
    state = first._state
    if len(parts) == 1:
        found = state.compiled
        if found is None:
            refuse_inside_compile(first)
            found = CompiledMods.of(first._traced())
            state.compiled = found
        return found
    for entry in list(state.combined):
        if (
            len(entry.others) == len(parts) - 1
            and all(ref() is part for ref, part in zip(entry.others, parts[1:], strict=True))
            and entry.keys == keys
        ):
            return entry.compiled
    refuse_inside_compile(*parts)
    masks: list[Callable[..., Any]] = []
    scores: list[Callable[..., Any]] = []
    for part in parts:
        part_masks, part_scores = part.functions()
        masks += part_masks
        scores += part_scores
    compiled = CompiledMods.of(trace_mods(masks, scores))
    entry = _Combined(tuple(weakref.ref(p) for p in parts[1:]), keys, compiled)
    with LOCK:
        del state.combined[: max(0, len(state.combined) - (MAX_COMBINED - 1))]
        state.combined.append(entry)
    for part in parts[1:]:
        # the compiled form holds every part's tensors: it goes with the first part that goes
        weakref.finalize(part, _forget, weakref.ref(state), entry)
    return compiled


def _forget(state: weakref.ref[ModState], entry: _Combined) -> None:
    found = state()
    if found is not None:
        found.forget_combined(entry)


def prepare(parts: tuple[ModBias, ...]) -> None:
    """:func:`compiled_mods` of ``parts`` and their built-in forms ahead of the calls; a
    function the compiler refuses is left to raise at the first call, where the error names
    it. Under ``torch.compile`` the tracer cannot run in the graph: the work runs eagerly at a
    graph break, and with ``fullgraph=True`` the compiler's error says why."""
    if torch.compiler.is_compiling():
        if _EAGERLY:
            _EAGERLY[0](parts)
        else:  # (torch._dynamo was not loaded when a bias was last built outside compile)
            refuse_inside_compile(*parts)
        return
    eagerly_ready()
    with contextlib.suppress(ModTraceError):
        compiled_mods(parts)
        for part in parts:  # read under torch.compile as a kept value only
            part.builtin_form()


_BUILT_INSIDE = (
    "a ModBias traces its functions when it is built (or summed), which cannot happen inside a "
    "torch.compile graph: build the bias outside the compiled function and pass it in, or "
    "compile without fullgraph=True (the build then runs eagerly at a graph break)"
)

# prepare, run eagerly at a graph break where torch.compile meets it (made once torch._dynamo
# is loaded: importing it here would load Triton with the package)
_EAGERLY: list[Callable[[tuple[Any, ...]], None]] = []


def eagerly_ready() -> None:
    if not _EAGERLY and "torch._dynamo" in sys.modules:
        _EAGERLY.append(torch.compiler.disable(prepare, reason=_BUILT_INSIDE))


def refuse_changed_inside_compile(bias: ModBias) -> None:
    """A value ``bias``'s functions read changed since its last call outside
    ``torch.compile``, whose tracer cannot trace them anew: without ``fullgraph=True`` the
    call then runs eagerly (and sees the new values); with it, this error says what to do."""
    raise TypeError(
        f"{bias.describe()}: a value its functions read changed since the bias was last used "
        f"outside torch.compile, and the functions cannot be traced anew inside it; call the "
        f"bias once outside the compiled function after changing its values (or compile "
        f"without fullgraph=True: the call then runs eagerly with the new values)"
    )


def refuse_inside_compile(*parts: ModBias) -> None:
    """Inside ``torch.compile``, a ModBias whose functions were not traced yet (built inside
    the compiled function, or a subclass whose own ``__post_init__`` skips ModBias's): the
    tracer cannot run there, so say what to do instead."""
    if torch.compiler.is_compiling():
        names = " + ".join(part.describe() for part in parts)
        raise TypeError(
            f"{names}: a ModBias traces its functions when it is built, and this one was not "
            f"traced before torch.compile reached it (built inside the compiled function, or "
            f"a subclass __post_init__ that does not call super().__post_init__()); build the "
            f"bias outside the compiled function and pass it in (a sum of ModBias parts too)"
        )


eagerly_ready()

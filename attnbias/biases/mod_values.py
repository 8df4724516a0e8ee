"""Where the values a ModBias's functions read live, and how each call sees them.

A trace holds the numbers the functions computed from what they can see. :func:`seen` lists
where each of those values lives (closure cells, fields and attributes, defaults, module
globals, class attributes) and :func:`unchanged` reads them again at each call, a few µs.
:func:`with_slots` traces the functions once more with the numbers they read straight from a
closure cell, a module global or the bias's own attributes standing as the trace's runtime
numbers; where that trace is the same graph as the plain one, a new value of such a number is
written into the trace (:func:`renumbered`) instead of tracing the functions again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["cell_value", "renumbered", "seen", "unchanged", "with_slots"]

Probe = tuple[int, Any, Any, Any]


class _Unseen(Exception):
    """The values a function reads go past what :func:`seen` compares."""


#: The most values :func:`seen` compares, and how deep it follows containers and objects;
#: past either, the functions are traced again at every call.
_MAX_SEEN = 2048
_MAX_DEPTH = 8
_ATOMS = (int, float, bool, str, bytes, complex, type(None))
_OPAQUE = (
    types.ModuleType, type, types.BuiltinFunctionType, types.MethodDescriptorType,
    types.WrapperDescriptorType, torch.dtype, torch.device,
)  # fmt: skip
_EMPTY_CELL = object()


def seen(
    bias: Any,
    functions: Any,
    base: type,
    worked_out: tuple[str, ...],
    reached: dict[int, int] | None = None,
) -> list[Probe] | None:
    """Where everything ``bias``'s functions can read lives, with its value now: a list of
    probes ``(how, container, key, value)`` that :func:`unchanged` reads again at each call.

    Followed: the functions (their code, defaults, closure cells and the module globals their
    code names, nested functions included), bound methods (the function and the object),
    ``functools.partial``, lists, tuples, sets and dicts, objects' attributes (``__dict__``
    and ``__slots__``), and the bias's classes (their plain values and functions). Numbers and
    strings are compared by value and type, anything else by identity (a tensor's contents
    are read by the kernels at every call anyway). ``None`` where that goes past
    :data:`_MAX_SEEN` probes or :data:`_MAX_DEPTH` levels (every call then traces anew).

    ``bias``'s own ``worked_out`` entries are left out, and its classes are read up to
    ``base``; ``reached`` counts, per object, how many times the walk met it."""
    probes: list[Probe] = []
    done: set[int] = set()

    def probe(how: int, container: Any, key: Any, depth: int) -> None:
        value = _read(how, container, key)
        probes.append((how, container, key, value))
        visit(value, depth + 1)

    def visit(value: Any, depth: int) -> None:
        if len(probes) > _MAX_SEEN or depth > _MAX_DEPTH:
            raise _Unseen
        if type(value) in _ATOMS or isinstance(value, (Tensor, *_OPAQUE)):
            return
        if reached is not None:
            reached[id(value)] = reached.get(id(value), 0) + 1
        if id(value) in done:
            return
        done.add(id(value))
        kind = type(value)
        if isinstance(value, types.FunctionType):
            for name in ("__code__", "__defaults__", "__kwdefaults__"):
                probe(_ATTR, value, name, depth)
            for cell in value.__closure__ or ():
                probe(_CELL, cell, None, depth)
            space = value.__globals__
            for name in _global_names(value.__code__):
                if name in space:
                    probe(_ITEM, space, name, depth)
        elif isinstance(value, types.MethodType):
            visit(value.__func__, depth + 1)
            visit(value.__self__, depth + 1)
        elif isinstance(value, functools.partial):
            visit(value.func, depth + 1)
            visit(value.args, depth + 1)
            visit(value.keywords, depth + 1)
        elif kind is tuple or kind is frozenset:
            for item in value:
                visit(item, depth + 1)
        elif kind is list:
            probes.append((_LENGTH, value, None, len(value)))
            for index in range(len(value)):
                probe(_ITEM, value, index, depth)
        elif kind is set:
            probes.append((_LENGTH, value, None, len(value)))
            probes.append((_SAME, value, None, frozenset(value)))
        elif kind is dict:
            probes.append((_LENGTH, value, None, len(value)))
            for key in list(value):
                probe(_ITEM, value, key, depth)
        else:
            attributes = getattr(value, "__dict__", None)
            if attributes is not None:
                for key in list(attributes):
                    if not (value is bias and key in worked_out):
                        probe(_ITEM, attributes, key, depth)
            for cls in kind.__mro__:
                if cls is base or cls is object:
                    break
                for slot in cls.__dict__.get("__slots__", ()):
                    if isinstance(slot, str) and slot not in ("__dict__", "__weakref__"):
                        probe(_ATTR, value, slot, depth)
                if value is bias:  # the subclass's values and methods
                    for key, item in cls.__dict__.items():
                        if not key.startswith("__") and (
                            type(item) in _ATOMS or isinstance(item, types.FunctionType)
                        ):
                            probe(_ITEM, cls.__dict__, key, depth)

    try:
        visit(bias, 0)
        visit(functions, 1)
    except (_Unseen, RecursionError):
        return None
    return probes


# how a probe of :func:`seen` reads its value
_ITEM, _ATTR, _CELL, _LENGTH, _SAME = range(5)
_MISSING = object()


def _read(how: int, container: Any, key: Any) -> Any:
    if how == _ITEM:
        try:
            return container[key]
        except (KeyError, IndexError):
            return _MISSING
    if how == _ATTR:
        return getattr(container, key, _MISSING)
    if how == _CELL:
        return cell_value(container, _MISSING)
    if how == _LENGTH:
        return len(container)
    return frozenset(container)


def unchanged(probes: list[Probe]) -> bool:
    """Whether every probe of :func:`seen` reads what it read then.

    Under ``torch.compile``, whose guards then hold the values read, a class's own values
    (read through its ``mappingproxy``, which the compiler cannot follow while the bias's
    ``__dict__`` changes) are left out."""
    compiling = torch.compiler.is_compiling()
    return all(
        _same(_read(how, container, key), value, how)
        for how, container, key, value in probes
        if not (compiling and type(container) is types.MappingProxyType)
    )


_GLOBAL_NAMES: dict[types.CodeType, tuple[str, ...]] = {}


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` may read as module globals (nested functions' code included)."""
    found = _GLOBAL_NAMES.get(code)
    if found is None:
        names = set(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names.update(_global_names(const))
        found = tuple(sorted(names))
        if len(_GLOBAL_NAMES) < 4096:
            _GLOBAL_NAMES[code] = found
    return found


def cell_value(cell: Any, empty: Any = None) -> Any:
    """A closure cell's value (``empty`` for a cell not filled yet)."""
    try:
        return cell.cell_contents
    except ValueError:
        return empty


def _same(now: Any, value: Any, how: int) -> bool:
    """Whether a probe reads what it read then (see :func:`unchanged`)."""
    if now is value:
        return True
    kind = type(now)
    if kind is not type(value) or (kind not in _ATOMS and how != _SAME):
        return False
    return bool(now == value) or (kind is float and math.isnan(now) and math.isnan(value))


def _is_number(value: Any) -> bool:
    return type(value) is int or type(value) is float


def with_slots(
    bias: Any,
    functions: tuple[Sequence[Callable[..., Any]], Sequence[Callable[..., Any]]],
    plain: Any,
    probes: list[Probe],
    reached: dict[int, int],
    worked_out: tuple[str, ...],
) -> tuple[Any, dict[int, tuple[int, ...]]] | None:
    """The functions traced with each number they read from a closure cell, a module global
    or the bias's own ``__dict__`` standing as a runtime number of the trace, and for each
    such probe of ``probes`` the trace's slots it fills; ``None`` where no such trace holds.

    Kept only where it is the same graph as ``plain`` (the trace with the numbers as they
    are): a function that branches on such a number, computes with it on the Python side
    (``W - 1``), tests its type or uses it as a Python integer does not give the same graph
    (or fails to trace), and keeps tracing anew when the number changes. A number is a slot
    only where every place the walk of :func:`seen` met it was replaced: a helper function
    reading the same cell or global, or the bias reached from elsewhere than its own
    methods, would still read the number itself."""
    from attnbias.mods import trace

    masks, scores = functions
    bound = {
        id(f) for f in (*masks, *scores) if isinstance(f, types.MethodType) and f.__self__ is bias
    }
    replaced: dict[tuple[int, int, Any], list[int]] = {}

    def bind(slot_of: Callable[[Any], tuple[Any, int]]) -> tuple[list[Any], list[Any]]:
        def number(value: Any, address: tuple[int, int, Any]) -> Any:
            sym, slot = slot_of(value)
            replaced.setdefault(address, []).append(slot)
            return sym

        proxy = _proxy(bias, number, worked_out) if bound else bias

        def rebuilt(fn: Any) -> Any:
            if (
                isinstance(fn, types.MethodType)
                and fn.__self__ is bias
                and isinstance(fn.__func__, types.FunctionType)
            ):
                return types.MethodType(_replaced(fn.__func__, number), proxy)
            if isinstance(fn, types.FunctionType):
                return _replaced(fn, number)
            return fn

        return [rebuilt(f) for f in masks], [rebuilt(f) for f in scores]

    try:
        traced = trace.trace_mods(masks, scores, bind=bind)
    except Exception:  # the plain trace is what the calls use; this one only saves work
        return None
    if not replaced or not trace.same_graph(traced, plain):
        return None
    counts: dict[tuple[int, int, Any], int] = {}
    for how, container, key, _ in probes:
        address = (how, id(container), key)
        counts[address] = counts.get(address, 0) + 1
    own = getattr(bias, "__dict__", None)
    bias_only_here = reached.get(id(bias), 0) == 1 + len(bound)
    slots: dict[int, tuple[int, ...]] = {}
    for index, (how, container, key, value) in enumerate(probes):
        address = (how, id(container), key)
        found = replaced.get(address)
        if found is None or len(found) != counts[address] or not _is_number(value):
            continue
        if container is own and not bias_only_here:
            continue
        slots[index] = tuple(found)
    return (traced, slots) if slots else None


def _proxy(
    bias: Any, number: Callable[[Any, tuple[int, int, Any]], Any], worked_out: tuple[str, ...]
) -> Any:
    """A shallow copy of ``bias`` whose numbers in ``__dict__`` are runtime numbers, for its
    methods to read as ``self``; ``bias`` itself where it has no ``__dict__``."""
    own = getattr(bias, "__dict__", None)
    if own is None:
        return bias
    proxy = object.__new__(type(bias))
    object.__getattribute__(proxy, "__dict__").update(
        {
            key: number(value, (_ITEM, id(own), key))
            if key not in worked_out and _is_number(value)
            else value
            for key, value in own.items()
        }
    )
    return proxy


def _replaced(fn: types.FunctionType, number: Callable[[Any, tuple[int, int, Any]], Any]) -> Any:
    """``fn`` with the numbers of its closure cells and of the module globals its code names
    replaced by runtime numbers (a new function: ``fn`` is left as it is)."""
    closure = fn.__closure__
    if closure:
        closure = tuple(
            types.CellType(number(cell.cell_contents, (_CELL, id(cell), None)))
            if _is_number(cell_value(cell, _EMPTY_CELL))
            else cell
            for cell in closure
        )
    space = fn.__globals__
    names = [name for name in _global_names(fn.__code__) if _is_number(space.get(name))]
    if names:
        space = dict(space)
        for name in names:
            space[name] = number(space[name], (_ITEM, id(fn.__globals__), name))
    made = types.FunctionType(fn.__code__, space, fn.__name__, fn.__defaults__, closure)
    made.__kwdefaults__ = fn.__kwdefaults__
    made.__qualname__ = fn.__qualname__
    made.__dict__.update(fn.__dict__)
    return made


def renumbered(
    traced: Any, probes: list[Probe], slots: dict[int, tuple[int, ...]] | None
) -> tuple[Any, list[Probe]] | None:
    """``traced`` with the new values of the numbers that changed written into their slots,
    and the probes reading them now; ``None`` where something else changed (or a number
    changed its type): then the functions are traced again."""
    if not slots:
        return None
    consts = list(traced.consts)
    now_probes = list(probes)
    for index, (how, container, key, value) in enumerate(probes):
        now = _read(how, container, key)
        if _same(now, value, how):
            continue
        places = slots.get(index)
        if places is None or type(now) is not type(value):
            return None
        for slot in places:
            consts[slot] = now
        now_probes[index] = (how, container, key, now)
    return dataclasses.replace(traced, consts=consts), now_probes

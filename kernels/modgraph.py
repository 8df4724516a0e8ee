"""The traced form of ``mask_mod`` / ``score_mod`` functions: a small graph of operations on
the index inputs (``b``, ``h``, ``q_idx``, ``kv_idx``) and the score, the tensors they read and
the Python numbers they use, which the emitters read (Triton here, CuTe in the FlashAttention 4
backend). The front end that traces functions into it, evaluates it on index grids and proves
its reads in range is :mod:`attnbias.mods`; what is here needs nothing from it.

Also here: value ranges over every call (interval arithmetic on the graph), which decide the
integer widths the generated code computes in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "INDEX_NAMES",
    "INT32",
    "Node",
    "TracedFunction",
    "TracedMods",
    "node_inputs",
    "value_ranges",
]

INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")


# -- the graph ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One operation: ``op`` on ``args`` (node ids, or for "input" / "const" / "load" their own
    payload), giving a value of ``kind`` ("bool", "int" or "float")."""

    op: str
    args: tuple[Any, ...]
    kind: str


@dataclass(frozen=True, eq=False)
class TracedFunction:
    """One traced function: its result node, and which of the index inputs it reads."""

    name: str
    result: int
    reads: frozenset[str]


@dataclass(eq=False)
class TracedMods:
    """Mask functions (kept where all of them keep) and score functions (applied in order),
    traced into one graph with their parameters and runtime numbers.

    ``params`` are the tensors the functions read (each ``(param, sizes..., strides...)`` at
    run time); ``consts`` the Python numbers, runtime arguments as well."""

    nodes: list[Node]
    masks: list[TracedFunction]
    scores: list[TracedFunction]
    params: list[Tensor]
    consts: list[int | float]
    inputs: dict[str, int] = field(default_factory=dict)

    def reads(self) -> frozenset[str]:
        """The index inputs the masks read ("b", "h", "q_idx", "kv_idx")."""
        return frozenset().union(*(f.reads for f in self.masks))

    def runtime_args(self) -> list[Any]:
        """The flat runtime arguments of the generated code: the constants, then per parameter
        its tensor, sizes and strides."""
        args: list[Any] = list(self.consts)
        for param in self.params:
            args.append(param)
            args.extend(int(n) for n in param.shape)
            args.extend(int(s) for s in param.stride())
        return args

    def param_slots(self) -> list[int]:
        """Where each parameter's runtime arguments (tensor, sizes, strides) start in the flat
        tuple of :meth:`runtime_args`."""
        slots, slot = [], len(self.consts)
        for param in self.params:
            slots.append(slot)
            slot += 1 + 2 * param.dim()
        return slots

    def read_args(self, node: Node) -> tuple[int, list[int], list[int]]:
        """Where a parameter read's (op ``"load"``) runtime arguments lie in the flat tuple of
        :meth:`runtime_args`: its tensor, then its sizes and its strides by dimension."""
        slot = self.param_slots()[node.args[0]]
        dims = range(len(node.args) - 1)
        return slot, [slot + 1 + d for d in dims], [slot + 1 + len(dims) + d for d in dims]

    def additive_score(self) -> bool:
        """Whether the score functions only add something that does not depend on the score
        (``score + g(b, h, q_idx, kv_idx)``, chained), so that they have an additive form:
        :func:`attnbias.mods.score_grid` of a zero score."""
        start = current = self.inputs["score"]
        for function in self.scores:
            result = function.result
            if result == current:
                continue
            node = self.nodes[result]
            if node.op == "add" and current in node.args:
                other = node.args[1] if node.args[0] == current else node.args[0]
            elif node.op == "sub" and node.args[0] == current:
                other = node.args[1]
            else:
                return False
            if {start, current} & self.ancestors(other):
                return False
            current = result
        return True

    def narrow_casts(self) -> frozenset[int]:
        """The casts to int64 that run in 32 bits (see :func:`_narrow_casts`)."""
        return self._per_numbers("_narrow", _narrow_casts)

    def wide_nodes(self) -> frozenset[int]:
        """The integer operations the generated code computes in int64 (see
        :func:`_wide_nodes`)."""
        return self._per_numbers("_wide", _wide_nodes)

    def wrapped_reads(self) -> frozenset[tuple[int, int]]:
        """``(load node, dimension)`` of the reads whose index may be negative on some call
        (see :func:`_wrapped_reads`)."""
        return self._per_numbers("_wrapped", _wrapped_reads)

    def _per_numbers(self, name: str, work: Callable[[TracedMods], Any]) -> Any:
        """``work(self)``, kept with the numbers it was worked out for."""
        numbers = tuple((type(c), c) for c in self.consts)
        found = self.__dict__.get(name)
        if found is None or found[0] != numbers:
            found = self.__dict__[name] = (numbers, work(self))
        return found[1]

    def id_of(self, node: Node) -> int:
        """The id of ``node`` in :attr:`nodes` (each node is there once)."""
        ids = self.__dict__.get("_ids")
        if ids is None or len(ids) != len(self.nodes):
            ids = self.__dict__["_ids"] = {n: i for i, n in enumerate(self.nodes)}
        return int(ids[node])

    def function_of(self, node_id: int) -> str:
        """The function that reads ``node_id`` as errors name it (``"mask_mod doc_mask"``):
        the first of the masks, then the score functions, computed from it."""
        for function in (*self.masks, *self.scores):
            if node_id in self.ancestors(function.result):
                return function.name
        return "a ModBias function"

    def used_nodes(self) -> set[int]:
        """The nodes some mask or score function's result is computed from."""
        results = [f.result for f in (*self.masks, *self.scores)]
        return set().union(*(self.ancestors(r) for r in results)) if results else set()

    def read_list(self) -> list[tuple[int, int]]:
        """``(load node, dimension)`` of every read the functions make, in node order."""
        found = self.__dict__.get("_read_list")
        if found is None:
            found = [
                (node_id, dim)
                for node_id in sorted(self.used_nodes())
                if self.nodes[node_id].op == "load"
                for dim in range(len(self.nodes[node_id].args) - 1)
            ]
            self.__dict__["_read_list"] = found
        return found

    def ancestors(self, node_id: int) -> set[int]:
        """The nodes ``node_id`` is computed from, itself included."""
        seen: set[int] = set()
        stack = [node_id]
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            node = self.nodes[current]
            stack.extend(node_inputs(node))
        return seen


def node_inputs(node: Node) -> list[int]:
    """The node ids ``node`` is computed from."""
    if node.op in ("input", "const", "bool"):
        return []
    if node.op == "load":
        return list(node.args[1:])
    if node.op == "cast":
        return [node.args[0]]
    return list(node.args)


# -- value ranges: which integer casts of 64 bits can run in 32 ---------------------------------

#: The integers of 32 bits.
INT32 = (-(2.0**31), 2.0**31 - 1)
#: Room for float32's rounding (and the kernels' approximate log and exp) around the bounds of
#: a float value worked out here in float64, where a cast turns it into an integer.
_ROUNDING = 1e-4

_Range = tuple[float, float, bool]  # low, high, may be NaN
_ANY: _Range = (-math.inf, math.inf, True)


def _combine(values: list[float], nan: bool) -> _Range:
    if any(math.isnan(v) for v in values):
        return _ANY
    return (min(values), max(values), nan)


#: The index inputs' bounds over all calls.
_POSITIONS: _Range = (0.0, 2.0**31 - 1, False)


def value_ranges(
    traced: TracedMods,
    inputs: Mapping[str, _Range] | None = None,
    loads: Mapping[int, _Range] | None = None,
    numbers: bool = True,
) -> list[_Range]:
    """Bounds of every node's value: interval arithmetic, each bound conservative.

    By default over all calls (indices in ``[0, 2**31)``, the scores and float tables
    anything, integer tables their dtype's range) with the trace's numbers. ``inputs`` bounds
    the index inputs by name (a call's ``[0, B)``, ``[0, Hq)``, ``[0, L)``, ``[0, S)``),
    ``loads`` the values of tensor parameters by slot (their actual least and greatest);
    ``numbers=False``: any number in place of the trace's (bounds that hold whatever numbers
    later calls bring)."""
    ranges: list[_Range] = []
    for node in traced.nodes:
        op, args = node.op, node.args
        a = ranges[args[0]] if op not in ("input", "const", "bool", "load") else None
        b = ranges[args[1]] if op in _BINARY_OPS else None
        result: _Range
        if op == "input":
            result = _ANY if args[0] == "score" else (inputs or {}).get(args[0], _POSITIONS)
        elif op == "const" and not numbers:
            result = _ANY if node.kind == "float" else (-math.inf, math.inf, False)
        elif op == "const":
            value = float(traced.consts[args[0]])
            result = (value, value, math.isnan(value))
        elif op == "bool" or node.kind == "bool":
            result = (0.0, 1.0, False)
        elif op == "load":
            dtype = traced.params[args[0]].dtype
            if loads is not None and args[0] in loads:
                result = loads[args[0]]
            elif dtype.is_floating_point:
                result = _ANY
            else:
                info = torch.iinfo(dtype)
                result = (float(info.min), float(info.max), False)
        elif op == "where":
            branches = [
                _refined(traced, ranges, args[0], args[1], True, ranges[args[1]]),
                _refined(traced, ranges, args[0], args[2], False, ranges[args[2]]),
            ]
            taken = [r for r in branches if r is not None] or [ranges[args[1]], ranges[args[2]]]
            result = (
                min(r[0] for r in taken),
                max(r[1] for r in taken),
                any(r[2] for r in taken),
            )
        else:
            assert a is not None
            source_float = traced.nodes[args[0]].kind == "float"
            result = _node_range(op, node, a, b, ranges, source_float)
        ranges.append(result)
    return ranges


_MIRRORED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def _refined(
    traced: TracedMods,
    ranges: list[_Range],
    condition: int,
    branch: int,
    truth: bool,
    bounds: _Range,
) -> _Range | None:
    """``bounds`` of the integer ``branch`` narrowed to where ``condition`` is ``truth``
    (``None``: nowhere): the branch a choice ``where(x < n, x, ...)`` takes is below ``n``.
    Reads comparisons of the branch itself with a bounded value, under ``~``, ``&`` (true)
    and ``|`` (false); anything else leaves the bounds as they are."""
    node = traced.nodes[condition]
    if node.kind != "bool" or traced.nodes[branch].kind != "int":
        return bounds
    if node.op == "not":
        return _refined(traced, ranges, node.args[0], branch, not truth, bounds)
    if node.op in ("and", "or") and truth == (node.op == "and"):
        found: _Range | None = bounds
        for arg in node.args:
            if found is not None:
                found = _refined(traced, ranges, arg, branch, truth, found)
        return found
    if node.op not in _MIRRORED:
        return bounds
    op, (left, right) = node.op, node.args
    if right == branch and left != branch:
        op, left, right = _MIRRORED[op], right, left
    if left != branch or traced.nodes[right].kind == "float":
        return bounds
    op = op if truth else _NEGATED[op]
    low, high, nan = bounds
    other = ranges[right]
    if op == "lt":
        high = min(high, other[1] - 1)
    elif op == "le":
        high = min(high, other[1])
    elif op == "gt":
        low = max(low, other[0] + 1)
    else:
        low = max(low, other[0])
    return None if low > high else (low, high, nan)


_BINARY_OPS = frozenset(
    ("add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor", "minimum", "maximum")
)


def _node_range(
    op: str, node: Node, a: _Range, b: _Range | None, ranges: list[_Range], source_float: bool
) -> _Range:
    nan = a[2] or (b is not None and b[2])
    if b is not None:
        if op == "add":
            return _combine([a[0] + b[0], a[1] + b[1]], nan)
        if op == "sub":
            return _combine([a[0] - b[1], a[1] - b[0]], nan)
        if op == "mul":
            return _combine([x * y for x in a[:2] for y in b[:2]], nan)
        if op in ("truediv", "floordiv") and (b[0] > 0 or b[1] < 0):
            quotients = [x / y for x in a[:2] for y in b[:2]]
            low, high, nan = _combine(quotients, nan)
            return (_floor(low), _floor(high), nan) if op == "floordiv" else (low, high, nan)
        if op == "mod" and math.isfinite(max(abs(b[0]), abs(b[1]))):
            if b[0] > 0 and a[0] >= 0 and a[1] < b[0]:
                return a  # below every divisor: the value itself
            # an integer's remainder is at most |divisor| - 1 from 0
            reach = max(abs(b[0]), abs(b[1])) - (1 if node.kind == "int" else 0)
            return (0.0 if b[0] > 0 else -reach, 0.0 if b[1] < 0 else reach, nan)
        if op == "minimum":
            return (min(a[0], b[0]), min(a[1], b[1]), nan)
        if op == "maximum":
            return (max(a[0], b[0]), max(a[1], b[1]), nan)
        if op in ("and", "or", "xor") and min(a[0], b[0]) >= 0 and math.isfinite(a[1] + b[1]):
            top = 2.0 ** max(int(a[1]).bit_length(), int(b[1]).bit_length()) - 1
            return (0.0, top, nan)
        return _ANY
    args = node.args
    if op == "neg":
        return (-a[1], -a[0], nan)
    if op == "invert":
        return (-a[1] - 1, -a[0] - 1, nan)
    if op == "abs":
        if a[0] >= 0:
            return a
        if a[1] <= 0:
            return (-a[1], -a[0], nan)
        return (0.0, max(-a[0], a[1]), nan)
    if op == "cast":
        kind, width = args[1], args[2]
        if kind == "float":
            return a
        if nan or not (math.isfinite(a[0]) and math.isfinite(a[1])):
            return _ANY
        low, high = a[0], a[1]
        if source_float:
            low, high = low - abs(low) * _ROUNDING - 1, high + abs(high) * _ROUNDING + 1
        low, high = float(math.trunc(low)), float(math.trunc(high))
        if width == 32 and not (low >= INT32[0] and high <= INT32[1]):
            return _ANY  # wraps
        return (low, high, False)
    if op == "exp":
        return (_exp(a[0]), _exp(a[1]), nan)
    if op == "log":
        if a[0] < 0:
            return _ANY
        return (math.log(a[0]) if a[0] > 0 else -math.inf, _log(a[1]), nan)
    if op == "sqrt":
        return _ANY if a[0] < 0 else (math.sqrt(a[0]), math.sqrt(a[1]), nan)
    if op == "tanh":
        return (math.tanh(a[0]), math.tanh(a[1]), nan)
    if op == "sigmoid":
        return (0.0, 1.0, nan)
    return _ANY


def _floor(x: float) -> float:
    """``math.floor`` that keeps an infinite bound infinite."""
    return x if math.isinf(x) or math.isnan(x) else float(math.floor(x))


def _exp(x: float) -> float:
    return math.inf if x > 700 else math.exp(x)


def _log(x: float) -> float:
    return math.inf if math.isinf(x) else math.log(x)


def _narrow_casts(traced: TracedMods) -> frozenset[int]:
    """The casts to int64 whose value, and every integer computed from it, stays within
    ``±2**30`` on every call: they run in 32 bits (64-bit integer arithmetic costs the kernels
    several instructions per score)."""
    ranges = value_ranges(traced)
    users: dict[int, list[int]] = {}
    for node_id, node in enumerate(traced.nodes):
        for arg in node_inputs(node):
            users.setdefault(arg, []).append(node_id)

    def fits(node_id: int) -> bool:
        low, high, nan = ranges[node_id]
        return not nan and low >= INT32[0] and high <= INT32[1]

    narrow = set()
    for node_id, node in enumerate(traced.nodes):
        if node.op != "cast" or node.args[1] != "int" or node.args[2] != 64:
            continue
        stack, seen, ok = [node_id], set(), True
        while stack and ok:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if traced.nodes[current].kind != "int":
                continue  # a comparison or a float: the integer's width ends here
            ok = fits(current)
            stack.extend(users.get(current, []))
        if ok:
            narrow.add(node_id)
    return frozenset(narrow)


#: Integer operations, computed in int64 where their values may leave int32 (:func:`_wide_nodes`).
_INT_OPERATIONS = frozenset(
    ("add", "sub", "mul", "floordiv", "mod", "and", "or", "xor", "neg", "abs", "invert",
     "minimum", "maximum", "where")
)  # fmt: skip


def _wide_nodes(traced: TracedMods) -> frozenset[int]:
    """The integer operations whose value may leave int32 on some call (value ranges over
    all calls, with the trace's numbers): the generated code computes them in int64, as
    eager PyTorch computes the int64 indices (``q_idx * 1000003 * 1000003`` wraps in 32
    bits). The others stay in 32 bits, where the kernels' indices are (most index arithmetic,
    ``kv_idx - q_idx`` included)."""
    ranges = value_ranges(traced)
    return frozenset(
        node_id
        for node_id, node in enumerate(traced.nodes)
        if node.kind == "int"
        and node.op in _INT_OPERATIONS
        and not (ranges[node_id][0] >= INT32[0] and ranges[node_id][1] <= INT32[1])
    )


def _wrapped_reads(traced: TracedMods) -> frozenset[tuple[int, int]]:
    """``(load node, dimension)`` of the reads whose index may be negative on some call,
    whatever the numbers (``rel[h, kv_idx - q_idx]``): the generated code adds the size to a
    negative index, as eager PyTorch reads it. The others are read as they are."""
    ranges = value_ranges(traced, numbers=False)
    return frozenset(
        (node_id, dim)
        for node_id, node in enumerate(traced.nodes)
        if node.op == "load"
        for dim, arg in enumerate(node.args[1:])
        if ranges[arg][0] < 0
    )

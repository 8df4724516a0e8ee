"""The mask-function compiler: FlexAttention-style ``mask_mod`` / ``score_mod`` functions traced
into a small graph and generated as Triton code for the kernels, or evaluated with torch
operations on an index grid.

A function is called once with symbolic arguments (:class:`Sym`): the batch row ``b``, the
query head ``h``, the query and key positions ``q_idx`` / ``kv_idx`` (integers) and, for a
score function, the scaled ``score`` (float). Every operation on them records a node; tensors
the function reads (a per-head table, document ids, through closures or fields) become
*parameters*, indexed by index expressions; every Python number in the graph becomes a runtime
argument. So the generated code depends only on the graph's structure: new numbers, new
tensor values, new lengths and in-place changes need no new compilation and are always seen.

Reads and integers mean what eager PyTorch computes from the same functions on int64 indices:
an index in ``[-size, 0)`` counts from the end of its dimension, any other outside the tensor
is an ``IndexError`` (each call's reads are proven in range on the host before anything runs,
:meth:`TracedMods.check_reads`; the generated code wraps negative indices, and its clamp only
guards the memory), and an integer operation whose values may leave 32 bits runs in 64
(:func:`_wide_nodes`).

What cannot be compiled is refused when traced, with the function's name and the operator: a
Python ``if``, ``and``, ``or`` or ``bool()`` on a traced value (a data-dependent branch), and
any operator outside :data:`SUPPORTED`.

Nothing here knows about bias classes: the front-end hands in plain callables.

Shape legend (grid evaluation): ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import linecache
import math
import numbers
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "EXACT_LIMIT",
    "SUPPORTED",
    "CompiledMods",
    "ModTraceError",
    "Sym",
    "TracedMods",
    "jit_from_source",
    "trace_mods",
    "with_flat_mods",
]

INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")


class ModTraceError(TypeError):
    """A mask or score function uses something the compiler cannot turn into kernel code."""


def _way_out(name: str) -> str:
    return (
        f"write {name} with tensor operations only (torch.where for choices, & | ~ for logic), "
        f"or give the bias a materialize() and needs_materialization() -> True to run it "
        f"unfused"
    )


# -- the graph ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """One operation: ``op`` on ``args`` (node ids, or for "input" / "const" / "load" their own
    payload), giving a value of ``kind`` ("bool", "int" or "float")."""

    op: str
    args: tuple[Any, ...]
    kind: str


_KIND_OF_DTYPE = {
    torch.bool: "bool",
    torch.uint8: "int",
    torch.int8: "int",
    torch.int16: "int",
    torch.int32: "int",
    torch.int64: "int",
    torch.float16: "float",
    torch.bfloat16: "float",
    torch.float32: "float",
    torch.float64: "float",
}


def _promote(*kinds: str) -> str:
    if "float" in kinds:
        return "float"
    return "int"


class _Tracer:
    def __init__(self, name: str) -> None:
        self.name = name  # the function's name, for errors
        self.nodes: list[Node] = []
        self.memo: dict[Node, int] = {}
        self.params: list[Tensor] = []
        self.consts: list[int | float] = []

    def add(self, op: str, args: tuple[Any, ...], kind: str) -> Sym:
        node = Node(op, args, kind)
        found = self.memo.get(node)
        if found is None:
            found = self.memo[node] = len(self.nodes)
            self.nodes.append(node)
        return Sym(self, found)

    def const(self, value: Any) -> Sym:
        if isinstance(value, bool):
            return self.add("bool", (bool(value),), "bool")
        if isinstance(value, numbers.Integral):
            value = int(value)
            kind = "int"
        elif isinstance(value, numbers.Real):
            value = float(value)
            kind = "float"
        else:
            raise self.error(f"a value of type {type(value).__name__} ({value!r})")
        # a slot per number met, equal values or not: the graph (and the generated source)
        # then depends on where the function uses numbers, never on which values they have
        self.consts.append(value)
        return self.add("const", (len(self.consts) - 1,), kind)

    def lift(self, value: Any) -> Sym:
        """A traced value for an operand: a Sym as it is, a number as a runtime constant, a
        tensor of one element as a parameter read at its only element."""
        if isinstance(value, Sym):
            if value.tracer is not self:
                raise self.error("a value traced by another function")
            return value
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise self.error(
                    f"a tensor of shape {tuple(value.shape)} used as a whole (index it with "
                    f"the index arguments, e.g. table[h, kv_idx - q_idx])"
                )
            return self.load(value, [0] * value.dim())
        return self.const(value)

    def param(self, tensor: Tensor) -> int:
        for slot, known in enumerate(self.params):
            if known is tensor:
                return slot
        if tensor.dtype not in _KIND_OF_DTYPE:
            raise self.error(f"a tensor of dtype {tensor.dtype}")
        self.params.append(tensor)
        return len(self.params) - 1

    def load(self, tensor: Tensor, index: Sequence[Any]) -> Sym:
        if len(index) != tensor.dim():
            raise self.error(
                f"indexing a tensor of shape {tuple(tensor.shape)} with {len(index)} indices "
                f"(give one index per dimension, so that each score reads one element)"
            )
        ids = []
        for item in index:
            sym = self.lift(item)
            if sym.kind == "float":
                raise self.error("indexing a tensor with a float value")
            ids.append(sym.node)
        slot = self.param(tensor)
        return self.add("load", (slot, *ids), _KIND_OF_DTYPE[tensor.dtype])

    def error(self, what: str) -> ModTraceError:
        return ModTraceError(f"{self.name}: {what} cannot be compiled into the kernels; "
                             f"{_way_out(self.name)}")  # fmt: skip


def _arith(a: str, b: str) -> str:
    return _promote(a, b)


def _true_div(a: str, b: str) -> str:
    return "float"


def _compare(a: str, b: str) -> str:
    return "bool"


def _logic(a: str, b: str) -> str:
    if a == "float" or b == "float":
        raise ModTraceError("&, | and ^ take booleans or integers, not floats")
    return "bool" if a == b == "bool" else "int"


class Sym:
    """A traced value: an index, the score, or what a function computed from them."""

    __slots__ = ("node", "tracer")

    def __init__(self, tracer: _Tracer, node: int) -> None:
        self.tracer = tracer
        self.node = node

    @property
    def kind(self) -> str:
        return self.tracer.nodes[self.node].kind

    def _op(self, other: Any, op: str, rule: Callable[[str, str], str], swap: bool = False) -> Sym:
        tracer = self.tracer
        a, b = self, tracer.lift(other)
        if swap:
            a, b = b, a
        return tracer.add(op, (a.node, b.node), rule(a.kind, b.kind))

    def __add__(self, other: Any) -> Sym:
        return self._op(other, "add", _arith)

    def __radd__(self, other: Any) -> Sym:
        return self._op(other, "add", _arith, swap=True)

    def __sub__(self, other: Any) -> Sym:
        return self._op(other, "sub", _arith)

    def __rsub__(self, other: Any) -> Sym:
        return self._op(other, "sub", _arith, swap=True)

    def __mul__(self, other: Any) -> Sym:
        return self._op(other, "mul", _arith)

    def __rmul__(self, other: Any) -> Sym:
        return self._op(other, "mul", _arith, swap=True)

    def __truediv__(self, other: Any) -> Sym:
        return self._op(other, "truediv", _true_div)

    def __rtruediv__(self, other: Any) -> Sym:
        return self._op(other, "truediv", _true_div, swap=True)

    def __floordiv__(self, other: Any) -> Sym:
        return self._op(other, "floordiv", _arith)

    def __rfloordiv__(self, other: Any) -> Sym:
        return self._op(other, "floordiv", _arith, swap=True)

    def __mod__(self, other: Any) -> Sym:
        return self._op(other, "mod", _arith)

    def __rmod__(self, other: Any) -> Sym:
        return self._op(other, "mod", _arith, swap=True)

    def __and__(self, other: Any) -> Sym:
        return self._op(other, "and", _logic)

    def __rand__(self, other: Any) -> Sym:
        return self._op(other, "and", _logic, swap=True)

    def __or__(self, other: Any) -> Sym:
        return self._op(other, "or", _logic)

    def __ror__(self, other: Any) -> Sym:
        return self._op(other, "or", _logic, swap=True)

    def __xor__(self, other: Any) -> Sym:
        return self._op(other, "xor", _logic)

    def __rxor__(self, other: Any) -> Sym:
        return self._op(other, "xor", _logic, swap=True)

    def __lt__(self, other: Any) -> Sym:
        return self._op(other, "lt", _compare)

    def __le__(self, other: Any) -> Sym:
        return self._op(other, "le", _compare)

    def __gt__(self, other: Any) -> Sym:
        return self._op(other, "gt", _compare)

    def __ge__(self, other: Any) -> Sym:
        return self._op(other, "ge", _compare)

    def __eq__(self, other: Any) -> Sym:  # type: ignore[override]
        return self._op(other, "eq", _compare)

    def __ne__(self, other: Any) -> Sym:  # type: ignore[override]
        return self._op(other, "ne", _compare)

    __hash__ = None  # type: ignore[assignment]

    def __neg__(self) -> Sym:
        return self.tracer.add("neg", (self.node,), "int" if self.kind == "bool" else self.kind)

    def __pos__(self) -> Sym:
        return self

    def __abs__(self) -> Sym:
        return self.tracer.add("abs", (self.node,), "int" if self.kind == "bool" else self.kind)

    def __invert__(self) -> Sym:
        if self.kind == "float":
            raise self.tracer.error("~ of a float value")
        return self.tracer.add("not" if self.kind == "bool" else "invert", (self.node,), self.kind)

    def __pow__(self, other: Any) -> Sym:
        """``x ** n`` for a whole ``n`` in 0..8 (products) and ``x ** 0.5`` (a square root);
        any other exponent is refused."""
        if (
            isinstance(other, numbers.Integral)
            and not isinstance(other, bool)
            and 0 <= int(other) <= 8
        ):
            result: Sym = self.tracer.lift(1 if self.kind != "float" else 1.0)
            for _ in range(int(other)):
                result = result * self
            return result
        if isinstance(other, numbers.Real) and float(other) == 0.5:
            return _unary_float(self, "sqrt")
        raise self.tracer.error(
            f"x ** {other!r} (only whole exponents 0 to 8 and 0.5 compile; write "
            f"torch.exp(y * torch.log(x)) for x > 0)"
        )

    def __rpow__(self, base: Any) -> Sym:
        """``c ** x`` for a number ``c > 0``: ``exp(x * ln c)``."""
        if isinstance(base, numbers.Real) and not isinstance(base, bool) and float(base) > 0:
            return _exp_of(self * math.log(float(base)))
        raise self.tracer.error(f"{base!r} ** x (only a positive number as the base compiles)")

    def exp2(self) -> Sym:
        return _exp_of(self * math.log(2.0))

    def expm1(self) -> Sym:
        return _exp_of(self) - 1.0

    def log2(self) -> Sym:
        return _unary_float(self, "log") * (1.0 / math.log(2.0))

    def log10(self) -> Sym:
        return _unary_float(self, "log") * (1.0 / math.log(10.0))

    def log1p(self) -> Sym:
        return _unary_float(self + 1.0, "log")

    def rsqrt(self) -> Sym:
        return 1.0 / _unary_float(self, "sqrt")

    def square(self) -> Sym:
        return self * self

    def __bool__(self) -> bool:
        raise ModTraceError(
            f"{self.tracer.name}: a Python if, and, or, not or bool() on a value computed from "
            f"the indices or the score is a data-dependent branch, which cannot be compiled "
            f"into the kernels; {_way_out(self.tracer.name)}"
        )

    def __index__(self) -> int:
        raise self.tracer.error("a traced value used as a Python integer (e.g. in range())")

    __int__ = __float__ = __index__

    def __iter__(self) -> Any:
        raise self.tracer.error("iterating over a traced value")

    def __getitem__(self, index: Any) -> Any:
        raise self.tracer.error("indexing a traced value (index the tensor parameter instead)")

    def __repr__(self) -> str:
        node = self.tracer.nodes[self.node]
        return f"Sym({node.op}, kind={node.kind})"

    # -- tensor methods FlexAttention functions use -----------------------------------------

    def to(self, *args: Any, **kwargs: Any) -> Sym:
        dtype = kwargs.get("dtype")
        for arg in args:
            if isinstance(arg, torch.dtype):
                dtype = arg
        if dtype is None:
            return self  # a device move
        return _cast(self, dtype)

    def float(self) -> Sym:
        return _cast(self, torch.float32)

    def double(self) -> Sym:
        return _cast(self, torch.float64)

    def half(self) -> Sym:
        return _cast(self, torch.float16)

    def bfloat16(self) -> Sym:
        return _cast(self, torch.bfloat16)

    def int(self) -> Sym:
        return _cast(self, torch.int32)

    def long(self) -> Sym:
        return _cast(self, torch.int64)

    def bool(self) -> Sym:
        return _cast(self, torch.bool)

    def abs(self) -> Sym:
        return abs(self)

    def clamp(self, min: Any = None, max: Any = None) -> Sym:
        return _clamp(self, min, max)

    clip = clamp

    def clamp_min(self, min: Any) -> Sym:
        return _clamp(self, min, None)

    def clamp_max(self, max: Any) -> Sym:
        return _clamp(self, None, max)

    def exp(self) -> Sym:
        return _unary_float(self, "exp")

    def log(self) -> Sym:
        return _unary_float(self, "log")

    def tanh(self) -> Sym:
        return _unary_float(self, "tanh")

    def sqrt(self) -> Sym:
        return _unary_float(self, "sqrt")

    def sigmoid(self) -> Sym:
        return _unary_float(self, "sigmoid")

    def logical_not(self) -> Sym:
        return ~_cast(self, torch.bool)

    # -- one value per pair, as FlexAttention's and_masks / or_masks / noop_mask make it ------

    @property
    def device(self) -> None:
        """Where a new value would live: the kernels decide (``new_ones(device=...)``)."""
        return None

    def new_ones(self, *size: Any, **kwargs: Any) -> Sym:
        return _filled(self, 1, size, size_kw=kwargs.pop("size", None), **kwargs)

    def new_zeros(self, *size: Any, **kwargs: Any) -> Sym:
        return _filled(self, 0, size, size_kw=kwargs.pop("size", None), **kwargs)

    def new_full(self, size: Any, fill_value: Any, **kwargs: Any) -> Sym:
        return _filled(self, fill_value, (size,), **kwargs)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        tracer = next(
            a.tracer for a in _flat((args, kwargs)) if isinstance(a, Sym)
        )  # some argument is traced, or this would not be called
        handler = _TORCH_FUNCTIONS.get(func)
        if handler is None:
            name = getattr(func, "__name__", repr(func))
            raise tracer.error(f"the operator {name}")
        return handler(tracer, *args, **kwargs)


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flat(item)]
    if isinstance(value, dict):
        return [x for item in value.values() for x in _flat(item)]
    return [value]


def _cast(value: Sym, dtype: torch.dtype) -> Sym:
    kind = _KIND_OF_DTYPE.get(dtype)
    if kind is None:
        raise value.tracer.error(f"a cast to {dtype}")
    width = 64 if dtype == torch.int64 else 32
    return value.tracer.add("cast", (value.node, kind, width), kind)


def _unary_float(value: Sym, op: str) -> Sym:
    return value.tracer.add(op, (value.tracer.lift(value).node,), "float")


def _exp_of(value: Sym) -> Sym:
    return _unary_float(value, "exp")


def _filled(
    like: Sym,
    value: Any,
    size: tuple[Any, ...],
    *,
    dtype: torch.dtype | None = None,
    device: Any = None,
    requires_grad: bool = False,
    layout: Any = None,
    pin_memory: bool = False,
    size_kw: Any = None,
) -> Sym:
    """A new value of shape ``()`` (one per pair) filled with ``value``, of ``dtype`` (or
    ``like``'s kind): ``b.new_ones((), dtype=torch.bool)`` is the constant ``True``."""
    del device, requires_grad, layout, pin_memory
    shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    if size_kw is not None:
        shape = size_kw
    if tuple(shape) != ():
        raise like.tracer.error(
            f"a new tensor of size {tuple(shape)} (each pair computes one value: use size ())"
        )
    kind = like.kind if dtype is None else _KIND_OF_DTYPE.get(dtype)
    if kind == "bool":
        return like.tracer.const(bool(value))
    if kind == "int":
        return like.tracer.const(int(value))
    if kind == "float":
        return like.tracer.const(float(value))
    raise like.tracer.error(f"a new value of dtype {dtype}")


def _clamp(value: Any, low: Any, high: Any) -> Sym:
    if isinstance(low, Tensor) or isinstance(high, Tensor):
        tensor = low if isinstance(low, Tensor) else high
        if not isinstance(value, Sym):
            raise ModTraceError(f"clamp of a tensor of shape {tuple(tensor.shape)}")
    tracer = value.tracer
    result = tracer.lift(value)
    if low is not None:
        result = _minmax(tracer, "maximum", result, low)
    if high is not None:
        result = _minmax(tracer, "minimum", result, high)
    return result


def _minmax(tracer: _Tracer, op: str, a: Any, b: Any) -> Sym:
    x, y = tracer.lift(a), tracer.lift(b)
    return tracer.add(op, (x.node, y.node), _promote(x.kind, y.kind))


def _where(tracer: _Tracer, condition: Any, a: Any, b: Any) -> Sym:
    c = tracer.lift(condition)
    if c.kind != "bool":
        c = _cast(c, torch.bool)
    x, y = tracer.lift(a), tracer.lift(b)
    kind = "bool" if x.kind == y.kind == "bool" else _promote(x.kind, y.kind)
    return tracer.add("where", (c.node, x.node, y.node), kind)


def _getitem(tracer: _Tracer, tensor: Any, index: Any) -> Any:
    if not isinstance(tensor, Tensor):
        raise tracer.error("indexing something that is not a tensor parameter")
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not isinstance(i, (Sym, numbers.Integral)) or isinstance(i, bool) for i in items):
        raise tracer.error(
            "indexing a tensor with slices, None, Ellipsis or tensors (give one integer index "
            "per dimension)"
        )
    if len(items) < tensor.dim():
        return _Partial(tracer, tensor, items)
    return tracer.load(tensor, items)


@dataclass
class _Partial:
    """A tensor parameter indexed in fewer dimensions than it has (``docs[b]``): indexed
    again (``docs[b][q_idx]``) it reads one element."""

    tracer: _Tracer
    tensor: Tensor
    index: list[Any]

    def __getitem__(self, index: Any) -> Any:
        items = list(index) if isinstance(index, tuple) else [index]
        return _getitem(self.tracer, self.tensor, tuple(self.index + items))

    def __getattr__(self, name: str) -> Any:
        raise self.tracer.error(
            f"a tensor indexed in {len(self.index)} of its {self.tensor.dim()} dimensions "
            f"(.{name}); index every dimension"
        )


def _unary_torch(op: str) -> Callable[..., Sym]:
    def handler(tracer: _Tracer, value: Any, *, out: Any = None) -> Sym:
        if out is not None:
            raise tracer.error(f"{op}(..., out=...)")
        return _unary_float(tracer.lift(value), op)

    return handler


def _binary_torch(method: str) -> Callable[..., Sym]:
    def handler(tracer: _Tracer, a: Any, b: Any) -> Sym:
        return getattr(tracer.lift(a), method)(b)

    return handler


def _to(tracer: _Tracer, value: Any, *args: Any, **kwargs: Any) -> Sym:
    return tracer.lift(value).to(*args, **kwargs)


def _method(name: str) -> Callable[..., Sym]:
    def handler(tracer: _Tracer, value: Any, *args: Any, **kwargs: Any) -> Sym:
        return getattr(tracer.lift(value), name)(*args, **kwargs)

    return handler


def _not_supported(name: str) -> Callable[..., Sym]:
    def handler(tracer: _Tracer, *args: Any, **kwargs: Any) -> Sym:
        raise tracer.error(f"the operator {name}")

    return handler


def _torch_functions() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {
        torch.where: lambda tracer, c, a, b: _where(tracer, c, a, b),
        torch.minimum: lambda tracer, a, b: _minmax(tracer, "minimum", a, b),
        torch.maximum: lambda tracer, a, b: _minmax(tracer, "maximum", a, b),
        torch.clamp: lambda tracer, x, min=None, max=None: _clamp(tracer.lift(x), min, max),
        torch.clip: lambda tracer, x, min=None, max=None: _clamp(tracer.lift(x), min, max),
        torch.abs: lambda tracer, x: abs(tracer.lift(x)),
        torch.logical_not: lambda tracer, x: ~_cast(tracer.lift(x), torch.bool),
        torch.logical_and: lambda tracer, a, b: (
            _cast(tracer.lift(a), torch.bool) & _cast(tracer.lift(b), torch.bool)
        ),
        torch.logical_or: lambda tracer, a, b: (
            _cast(tracer.lift(a), torch.bool) | _cast(tracer.lift(b), torch.bool)
        ),
        torch.floor_divide: _binary_torch("__floordiv__"),
        torch.remainder: _binary_torch("__mod__"),
        torch.add: _binary_torch("__add__"),
        torch.sub: _binary_torch("__sub__"),
        torch.mul: _binary_torch("__mul__"),
        torch.div: lambda tracer, a, b, rounding_mode=None: (
            tracer.lift(a) / b
            if rounding_mode is None
            else tracer.lift(a) // b
            if rounding_mode == "floor"
            else _not_supported("div(rounding_mode='trunc')")(tracer)
        ),
        torch.eq: _binary_torch("__eq__"),
        torch.ne: _binary_torch("__ne__"),
        torch.lt: _binary_torch("__lt__"),
        torch.le: _binary_torch("__le__"),
        torch.gt: _binary_torch("__gt__"),
        torch.ge: _binary_torch("__ge__"),
        torch.ones_like: lambda tracer, x, **kw: _filled(tracer.lift(x), 1, ((),), **kw),
        torch.zeros_like: lambda tracer, x, **kw: _filled(tracer.lift(x), 0, ((),), **kw),
        torch.full_like: lambda tracer, x, value, **kw: _filled(tracer.lift(x), value, ((),), **kw),
        Tensor.__getitem__: _getitem,
        Tensor.to: _to,
        Tensor.__bool__: lambda tracer, x: bool(tracer.lift(x)),
    }
    for name in ("exp", "log", "tanh", "sqrt", "sigmoid"):
        table[getattr(torch, name)] = _unary_torch(name)
        table[getattr(Tensor, name)] = _unary_torch(name)
    # the rest of the exp / log family, written with exp and log
    for name in ("exp2", "expm1", "log2", "log10", "log1p", "rsqrt", "square"):
        for owner in (torch, Tensor):
            table[getattr(owner, name)] = lambda tracer, value, name=name: getattr(
                tracer.lift(value), name
            )()
    table[torch.pow] = lambda tracer, a, b: (
        a.__pow__(b) if isinstance(a, Sym) else tracer.lift(b).__rpow__(a)
    )
    table[Tensor.pow] = table[torch.pow]
    for name in ("float", "double", "half", "bfloat16", "int", "long", "bool", "abs"):
        table[getattr(Tensor, name)] = _method(name)
    for name in ("clamp", "clip", "clamp_min", "clamp_max"):
        table[getattr(Tensor, name)] = _method(name)
    # Python operators reach here when a plain tensor is the left operand (table + sym)
    operators = {
        "__add__": "__radd__", "__radd__": "__add__", "__sub__": "__rsub__",
        "__rsub__": "__sub__", "__mul__": "__rmul__", "__rmul__": "__mul__",
        "__truediv__": "__rtruediv__", "__rtruediv__": "__truediv__",
        "__floordiv__": "__rfloordiv__", "__rfloordiv__": "__floordiv__",
        "__mod__": "__rmod__", "__rmod__": "__mod__", "__and__": "__rand__",
        "__rand__": "__and__", "__or__": "__ror__", "__ror__": "__or__",
        "__lt__": "__gt__", "__le__": "__ge__", "__gt__": "__lt__", "__ge__": "__le__",
        "__eq__": "__eq__", "__ne__": "__ne__",
    }  # fmt: skip
    for name, mirrored in operators.items():

        def handler(tracer: _Tracer, a: Any, b: Any, mirrored: str = mirrored) -> Sym:
            # ``a`` is a tensor (or a Sym when the mirrored form was tried first)
            if isinstance(a, Sym):
                return getattr(a, {v: k for k, v in operators.items()}[mirrored])(b)
            return getattr(tracer.lift(b), mirrored)(a)

        table[getattr(Tensor, name)] = handler
    return table


_TORCH_FUNCTIONS = _torch_functions()

#: What a mask or score function may use, in words (for the documentation and errors).
SUPPORTED = (
    "+ - * / // % on numbers and indices, comparisons, & | ^ ~, abs, torch.where, "
    "torch.minimum / maximum, clamp, exp, exp2, expm1, log, log2, log10, log1p, tanh, sqrt, "
    "rsqrt, square, sigmoid, x ** n (n whole, 0 to 8, or 0.5), c ** x (c > 0), casts "
    "(.to(dtype), .float(), .long(), ...), new_ones / ones_like of size (), and tensor "
    "parameters indexed with one index expression per dimension"
)


# -- tracing -----------------------------------------------------------------------------------


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

    # -- evaluation with torch operations on a grid -------------------------------------------

    def _evaluate(self, wanted: Sequence[int], values: dict[str, Tensor]) -> list[Tensor]:
        cache: dict[int, Any] = {}
        for name, node_id in self.inputs.items():
            if name in values:
                cache[node_id] = values[name]
        needed = set().union(*(self.ancestors(i) for i in wanted))
        for node_id in sorted(needed - set(cache)):  # a node comes after its inputs
            cache[node_id] = _TORCH_EVAL[self.nodes[node_id].op](self, self.nodes[node_id], cache)
        return [cache[i] for i in wanted]

    def evaluate(self, node_id: int, **values: Tensor) -> Tensor:
        """The value of ``node_id`` on broadcast index tensors named as the inputs (``b``,
        ``h``, ``q_idx``, ``kv_idx``, ``score``); those it depends on must be given."""
        (result,) = self._evaluate([node_id], values)
        return torch.as_tensor(result)

    def mask_grid(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor | None:
        """The masks on broadcast int64 index tensors: bool, their broadcast shape (``None``
        without masks)."""
        if not self.masks:
            return None
        values = dict(zip(INDEX_NAMES, (b, h, q_idx, kv_idx), strict=True))
        results = self._evaluate([f.result for f in self.masks], values)
        keep = torch.ones((), dtype=torch.bool, device=q_idx.device)
        for result in results:
            keep = keep & torch.as_tensor(result, device=q_idx.device).bool()
        # a mask that reads no index (a constant True or False) still covers the grid
        return keep.expand(torch.broadcast_shapes(keep.shape, q_idx.shape, kv_idx.shape))

    def score_grid(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        """The score functions applied in order to ``score`` (differentiable in the score and
        in the parameters)."""
        if not self.scores:
            return score
        values = dict(zip(INDEX_NAMES, (b, h, q_idx, kv_idx), strict=True), score=score)
        # each score function was traced on the result of the one before: the last is all
        (result,) = self._evaluate([self.scores[-1].result], values)
        return result

    def additive_score(self) -> bool:
        """Whether the score functions only add something that does not depend on the score
        (``score + g(b, h, q_idx, kv_idx)``, chained), so that they have an additive form:
        :meth:`score_grid` of a zero score."""
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

    # -- tensor reads: within their tensors, as eager PyTorch indexes --------------------------

    def check_reads(self, batch: int | None, heads: int, length_q: int, length_kv: int) -> None:
        """Prove that every tensor read of the functions stays within its tensor on a call of
        ``(B, Hq, L, S)`` = ``(batch, heads, length_q, length_kv)`` (``batch`` ``None``: one
        row): each index in ``[-size, size)``, a negative one counting from the end as in
        eager PyTorch. The kernels rely on it (they wrap negative indices and clamp only as a
        memory guard).

        Interval bounds of every node over the call's positions first (no device work); then
        the integer tensors read on the way to an index still unbounded, bounded by their
        least and greatest values (one host synchronisation per new version of them); then an
        index still unbounded is evaluated on the grid of the positions it reads (at most
        :data:`EXACT_LIMIT` of them). A proof is kept per call shape, numbers and tensors
        (with the versions of those whose values it read), so a repeated call costs a lookup
        and a comparison of them.

        Raises:
            IndexError: a read reaches outside its tensor; the message names the function,
                the tensor, the dimension, its size and the range the indices reach.
            ValueError: a read cannot be proven in range: an index of too many positions or of
                the score, or a proof that needs tensor values while ``torch.compile`` traces
                or a CUDA graph is being captured.
        """
        shape = (1 if batch is None else batch, heads, length_q, length_kv)
        proven: dict[Any, Any] | None = self.__dict__.get("_proven")
        if proven is None:
            proven = self.__dict__["_proven"] = {}
        found = proven.get(shape)
        if found is not None and _still_proven(found, self):
            return
        reads = self._reads()
        if not reads or min(shape) <= 0:
            return
        if torch.compiler.is_compiling():
            _prove_reads(self, shape, reads)  # bounds alone: no synchronisation, nothing kept
            return
        used, deferred = _prove_reads(self, shape, reads)
        versions = tuple((slot, _version(self.params[slot])) for slot in used)
        if not deferred and all(version is not None for _, version in versions):
            if len(proven) >= _PROVEN_LIMIT:
                proven.pop(next(iter(proven)), None)
            proven[shape] = (
                list(self.consts),
                tuple(weakref.ref(p) for p in self.params),
                tuple(p.shape for p in self.params),
                versions,
            )

    def proven_on_device(
        self, shape: tuple[int, int, int, int], read: tuple[int, int], key: Any
    ) -> None:
        """Keep that the device found ``read`` within its tensor on a call of ``shape``, for
        the numbers and tensor versions of :meth:`proof_key` ``key`` (those of the check)."""
        kept = self.__dict__.setdefault("_device_proven", {})
        if len(kept) >= _PROVEN_LIMIT:
            kept.clear()
        kept[shape, read] = key

    def proof_key(self, read: tuple[int, int]) -> tuple[Any, ...]:
        """The numbers, and the tensors (by identity and version) ``read``'s index reads."""
        tables = _tables(self, _index_of(self, read))
        return (
            tuple((type(c), c) for c in self.consts),
            tuple((slot, id(self.params[slot]), _version(self.params[slot])) for slot in tables),
        )

    def read_versions(self) -> tuple[int, ...] | None:
        """The versions of the tensors that the indices of reads are computed from (``ids`` of
        ``table[ids[q_idx]]``), whose values :meth:`check_reads` may read: a cache of calls
        that skips it must hold them, so that a call after an in-place write proves its reads
        again. ``None`` where one has no version counter (an inference tensor: such calls are
        not for a cache)."""
        found = self.__dict__.get("_index_tables")
        if found is None:
            found = self.__dict__["_index_tables"] = sorted(
                {
                    self.nodes[i].args[0]
                    for read in self._reads()
                    for i in self.ancestors(_index_of(self, read))
                    if self.nodes[i].op == "load"
                }
            )
        versions = [_version(self.params[slot]) for slot in found]
        return None if None in versions else tuple(v for v in versions if v is not None)

    def _reads(self) -> list[tuple[int, int]]:
        """``(load node, dimension)`` of every read the functions make, in node order."""
        found = self.__dict__.get("_read_list")
        if found is None:
            results = [f.result for f in (*self.masks, *self.scores)]
            needed = set().union(*(self.ancestors(r) for r in results)) if results else set()
            found = [
                (node_id, dim)
                for node_id in sorted(needed)
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
            stack.extend(_node_inputs(node))
        return seen


#: An index the interval bounds leave open is evaluated on the grid of the positions it reads
#: where that grid has at most this many elements (:meth:`TracedMods.check_reads`).
EXACT_LIMIT = 2**24
#: Proofs of calls kept per graph (:meth:`TracedMods.check_reads`).
_PROVEN_LIMIT = 32
#: Least and greatest values of integer tensors read as indices, at their version then.
_VALUE_BOUNDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _version(tensor: Tensor) -> int | None:
    """``tensor``'s version counter (an in-place write bumps it), ``None`` where it has none
    (an inference tensor)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


def _still_proven(found: Any, traced: TracedMods) -> bool:
    """Whether a proof kept for a call shape holds for ``traced`` now: the same numbers, the
    same tensors of the same shapes, and those whose values it read at the same versions."""
    numbers, refs, shapes, versions = found
    params = traced.params
    return (
        numbers == traced.consts
        and all(ref() is p for ref, p in zip(refs, params, strict=True))
        and all(p.shape == shape for p, shape in zip(params, shapes, strict=True))
        and all(_version(params[slot]) == version for slot, version in versions)
    )


def _sync_refused(device: torch.device) -> str | None:
    """Why reading a value of ``device`` on the host cannot happen now (``None``: it can)."""
    if torch.compiler.is_compiling():
        return "while torch.compile traces the call"
    if (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    ):
        return "while a CUDA graph is being captured"
    return None


def _index_of(traced: TracedMods, read: tuple[int, int]) -> int:
    node_id, dim = read
    return int(traced.nodes[node_id].args[1 + dim])


def _size_of(traced: TracedMods, read: tuple[int, int]) -> int:
    node_id, dim = read
    return int(traced.params[traced.nodes[node_id].args[0]].shape[dim])


def _out_of_range(
    traced: TracedMods,
    read: tuple[int, int],
    low: float,
    high: float,
    shape: tuple[int, ...] | None = None,
) -> IndexError:
    """The error of a read whose indices reach ``[low, high]``, beyond its tensor."""
    node_id, dim = read
    param = traced.params[traced.nodes[node_id].args[0]]
    size = _size_of(traced, read)
    call = "" if shape is None else f" on a call of (B, Hq, L, S)={shape}"
    bound = f" (.clamp(0, {size - 1}) or % {size})" if size > 0 else ""
    return IndexError(
        f"{traced.function_of(node_id)} reads a tensor of shape {tuple(param.shape)} "
        f"({param.dtype}) at dim {dim} with indices reaching [{int(low)}, {int(high)}]{call}, "
        f"outside its size {size} (indices in [-{size}, {size - 1}] read as eager PyTorch "
        f"does, negative ones from the end); make the tensor cover every position, or bound "
        f"the index in the function{bound}"
    )


def _unproven(traced: TracedMods, read: tuple[int, int], why: str) -> ValueError:
    """The error of a read that cannot be proven within its tensor, ``why``."""
    node_id, dim = read
    param = traced.params[traced.nodes[node_id].args[0]]
    size = _size_of(traced, read)
    return ValueError(
        f"{traced.function_of(node_id)} reads a tensor of shape {tuple(param.shape)} "
        f"({param.dtype}) at dim {dim} with an index that cannot be proven within "
        f"[-{size}, {size - 1}]: {why}; bound the index in the function (.clamp(0, "
        f"{max(size - 1, 0)}) or % {size}) so that its range is known without the call"
    )


def _within(traced: TracedMods, ranges: list[_Range], read: tuple[int, int]) -> bool:
    low, high, _ = ranges[_index_of(traced, read)]
    size = _size_of(traced, read)
    return -size <= low and high < size


def _tight(traced: TracedMods, node_id: int) -> bool:
    """Whether interval arithmetic bounds ``node_id`` exactly: sums, differences, negations,
    minima and maxima of positions and numbers (and products with a number), each position
    used once, every corner of the call's grid then being reached."""
    seen: set[int] = set()

    def walk(current: int) -> bool:
        node = traced.nodes[current]
        if node.op == "const":
            return True
        if node.op == "input":
            if node.args[0] == "score" or current in seen:
                return False
            seen.add(current)
            return True
        if node.op == "cast":
            source = traced.nodes[node.args[0]].kind
            return node.args[1:] == ("int", 64) and source == "int" and walk(node.args[0])
        if node.op in ("add", "sub", "minimum", "maximum"):
            return all(walk(arg) for arg in node.args)
        if node.op == "neg":
            return walk(node.args[0])
        if node.op == "mul":
            consts = [arg for arg in node.args if traced.nodes[arg].op == "const"]
            others = [arg for arg in node.args if traced.nodes[arg].op != "const"]
            return len(consts) >= 1 and all(walk(arg) for arg in others)
        return False

    return walk(node_id)


def _tables(traced: TracedMods, index: int) -> list[int]:
    """The slots of the tensors whose values node ``index`` is computed from."""
    return sorted(
        {traced.nodes[i].args[0] for i in traced.ancestors(index) if traced.nodes[i].op == "load"}
    )


def _integer_tables(traced: TracedMods, index: int) -> list[int]:
    """The slots of the integer tensors whose values ``index`` is computed from."""
    return sorted(
        {
            traced.nodes[i].args[0]
            for i in traced.ancestors(index)
            if traced.nodes[i].op == "load" and traced.nodes[i].kind == "int"
        }
    )


def _tensor_bounds(
    traced: TracedMods, slots: list[int], read: tuple[int, int]
) -> dict[int, _Range]:
    """The least and greatest values of the integer tensors in ``slots``, by slot: kept per
    tensor and version, the others read in one host synchronisation (refused where none can
    happen, naming ``read``, the read that needs them). Empty tensors are left out."""
    why = "its range depends on the values of an integer tensor, which cannot be read"
    if torch.compiler.is_compiling():  # (a traced graph cannot read them, nor keep them)
        raise _unproven(traced, read, f"{why} while torch.compile traces the call")
    found: dict[int, _Range] = {}
    fresh = []
    for slot in slots:
        param = traced.params[slot]
        if param.numel() == 0:
            continue
        version = _version(param)
        kept = _VALUE_BOUNDS.get(param) if version is not None else None
        if kept is not None and kept[0] == (version, tuple(param.shape)):
            found[slot] = kept[1]
        else:
            fresh.append(slot)
    if not fresh:
        return found
    refusal = _sync_refused(traced.params[fresh[0]].device)
    if refusal is not None:
        raise _unproven(
            traced,
            read,
            f"{why} {refusal} (run the call once before capturing: the values read then are "
            f"kept until the tensor changes)",
        )
    extremes = torch.stack(
        [
            torch.stack(torch.aminmax(traced.params[slot].detach().reshape(-1))).to(torch.int64)
            for slot in fresh
        ]
    ).tolist()  # one host synchronisation
    for slot, (low, high) in zip(fresh, extremes, strict=True):
        param = traced.params[slot]
        found[slot] = (float(low), float(high), False)
        version = _version(param)
        if version is not None:
            _VALUE_BOUNDS[param] = ((version, tuple(param.shape)), found[slot])
    return found


def _evaluated_bounds(
    traced: TracedMods, read: tuple[int, int], shape: tuple[int, int, int, int]
) -> tuple[int, int] | None:
    """The least and greatest index of ``read`` on the call, evaluated with torch operations
    on the grid of the positions the index reads (on its tensors' device; one host
    synchronisation). Past :data:`EXACT_LIMIT` positions on a GPU, ``None``: the bounds are
    found on the device and read at the next call (:func:`check_errors`). Raises the
    ValueError of :func:`_unproven` where neither can be done (a CPU tensor past the limit,
    an index of the score, a capture or a trace that cannot synchronise)."""
    index = _index_of(traced, read)
    ancestors = traced.ancestors(index)
    if traced.inputs["score"] in ancestors:
        raise _unproven(traced, read, "the index depends on the score")
    names = [name for name in INDEX_NAMES if traced.inputs[name] in ancestors]
    sizes = dict(zip(INDEX_NAMES, shape, strict=True))
    count = math.prod(sizes[name] for name in names)
    tables = _tables(traced, index)
    device = traced.params[tables[0]].device if tables else torch.device("cpu")
    refusal = _sync_refused(device)
    if refusal is not None:
        raise _unproven(
            traced,
            read,
            f"its bounds are not known from the operations, and evaluating it cannot happen "
            f"{refusal}",
        )
    if count > EXACT_LIMIT and _defers(device):
        _check_on_device(traced, read, shape, names, device)
        return None
    if count > EXACT_LIMIT:
        raise _unproven(
            traced,
            read,
            f"its bounds are not known from the operations, and the {count} positions it "
            f"reads on this call are more than the {EXACT_LIMIT} evaluated on the host to find "
            f"them",
        )
    low, high = torch.stack(_index_bounds(traced, index, sizes, names, device)).tolist()
    return int(low), int(high)  # (a synchronisation)


def _index_bounds(
    traced: TracedMods,
    index: int,
    sizes: dict[str, int],
    names: list[str],
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """The least and greatest value of node ``index`` over the grid of the positions ``names``
    of ``sizes``, as int64 tensors on ``device`` (no synchronisation), evaluated in slices of
    at most :data:`EXACT_LIMIT` positions along the longest axis."""
    longest = max(names, key=lambda name: sizes[name])
    rest = math.prod(sizes[name] for name in names if name != longest)
    step = max(1, EXACT_LIMIT // max(rest, 1))
    low = high = None
    for first in range(0, sizes[longest], step):
        grids = {}
        for axis, name in enumerate(INDEX_NAMES):
            if name in names:
                view = [1] * len(INDEX_NAMES)
                stop = min(first + step, sizes[name]) if name == longest else sizes[name]
                start = first if name == longest else 0
                view[axis] = stop - start
                grids[name] = torch.arange(start, stop, device=device).reshape(view)
        value = traced.evaluate(index, **grids).to(device=device, dtype=torch.int64)
        part_low, part_high = torch.aminmax(value.reshape(-1))
        low = part_low if low is None else torch.minimum(low, part_low)
        high = part_high if high is None else torch.maximum(high, part_high)
    assert low is not None and high is not None
    return low, high


def _defers(device: torch.device) -> bool:
    """Whether a read past :data:`EXACT_LIMIT` positions is checked on ``device`` while the
    kernels run (a GPU: no synchronisation) rather than refused (on the CPU that would be
    unbounded host work on every call until it is read)."""
    return device.type != "cpu"


#: Reads checked on the device for a call whose host proof was inconclusive, each with the
#: bounds its indices reached there (no synchronisation yet): read by :func:`check_errors`.
_PENDING: list[
    tuple[TracedMods, tuple[int, int], tuple[int, int, int, int], Tensor, Tensor, Any]
] = []
_PENDING_LOCK = threading.Lock()


def _check_on_device(
    traced: TracedMods,
    read: tuple[int, int],
    shape: tuple[int, int, int, int],
    names: list[str],
    device: torch.device,
) -> None:
    sizes = dict(zip(INDEX_NAMES, shape, strict=True))
    low, high = _index_bounds(traced, _index_of(traced, read), sizes, names, device)
    key = traced.proof_key(read)  # the numbers and versions the check was made with
    with _PENDING_LOCK:
        _PENDING.append((traced, read, shape, low, high, key))


def pending_checks() -> bool:
    """Whether a device-side check of an earlier call's reads is still to be read."""
    return bool(_PENDING)


def check_errors() -> None:
    """Read the device-side checks of earlier calls (one synchronisation, only where one is
    pending): raises the ``IndexError`` of a read that went outside its tensor, naming the
    call; that call's output is not to be trusted (the kernels only kept its loads in
    memory). Called at the start of each eager call of :func:`attnbias.sdpa`."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    for traced, read, shape, low, high, key in pending:
        low_value, high_value = torch.stack((low, high)).tolist()
        size = _size_of(traced, read)
        if low_value < -size or high_value >= size:
            # the same read with the same numbers and tensors raises at once from now on
            failed = traced.__dict__.setdefault("_device_failed", {})
            failed[shape, read] = (key, low_value, high_value)
            error = _out_of_range(traced, read, low_value, high_value, shape)
            raise IndexError(
                f"an earlier call (its index bounds could not be proven on the host, so they "
                f"were checked on the device; its output is wrong): {error}"
            )
        traced.proven_on_device(shape, read, key)


def _prove_reads(
    traced: TracedMods, shape: tuple[int, int, int, int], reads: list[tuple[int, int]]
) -> tuple[list[int], bool]:
    """:meth:`TracedMods.check_reads` for a call of ``shape`` ``(B, Hq, L, S)``, none empty:
    raises where a read is out of range or unproven; returns the slots of the tensors whose
    values the proof read (a proof by bounds alone reads none), and whether a read is left to
    a check on the device (:func:`check_errors`)."""
    inputs = {
        name: (0.0, float(size - 1), False) for name, size in zip(INDEX_NAMES, shape, strict=True)
    }
    ranges = _value_ranges(traced, inputs)
    open_reads = [read for read in reads if not _within(traced, ranges, read)]
    if not open_reads:
        return [], False
    for read in open_reads:
        low, high, _ = ranges[_index_of(traced, read)]
        size = _size_of(traced, read)
        if _tight(traced, _index_of(traced, read)) or high < -size or low >= size:
            raise _out_of_range(traced, read, low, high, shape)
    used: set[int] = set()
    slots = sorted(
        {s for read in open_reads for s in _integer_tables(traced, _index_of(traced, read))}
    )
    if slots:
        loads = _tensor_bounds(traced, slots, open_reads[0])
        used.update(loads)
        ranges = _value_ranges(traced, inputs, loads)
        open_reads = [read for read in open_reads if not _within(traced, ranges, read)]
    deferred = False
    for read in open_reads:
        used.update(_tables(traced, _index_of(traced, read)))
        key = traced.proof_key(read)  # what a check on the device found holds for
        if traced.__dict__.get("_device_proven", {}).get((shape, read)) == key:
            continue
        failed = traced.__dict__.get("_device_failed", {}).get((shape, read))
        if failed is not None and failed[0] == key:
            raise _out_of_range(traced, read, failed[1], failed[2], shape)
        bounds = _evaluated_bounds(traced, read, shape)
        if bounds is None:  # checked on the device, read at the next call
            deferred = True
            continue
        low, high = bounds
        size = _size_of(traced, read)
        if low < -size or high >= size:
            raise _out_of_range(traced, read, low, high, shape)
    return sorted(used), deferred


def _node_inputs(node: Node) -> list[int]:
    if node.op in ("input", "const", "bool"):
        return []
    if node.op == "load":
        return list(node.args[1:])
    if node.op == "cast":
        return [node.args[0]]
    return list(node.args)


def _eval_load(traced: TracedMods, node: Node, cache: dict[int, Any]) -> Tensor:
    """A read as eager PyTorch makes it: an index in ``[-size, 0)`` counts from the end, one
    outside ``[-size, size)`` raises the IndexError of :func:`_out_of_range` (checked on the
    host, except where no synchronisation can happen: :meth:`TracedMods.check_reads` proved
    the call's reads before)."""
    tensor = traced.params[node.args[0]]
    index = []
    for dim, arg in enumerate(node.args[1:]):
        value = torch.as_tensor(cache[arg], device=tensor.device)
        if value.dtype == torch.bool:
            value = value.to(torch.int64)
        size = int(tensor.shape[dim])
        if value.numel() and _sync_refused(tensor.device) is None:
            low, high = torch.stack(torch.aminmax(value.reshape(-1))).tolist()
            if low < -size or high >= size:
                with _PENDING_LOCK:  # raised here: not again by a check of the same call
                    _PENDING[:] = [entry for entry in _PENDING if entry[0] is not traced]
                raise _out_of_range(traced, (traced.id_of(node), dim), low, high)
        index.append(torch.where(value < 0, value + size, value))
    return tensor[tuple(index)] if index else tensor


def _eval_cast(traced: TracedMods, node: Node, cache: dict[int, Any]) -> Tensor:
    value = torch.as_tensor(cache[node.args[0]])
    kind, width = node.args[1], node.args[2]
    if kind == "bool":
        return value != 0
    if kind == "int":
        return value.to(torch.int64 if width == 64 else torch.int32)
    return value.to(torch.float64 if value.dtype == torch.float64 else torch.float32)


def _floordiv(a: Any, b: Any) -> Any:
    return torch.div(torch.as_tensor(a), b, rounding_mode="floor")


def _torch_eval() -> dict[str, Callable[[TracedMods, Node, dict[int, Any]], Any]]:
    def binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
        return lambda traced, node, cache: fn(cache[node.args[0]], cache[node.args[1]])

    def unary(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        return lambda traced, node, cache: fn(torch.as_tensor(cache[node.args[0]]))

    def as_float(x: Any) -> Tensor:
        x = torch.as_tensor(x)
        return x if x.is_floating_point() else x.to(torch.float32)

    return {
        "const": lambda traced, node, cache: traced.consts[node.args[0]],
        "bool": lambda traced, node, cache: node.args[0],
        "load": _eval_load,
        "cast": _eval_cast,
        "add": binary(lambda a, b: a + b),
        "sub": binary(lambda a, b: a - b),
        "mul": binary(lambda a, b: a * b),
        "truediv": binary(lambda a, b: as_float(a) / b),
        "floordiv": binary(_floordiv),
        "mod": binary(lambda a, b: torch.remainder(torch.as_tensor(a), b)),
        "and": binary(lambda a, b: torch.as_tensor(a) & b),
        "or": binary(lambda a, b: torch.as_tensor(a) | b),
        "xor": binary(lambda a, b: torch.as_tensor(a) ^ b),
        "lt": binary(lambda a, b: torch.as_tensor(a) < b),
        "le": binary(lambda a, b: torch.as_tensor(a) <= b),
        "gt": binary(lambda a, b: torch.as_tensor(a) > b),
        "ge": binary(lambda a, b: torch.as_tensor(a) >= b),
        "eq": binary(lambda a, b: torch.as_tensor(a) == b),
        "ne": binary(lambda a, b: torch.as_tensor(a) != b),
        "neg": unary(lambda a: -a.to(torch.int64) if a.dtype == torch.bool else -a),
        "abs": unary(torch.abs),
        "not": unary(torch.logical_not),
        "invert": unary(torch.bitwise_not),
        "minimum": binary(lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b))),
        "maximum": binary(lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b))),
        "where": lambda traced, node, cache: torch.where(
            torch.as_tensor(cache[node.args[0]]),
            torch.as_tensor(cache[node.args[1]]),
            torch.as_tensor(cache[node.args[2]]),
        ),
        "exp": unary(lambda a: torch.exp(as_float(a))),
        "log": unary(lambda a: torch.log(as_float(a))),
        "tanh": unary(lambda a: torch.tanh(as_float(a))),
        "sqrt": unary(lambda a: torch.sqrt(as_float(a))),
        "sigmoid": unary(lambda a: torch.sigmoid(as_float(a))),
    }


_TORCH_EVAL = _torch_eval()


def _function_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return str(name)


def trace_mods(
    masks: Sequence[Callable[..., Any]],
    scores: Sequence[Callable[..., Any]],
    *,
    bind: Callable[[Callable[[Any], tuple[Sym, int]]], tuple[Sequence[Any], Sequence[Any]]]
    | None = None,
) -> TracedMods:
    """Trace mask functions ``f(b, h, q_idx, kv_idx) -> bool`` and score functions
    ``f(score, b, h, q_idx, kv_idx) -> score`` into one graph. Raises :class:`ModTraceError`
    naming the function and the operator it cannot compile.

    ``bind``, where given, makes the functions to trace instead of ``masks`` and ``scores``:
    it receives ``slot_of(number) -> (value, slot)``, which makes a runtime number of the
    trace (a traced value) and says which of :attr:`TracedMods.consts` holds it."""
    tracer = _Tracer("?")
    inputs = {name: tracer.add("input", (name,), "int").node for name in INDEX_NAMES}
    inputs["score"] = tracer.add("input", ("score",), "float").node
    if bind is not None:

        def slot_of(value: Any) -> tuple[Sym, int]:
            sym = tracer.const(value)
            return sym, len(tracer.consts) - 1

        masks, scores = bind(slot_of)
    index_syms = [Sym(tracer, inputs[name]) for name in INDEX_NAMES]
    traced_masks, traced_scores = [], []
    score: Sym = Sym(tracer, inputs["score"])
    for fn in masks:
        tracer.name = f"mask_mod {_function_name(fn)}"
        result = tracer.lift(_call(tracer, fn, index_syms))
        if result.kind != "bool":
            raise ModTraceError(
                f"{tracer.name} returns {'an' if result.kind == 'int' else 'a'} {result.kind} "
                f"value, not a bool: a mask function "
                f"keeps a pair where it returns True (a comparison, e.g. kv_idx <= q_idx); "
                f"write (...) != 0 to keep the pairs where the value is not zero"
            )
        traced_masks.append(_traced(tracer, result.node, inputs))
    for fn in scores:
        tracer.name = f"score_mod {_function_name(fn)}"
        result = tracer.lift(_call(tracer, fn, [score, *index_syms]))
        if result.kind != "float":
            result = _cast(result, torch.float32)
        traced_scores.append(_traced(tracer, result.node, inputs))
        score = result
    return TracedMods(
        tracer.nodes, traced_masks, traced_scores, tracer.params, tracer.consts, inputs
    )


def same_graph(a: TracedMods, b: TracedMods) -> bool:
    """Whether two traces compute the same: from each function's result down, the same
    operations on the same inputs, tensors (by identity) and numbers (by type and value),
    wherever their slots are."""
    table: dict[Any, int] = {}

    def forms(traced: TracedMods) -> list[int]:
        out: list[int] = []
        for node in traced.nodes:
            form: tuple[Any, ...]
            if node.op == "const":
                value = traced.consts[node.args[0]]
                form = ("=", type(value), value.hex() if isinstance(value, float) else value)
            elif node.op == "load":
                form = ("load", id(traced.params[node.args[0]]), *(out[i] for i in node.args[1:]))
            elif node.op == "cast":
                form = ("cast", out[node.args[0]], *node.args[1:])
            elif node.op in ("input", "bool"):
                form = (node.op, *node.args)
            else:
                form = (node.op, *(out[i] for i in node.args))
            out.append(table.setdefault((node.kind, form), len(table)))
        return out

    ours, theirs = forms(a), forms(b)
    return [ours[f.result] for f in a.masks] == [theirs[f.result] for f in b.masks] and [
        ours[f.result] for f in a.scores
    ] == [theirs[f.result] for f in b.scores]


def _call(tracer: _Tracer, fn: Callable[..., Any], args: list[Sym]) -> Any:
    """``fn(*args)``. An exception the function raised itself (its last frame is neither
    this module nor torch's) surfaces as itself, with a note naming the function; one raised
    by an operation on a traced value becomes a :class:`ModTraceError` naming the function
    and what the kernels compile."""
    try:
        return fn(*args)
    except ModTraceError:
        raise
    except Exception as exc:
        if _raised_by_user(exc):
            if hasattr(exc, "add_note"):  # Python 3.11 and later
                exc.add_note(f"(raised by {tracer.name} while attnbias traced it)")
            raise
        if not isinstance(exc, (TypeError, RuntimeError, IndexError, ValueError, AttributeError)):
            raise
        raise ModTraceError(
            f"{tracer.name} failed while being traced ({type(exc).__name__}: {exc}); it may use "
            f"an operator outside what the kernels compile ({SUPPORTED}); "
            f"{_way_out(tracer.name)}"
        ) from exc


_OURS = (__file__, str(Path(torch.__file__).parent))


def _raised_by_user(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` is outside this module and torch (a ``raise``
    in the user's own function), and the error is not about a traced value (a method a
    traced value lacks fails in the function's own frame)."""
    tb = exc.__traceback__
    if tb is None or isinstance(getattr(exc, "obj", None), Sym) or "'Sym'" in str(exc):
        return False  # an operation on a traced value: not the function's own error
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    return not (filename == _OURS[0] or filename.startswith(_OURS[1]))


def _traced(tracer: _Tracer, result: int, inputs: dict[str, int]) -> TracedFunction:
    reads = set()
    stack, seen = [result], set()
    index_ids = {inputs[name]: name for name in INDEX_NAMES}
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in index_ids:
            reads.add(index_ids[current])
        stack.extend(_node_inputs(tracer.nodes[current]))
    return TracedFunction(tracer.name, result, frozenset(reads))


# -- Triton code -------------------------------------------------------------------------------

_HEADER = """\
import triton
import triton.language as tl

from attnbias.kernels.common import _tanh


@triton.jit
def _floordiv(a, b):
    q = a // b
    r = a - q * b
    return q - ((r != 0) & ((r < 0) != (b < 0))).to(q.dtype)


@triton.jit
def _floormod(a, b):
    r = a % b
    return r + tl.where((r != 0) & ((r < 0) != (b < 0)), b, 0)
"""


# -- value ranges: which integer casts of 64 bits can run in 32 ---------------------------------

#: The integers of 32 bits.
_INT32 = (-(2.0**31), 2.0**31 - 1)
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


def _value_ranges(
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
        if width == 32 and not (low >= _INT32[0] and high <= _INT32[1]):
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
    ranges = _value_ranges(traced)
    users: dict[int, list[int]] = {}
    for node_id, node in enumerate(traced.nodes):
        for arg in _node_inputs(node):
            users.setdefault(arg, []).append(node_id)

    def fits(node_id: int) -> bool:
        low, high, nan = ranges[node_id]
        return not nan and low >= _INT32[0] and high <= _INT32[1]

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
    ranges = _value_ranges(traced)
    return frozenset(
        node_id
        for node_id, node in enumerate(traced.nodes)
        if node.kind == "int"
        and node.op in _INT_OPERATIONS
        and not (ranges[node_id][0] >= _INT32[0] and ranges[node_id][1] <= _INT32[1])
    )


def _wrapped_reads(traced: TracedMods) -> frozenset[tuple[int, int]]:
    """``(load node, dimension)`` of the reads whose index may be negative on some call,
    whatever the numbers (``rel[h, kv_idx - q_idx]``): the generated code adds the size to a
    negative index, as eager PyTorch reads it. The others are read as they are."""
    ranges = _value_ranges(traced, numbers=False)
    return frozenset(
        (node_id, dim)
        for node_id, node in enumerate(traced.nodes)
        if node.op == "load"
        for dim, arg in enumerate(node.args[1:])
        if ranges[arg][0] < 0
    )


class _Emitter:
    """Writes the Triton statements of a graph's nodes, each once, as local variables."""

    def __init__(self, traced: TracedMods, seed: int | None = None, prefix: str = "v") -> None:
        self.traced = traced
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.prefix = prefix
        # nodes bound to one value for the whole tile (:func:`_score_cut`): no read below them
        # depends on the positions
        self.uniform = False
        # d node / d seed (the score input unless ``seed`` names a node): None is 0, "1" one
        self.tangents: dict[int, str | None] = {}
        self.seed = traced.inputs["score"] if seed is None else seed
        self.narrow = traced.narrow_casts()
        self.wide = traced.wide_nodes()
        self.wraps = traced.wrapped_reads()
        # where each parameter's runtime arguments start in the flat argument tuple
        self.param_slot: list[int] = []
        slot = len(traced.consts)
        for param in traced.params:
            self.param_slot.append(slot)
            slot += 1 + 2 * param.dim()

    def bind_inputs(self, names: dict[str, str]) -> None:
        for name, var in names.items():
            self.names[self.traced.inputs[name]] = var
        score = self.traced.inputs["score"]
        self.tangents[score] = "1" if self.seed == score else None

    def bind_uniform(self, values: dict[int, str]) -> None:
        """Bind nodes to scalars, each the node's one value over the tile: the nodes of
        :func:`_score_cut`, so that what the score functions compute from them is a scalar
        per tile (the reads below them one load each, no gather)."""
        self.uniform = True
        for node_id, var in values.items():
            self.names[node_id] = var
            self.tangents[node_id] = None

    def value(self, node_id: int, tangent: bool = False) -> str:
        if node_id not in self.names:
            node = self.traced.nodes[node_id]
            for arg in _node_inputs(node):
                self.value(arg, tangent)
            var = f"{self.prefix}{node_id}"
            self.lines.append(f"{var} = {self._expr(node, node_id)}")
            self.names[node_id] = var
            if tangent:
                self.tangents[node_id] = (
                    "1" if node_id == self.seed else self._tangent(node_id, node)
                )
        elif tangent and node_id not in self.tangents:
            self.tangents[node_id] = None
        return self.names[node_id]

    def _expr(self, node: Node, node_id: int = -1) -> str:
        op, args = node.op, node.args
        n = self.names
        if node_id in self.wide:  # int64 operands: the value may leave int32
            operands = args[1:] if op == "where" else tuple(_node_inputs(node))
            n = dict(n)
            for arg in operands:
                if self.traced.nodes[arg].kind != "float":
                    n[arg] = f"tl.cast({self.names[arg]}, tl.int64)"  # a number too
        if op == "const":
            return f"MOD[{args[0]}]"
        if op == "bool":
            return "True" if args[0] else "False"
        if op == "load":
            gathered = None if self.uniform else self._gathered_load(node)
            if gathered is not None:
                return gathered
            load = f"tl.load(MOD[{self.param_slot[args[0]]}] + {self.offset(node)})"
            return f"{load}.to(tl.float32)" if node.kind == "float" else load
        if op == "cast":
            kind, width = args[1], args[2]
            source = self.traced.nodes[args[0]].kind
            if kind == "bool":
                return f"({n[args[0]]} != 0)"
            if kind == "int":
                width = 32 if node_id in self.narrow else width
                return f"{n[args[0]]}.to(tl.int{width})"
            return f"{n[args[0]]}.to(tl.float32)" if source != "float" else n[args[0]]
        binary = {
            "add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^",
            "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
        }  # fmt: skip
        if op in binary:
            return f"({n[args[0]]} {binary[op]} {n[args[1]]})"
        if op == "truediv":
            return f"({n[args[0]]}.to(tl.float32) / {n[args[1]]})"
        if op in ("floordiv", "mod"):
            a, b = args
            if node.kind == "int":
                helper = "_floordiv" if op == "floordiv" else "_floormod"
                return f"{helper}({n[a]}, {n[b]})"
            quotient = f"tl.floor({n[a]}.to(tl.float32) / {n[b]})"
            return quotient if op == "floordiv" else f"({n[a]} - {quotient} * {n[b]})"
        if op == "neg":
            return f"(0 - {n[args[0]]})"
        if op == "abs":
            return f"tl.abs({n[args[0]]})"
        if op == "not":
            return f"({n[args[0]]} == 0)"
        if op == "invert":
            return f"(~{n[args[0]]})"
        if op in ("minimum", "maximum"):
            return f"tl.{op}({n[args[0]]}, {n[args[1]]})"
        if op == "where":
            return f"tl.where({n[args[0]]}, {n[args[1]]}, {n[args[2]]})"
        x = f"{n[args[0]]}.to(tl.float32)"
        return {
            "exp": f"tl.exp({x})",
            "log": f"tl.log({x})",
            "tanh": f"_tanh({x}, 0)",
            "sqrt": f"tl.sqrt({x})",
            "sigmoid": f"(1.0 / (1.0 + tl.exp(0.0 - {x})))",
        }[op]

    # -- a parameter read ``node`` (op "load"): its runtime arguments, by dimension ------------

    def size(self, node: Node, dim: int) -> str:
        return f"MOD[{self.param_slot[node.args[0]] + 1 + dim}]"

    def stride(self, node: Node, dim: int) -> str:
        dims = len(node.args) - 1
        return f"MOD[{self.param_slot[node.args[0]] + 1 + dims + dim}]"

    def clamped(self, node: Node, dim: int) -> str:
        """The read's element index along ``dim``: a negative index counts from the end (where
        one may be negative, :func:`_wrapped_reads`), as eager PyTorch reads it; then clamped
        into the tensor, only a guard for the memory: :meth:`TracedMods.check_reads` proved
        every read at a valid position in range, and the kernels clamp the positions of a
        tile's padding into the sequences."""
        index = self.names[node.args[1 + dim]]
        size = self.size(node, dim)
        if (self.traced.id_of(node), dim) in self.wraps:
            index = f"tl.where({index} < 0, {index} + {size}, {index})"
        return f"tl.minimum(tl.maximum({index}, 0), {size} - 1)"

    def offset(self, node: Node, skip: int | None = None) -> str:
        """The read's element offset, in int64, over every dimension but ``skip``."""
        offset = "0"
        for dim in range(len(node.args) - 1):
            if dim != skip:
                offset = (
                    f"{offset} + {self.clamped(node, dim)}.to(tl.int64) * {self.stride(node, dim)}"
                )
        return offset

    def _gathered_load(self, node: Node) -> str | None:
        """A tile's reads of a small table row through a register gather, or None where the
        read is not of that form.

        The form: one index of the read depends on both positions (a tile's ``[M, N]`` of
        entries, ``table[h, bucket(q_idx - kv_idx)]``), the others on neither, and the table
        has at most :data:`GATHER_LIMIT` entries along that index. The row is loaded once per
        tile (``[1 or rows, T]``) and each pair picks its entry with ``tl.gather``, instead of
        one load from memory per pair."""
        args = node.args
        positions = {self.traced.inputs["q_idx"], self.traced.inputs["kv_idx"]}
        reads = [self.traced.ancestors(i) & positions for i in args[1:]]
        varying = [d for d, r in enumerate(reads) if r]
        if len(varying) != 1 or reads[varying[0]] != positions:
            return None
        param = self.traced.params[args[0]]
        dim = varying[0]
        entries = int(param.shape[dim])
        if not 0 < entries <= GATHER_LIMIT:
            return None
        slot = self.param_slot[args[0]]
        width = 1 << (entries - 1).bit_length()
        size, stride = self.size(node, dim), self.stride(node, dim)
        tag = f"{self.prefix}{len(self.lines)}"
        self.lines += [
            f"te{tag} = tl.arange(0, {width})[None, :]",
            f"tr{tag} = tl.load(MOD[{slot}] + {self.offset(node, skip=dim)} + te{tag} * {stride}, "
            f"mask=te{tag} < {size}, other=0)",
            f"ti{tag} = {self.clamped(node, dim)}.to(tl.int32)",
            f"tg{tag} = tl.gather("
            f"tl.broadcast_to(tr{tag}, (ti{tag}.shape[0], {width})), ti{tag}, 1)",
        ]
        return f"tg{tag}.to(tl.float32)" if node.kind == "float" else f"tg{tag}"

    def _tangent(self, node_id: int, node: Node) -> str | None:
        """``d node / d score`` as an expression of earlier variables (None: zero)."""
        op, args = node.op, node.args
        if node.kind != "float" or op in ("const", "load"):
            return None
        t = [self.tangents.get(a) for a in _node_inputs(node)]
        n = self.names
        var = n[node_id]

        def scaled(tangent: str | None, factor: str) -> str | None:
            if tangent is None:
                return None
            return factor if tangent == "1" else f"({tangent} * {factor})"

        def plus(a: str | None, b: str | None, sign: str = "+") -> str | None:
            if b is None:
                return a
            if a is None:
                return b if sign == "+" else f"(0.0 - {b})"
            return f"({a} {sign} {b})"

        if op == "cast":
            return t[0]
        if op == "add":
            return plus(t[0], t[1])
        if op == "sub":
            return plus(t[0], t[1], "-")
        if op == "mul":
            return plus(scaled(t[0], n[args[1]]), scaled(t[1], n[args[0]]))
        if op == "truediv":
            a, b = n[args[0]], n[args[1]]
            return plus(scaled(t[0], f"(1.0 / {b})"), scaled(t[1], f"(0.0 - {a} / ({b} * {b}))"))
        if op == "neg":
            return None if t[0] is None else f"(0.0 - {t[0]})"
        if op == "abs":
            return None if t[0] is None else f"tl.where({n[args[0]]} < 0, 0.0 - {t[0]}, {t[0]})"
        if op in ("minimum", "maximum"):
            if t[0] is None and t[1] is None:
                return None
            cmp = "<=" if op == "minimum" else ">="
            first = "1.0" if t[0] == "1" else t[0] or "0.0"
            second = "1.0" if t[1] == "1" else t[1] or "0.0"
            return f"tl.where({n[args[0]]} {cmp} {n[args[1]]}, {first}, {second})"
        if op == "where":
            if t[1] is None and t[2] is None:
                return None
            first = "1.0" if t[1] == "1" else t[1] or "0.0"
            second = "1.0" if t[2] == "1" else t[2] or "0.0"
            return f"tl.where({n[args[0]]}, {first}, {second})"
        if op in ("floordiv", "mod"):
            return None if op == "floordiv" else t[0]
        x = n[args[0]]
        factor = {
            "exp": var,
            "log": f"(1.0 / {x})",
            "tanh": f"(1.0 - {var} * {var})",
            "sqrt": f"(0.5 / {var})",
            "sigmoid": f"({var} * (1.0 - {var}))",
        }[op]
        return scaled(t[0], factor)


def _generate(traced: TracedMods) -> str:
    """The Python source of the module with the kernels' functions of ``traced``:

    * ``mask_fn(b, h, q_idx, kv_idx, MOD)``: whether each pair is kept (all masks);
    * ``score_fn(score, b, h, q_idx, kv_idx, MOD)``: the scores after every score function;
    * ``score_grad_fn(score, ...)``: that and its derivative in ``score``.

    ``MOD`` is the tuple of :meth:`TracedMods.runtime_args`.
    """
    parts = [_HEADER]
    index_args = ", ".join(INDEX_NAMES)
    names = {name: name for name in (*INDEX_NAMES, "score")}

    emitter = _Emitter(traced)
    emitter.bind_inputs(names)
    results = [emitter.value(f.result) for f in traced.masks]
    body = [*emitter.lines, f"return {' & '.join(results) if results else 'True'}"]
    parts.append(_function("mask_fn", f"{index_args}, MOD", body))

    tiled = _score_tile(traced)
    for with_grad in (False, True):
        plain = _score_body(traced, with_grad, "v")
        if tiled is None:
            body = _tiled_body(None, plain, plain)
        else:
            uniform = _score_body(traced, with_grad, "w", tiled)
            body = _tiled_body(tiled, uniform, plain)
        name = "score_grad_fn" if with_grad else "score_fn"
        params = f"score, {index_args}, MOD, TILED: tl.constexpr = False"
        parts.append(_function(name, params, body))
    parts.append(
        _function(
            "param_grad_fn",
            f"score, {index_args}, MOD, ds, TILED: tl.constexpr = False",
            _tiled_body(
                tiled,
                _param_grads(traced, tiled) if tiled is not None else [],
                _param_grads(traced),
            ),
        )
    )
    parts.append(_tile_function(traced))
    return "\n".join(parts)


@dataclass(frozen=True)
class _ScoreTile:
    """How the score functions' tiles are checked for one value over the tile: the lines of
    the cut's bounds, the condition that each is a single value, and those values."""

    lines: list[str]
    uniform: str
    values: dict[int, str]


_TILE_PRELUDE = [
    "q_lo = tl.min(tl.min(q_idx, 1), 0)",
    "q_hi = tl.max(tl.max(q_idx, 1), 0)",
    "kv_lo = tl.min(tl.min(kv_idx, 1), 0)",
    "kv_hi = tl.max(tl.max(kv_idx, 1), 0)",
    "YES = q_lo == q_lo",
    "NO = q_lo != q_lo",
    "ZERO = q_lo.to(tl.int64) * 0",
    "FZERO = ZERO.to(tl.float32)",
]


def _score_cut(traced: TracedMods) -> list[int] | None:
    """The integer and bool nodes through which the positions reach the score functions'
    result: walking back from it through float nodes, the first ones that are not floats and
    depend on ``q_idx`` or ``kv_idx``. Where each of them has one value over a tile, the
    score functions add (or apply) one value per tile (a relative-position bucket that
    saturates far from the diagonal). ``None``: no such nodes, or one that no tile of several
    queries and keys gives one value (a position, their difference, its ``abs``)."""
    if not traced.scores:
        return None
    positions = {traced.inputs["q_idx"], traced.inputs["kv_idx"]}
    cut: set[int] = set()
    seen: set[int] = set()
    stack = [traced.scores[-1].result]
    while stack:
        node_id = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        if not traced.ancestors(node_id) & positions:
            continue
        node = traced.nodes[node_id]
        if node.kind != "float":
            cut.add(node_id)
        else:
            stack.extend(_node_inputs(node))
    if not cut or any(not _may_collapse(traced, node_id, positions) for node_id in cut):
        return None
    return sorted(cut)


#: Operations whose value may be one over a range of positions (a clamp, a choice, a
#: quotient, a comparison, a table read); the others (sums, differences, |.|) vary with them.
_COLLAPSING = frozenset(
    ("minimum", "maximum", "where", "floordiv", "mod", "cast", "lt", "le", "gt", "ge", "eq",
     "ne", "and", "or", "xor", "not", "invert", "load", "mul")
)  # fmt: skip


def _may_collapse(traced: TracedMods, node_id: int, positions: set[int]) -> bool:
    """Whether a node may have one value over a tile of several queries and keys: some
    operation between it and the positions may collapse a range."""
    return any(
        traced.nodes[i].op in _COLLAPSING
        for i in traced.ancestors(node_id)
        if traced.ancestors(i) & positions
    )


def _score_tile(traced: TracedMods) -> _ScoreTile | None:
    cut = _score_cut(traced)
    if cut is None:
        return None
    emitter = _TileEmitter(traced, prefix="k")
    checks, values = [], {}
    for node_id in cut:
        found = emitter.bounds(node_id)
        if found[0] == "int":
            checks.append(f"({found[1]} == {found[2]}) & ~{found[3]}")
        else:
            checks.append(f"({found[1]} != {found[2]})")
        values[node_id] = found[1]
    return _ScoreTile([*_TILE_PRELUDE, *emitter.lines], " & ".join(checks), values)


def _score_body(
    traced: TracedMods, with_grad: bool, prefix: str, tile: _ScoreTile | None = None
) -> list[str]:
    """Lines that set ``r0`` (the scores after every score function) and, ``with_grad``,
    ``r1`` (their derivative in the input score); per pair, or with ``tile`` from the cut's
    one value per tile."""
    emitter = _Emitter(traced, prefix=prefix)
    emitter.bind_inputs({name: name for name in (*INDEX_NAMES, "score")})
    if tile is not None:
        emitter.bind_uniform(tile.values)
    result = "score"
    for function in traced.scores:
        result = emitter.value(function.result, tangent=with_grad)
    last = traced.scores[-1].result if traced.scores else None
    if last is not None and traced.inputs["score"] not in traced.ancestors(last):
        result = f"({result} + tl.zeros_like(score))"  # the tile's shape in either branch
    lines = [*emitter.lines, f"r0 = {result}"]
    if with_grad:
        tangent = emitter.tangents.get(traced.scores[-1].result) if traced.scores else "1"
        tangent = "1.0" if tangent == "1" else tangent or "0.0"
        lines.append(f"r1 = tl.zeros_like(score) + {tangent}")
    return lines


def _tiled_body(tile: _ScoreTile | None, uniform: list[str], plain: list[str]) -> list[str]:
    """A generated function's body: ``plain`` per pair, and with ``TILED`` (the training
    kernels' tiles, ``b`` and ``h`` scalars) and ``tile``, ``uniform`` where the tile's cut
    nodes each have one value. Returns ``r0`` (and ``r1``) where ``plain`` sets them."""
    returns = [n for n in ("r0", "r1") if any(line.startswith(f"{n} = ") for line in plain)]
    ending = [f"return {', '.join(returns)}"] if returns else []
    if tile is None:
        return [*plain, *ending] or ["pass"]

    def indent(lines: list[str]) -> list[str]:
        return [f"    {line}" for line in lines] or ["    pass"]

    return [
        "if TILED:",
        *indent([*tile.lines, f"UNIFORM = {tile.uniform}", "if UNIFORM:"]),
        *indent(indent(uniform)),
        "    else:",
        *indent(indent(plain)),
        "else:",
        *indent(plain),
        *ending,
    ]


#: Tables with at most this many entries along the index that both positions set are read a
#: row per tile and gathered in registers (``_Emitter._gathered_load``).
GATHER_LIMIT = 64

#: Above this many entries indexed by the positions, a tensor's gradient is added one score at
#: a time (atomics); at or below it, each tile sums per entry first and adds once.
ONE_HOT_LIMIT = 256


def _param_grads(traced: TracedMods, tile: _ScoreTile | None = None) -> list[str]:
    """The body of ``param_grad_fn``: for each float tensor the score functions read, the
    gradient ``ds * d scores / d read`` of a tile's pairs added into its float32 buffer (at
    the end of the runtime arguments, one per float tensor). Each read sums over the tile:
    entirely when its index depends on neither position, else per entry of the dimensions
    that do (a loop over the entries between the least and the greatest that the tile's
    nonzero gradients read, for tables of at most ``ONE_HOT_LIMIT`` such entries; beyond it
    one atomic per nonzero score). With ``tile``, every read is of one entry over the tile
    (the cut's values): one sum and one atomic per read."""
    if not traced.scores:
        return ["pass"]
    result = traced.scores[-1].result
    ancestors = traced.ancestors(result)
    floats = [slot for slot, p in enumerate(traced.params) if p.is_floating_point()]
    grad_slot = len(traced.runtime_args())
    positions = {traced.inputs["q_idx"], traced.inputs["kv_idx"]}
    names = {name: name for name in (*INDEX_NAMES, "score")}
    body: list[str] = []
    for node_id in sorted(ancestors):
        node = traced.nodes[node_id]
        if node.op != "load" or node.args[0] not in floats:
            continue
        emitter = _Emitter(traced, seed=node_id, prefix="v" if tile is None else "w")
        emitter.bind_inputs(names)
        if tile is not None:
            emitter.bind_uniform(tile.values)
        emitter.value(result, tangent=True)
        tangent = emitter.tangents.get(result)
        if tangent is None:
            continue
        slot = node.args[0]
        dims = len(node.args) - 1
        grad = f"MOD[{grad_slot + floats.index(slot)}]"
        sizes = [emitter.size(node, d) for d in range(dims)]
        # contiguous strides of the float32 gradient buffer
        strides = [" * ".join(sizes[d + 1 :]) or "1" for d in range(dims)]
        index = [emitter.clamped(node, d) for d in range(dims)]
        varying = [d for d, i in enumerate(node.args[1:]) if traced.ancestors(i) & positions]
        uniform = [d for d in range(dims) if d not in varying]
        g = f"g{node_id}"
        lines = [*emitter.lines]
        if tile is not None:
            offset = " + ".join(f"{index[d]}.to(tl.int64) * ({strides[d]})" for d in range(dims))
            factor = "1.0" if tangent == "1" else tangent
            lines.append(f"w{g} = tl.where(ds == 0.0, 0.0, ds * {factor})")
            lines.append(f"tl.atomic_add({grad} + {offset or '0'}, tl.sum(tl.sum(w{g}, 1), 0))")
            body += lines
            continue
        lines.append(f"{g} = tl.where(ds == 0.0, 0.0, ds * {'1.0' if tangent == '1' else tangent})")
        offset = " + ".join(f"{index[d]}.to(tl.int64) * ({strides[d]})" for d in uniform) or "0"
        lines.append(f"u{node_id} = {offset}")
        if not varying:
            lines.append(f"tl.atomic_add({grad} + u{node_id}, tl.sum(tl.sum({g}, 1), 0))")
        else:
            count = " * ".join(sizes[d] for d in varying)
            inner = [" * ".join(sizes[e] for e in varying if e > d) or "1" for d in varying]
            flat = " + ".join(f"{index[d]} * ({inner[k]})" for k, d in enumerate(varying))
            entry = " + ".join(
                f"((e // ({inner[k]})) % {sizes[d]}).to(tl.int64) * ({strides[d]})"
                for k, d in enumerate(varying)
            )
            every = " + ".join(f"{index[d]}.to(tl.int64) * ({strides[d]})" for d in varying)
            lines += [
                f"f{node_id} = {flat}",
                f"if {count} <= {ONE_HOT_LIMIT}:",
                # only the entries the tile's kept pairs read: a relative-position table
                # gives most tiles one or a few
                f"    nz = {g} != 0.0",
                f"    lo = tl.min(tl.min(tl.where(nz, f{node_id}, {count}), 1), 0)",
                f"    hi = tl.max(tl.max(tl.where(nz, f{node_id}, -1), 1), 0)",
                "    for e in range(lo, hi + 1):",
                f"        c = tl.sum(tl.sum(tl.where(f{node_id} == e, {g}, 0.0), 1), 0)",
                f"        tl.atomic_add({grad} + u{node_id} + {entry}, c)",
                "else:",
                f"    tl.atomic_add({grad} + u{node_id} + {every}, {g}, mask={g} != 0.0)",
            ]
        body += lines
    return body or ["pass"]


def _function(name: str, params: str, body: list[str]) -> str:
    lines = [f"@triton.jit\ndef {name}({params}):"]
    lines += [f"    {line}" for line in body]
    return "\n".join(lines) + "\n"


# -- tile classification by intervals: whether the masks may keep, or may drop, any pair of a
# block of queries and keys, from bounds on every value over the block ---------------------------

#: Bounds past this magnitude make a value unknown (no sum of two known values overflows).
_TILE_LIMIT = 2**40
#: Factors of a product whose bounds stay within this magnitude (the product fits 64 bits).
_TILE_FACTOR = 2**31
#: Relative and absolute widening of a float bound after an operation that rounds: room for
#: the kernels' fused multiply-adds and approximate exp, log and tanh (a few ulp) against the
#: bound computed here, so that a bound never cuts off a value the kernel computes.
_FLOAT_SLACK = 2.0**-16
_FLOAT_TINY = 1e-30
#: The float operations with bounds (the rest are unknown).
_FLOAT_TILE_OPS = frozenset(
    ("neg", "abs", "exp", "tanh", "sigmoid", "log", "sqrt", "minimum", "maximum", "add", "sub",
     "mul", "truediv")
)  # fmt: skip


class _TileEmitter:
    """Writes ``tile_fn``: interval arithmetic over the masks' graph for one block of pairs
    (scalar bounds of each integer: ``lo``, ``hi``, and ``unknown``; of each bool: whether it
    may be true, whether it may be false). Floats, table reads and bitwise integer operators
    are unknown: only their users' verdicts widen, so the answer stays sound."""

    def __init__(self, traced: TracedMods, prefix: str = "") -> None:
        self.traced = traced
        self.lines: list[str] = []
        self.done: dict[int, tuple[str, ...]] = {}
        self.input_names = {node: name for name, node in traced.inputs.items()}
        self.prefix = prefix  # of the variables written, beside the caller's

    def bounds(self, node_id: int) -> tuple[str, ...]:
        """``("int", lo, hi, unknown)``, ``("bool", may_true, may_false)`` or
        ``("float", lo, hi, unknown)``."""
        found = self.done.get(node_id)
        if found is None:
            node = self.traced.nodes[node_id]
            for arg in _node_inputs(node):
                self.bounds(arg)
            found = self.done[node_id] = self._node(node_id, node)
        return found

    def as_int(self, node_id: int) -> tuple[str, str, str]:
        found = self.bounds(node_id)
        if found[0] == "int":
            return found[1], found[2], found[3]
        if found[0] == "bool":
            low = f"tl.where({found[2]}, 0, 1).to(tl.int64)"
            return low, f"tl.where({found[1]}, 1, 0).to(tl.int64)", "NO"
        return "ZERO", "ZERO", "YES"

    def as_float(self, node_id: int) -> tuple[str, str, str]:
        found = self.bounds(node_id)
        if found[0] == "float":
            return found[1], found[2], found[3]
        if found[0] == "int":
            return f"{found[1]}.to(tl.float32)", f"{found[2]}.to(tl.float32)", found[3]
        return f"tl.where({found[2]}, 0.0, 1.0)", f"tl.where({found[1]}, 1.0, 0.0)", "NO"

    def _choice(
        self, args: tuple[Any, ...], bound: Callable[[int], tuple[str, str, str]]
    ) -> tuple[str, str, str]:
        """``(lo, hi, unknown)`` of ``where(c, x, y)``: the branch the condition settles, or
        both (``bound`` gives a branch's bounds as integers or floats)."""
        c = self.bounds(args[0])
        lx, hx, ux = bound(args[1])
        ly, hy, uy = bound(args[2])
        t, f = (c[1], c[2]) if c[0] == "bool" else ("YES", "YES")
        return (
            f"tl.where({t} & {f}, tl.minimum({lx}, {ly}), tl.where({t}, {lx}, {ly}))",
            f"tl.where({t} & {f}, tl.maximum({hx}, {hy}), tl.where({t}, {hx}, {hy}))",
            f"({t} & {ux}) | ({f} & {uy})",
        )

    def _int(self, i: int, lo: str, hi: str, unknown: str) -> tuple[str, ...]:
        p = self.prefix
        self.lines += [f"{p}l{i} = {lo}", f"{p}h{i} = {hi}"]
        self.lines.append(
            f"{p}u{i} = {unknown} | ({p}l{i} < -{_TILE_LIMIT}) | ({p}h{i} > {_TILE_LIMIT})"
        )
        return ("int", f"{p}l{i}", f"{p}h{i}", f"{p}u{i}")

    def _bool(self, i: int, may_true: str, may_false: str) -> tuple[str, ...]:
        p = self.prefix
        self.lines += [f"{p}t{i} = {may_true}", f"{p}f{i} = {may_false}"]
        return ("bool", f"{p}t{i}", f"{p}f{i}")

    def _float(self, i: int, lo: str, hi: str, unknown: str, rounded: bool) -> tuple[str, ...]:
        """Bounds of a float; ``rounded``: widened by :data:`_FLOAT_SLACK` for the rounding
        of an operation the kernels may evaluate otherwise (fused, approximate)."""
        p = self.prefix
        if rounded:
            self.lines += [f"{p}a{i} = {lo}", f"{p}b{i} = {hi}"]
            lo = f"{p}a{i} - tl.abs({p}a{i}) * {_FLOAT_SLACK} - {_FLOAT_TINY}"
            hi = f"{p}b{i} + tl.abs({p}b{i}) * {_FLOAT_SLACK} + {_FLOAT_TINY}"
        self.lines += [f"{p}l{i} = {lo}", f"{p}h{i} = {hi}"]
        self.lines.append(f"{p}u{i} = {unknown} | ({p}l{i} != {p}l{i}) | ({p}h{i} != {p}h{i})")
        return ("float", f"{p}l{i}", f"{p}h{i}", f"{p}u{i}")

    def _node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args, kind = node.op, node.args, node.kind
        if op == "input":
            name = self.input_names[i]
            if name == "score":
                return self._float(i, "FZERO", "FZERO", "YES", False)
            low, high = {"b": ("b", "b"), "h": ("h", "h"), "q_idx": ("q_lo", "q_hi"),
                         "kv_idx": ("kv_lo", "kv_hi")}[name]  # fmt: skip
            return self._int(i, f"{low}.to(tl.int64)", f"{high}.to(tl.int64)", "NO")
        if kind == "float":
            return self._float_node(i, node)
        if op == "bool":
            return self._bool(i, "YES" if args[0] else "NO", "NO" if args[0] else "YES")
        if op == "const":
            value = f"tl.cast(MOD[{args[0]}], tl.int64)"
            return self._int(i, value, value, "NO")
        if op == "load" or (op in ("and", "or", "xor") and kind == "int"):
            if kind == "bool":
                return self._bool(i, "YES", "YES")
            return self._int(i, "ZERO", "ZERO", "YES")
        if kind == "bool":
            return self._bool_node(i, node)
        return self._int_node(i, node)

    def _bool_node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args = node.op, node.args
        if op in ("and", "or", "xor", "not", "invert") and all(
            self.bounds(a)[0] == "bool" for a in args
        ):
            a = self.bounds(args[0])
            if op in ("not", "invert"):
                return self._bool(i, a[2], a[1])
            b = self.bounds(args[1])
            if op == "and":
                return self._bool(i, f"{a[1]} & {b[1]}", f"{a[2]} | {b[2]}")
            if op == "or":
                return self._bool(i, f"{a[1]} | {b[1]}", f"{a[2]} & {b[2]}")
            true = f"({a[1]} & {b[2]}) | ({a[2]} & {b[1]})"
            return self._bool(i, true, f"({a[1]} & {b[1]}) | ({a[2]} & {b[2]})")
        if op == "not":  # of an integer: true where it is 0
            la, ha, ua = self.as_int(args[0])
            return self._bool(
                i, f"(({la} <= 0) & ({ha} >= 0)) | {ua}", f"~(({la} == 0) & ({ha} == 0)) | {ua}"
            )
        if op == "where":
            c = self.bounds(args[0])
            x, y = self.bounds(args[1]), self.bounds(args[2])
            if c[0] != "bool" or x[0] != "bool" or y[0] != "bool":
                return self._bool(i, "YES", "YES")
            true = f"({c[1]} & {x[1]}) | ({c[2]} & {y[1]})"
            return self._bool(i, true, f"({c[1]} & {x[2]}) | ({c[2]} & {y[2]})")
        if op == "cast":
            la, ha, ua = self.as_int(args[0])
            return self._bool(
                i, f"~(({la} == 0) & ({ha} == 0)) | {ua}", f"(({la} <= 0) & ({ha} >= 0)) | {ua}"
            )
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            if any(self.bounds(a)[0] == "float" for a in args):
                la, ha, ua = self.as_float(args[0])
                lb, hb, ub = self.as_float(args[1])
            else:
                la, ha, ua = self.as_int(args[0])
                lb, hb, ub = self.as_int(args[1])
            unknown = f"{ua} | {ub}"
            true, false = {
                "lt": (f"{la} < {hb}", f"{ha} >= {lb}"),
                "le": (f"{la} <= {hb}", f"{ha} > {lb}"),
                "gt": (f"{ha} > {lb}", f"{la} <= {hb}"),
                "ge": (f"{ha} >= {lb}", f"{la} < {hb}"),
                "eq": (
                    f"({la} <= {hb}) & ({lb} <= {ha})",
                    f"~(({la} == {ha}) & ({lb} == {hb}) & ({la} == {lb}))",
                ),
                "ne": (
                    f"~(({la} == {ha}) & ({lb} == {hb}) & ({la} == {lb}))",
                    f"({la} <= {hb}) & ({lb} <= {ha})",
                ),
            }[op]
            return self._bool(i, f"({true}) | {unknown}", f"({false}) | {unknown}")
        return self._bool(i, "YES", "YES")

    def _int_node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args = node.op, node.args
        if op == "cast":
            if self.bounds(args[0])[0] == "float":
                # truncation toward zero keeps the order
                lf, hf, uf = self.as_float(args[0])
                limit = f"{float(_TILE_LIMIT)}"
                la = f"tl.minimum(tl.maximum({lf}, -{limit}), {limit}).to(tl.int64)"
                ha = f"tl.minimum(tl.maximum({hf}, -{limit}), {limit}).to(tl.int64)"
                ua = f"{uf} | ({lf} < -{limit}) | ({hf} > {limit})"
            else:
                la, ha, ua = self.as_int(args[0])
            if args[2] == 32:
                ua = f"{ua} | ({la} < -{2**31}) | ({ha} > {2**31 - 1})"
            return self._int(i, la, ha, ua)
        if op == "where":
            return self._int(i, *self._choice(args, self.as_int))
        la, ha, ua = self.as_int(args[0])
        if op == "neg":
            return self._int(i, f"0 - {ha}", f"0 - {la}", ua)
        if op == "invert":
            return self._int(i, f"-1 - {ha}", f"-1 - {la}", ua)
        if op == "abs":
            return self._int(
                i,
                f"tl.where({la} >= 0, {la}, tl.where({ha} <= 0, 0 - {ha}, 0))",
                f"tl.maximum(0 - {la}, {ha})",
                ua,
            )
        if len(args) != 2:
            return self._int(i, "ZERO", "ZERO", "YES")
        lb, hb, ub = self.as_int(args[1])
        unknown = f"{ua} | {ub}"
        if op == "add":
            return self._int(i, f"{la} + {lb}", f"{ha} + {hb}", unknown)
        if op == "sub":
            return self._int(i, f"{la} - {hb}", f"{ha} - {lb}", unknown)
        if op in ("minimum", "maximum"):
            return self._int(i, f"tl.{op}({la}, {lb})", f"tl.{op}({ha}, {hb})", unknown)
        if op == "mul":
            corners = [f"{x} * {y}" for x in (la, ha) for y in (lb, hb)]
            big = " | ".join(
                f"({x} < -{_TILE_FACTOR}) | ({x} > {_TILE_FACTOR})" for x in (la, ha, lb, hb)
            )
            pairs = [f"{corners[0]}, {corners[1]}", f"{corners[2]}, {corners[3]}"]
            low = f"tl.minimum(tl.minimum({pairs[0]}), tl.minimum({pairs[1]}))"
            high = f"tl.maximum(tl.maximum({pairs[0]}), tl.maximum({pairs[1]}))"
            return self._int(i, low, high, f"{unknown} | {big}")
        if op == "floordiv":
            # a positive divisor: floor(a / b) grows with a, and moves with b the other way
            # from a's sign, so the corners bound it
            safe_lb = f"tl.maximum({lb}, 1)"
            safe_hb = f"tl.maximum({hb}, 1)"
            low = f"tl.minimum(_floordiv({la}, {safe_lb}), _floordiv({la}, {safe_hb}))"
            high = f"tl.maximum(_floordiv({ha}, {safe_lb}), _floordiv({ha}, {safe_hb}))"
            return self._int(i, low, high, f"{unknown} | ({lb} <= 0)")
        if op == "mod":
            # a positive divisor: the remainder is in [0, b); exactly a's when a's interval
            # stays within one multiple of a single divisor
            safe = f"tl.maximum({lb}, 1)"
            same = f"({lb} == {hb}) & (_floordiv({la}, {safe}) == _floordiv({ha}, {safe}))"
            return self._int(
                i,
                f"tl.where({same}, _floormod({la}, {safe}), 0)",
                f"tl.where({same}, _floormod({ha}, {safe}), {hb} - 1)",
                f"{unknown} | ({lb} <= 0)",
            )
        return self._int(i, "ZERO", "ZERO", "YES")

    def _float_node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args = node.op, node.args
        if op == "const":
            value = f"tl.cast(MOD[{args[0]}], tl.float32)"
            return self._float(i, value, value, "NO", False)
        if op == "cast":  # to float from an integer, a bool or a float: monotone
            la, ha, ua = self.as_float(args[0])
            return self._float(i, la, ha, ua, False)
        if op == "where":
            return self._float(i, *self._choice(args, self.as_float), False)
        if op in ("input", "load") or op not in _FLOAT_TILE_OPS:
            return self._float(i, "FZERO", "FZERO", "YES", False)
        la, ha, ua = self.as_float(args[0])
        if op == "neg":
            return self._float(i, f"0.0 - {ha}", f"0.0 - {la}", ua, False)
        if op == "abs":
            low = f"tl.where({la} >= 0.0, {la}, tl.where({ha} <= 0.0, 0.0 - {ha}, 0.0))"
            return self._float(i, low, f"tl.maximum(0.0 - {la}, {ha})", ua, False)
        if op in ("exp", "tanh", "sigmoid"):  # increasing
            x = {
                "exp": "tl.exp({})",
                "tanh": "_tanh({}, 0)",
                "sigmoid": "(1.0 / (1.0 + tl.exp(0.0 - {})))",
            }[op]
            return self._float(i, x.format(la), x.format(ha), ua, True)
        if op in ("log", "sqrt"):  # increasing where defined
            return self._float(i, f"tl.{op}({la})", f"tl.{op}({ha})", f"{ua} | ({la} < 0.0)", True)
        lb, hb, ub = self.as_float(args[1])
        unknown = f"{ua} | {ub}"
        if op in ("minimum", "maximum"):
            return self._float(i, f"tl.{op}({la}, {lb})", f"tl.{op}({ha}, {hb})", unknown, False)
        if op == "add":
            return self._float(i, f"{la} + {lb}", f"{ha} + {hb}", unknown, True)
        if op == "sub":
            return self._float(i, f"{la} - {hb}", f"{ha} - {lb}", unknown, True)
        # mul, truediv: the extremes are at the corners (a divisor that may be 0: unknown)
        sign = "*" if op == "mul" else "/"
        if op == "truediv":
            unknown = f"{unknown} | (({lb} <= 0.0) & ({hb} >= 0.0))"
        corners = [f"{x} {sign} {y}" for x in (la, ha) for y in (lb, hb)]
        low = (
            f"tl.minimum(tl.minimum({corners[0]}, {corners[1]}), "
            f"tl.minimum({corners[2]}, {corners[3]}))"
        )
        high = (
            f"tl.maximum(tl.maximum({corners[0]}, {corners[1]}), "
            f"tl.maximum({corners[2]}, {corners[3]}))"
        )
        return self._float(i, low, high, unknown, True)


def _tile_function(traced: TracedMods) -> str:
    """``tile_fn(b, h, q_lo, q_hi, kv_lo, kv_hi, MOD) -> (may_keep, may_drop)``: whether the
    masks may keep some pair, and may drop some pair, of queries ``[q_lo, q_hi]`` and keys
    ``[kv_lo, kv_hi]`` of batch row ``b`` and head ``h`` (bounds included; sound, not exact:
    both may be true where the block is in fact all kept or all dropped)."""
    emitter = _TileEmitter(traced)
    keep, drop = [], []
    for function in traced.masks:
        result = emitter.bounds(function.result)
        if result[0] != "bool":
            keep.append("YES")
            drop.append("YES")
        else:
            keep.append(result[1])
            drop.append(result[2])
    body = [
        "YES = q_lo == q_lo",
        "NO = q_lo != q_lo",
        "ZERO = q_lo.to(tl.int64) * 0",
        "FZERO = ZERO.to(tl.float32)",
        *emitter.lines,
        f"return {' & '.join(keep) or 'YES'}, {' | '.join(drop) or 'NO'}",
    ]
    return _function("tile_fn", "b, h, q_lo, q_hi, kv_lo, kv_hi, MOD", body)


_SOURCES: dict[tuple[str, str], dict[str, Any]] = {}


def jit_from_source(
    source: str, prefix: str, names: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Execute generated ``source`` as a module (its text registered with ``linecache``, where
    Triton and ``inspect`` read a function's source) and return its namespace, which starts
    with ``names``; the same source and ``prefix`` give the same namespace, so its Triton
    functions compile once per process (callers giving other ``names`` give another
    ``prefix``)."""
    found = _SOURCES.get((source, prefix))
    if found is not None:
        return found
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    filename = f"<attnbias-{prefix}-{digest}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"attnbias_generated_{prefix}_{digest}"}
    namespace.update(names or {})
    exec(compile(source, filename, "exec"), namespace)
    _SOURCES[(source, prefix)] = namespace
    return namespace


@dataclass(frozen=True, eq=False)
class CompiledMods:
    """The Triton functions of traced mask and score functions, with the runtime arguments
    they read (``args``: the flat tuple of :meth:`TracedMods.runtime_args`)."""

    traced: TracedMods
    mask_fn: Any
    score_fn: Any
    score_grad_fn: Any
    param_grad_fn: Any
    source: str
    tile_fn: Any = None

    @classmethod
    def of(cls, traced: TracedMods) -> CompiledMods:
        source = _generate(traced)
        namespace = jit_from_source(source, "mods")
        made = cls(
            traced,
            namespace["mask_fn"],
            namespace["score_fn"],
            namespace["score_grad_fn"],
            namespace["param_grad_fn"],
            source,
            namespace["tile_fn"],
        )
        # registered now, outside any torch.compile trace: a registration traced there would
        # only be applied after the graph is built, and the ops' fake forms look it up before
        made.register()
        return made

    @property
    def has_mask(self) -> bool:
        return len(self.traced.masks) > 0  # (not bool(list): torch.compile traces this)

    @property
    def has_score(self) -> bool:
        return len(self.traced.scores) > 0

    def args(self) -> list[Any]:
        return self.traced.runtime_args()

    def bound(self, param_grads: bool) -> dict[str, Any]:
        """The kernels' generated-function parameters and this form's functions for them
        (``None`` where it has none; the parameters' gradient function only with
        ``param_grads``)."""
        return {
            "MASK_FN": self.mask_fn if self.has_mask else None,
            "SCORE_FN": self.score_fn if self.has_score else None,
            "SCORE_GRAD_FN": self.score_grad_fn if self.has_score else None,
            "PARAM_GRAD_FN": self.param_grad_fn if param_grads else None,
            "TILE_FN": self.tile_fn if self.has_mask else None,
            # for tiles of rows of several heads (the decode kernel's packed rows): only where
            # the masks do not read the head
            "HEADLESS_TILE_FN": (
                self.tile_fn if self.has_mask and "h" not in self.traced.reads() else None
            ),
        }

    def describe(self) -> str:
        names = [f.name for f in (*self.traced.masks, *self.traced.scores)]
        return "generated " + ", ".join(names)

    # -- through the registered ops: functions by number, parameters and numbers as values --

    def register(self) -> int:
        """This form's number in the process's registry (the same generated code, the same
        number), which the registered ops carry instead of the functions."""
        key = (self.source, tuple(type(c) for c in self.traced.consts))
        number = _REGISTERED.get(key)
        if number is None:
            number = _REGISTERED[key] = len(_TEMPLATES)
            _TEMPLATES.append(self)
        return number

    def pack_into(self, tensors: list[Any], ints: list[int], floats: list[float]) -> None:
        """Append the parameters to ``tensors`` and the numbers to ``ints`` / ``floats``."""
        tensors.extend(self.traced.params)
        for value in self.traced.consts:
            if isinstance(value, int):
                ints.append(value)
            else:
                floats.append(value)

    @classmethod
    def unpack_from(
        cls, number: int, tensors: Iterator[Any], ints: Iterator[int], floats: Iterator[float]
    ) -> CompiledMods:
        """The form :meth:`pack_into` wrote, with registry number ``number``."""
        template = _TEMPLATES[number]
        old = template.traced
        params = [next(tensors) for _ in old.params]
        consts: list[int | float] = [
            next(ints) if isinstance(value, int) else next(floats) for value in old.consts
        ]
        traced = dataclasses.replace(old, params=params, consts=consts)
        return dataclasses.replace(template, traced=traced)


_REGISTERED: dict[tuple[str, tuple[type, ...]], int] = {}
_TEMPLATES: list[CompiledMods] = []


_WRAPPERS: dict[tuple[Any, ...], Any] = {}


def with_flat_mods(kernel: Any, count: int, bound: Mapping[str, Any] | None = None) -> Any:
    """A kernel that takes ``kernel``'s runtime parameter ``MOD`` (the tuple of generated
    functions' arguments) as ``count`` flat parameters in its place and calls ``kernel`` with
    them as one tuple: a launch, ``torch.compile``'s tracing of a launch and the compiled
    kernel's own launcher all take flat arguments only.

    ``bound`` fixes ``tl.constexpr`` parameters of ``kernel`` to generated functions (or
    ``None``): the new kernel calls them by name, so they are not among its own parameters
    (``torch.compile`` writes a kernel's source with the functions it calls, but cannot write
    a function passed as a launch argument). Names ``kernel`` does not take are ignored."""
    # looked up on every launch: the key first (a signature costs the host tens of µs)
    key = (kernel, count, *((name, id(fn)) for name, fn in (bound or {}).items()))
    found = _WRAPPERS.get(key)
    if found is not None:
        return found
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = [p.name for p in params]
    if "MOD" not in names:
        raise TypeError(f"{kernel} has no MOD parameter")
    fixed = {name: fn for name, fn in (bound or {}).items() if name in names}
    # the functions by their own names (generated together, so distinct), the kernel by its
    namespace: dict[str, Any] = {kernel.__name__: kernel}
    for fn in fixed.values():
        if fn is not None:
            namespace[fn.__name__] = fn
    flat = [f"MOD{i}" for i in range(count)]
    signature, call = [], []
    for param in params:
        if param.name == "MOD":
            signature += flat
            call.append(f"({', '.join(flat)},)" if flat else "()")
        elif param.name in fixed:
            fn = fixed[param.name]
            call.append(f"{param.name}={'None' if fn is None else fn.__name__}")
        elif "constexpr" in str(param.annotation):
            default = "" if param.default is inspect.Parameter.empty else " = None"
            signature.append(f"{param.name}: tl.constexpr{default}")
            call.append(f"{param.name}={param.name}")
        else:
            signature.append(param.name)
            call.append(param.name)
    # one name per set of functions: their generated module's name holds its source's digest
    origin = "".join(sorted({fn.fn.__module__ for fn in fixed.values() if fn is not None}))
    suffix = hashlib.sha256(origin.encode()).hexdigest()[:8] if origin else "free"
    name = f"{kernel.__name__}_mods{count}_{suffix}"
    # the functions' numbers change between calls: specialized on their type only (Triton
    # would compile a variant for a value of 1 or a multiple of 16)
    jit = f"@triton.jit(do_not_specialize={flat!r})" if flat else "@triton.jit"
    source = (
        f"import triton\nimport triton.language as tl\n\n\n{jit}\n"
        f"def {name}({', '.join(signature)}):\n    {kernel.__name__}({', '.join(call)})\n"
    )
    made = jit_from_source(source, name, namespace)[name]
    _WRAPPERS[key] = made
    return made

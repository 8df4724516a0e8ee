"""Tracing ``mask_mod`` / ``score_mod`` functions: the symbolic values (:class:`Sym`) they are
called with, and the torch operators they may use (:data:`SUPPORTED`), each recording a node of
the graph (:class:`~attnbias.kernels.modgraph.TracedMods`).

A function is called once with symbolic arguments: the batch row ``b``, the query head ``h``,
the query and key positions ``q_idx`` / ``kv_idx`` (integers) and, for a score function, the
scaled ``score`` (float). Every operation on them records a node; tensors the function reads
(a per-head table, document ids, through closures or fields) become *parameters*, indexed by
index expressions; every Python number in the graph becomes a runtime argument. So the
generated code depends only on the graph's structure: new numbers, new tensor values, new
lengths and in-place changes need no new compilation and are always seen.

What cannot be compiled is refused when traced, with the function's name and the operator: a
Python ``if``, ``and``, ``or`` or ``bool()`` on a traced value (a data-dependent branch), and
any operator outside :data:`SUPPORTED`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnbias.kernels.modgraph import Node

__all__ = ["SUPPORTED", "ModTraceError", "Sym"]


class ModTraceError(TypeError):
    """A mask or score function uses something the compiler cannot turn into kernel code."""


def _way_out(name: str) -> str:
    return (
        f"write {name} with tensor operations only (torch.where for choices, & | ~ for logic), "
        f"or give the bias a materialize() and needs_materialization() -> True to run it "
        f"unfused"
    )


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

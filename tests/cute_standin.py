"""A stand-in for the few CuTe DSL names the FlashAttention 4 callbacks of ``fa4_mods`` use,
implemented with torch operations, so that the generated source runs on CPU index grids.

It follows the DSL where the callbacks could depend on it: ``//`` of integers truncates toward
zero (as MLIR's signed division does; the callbacks must not rely on flooring), a float cast to
an integer truncates, every value has one of three types (Int32, Float32, Boolean) and no
operation mixes types silently (a mixed operation raises, as the callbacks convert
explicitly). Values broadcast, so one call evaluates a whole ``(B, H, L, S)`` grid.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

__all__ = ["NAMES", "SSA"]


class _Type:
    """``cutlass.Int32`` and the like: converts a number, names a torch dtype."""

    def __init__(self, dtype: torch.dtype, python: type) -> None:
        self.dtype = dtype
        self.python = python

    def __call__(self, value: Any) -> Any:
        return self.python(value)


Int32 = _Type(torch.int32, int)
Float32 = _Type(torch.float32, float)
Boolean = _Type(torch.bool, bool)


class SSA:
    """A ``TensorSSA`` of one of the three types, holding a torch tensor."""

    __slots__ = ("t",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, tensor: Tensor) -> None:
        if tensor.dtype not in (torch.int32, torch.float32, torch.bool):
            raise TypeError(f"a TensorSSA of {tensor.dtype}")
        self.t = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.t.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    def to(self, kind: _Type) -> SSA:
        if self.t.dtype == torch.bool and kind is not Boolean:
            raise TypeError("the callbacks convert booleans with where, not .to")
        return SSA(self.t.to(kind.dtype))  # float to int32 truncates

    def _other(self, other: Any) -> Tensor:
        if isinstance(other, SSA):
            if other.t.dtype != self.t.dtype:
                raise TypeError(f"{self.t.dtype} with {other.t.dtype}")
            return other.t
        if isinstance(other, float) and self.t.dtype == torch.float32:
            return torch.tensor(other, dtype=torch.float32)
        raise TypeError(f"a TensorSSA of {self.t.dtype} with {type(other).__name__}")

    def _arith(self, other: Any, fn: Any) -> SSA:
        if self.t.dtype == torch.bool:
            raise TypeError("arithmetic on booleans")
        return SSA(fn(self.t, self._other(other)).to(self.t.dtype))

    def __add__(self, other: Any) -> SSA:
        return self._arith(other, torch.add)

    def __sub__(self, other: Any) -> SSA:
        return self._arith(other, torch.sub)

    def __mul__(self, other: Any) -> SSA:
        return self._arith(other, torch.mul)

    def __truediv__(self, other: Any) -> SSA:
        if self.t.dtype != torch.float32:
            raise TypeError("/ of integers")
        return self._arith(other, torch.div)

    def __floordiv__(self, other: Any) -> SSA:
        if self.t.dtype != torch.int32:
            raise TypeError("// of floats")
        return self._arith(other, lambda a, b: torch.div(a, b, rounding_mode="trunc"))

    def _compare(self, other: Any, fn: Any) -> SSA:
        return SSA(fn(self.t, self._other(other)))

    def __lt__(self, other: Any) -> SSA:
        return self._compare(other, torch.lt)

    def __le__(self, other: Any) -> SSA:
        return self._compare(other, torch.le)

    def __gt__(self, other: Any) -> SSA:
        return self._compare(other, torch.gt)

    def __ge__(self, other: Any) -> SSA:
        return self._compare(other, torch.ge)

    def __eq__(self, other: Any) -> SSA:  # type: ignore[override]
        return self._compare(other, torch.eq)

    def __ne__(self, other: Any) -> SSA:  # type: ignore[override]
        return self._compare(other, torch.ne)

    def _logic(self, other: Any, fn: Any) -> SSA:
        if self.t.dtype == torch.float32:
            raise TypeError("bitwise operation on floats")
        return SSA(fn(self.t, self._other(other)))

    def __and__(self, other: Any) -> SSA:
        return self._logic(other, torch.bitwise_and)

    def __or__(self, other: Any) -> SSA:
        return self._logic(other, torch.bitwise_or)

    def __xor__(self, other: Any) -> SSA:
        return self._logic(other, torch.bitwise_xor)

    def __bool__(self) -> bool:
        raise TypeError("a TensorSSA has no Python truth value in a callback")


class _Rmem:
    """``cute.make_rmem_tensor(1, dtype)``: one register, here a whole grid of them."""

    def __init__(self, kind: _Type) -> None:
        self.kind = kind
        self.value: Tensor | None = None

    def store(self, value: SSA) -> None:
        if value.t.dtype != self.kind.dtype:
            raise TypeError(f"storing {value.t.dtype} into {self.kind.dtype} registers")
        self.value = value.t

    def __getitem__(self, index: int) -> Tensor:
        assert index == 0 and self.value is not None
        return self.value

    def __setitem__(self, index: int, value: Tensor) -> None:
        assert index == 0
        if value.dtype != self.kind.dtype:
            raise TypeError(f"a {value.dtype} element into {self.kind.dtype} registers")
        self.value = value

    def load(self) -> SSA:
        assert self.value is not None
        return SSA(self.value)


class _AuxTensor:
    """An aux tensor: 1-D, indexed by an int32 register."""

    def __init__(self, tensor: Tensor) -> None:
        assert tensor.dim() == 1 and tensor.dtype in (torch.int32, torch.float32)
        self.tensor = tensor

    def __getitem__(self, index: Tensor) -> Tensor:
        assert index.dtype == torch.int32
        assert bool((index >= 0).all()) and bool((index < self.tensor.numel()).all())
        return self.tensor[index.long()]


def aux(tensors: list[Tensor] | None) -> list[_AuxTensor] | None:
    """FlashAttention 4's ``aux_tensors`` as the callbacks see them."""
    return None if tensors is None else [_AuxTensor(t) for t in tensors]


def _full_like(like: SSA, value: Any) -> SSA:
    if like.t.dtype == torch.int32 and not isinstance(value, int):
        raise TypeError(f"full_like of an Int32 value with {value!r}")
    if like.t.dtype == torch.float32 and not isinstance(value, float):
        raise TypeError(f"full_like of a Float32 value with {value!r}")
    return SSA(torch.full_like(like.t, value))


def _where(condition: SSA, a: SSA, b: SSA) -> SSA:
    if condition.t.dtype != torch.bool or a.t.dtype != b.t.dtype:
        raise TypeError(f"where({condition.t.dtype}, {a.t.dtype}, {b.t.dtype})")
    return SSA(torch.where(condition.t, a.t, b.t))


def _float_math(fn: Any) -> Any:
    def apply(x: SSA, fastmath: bool = False) -> SSA:
        if x.t.dtype != torch.float32:
            raise TypeError(f"math on {x.t.dtype}")
        return SSA(fn(x.t))

    return apply


cute = SimpleNamespace(
    jit=lambda fn: fn,
    full_like=_full_like,
    where=_where,
    TensorSSA=lambda value, shape, dtype: SSA(value),
    make_rmem_tensor=lambda size, kind: _Rmem(kind),
    math=SimpleNamespace(
        exp2=_float_math(torch.exp2),
        log=_float_math(torch.log),
        sqrt=_float_math(torch.sqrt),
        tanh=_float_math(torch.tanh),
    ),
)
cutlass = SimpleNamespace(Int32=Int32, Float32=Float32, Boolean=Boolean)
mlir_math = SimpleNamespace(absi=lambda x: torch.abs(x.t), absf=lambda x: torch.abs(x.t))

#: The namespace the generated source runs in.
NAMES: dict[str, Any] = {"cute": cute, "cutlass": cutlass, "mlir_math": mlir_math}

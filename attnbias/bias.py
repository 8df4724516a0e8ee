"""Bias objects for scaled dot product attention.

Shape legend used throughout:

    B   batch size              L   query sequence length
    Hq  query heads             S   key/value sequence length
    Hkv key/value heads         E   head dimension

Every bias follows one set of semantics (see the README): query row ``i`` in ``[0, L)``, key
column ``j`` in ``[0, S)``; the score is ``s = scale * q_i . k_j``, then soft-capped, then the
additive biases are added, then the masks are applied (a pair is kept when every mask keeps it).
A query row that keeps no key produces a zero output and zero gradients.

``materialize`` returns the additive float form of a bias: ``0`` where attended, ``-inf`` where
masked, finite values for score biases such as ALiBi. It returns the fewest dimensions it needs
(a causal mask is ``(L, S)``), broadcastable to ``(B, H, L, S)``.
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "AlibiBias",
    "AttnBias",
    "CausalBias",
    "CausalVariant",
    "CompositeBias",
    "DocumentBias",
    "KeyRangeBias",
    "MaskedBias",
    "SlidingWindowBias",
    "SoftcapBias",
    "TensorBias",
    "alibi_slopes",
    "causal_lower_right",
    "causal_upper_left",
    "check_dispatched",
    "check_materialized",
    "materialize_masked",
]

_Device = torch.device | str | int | None
_Shape = Sequence[int] | torch.Size | None


def _resolve_lengths(
    shape: _Shape, seq_len_q: int | None, seq_len_kv: int | None, owner: str
) -> tuple[int, int]:
    """Return ``(L, S)`` from ``shape=(..., L, S)`` and/or lengths the bias carries itself."""
    shape_l = shape_s = None
    if shape is not None:
        shape = tuple(shape)
        if len(shape) < 2:
            raise ValueError(f"{owner}.materialize: shape must end with (L, S), got shape={shape}")
        shape_l, shape_s = int(shape[-2]), int(shape[-1])
    length_q = seq_len_q if seq_len_q is not None else shape_l
    length_kv = seq_len_kv if seq_len_kv is not None else shape_s
    if length_q is None or length_kv is None:
        raise ValueError(
            f"{owner}.materialize needs the sequence lengths: pass shape=(B, H, L, S) or build "
            f"the bias with its lengths (e.g. causal_lower_right(L, S))"
        )
    if shape_l is not None and (shape_l, shape_s) != (length_q, length_kv):
        raise ValueError(
            f"{owner} was built for L={length_q}, S={length_kv} but shape={shape} asks for "
            f"L={shape_l}, S={shape_s}; build the bias with the lengths of this call"
        )
    return length_q, length_kv


def _cached_on(cache: dict[Any, Tensor], key: Any, make: Any) -> Tensor:
    """``make()``, kept in ``cache`` under ``key`` (not while torch.compile traces).

    Built-in biases copy their small tensors (slopes, document ids) to the inputs' device once:
    a copy from host memory on every call would synchronise the device with the host each time.
    """
    if torch.compiler.is_compiling():
        return make()
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _device_key(device: _Device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def _keep_to_additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    zeros = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zeros, torch.full((), -math.inf, dtype=dtype, device=keep.device))


def _band_keep(
    length_q: int, length_kv: int, lo: int | None, hi: int | None, device: _Device
) -> Tensor:
    """``(L, S)`` bool: ``lo <= j - i <= hi`` (``None`` = unbounded side)."""
    rows = torch.arange(length_q, device=device)[:, None]
    cols = torch.arange(length_kv, device=device)[None, :]
    offset = cols - rows
    keep = torch.ones(length_q, length_kv, dtype=torch.bool, device=device)
    if lo is not None:
        keep &= offset >= lo
    if hi is not None:
        keep &= offset <= hi
    return keep


class AttnBias(ABC):
    """Base class of every bias object accepted as ``attn_mask`` by :func:`attnbias.sdpa`.

    A subclass provides at least one of two paths:

    * ``materialize`` (and ``needs_materialization() -> True``): the bias becomes a bool
      keep-mask or an additive float tensor and stock SDPA runs with it. This is all a custom
      bias needs.
    * ``dispatch`` (and ``needs_materialization() -> False``): the bias runs attention itself,
      e.g. through a fused kernel.

    Biases compose with ``+``: ``a + b`` adds the additive parts and intersects the masks.

    Example, a prefix-LM mask (the first ``prefix`` keys are visible to every query)::

        @dataclass(frozen=True)
        class PrefixLMBias(AttnBias):
            prefix: int

            def materialize(self, device=None, *, shape=None, dtype=None):
                L, S = shape[-2], shape[-1]
                i = torch.arange(L, device=device)[:, None]
                j = torch.arange(S, device=device)[None, :]
                keep = (j <= i) | (j < self.prefix)
                return torch.zeros(L, S, dtype=dtype, device=device).masked_fill(~keep, -inf)

            def needs_materialization(self):
                return True
    """

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        """The bias as a tensor broadcastable to ``shape=(B, H, L, S)``, on ``device``.

        Either a bool keep-mask (``True`` = attend) or an additive float tensor (``0`` where
        attended, ``-inf`` where masked, finite values for score biases; never NaN or
        ``+inf``). A bool result is read as a keep-mask everywhere, sums included. The routes
        ask for ``dtype=torch.float32`` (``float64`` for float64 inputs) and check the result.
        """
        raise TypeError(
            f"{type(self).__name__} has no materialized form; it can only run through its "
            f"dispatch (its needs_materialization() must return False)"
        )

    @abstractmethod
    def needs_materialization(self) -> bool:
        """True when ``sdpa`` should call stock SDPA with ``materialize(...)``."""

    @staticmethod
    def dispatch(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_bias: AttnBias,
        causal: bool,
        scale: float | None,
        dropout_p: float,
        enable_gqa: bool = False,
    ) -> Tensor:
        """Compute attention with this bias without materializing it: ``(B, Hq, L, Ev)`` in
        the dtype and on the device of ``query`` (checked)."""
        raise TypeError(
            f"{type(attn_bias).__name__}.needs_materialization() returned False but the class "
            f"does not implement dispatch(); implement dispatch() or return True from "
            f"needs_materialization() and implement materialize()"
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.materialize is AttnBias.materialize and cls.dispatch is AttnBias.dispatch:
            raise TypeError(
                f"{cls.__name__} implements neither materialize() nor dispatch(); an AttnBias "
                f"subclass must implement at least one of them"
            )

    def __add__(self, other: object) -> CompositeBias:
        if not isinstance(other, AttnBias):
            return NotImplemented
        return CompositeBias((*parts_of(self), *parts_of(other)))

    def __radd__(self, other: object) -> AttnBias:
        # sum([a, b]) starts from 0
        if isinstance(other, int) and other == 0:
            return self
        return NotImplemented

    def _validate_call(self, batch: int, heads: int, length_q: int, length_kv: int) -> None:
        """Raise ``ValueError`` when the bias cannot apply to a ``(B, Hq, L, S)`` call."""
        return None


def parts_of(bias: AttnBias | None) -> tuple[AttnBias, ...]:
    """The flat parts of a bias: those of a sum, the bias itself, or none for ``None``."""
    if bias is None:
        return ()
    if isinstance(bias, CompositeBias):
        return bias.parts
    return (bias,)


class _BuiltinBias(AttnBias):
    """A bias the library knows how to lower to its kernel (band, documents, score modifiers)."""

    def needs_materialization(self) -> bool:
        return False

    @staticmethod
    def dispatch(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_bias: AttnBias,
        causal: bool,
        scale: float | None,
        dropout_p: float,
        enable_gqa: bool = False,
    ) -> Tensor:
        from attnbias.planner import plan
        from attnbias.spec import make_spec

        spec = make_spec(query, key, value, attn_bias, causal, scale, dropout_p, enable_gqa)
        return plan(spec).run()


# --------------------------------------------------------------------------------------------
# Tensor


@dataclass(frozen=True, eq=False)
class TensorBias(AttnBias):
    """A plain additive (float) or keep (bool) tensor, broadcastable to ``(B, Hq, L, S)``.

    Always materialised: ``sdpa`` passes it to stock SDPA (a bool tensor as a keep-mask), or
    to the float32 eager path when half-precision inputs cannot hold a float bias exactly. A
    float bias that requires grad gets its exact gradient; its ``-inf`` entries mask, and a NaN
    or ``+inf`` entry makes its row NaN, as in stock SDPA. A bool tensor keeps ``True`` pairs
    (PyTorch's convention). Any rank up to 4 that broadcasts to ``(B, Hq, L, S)`` works.

    >>> TensorBias(torch.tensor([[0.0, -1.0], [float("-inf"), 0.5]])).materialize()
    tensor([[ 0.0000, -1.0000],
            [   -inf,  0.5000]])
    """

    bias: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.bias, Tensor):
            raise TypeError(
                f"TensorBias expects a torch.Tensor, got {type(self.bias).__name__}; "
                f"wrap values with torch.tensor(...)"
            )
        if self.bias.dtype != torch.bool and not self.bias.is_floating_point():
            raise TypeError(
                f"TensorBias expects a floating point (additive) or bool (keep) tensor, got "
                f"dtype={self.bias.dtype}; convert it with .float() or .bool()"
            )
        if self.bias.dim() > 4:
            raise ValueError(
                f"TensorBias must broadcast to (B, H, L, S), got a {self.bias.dim()}-D tensor "
                f"of shape {tuple(self.bias.shape)}"
            )
        if self.bias.is_meta:
            raise ValueError(
                f"TensorBias holds a meta tensor of shape {tuple(self.bias.shape)}, which has no "
                f"values; build it from a tensor on the inputs' device"
            )

    @property
    def matrix(self) -> Tensor:
        """The tensor with at least two dimensions, ``(..., L or 1, S or 1)``: stock SDPA
        indexes a mask's last two dimensions, so ``(S,)`` becomes ``(1, S)``."""
        bias = self.bias
        return bias.reshape((1,) * (2 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 2 else bias

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        bias = self.matrix
        if shape is not None:
            self._check_broadcast(tuple(shape))
        if bias.dtype == torch.bool:
            bias = _keep_to_additive(bias, dtype or torch.float32)
        elif dtype is not None:
            bias = bias.to(dtype)
        if device is not None:
            bias = bias.to(device)
        return bias

    def needs_materialization(self) -> bool:
        return True

    def _check_broadcast(self, shape: tuple[int, ...]) -> None:
        try:
            ok = torch.broadcast_shapes(tuple(self.bias.shape), shape) == torch.Size(shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"TensorBias of shape {tuple(self.bias.shape)} does not broadcast to the "
                f"attention scores of shape (B, Hq, L, S)={shape}; give it a shape such as "
                f"(L, S), (B, 1, L, S) or (B, Hq, L, S)"
            )

    def _validate_call(self, batch: int, heads: int, length_q: int, length_kv: int) -> None:
        self._check_broadcast((batch, heads, length_q, length_kv))

    def __repr__(self) -> str:
        return f"TensorBias(shape={tuple(self.bias.shape)}, dtype={self.bias.dtype})"


# --------------------------------------------------------------------------------------------
# Causal


class CausalVariant(enum.IntEnum):
    """Alignment of a causal mask when ``L != S`` (the values match PyTorch's enum).

    ``UPPER_LEFT`` keeps ``j <= i``; ``LOWER_RIGHT`` keeps ``j <= i + (S - L)``, so the last
    query sees every key (KV cache, chunked prefill).
    """

    UPPER_LEFT = 1
    LOWER_RIGHT = 2


@dataclass(frozen=True)
class CausalBias(_BuiltinBias):
    """Causal mask, aligned to the top-left or bottom-right corner of the ``(L, S)`` scores.

    ``seq_len_q`` / ``seq_len_kv`` are optional; when given, the bias materializes on its own
    (``materialize(device)``) and ``sdpa`` checks them against the inputs.

    >>> causal_lower_right(2, 3).materialize()
    tensor([[0., 0., -inf],
            [0., 0., 0.]])
    """

    variant: CausalVariant = CausalVariant.UPPER_LEFT
    seq_len_q: int | None = None
    seq_len_kv: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.variant, CausalVariant):
            try:
                object.__setattr__(self, "variant", CausalVariant(self.variant))
            except ValueError:
                raise ValueError(
                    f"CausalBias variant must be CausalVariant.UPPER_LEFT or LOWER_RIGHT, got "
                    f"{self.variant!r}"
                ) from None
        for name in ("seq_len_q", "seq_len_kv"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CausalBias {name} must be a positive int or None, got {value!r}")
            if value < 1:
                raise ValueError(f"CausalBias {name} must be a positive int, got {value!r}")

    def offset_hi(self, length_q: int, length_kv: int) -> int:
        """The largest kept ``j - i``."""
        return 0 if self.variant is CausalVariant.UPPER_LEFT else length_kv - length_q

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        return _keep_to_additive(self._keep(device, shape), dtype or torch.float32)

    def _keep(self, device: _Device, shape: _Shape) -> Tensor:
        length_q, length_kv = _resolve_lengths(shape, self.seq_len_q, self.seq_len_kv, "CausalBias")
        return _band_keep(length_q, length_kv, None, self.offset_hi(length_q, length_kv), device)

    def _validate_call(self, batch: int, heads: int, length_q: int, length_kv: int) -> None:
        _resolve_lengths((length_q, length_kv), self.seq_len_q, self.seq_len_kv, "CausalBias")

    def __repr__(self) -> str:
        lengths = ""
        if self.seq_len_q is not None or self.seq_len_kv is not None:
            lengths = f", seq_len_q={self.seq_len_q}, seq_len_kv={self.seq_len_kv}"
        return f"CausalBias({self.variant.name}{lengths})"


def causal_upper_left(seq_len_q: int | None = None, seq_len_kv: int | None = None) -> CausalBias:
    """Causal mask keeping ``j <= i`` (PyTorch's ``is_causal=True``)."""
    return CausalBias(CausalVariant.UPPER_LEFT, seq_len_q, seq_len_kv)


def causal_lower_right(seq_len_q: int | None = None, seq_len_kv: int | None = None) -> CausalBias:
    """Causal mask keeping ``j <= i + (S - L)``; rows ``i < L - S`` are fully masked."""
    return CausalBias(CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv)


# --------------------------------------------------------------------------------------------
# ALiBi


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's head slopes for any number of heads.

    For a power of two ``n`` the slopes are the geometric sequence starting at
    ``2 ** (-8 / n)``; otherwise the slopes of the closest smaller power of two are followed by
    every other slope of twice that power (Press et al., 2022).

    >>> alibi_slopes(4)
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes needs a positive number of heads, got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**k for k in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def _check_slopes(slopes: Any) -> None:
    if not isinstance(slopes, Tensor):
        raise TypeError(
            f"AlibiBias slopes must be a torch.Tensor of shape (Hq,) or (B, Hq), got "
            f"{type(slopes).__name__}; wrap them with torch.tensor(...)"
        )
    if not slopes.is_floating_point():
        raise TypeError(
            f"AlibiBias slopes must be a real floating point tensor, got dtype={slopes.dtype}; "
            f"convert them with .float()"
        )
    if slopes.dim() not in (1, 2) or slopes.numel() == 0:
        raise ValueError(
            f"AlibiBias slopes must have shape (Hq,) or (B, Hq) with Hq > 0, got shape "
            f"{tuple(slopes.shape)}"
        )
    if slopes.is_meta:
        raise ValueError(
            "AlibiBias slopes are a meta tensor, which has no values; build them on the "
            "inputs' device"
        )
    if torch.compiler.is_compiling():
        return
    finite = torch.isfinite(slopes.detach())
    if not bool(finite.all()):
        index = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ValueError(
            f"AlibiBias slopes must be finite, got {slopes.detach()[index].item()} at index "
            f"{index}; the paper's slopes for H heads are AlibiBias(num_heads=H)"
        )


@dataclass(frozen=True, eq=False)
class AlibiBias(_BuiltinBias):
    """ALiBi: adds ``-slope_h * |i + (S - L) - j|`` to the scores of head ``h``.

    Bottom-right aligned and symmetric, as FlashAttention 2; under a causal mask it equals the
    paper's ``slope_h * (j - i')`` up to a per-row constant, so the outputs agree. Give either
    ``num_heads`` (the paper's slopes, for any head count) or ``slopes`` of shape ``(Hq,)`` or
    ``(B, Hq)``.

    >>> AlibiBias(num_heads=2).materialize(shape=(1, 2, 2, 2))[0]
    tensor([[-0.0000, -0.0625],
            [-0.0625, -0.0000]])
    """

    num_heads: int | None = None
    slopes: Tensor | None = field(default=None, repr=False)
    _on_device: dict[Any, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.num_heads is None) == (self.slopes is None):
            raise ValueError(
                f"AlibiBias takes exactly one of num_heads or slopes, got num_heads="
                f"{self.num_heads!r} and slopes={'None' if self.slopes is None else 'a tensor'}"
            )
        if self.num_heads is not None:
            if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int):
                raise TypeError(
                    f"AlibiBias num_heads must be a positive int, got {self.num_heads!r}"
                )
            if self.num_heads < 1:
                raise ValueError(
                    f"AlibiBias num_heads must be a positive int, got {self.num_heads!r}"
                )
        if self.slopes is not None:
            _check_slopes(self.slopes)

    @property
    def heads(self) -> int:
        if self.slopes is not None:
            return int(self.slopes.shape[-1])
        assert self.num_heads is not None  # guaranteed by __post_init__
        return self.num_heads

    def slope_tensor(self, device: _Device = None) -> Tensor:
        """Slopes as a float32 tensor of shape ``(1, Hq)`` or ``(B, Hq)``.

        The paper's slopes are built once per device. Slopes you pass are converted on each
        call (no copy when they are already float32 on ``device``).
        """
        if self.slopes is None:
            return _cached_on(
                self._on_device,
                _device_key(device),
                lambda: torch.tensor(
                    [alibi_slopes(self.heads)], dtype=torch.float32, device=device
                ),
            )
        slopes = self.slopes.to(device=device, dtype=torch.float32)
        return slopes if slopes.dim() == 2 else slopes[None]

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        length_q, length_kv = _resolve_lengths(shape, None, None, "AlibiBias")
        device = (
            device
            if device is not None
            else (self.slopes.device if self.slopes is not None else None)
        )
        rows = torch.arange(length_q, device=device, dtype=torch.float64)[:, None]
        cols = torch.arange(length_kv, device=device, dtype=torch.float64)[None, :]
        distance = (rows + (length_kv - length_q) - cols).abs()
        slopes = self.slope_tensor(device).to(torch.float64)[..., None, None]  # (B|1, H, 1, 1)
        bias = (-slopes * distance).to(dtype or torch.float32)
        return bias if self.slopes is not None and self.slopes.dim() == 2 else bias[0]

    def _validate_call(self, batch: int, heads: int, length_q: int, length_kv: int) -> None:
        if self.heads != heads:
            raise ValueError(
                f"AlibiBias has slopes for {self.heads} heads but the query has Hq={heads}; "
                f"build it with AlibiBias(num_heads={heads})"
            )
        shape = () if self.slopes is None else tuple(self.slopes.shape)
        if len(shape) == 2 and shape[0] not in (1, batch):
            raise ValueError(
                f"AlibiBias slopes of shape {shape} do not match batch "
                f"size B={batch}; use shape (Hq,) or (B, Hq)"
            )

    def __repr__(self) -> str:
        if self.slopes is None:
            return f"AlibiBias(num_heads={self.num_heads})"
        return f"AlibiBias(slopes of shape {tuple(self.slopes.shape)})"


# --------------------------------------------------------------------------------------------
# Sliding window


@dataclass(frozen=True)
class SlidingWindowBias(_BuiltinBias):
    """Local attention, FlashAttention 2's ``window_size=(window_left, window_right)``.

    Keeps ``i + (S - L) - window_left <= j <= i + (S - L) + window_right`` (bottom-right
    aligned, inclusive); ``None`` leaves that side unbounded. ``SlidingWindowBias(W - 1)``
    keeps ``W`` keys per query: the query's own position and the ``W - 1`` before it.

    >>> SlidingWindowBias(1).materialize(shape=(3, 3))
    tensor([[0., -inf, -inf],
            [0., 0., -inf],
            [-inf, 0., 0.]])
    """

    window_left: int | None
    window_right: int | None = 0

    def __post_init__(self) -> None:
        for name in ("window_left", "window_right"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not hasattr(type(value), "__index__"):
                raise TypeError(f"SlidingWindowBias {name} must be an int or None, got {value!r}")
            value = operator.index(value)
            object.__setattr__(self, name, value)
            if value < 0:
                raise ValueError(
                    f"SlidingWindowBias {name} must be >= 0 (or None for unbounded), got "
                    f"{value}; window_left=W-1 keeps W keys per query"
                )

    def offsets(self, length_q: int, length_kv: int) -> tuple[int | None, int | None]:
        """``(lo, hi)`` such that the kept pairs are ``lo <= j - i <= hi``."""
        shift = length_kv - length_q
        lo = None if self.window_left is None else shift - self.window_left
        hi = None if self.window_right is None else shift + self.window_right
        return lo, hi

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        return _keep_to_additive(self._keep(device, shape), dtype or torch.float32)

    def _keep(self, device: _Device, shape: _Shape) -> Tensor:
        length_q, length_kv = _resolve_lengths(shape, None, None, "SlidingWindowBias")
        return _band_keep(length_q, length_kv, *self.offsets(length_q, length_kv), device)


# --------------------------------------------------------------------------------------------
# Documents


def _check_doc_ids(ids: Tensor, name: str) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(
            f"DocumentBias {name} must be a torch.Tensor of integer ids, got {type(ids).__name__}"
        )
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(
            f"DocumentBias {name} must hold integer document ids, got dtype={ids.dtype}; "
            f"convert with .long()"
        )
    if ids.dim() not in (1, 2) or ids.shape[-1] == 0:
        raise ValueError(
            f"DocumentBias {name} must have shape (L,) or (B, L) with L > 0, got {tuple(ids.shape)}"
        )
    if torch.compiler.is_compiling():
        return
    if ids.shape[-1] > 1 and bool((ids[..., 1:] < ids[..., :-1]).any()):
        position = int((ids[..., 1:] < ids[..., :-1]).nonzero()[0, -1]) + 1
        raise ValueError(
            f"DocumentBias {name} must be non-decreasing along the sequence (packed documents), "
            f"but it decreases at position {position}; sort the sequences by document or build "
            f"the ids with DocumentBias.from_seqlens(...)"
        )


@dataclass(frozen=True, eq=False)
class DocumentBias(_BuiltinBias):
    """Packed documents: query ``i`` attends to key ``j`` only when ``doc_q[i] == doc_kv[j]``.

    ``q_doc_ids`` has shape ``(L,)`` or ``(B, L)``, ``kv_doc_ids`` ``(S,)`` or ``(B, S)``
    (default: the query ids, for self-attention); ids are non-decreasing along the sequence.
    Combine with :class:`CausalBias` for causal packed training.

    >>> DocumentBias.from_seqlens([1, 2]).materialize()
    tensor([[0., -inf, -inf],
            [-inf, 0., 0.],
            [-inf, 0., 0.]])
    """

    q_doc_ids: Tensor = field(repr=False)
    kv_doc_ids: Tensor | None = field(default=None, repr=False)
    _on_device: dict[Any, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_doc_ids(self.q_doc_ids, "q_doc_ids")
        if self.kv_doc_ids is not None:
            _check_doc_ids(self.kv_doc_ids, "kv_doc_ids")
            if self.kv_doc_ids.device != self.q_doc_ids.device:
                raise ValueError(
                    f"DocumentBias q_doc_ids is on {self.q_doc_ids.device} but kv_doc_ids is on "
                    f"{self.kv_doc_ids.device}; put both on the device of the inputs"
                )

    @classmethod
    def from_seqlens(
        cls,
        q_seqlens: Sequence[int] | Tensor,
        kv_seqlens: Sequence[int] | Tensor | None = None,
        *,
        device: _Device = None,
    ) -> Self:
        """Document ids for sequences packed back to back.

        ``q_seqlens[d]`` query tokens (and ``kv_seqlens[d]`` keys, default the same) belong to
        document ``d``; ``sum(q_seqlens) == L``, ``sum(kv_seqlens) == S``.
        """
        q_ids = cls._ids_from_seqlens(q_seqlens, "q_seqlens", device)
        if kv_seqlens is None:
            return cls(q_ids)
        kv_ids = cls._ids_from_seqlens(kv_seqlens, "kv_seqlens", device)
        if len(kv_seqlens) != len(q_seqlens):
            raise ValueError(
                f"DocumentBias.from_seqlens needs one kv length per document: got "
                f"{len(q_seqlens)} query lengths and {len(kv_seqlens)} kv lengths"
            )
        return cls(q_ids, kv_ids)

    @staticmethod
    def _ids_from_seqlens(seqlens: Sequence[int] | Tensor, name: str, device: _Device) -> Tensor:
        try:
            lengths = torch.as_tensor(seqlens)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"DocumentBias.from_seqlens: {name} must be a list or 1-D tensor of int lengths, "
                f"got {seqlens!r}"
            ) from None
        if lengths.dim() != 1 or lengths.numel() == 0:
            raise ValueError(
                f"DocumentBias.from_seqlens: {name} must be a non-empty 1-D list of lengths, got "
                f"shape {tuple(lengths.shape)}"
            )
        mixed_bools = isinstance(seqlens, (list, tuple)) and any(
            isinstance(n, bool) for n in seqlens
        )
        if (
            mixed_bools
            or lengths.dtype == torch.bool
            or lengths.is_floating_point()
            or lengths.is_complex()
        ):
            # a fractional length would be truncated, and True would count as 1
            raise TypeError(
                f"DocumentBias.from_seqlens: {name} must hold int lengths, got {lengths.tolist()} "
                f"(dtype={lengths.dtype}); pass whole numbers of tokens as ints"
            )
        lengths = lengths.to(device=device, dtype=torch.long)
        if bool((lengths < 0).any()) or int(lengths.sum()) == 0:
            raise ValueError(
                f"DocumentBias.from_seqlens: {name} must be non-negative with a positive sum, "
                f"got {lengths.tolist()}"
            )
        return torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device), lengths
        )

    @property
    def kv_ids(self) -> Tensor:
        return self.q_doc_ids if self.kv_doc_ids is None else self.kv_doc_ids

    def ids_on(self, device: _Device) -> tuple[Tensor, Tensor]:
        """``(q_ids, kv_ids)`` as int64 ``(1 or B, L)`` and ``(1 or B, S)`` on ``device``.

        The ids are copied to a device once and kept with the bias (a bias is immutable: do not
        modify its id tensors in place). Build the bias on the inputs' device (``device=`` in
        :meth:`from_seqlens`) to skip even that copy.
        """

        def prepare(ids: Tensor) -> Tensor:
            ids = ids.to(device=device, dtype=torch.long)
            return ids if ids.dim() == 2 else ids[None]

        key = _device_key(device)
        q_ids = _cached_on(self._on_device, ("q", key), lambda: prepare(self.q_doc_ids))
        kv_ids = _cached_on(self._on_device, ("kv", key), lambda: prepare(self.kv_ids))
        return q_ids, kv_ids

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        return _keep_to_additive(self._keep(device, shape), dtype or torch.float32)

    def _keep(self, device: _Device, shape: _Shape) -> Tensor:
        q_ids, kv_ids = self.q_doc_ids, self.kv_ids
        if shape is not None:
            shape = tuple(shape)
            self._validate_call(
                shape[0] if len(shape) == 4 else 1, 1, int(shape[-2]), int(shape[-1])
            )
        keep = q_ids[..., :, None] == kv_ids[..., None, :]
        if keep.dim() == 3:  # (B, L, S) -> (B, 1, L, S)
            keep = keep[:, None]
        if device is not None:
            keep = keep.to(device)
        return keep

    def _validate_call(self, batch: int, heads: int, length_q: int, length_kv: int) -> None:
        for name, ids, length, letter in (
            ("q_doc_ids", self.q_doc_ids, length_q, "L"),
            ("kv_doc_ids", self.kv_ids, length_kv, "S"),
        ):
            if ids.shape[-1] != length:
                raise ValueError(
                    f"DocumentBias {name} has length {ids.shape[-1]} but the call has "
                    f"{letter}={length}; give one id per {'query' if letter == 'L' else 'key'}"
                    + (
                        " (pass kv_doc_ids when S != L)"
                        if self.kv_doc_ids is None and letter == "S"
                        else ""
                    )
                )
            if ids.dim() == 2 and ids.shape[0] not in (1, batch):
                raise ValueError(
                    f"DocumentBias {name} of shape {tuple(ids.shape)} does not match batch size "
                    f"B={batch}; use shape ({letter},) or (B, {letter})"
                )

    def __repr__(self) -> str:
        return (
            f"DocumentBias(q_doc_ids of shape {tuple(self.q_doc_ids.shape)}, kv_doc_ids of "
            f"shape {tuple(self.kv_ids.shape)})"
        )


# --------------------------------------------------------------------------------------------
# Valid key ranges (padding, the filled part of a cache)


def _check_key_bound(value: Any, name: str) -> Tensor | None:
    if value is None:
        return None
    if isinstance(value, Tensor):
        bound = value
    else:
        values = list(value) if isinstance(value, Sequence) else value
        if isinstance(values, list) and any(
            isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in values
        ):
            raise TypeError(f"KeyRangeBias {name} must hold int positions, got {values!r}")
        try:
            bound = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"KeyRangeBias {name} must be a (B,) tensor or list of int positions, got {value!r}"
            ) from None
    if bound.dtype.is_floating_point or bound.dtype.is_complex or bound.dtype == torch.bool:
        raise TypeError(
            f"KeyRangeBias {name} must hold integer positions, got dtype={bound.dtype}; convert "
            f"with .long()"
        )
    if bound.dim() != 1 or bound.numel() == 0:
        raise ValueError(
            f"KeyRangeBias {name} must have shape (B,) with one position per batch row, got "
            f"{tuple(bound.shape)}"
        )
    if not torch.compiler.is_compiling() and bool((bound < 0).any()):
        raise ValueError(
            f"KeyRangeBias {name} must be >= 0, got {bound.tolist()}; positions count keys from 0"
        )
    return bound


@dataclass(frozen=True, eq=False)
class KeyRangeBias(_BuiltinBias):
    """The valid keys of each batch row: query ``i`` of row ``b`` attends to key ``j`` only
    when ``start[b] <= j < end[b]``.

    For padded batches (left padding: ``start`` is the padding length; right padding: ``end``
    is the sequence length) and for a key/value cache of which only a prefix is filled.
    ``start`` and ``end`` are ``(B,)`` integer tensors or lists (``(1,)`` broadcasts over the
    batch); ``None`` means ``0`` and ``S``. A row whose range is empty keeps no key (its
    output is 0). Keys outside the range reach nothing at all, on every route: a NaN in a
    padded key or an unused cache slot stays out of every output and gradient.

    Positions given as ``torch.int32`` tensors of shape ``(B,)`` on the inputs' device are
    used as they are, not copied: a cache that fills can write ``end += 1`` in place between
    decode steps, and the next call with the same bias (a CUDA-graph replay of a captured
    call too) sees it. They must stay ``0 <= start <= end``, which is checked only when the
    bias is made. Positions of another dtype, shape or device are copied once, and later
    writes into them are not seen.

    >>> KeyRangeBias(start=[1, 0], end=[3, 2]).materialize(shape=(2, 1, 1, 3))
    tensor([[[[-inf, 0., 0.]]],
    <BLANKLINE>
    <BLANKLINE>
            [[[0., 0., -inf]]]])
    """

    start: Tensor | None = field(default=None, repr=False)
    end: Tensor | None = field(default=None, repr=False)
    _on_device: dict[Any, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        start = _check_key_bound(self.start, "start")
        end = _check_key_bound(self.end, "end")
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)
        if start is not None and end is not None:
            if start.device != end.device:
                raise ValueError(
                    f"KeyRangeBias start is on {start.device} but end is on {end.device}; put "
                    f"both on the device of the inputs"
                )
            if start.shape[0] != end.shape[0] and 1 not in (start.shape[0], end.shape[0]):
                raise ValueError(
                    f"KeyRangeBias start has {start.shape[0]} rows but end has {end.shape[0]}; "
                    f"give one position per batch row (or one for all)"
                )
            if not torch.compiler.is_compiling() and bool((end < start).any()):
                raise ValueError(
                    f"KeyRangeBias needs start <= end in every row, got start={start.tolist()} "
                    f"and end={end.tolist()}"
                )

    @classmethod
    def from_padding_mask(cls, mask: Tensor) -> Self:
        """The key ranges of a ``(B, S)`` padding mask (``True`` or ``1`` = a real token).

        Each row's real tokens must form one contiguous run (left or right padding); a mask
        with holes is no key range: pass it as a :class:`TensorBias` instead.

        >>> KeyRangeBias.from_padding_mask(torch.tensor([[0, 1, 1], [1, 1, 0]]))
        KeyRangeBias(start=[1, 0], end=[3, 2])
        """
        if not isinstance(mask, Tensor):
            raise TypeError(
                f"KeyRangeBias.from_padding_mask takes a (B, S) tensor, got {type(mask).__name__}"
            )
        if mask.dim() != 2:
            raise ValueError(
                f"KeyRangeBias.from_padding_mask takes a (B, S) mask, got shape {tuple(mask.shape)}"
            )
        if mask.dtype != torch.bool:
            if (
                mask.is_floating_point()
                or mask.is_complex()
                or bool(((mask != 0) & (mask != 1)).any())
            ):
                raise ValueError(
                    f"KeyRangeBias.from_padding_mask takes a bool or 0/1 integer mask, got "
                    f"dtype={mask.dtype}"
                    + ("" if mask.is_floating_point() else " with values other than 0 and 1")
                )
            mask = mask != 0
        length = mask.shape[1]
        positions = torch.arange(length, device=mask.device)
        count = mask.sum(1)
        start = torch.where(mask, positions, length).amin(1)
        end = torch.where(mask, positions + 1, 0).amax(1)
        start = torch.where(count > 0, start, 0)
        holes = (count > 0) & (end - start != count)
        if bool(holes.any()):
            row = int(holes.nonzero()[0, 0])
            raise ValueError(
                f"KeyRangeBias.from_padding_mask: row {row} of the mask has padding between "
                f"real tokens, so its keys are no single range; pass the mask as a TensorBias"
            )
        return cls(start, end)

    def bounds_on(self, device: _Device, batch: int, length_kv: int) -> tuple[Tensor, Tensor]:
        """``(start, end)`` as int32 ``(B,)`` tensors on ``device``, ``None`` filled in with 0
        and ``S``: the bias's own tensors where they are int32 ``(B,)`` on ``device`` already
        (so that writes into them are seen), otherwise copied to a device once and kept with
        the bias."""

        def prepare(bound: Tensor | None, default: int) -> Tensor:
            if bound is None:
                return torch.full((batch,), default, dtype=torch.int32, device=device)
            return bound.to(device=device, dtype=torch.int32).expand(batch).contiguous()

        key = (_device_key(device), batch, length_kv)
        start = _cached_on(self._on_device, ("start", key), lambda: prepare(self.start, 0))
        end = _cached_on(self._on_device, ("end", key), lambda: prepare(self.end, length_kv))
        return start, end

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        return _keep_to_additive(self._keep(device, shape), dtype or torch.float32)

    def _keep(self, device: _Device, shape: _Shape) -> Tensor:
        """``(B, 1, 1, S)`` bool."""
        _, length_kv = _resolve_lengths(shape, None, None, "KeyRangeBias")
        shape = tuple(shape) if shape is not None else ()
        rows = [b.shape[0] for b in (self.start, self.end) if b is not None]
        batch = int(shape[0]) if len(shape) == 4 else max(rows, default=1)
        self._validate_call(batch, 1, 1, length_kv)
        cols = torch.arange(length_kv, device=device)
        keep = torch.ones(batch, length_kv, dtype=torch.bool, device=device)
        if self.start is not None:
            keep &= cols >= self.start.to(device)[:, None]
        if self.end is not None:
            keep &= cols < self.end.to(device)[:, None]
        return keep[:, None, None, :]

    def _validate_call(self, batch: int, heads: int, length_q: int, length_kv: int) -> None:
        for name, bound in (("start", self.start), ("end", self.end)):
            if bound is None:
                continue
            if bound.shape[0] not in (1, batch):
                raise ValueError(
                    f"KeyRangeBias {name} has {bound.shape[0]} rows but the call has batch size "
                    f"B={batch}; give one position per batch row"
                )
            if not torch.compiler.is_compiling() and bool((bound > length_kv).any()):
                raise ValueError(
                    f"KeyRangeBias {name}={bound.tolist()} goes past the call's S={length_kv} "
                    f"keys; positions must be at most S"
                )

    def __repr__(self) -> str:
        def show(bound: Tensor | None) -> str:
            if bound is None:
                return "None"
            return str(bound.tolist()) if bound.numel() <= 8 else f"({bound.shape[0]},) tensor"

        return f"KeyRangeBias(start={show(self.start)}, end={show(self.end)})"


# --------------------------------------------------------------------------------------------
# Soft-cap


@dataclass(frozen=True)
class SoftcapBias(_BuiltinBias):
    """Logit soft-capping (Gemma 2): ``s = cap * tanh(s / cap)`` after scaling, before the
    additive biases and the masks.

    It is not additive, so it has no materialized form: ``materialize`` raises and the bias
    always dispatches (to the fused kernel on CUDA, to the exact eager path elsewhere).
    """

    cap: float

    def __post_init__(self) -> None:
        if isinstance(self.cap, bool) or not isinstance(self.cap, numbers.Real):
            raise TypeError(f"SoftcapBias cap must be a positive float, got {self.cap!r}")
        if not (math.isfinite(self.cap) and self.cap > 0):
            raise ValueError(
                f"SoftcapBias cap must be finite and > 0, got cap={self.cap}; Gemma 2 uses 50.0"
            )
        object.__setattr__(self, "cap", float(self.cap))

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        raise TypeError(
            "SoftcapBias transforms the scores (cap * tanh(s / cap)) and has no additive "
            "tensor form; pass it to attnbias.sdpa as attn_mask instead of materializing it"
        )


# --------------------------------------------------------------------------------------------
# Composition


@dataclass(frozen=True, eq=False)
class CompositeBias(AttnBias):
    """The sum of several biases (``a + b``): additive parts add up, masks intersect."""

    parts: tuple[AttnBias, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("CompositeBias needs at least one part")
        for part in self.parts:
            if not isinstance(part, AttnBias) or isinstance(part, CompositeBias):
                raise TypeError(f"CompositeBias parts must be flat AttnBias objects, got {part!r}")
        caps = [p for p in self.parts if isinstance(p, SoftcapBias)]
        if len(caps) > 1:
            raise ValueError(
                f"a bias can hold at most one SoftcapBias, got {caps}; soft-capping twice is "
                f"ambiguous, keep the one you mean"
            )

    def needs_materialization(self) -> bool:
        if any(isinstance(p, SoftcapBias) for p in self.parts):
            return False
        return not all(isinstance(p, _BuiltinBias) for p in self.parts)

    def materialize(
        self, device: _Device = None, *, shape: _Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        dtype = dtype or torch.float32
        form = materialize_masked(self, device, shape, dtype).additive_form(dtype)
        assert form is not None  # every part gives a keep-mask or an additive term
        return form

    # A sum of built-in biases lowers like one; parts with no kernel form are materialized.
    dispatch = staticmethod(_BuiltinBias.dispatch)

    def _validate_call(self, batch: int, heads: int, length_q: int, length_kv: int) -> None:
        for part in self.parts:
            part._validate_call(batch, heads, length_q, length_kv)

    def __repr__(self) -> str:
        return " + ".join(repr(p) for p in self.parts)


# --------------------------------------------------------------------------------------------
# The materialized form every materializing route shares


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is materialized in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)
class MaskedBias:
    """A bias as a keep-mask and an additive part, each broadcastable to ``(B, H, L, S)``.

    ``keep`` (bool, ``True`` = attend) selects; it is never added to the scores, so a
    non-finite score at a masked pair cannot reach a kept one. ``additive`` is float32 or wider
    and holds only the score biases (its ``-inf`` entries are moved to ``keep``). ``None`` means
    every pair is kept, or nothing is added.
    """

    keep: Tensor | None
    additive: Tensor | None

    def additive_form(self, dtype: torch.dtype) -> Tensor | None:
        """The single float tensor of ``materialize``: ``additive`` with ``-inf`` where masked."""
        if self.additive is None:
            return None if self.keep is None else _keep_to_additive(self.keep, dtype)
        if self.keep is None:
            return self.additive.to(dtype)
        return self.additive.masked_fill(~self.keep, -math.inf).to(dtype)


def materialize_masked(
    bias: AttnBias | None, device: _Device, shape: _Shape, dtype: torch.dtype
) -> MaskedBias:
    """``bias`` materialized for a call with scores of ``shape=(B, H, L, S)``, as
    :class:`MaskedBias`; its additive part in :func:`_compute_dtype` of ``dtype``.

    Built-in masks give bool keep-masks. Any other part's ``materialize`` is checked (see
    :func:`check_materialized`); a bool result is its keep-mask, a float result is additive with
    ``-inf`` meaning masked. The keep-masks intersect and the additive parts add up.
    """
    shape = None if shape is None else tuple(int(n) for n in shape)
    compute = _compute_dtype(dtype)
    keep: Tensor | None = None
    additive: Tensor | None = None
    for part in parts_of(bias):
        part_keep: Tensor | None = None
        part_additive: Tensor | None = None
        if isinstance(part, (CausalBias, SlidingWindowBias, DocumentBias, KeyRangeBias)):
            part_keep = part._keep(device, shape)
        elif isinstance(part, AlibiBias):
            part_additive = part.materialize(device, shape=shape, dtype=compute)
        else:
            if isinstance(part, TensorBias):
                if shape is not None:
                    part._check_broadcast(shape)
                result = part.matrix
                if device is not None:
                    result = result.to(device)
            else:
                result = check_materialized(
                    part, part.materialize(device, shape=shape, dtype=compute), shape, device
                )
            if result.dtype == torch.bool:
                part_keep = result
            else:
                result = result.to(compute)
                masked = torch.isneginf(result)
                part_keep = ~masked
                part_additive = result.masked_fill(masked, 0.0)
        if part_keep is not None:
            keep = part_keep if keep is None else keep & part_keep
        if part_additive is not None:
            additive = part_additive if additive is None else additive + part_additive
    return MaskedBias(keep, additive)


def _expected_device(device: _Device) -> torch.device:
    expected = torch.device("cpu") if device is None else torch.device(device)
    if expected.type == "cuda" and expected.index is None:
        expected = torch.device("cuda", torch.cuda.current_device())
    return expected


def check_materialized(
    bias: AttnBias, result: Any, shape: tuple[int, ...] | None, device: _Device
) -> Tensor:
    """``result`` of ``bias.materialize(device, shape=shape, ...)``, checked for the routes.

    It must be a bool keep-mask (``True`` = attend) or a float additive tensor (``-inf`` =
    masked; no NaN or ``+inf``), on ``device``, broadcastable to ``shape=(B, H, L, S)``.
    Raises ``TypeError`` / ``ValueError`` naming the class, the value and the fix.
    """
    owner = f"{type(bias).__name__}.materialize"
    wanted = (
        f"return a bool keep-mask (True = attend) or a float additive tensor (-inf = masked) "
        f"broadcastable to (B, H, L, S)={shape}"
    )
    if not isinstance(result, Tensor):
        raise TypeError(f"{owner} returned {type(result).__name__}, not a tensor; {wanted}")
    if result.dtype != torch.bool and not result.is_floating_point():
        raise TypeError(
            f"{owner} returned a tensor of dtype={result.dtype}; {wanted} (convert a 0/1 mask "
            f"with .bool())"
        )
    if result.device != _expected_device(device):
        raise ValueError(
            f"{owner} returned a tensor on {result.device} but the inputs are on "
            f"{_expected_device(device)}; create it with device=device"
        )
    try:
        fits = shape is None or torch.broadcast_shapes(result.shape, shape) == torch.Size(shape)
    except RuntimeError:
        fits = False
    if not fits or result.dim() > 4:
        raise ValueError(
            f"{owner} returned a tensor of shape {tuple(result.shape)}, which does not broadcast "
            f"to (B, H, L, S)={shape}; give it a shape such as (L, S), (B, 1, L, S) or (B, H, L, S)"
        )
    if result.dim() < 2:
        result = result.reshape((1,) * (2 - result.dim()) + tuple(result.shape))
    if result.is_floating_point() and not torch.compiler.is_compiling():
        bad = torch.isnan(result) | torch.isposinf(result)
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{owner} returned {result.detach()[index].item()} at index {index} "
                f"({int(bad.sum())} NaN or +inf entries); return 0 where attended, -inf where "
                f"masked and finite values for score biases"
            )
    return result


def check_dispatched(bias: AttnBias, result: Any, query: Tensor, value: Tensor) -> Tensor:
    """``result`` of ``type(bias).dispatch(query, key, value, ...)``, checked: a tensor of shape
    ``(B, Hq, L, Ev)`` in the dtype and on the device of ``query``."""
    owner = f"{type(bias).__name__}.dispatch"
    batch, heads, length_q, _ = query.shape
    expected = (batch, heads, length_q, value.shape[-1])
    if not isinstance(result, Tensor):
        raise TypeError(
            f"{owner} returned {type(result).__name__}, not a tensor; return the attention "
            f"output of shape (B, Hq, L, Ev)={expected}"
        )
    if tuple(result.shape) != expected:
        raise ValueError(
            f"{owner} returned shape {tuple(result.shape)}; the attention output must have shape "
            f"(B, Hq, L, Ev)={expected}"
        )
    if result.dtype != query.dtype or result.device != query.device:
        raise TypeError(
            f"{owner} returned a tensor of dtype={result.dtype} on {result.device}; the output "
            f"must match the query: dtype={query.dtype} on {query.device}"
        )
    return result

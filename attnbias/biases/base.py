"""The base class every bias derives from, and what each bias kind gives the library.

A bias kind is one module of this package. It defines a frozen dataclass deriving from
:class:`AttnBias` and, through public methods, everything the library asks of it:

* ``__post_init__``: validation of its own fields (``TypeError`` / ``ValueError`` naming the
  value and the fix);
* :meth:`AttnBias.validate_call`: whether it fits a call of shape ``(B, Hq, L, S)``;
* :meth:`AttnBias.lower`: its :class:`~attnbias.terms.Terms` for a call (band limits,
  documents, key ranges, score terms; a part with no kernel form lowers to itself, to be
  materialized);
* :meth:`AttnBias.masked`: its materialized form as a keep-mask and an additive part;
* :meth:`AttnBias.cache_key`: its identity in the plan cache (``None``: not cached);
* :meth:`AttnBias.parameters`: the tensors whose gradient it may need;
* :meth:`AttnBias.sub_block`: the bias of a block of a call's scores, as a bias of its own
  (context parallelism runs each shard pair so);
* :meth:`AttnBias.sub_heads`: the bias of a range of a call's query heads, as a bias of a call
  with that many heads (the head-parallel mode of context parallelism runs each rank's heads
  so).

The sum of biases (:class:`~attnbias.biases.base.CompositeBias`) merges its parts' terms
and masked forms without knowing their kinds.

Shape legend used throughout:

    B   batch size              L   query sequence length
    Hq  query heads             S   key/value sequence length
    Hkv key/value heads         E   head dimension

``materialize`` returns the additive float form of a bias: ``0`` where attended, ``-inf`` where
masked, finite values for score biases such as ALiBi. It returns the fewest dimensions it needs
(a causal mask is ``(L, S)``), broadcastable to ``(B, H, L, S)``.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnbias.kernels.pools import outside_pools
from attnbias.materialize import MaskedBias, check_materialized, compute_dtype
from attnbias.terms import Block, Call, Terms

__all__ = [
    "AttnBias",
    "CompositeBias",
    "Device",
    "HashedKey",
    "HeadSlicedBias",
    "KernelBias",
    "KernelMask",
    "Shape",
    "SlicedBias",
    "band_keep",
    "cached_on",
    "check_head_range",
    "device_key",
    "keep_to_additive",
    "materialize_masked",
    "parts_of",
    "resolve_lengths",
    "set_router",
]

Device = torch.device | str | int | None
Shape = Sequence[int] | torch.Size | None


def resolve_lengths(
    shape: Shape, seq_len_q: int | None, seq_len_kv: int | None, owner: str
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


def cached_on(cache: dict[Any, Tensor], key: Any, make: Callable[[], Tensor]) -> Tensor:
    """``make()``, kept in ``cache`` under ``key`` (not while torch.compile traces).

    Built-in biases copy their small tensors (slopes, document ids) to the inputs' device once:
    a copy from host memory on every call would synchronise the device with the host each time.

    Kept tensors are made outside any memory pool this thread's allocations are routed to
    (:func:`attnbias.kernels.pools.outside_pools`): one made inside a pool that CUDA graphs
    share could lie where an earlier graph writes at its replays. While a CUDA graph is being
    captured, a kept tensor is read but none is kept: a tensor made then is filled by the
    captured work, which runs only when that graph is replayed, so no other call may read it.
    """
    if torch.compiler.is_compiling():
        return make()
    found = cache.get(key)
    if found is None:
        if capturing_now():
            return make()
        if len(cache) >= KEPT_PER_CACHE:  # the oldest goes (a plan holding it keeps it alive)
            del cache[next(iter(cache))]
        found = cache[key] = outside_pools(make)
    return found


# Tensors a bias keeps per device and call shape (a key range's default ends per key count,
# copies per version of its positions): a bias reused over a growing cache would keep one per
# step without a bound.
KEPT_PER_CACHE = 16


def capturing_now() -> bool:
    """Whether the current CUDA stream is capturing a graph (``False`` without CUDA). Not to
    be asked while ``torch.compile`` traces (it cannot trace the query): callers check
    ``torch.compiler.is_compiling()`` first."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_key(device: Device) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def keep_to_additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    zeros = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zeros, torch.full((), -math.inf, dtype=dtype, device=keep.device))


def band_keep(
    length_q: int, length_kv: int, lo: int | None, hi: int | None, device: Device
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

    Beyond these, a subclass may override the public methods below (the built-in kinds do):
    :meth:`validate_call`, :meth:`lower`, :meth:`masked`, :meth:`cache_key`,
    :meth:`parameters`, :meth:`sub_block` and :meth:`sub_heads`.
    """

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
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

    #: Whether the bias is, or holds, a :class:`~attnbias.biases.paged.PagedKV`: the call's
    #: key and value are page pools then (``attnbias.paged``).
    holds_pages: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.materialize is AttnBias.materialize and cls.dispatch is AttnBias.dispatch:
            raise TypeError(
                f"{cls.__name__} implements neither materialize() nor dispatch(); an AttnBias "
                f"subclass must implement at least one of them"
            )

    def __add__(self, other: object) -> CompositeBias:
        other = _operand(self, other)
        if not isinstance(other, AttnBias):
            return NotImplemented
        return CompositeBias((*parts_of(self), *parts_of(other)))

    def __radd__(self, other: object) -> AttnBias:
        # sum([a, b]) starts from 0
        if isinstance(other, int) and not isinstance(other, bool) and other == 0:
            return self
        other = _operand(self, other)
        if not isinstance(other, AttnBias):
            return NotImplemented
        return CompositeBias((*parts_of(other), *parts_of(self)))

    # -- what the library asks of a bias kind (override in a subclass) -----------------------

    def validate_call(self, call: Call) -> None:
        """Raise ``ValueError`` naming the values when the bias cannot apply to ``call``."""
        return None

    def lower(self, call: Call) -> Terms:
        """The bias's terms for ``call``. By default it has no kernel form: the term is the
        bias itself, materialized by the routes that take it."""
        return Terms.of(others=(self,))

    def masked(self, device: Device, shape: Shape, dtype: torch.dtype) -> MaskedBias:
        """The bias materialized for scores of ``shape=(B, H, L, S)`` as a keep-mask and an
        additive part (in :func:`~attnbias.materialize.compute_dtype` of ``dtype``).

        By default from :meth:`materialize`, checked: a bool result is the keep-mask, a float
        result is additive with ``-inf`` meaning masked."""
        compute = compute_dtype(dtype)
        shape = None if shape is None else tuple(int(n) for n in shape)
        result = check_materialized(
            self, self.materialize(device, shape=shape, dtype=compute), shape, device
        )
        return MaskedBias.of_tensor(result, compute)

    def cache_key(self) -> Hashable | None:
        """What identifies this bias in the plan cache, or ``None`` to keep its calls out of
        it (the default: a bias of unknown kind may change what it lowers to)."""
        return None

    @property
    def cache_key_varies(self) -> bool:
        """Whether :meth:`cache_key` may change from call to call (it holds the versions of
        tensors that decide the lowering), so that a sum must ask for it at every call."""
        return False

    def parameters(self) -> tuple[Tensor, ...]:
        """The tensors of this bias that may require grad (a call then records gradients)."""
        return ()

    def sub_block(self, call: Call, block: Block) -> AttnBias:
        """The bias of ``block`` of ``call``'s scores, as a bias of a call of ``(B, Hq,
        block.length_q, block.length_kv)``: it keeps pair ``(i, j)`` and adds to its score
        exactly what this bias does to pair ``(block.q_start + i, block.kv_start + j)`` of
        ``call``. Its tensors that require grad are (or are views of) this bias's own, so
        gradients reach :meth:`parameters`.

        By default the materialized form of the whole call, sliced (:class:`SlicedBias`):
        exact for any bias with :meth:`materialize`, but ``L x S`` in size; the built-in kinds
        give a bias of the block's own size (a band shifted along the diagonal, sliced document
        ids, shifted key ranges, ``ModBias`` functions reading the call's indices). A bias
        that only dispatches has no block form: ``TypeError``."""
        if type(self).materialize is AttnBias.materialize:
            raise TypeError(
                f"{type(self).__name__} has no materialized form and no sub_block(); "
                f"attention over blocks of the scores (context parallelism) needs one of them: "
                f"implement materialize() or sub_block(call, block)"
            )
        return SlicedBias(self, call, block)

    def sub_heads(self, call: Call, start: int, count: int) -> AttnBias:
        """The bias of the query heads ``[start, start + count)`` of ``call``, as a bias of a
        call of ``(B, count, L, S)``: its head ``h`` keeps and adds exactly what this bias does
        for head ``start + h`` of ``call``. Its tensors that require grad are (or are views
        of) this bias's own, so gradients reach :meth:`parameters` (those of the other heads'
        entries are zero).

        By default the materialized form of the whole call's heads, narrowed to the range
        (:class:`HeadSlicedBias`): exact for any bias with :meth:`materialize`, but ``L x S``
        (per head where it depends on the head) in size; the built-in kinds give a bias of
        their own kind (``self`` where the bias does not depend on the head, sliced ALiBi
        slopes and tensors, ``ModBias`` functions reading the call's head index). A bias that
        only dispatches has no head form: ``TypeError``."""
        check_head_range(call, start, count, type(self).__name__)
        if type(self).materialize is AttnBias.materialize:
            raise TypeError(
                f"{type(self).__name__} has no materialized form and no sub_heads(); "
                f"attention over a range of the heads (head-parallel context parallelism) "
                f"needs one of them: implement materialize() or sub_heads(call, start, count)"
            )
        if start == 0 and count == call.heads:
            return self
        return HeadSlicedBias(self, call, start, count)

    def in_sum(self, parts: tuple[AttnBias, ...]) -> None:
        """Called once on each part as a sum of ``parts`` (this bias among them) is built:
        work a kind does for its parts together, ahead of the calls. Nothing by default."""
        return None

    # -- copies ------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """The bias's fields, without what it worked out for its calls (traced functions,
        generated code, kept blocks and keys): ``copy``, ``deepcopy`` and ``pickle`` take
        these, and the copy works its own out again. A bias that is no dataclass keeps all."""
        state = dict(self.__dict__)
        if dataclasses.is_dataclass(self):
            fields = {f.name for f in dataclasses.fields(self) if f.init}
            for name in [n for n in state if n.startswith("_") and n not in fields]:
                del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)  # frozen dataclasses too
        if dataclasses.is_dataclass(self):
            # fields kept for the calls (``init=False``) start empty, as in a new bias
            for field in dataclasses.fields(self):
                if not field.init and field.name not in state:
                    if field.default_factory is not dataclasses.MISSING:
                        object.__setattr__(self, field.name, field.default_factory())
                    elif field.default is not dataclasses.MISSING:
                        object.__setattr__(self, field.name, field.default)
        self.restored()

    def restored(self) -> None:
        """Called on a copy (``copy``, ``deepcopy``, ``pickle``) once its fields are set: the
        work a kind does as it is built and that the copy left out. Nothing by default."""
        return None


# The library's dispatcher, which runs a bias that lowers into the kernels' terms. Set by
# ``attnbias.functional`` when it is imported: the biases sit below the dispatcher and do not
# import it (``import attnbias`` imports both).
_router: list[Callable[..., Tensor]] = []


def set_router(route: Callable[..., Tensor]) -> None:
    """Install the function :meth:`KernelBias.dispatch` calls (``attnbias.functional._route``)."""
    _router[:] = [route]


class KernelBias(AttnBias):
    """A bias that lowers into the kernels' terms (every built-in kind): it needs no
    materialization and its ``dispatch`` is the library's dispatcher."""

    #: False for a kind with no materialized form (soft-cap): a sum holding one never
    #: materializes, it always dispatches.
    materializable: ClassVar[bool] = True
    #: True for a kind a sum may hold at most once (soft-cap: capping twice is ambiguous).
    unique: ClassVar[bool] = False

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
        return _router[0](query, key, value, attn_bias, causal, scale, dropout_p, enable_gqa)


@dataclass(frozen=True, eq=False)
class CompositeBias(AttnBias):
    """The sum of several biases (``a + b``): additive parts add up, masks intersect.

    It merges its parts' terms (:meth:`lower`) and materialized forms (:meth:`masked`) without
    knowing their kinds."""

    parts: tuple[AttnBias, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("CompositeBias needs at least one part")
        for part in self.parts:
            if not isinstance(part, AttnBias) or isinstance(part, CompositeBias):
                raise TypeError(f"CompositeBias parts must be flat AttnBias objects, got {part!r}")
        for kind in {type(p) for p in self.parts if getattr(p, "unique", False)}:
            same = [p for p in self.parts if type(p) is kind]
            if len(same) > 1:
                raise ValueError(
                    f"a bias can hold at most one {kind.__name__}, got {same}; applying it "
                    f"twice is ambiguous, keep the one you mean"
                )
        for part in self.parts:
            part.in_sum(self.parts)
        object.__setattr__(self, "holds_pages", any(p.holds_pages for p in self.parts))

    def needs_materialization(self) -> bool:
        kernel_parts = [p for p in self.parts if isinstance(p, KernelBias)]
        if any(not p.materializable for p in kernel_parts):
            return False
        return len(kernel_parts) < len(self.parts)

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        dtype = dtype or torch.float32
        return self.masked(device, shape, dtype).tensor(dtype)

    # A sum of biases that lower runs as one; parts with no kernel form are materialized.
    dispatch = staticmethod(KernelBias.dispatch)

    def validate_call(self, call: Call) -> None:
        for part in self.parts:
            part.validate_call(call)

    def lower(self, call: Call) -> Terms:
        terms = Terms.of()
        for part in self.parts:
            terms = terms.merge(part.lower(call))
        return terms

    def masked(self, device: Device, shape: Shape, dtype: torch.dtype) -> MaskedBias:
        masked = MaskedBias(None, None, None, ())
        for part in self.parts:
            masked = masked.merge(part.masked(device, shape, dtype))
        return masked

    def cache_key(self) -> Hashable | None:
        # worked out once (biases are immutable) unless a part's key varies; False where a
        # part has none
        found = self.__dict__.get("_cache_key")
        if found is None:
            keys = tuple(part.cache_key() for part in self.parts)
            found = False if None in keys else HashedKey(keys)
            if not self.cache_key_varies:
                object.__setattr__(self, "_cache_key", found)
        return found or None

    @property
    def cache_key_varies(self) -> bool:
        found = self.__dict__.get("_key_varies")
        if found is None:
            found = any(part.cache_key_varies for part in self.parts)
            object.__setattr__(self, "_key_varies", found)
        return bool(found)

    def parameters(self) -> tuple[Tensor, ...]:
        return tuple(t for part in self.parts for t in part.parameters())

    def restored(self) -> None:
        for part in self.parts:
            part.in_sum(self.parts)

    def sub_block(self, call: Call, block: Block) -> AttnBias:
        """The sum of the parts' blocks."""
        return CompositeBias(tuple(part.sub_block(call, block) for part in self.parts))

    def sub_heads(self, call: Call, start: int, count: int) -> AttnBias:
        """The sum of the parts' head ranges (the sum itself where no part depends on the
        head)."""
        heads = tuple(part.sub_heads(call, start, count) for part in self.parts)
        if all(a is b for a, b in zip(heads, self.parts, strict=True)):
            return self
        return CompositeBias(tuple(p for part in heads for p in parts_of(part)))

    def __repr__(self) -> str:
        return " + ".join(repr(p) for p in self.parts)


@dataclass(frozen=True, eq=False)
class SlicedBias(AttnBias):
    """A block of another bias's materialized form (:meth:`AttnBias.sub_block`'s default):
    ``bias`` materialized for the whole ``call`` (batch and heads from the block's shape),
    then the block's rows and columns taken. Exact for any bias that materializes; its size
    is the whole call's."""

    bias: AttnBias
    call: Call
    block: Block

    def needs_materialization(self) -> bool:
        return True

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        block = self.block
        length_q, length_kv = resolve_lengths(
            shape, block.length_q, block.length_kv, type(self.bias).__name__
        )
        lead = tuple(shape)[:-2] if shape is not None else ()
        whole = (*lead, self.call.length_q, self.call.length_kv)
        result = check_materialized(
            self.bias, self.bias.materialize(device, shape=whole, dtype=dtype), whole, device
        )
        # a dimension of 1 broadcasts over the whole call, and so over the block
        if result.shape[-2] != 1:
            result = result.narrow(-2, block.q_start, length_q)
        if result.shape[-1] != 1:
            result = result.narrow(-1, block.kv_start, length_kv)
        return result

    def parameters(self) -> tuple[Tensor, ...]:
        return self.bias.parameters()

    def __repr__(self) -> str:
        block = self.block
        return (
            f"{self.bias!r}[{block.q_start}:{block.q_start + block.length_q}, "
            f"{block.kv_start}:{block.kv_start + block.length_kv}]"
        )


@dataclass(frozen=True, eq=False)
class HeadSlicedBias(AttnBias):
    """A range of the query heads of another bias's materialized form
    (:meth:`AttnBias.sub_heads`'s default): ``bias`` materialized for all ``call.heads`` heads
    (``(B, Hq, L, S)``, the batch and lengths from the asked shape), then the heads
    ``[start, start + count)`` taken where the result has a head dimension. Exact for any
    bias that materializes; ``L x S`` in size, per head where it depends on the head."""

    bias: AttnBias
    call: Call
    start: int
    count: int

    def needs_materialization(self) -> bool:
        return True

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        call = self.call
        length_q, length_kv = resolve_lengths(
            shape, call.length_q, call.length_kv, type(self.bias).__name__
        )
        lead = () if shape is None else tuple(shape)[:-3]
        whole = (int(lead[0]) if lead else call.batch_size, call.heads, length_q, length_kv)
        result = check_materialized(
            self.bias, self.bias.materialize(device, shape=whole, dtype=dtype), whole, device
        )
        # a head dimension of 1 (or none) broadcasts over every head, and so over the range
        if result.dim() >= 3 and result.shape[-3] != 1:
            result = result.narrow(-3, self.start, self.count)
        return result

    def parameters(self) -> tuple[Tensor, ...]:
        return self.bias.parameters()

    def __repr__(self) -> str:
        return f"{self.bias!r}[heads {self.start}:{self.start + self.count}]"


def check_head_range(call: Call, start: int, count: int, owner: str) -> None:
    """``ValueError`` naming the values unless ``[start, start + count)`` is a range of
    ``call``'s ``Hq`` query heads."""
    for name, value in (("start", start), ("count", count)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}.sub_heads: {name} must be an int, got {value!r}")
    if start < 0 or count < 0 or start + count > call.heads:
        raise ValueError(
            f"{owner}.sub_heads: the heads [{start}, {start + count}) are not a range of the "
            f"call's Hq={call.heads} query heads; pass 0 <= start and start + count <= {call.heads}"
        )


class HashedKey:
    """A sum's cache key with its hash worked out once: a call hashes it on every lookup, and
    the hash of a tuple of frozen dataclasses is Python code, part by part."""

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple[Hashable, ...]) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return type(other) is HashedKey and self._hash == other._hash and self.parts == other.parts


def parts_of(bias: AttnBias | None) -> tuple[AttnBias, ...]:
    """The flat parts of a bias: those of a sum, the bias itself, or none for ``None``."""
    if bias is None:
        return ()
    return bias.parts if isinstance(bias, CompositeBias) else (bias,)


class KernelMask(KernelBias):
    """A :class:`KernelBias` that only masks: its materialized form is its bool keep-mask
    (:meth:`keep`), ``0`` / ``-inf`` as a float tensor."""

    @abstractmethod
    def keep(self, device: Device = None, shape: Shape = None) -> Tensor:
        """The bool keep-mask (``True`` = attend) for scores of ``shape=(B, H, L, S)``,
        broadcastable to it."""

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        return keep_to_additive(self.keep(device, shape), dtype or torch.float32)

    def masked(self, device: Device, shape: Shape, dtype: torch.dtype) -> MaskedBias:
        return MaskedBias(self.keep(device, shape), None, None, ())

    def sub_heads(self, call: Call, start: int, count: int) -> AttnBias:
        """The bias itself: a mask in the kernels' terms (a band, documents, key ranges) is
        the same for every head."""
        check_head_range(call, start, count, type(self).__name__)
        return self


def materialize_masked(
    bias: AttnBias | None, device: Device, shape: Shape, dtype: torch.dtype
) -> MaskedBias:
    """``bias`` materialized for a call with scores of ``shape=(B, H, L, S)``, as
    :class:`~attnbias.materialize.MaskedBias` (its additive part in
    :func:`~attnbias.materialize.compute_dtype` of ``dtype``): each part's
    :meth:`AttnBias.masked`, the keep-masks intersected and the additive parts added up."""
    if bias is None:
        return MaskedBias(None, None, None, ())
    shape = None if shape is None else tuple(int(n) for n in shape)
    return bias.masked(device, shape, dtype)


def from_torch(value: object) -> AttnBias | None:
    """The attnbias form of PyTorch's own bias objects (``torch.nn.attention.bias``'s
    ``CausalBias``, from its ``causal_upper_left`` / ``causal_lower_right``: the causal bias
    of the same alignment and lengths), or ``None`` for anything else."""
    if value is None or type(value) is Tensor or isinstance(value, AttnBias):
        return None  # (the common case, answered without the import below)
    try:
        from torch.nn.attention.bias import CausalBias as TorchCausal
    except ImportError:  # pragma: no cover - PyTorch before 2.2
        return None
    if not isinstance(value, TorchCausal):
        return None
    from attnbias.biases.causal import CausalBias, CausalVariant

    variant = CausalVariant(int(getattr(value.variant, "value", value.variant)))
    return CausalBias(variant, int(value.seq_len_q), int(value.seq_len_kv))


def _operand(bias: AttnBias, other: object) -> object:
    """``other`` as an operand of ``bias + other``: PyTorch's causal bias as ours; a plain
    tensor refused with the fix."""
    converted = from_torch(other)
    if converted is not None:
        return converted
    if isinstance(other, Tensor):
        raise TypeError(
            f"cannot add a plain Tensor of shape {tuple(other.shape)} and a bias "
            f"({type(bias).__name__}): wrap the tensor in attnbias.TensorBias, e.g. "
            f"bias + TensorBias(mask)"
        )
    return other

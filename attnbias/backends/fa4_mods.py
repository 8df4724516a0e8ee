"""FlashAttention 4's form of generated mask and score functions (``ModBias``): the traced graph
(:class:`~attnbias.kernels.modgraph.TracedMods`) written as CuTe DSL source for FlashAttention 4's
callbacks, and the block lists of the mask functions as its block sparsity.

The callbacks, with FlashAttention 4's signatures (``b_idx``, ``h_idx``, ``q_idx``, ``kv_idx``
are Int32 ``TensorSSA`` values, ``score`` and ``grad`` Float32 ones, the scaled score)::

    mask_mod(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars)  -> Boolean
    score_mod(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars)
    score_mod_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors, aux_scalars)

``mask_mod`` keeps a pair where every mask function keeps it and, when the call has a band,
where ``band_lo <= kv_idx - q_idx <= band_hi`` (FlashAttention 4 applies no window together
with a ``mask_mod``). ``score_mod`` applies the soft-cap, when the call has one, then every
score function in order; ``score_mod_bwd`` returns ``grad * d score_mod / d score`` by the
chain rule, written only for the operations whose derivative it writes exactly (see
:func:`reasons`). Integers are computed in 32 bits (a graph with an integer that may leave them,
which the Triton kernels compute in 64, is refused: :func:`reasons`) and floats in float32, as
in the Triton kernels.

The graph's numbers (and the band, the soft-cap, the parameters' sizes) are FlashAttention 4's
``aux_scalars``, runtime arguments: new numbers and new lengths compile nothing new
(:data:`NUMBERS_AS_AUX_SCALARS`). Its tensors are ``aux_tensors``, flattened to one dimension
(float32, or int32 for integers and booleans) and indexed by the index expressions as the
Triton kernels index them: a negative index counts from the end (as in eager PyTorch), then it
is clamped into its dimension, only a guard for the memory (every read at a valid position was
proven in range on the host, :func:`~attnbias.mods.check_reads`). The
source is generated once per graph structure and options, and compiled once per source
(:func:`callbacks`).

Shape legend: ``B`` batch, ``Hq`` query heads, ``L`` queries, ``S`` keys, ``Mb`` / ``Nb`` the
query / key blocks of the block sparsity.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from attnbias.backends.fa4_cute import (
    WRITTEN,
    Options,
    backward_problems,
    generate,
)
from attnbias.kernels.modfn import jit_from_source
from attnbias.kernels.modgraph import TracedMods

__all__ = [
    "MAX_NUMBER_SETS",
    "NUMBERS_AS_AUX_SCALARS",
    "Callbacks",
    "Options",
    "aux_scalars",
    "aux_tensors",
    "backward_problems",
    "block_size",
    "block_sparse_fields",
    "callbacks",
    "generate",
    "new_numbers_reason",
    "reasons",
]

#: Numbers reach the callbacks as FlashAttention 4's runtime ``aux_scalars`` (``True``), or
#: are written into the source as literals (``False``: each new number then compiles a new
#: kernel). flash-attn-4 4.0.0b36 compiles no kernel with ``aux_scalars`` on the H100 (its
#: ``AuxData`` is no JIT argument there), so literals are the default.
NUMBERS_AS_AUX_SCALARS = False

#: With numbers as literals, each new set of numbers for the same functions compiles the
#: callbacks and FlashAttention 4's kernel anew (seconds). Past this many sets of numbers per
#: functions (per number-free source), calls with yet other numbers are left to the Triton
#: kernels, which compile nothing for new numbers (:func:`new_numbers_reason`).
MAX_NUMBER_SETS = 4


@dataclass(frozen=True)
class Callbacks:
    """The compiled callbacks of one source (``None`` where the graph has no such function,
    ``score_mod_bwd`` also where the backward is not written)."""

    source: str
    mask_mod: Any
    score_mod: Any
    score_mod_bwd: Any


def _as_int32(traced: TracedMods) -> TracedMods:
    """``traced`` with its 64-bit integer tensors read as int32 (what the callbacks read: the
    values are checked to fit when the tensors are handed over, :func:`aux_tensors`)."""
    params = [
        torch.empty(0, dtype=torch.int32, device="meta") if p.dtype == torch.int64 else p
        for p in traced.params
    ]
    return TracedMods(
        traced.nodes, traced.masks, traced.scores, params, traced.consts, traced.inputs
    )


def reasons(traced: TracedMods, *, needs_grad: bool, grouped: bool) -> list[str]:
    """Why the graph has no exact FlashAttention 4 form (empty: it has one).

    ``needs_grad``: the call needs gradients (the backward callback, and no tensor parameter
    may require grad: FlashAttention 4 gives none for it); ``grouped``: Hq != Hkv (its SM90
    backward hands score callbacks packed query indices and heads under GQA)."""
    found: list[str] = []
    needed = traced.used_nodes()
    nodes = traced.nodes
    for node_id in sorted(needed):
        node = nodes[node_id]
        if node.op not in WRITTEN:
            found.append(f"the operator {node.op} has no FlashAttention 4 form")
        elif node.op in ("floordiv", "mod") and node.kind == "float":
            found.append(f"{'//' if node.op == 'floordiv' else '%'} of float values")
    found += _int64_problems(traced, needed)
    for param in traced.params:
        if param.numel() >= 2**31:
            found.append(f"a tensor of {param.numel()} elements (int32 indices)")
        if needs_grad and param.requires_grad:
            found.append(
                f"a tensor parameter of shape {tuple(param.shape)} requires grad: FlashAttention "
                f"4 computes no gradient for it (the Triton kernel does)"
            )
    if needs_grad:
        found += backward_problems(traced)
    if needs_grad and grouped and any(f.reads for f in traced.scores):
        found.append(
            "a score function that reads b, h, q_idx or kv_idx with grouped-query attention "
            "(FlashAttention 4's SM90 backward gives score callbacks packed query indices and "
            "heads then)"
        )
    return list(dict.fromkeys(found))


def _int64_problems(traced: TracedMods, needed: set[int]) -> list[str]:
    """Per function, its 64-bit integer arithmetic: an integer of the graph (a number, a cast,
    an operation) whose values may not fit 32 bits over all calls (value ranges of the trace's
    numbers, positions up to ``2**31``, 64-bit tensors read as int32). The callbacks compute
    integers in 32 bits, where such a value wraps; eager PyTorch, and the Triton kernels, in
    64."""
    from attnbias.kernels.modgraph import INT32, value_ranges

    ranges = value_ranges(_as_int32(traced))
    functions = []
    for node_id in sorted(needed):
        node = traced.nodes[node_id]
        if node.kind != "int" or node.op in ("input", "load"):
            continue
        low, high, _ = ranges[node_id]
        if not (low >= INT32[0] and high <= INT32[1]):
            functions.append(traced.function_of(node_id))
    return [
        f"{name} computes 64-bit integers: values that may not fit 32 bits (e.g. a product "
        f"of positions; FlashAttention 4's callbacks compute integers in 32 bits, the Triton "
        f"kernel in 64 where they need it)"
        for name in dict.fromkeys(functions)
    ]


# -- the source ----------------------------------------------------------------------------------


def aux_scalars(
    traced: TracedMods, options: Options, band: tuple[int | None, int | None], softcap: float | None
) -> tuple[int | float, ...]:
    """The runtime numbers of the callbacks of ``traced`` with ``options``: the graph's
    numbers, the band's sides, the soft-cap and its inverse, and per tensor parameter its
    last index and its stride (of the flattened tensor) per dimension."""
    values: list[int | float] = list(traced.consts)
    if options.band_lo:
        values.append(int(band[0]))  # type: ignore[arg-type]
    if options.band_hi:
        values.append(int(band[1]))  # type: ignore[arg-type]
    if options.softcap:
        assert softcap is not None
        values += [float(softcap), 1.0 / float(softcap)]
    for param in traced.params:
        sizes = [int(n) for n in param.shape]
        strides = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
        for size, stride in zip(sizes, strides, strict=True):
            values += [max(size - 1, 0), stride]
    return tuple(values)


# -- compiling ---------------------------------------------------------------------------------


@functools.cache
def _cute_names() -> dict[str, Any]:
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import math as mlir_math

    return {"cute": cute, "cutlass": cutlass, "mlir_math": mlir_math}


# The sources of a graph per options (and numbers, when they are literals): generated once.
_SOURCES: weakref.WeakKeyDictionary[TracedMods, dict[Any, str]] = weakref.WeakKeyDictionary()


def callbacks(
    traced: TracedMods,
    options: Options,
    values: Sequence[int | float],
    *,
    differentiable: bool = True,
    names: Callable[[], Mapping[str, Any]] | None = None,
    flavour: str = "cute",
) -> Callbacks:
    """The compiled callbacks of ``traced`` with ``options`` (``values``: its
    :func:`aux_scalars`, written into the source where ``options.scalars`` is false).
    ``differentiable``: whether :func:`reasons` found the backward writable (else
    ``score_mod_bwd`` is ``None``). ``names`` gives the namespace the source runs in (by
    default the CuTe DSL's; the tests give a stand-in, ``flavour`` tells the two apart)."""
    literal = None if options.scalars else tuple(values)
    source = _source(traced, options, literal)
    if literal is not None:
        with _LOCK:
            _NUMBER_SETS.setdefault(_source(traced, options, None), set()).add(literal)
    namespace = jit_from_source(source, f"fa4-mods-{flavour}", (names or _cute_names)())
    return Callbacks(
        source=source,
        mask_mod=namespace.get("mask_mod"),
        score_mod=namespace.get("score_mod"),
        score_mod_bwd=namespace.get("score_mod_bwd") if differentiable else None,
    )


# The sets of literal numbers whose callbacks were made, per number-free source.
_NUMBER_SETS: dict[str, set[tuple[int | float, ...]]] = {}
_LOCK = threading.Lock()


def _source(traced: TracedMods, options: Options, literal: tuple[int | float, ...] | None) -> str:
    """:func:`generate`'s source, kept per graph, options and literal numbers. With ``literal``
    ``None`` (numbers read from ``aux_scalars``) it is the same for every set of numbers: the
    key of :data:`_NUMBER_SETS`."""
    per_graph = _SOURCES.setdefault(traced, {})
    source = per_graph.get((options, literal))
    if source is None:
        source = per_graph[options, literal] = generate(traced, options, literal)
    return source


def new_numbers_reason(
    traced: TracedMods, options: Options, values: Sequence[int | float]
) -> str | None:
    """Why a call of ``traced`` with these numbers is not for FlashAttention 4: its callbacks
    were made for :data:`MAX_NUMBER_SETS` other sets of numbers already, and these would compile
    anew. ``None`` where the numbers are runtime ``aux_scalars``, known, or within the count."""
    if options.scalars:
        return None
    seen = _NUMBER_SETS.get(_source(traced, options, None), set())
    if len(seen) < MAX_NUMBER_SETS or tuple(values) in seen:
        return None
    return (
        f"its callbacks were compiled for {len(seen)} sets of numbers already and these "
        f"({', '.join(map(repr, values))}) would compile them and FlashAttention 4's kernel anew "
        f"(seconds; flash-attn-4 4.0.0b36 takes no runtime aux_scalars), where the Triton "
        f"kernel compiles nothing for new numbers"
    )


# -- the tensors ---------------------------------------------------------------------------------

# 64-bit integer tensors whose values were checked to fit int32, at their version then.
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def aux_tensors(traced: TracedMods) -> list[Tensor] | None:
    """The tensor parameters as FlashAttention 4's ``aux_tensors``: each flattened (a view
    where it is contiguous: in-place changes are seen), float32 for floats, int32 for integers
    and booleans. A 64-bit integer tensor is checked to fit 32 bits when first handed over and
    again after each in-place change (one host synchronisation then)."""
    if not traced.params:
        return None
    converted = []
    for param in traced.params:
        flat = param.detach().reshape(-1)
        if param.is_floating_point():
            flat = flat.to(torch.float32)
        else:
            if param.dtype == torch.int64 and _CHECKED.get(param) != param._version:
                if flat.numel() and bool(
                    ((flat < -(2**31)) | (flat > 2**31 - 1)).any()
                ):  # a host synchronisation
                    raise ValueError(
                        f"a ModBias reads an int64 tensor of shape {tuple(param.shape)} with "
                        f"values outside int32, which FlashAttention 4's callbacks read as int32; "
                        f"run it with attnbias.use_backends(exclude=['fa4'])"
                    )
                _CHECKED[param] = param._version
            flat = flat.to(torch.int32)
        converted.append(dense(flat))
    return converted


def dense(t: Tensor) -> Tensor:
    """``t`` contiguous with the standard strides on its dims of size 1 too, which
    FlashAttention 4 checks and ``Tensor.contiguous`` leaves as they were (e.g. ``x[..., 0]``
    of a ``(1, 1, 1, 4)`` tensor); a view where ``t`` is contiguous, so in-place changes are
    seen."""
    t = t.contiguous()
    strides: list[int] = []
    step = 1
    for n in reversed(t.shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return t if t.stride() == tuple(strides) else t.as_strided(t.shape, strides)


def block_size(head_dim: int) -> tuple[int, int]:
    """FlashAttention 4's SM90 block-sparse block ``(queries, keys)`` for a head dim: its
    forward's key tile must equal the sparse key block and its query tile divide the sparse
    query block, and its backward's key tile equals the sparse key block (128 up to head dim
    128; 64 at head dim 256, where the forward's tile of 80 keys shrinks to it) while its query
    tile (64 or 128) divides 128."""
    return (128, 64) if head_dim > 128 else (128, 128)


def block_sparse_fields(kv_lists: Tensor, q_lists: Tensor) -> tuple[dict[str, Tensor], ...]:
    """FlashAttention 4's ``BlockSparseTensorsTorch`` fields for the forward and the backward
    from the library's block lists (``kv_lists`` ``(Bl, Hl, Mb, 2, Nb + 1)`` and ``q_lists``
    ``(Bl, Hl, Nb, 2, Mb + 1)`` int32: per row a count of partial blocks and their columns in
    increasing order, then the same for full ones).

    Forward: ``mask_block_cnt`` / ``full_block_cnt`` ``(Bl, Hl, Mb)`` and ``mask_block_idx`` /
    ``full_block_idx`` ``(Bl, Hl, Mb, Nb)``; backward the same per key block, ``(Bl, Hl, Nb)``
    and ``(Bl, Hl, Nb, Mb)``. Each contiguous int32; ``Bl`` and ``Hl`` of 1 broadcast. Partial
    blocks run ``mask_mod``, full ones do not."""
    fields = []
    for lists in (kv_lists, q_lists):
        fields.append(
            {
                "mask_block_cnt": dense(lists[..., 0, 0]),
                "mask_block_idx": dense(lists[..., 0, 1:]),
                "full_block_cnt": dense(lists[..., 1, 0]),
                "full_block_idx": dense(lists[..., 1, 1:]),
            }
        )
    return fields[0], fields[1]

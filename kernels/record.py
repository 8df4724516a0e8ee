"""The mask as the kernels read it: one runtime record and one set of compile-time features.

Every kernel that masks (the forward, the two backward kernels, the decode kernel and the
block classification) takes a call's mask as two parameters:

* ``M``, the runtime record (:class:`MaskRecord` as a tuple): band bounds, document ranges,
  key ranges, ALiBi slopes, scales, block lists, page tables. A kernel reads a field with its
  accessor, ``mask_band_lo(M)``, ``mask_row_lo(M)``, ...;
* ``F: tl.constexpr``, the features (:class:`MaskFeatures` as a tuple), which decide what the
  kernel is compiled to: ``has_lo(F)``, ``has_docs(F)``, ``page_size(F)``, ...

Fields a kernel does not use are passed all the same (an absent tensor as 0: Triton refuses a
tuple holding ``None``; a kernel reads a field only where a feature says it is there), so
every kernel takes the same two values. Launches and ``torch.library.wrap_triton`` take flat
arguments only: :func:`flat_kernel` generates, once per kernel, a kernel with the record's
fields and the features as flat parameters (and the generated functions' arguments, ``MOD``)
that calls the kernel with the two tuples. Adding a term is a field (or feature) here with
its accessor, its value in :func:`~.masks.launch_mask`, and its use in the kernels.
"""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "MaskFeatures",
    "MaskRecord",
    # accessors of the features (compile-time values)
    "alibi_sign_of",
    "flat_kernel",
    "has_alibi",
    "has_block_lists",
    "has_docs",
    "has_hi",
    "has_kv_range",
    "has_lo",
    "has_softcap",
    "lists_per_batch",
    "lists_per_head",
    # accessors of the record (runtime values)
    "mask_alibi_stride_b",
    "mask_alibi_stride_h",
    "mask_band_hi",
    "mask_band_lo",
    "mask_col_hi",
    "mask_col_lo",
    "mask_col_stride",
    "mask_kv_capacity",
    "mask_kv_end",
    "mask_kv_lists",
    "mask_kv_pool",
    "mask_kv_start",
    "mask_page_table",
    "mask_q_lists",
    "mask_qk_scale",
    "mask_query_starts",
    "mask_row_hi",
    "mask_row_lo",
    "mask_row_stride",
    "mask_seq_lens",
    "mask_slopes",
    "mask_softcap_in",
    "mask_softcap_out",
    "mask_table_stride",
    "page_size",
    "positive_scale",
    "ragged_queries",
    "sparse_m",
    "sparse_n",
    "tanh_mode_of",
]  # fmt: skip


@dataclass(frozen=True, eq=False)
class MaskRecord:
    """The runtime values of a call's mask, in the order of the kernels' ``M`` tuple.

    ``L`` queries, ``S`` keys, ``B`` batch rows; document ranges are ``(Bd, L)`` / ``(Bd, S)``
    int32 with ``Bd`` 1 or ``B`` (batch stride ``row_stride`` / ``col_stride``: 0 or the
    length)."""

    band_lo: int = 0  # keep j - i >= band_lo (with has_lo)
    band_hi: int = 0  # keep j - i <= band_hi (with has_hi)
    row_lo: Tensor | None = None  # (Bd, L) int32: first key of each query row's document
    row_hi: Tensor | None = None  # (Bd, L) int32: one past its last key
    row_stride: int = 0
    col_lo: Tensor | None = None  # (Bd, S) int32: first query of each key column's document
    col_hi: Tensor | None = None  # (Bd, S) int32: one past its last query
    col_stride: int = 0
    kv_start: Tensor | None = None  # (B,) int32: first valid key of each batch row
    kv_end: Tensor | None = None  # (B,) int32: one past its last
    slopes: Tensor | None = None  # ALiBi slopes, float32 (Hq,) or (1 | B, Hq)
    alibi_stride_b: int = 0
    alibi_stride_h: int = 0
    qk_scale: float = 0.0  # the scale times log2(e): scores are kept in base 2
    softcap_in: float = 0.0  # scale / cap
    softcap_out: float = 0.0  # cap * log2(e)
    kv_lists: Tensor | None = None  # the key blocks per query block (block lists)
    q_lists: Tensor | None = None  # the query blocks per key block
    table_stride: int = 0  # a paged cache: the batch stride of the page table
    kv_capacity: int = 0  # its tokens per batch row (page table width times page size)
    kv_pool: int = 0  # the pages in its pool
    page_table: Tensor | None = None  # (B, pages) int32, given per call (:meth:`values`)
    seq_lens: Tensor | None = None  # (B,) int32, given per call
    # (B,) int32, given per call: ragged rows placed at the end of the call's L query
    # positions, each row's first placed query (the positions before it are padding)
    query_starts: Tensor | None = None

    def values(
        self,
        page_table: Tensor | None = None,
        seq_lens: Tensor | None = None,
        query_starts: Tensor | None = None,
    ) -> tuple:
        """The record as the kernels' flat arguments, with a call's page table, lengths and
        ragged rows' first queries in place of the record's own where given."""
        values = self._values
        if page_table is None:
            return values
        return (*values[:-3], page_table, seq_lens, 0 if query_starts is None else query_starts)

    @functools.cached_property
    def _values(self) -> tuple:
        # an absent tensor is a 0: Triton refuses a tuple holding None (the kernels read a
        # field only where a feature says it is there)
        return tuple(0 if value is None else value for value in _shallow(self))


def _shallow(record: Any) -> tuple:
    """A dataclass's fields as a tuple, not copied (``dataclasses.astuple`` copies them)."""
    return tuple(getattr(record, field.name) for field in dataclasses.fields(record))


@dataclass(frozen=True)
class MaskFeatures:
    """What a call's mask compiles its kernels to, in the order of the kernels' ``F`` tuple;
    the flat wrappers take them as ``tl.constexpr`` parameters of the upper-case names."""

    has_lo: bool = False
    has_hi: bool = False
    has_docs: bool = False
    has_kv_range: bool = False
    has_alibi: bool = False
    alibi_sign: int = 0  # +1 (-1): every kept pair has i + (S - L) - j >= 0 (<= 0); 0 unknown
    has_softcap: bool = False
    tanh_mode: int = 0  # how the soft-cap evaluates tanh (``common.TANH_*``)
    positive_scale: bool = True  # the scale is a positive normal float32
    has_block_lists: bool = False
    lists_per_batch: bool = False
    lists_per_head: bool = False
    sparse_m: int = 128  # the lists' blocks (fixed without lists: one compiled kernel)
    sparse_n: int = 128
    page: int = 0  # a paged cache's page size (0: contiguous keys)
    # ragged rows of a paged call, each placed at the end of the L query positions: the query
    # tiles before a row's first query (``query_starts``) visit no key
    ragged_queries: bool = False

    def options(self) -> dict[str, Any]:
        """The features as the flat wrappers' keyword arguments."""
        return {name.upper(): value for name, value in zip(FEATURES, _shallow(self), strict=True)}


FIELDS = tuple(field.name for field in dataclasses.fields(MaskRecord))
FEATURES = tuple(field.name for field in dataclasses.fields(MaskFeatures))


@dataclass(frozen=True, eq=False)
class Pages:
    """Where a call's keys lie in a paged pool (the kernels read them there): ``k`` and ``v``
    are the pools' rows ``(1 | B, Hkv, R, E)`` (``R = num_pages * page_size``, batch stride
    0); batch row ``b``'s pages are listed in ``table[b]`` (int32 ``(B, max_pages)``) and its
    ``seq_lens[b]`` tokens (int32 ``(B,)``) end at the call's last key position (``keys``
    positions, the call's ``S``). Read at each launch (in-place updates are seen)."""

    table: Tensor
    seq_lens: Tensor
    page_size: int
    num_pages: int
    keys: int
    # ragged rows, each placed at the end of the call's L query positions: int32 (B,), each
    # row's first placed query (None: every position is a query)
    query_starts: Tensor | None = None


def page_tensors(pages: Pages | None) -> tuple[Tensor, ...]:
    """A launch's page table, lengths and ragged rows' first queries for
    :meth:`~.record.MaskRecord.values` (none without pages)."""
    if pages is None:
        return ()
    if pages.query_starts is None:
        return (pages.table, pages.seq_lens)
    return (pages.table, pages.seq_lens, pages.query_starts)


# Accessors of the record. Positions follow MaskRecord's fields (a test checks each one).
@triton.jit
def mask_band_lo(M):
    return M[0]


@triton.jit
def mask_band_hi(M):
    return M[1]


@triton.jit
def mask_row_lo(M):
    return M[2]


@triton.jit
def mask_row_hi(M):
    return M[3]


@triton.jit
def mask_row_stride(M):
    return M[4]


@triton.jit
def mask_col_lo(M):
    return M[5]


@triton.jit
def mask_col_hi(M):
    return M[6]


@triton.jit
def mask_col_stride(M):
    return M[7]


@triton.jit
def mask_kv_start(M):
    return M[8]


@triton.jit
def mask_kv_end(M):
    return M[9]


@triton.jit
def mask_slopes(M):
    return M[10]


@triton.jit
def mask_alibi_stride_b(M):
    return M[11]


@triton.jit
def mask_alibi_stride_h(M):
    return M[12]


# torch.compile passes Python floats as fp64: the softmax arithmetic stays in fp32
@triton.jit
def mask_qk_scale(M):
    return tl.cast(M[13], tl.float32)


@triton.jit
def mask_softcap_in(M):
    return tl.cast(M[14], tl.float32)


@triton.jit
def mask_softcap_out(M):
    return tl.cast(M[15], tl.float32)


@triton.jit
def mask_kv_lists(M):
    return M[16]


@triton.jit
def mask_q_lists(M):
    return M[17]


@triton.jit
def mask_table_stride(M):
    return M[18]


@triton.jit
def mask_kv_capacity(M):
    return M[19]


@triton.jit
def mask_kv_pool(M):
    return M[20]


@triton.jit
def mask_page_table(M):
    return M[21]


@triton.jit
def mask_seq_lens(M):
    return M[22]


@triton.jit
def mask_query_starts(M):
    return M[23]


# Accessors of the features: evaluated while compiling (their results are constexprs).
@triton.constexpr_function
def has_lo(F):
    return F[0]


@triton.constexpr_function
def has_hi(F):
    return F[1]


@triton.constexpr_function
def has_docs(F):
    return F[2]


@triton.constexpr_function
def has_kv_range(F):
    return F[3]


@triton.constexpr_function
def has_alibi(F):
    return F[4]


@triton.constexpr_function
def alibi_sign_of(F):
    return F[5]


@triton.constexpr_function
def has_softcap(F):
    return F[6]


@triton.constexpr_function
def tanh_mode_of(F):
    return F[7]


@triton.constexpr_function
def positive_scale(F):
    return F[8]


@triton.constexpr_function
def has_block_lists(F):
    return F[9]


@triton.constexpr_function
def lists_per_batch(F):
    return F[10]


@triton.constexpr_function
def lists_per_head(F):
    return F[11]


@triton.constexpr_function
def sparse_m(F):
    return F[12]


@triton.constexpr_function
def sparse_n(F):
    return F[13]


@triton.constexpr_function
def page_size(F):
    return F[14]


@triton.constexpr_function
def ragged_queries(F):
    return F[15]


# The flat forms made so far, by kernel, functions' argument count and bound functions.
_FLAT: dict[tuple[object, ...], Any] = {}


def flat_kernel(
    kernel: Any, mods: int | None = None, bound: Mapping[str, Any] | None = None
) -> Any:
    """``kernel`` taking flat arguments only: its record parameter ``M`` as the fields of
    :class:`MaskRecord` (``M_<field>``), its features parameter ``F`` as ``tl.constexpr``
    parameters named as in :meth:`MaskFeatures.options`, and with ``mods`` its parameter
    ``MOD`` (the generated functions' arguments) as ``mods`` parameters ``MOD0, ...``; it
    calls ``kernel`` with the tuples. A launch, ``torch.compile``'s tracing of a launch and
    the compiled kernel's own launcher all take flat arguments only.

    ``bound`` fixes ``tl.constexpr`` parameters of ``kernel`` to generated functions (or
    ``None``): the new kernel calls them by name, so they are not among its own parameters
    (``torch.compile`` writes a kernel's source with the functions it calls, but cannot write
    a function passed as a launch argument). Names ``kernel`` does not take are ignored.
    Made once per ``(kernel, mods, functions)``."""
    # looked up on every plan: the key first (a signature costs the host tens of µs)
    key = (kernel, mods, *((name, id(fn)) for name, fn in (bound or {}).items()))
    found = _FLAT.get(key)
    if found is not None:
        return found
    from .modfn import jit_from_source, module_suffix

    params = list(inspect.signature(kernel.fn).parameters.values())
    names = [p.name for p in params]
    for needed in ("M", "F"):
        if needed not in names:
            raise TypeError(f"{kernel} has no {needed} parameter")
    if mods is not None and "MOD" not in names:
        raise TypeError(f"{kernel} has no MOD parameter")
    fixed = {name: fn for name, fn in (bound or {}).items() if name in names}
    # the functions by their own names (generated together, so distinct), the kernel by its
    namespace: dict[str, Any] = {kernel.__name__: kernel}
    for fn in fixed.values():
        if fn is not None:
            namespace[fn.__name__] = fn
    record = [f"M_{name}" for name in FIELDS]
    flat = [f"MOD{i}" for i in range(mods or 0)]
    runtime, constexprs, call = [], [], []
    for param in params:
        if param.name == "M":
            runtime += record
            call.append(f"M=({', '.join(record)},)")
        elif param.name == "F":
            features = [name.upper() for name in FEATURES]
            constexprs += [f"{name}: tl.constexpr" for name in features]
            call.append(f"F=({', '.join(features)},)")
        elif param.name == "MOD" and mods is not None:
            runtime += flat
            call.append(f"MOD=({', '.join(flat)},)" if flat else "MOD=()")
        elif param.name in fixed:
            fn = fixed[param.name]
            call.append(f"{param.name}={'None' if fn is None else fn.__name__}")
        elif "constexpr" in str(param.annotation):
            default = "" if param.default is inspect.Parameter.empty else " = None"
            constexprs.append(f"{param.name}: tl.constexpr{default}")
            call.append(f"{param.name}={param.name}")
        else:
            runtime.append(param.name)
            call.append(f"{param.name}={param.name}")
    # parameters with defaults last: the features before the kernel's defaulted ones
    constexprs.sort(key=lambda text: "=" in text)
    suffix = module_suffix(fixed.values())
    name = f"{kernel.__name__}_flat{'' if mods is None else mods}_{suffix}"
    # the functions' numbers change between calls: specialized on their type only (Triton
    # would compile a variant for a value of 1 or a multiple of 16)
    jit = f"@triton.jit(do_not_specialize={flat!r})" if flat else "@triton.jit"
    source = (
        f"import triton\nimport triton.language as tl\n\n\n{jit}\n"
        f"def {name}({', '.join(runtime + constexprs)}):\n"
        f"    {kernel.__name__}({', '.join(call)})\n"
    )
    made = jit_from_source(source, name, namespace)[name]
    _FLAT[key] = made
    return made

"""Custom biases written as FlexAttention-style functions, compiled into the kernels."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnbias.biases.base import Device, KernelBias, Shape, check_head_range, resolve_lengths
from attnbias.biases.documents import DocumentBias
from attnbias.biases.mod_state import (
    LOCK,
    UNSET,
    Identity,
    ModState,
    prepare,
    refuse_changed_inside_compile,
    refuse_inside_compile,
)
from attnbias.biases.mod_values import cell_value, renumbered, seen, unchanged, with_slots
from attnbias.materialize import MaskedBias, compute_dtype
from attnbias.mods import eager as graph_eval
from attnbias.mods.symbols import ModTraceError
from attnbias.terms import Block, Call, Terms

__all__ = ["ModBias"]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


class ModBias(KernelBias):
    """A bias written as FlexAttention's functions, run fused in the Triton kernels.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` keeps a pair where it returns True;
    ``score_mod(score, b, h, q_idx, kv_idx) -> score`` rewrites the scaled score (after a
    soft-cap and the additive biases). The indices are integer tensors: the batch row, the
    query head, the query position in ``[0, L)`` and the key position in ``[0, S)``.

    Either subclass it (usually as a frozen dataclass whose fields are the parameters: Python
    numbers and tensors such as a per-head table or per-batch document ids) and define either
    function or both as methods::

        @dataclass(frozen=True)
        class PrefixLM(ModBias):
            prefix: int

            def mask_mod(self, b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) | (kv_idx < self.prefix)

    or wrap plain functions (closures over tensors included), as FlexAttention takes them::

        bias = ModBias(mask_mod=causal, score_mod=relative_position)

    The functions are traced into a small graph and compiled into the kernels (forward and
    backward; tile skipping from the mask itself, no ``L x S`` tensor). Numbers and tensors are
    runtime arguments, read at the time of each call: a closure's number rebound, a field or
    attribute assigned, a module global changed, a tensor written in place or a closure
    rebound to another tensor are seen by the next call, as eager PyTorch would see them.
    Each call compares what the functions can read with the values of its trace (~2 µs) and
    traces them again where something changed (tens of µs; the same structure generates the
    same source, so nothing compiles). Under ``torch.compile`` and CUDA-graph replay the
    values are those of the last call outside them. What the compiler takes: see
    :data:`attnbias.mods.SUPPORTED`; anything else (a Python ``if`` on an index, an
    unknown operator) is refused at the first call, naming the function and the operator.

    Functions that are built-ins written as functions run as those built-ins: a conjunction of
    comparisons of ``kv_idx - q_idx`` with numbers (a causal sliding window), equal chunks
    ``q_idx // C == kv_idx // C`` (Llama 4's chunked attention) and document ids compared
    across the two sides (``docs[b, q_idx] == docs[b, kv_idx]``, where the ids do not decrease
    along a row: checked per call shape and tensor version) as the band and documents, and a
    score function ``cap * tanh(score / cap)`` as the soft-cap (where the sum has no ALiBi,
    tensor bias, other soft-cap or earlier score function, which would apply before it). The
    same pairs and scores, with the built-ins' analytic tile ranges on every backend that
    takes them (:func:`attnbias.mods.forms.builtin_form`; ``explain`` says so). Set the
    class attribute ``run_as_builtin = False`` on a subclass to run its functions as they are.

    Copies (``copy.copy``, ``copy.deepcopy``, ``pickle``) hold the fields and functions and
    trace the functions again; ``deepcopy`` copies tensor fields through the memo, while tensors
    captured in a closure stay shared with the original (a warning says so where one requires
    grad). Pickling needs functions that can be imported.

    Tensor parameters must be on the inputs' device. ``materialize`` evaluates the functions on
    the ``(B, H, L, S)`` grid (for the CPU and the exact routes): a mask becomes ``0`` / ``-inf``,
    a score function of the form ``score + g(...)`` becomes ``g``; any other score function has
    no additive form (like soft-cap), so such a bias always dispatches.
    """

    #: Overridden by a subclass's methods, or set by ``ModBias(mask_mod=..., score_mod=...)``.
    mask_mod: Callable[..., Any] | None = None
    score_mod: Callable[..., Any] | None = None
    #: Whether a mask function that is a band and equal chunks runs as the built-in terms.
    run_as_builtin: ClassVar[bool] = True

    def __init__(self, mask_mod: MaskMod | None = None, score_mod: ScoreMod | None = None) -> None:
        for name, fn in (("mask_mod", mask_mod), ("score_mod", score_mod)):
            if fn is not None and not callable(fn):
                raise TypeError(f"ModBias {name} must be a function, got {fn!r}")
        if type(self) is not ModBias and mask_mod is None and score_mod is None:
            return  # a subclass without fields: its methods are the functions
        if mask_mod is None and score_mod is None:
            raise TypeError(
                "ModBias needs a mask_mod(b, h, q_idx, kv_idx) or a "
                "score_mod(score, b, h, q_idx, kv_idx): pass one, or subclass ModBias and "
                "define either as a method"
            )
        object.__setattr__(self, "mask_mod", mask_mod)
        object.__setattr__(self, "score_mod", score_mod)
        self.__post_init__()

    def __post_init__(self) -> None:
        """Trace and generate the functions' code as the bias is built, outside any
        ``torch.compile`` region (its tracing cannot run inside one). A function the compiler
        refuses is left to raise at the first call, where the error names it."""
        prepare((self,))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.mask_mod is None and cls.score_mod is None:
            raise TypeError(
                f"{cls.__name__} defines neither mask_mod(self, b, h, q_idx, kv_idx) nor "
                f"score_mod(self, score, b, h, q_idx, kv_idx); a ModBias subclass needs one"
            )

    # -- what the library asks of a bias kind ----------------------------------------------

    @property
    def materializable(self) -> bool:  # type: ignore[override]
        """Whether the routes may run it as a mask: without a score function (they apply
        score functions themselves, after the additive terms and in the order of the sum)."""
        return self.score_mod is None

    def functions(self) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]:
        """``([mask_mod], [score_mod])``, each list empty where the function is absent."""
        masks = [] if self.mask_mod is None else [self.mask_mod]
        scores = [] if self.score_mod is None else [self.score_mod]
        return masks, scores

    def _traced(self) -> Any:
        """The functions traced with the values they read now.

        A trace holds the numbers the functions computed from what they can see (closure
        cells, fields and attributes, defaults, module globals, class attributes): each call
        first compares those values with the ones of the trace (:func:`~attnbias.biases.
        mod_values.seen`, a few µs). A number the functions read straight from a closure
        cell, a module global or the bias's own attributes is a runtime number of the trace
        (:func:`~attnbias.biases.mod_values.with_slots`): its new value is written into the
        trace. Where anything else changed, the functions are traced again. Either way the
        same structure generates the same source (no compilation); everything worked out
        from the old values (built-in forms, documents, generated forms, shifted copies) is
        dropped, and :meth:`cache_key` names the new values, so that no plan of the old ones
        is reused. Inside ``torch.compile`` the trace is the one of the last call outside
        it; the values are read there too, so that the compiler guards on them: a compiled
        call after a change compiles again and raises (:func:`~attnbias.biases.mod_state.
        refuse_changed_inside_compile`), which without ``fullgraph=True`` runs the call
        eagerly, with the new values."""
        state = self._state
        found, probes = state.traced, state.seen_values
        if torch.compiler.is_compiling():
            if found is None:
                refuse_inside_compile(self)
            # read under the compiler, which guards on what it reads: a compiled call runs
            # with these values only, and a change makes it compile the call again
            if probes is not None and not unchanged(probes):
                refuse_changed_inside_compile(self)
            return found
        if found is not None and probes is not None:
            if unchanged(probes):
                return found
            renewed = renumbered(found, probes, state.value_slots)
            if renewed is not None:
                return state.keep_trace(renewed[0], renewed[1], state.value_slots)
        from attnbias.mods.trace import trace_mods

        refuse_inside_compile(self)
        functions = self.functions()
        reached: dict[int, int] = {}
        probes = seen(self, functions, ModBias, _WORKED_OUT, reached)
        traced = trace_mods(*functions)
        slotted = None
        if probes is not None and not state.no_slots:
            slotted = with_slots(self, functions, traced, probes, reached, _WORKED_OUT)
            if slotted is None:  # not tried again: a change traces anew from now on
                state.no_slots = True
        if slotted is None:
            return state.keep_trace(traced, probes, None)
        return state.keep_trace(slotted[0], probes, slotted[1])

    @property
    def _state(self) -> ModState:
        """Everything this bias worked out (:class:`~attnbias.biases.mod_state.ModState`),
        made with the bias."""
        found = self.__dict__.get(_STATE)
        if found is None:
            with LOCK:
                found = self.__dict__.setdefault(_STATE, ModState())
        return found

    def _current_values(self) -> Any:
        """The trace's structure, numbers and tensors as the plan cache tells them apart,
        for the values the functions read now (read again first, as :meth:`_traced` does)."""
        self._traced()
        return self._state.values_key

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop(_STATE, None)
        return state

    def restored(self) -> None:
        """A copy traces its functions again, with its own tensors (a deep copy's tables)."""
        prepare((self,))

    def __deepcopy__(self, memo: dict[int, Any]) -> ModBias:
        """A copy whose tensor fields are copied through ``memo`` (an EMA copy of a model gets
        its own tables); tensors captured in a closure stay shared with the original (a
        function is copied as itself), and a warning says so where one requires grad."""
        shared = [
            cell.cell_contents
            for fn in (self.mask_mod, self.score_mod)
            for cell in (getattr(fn, "__closure__", None) or ())
            if isinstance(cell_value(cell), Tensor) and cell.cell_contents.requires_grad
        ]
        if shared:
            warnings.warn(
                f"copy.deepcopy of {self.describe()}: its functions capture "
                f"{len(shared)} tensor(s) that require grad in a closure; the copy shares them "
                f"with the original (a function is copied as itself). Make them fields of a "
                f"ModBias subclass to copy them",
                stacklevel=2,
            )
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

    def in_sum(self, parts: tuple[Any, ...]) -> None:
        """As a sum is built: the first ModBias of ``parts`` prepares the code of all of them
        together (outside ``torch.compile``, as :meth:`__post_init__` does for one)."""
        mods = tuple(p for p in parts if isinstance(p, ModBias))
        if len(mods) > 1 and mods[0] is self:
            prepare(mods)
            if not torch.compiler.is_compiling():  # the parts left as functions, together
                with contextlib.suppress(ModTraceError):
                    generated = tuple(p for p in mods if p.builtin_form() is None)
                    if 1 < len(generated) < len(mods):
                        prepare(generated)

    def validate_call(self, call: Call) -> None:
        traced = self._traced()  # refuses what cannot be compiled, at the first call
        for tensor in traced.params:
            if tensor.device != call.device:
                raise ValueError(
                    f"{self!r} reads a tensor of shape {tuple(tensor.shape)} on {tensor.device}, "
                    f"but the inputs are on {call.device}; move it with .to({str(call.device)!r})"
                )
        graph_eval.check_reads(traced, call.batch, call.heads, call.length_q, call.length_kv)

    def lower(self, call: Call) -> Terms:
        form = self.builtin_form()
        if form is None or (form.needs_host and torch.compiler.is_compiling()):
            # (document ids are built and checked on the host, outside a trace)
            return Terms.of(mods=(self,))
        terms = Terms.of(
            band_lo=form.band_lo,
            band_hi=form.band_hi,
            softcap=form.softcap,
            softcap_part=None if form.softcap is None else self,
            forms=(self,),
        )
        if form.chunk is not None:
            terms = terms.merge(self._chunks(call).lower(call))
        if form.ids is not None:
            documents = self._documents_of_ids(call)
            if documents is None:  # ids that decrease along a row: no documents
                return Terms.of(mods=(self,))
            terms = terms.merge(documents.lower(call))
        return terms

    def builtin_form(self) -> Any:
        """The band, documents and soft-cap this bias's functions are
        (:class:`~attnbias.mods.forms.BuiltinForm`), or ``None`` where they are
        something else or the class sets ``run_as_builtin = False``. Document ids read from
        the indices (``docs[b, q_idx] == docs[b, kv_idx]``) are documents only where they do
        not decrease along a row: each call checks that (:meth:`lower`)."""
        if not self.run_as_builtin:
            return None
        state = self._state
        found = state.form
        if found is UNSET:
            from attnbias.mods.forms import builtin_form

            found = state.form = builtin_form(self._traced())
        return found

    def describe_form(self) -> str:
        """What :meth:`builtin_form` runs the mask function as, in words."""
        form = self.builtin_form()
        if form is None:
            return "its functions (generated code)"
        parts = []
        if form.band_lo is not None or form.band_hi is not None:
            lo = "" if form.band_lo is None else f"{form.band_lo} <= "
            hi = "" if form.band_hi is None else f" <= {form.band_hi}"
            parts.append(f"the band {lo}j - i{hi}")
        if form.chunk is not None:
            parts.append(f"documents of {form.chunk} positions")
        if form.ids is not None:
            parts.append("documents of the ids it compares")
        said = []
        if self.mask_mod is not None:
            said.append(f"its mask_mod as {' and '.join(parts) or 'no mask'}")
        if form.softcap is not None:
            said.append(f"its score_mod as soft-cap {form.softcap:g}")
        return ", ".join(said)

    def _chunks(self, call: Call) -> DocumentBias:
        """The documents of the chunks for ``(L, S)``, kept with the bias (ids on the host,
        so that every backend reads them as it reads a DocumentBias's)."""
        form = self.builtin_form()
        key = (call.length_q, call.length_kv)
        kept = self._state.chunk_docs
        found = kept.get(key)
        if found is None:
            q_ids = (torch.arange(call.length_q) + form.q_offset) // form.chunk
            kv_ids = (torch.arange(call.length_kv) + form.kv_offset) // form.chunk
            found = DocumentBias(q_ids, kv_ids)
            kept.put(key, found)
        return found

    def _documents_of_ids(self, call: Call) -> DocumentBias | None:
        """The documents of the form's ids ``x(b, q_idx) == y(b, kv_idx)`` for the call: both
        sides evaluated on the call's positions (and batch rows, where they read ``b``), or
        ``None`` where the ids decrease along a row (no documents), the batch size is unknown
        for ids that read ``b``, or a length is 0. Checked once per shape, device and version
        of the tensors read (host synchronisations then), and kept with the bias: a tensor
        written in place is read again at the next call."""
        form = self.builtin_form()
        traced = self._traced()
        q_node, kv_node = form.ids
        reads_batch = traced.inputs["b"] in traced.ancestors(q_node) | traced.ancestors(kv_node)
        if (reads_batch and call.batch is None) or call.length_q == 0 or call.length_kv == 0:
            return None
        rows = call.batch_size if reads_batch else 1
        versions = self._id_versions()
        key = (rows, call.length_q, call.length_kv, call.device)
        kept = self._state.id_docs
        found = kept.get(key)
        if found is not None and versions is not None and found[0] == versions:
            return found[1]
        b = torch.arange(rows, device=call.device)[:, None]
        ids = []
        for node, name, length in (
            (q_node, "q_idx", call.length_q),
            (kv_node, "kv_idx", call.length_kv),
        ):
            positions = torch.arange(length, device=call.device)[None, :]
            value = graph_eval.evaluate(traced, node, b=b, **{name: positions})
            ids.append(
                value.to(device=call.device, dtype=torch.long).expand(rows, length).contiguous()
            )
        try:
            documents: DocumentBias | None = DocumentBias(ids[0], ids[1])
        except ValueError:  # the ids decrease somewhere along a row
            documents = None
        kept.put(key, (versions, documents))
        return documents

    def _id_versions(self) -> tuple[int, ...] | None:
        """The versions of the tensors the form's ids read, or ``None`` where one has no
        version counter (an inference tensor: its ids are read at every call)."""
        params = self._traced().params
        try:
            return tuple(params[slot]._version for slot in self.builtin_form().id_params)
        except RuntimeError:
            return None

    @property
    def cache_key_varies(self) -> bool:
        """Always: the key holds the values the functions read (:meth:`cache_key`)."""
        return True

    def sub_block(self, call: Call, block: Block) -> ModBias:
        """The same functions reading the call's indices: ``q_idx + block.q_start`` and
        ``kv_idx + block.kv_start``. The offsets are numbers of the traced functions, so
        runtime arguments: the blocks of one bias share their generated code. Kept with the
        bias, per block place."""
        key = (block.q_start, block.kv_start)
        kept = self._state.blocks
        found = kept.get(key)
        if found is None:
            found = _shifted(self, *key)
            kept.put(key, found)
        return found

    def sub_heads(self, call: Call, start: int, count: int) -> ModBias:
        """The same functions reading the call's head index, ``h + start`` (the bias itself
        where they do not read ``h``, or ``start`` is 0). The offset is a number of the traced
        functions, so a runtime argument: the head ranges of one bias share their generated
        code. Kept with the bias, per start."""
        check_head_range(call, start, count, type(self).__name__)
        if start == 0 or not self._reads_head():
            return self
        kept = self._state.head_ranges
        found = kept.get(start)
        if found is None:
            found = _shifted(self, 0, 0, start)
            kept.put(start, found)
        return found

    def _reads_head(self) -> bool:
        """Whether a function reads ``h`` (``True`` for functions the compiler refuses: their
        head range then raises at its first call, naming the function)."""
        try:
            traced = self._traced()
        except ModTraceError:
            return True
        return any("h" in function.reads for function in (*traced.masks, *traced.scores))

    def keep_rows(self, device: Device, shape: Shape, q_start: int) -> Tensor | None:
        """The masks on the ``(B, H, L, S)`` grid of ``shape`` for the query rows
        ``[q_start, q_start + L)`` of a larger call (bool, the shape the functions read;
        ``None`` without masks): a slice of rows without functions traced anew."""
        b, h, q_idx, kv_idx = _grid(device, shape, type(self).__name__)
        return graph_eval.mask_grid(self._traced(), b, h, q_idx + q_start, kv_idx)

    def masked(self, device: Device, shape: Shape, dtype: torch.dtype) -> MaskedBias:
        traced = self._traced()
        grid = _grid(device, shape, type(self).__name__)
        keep = graph_eval.mask_grid(traced, *grid)
        if not traced.scores:
            return MaskedBias(keep, None, None, ())

        def score_fn(scores: Tensor) -> Tensor:
            return graph_eval.score_grid(traced, scores, *grid)

        return MaskedBias(keep, None, None, (score_fn,))

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        """The functions on the ``(B, H, L, S)`` grid of ``shape``: ``0`` where kept and
        ``-inf`` where masked, plus ``g`` for a score function ``score + g(...)``."""
        dtype = dtype or torch.float32
        traced = self._traced()
        if traced.scores and not traced.additive_score():
            raise TypeError(
                f"{self!r} has a score_mod that is not score + something of the indices, so it "
                f"has no additive tensor form; pass the bias to attnbias.sdpa as attn_mask"
            )
        grid = _grid(device, shape, type(self).__name__)
        compute = compute_dtype(dtype)
        zeros = torch.zeros((), dtype=compute, device=grid[2].device)
        additive = graph_eval.score_grid(traced, zeros, *grid) if traced.scores else zeros
        keep = graph_eval.mask_grid(traced, *grid)
        if keep is not None:
            additive = torch.where(keep, additive, torch.tensor(-math.inf, dtype=compute))
        b, h, q_idx, kv_idx = grid
        full = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        return additive.to(dtype).expand(full).contiguous()

    def cache_key(self) -> Hashable | None:
        """The bias by identity with the values its functions read now (numbers, and tensors
        by identity and shape: a plan made with other values is not reused), and the versions
        of the tensors its document ids and its reads' indices read (a call after an in-place
        write is planned and checked again); ``None`` where such a tensor has no version
        counter."""
        traced = self._traced()
        values = self._state.values_key
        # the tensors' shapes and the versions of those indices are read from: a call after
        # a resize or a write there proves its reads again (:func:`attnbias.mods.check_reads`)
        reads = graph_eval.read_versions(traced)
        if reads is None:
            return None
        shapes = tuple(tuple(t.shape) for t in traced.params)
        key = (Identity(self), values, shapes, reads)
        form = self.builtin_form()
        if form is None or form.ids is None or not form.id_params:
            return key
        versions = self._id_versions()
        return None if versions is None else (key, versions)

    def parameters(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self._traced().params if t.is_floating_point())

    def __repr__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """The bias in a line: its class and fields, tensors by their shape (a subclass's
        dataclass ``repr`` would print the tensors' values)."""
        if dataclasses.is_dataclass(self):
            fields = ", ".join(
                f"{f.name}={_short(getattr(self, f.name))}" for f in dataclasses.fields(self)
            )
            return f"{type(self).__name__}({fields})"
        names = [
            f"{name}={getattr(fn, '__name__', 'fn')}"
            for name, fn in (("mask_mod", self.mask_mod), ("score_mod", self.score_mod))
            if fn is not None
        ]
        return f"{type(self).__name__}({', '.join(names)})"


def _shifted(bias: ModBias, q_start: int, kv_start: int, head_start: int = 0) -> ModBias:
    """``bias``'s functions with the query, key and head indices moved by the given offsets."""
    return reindexed(
        bias,
        f"[+{q_start}, +{kv_start}]" if head_start == 0 else f"[h+{head_start}]",
        head=lambda b, h: _plus(h, head_start),
        query=lambda b, q_idx: q_idx + q_start,
        key=lambda b, kv_idx: kv_idx + kv_start,
    )


#: How :func:`reindexed` moves an index: ``(b, index) -> the index the functions read``.
Reindex = Callable[[Any, Any], Any]


def reindexed(
    bias: ModBias,
    moved: str,
    *,
    head: Reindex | None = None,
    query: Reindex | None = None,
    key: Reindex | None = None,
) -> ModBias:
    """A ModBias of ``bias``'s functions reading moved indices: each of ``head``, ``query``
    and ``key`` given maps ``(b, index)`` to the index the functions read (an index without
    one is read as it is); ``moved`` is added to the functions' names. The numbers and tensors
    the maps read are the new bias's own (a block's offsets, a paged row's starts)."""
    masks, scores = bias.functions()

    def move(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> tuple[Any, Any, Any, Any]:
        return (
            b,
            h if head is None else head(b, h),
            q_idx if query is None else query(b, q_idx),
            kv_idx if key is None else key(b, kv_idx),
        )

    mask_mod = score_mod = None
    if masks:
        mask = masks[0]

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return mask(*move(b, h, q_idx, kv_idx))

        mask_mod.__name__ = mask_mod.__qualname__ = f"{_name(mask)}{moved}"
    if scores:
        score = scores[0]

        def score_mod(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return score(s, *move(b, h, q_idx, kv_idx))

        score_mod.__name__ = score_mod.__qualname__ = f"{_name(score)}{moved}"
    return ModBias(mask_mod=mask_mod, score_mod=score_mod)


# The one entry a ModBias keeps in its __dict__ (left out of copies and of the values its
# functions read): everything it worked out
_STATE = "_modbias_state"
_WORKED_OUT = (_STATE,)


def _plus(index: Any, offset: int) -> Any:
    """``index + offset``, or ``index`` itself for 0: the functions then read no more of the
    head than they did."""
    return index if offset == 0 else index + offset


def _name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "fn"))


def _short(value: object) -> str:
    if isinstance(value, Tensor):
        return f"Tensor{tuple(value.shape)}"
    return repr(value)


def _grid(device: Device, shape: Shape, owner: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Broadcast int64 index tensors ``b, h, q_idx, kv_idx`` of the ``(B, H, L, S)`` grid."""
    if shape is None or len(tuple(shape)) != 4:
        raise ValueError(
            f"{owner}.materialize needs shape=(B, H, L, S) (its functions read the batch row "
            f"and the head), got shape={shape}"
        )
    batch, heads, _, _ = (int(n) for n in tuple(shape))
    length_q, length_kv = resolve_lengths(shape, None, None, owner)
    device = torch.device("cpu") if device is None else torch.device(device)
    return (
        torch.arange(batch, device=device)[:, None, None, None],
        torch.arange(heads, device=device)[None, :, None, None],
        torch.arange(length_q, device=device)[None, None, :, None],
        torch.arange(length_kv, device=device)[None, None, None, :],
    )

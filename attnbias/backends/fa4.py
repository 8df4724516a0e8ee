"""FlashAttention 4 (``pip install "attnbias[fa4]"``, import ``flash_attn.cute``) on Hopper and
Blackwell GPUs.

It takes every band, soft-cap, ALiBi (as a score modifier), documents (as FlashAttention's
variable-length batch) and grouped-query attention, forward and backward. A
band ``band_lo <= j - i <= band_hi`` is FlashAttention's bottom-right aligned ``window_size``::

    window_size = ((S - L) - band_lo, band_hi - (S - L))      # None for an open side

which it computes exactly, negative sides included. Documents become one variable-length
sequence each, the documents of batch row 0 first, then those of row 1, and so on: the rows'
``(B, L, H, E)`` views flattened to ``(B·L, H, E)``, taken where that is a view (batch size 1,
or q, k and v ``(B, L, H, E)`` in memory, as a projection followed by ``.transpose(1, 2)``
leaves them; the copies otherwise cost more than the Triton kernel's whole forward);
the band carries over when every document's query and key ranges end at one offset ``c`` from
each other within their row (``window_size = (c - band_lo, band_hi - c)``), as in packed
self-attention. What it does not take, and why, is listed by :meth:`FlashAttention4.reasons`;
the planner then moves on to the next backend.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnbias.backends import fa4_mods
from attnbias.backends.base import Backend, LseGrads, Prepared, refuse_double_backward
from attnbias.backends.documents import (
    DocumentLayout,
    call_documents,
    document_part,
    flattens_as_view,
)
from attnbias.spec import Spec
from attnbias.terms import Terms

if TYPE_CHECKING:
    from attnbias.kernels.modgraph import TracedMods

__all__ = ["FlashAttention4", "window_size"]

# Compute capabilities whose FlashAttention 4 kernels were checked against the oracle.
CAPABILITIES = (9, 10)
# Compute capabilities whose FlashAttention 4 form of ModBias functions (callbacks and block
# sparsity, ``fa4_mods``) was written for: its SM90 kernels' tiles set the block sparsity.
MOD_CAPABILITIES = (9,)
# Head dims (E = Ev) checked against the oracle on the H100; head dim 80, which FlashAttention 4
# accepts, failed those checks, so each further head dim is added here only once tested.
CHECKED_HEAD_DIMS = (64, 128, 256)


@functools.cache
def _installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


@functools.cache
def _flash_attn_func() -> Callable[..., Any]:
    # Importing it loads the CuTe DSL: seconds, so only on first use.
    module = importlib.import_module("flash_attn.cute")
    return module.flash_attn_func


@functools.cache
def interface_module() -> Any:
    """``flash_attn.cute.interface``, whose private helpers some routes read."""
    return importlib.import_module("flash_attn.cute.interface")


@functools.cache
def _flash_attn_bwd() -> Callable[..., Any] | None:
    """FlashAttention 4's backward given an output and log-sum-exp, or ``None`` where this
    version has none. It is not public API: context parallelism needs it with the merged
    output and log-sum-exp (:meth:`FlashAttention4.backward_lse`)."""
    return getattr(interface_module(), "_flash_attn_bwd", None)


@functools.cache
def _flash_attn_varlen_func() -> Callable[..., Any]:
    module = importlib.import_module("flash_attn.cute")
    return module.flash_attn_varlen_func


@functools.cache
def _block_sparse_tensors() -> Callable[..., Any]:
    """FlashAttention 4's ``BlockSparseTensorsTorch`` (a named tuple of its block lists)."""
    module = importlib.import_module("flash_attn.cute.block_sparsity")
    return module.BlockSparseTensorsTorch


@functools.cache
def _alibi_score_mods() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(score_mod, score_mod_bwd)`` adding ``-slope[h] * |i + (S - L) - j|`` to a score.

    The slopes are the first aux tensor, ``(Hq,)`` float32. ALiBi is additive, so the
    backward passes the score's gradient through unchanged.
    """
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import math as mlir_math

    @cute.jit
    def alibi(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        slopes = aux_tensors[0]
        head = cute.make_rmem_tensor(1, cutlass.Int32)
        head.store(h_idx)
        slope = cute.make_rmem_tensor(1, cutlass.Float32)
        slope[0] = slopes[head[0]]
        offset = seqlen_info.seqlen_k - seqlen_info.seqlen_q
        distance = q_idx - kv_idx + cute.full_like(q_idx, offset)
        absolute = cute.TensorSSA(mlir_math.absi(distance), distance.shape, distance.dtype)
        return score - slope.load() * absolute.to(cutlass.Float32)

    @cute.jit
    def alibi_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return alibi, alibi_bwd


@functools.cache
def _softcap_score_mods(cap: float) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``(score_mod, score_mod_bwd)`` for ``cap * tanh(s / cap)``.

    FlashAttention 4's own ``softcap=`` divides every score by the cap; multiplying by its
    reciprocal instead is faster with the same error (benchmarks/NOTES.md, "Figures behind the
    code's choices"). One pair per cap, so the compiled kernels are reused.
    """
    import cutlass.cute as cute

    inverse = 1.0 / cap

    @cute.jit
    def softcap(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return cute.math.tanh(score * inverse, fastmath=True) * cap

    @cute.jit
    def softcap_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        tanh = cute.math.tanh(score * inverse, fastmath=True)
        return grad * (1.0 - tanh * tanh)

    return softcap, softcap_bwd


def _rows_flattened(x: Tensor) -> Tensor:
    """``(B, H, L, E)`` as FlashAttention's variable-length ``(B·L, H, E)``: a view where
    :func:`flattens_as_view` (the calls this backend takes with documents), a copy for a call
    of another layout that reuses such a call's cached decision."""
    return x.transpose(1, 2).flatten(0, 1)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _on_cuda(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device (one function, so that the tests can fake a GPU)."""
    return device.type == "cuda"


def window_size(terms: Terms, offset: int) -> tuple[int | None, int | None]:
    """FlashAttention's ``window_size`` for the band of ``terms`` (``None``: open side).

    FlashAttention keeps ``i + offset - left <= j <= i + offset + right`` with
    ``offset = S - L`` (of each sequence of a variable-length batch), so
    ``left = offset - band_lo`` and ``right = band_hi - offset``.
    """
    left = None if terms.band_lo is None else offset - terms.band_lo
    right = None if terms.band_hi is None else terms.band_hi - offset
    return left, right


def _head_dim_reasons(major: int, head_dim: int, head_dim_v: int, dtype: torch.dtype) -> list[str]:
    alignment = 16 // (torch.finfo(dtype).bits // 8)
    if head_dim % alignment or head_dim_v % alignment:
        return [f"head dims ({head_dim}, {head_dim_v}) are not multiples of {alignment}"]
    if major == 9 and not (8 <= head_dim <= 256 and 8 <= head_dim_v <= 256):
        return [f"head dims ({head_dim}, {head_dim_v}) are outside 8..256 on compute capability 9"]
    if major == 10 and not (
        (head_dim <= 128 and head_dim_v <= 128)
        or (head_dim, head_dim_v) in ((192, 128), (256, 256))
    ):
        return [
            f"head dims ({head_dim}, {head_dim_v}) are not supported on compute capability 10 "
            f"(up to 128, or (192, 128), or (256, 256))"
        ]
    if head_dim != head_dim_v or head_dim not in CHECKED_HEAD_DIMS:
        return [
            f"head dims ({head_dim}, {head_dim_v}) are not among those checked against the "
            f"oracle for this backend (E = Ev in {', '.join(map(str, CHECKED_HEAD_DIMS))})"
        ]
    return []


def _first_order(out: Tensor, needs_grad: bool) -> Tensor:
    return refuse_double_backward(out, "FlashAttention 4") if needs_grad else out


class FlashAttention4(Backend):
    """Bands, soft-cap, ALiBi, documents and GQA through ``flash_attn.cute``."""

    name = "fa4"
    dtypes = (torch.float16, torch.bfloat16)
    returns_lse = True

    def reasons(self, spec: Spec) -> list[str]:
        if spec.compiling:  # and the checks below are not traceable
            return [
                "torch.compile cannot trace FlashAttention 4, so a compiled call takes the "
                "Triton kernel"
            ]
        reasons = []
        terms = spec.terms
        if not _installed():
            reasons.append('flash_attn.cute is not installed (pip install "attnbias[fa4]")')
        if not _on_cuda(spec.device):
            reasons.append(
                f"FlashAttention 4 needs CUDA tensors and these are on {spec.device.type}"
            )
        else:
            major = _capability(spec.device.index or 0)[0]
            if major not in CAPABILITIES:
                reasons.append(
                    f"compute capability {major}.x is not one of FlashAttention 4's here "
                    f"({', '.join(f'{c}.x' for c in CAPABILITIES)})"
                )
            elif spec.dtype in self.dtypes:
                reasons += _head_dim_reasons(major, spec.head_dim, spec.head_dim_v, spec.dtype)
                if (
                    major == 10
                    and spec.head_dim == 256
                    and terms.softcap is not None
                    and spec.needs_grad
                ):
                    reasons.append("its backward at head dim 256 has no soft-cap on capability 10")
        if spec.dropout_p > 0.0:
            reasons.append(f"dropout_p={spec.dropout_p}: FlashAttention 4 has no dropout")
        if spec.needs_lse and _installed() and _flash_attn_bwd() is None:
            reasons.append(
                "this flash_attn.cute has no backward given a log-sum-exp (_flash_attn_bwd), "
                "which context parallelism needs"
            )
        if terms.q_doc is not None:
            if spec.needs_lse:
                # its variable-length log-sum-exp is laid out (H, total): not wired here
                reasons.append("log-sum-exp of documents (context parallelism) is not wired")
            else:
                reasons += self._document_reasons(spec)
        if terms.slopes is not None:
            if terms.alibi_shift:
                reasons.append(
                    f"ALiBi shifted by {terms.alibi_shift} (its score modifier measures from "
                    f"the call's own diagonal)"
                )
            if terms.slopes.shape[0] != 1:
                reasons.append("ALiBi slopes per batch row (its score modifier reads (Hq,))")
            if terms.softcap is not None:
                reasons.append("ALiBi together with soft-cap")
            if spec.query.shape[1] != spec.key.shape[1]:
                # its backward reads the slopes with another head index than its forward
                reasons.append("ALiBi with grouped-query attention (Hq != Hkv)")
            if terms.slopes.requires_grad:
                reasons.append("ALiBi slopes that require grad (no gradient for them here)")
        if terms.has_key_range:
            # FlashAttention 4's seqused_k (keys [0, seqused_k[b]) of each batch row) could
            # carry ranges that start at 0 (right padding, a cache's filled prefix) without a
            # band; with one it would also move the bottom-right alignment (and ALiBi's
            # distances) to each row's used length, where the semantics align to S. Unchecked
            # against the oracle, so refused; ranges with a start have no form at all.
            reasons.append(
                "a key range (KeyRangeBias): its seqused_k form, for ranges from 0, is not "
                "checked against the oracle"
            )
        if terms.others:
            names = ", ".join(type(p).__name__ for p in terms.others)
            reasons.append(f"{names} has no FlashAttention 4 form")
        if terms.mods:
            reasons += self._mod_reasons(spec)
        if terms.band_is_empty:
            # FlashAttention reads a window whose sides are both negative as no window at all.
            reasons.append(f"{terms.describe()} keeps no pair")
        if not spec.resolved_scale > 0.0:
            reasons.append(f"scale={spec.resolved_scale} is not positive")
        if spec.has_empty_dim:
            reasons.append(f"an empty dimension in (B, Hq, L, S)={spec.shape}")
        return reasons

    @staticmethod
    def _mod_reasons(spec: Spec) -> list[str]:
        """Why the call's ModBias functions have no FlashAttention 4 form here."""
        terms = spec.terms
        reasons = []
        if _on_cuda(spec.device):
            major = _capability(spec.device.index or 0)[0]
            if major in CAPABILITIES and major not in MOD_CAPABILITIES:
                reasons.append(
                    f"ModBias functions run in FlashAttention 4 on compute capability "
                    f"{', '.join(f'{c}.x' for c in MOD_CAPABILITIES)} only (its block sparsity "
                    f"is laid out for those kernels' tiles), not on {major}.x"
                )
        if terms.slopes is not None:
            reasons.append("ALiBi together with ModBias functions")
        if terms.q_doc is not None:
            reasons.append(
                "documents together with ModBias functions (FlashAttention 4's variable-length "
                "batch takes no block sparsity in its backward)"
            )
        if spec.needs_lse:
            reasons.append("ModBias functions with the log-sum-exp (context parallelism)")
        mods = spec.program.mods
        if mods is not None:
            _, heads_q, _, _ = spec.shape
            found = fa4_mods.reasons(
                mods.traced,
                needs_grad=spec.needs_grad,
                grouped=heads_q != spec.key.shape[1],
            )
            if not found:
                form = _mod_form(spec, compiled=False)
                again = fa4_mods.new_numbers_reason(mods.traced, form.options, form.scalars)
                found = [] if again is None else [again]
            reasons += found
        return reasons

    @staticmethod
    def _document_reasons(spec: Spec) -> list[str]:
        documents = document_part(spec)
        if documents is None:
            return ["more than one DocumentBias in the sum"]
        reasons = []
        batch = spec.shape[0]
        if batch > 1 and not all(flattens_as_view(x) for x in (spec.query, spec.key, spec.value)):
            reasons.append(
                f"documents at batch size {batch} where q, k and v are not (B, L, H, E) in "
                f"memory: its variable-length batch would copy them, slower than the Triton "
                f"kernel (projections viewed as .view(B, L, H, E).transpose(1, 2) need no copy)"
            )
        if spec.terms.slopes is not None:
            reasons.append("ALiBi with documents (its distances would restart per document)")
        layout = call_documents(spec)
        if layout.problem is not None:
            reasons.append(layout.problem)
        has_band = spec.terms.band_lo is not None or spec.terms.band_hi is not None
        if has_band and layout.problem is None and layout.end_offset is None:
            reasons.append(
                "the documents' query and key ranges do not end at one offset, so the band is "
                "no single window"
            )
        return reasons

    @staticmethod
    def _layout(spec: Spec) -> DocumentLayout | None:
        """The variable-length layout of the call's documents (``None``: no documents)."""
        if spec.terms.q_doc is None:
            return None
        documents = document_part(spec)
        assert documents is not None  # reasons() refuses calls without exactly one
        return call_documents(spec)

    @staticmethod
    def _window(spec: Spec, layout: DocumentLayout | None) -> tuple[int | None, int | None]:
        if layout is None:
            return window_size(spec.terms, spec.shape[3] - spec.shape[2])
        return window_size(spec.terms, layout.end_offset or 0)

    def how(self, spec: Spec) -> str:
        if spec.terms.mods:
            return self._mod_how(spec)
        left, right = self._window(spec, self._layout(spec))
        terms = [f"window_size=({left}, {right})"]
        if spec.terms.softcap is not None:
            terms.append(f"softcap={spec.terms.softcap:g}")
        if spec.terms.slopes is not None:
            terms.append("ALiBi score_mod")
        if spec.terms.q_doc is not None:
            terms.append("one variable-length sequence per document")
            if spec.shape[0] > 1:
                terms.append(f"the {spec.shape[0]} batch rows flattened as views")
        return f"FlashAttention 4 ({', '.join(terms)})"

    def _mod_how(self, spec: Spec) -> str:
        form = _mod_form(spec, compiled=False)
        mods = spec.program.mods
        assert mods is not None  # a call with ModBias parts has generated functions
        traced = mods.traced
        names = ", ".join(f.name for f in (*traced.masks, *traced.scores))
        has_score = bool(traced.scores) or form.options.softcap
        callbacks = ["mask_mod"] if form.block is not None else []
        callbacks += ["score_mod"] if has_score else []
        callbacks += (
            ["score_mod_bwd"] if has_score and not fa4_mods.backward_problems(traced) else []
        )
        terms = [f"{' / '.join(callbacks)} generated from {names}"]
        left, right = form.window
        if left is not None or right is not None:
            terms.append(f"window_size=({left}, {right})")
        elif form.options.band_lo or form.options.band_hi:
            terms.append("the band inside mask_mod")
        if spec.terms.softcap is not None:
            terms.append(f"soft-cap {spec.terms.softcap:g} inside score_mod")
        if form.options.scalars and form.scalars:
            terms.append(f"{len(form.scalars)} aux_scalars")
        if mods.traced.params:
            terms.append(f"{len(mods.traced.params)} aux_tensors")
        if form.block is not None:
            terms.append(self._tile_counts(spec, form.block))
        return f"FlashAttention 4 ({', '.join(terms)})"

    @staticmethod
    def _tile_counts(spec: Spec, block: tuple[int, int]) -> str:
        """How the block sparsity splits the call's blocks: skipped, full, partial (builds
        the block lists: GPU work and a host synchronisation, for ``explain``)."""
        from attnbias.kernels.masks import mod_block_lists

        blocks = mod_block_lists(spec.query, spec.key, spec.program, *block)
        partial, full, total = blocks.counts()
        lists = blocks.kv_lists
        return (
            f"block sparsity of {block[0]}x{block[1]} (per list row: {lists.shape[0]} batch x "
            f"{lists.shape[1]} head): of {total} blocks {total - partial - full} skipped, "
            f"{full} full, {partial} partial"
        )

    def run(self, spec: Spec) -> Tensor:
        return self.prepare(spec)(spec.query, spec.key, spec.value)

    def forward_lse(self, spec: Spec) -> tuple[Tensor, Tensor]:
        """FlashAttention 4's forward with its log-sum-exp (natural log, ``-inf`` for a row
        that keeps nothing, as :meth:`Backend.forward_lse` says), recording no graph."""
        options = self._options(spec, None)
        with torch.no_grad():
            out, lse = _flash_attn_func()(
                *(x.transpose(1, 2) for x in (spec.query, spec.key, spec.value)),
                return_lse=True,
                **options,
            )
        return out.transpose(1, 2), lse

    def backward_lse(
        self, spec: Spec, grad_out: Tensor, out: Tensor, lse: Tensor, wrt: Sequence[Tensor]
    ) -> LseGrads:
        """FlashAttention 4's backward kernels given the merged output and log-sum-exp (its
        softmax-gradient term ``rowsum(dO * O)`` is then the merged one). Its bias terms hold
        no learnable tensor (slopes that require grad are refused), so ``wrt`` gets nothing."""
        options = self._options(spec, None)
        left, right = options.pop("window_size")
        options.pop("softmax_scale")
        backward = _flash_attn_bwd()
        assert backward is not None  # reasons() refuses the call without it
        dq, dk, dv = backward(
            *(x.transpose(1, 2) for x in (spec.query, spec.key, spec.value)),
            out.to(spec.dtype).transpose(1, 2),
            grad_out.to(spec.dtype).transpose(1, 2),
            lse.float().contiguous(),
            spec.resolved_scale,
            window_size_left=left,
            window_size_right=right,
            **options,
        )[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), [None] * len(wrt)

    def _options(self, spec: Spec, layout: DocumentLayout | None) -> dict[str, Any]:
        """FlashAttention 4's keyword arguments for the call's scale, band and score terms."""
        terms = spec.terms
        options: dict[str, Any] = {
            "softmax_scale": spec.resolved_scale,
            "window_size": self._window(spec, layout),
        }
        if terms.mods:
            form = _mod_form(spec)
            assert form.callbacks is not None
            options["window_size"] = form.window
            options.update(
                mask_mod=form.callbacks.mask_mod,
                score_mod=form.callbacks.score_mod,
                score_mod_bwd=form.callbacks.score_mod_bwd,
                # unpacked heads: the callbacks see one query head per tile
                pack_gqa=False,
            )
            if form.options.scalars and form.scalars:
                options["aux_scalars"] = form.scalars
            return options
        if terms.softcap is not None:
            score_mod, score_mod_bwd = _softcap_score_mods(terms.softcap)
            options.update(score_mod=score_mod, score_mod_bwd=score_mod_bwd)
        if terms.slopes is not None:
            score_mod, score_mod_bwd = _alibi_score_mods()
            # Unpacked heads, so that the score modifier sees one query head per tile.
            options.update(
                score_mod=score_mod,
                score_mod_bwd=score_mod_bwd,
                aux_tensors=[terms.slopes[0]],
                pack_gqa=False,
            )
        return options

    def prepare(self, spec: Spec) -> Prepared:
        needs_grad = spec.needs_grad
        layout = self._layout(spec)
        options = self._options(spec, layout)
        if layout is None and spec.terms.mods:
            return self._prepare_mods(spec, options)
        if layout is None:
            dense = _flash_attn_func()

            def run_dense(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
                # FlashAttention takes (B, L, H, E): a transposed view, no copy.
                out, _ = dense(
                    query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), **options
                )
                return _first_order(out.transpose(1, 2), needs_grad)

            return run_dense

        varlen = _flash_attn_varlen_func()
        options.update(
            cu_seqlens_q=layout.cu_seqlens_q,
            cu_seqlens_k=layout.cu_seqlens_k,
            max_seqlen_q=layout.max_seqlen_q,
            max_seqlen_k=layout.max_seqlen_k,
        )

        def run_documents(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            batch, _, length_q, _ = query.shape
            out, _ = varlen(*(_rows_flattened(x) for x in (query, key, value)), **options)
            return _first_order(out.unflatten(0, (batch, length_q)).transpose(1, 2), needs_grad)

        return run_documents

    @staticmethod
    def _prepare_mods(spec: Spec, options: dict[str, Any]) -> Prepared:
        """The run of a call with ModBias functions: per call, the tensors they read (as
        ``aux_tensors``: in-place changes are seen) and the block lists of their masks (rebuilt
        when a tensor they read changed)."""
        needs_grad = spec.needs_grad
        dense = _flash_attn_func()
        form = _mod_form(spec)
        program = spec.program
        mods = program.mods
        assert mods is not None  # a call with ModBias parts has generated functions
        traced = mods.traced

        def run_mods(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            per_call = dict(options, aux_tensors=fa4_mods.aux_tensors(traced))
            if form.block is not None:
                per_call.update(_block_sparsity(query, key, program, form.block))
            out, _ = dense(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), **per_call
            )
            return _first_order(out.transpose(1, 2), needs_grad)

        return run_mods


@dataclass(frozen=True)
class _ModForm:
    """A call's ModBias functions in FlashAttention 4's form: its callbacks, their options and
    runtime numbers, its window (open where the band is inside ``mask_mod``) and its block
    sparsity's block (``None``: no mask function, no block sparsity)."""

    callbacks: fa4_mods.Callbacks | None  # None: not compiled (for explain)
    options: fa4_mods.Options
    scalars: tuple[int | float, ...]
    window: tuple[int | None, int | None]
    block: tuple[int, int] | None


def _mod_form(spec: Spec, compiled: bool = True) -> _ModForm:
    terms = spec.terms
    mods = spec.program.mods
    assert mods is not None  # a call with ModBias parts has generated functions
    traced: TracedMods = mods.traced
    has_mask = bool(traced.masks)
    window = window_size(terms, spec.shape[3] - spec.shape[2])
    options = fa4_mods.Options(
        # FlashAttention 4 applies no window together with a mask_mod: the band goes inside
        band_lo=has_mask and terms.band_lo is not None,
        band_hi=has_mask and terms.band_hi is not None,
        softcap=terms.softcap is not None,
        scalars=fa4_mods.NUMBERS_AS_AUX_SCALARS,
    )
    scalars = fa4_mods.aux_scalars(traced, options, (terms.band_lo, terms.band_hi), terms.softcap)
    callbacks = (
        fa4_mods.callbacks(
            traced, options, scalars, differentiable=not fa4_mods.backward_problems(traced)
        )
        if compiled
        else None
    )
    return _ModForm(
        callbacks=callbacks,
        options=options,
        scalars=scalars,
        window=(None, None) if has_mask else window,
        block=fa4_mods.block_size(spec.head_dim) if has_mask else None,
    )


def _block_sparsity(
    query: Tensor, key: Tensor, program: Any, block: tuple[int, int]
) -> dict[str, Any]:
    """FlashAttention 4's block sparsity of the program's masks, forward and backward, from the
    library's block lists at FlashAttention 4's block (kept until a tensor they read
    changes)."""
    from attnbias.kernels.masks import mod_block_lists

    lists = mod_block_lists(query, key, program, *block)
    forward, backward = fa4_mods.block_sparse_fields(lists.kv_lists, lists.q_lists)
    make = _block_sparse_tensors()
    return {
        "block_sparse_tensors": make(**forward, block_size=block),
        "block_sparse_tensors_bwd": make(**backward, block_size=block),
    }

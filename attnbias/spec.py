"""One call, lowered once: the bias in the kernels' terms plus everything a backend looks at.

Every built-in mask and every sum of them is a diagonal band intersected with documents and
with each batch row's valid key range::

    keep(b, i, j) = band_lo <= j - i <= band_hi  and  doc_q[b, i] == doc_kv[b, j]
                    and  kv_start[b] <= j < kv_end[b]

plus two score modifiers (soft-cap, ALiBi). :func:`lower` computes that form and
:func:`make_spec` wraps it with the call's tensors, shapes and flags into a :class:`Spec`, which
each backend inspects (``not_supported_reasons``) and runs.

Shape legend: B batch, Hq query heads, Hkv key/value heads, L query length, S key length,
E head dim, Ev value head dim.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnbias.kernels.program import MaskProgram
from attnbias.bias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    parts_of,
)

__all__ = ["Lowered", "Spec", "lower", "make_spec", "with_causal"]


@dataclass(frozen=True, eq=False)
class Lowered:
    """A bias in the kernels' terms for one call of shape ``(B, Hq, L, S)``."""

    band_lo: int | None
    band_hi: int | None
    q_doc: Tensor | None  # (1 or B, L) int64
    kv_doc: Tensor | None  # (1 or B, S) int64
    slopes: Tensor | None  # (1 or B, Hq) float32
    softcap: float | None
    others: tuple[AttnBias, ...]  # parts with no kernel form (materialized additively)
    # Each batch row's valid keys [kv_start[b], kv_end[b]) (padding, a cache's filled part):
    # (B,) int32 on the inputs' device ((1 or B,) when lowered without the batch size), both
    # or neither; a start past its end keeps no key.
    kv_start: Tensor | None = None
    kv_end: Tensor | None = None

    @property
    def has_key_range(self) -> bool:
        return self.kv_start is not None

    @functools.cached_property
    def program(self) -> MaskProgram:
        """The kernels' form of these terms, built once."""
        return MaskProgram(
            band_lo=self.band_lo,
            band_hi=self.band_hi,
            q_doc=self.q_doc,
            kv_doc=self.kv_doc,
            kv_start=self.kv_start,
            kv_end=self.kv_end,
            alibi_slopes=self.slopes,
            softcap=self.softcap,
        )

    def kernel_args(self) -> dict[str, Any]:
        """The mask and score-modifier keywords of the Triton kernels' launchers
        (``attention_forward``, ``decode_forward``, their plans, ``block_sparse_attention``)."""
        return {
            "band_lo": self.band_lo,
            "band_hi": self.band_hi,
            "q_doc": self.q_doc,
            "kv_doc": self.kv_doc,
            "alibi_slopes": self.slopes,
            "softcap": self.softcap,
            "kv_start": self.kv_start,
            "kv_end": self.kv_end,
        }

    @property
    def _band_only(self) -> bool:
        """Nothing but a band, a key range aside."""
        return (
            self.q_doc is None and self.slopes is None and self.softcap is None and not self.others
        )

    @property
    def is_plain_causal(self) -> bool:
        return (
            self._band_only
            and not self.has_key_range
            and self.band_lo is None
            and self.band_hi == 0
        )

    @property
    def is_empty(self) -> bool:
        return (
            self._band_only
            and not self.has_key_range
            and self.band_lo is None
            and self.band_hi is None
        )

    @property
    def band_is_empty(self) -> bool:
        """True when the band keeps no ``(i, j)`` at all (``band_lo > band_hi``)."""
        return self.band_lo is not None and self.band_hi is not None and self.band_lo > self.band_hi

    @property
    def kind(self) -> str:
        """The one word the priority tables are keyed by: the costliest feature present.

        A key range adds no kind of its own: it only narrows the key loop of the kernel that
        runs the other features (fewer blocks, bounded loads in the blocks at its ends), so
        the order measured for those features stands; the backends that cannot take a key
        range (FlashAttention 4, stock SDPA's fused routes) give their reason and the planner
        moves on. A kind needs measurements of its own to earn a row in the tables.
        """
        if self.others:
            return "materialized"
        if self.slopes is not None:
            return "alibi"
        if self.softcap is not None:
            return "softcap"
        if self.q_doc is not None:
            return "documents"
        if self.band_lo is None and self.band_hi is None:
            return "none"
        if self.band_lo is None and self.band_hi == 0:
            return "causal"
        return "band"

    def describe(self) -> str:
        terms = []
        if self.band_lo is not None or self.band_hi is not None:
            lo = "-inf" if self.band_lo is None else str(self.band_lo)
            hi = "+inf" if self.band_hi is None else str(self.band_hi)
            terms.append(f"band {lo} <= j - i <= {hi}")
        if self.q_doc is not None:
            terms.append("documents")
        if self.has_key_range:
            terms.append("key range kv_start[b] <= j < kv_end[b]")
        if self.slopes is not None:
            terms.append("ALiBi")
        if self.softcap is not None:
            terms.append(f"soft-cap {self.softcap:g}")
        terms += [f"{type(p).__name__} (materialized)" for p in self.others]
        return ", ".join(terms) if terms else "no mask"


def _dense_ranks(query_ids: Tensor, key_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Each id replaced by its position in the sorted ids of both sides, ``[0, N)`` for the
    ``N`` ids in all: equal ids get equal ranks and the order is kept, so non-decreasing ids
    stay non-decreasing and whatever the ids' magnitude, the ranks are small."""
    everything = torch.cat([query_ids.flatten(), key_ids.flatten()]).sort().values
    return (
        torch.searchsorted(everything, query_ids.contiguous()),
        torch.searchsorted(everything, key_ids.contiguous()),
    )


def _merge_docs(
    first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """Ids whose equality means equality under both document layouts (still non-decreasing).

    The pair ``(first id, second id)`` of each position, numbered in lexicographic order: both
    layouts are relabelled to their ranks among the ``N`` ids of the query and key sides
    (``[0, N)``), and ``rank1 * N + rank2`` is then exact in int64 for any ids (the product of
    the raw ids overflowed), non-decreasing where both layouts are, and the same on the query
    and key sides. ``(1 or B, L)`` and ``(1 or B, S)`` in, the same shapes out.
    """
    q1, kv1 = _dense_ranks(*first)
    q2, kv2 = _dense_ranks(*second)
    count = q1.numel() + kv1.numel()
    if count >= 2**31:
        raise ValueError(
            f"DocumentBias: merging two document layouts needs fewer than 2**31 ids in all, got "
            f"{count}; pass one DocumentBias with the combined ids"
        )
    return _dense_ranks(q1 * count + q2, kv1 * count + kv2)


def lower(
    bias: AttnBias | None,
    length_q: int,
    length_kv: int,
    device: torch.device,
    *,
    batch: int | None = None,
) -> Lowered:
    """Lower ``bias`` to a band, documents, a key range and score modifiers for a call with
    ``(B, L, S)``; without ``batch``, key ranges keep their own rows (1 or B)."""
    band_lo: int | None = None
    band_hi: int | None = None
    docs: tuple[Tensor, Tensor] | None = None
    slopes: Tensor | None = None
    softcap: float | None = None
    key_range: tuple[Tensor, Tensor] | None = None
    others: list[AttnBias] = []

    def tighten(lo: int | None, hi: int | None) -> None:
        nonlocal band_lo, band_hi
        if lo is not None:
            band_lo = lo if band_lo is None else max(band_lo, lo)
        if hi is not None:
            band_hi = hi if band_hi is None else min(band_hi, hi)

    for part in parts_of(bias):
        if isinstance(part, CausalBias):
            tighten(None, part.offset_hi(length_q, length_kv))
        elif isinstance(part, SlidingWindowBias):
            tighten(*part.offsets(length_q, length_kv))
        elif isinstance(part, DocumentBias):
            # One document bias passes its cached device tensors on unchanged, so the kernel
            # can recognise them from call to call; the kernel broadcasts (1, L) against (B, S).
            new = part.ids_on(device)
            if docs is not None:
                rows = max(t.shape[0] for t in new + docs)  # 1 or B
                docs = _merge_docs(
                    (docs[0].expand(rows, -1), docs[1].expand(rows, -1)),
                    (new[0].expand(rows, -1), new[1].expand(rows, -1)),
                )
            else:
                docs = new
        elif isinstance(part, AlibiBias):
            term = part.slope_tensor(device)
            slopes = term if slopes is None else slopes + term
        elif isinstance(part, KeyRangeBias):
            if part.start is None and part.end is None:
                continue  # every key of every row
            # (B,) int32 on the device, kept with the bias; ranges intersect on the device
            # (no host sync): the largest start and the smallest end.
            key_rows = batch
            if key_rows is None:
                key_rows = max(b.shape[0] for b in (part.start, part.end) if b is not None)
            start, end = part.bounds_on(device, key_rows, length_kv)
            if key_range is not None:
                start = torch.maximum(key_range[0], start)
                end = torch.minimum(key_range[1], end)
            key_range = (start, end)
        elif isinstance(part, SoftcapBias):
            softcap = part.cap
        else:
            others.append(part)

    # A side of the band that every (i, j) satisfies is no constraint at all.
    if band_lo is not None and band_lo <= -(length_q - 1):
        band_lo = None
    if band_hi is not None and band_hi >= length_kv - 1:
        band_hi = None
    return Lowered(
        band_lo=band_lo,
        band_hi=band_hi,
        q_doc=None if docs is None else docs[0].contiguous(),
        kv_doc=None if docs is None else docs[1].contiguous(),
        slopes=None if slopes is None else slopes.contiguous(),
        softcap=softcap,
        others=tuple(others),
        kv_start=None if key_range is None else key_range[0],
        kv_end=None if key_range is None else key_range[1],
    )


@dataclass(frozen=True, eq=False)
class Spec:
    """One validated call of :func:`attnbias.sdpa` whose bias is built from built-ins.

    ``bias`` already holds ``is_causal`` (see :func:`with_causal`); ``lowered`` is its kernel
    form. Backends read the fields and properties; none of them changes the spec.
    """

    query: Tensor  # (B, Hq, L, E)
    key: Tensor  # (B, Hkv, S, E)
    value: Tensor  # (B, Hkv, S, Ev)
    bias: AttnBias | None
    lowered: Lowered
    scale: float | None  # None: 1 / sqrt(E)
    dropout_p: float
    enable_gqa: bool
    needs_grad: bool
    compiling: bool
    # being captured in a CUDA graph: its host time is paid once, at capture, so only the
    # GPU time of its route counts (``planner.plan``)
    capturing: bool = False

    @property
    def program(self) -> MaskProgram:
        """The mask program the Triton kernels' launchers take, unchanged."""
        return self.lowered.program

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, Hq, L, S)``: the shape of the scores and of a materialized mask."""
        batch, heads, length_q, _ = self.query.shape
        return (batch, heads, length_q, self.key.shape[-2])

    @property
    def head_dim(self) -> int:
        return int(self.query.shape[-1])

    @property
    def head_dim_v(self) -> int:
        return int(self.value.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.query.dtype

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def resolved_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else float(self.scale)

    @property
    def has_empty_dim(self) -> bool:
        return 0 in self.shape or self.key.shape[1] == 0


def make_spec(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    enable_gqa: bool,
) -> Spec:
    """Lower a validated call once; everything the planner and the backends need."""
    bias = with_causal(bias, causal)
    lowered = lower(bias, query.shape[-2], key.shape[-2], query.device, batch=query.shape[0])
    tensors = [query, key, value]
    if lowered.slopes is not None:
        tensors.append(lowered.slopes)
    tensors += [part.bias for part in lowered.others if isinstance(part, TensorBias)]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    compiling = torch.compiler.is_compiling()
    return Spec(
        query=query,
        key=key,
        value=value,
        bias=bias,
        lowered=lowered,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=enable_gqa,
        needs_grad=needs_grad,
        compiling=compiling,
        capturing=not compiling and capturing(query),
    )


def capturing(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a CUDA tensor and the current CUDA stream is capturing a graph."""
    return tensor.is_cuda and torch._C._cuda_isCurrentStreamCapturing()


def capturable(tensor: Tensor) -> bool:
    """Whether a call on ``tensor`` could ever be captured in a CUDA graph (a CUDA tensor)."""
    return tensor.is_cuda


def with_causal(bias: AttnBias | None, causal: bool) -> AttnBias | None:
    """``bias`` with ``is_causal=True`` folded in: ``bias + CausalBias(UPPER_LEFT)``."""
    if not causal:
        return bias
    causal_part = CausalBias(CausalVariant.UPPER_LEFT)
    return causal_part if bias is None else bias + causal_part

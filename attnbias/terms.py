"""The open value a bias lowers to: :class:`Terms`, merged by a sum without knowing bias
kinds, and turned once into the kernels' :class:`~attnbias.kernels.program.MaskProgram`.

Every built-in mask and every sum of them is a diagonal band intersected with documents and
with each batch row's valid key range::

    keep(b, i, j) = band_lo <= j - i <= band_hi  and  doc_q[b, i] == doc_kv[b, j]
                    and  kv_start[b] <= j < kv_end[b]

plus two score terms (soft-cap, ALiBi). A part with no such form is carried as itself
(``others``) and materialized by the routes that take it.

Shape legend: B batch, Hq query heads, L query length, S key length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnbias.kernels.program import MaskProgram
from attnbias.kinds import Kind

if TYPE_CHECKING:
    from attnbias.kernels.modfn import CompiledMods

__all__ = ["KINDS", "Block", "Call", "Kind", "Terms"]


#: Every value of :attr:`Terms.kind`, the keys of the priority tables (``attnbias.policy``).
KINDS = tuple(Kind)


@dataclass(frozen=True)
class Call:
    """What a bias sees of a call when it validates and lowers itself: ``(B, Hq, L, S)`` and
    the device. ``batch`` is ``None`` when lowered without a batch size (key ranges then keep
    their own rows, 1 or B)."""

    batch: int | None
    heads: int
    length_q: int
    length_kv: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def batch_size(self) -> int:
        """``B``, or 1 when lowered without a batch size."""
        return 1 if self.batch is None else self.batch


@dataclass(frozen=True)
class Block:
    """A block of a call's ``(L, S)`` scores: the queries ``[q_start, q_start + length_q)``
    and the keys ``[kv_start, kv_start + length_kv)``.

    :meth:`attnbias.AttnBias.sub_block` gives the bias of such a block as a bias of its own,
    for a call of ``(length_q, length_kv)`` (context parallelism runs each shard pair so)."""

    q_start: int
    kv_start: int
    length_q: int
    length_kv: int

    @property
    def offset(self) -> int:
        """What a diagonal ``j - i`` of the whole call is minus the same pair's ``j - i`` in
        the block: a band ``lo <= j - i <= hi`` of the call is ``lo - offset <= j - i <= hi -
        offset`` in the block."""
        return self.kv_start - self.q_start


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
    rows = max(t.shape[0] for t in first + second)  # 1 or B
    first = (first[0].expand(rows, -1), first[1].expand(rows, -1))
    second = (second[0].expand(rows, -1), second[1].expand(rows, -1))
    q1, kv1 = _dense_ranks(*first)
    q2, kv2 = _dense_ranks(*second)
    count = q1.numel() + kv1.numel()
    if count >= 2**31:
        raise ValueError(
            f"DocumentBias: merging two document layouts needs fewer than 2**31 ids in all, got "
            f"{count}; pass one DocumentBias with the combined ids"
        )
    return _dense_ranks(q1 * count + q2, kv1 * count + kv2)


def _tighter(a: int | None, b: int | None, pick: Callable[[int, int], int]) -> int | None:
    if a is None:
        return b
    return a if b is None else pick(a, b)


@dataclass(frozen=True, eq=False)
class Terms:
    """A bias in the kernels' terms for one call of shape ``(B, Hq, L, S)``.

    Each bias kind gives its terms (:meth:`attnbias.AttnBias.lower`); :meth:`merge` combines
    two (masks intersect, additive terms add up) and :meth:`finish` normalises the merged
    terms for the call. ``doc_parts`` are the biases the documents came from (a backend that
    takes one layout of documents reads their ids on the host, once per bias).
    """

    band_lo: int | None = None
    band_hi: int | None = None
    q_doc: Tensor | None = None  # (1 or B, L) int64
    kv_doc: Tensor | None = None  # (1 or B, S) int64
    slopes: Tensor | None = None  # (1 or B, Hq) float32
    # ALiBi's distances i + (S - L) + alibi_shift - j (a block of a larger call's), and the
    # bias parts the slopes come from (materialized instead when two shifts meet in a sum)
    alibi_shift: int = 0
    alibi_parts: tuple[object, ...] = ()
    softcap: float | None = None
    # bias parts with no kernel form (materialized by the routes that take them)
    others: tuple[object, ...] = ()
    # Each batch row's valid keys [kv_start[b], kv_end[b]) (padding, a cache's filled part):
    # (B,) int32 on the inputs' device ((1 or B,) when lowered without the batch size), both
    # or neither; a start past its end keeps no key.
    kv_start: Tensor | None = None
    kv_end: Tensor | None = None
    # Work a kept plan redoes before each call: the intersection of two key ranges, written
    # again into the tensors above from the ranges' own (in-place writes are seen).
    refresh: tuple[Callable[[], object], ...] = ()
    doc_parts: tuple[object, ...] = ()  # the bias parts the documents come from
    # ModBias parts, in the order of the sum: their masks intersect with the rest, their score
    # functions apply after the additive terms, in this order (compiled together into the
    # program's generated functions when the lowering finishes: :meth:`finish`).
    mods: tuple[Any, ...] = ()
    # ModBias parts whose functions run as the band, documents and soft-cap above (for
    # describe)
    forms: tuple[Any, ...] = ()
    # The ModBias part whose score function the soft-cap is (``cap * tanh(score / cap)``). A
    # score function applies after the additive terms, a soft-cap before them: in a sum with
    # additive terms, another soft-cap or an earlier score function it runs as its functions
    # instead (:meth:`merge`).
    softcap_part: Any = None
    # The kernels' form of these terms, made by :meth:`finish` (``None`` before) and passed
    # unchanged to the launchers (a field rather than a cached property: torch.compile traces
    # its reads).
    program: MaskProgram | None = field(default=None, repr=False)

    @classmethod
    def of(cls, **given: Any) -> Terms:
        """``Terms(**given)`` with every other field named at its default, as the library
        builds terms: torch.compile (2.11) guards a default that a frozen dataclass's
        constructor takes by a Python call on each run of the compiled function (~10 µs
        each), and a named value by a plain guard."""
        return cls(**{**_TERMS_DEFAULTS, **given})

    def _program(self, mods: CompiledMods | None) -> MaskProgram:
        return MaskProgram(
            band_lo=self.band_lo,
            band_hi=self.band_hi,
            q_doc=self.q_doc,
            kv_doc=self.kv_doc,
            kv_start=self.kv_start,
            kv_end=self.kv_end,
            alibi_slopes=self.slopes,
            alibi_shift=self.alibi_shift or None,
            softcap=self.softcap,
            blocks=None,
            mods=mods,
        )

    def merge(self, other: Terms) -> Terms:
        """Both terms at once: bands and key ranges intersect, documents combine, ALiBi slopes
        add up (of two shifts, the ALiBi parts are materialized instead); the soft-cap is the
        one that is set (a sum holds at most one; a score function written as a soft-cap runs
        as its function where the order of the sum matters)."""
        first, second = self, other
        if first.softcap_part is not None and (second.adds_to_scores or second.softcap is not None):
            first = first.softcap_as_function()
        if second.softcap_part is not None and (
            first.adds_to_scores or first.softcap is not None or first.has_score_functions
        ):
            second = second.softcap_as_function()
        if first is not self or second is not other:
            return first.merge(second)
        if other.q_doc is None or other.kv_doc is None:
            docs = (self.q_doc, self.kv_doc)
        elif self.q_doc is None or self.kv_doc is None:
            docs = (other.q_doc, other.kv_doc)
        else:
            docs = _merge_docs((self.q_doc, self.kv_doc), (other.q_doc, other.kv_doc))
        key_range = (self.kv_start, self.kv_end)
        refresh = self.refresh + other.refresh
        if other.kv_start is not None and other.kv_end is not None:
            if self.kv_start is None or self.kv_end is None:
                key_range = (other.kv_start, other.kv_end)
            else:  # on the device, no host sync: the largest start and the smallest end
                key_range = (
                    torch.maximum(self.kv_start, other.kv_start),
                    torch.minimum(self.kv_end, other.kv_end),
                )
                # computed again before each call of a kept plan: writes into either range
                # are seen (the kernels read these tensors)
                refresh += (
                    partial(torch.maximum, self.kv_start, other.kv_start, out=key_range[0]),
                    partial(torch.minimum, self.kv_end, other.kv_end, out=key_range[1]),
                )
        slopes, shift, alibi_parts = self.slopes, self.alibi_shift, self.alibi_parts
        materialized: tuple[object, ...] = ()
        if other.slopes is not None:
            if slopes is None:
                slopes, shift, alibi_parts = other.slopes, other.alibi_shift, other.alibi_parts
            elif shift == other.alibi_shift:
                slopes, alibi_parts = slopes + other.slopes, alibi_parts + other.alibi_parts
            else:  # distances to two diagonals: no one kernel term
                materialized = alibi_parts + other.alibi_parts
                slopes, shift, alibi_parts = None, 0, ()
        return Terms.of(
            band_lo=_tighter(self.band_lo, other.band_lo, max),
            band_hi=_tighter(self.band_hi, other.band_hi, min),
            q_doc=docs[0],
            kv_doc=docs[1],
            slopes=slopes,
            alibi_shift=shift,
            alibi_parts=alibi_parts,
            softcap=self.softcap if other.softcap is None else other.softcap,
            others=self.others + other.others + materialized,
            kv_start=key_range[0],
            kv_end=key_range[1],
            refresh=refresh,
            doc_parts=self.doc_parts + other.doc_parts,
            mods=self.mods + other.mods,
            forms=self.forms + other.forms,
            softcap_part=self.softcap_part if other.softcap is None else other.softcap_part,
        )

    def softcap_as_function(self) -> Terms:
        """These terms with the soft-cap of ``softcap_part`` run as that part's functions,
        first of the score functions (no other one came before it in the sum; its mask, kept
        by the band or documents too, is then evaluated twice)."""
        part = self.softcap_part
        return dataclasses.replace(
            self,
            softcap=None,
            softcap_part=None,
            mods=(part, *self.mods),
            forms=tuple(p for p in self.forms if p is not part),
        )

    @property
    def adds_to_scores(self) -> bool:
        """ALiBi or materialized parts: terms added to the scores before score functions."""
        return self.slopes is not None or len(self.others) > 0

    @property
    def has_score_functions(self) -> bool:
        # (any(...) of a generator stops torch.compile; a loop does not)
        for part in self.mods:  # noqa: SIM110
            if part.score_mod is not None:
                return True
        return False

    def finish(self, length_q: int, length_kv: int, mods: CompiledMods | None = None) -> Terms:
        """These terms for a call with ``(L, S)`` with their :attr:`program`: a side of the
        band that every ``(i, j)`` satisfies is no constraint at all, and the tensors are
        contiguous. ``mods`` is the kernels' form of the ModBias parts (:attr:`mods`,
        :func:`~attnbias.biases.mod_state.compiled_mods`), given exactly where there are
        some."""
        if (mods is None) != (len(self.mods) == 0):  # (`not` of a tuple stops torch.compile)
            raise ValueError(
                f"Terms.finish: {len(self.mods)} ModBias part(s) and "
                f"{'no' if mods is None else 'a'} compiled form of them; pass "
                f"attnbias.biases.mod_state.compiled_mods(terms.mods) exactly where there are parts"
            )
        band_lo, band_hi = self.band_lo, self.band_hi
        if band_lo is not None and band_lo <= -(length_q - 1):
            band_lo = None
        if band_hi is not None and band_hi >= length_kv - 1:
            band_hi = None
        finished = Terms.of(
            band_lo=band_lo,
            band_hi=band_hi,
            q_doc=None if self.q_doc is None else self.q_doc.contiguous(),
            kv_doc=None if self.kv_doc is None else self.kv_doc.contiguous(),
            slopes=None if self.slopes is None else self.slopes.contiguous(),
            alibi_shift=self.alibi_shift,
            alibi_parts=self.alibi_parts,
            softcap=self.softcap,
            others=self.others,
            kv_start=self.kv_start,
            kv_end=self.kv_end,
            refresh=self.refresh,
            doc_parts=self.doc_parts,
            mods=self.mods,
            forms=self.forms,
            softcap_part=self.softcap_part,
        )
        object.__setattr__(finished, "program", finished._program(mods))
        return finished

    @property
    def has_key_range(self) -> bool:
        return self.kv_start is not None

    @property
    def is_mask_only(self) -> bool:
        """Only a band, documents and a key range: no score terms (ALiBi, soft-cap), generated
        functions or materialized parts."""
        return (
            self.slopes is None
            and self.softcap is None
            and len(self.others) == 0
            and len(self.mods) == 0  # (`not` of a tuple of objects stops torch.compile)
        )

    @property
    def _band_only(self) -> bool:
        """Nothing but a band, a key range aside."""
        return self.q_doc is None and self.is_mask_only

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
    def kind(self) -> Kind:
        """The one word the priority tables are keyed by (one of :data:`KINDS`): the
        costliest feature present.

        A key range adds no kind of its own: it only narrows the key loop of the kernel that
        runs the other features (fewer blocks, bounded loads in the blocks at its ends), so
        the order measured for those features stands; the backends that cannot take a key
        range (FlashAttention 4, stock SDPA's fused routes) give their reason and the planner
        moves on. A kind needs measurements of its own to earn a row in the tables.
        """
        if self.others:
            return Kind.MATERIALIZED
        if self.mods:
            return Kind.MOD if self.has_score_functions else Kind.MOD_MASK
        if self.slopes is not None:
            return Kind.ALIBI
        if self.softcap is not None:
            return Kind.SOFTCAP
        if self.q_doc is not None:
            return Kind.DOCUMENTS
        if self.band_lo is None and self.band_hi is None:
            return Kind.NONE
        if self.band_lo is None and self.band_hi == 0:
            return Kind.CAUSAL
        return Kind.BAND

    def describe(self) -> str:
        """The terms in words: the program's (its generated functions by the biases they
        come from), then the parts that are materialized."""
        program = self._program(None).describe()
        terms = [] if program == "no mask" else [program]
        terms += [f"{p.describe()} (generated functions)" for p in self.mods]
        terms += [f"{p.describe()} ({p.describe_form()})" for p in self.forms]
        terms += [f"{type(p).__name__} (materialized)" for p in self.others]
        return ", ".join(terms) if terms else "no mask"


# Every field of Terms at its default (none has a factory), for Terms.of.
_TERMS_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Terms)}

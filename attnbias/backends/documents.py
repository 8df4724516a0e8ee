"""The documents of a call as separate sequences: what the backends that run documents one
sequence at a time read of a ``DocumentBias`` (FlashAttention 4's variable-length batch,
stock SDPA's batch of equal documents, the planner's count of kept pairs).

The layout is read on the host, once per bias, device and batch size (one copy of the ids if
they live on the GPU), and kept with the bias.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnbias.kernels.pools import outside_pools
from attnbias.spec import Spec

if TYPE_CHECKING:
    from attnbias.biases import DocumentBias

__all__ = ["DocumentLayout", "document_part", "documents_layout", "flattens_as_view"]


@dataclass(frozen=True)
class DocumentLayout:
    """A document bias at one batch size as one sequence per document: the documents of every
    batch row, row after row (FlashAttention's variable-length batch).

    ``documents`` holds, per document, ``(queries, keys, first key - first query)``: its
    lengths and where it sits in its row (a band ``lo <= j - i <= hi`` of the call is ``lo - d
    <= j' - i' <= hi - d`` in its own positions).
    """

    cu_seqlens_q: Tensor  # (D + 1,) int32, D documents over all rows
    cu_seqlens_k: Tensor  # (D + 1,) int32
    max_seqlen_q: int
    max_seqlen_k: int
    end_offset: int | None  # key end - query end within its row, when equal for every document
    problem: str | None  # why it has no exact variable-length form
    documents: tuple[tuple[int, int, int], ...]

    @property
    def equal_length(self) -> int | None:
        """``C`` when every document of every row has ``C`` queries and ``C`` keys (each row
        is then ``L / C`` sequences of ``C``, at the same positions on both sides), else
        ``None``."""
        if self.problem is not None or not self.documents:
            return None
        first = self.documents[0][0]
        for length_q, length_kv, _ in self.documents:
            if length_q != first or length_kv != first:
                return None
        return first


_LAYOUTS: weakref.WeakKeyDictionary[
    DocumentBias, dict[tuple[torch.device, int], tuple[Any, DocumentLayout]]
] = weakref.WeakKeyDictionary()


def _row_runs(ids: Tensor, batch: int) -> list[tuple[list[int], list[int]]]:
    """``(document ids, their lengths)`` of each of the ``batch`` rows of ``ids`` (``(L,)``,
    ``(1, L)`` or ``(B, L)``; one copy to the host)."""
    rows = []
    for row in ids.reshape(-1, ids.shape[-1]).cpu():
        values, counts = torch.unique_consecutive(row, return_counts=True)
        rows.append((values.tolist(), counts.tolist()))
    return rows * batch if len(rows) == 1 else rows


def documents_layout(bias: DocumentBias, device: torch.device, batch: int = 1) -> DocumentLayout:
    """The one-sequence-per-document form of ``bias`` for ``batch`` rows, built once per bias,
    device, batch size and version of its ids (read again after an in-place write)."""
    per_call = _LAYOUTS.setdefault(bias, {})
    versions = bias.versions()
    kept = per_call.get((device, batch))
    if kept is not None and versions is not None and kept[0] == versions:
        return kept[1]
    problem = None
    documents: list[tuple[int, int, int]] = []
    offsets: set[int] = set()
    rows = zip(_row_runs(bias.q_doc_ids, batch), _row_runs(bias.kv_ids, batch), strict=True)
    for row, ((docs_q, row_q), (docs_kv, row_kv)) in enumerate(rows):
        if docs_q != docs_kv:
            problem = "a document has queries but no keys, or keys but no queries" + (
                f" (batch row {row})" if batch > 1 else ""
            )
            documents, offsets = [], set()
            break
        end_q = end_kv = 0
        for length_q, length_kv in zip(row_q, row_kv, strict=True):
            documents.append((length_q, length_kv, end_kv - end_q))
            end_q, end_kv = end_q + length_q, end_kv + length_kv
            offsets.add(end_kv - end_q)
    layout = DocumentLayout(
        cu_seqlens_q=_bounds([d[0] for d in documents], device),
        cu_seqlens_k=_bounds([d[1] for d in documents], device),
        max_seqlen_q=max((d[0] for d in documents), default=0),
        max_seqlen_k=max((d[1] for d in documents), default=0),
        end_offset=offsets.pop() if len(offsets) == 1 else None,
        problem=problem,
        documents=tuple(documents),
    )
    per_call[device, batch] = (versions, layout)
    return layout


def _bounds(lengths: list[int], device: torch.device) -> Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32 on ``device``."""
    bounds = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    bounds[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    # kept with the layout: made where no CUDA graph writes (attnbias.biases.base.cached_on)
    return outside_pools(lambda: bounds.to(device))


def document_part(spec: Spec) -> Any:
    """The one bias the call's documents come from (a ``DocumentBias``), or ``None``."""
    parts = spec.terms.doc_parts
    return parts[0] if len(parts) == 1 else None


def call_documents(spec: Spec) -> DocumentLayout:
    """The layout of the call's one document part for its batch: the spec's own
    (:attr:`~attnbias.spec.Spec.documents`, worked out by the dispatcher before planning), or
    :func:`documents_layout` (a host read of the ids, once per bias) where it has none."""
    if spec.documents is not None:
        return spec.documents
    part = document_part(spec)
    assert part is not None, "a call with one document part"
    return documents_layout(part, spec.device, spec.shape[0])


def flattens_as_view(x: Tensor, dim: int = 0) -> bool:
    """Whether ``(B, H, L, E)`` ``x`` flattens dimension ``dim`` (0: its batch rows, 1: its
    heads) with its positions into one, ``(B·L, H, E)`` or ``(B, H·L, E)``, as a view: that
    dimension of size 1, one position, or the dimension ``L`` positions apart in memory (for
    the batch: ``(B, L, H, E)`` in memory, as a projection followed by ``.transpose(1, 2)``
    leaves it; for the heads: ``(B, H, L, E)`` contiguous)."""
    length = x.shape[2]
    return x.shape[dim] == 1 or length == 1 or x.stride(dim) == length * x.stride(2)

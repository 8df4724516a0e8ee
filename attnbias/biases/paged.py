"""Where each batch row's keys are in a paged key/value cache (serving)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnbias.biases.base import AttnBias, Device, Shape
from attnbias.biases.mod_state import Bounded
from attnbias.terms import Call

__all__ = ["PagedKV", "check_layout", "row_queries"]


def _index_tensor(value: Any, name: str, dims: int) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"PagedKV {name} must be a tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(
            f"PagedKV {name} must hold integers (torch.int32), got dtype={value.dtype}; convert "
            f"with .int()"
        )
    if value.dim() != dims:
        shapes = {1: "(B,)", 2: "(B, max_pages)"}
        raise ValueError(
            f"PagedKV {name} must have shape {shapes.get(dims, dims)}, got {tuple(value.shape)}"
        )
    return value


@dataclass(frozen=True, eq=False)
class PagedKV(AttnBias):
    """Each batch row's keys in a paged key/value cache, as serving stacks keep them.

    With this bias (alone or in a sum) :func:`attnbias.sdpa` takes ``key`` and ``value`` as
    page pools ``(num_pages, page_size, Hkv, E)`` (FlashAttention's and FlashInfer's layout):
    ``block_table`` int32 ``(B, max_pages)`` lists row ``b``'s pages in order and ``seq_lens``
    int32 ``(B,)`` its token count, the new tokens already written. The query ``(B, Hq, L, E)``
    holds each row's last ``L`` tokens; with ``cu_seqlens_q`` (int32 ``(B + 1,)``, from 0,
    non-decreasing) the query is ``(1, Hq, total, E)`` and row ``b``'s queries are
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``, its last that many tokens (prefill and decode rows
    packed together, as continuous batching does). The rows may end before ``total``: the
    queries past ``cu_seqlens_q[-1]`` belong to no row (a step padded to a fixed size, as
    CUDA graphs need) and their outputs are zeros, at no cost in attention.
    ``max_seqlen_q`` (a host int, with ``cu_seqlens_q``) bounds any row's queries: the
    library's kernels then run each row at that many queries rather than at the packed total
    (a decode step of ``B`` rows of one token costs ``B`` times less); a row with more is
    refused like other bad tables.

    The other parts of a sum align per row: ``causal_lower_right()`` ends each row's queries at
    the row's last key, :class:`SlidingWindowBias` and :class:`AlibiBias` measure distances
    within the row, :class:`SoftcapBias` applies as usual, and a :class:`ModBias` keeps
    FlexAttention's meaning: ``kv_idx`` is the key's position in its row and ``q_idx`` the
    query's index among the row's queries (its position in the row is ``q_idx + lens[b] - L``,
    with ``lens`` the ``seq_lens`` tensor captured in the function: read at each call). Other
    parts are refused (``causal_upper_left()`` has no meaning for a cache). Rows
    may share pages (a common prefix). The tables and lengths are read at each call and may be
    written in place between calls (a server's step; a CUDA-graph replay sees them too).
    Forward only: inputs that require grad are refused.

    Their values are checked when the bias is made (outside a CUDA-graph capture), by
    :meth:`validate`, and at each eager call whose tables changed since this bias's last check
    (the layers of a step share one check): on the CPU before anything runs, on a GPU on the
    device, read at the next eager call (no synchronisation per step), which raises naming the
    problem; that call's output is not to be trusted. A change is seen through the tensors'
    version counters, which every in-place write through PyTorch moves; tables written by
    other means (a custom kernel writing through a pointer, the replay of a CUDA graph) are
    not checked again: call :meth:`validate` after such writes. The replays of a captured
    CUDA graph are not checked.

    Example::

        >>> import attnbias
        >>> from attnbias import causal_lower_right
        >>> pool_k = pool_v = torch.randn(8, 4, 2, 16)  # 8 pages of 4 tokens, Hkv=2, E=16
        >>> table = torch.tensor([[0, 1, 2], [5, 3, 0]], dtype=torch.int32)
        >>> lens = torch.tensor([10, 7], dtype=torch.int32)
        >>> q = torch.randn(2, 2, 1, 16)  # one new token per row
        >>> bias = PagedKV(table, lens) + causal_lower_right()
        >>> attnbias.sdpa(q, pool_k, pool_v, attn_mask=bias).shape
        torch.Size([2, 2, 1, 16])
    """

    block_table: Tensor = field(repr=False)
    seq_lens: Tensor = field(repr=False)
    cu_seqlens_q: Tensor | None = field(default=None, repr=False)
    max_seqlen_q: int | None = None
    # what a call works out once per layout and sum (attnbias.paged)
    _kept: Bounded[Any, Any] = field(
        default_factory=lambda: Bounded(8), init=False, repr=False
    )  # a few sums and layouts
    # the state of the tables whose values a call last checked (attnbias.paged._tables_state)
    _checked: list[Any] = field(default_factory=lambda: [None], init=False, repr=False)
    holds_pages: ClassVar[bool] = True

    def __post_init__(self) -> None:
        table = _index_tensor(self.block_table, "block_table", 2)
        lens = _index_tensor(self.seq_lens, "seq_lens", 1)
        if lens.shape[0] != table.shape[0]:
            raise ValueError(
                f"PagedKV seq_lens has {lens.shape[0]} rows but block_table has "
                f"{table.shape[0]}; give one length per row of the table"
            )
        if lens.device != table.device:
            raise ValueError(
                f"PagedKV block_table is on {table.device} but seq_lens on {lens.device}; put "
                f"both on the device of the page pools"
            )
        cu = self.cu_seqlens_q
        if cu is not None:
            cu = _index_tensor(cu, "cu_seqlens_q", 1)
            if cu.shape[0] != table.shape[0] + 1:
                raise ValueError(
                    f"PagedKV cu_seqlens_q must have B + 1 = {table.shape[0] + 1} entries, got "
                    f"{cu.shape[0]}"
                )
            if cu.device != table.device:
                raise ValueError(
                    f"PagedKV cu_seqlens_q is on {cu.device} but block_table on "
                    f"{table.device}; put both on the device of the page pools"
                )
        bound = self.max_seqlen_q
        if bound is not None:
            if cu is None:
                raise ValueError(
                    "PagedKV max_seqlen_q bounds the queries of ragged rows: pass it with "
                    "cu_seqlens_q (uniform rows have the query's length)"
                )
            if type(bound) is not int or bound < 1:
                raise ValueError(
                    f"PagedKV max_seqlen_q must be a positive int (the most queries any row "
                    f"has), got {bound!r}"
                )
        if not torch.compiler.is_compiling() and not (
            table.is_cuda and torch.cuda.is_current_stream_capturing()
        ):
            self._check_values()

    def _check_values(self) -> None:
        """What the tables say alone (one host synchronisation)."""
        lens, table = self.seq_lens, self.block_table
        if bool((lens < 0).any()):
            raise ValueError(f"PagedKV seq_lens must be >= 0, got {lens.tolist()}")
        if bool((table < 0).any()):
            raise ValueError(
                f"PagedKV block_table holds a negative page index; the pages are counted from "
                f"0, got {table.tolist()}"
            )
        cu = self.cu_seqlens_q
        if cu is not None and (int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any())):
            raise ValueError(
                f"PagedKV cu_seqlens_q must start at 0 and never decrease, got {cu.tolist()}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.block_table.shape[0])

    def validate(
        self, key: Tensor, value: Tensor | None = None, query: Tensor | None = None
    ) -> None:
        """Check the tables' values against the page pools (and the query), with host
        synchronisations: every page a row reads is in the pool, each length fits the row's
        pages and covers its queries. Raises ``ValueError`` naming the row and the values."""
        self._check_values()
        pages, page_size = check_layout(self, key, value if value is not None else key, query)
        lens = self.seq_lens.long().cpu()
        table = self.block_table.long().cpu()
        capacity = table.shape[1] * page_size
        queries = None
        if query is not None:
            queries = row_queries(self, query).long().cpu()
            cu = self.cu_seqlens_q
            if cu is not None and int(cu[-1]) > query.shape[2]:
                raise ValueError(
                    f"PagedKV cu_seqlens_q ends at {int(cu[-1])}, past the query's "
                    f"{query.shape[2]} packed tokens; the rows' queries must lie in the query"
                )
        for row in range(table.shape[0]):
            length = int(lens[row])
            if length > capacity:
                raise ValueError(
                    f"PagedKV row {row}: seq_lens={length} but its block_table row holds "
                    f"{table.shape[1]} pages of {page_size} tokens ({capacity})"
                )
            used = table[row, : -(-length // page_size)]
            if bool((used >= pages).any()):
                raise ValueError(
                    f"PagedKV row {row} reads page {int(used.max())}, but the pools hold "
                    f"{pages} pages"
                )
            if queries is not None and int(queries[row]) > length:
                raise ValueError(
                    f"PagedKV row {row} has {int(queries[row])} queries but seq_lens={length}: "
                    f"the queries are the row's last tokens, already written to its pages"
                )
            bound = self.max_seqlen_q
            if queries is not None and bound is not None and int(queries[row]) > bound:
                raise ValueError(
                    f"PagedKV row {row} has {int(queries[row])} queries but max_seqlen_q="
                    f"{bound}; pass a bound that covers every row"
                )

    # -- the bias protocol: a PagedKV runs only through attnbias.sdpa's paged route ----------

    def needs_materialization(self) -> bool:
        return False

    def _refuse(self) -> TypeError:
        return TypeError(
            "PagedKV says where each row's keys are in page pools: pass it (alone or in a sum) "
            "as attn_mask to attnbias.sdpa or attnbias.explain with key and value as "
            "(num_pages, page_size, Hkv, E) pools; it has no materialized form and no place "
            "in other calls (context parallelism, a bias's own dispatch)"
        )

    def validate_call(self, call: Call) -> None:
        raise self._refuse()

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        raise self._refuse()

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
        raise TypeError(
            "PagedKV runs through attnbias.sdpa with (num_pages, page_size, Hkv, E) pools as "
            "key and value"
        )

    def parameters(self) -> tuple[Tensor, ...]:
        return ()

    def describe(self) -> str:
        ragged = "" if self.cu_seqlens_q is None else ", ragged queries"
        if self.max_seqlen_q is not None:
            ragged += f" (at most {self.max_seqlen_q} a row)"
        return (
            f"PagedKV(B={self.block_table.shape[0]}, max_pages={self.block_table.shape[1]}{ragged})"
        )

    def __repr__(self) -> str:
        return self.describe()


def check_layout(
    pages: PagedKV, key: Tensor, value: Tensor, query: Tensor | None
) -> tuple[int, int]:
    """``(num_pages, page_size)`` of the pools, after checking the shapes against the tables
    and each other (``ValueError`` / ``TypeError`` naming the values)."""
    for name, pool in (("key", key), ("value", value)):
        if not isinstance(pool, Tensor) or pool.dim() != 4:
            shape = tuple(pool.shape) if isinstance(pool, Tensor) else type(pool).__name__
            raise ValueError(
                f"with a PagedKV, {name} is a page pool (num_pages, page_size, Hkv, E), got {shape}"
            )
    if key.shape[:3] != value.shape[:3]:
        raise ValueError(
            f"the key pool {tuple(key.shape)} and the value pool {tuple(value.shape)} must share "
            f"num_pages, page_size and Hkv"
        )
    num_pages, page_size, heads_kv, head_dim = key.shape
    if page_size == 0:
        raise ValueError(f"the page pools have pages of 0 tokens: {tuple(key.shape)}")
    if pages.block_table.device != key.device:
        raise ValueError(
            f"PagedKV's tables are on {pages.block_table.device} but the pools on {key.device}; "
            f"move them with .to({str(key.device)!r})"
        )
    if query is not None:
        if query.dim() != 4:
            raise ValueError(f"query must be (B, Hq, L, E), got {tuple(query.shape)}")
        rows = 1 if pages.cu_seqlens_q is not None else pages.batch_size
        if query.shape[0] != rows:
            form = (
                "(1, Hq, total, E) with cu_seqlens_q"
                if pages.cu_seqlens_q is not None
                else f"(B={pages.batch_size}, Hq, L, E)"
            )
            raise ValueError(f"with this PagedKV the query is {form}, got {tuple(query.shape)}")
        if query.shape[-1] != head_dim:
            raise ValueError(f"query and key head dims differ: E={query.shape[-1]} and {head_dim}")
        if heads_kv == 0 or query.shape[1] % heads_kv:
            raise ValueError(
                f"query has Hq={query.shape[1]} heads, not a multiple of the pools' Hkv={heads_kv}"
            )
    return num_pages, page_size


def row_queries(pages: PagedKV, query: Tensor) -> Tensor:
    """``(B,)`` the number of queries of each row (on the tables' device)."""
    cu = pages.cu_seqlens_q
    if cu is None:
        return torch.full_like(pages.seq_lens, query.shape[2])
    return cu[1:] - cu[:-1]

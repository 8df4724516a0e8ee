"""Attention over a paged key/value cache (``PagedKV``) against the fp64 oracle that reads
each row's pages by hand (``attnbias.testing.oracle.paged_attention``): uniform and ragged
queries, GQA, shared pages, the parts that compose, in-place table updates, and bad input."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnbias
from attnbias import (
    AlibiBias,
    KeyRangeBias,
    ModBias,
    PagedKV,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.biases import BandBias
from attnbias.kernels.limits import interpreting
from attnbias.testing.oracle import assert_close_to_oracle, paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
I32 = torch.int32


def pools(pages: int, page_size: int, heads_kv: int, head_dim: int, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(pages, page_size, heads_kv, head_dim, generator=gen) for _ in range(2))
    return k.to(DEVICE), v.to(DEVICE)


def table_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=I32, device=DEVICE)


def lens_of(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=I32, device=DEVICE)


def run_and_check(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pages: PagedKV,
    rest: Any,
    dtype: torch.dtype = torch.float32,
) -> None:
    bias = pages if rest is None else pages + rest
    with torch.no_grad():
        out = attnbias.sdpa(
            query.to(dtype), k.to(dtype), v.to(dtype), attn_mask=bias,
            enable_gqa=query.shape[1] != k.shape[2],
        )  # fmt: skip
    expected = paged_attention(
        query, k, v, pages.block_table, pages.seq_lens, rest, cu_seqlens_q=pages.cu_seqlens_q
    )
    stock = paged_attention(
        query, k, v, pages.block_table, pages.seq_lens, rest,
        cu_seqlens_q=pages.cu_seqlens_q, dtype=dtype,
    )  # fmt: skip
    assert out.shape == expected.shape
    assert_close_to_oracle([out], [expected], [stock], dtype)


def _no_gathering(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The paged route's module, made to fail the test where it would gather the pages."""
    route = importlib.import_module("attnbias.paged")
    monkeypatch.setattr(route, "_gathered", lambda *_: pytest.fail("the pages were gathered"))
    return route


RESTS = {
    "none": lambda: None,
    "causal": causal_lower_right,
    "window": lambda: causal_lower_right() + SlidingWindowBias(3),
    "alibi": lambda: causal_lower_right() + AlibiBias(num_heads=4),
    "softcap": lambda: causal_lower_right() + SoftcapBias(2.0),
    "window alibi softcap": lambda: (
        causal_lower_right() + SlidingWindowBias(5) + AlibiBias(num_heads=4) + SoftcapBias(3.0)
    ),
}


@pytest.mark.parametrize("rest", list(RESTS))
@pytest.mark.parametrize("length_q", [1, 3])
def test_uniform_queries_match_the_oracle(rest: str, length_q: int) -> None:
    """Rows of different lengths, pages in any order and shared between rows (a common
    prefix), GQA (4 query heads on 2 key/value heads)."""
    k, v = pools(10, 4, 2, 16, seed=length_q)
    table = table_of([[7, 2, 9, 0], [7, 2, 4, 4], [1, 0, 0, 0]])  # rows 0 and 1 share 7, 2
    pages = PagedKV(table, lens_of([13, 10, 3]))
    query = torch.randn(3, 4, length_q, 16, device=DEVICE)
    run_and_check(query, k, v, pages, RESTS[rest]())


@pytest.mark.parametrize("bound", [None, 5, 7])
@pytest.mark.parametrize("rest", ["none", "causal", "window alibi softcap"])
def test_ragged_queries_match_the_oracle(rest: str, bound: int | None) -> None:
    """Prefill and decode rows packed in one query (``cu_seqlens_q``), a row with no query;
    with ``max_seqlen_q`` (the longest row's 5, or more) each row runs at that many queries
    instead of the packed 9."""
    k, v = pools(12, 4, 2, 16, seed=3)
    table = table_of([[3, 4, 5, 6], [0, 1, 0, 0], [8, 9, 10, 11], [2, 0, 0, 0]])
    counts = [5, 1, 0, 3]
    cu = torch.tensor([0, 5, 6, 6, 9], dtype=I32, device=DEVICE)
    pages = PagedKV(table, lens_of([14, 6, 16, 3]), cu_seqlens_q=cu, max_seqlen_q=bound)
    query = torch.randn(1, 4, sum(counts), 16, device=DEVICE)
    run_and_check(query, k, v, pages, RESTS[rest]())
    paged = importlib.import_module("attnbias.paged")
    assert paged.placed_length(pages, query) == (9 if bound is None else bound)


@pytest.mark.parametrize("bound", [None, 5])
@pytest.mark.parametrize("rest", ["causal", "window alibi softcap"])
def test_a_padded_step_gives_zeros_past_its_last_row(rest: str, bound: int | None) -> None:
    """A step padded to a fixed size (as CUDA graphs need): the 4 packed queries past
    ``cu_seqlens_q[-1]`` belong to no row. They hold NaN, which reaches no row's output, and
    their outputs are zeros; with ``max_seqlen_q`` (the rows then run at the same length
    padded or not) the rows' outputs are those of the unpadded step, bit for bit."""
    k, v = pools(12, 4, 2, 16, seed=4)
    table = table_of([[3, 4, 5, 6], [0, 1, 0, 0], [8, 9, 10, 11], [2, 0, 0, 0]])
    cu = torch.tensor([0, 5, 6, 6, 9], dtype=I32, device=DEVICE)
    pages = PagedKV(table, lens_of([14, 6, 16, 3]), cu_seqlens_q=cu, max_seqlen_q=bound)
    query = torch.randn(1, 4, 13, 16, device=DEVICE)
    query[:, :, 9:] = float("nan")
    run_and_check(query, k, v, pages, RESTS[rest]())
    with torch.no_grad():
        out = attnbias.sdpa(query, k, v, attn_mask=pages + RESTS[rest](), enable_gqa=True)
        alone = attnbias.sdpa(query[:, :, :9], k, v, attn_mask=pages + RESTS[rest](),
                              enable_gqa=True)  # fmt: skip
    assert torch.equal(out[:, :, 9:], torch.zeros_like(out[:, :, 9:]))
    if bound is not None:
        torch.testing.assert_close(out[:, :, :9], alone, rtol=0, atol=0)
    pages.validate(k, v, query)
    with pytest.raises(ValueError, match="ends at 9, past the query's 8 packed tokens"):
        pages.validate(k, v, query[:, :, :8])
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="cu_seqlens_q that ends past the query's length"):
            _call(pages, query[:, :, :8], k, v)


def _mod_parts(lens: torch.Tensor, length_q: int, table: torch.Tensor) -> dict[str, Any]:
    """ModBias parts reading each row's own positions: ``kv_idx`` the key's position in its
    row, ``q_idx`` the query's index among the row's queries (its position in the row is
    ``q_idx + lens[b] - L``, the lengths captured and read at each call)."""

    def every_third(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx % 3 != 1) | (kv_idx == 0)

    def relative(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        distance = (q_idx + lens[b] - length_q - kv_idx).clamp(0, 31)
        return score + table[h, distance]

    def first_query_sees_all(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx == 0) | (kv_idx <= q_idx + lens[b] - length_q)

    # a draft tree of the L queries at each row's end (node n's parent (n - 1) // 2): a node
    # keeps the row's earlier tokens, itself and its ancestors; numbered from 1, node i's
    # ancestors are i >> 1, i >> 2, ...
    numbers = torch.arange(1, length_q + 1)
    lineage = numbers[:, None] >> torch.arange(length_q.bit_length())[None, :]
    ancestors = (lineage[:, :, None] == numbers[None, None, :]).any(1).to(lens.device)

    def draft_tree(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        cache = lens[b] - length_q
        return (kv_idx < cache) | ancestors[q_idx, (kv_idx - cache).clamp(0, length_q - 1)]

    return {
        "mask": ModBias(mask_mod=every_third) + causal_lower_right(),
        "score": causal_lower_right() + ModBias(score_mod=relative),
        "query positions": ModBias(mask_mod=first_query_sees_all),
        "draft tree": ModBias(mask_mod=draft_tree),
        # a window: only each row's last tokens are gathered, the offsets go negative
        "score in a window": causal_lower_right()
        + SlidingWindowBias(4)
        + ModBias(score_mod=relative),
    }


@pytest.mark.parametrize(
    "name", ["mask", "score", "query positions", "draft tree", "score in a window"]
)
@pytest.mark.parametrize("length_q", [1, 3])
def test_mod_bias_reads_each_rows_own_positions(name: str, length_q: int) -> None:
    """A ModBias over a paged cache keeps FlexAttention's meaning in every row: ``kv_idx`` is
    the key's position in the row, ``q_idx`` the query's index among the row's queries."""
    k, v = pools(10, 4, 2, 16, seed=10 + length_q)
    lens = lens_of([13, 10, 6])
    pages = PagedKV(table_of([[7, 2, 9, 0], [7, 2, 4, 4], [1, 5, 0, 0]]), lens)
    table = torch.randn(4, 32, device=DEVICE)
    query = torch.randn(3, 4, length_q, 16, device=DEVICE)
    run_and_check(query, k, v, pages, _mod_parts(lens, length_q, table)[name])


@pytest.mark.parametrize("bound", [None, 4])
def test_mod_bias_reads_ragged_rows_queries(bound: int | None) -> None:
    """With ``cu_seqlens_q`` a ModBias's ``q_idx`` is the query's index among its row's (with
    ``max_seqlen_q`` too, where the rows run at fewer queries)."""
    k, v = pools(12, 4, 2, 16, seed=12)
    cu = torch.tensor([0, 4, 5, 8], dtype=I32, device=DEVICE)
    lens = lens_of([14, 6, 9])
    table = table_of([[3, 4, 5, 6], [0, 1, 0, 0], [8, 9, 10, 11]])
    pages = PagedKV(table, lens, cu_seqlens_q=cu, max_seqlen_q=bound)

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx * 2) | (kv_idx >= 5)

    query = torch.randn(1, 4, 8, 16, device=DEVICE)
    run_and_check(query, k, v, pages, ModBias(mask_mod=mask_mod))


def test_tables_written_in_place_are_read_at_each_call() -> None:
    """One bias object serves a generation: the next token's length and a new page, written
    into the same tensors, are read by the next call (and its plan is reused)."""
    k, v = pools(6, 4, 1, 8, seed=5)
    table = table_of([[0, 0], [1, 0]])
    lens = lens_of([4, 2])
    pages = PagedKV(table, lens)
    bias = pages + causal_lower_right()
    query = torch.randn(2, 1, 1, 8, device=DEVICE)
    run_and_check(query, k, v, pages, causal_lower_right())
    table[0, 1] = 5  # row 0 grows into a second page
    lens += 1
    with torch.no_grad():
        out = attnbias.sdpa(query, k, v, attn_mask=bias)
    expected = paged_attention(query, k, v, table, lens, causal_lower_right())
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_tables_are_checked_once_for_each_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers of a step share one check of the tables' values: calls with the tables as
    they were check nothing more; another query length, or a table or length written in
    place, is checked again; tables found bad raise at every call that reads them (on a GPU
    at the next eager call, here through ``check_errors``), not only at the first."""
    from attnbias import paged

    checks: list[int] = []
    problems = paged._problems

    def counted(*args: Any) -> torch.Tensor:
        checks.append(1)
        return problems(*args)

    monkeypatch.setattr(paged, "_problems", counted)
    k, v = pools(8, 4, 2, 16, seed=17)
    table = table_of([[0, 1, 2], [5, 3, 0]])
    lens = lens_of([10, 7])
    bias = PagedKV(table, lens) + causal_lower_right()
    query = torch.randn(2, 2, 1, 16, device=DEVICE)
    for _ in range(3):
        _call(bias, query, k, v)
    assert len(checks) == 1
    _call(bias, torch.randn(2, 2, 2, 16, device=DEVICE), k, v)  # two queries a row
    assert len(checks) == 2
    lens += 1
    _call(bias, query, k, v)
    table[1, 2] = 4
    _call(bias, query, k, v)
    assert len(checks) == 4
    lens[0] = 13  # beyond the row's three pages of four tokens
    for _ in range(2):
        with pytest.raises(ValueError, match="seq_lens beyond"):
            _call(bias, query, k, v)
            attnbias.check_errors()
    assert len(checks) == 6


def test_a_paged_call_explains_its_route() -> None:
    """explain names the gather and the route; with a window only each row's last tokens
    that the window can keep are gathered (the queries' span and its left side)."""
    k, v = pools(4, 4, 1, 8, seed=6)
    pages = PagedKV(table_of([[0, 1]]), lens_of([6]))
    query = torch.randn(1, 1, 2, 8, device=DEVICE)
    with attnbias.use_backends(exclude=["triton-decode", "triton"]):
        text = attnbias.explain(query, k, v, attn_mask=pages + causal_lower_right())
        assert text.startswith("PagedKV(B=1, max_pages=2): each row's pages gathered")
        assert "cache of 8 keys" in text and "key range" in text
        window = pages + causal_lower_right() + SlidingWindowBias(3)
        assert "cache of 5 keys" in attnbias.explain(query, k, v, attn_mask=window)
    with attnbias.use_backends("triton-decode"):
        text = attnbias.explain(query, k, v, attn_mask=window)
    assert text.startswith("PagedKV(B=1, max_pages=2): the kernel reads each row's last 5 "
                           "tokens in place"), text  # fmt: skip
    assert "\ntriton-decode: " in text and "the Triton decode kernel" in text, text
    # every other backend with its reasons, as for any call
    assert "\n  triton: " in text and "\n  reference: " in text, text


_IN_PLACE = {
    **{name: lambda lens, length_q, table, make=make: make() for name, make in RESTS.items()},
    **{
        f"mod {name}": lambda lens, length_q, table, name=name: _mod_parts(lens, length_q, table)[
            name
        ]
        for name in ("mask", "draft tree", "score in a window")
    },
}


@pytest.mark.parametrize("rest", list(_IN_PLACE))
@pytest.mark.parametrize(
    ("backend", "length_q"),
    [("triton-decode", 1), ("triton-decode", 3), ("triton", 1), ("triton", 6)],
)
def test_the_kernels_read_the_pages_in_place(
    rest: str, backend: str, length_q: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the decode kernel or the training kernel's forward takes the call (pinned here;
    on the CPU through Triton's interpreter), it reads each key through its row in the
    pools: nothing is gathered (a gather fails the test), and the result is the oracle's, for
    every part that composes and a ModBias reading each row's own positions (a window: only
    the last tokens mapped)."""
    _no_gathering(monkeypatch)
    k, v = pools(10, 4, 2, 16, seed=20 + length_q)
    lens = lens_of([13, 10, 6])
    pages = PagedKV(table_of([[7, 2, 9, 0], [7, 2, 4, 4], [1, 5, 0, 0]]), lens)
    table = torch.randn(4, 32, device=DEVICE)
    query = torch.randn(3, 4, length_q, 16, device=DEVICE)
    if backend == "triton" and rest in ("mod mask", "mod draft tree"):
        # mask functions: the training kernel settles their tiles by block lists over
        # contiguous keys, so that call reads the gathered cache
        monkeypatch.undo()
    with attnbias.use_backends(backend):
        run_and_check(query, k, v, pages, _IN_PLACE[rest](lens, length_q, table))


@pytest.mark.parametrize("length_q", [1, 3])
def test_a_draft_tree_over_long_rows_on_the_decode_kernel(
    length_q: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ModBias reading each row's length (a draft tree at the row's end) over rows of
    several key blocks that fill their pages: the decode kernel runs the blocks before the
    tree without the mask (the tile function reads ``lens[b]``) and the tree's block, the
    last of the full run, with it; the oracle's result."""
    _no_gathering(monkeypatch)
    k, v = pools(24, 8, 2, 16, seed=30 + length_q)
    lens = lens_of([64, 40, 64])
    order = torch.randperm(24, generator=torch.Generator().manual_seed(length_q)).tolist()
    pages = PagedKV(table_of([order[0:8], order[8:13] + [0] * 3, order[16:24]]), lens)
    query = torch.randn(3, 4, length_q, 16, device=DEVICE)
    rest = _mod_parts(lens, length_q, torch.randn(4, 32, device=DEVICE))["draft tree"]
    with attnbias.use_backends("triton-decode"):
        run_and_check(query, k, v, pages, rest)


def _hole(lens: torch.Tensor) -> ModBias:
    """A mask that drops each row's tokens ``[n - 20, n - 18)`` (``n`` its length): bounds
    the tile function takes as exact, so the blocks around the hole run unmasked."""

    def hole(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < lens[b] - 20) | (kv_idx >= lens[b] - 18)

    return ModBias(mask_mod=hole)


ONE_PAGE_RESTS = ["none", "causal", "window alibi softcap", "mod mask", "mod draft tree",
                  "mod score in a window", "mod hole"]  # fmt: skip


@pytest.mark.parametrize("rest", ONE_PAGE_RESTS)
@pytest.mark.parametrize(
    ("page_size", "length_q"), [(16, 1), (32, 3), (4, 2), (8, 1), (12, 1), (24, 2)]
)
def test_the_decode_kernel_reads_key_tiles_laid_on_pages(
    rest: str, page_size: int, length_q: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages a multiple of the decode kernel's block of keys (16 under the interpreter) or a
    divisor of it: the key tiles lie on each row's tokens, each inside one page or holding
    whole pages; pages of 12 and 24 (neither) read a row per key. Rows of several blocks whose
    lengths are no multiple of the block (the tiles then start off the positions' own grid),
    pages listed out of order, one page shared by two rows: the oracle's result for the parts
    that compose and ModBias masks that settle blocks by their bounds (a draft tree, a hole
    of two tokens at the end of the last block but one of the run kept whole)."""
    _no_gathering(monkeypatch)
    width = 96 // page_size  # pages a row: 96 tokens
    k, v = pools(3 * width, page_size, 2, 16, seed=40 + length_q)
    order = torch.randperm(3 * width, generator=torch.Generator().manual_seed(page_size))
    rows = order.reshape(3, width).tolist()
    rows[1][0] = rows[0][0]  # a shared first page (a common prefix)
    lens = lens_of([66, 37, 85])  # (row 0's hole: the end of the full run's last block but one)
    pages = PagedKV(table_of(rows), lens)
    query = torch.randn(3, 4, length_q, 16, device=DEVICE)
    if rest == "mod hole":  # (in row 0, the last 2 tokens of a block that ends the full run)
        parts = causal_lower_right() + _hole(lens)
    else:
        parts = _IN_PLACE[rest](lens, length_q, torch.randn(4, 32, device=DEVICE))
    with attnbias.use_backends("triton-decode"):
        run_and_check(query, k, v, pages, parts)


def test_a_repeated_call_plans_once_and_follows_the_backends_pinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run over the pages is kept for the identical calls after the first (no planning
    per step; new lengths and pages read at each call), and a call under other pinned
    backends is another call."""
    route = importlib.import_module("attnbias.paged")
    planned = []
    in_place = route._in_place
    monkeypatch.setattr(route, "_in_place", lambda *a: planned.append(1) or in_place(*a))
    k, v = pools(8, 4, 2, 16, seed=50)
    table = table_of([[3, 1, 0], [4, 5, 6]])
    lens = lens_of([5, 9])
    causal = causal_lower_right()
    bias = PagedKV(table, lens) + causal
    query = torch.randn(2, 4, 1, 16, device=DEVICE)

    def step() -> None:
        with torch.no_grad():
            out = attnbias.sdpa(query, k, v, attn_mask=bias, enable_gqa=True)
        expected = paged_attention(query, k, v, table, lens, causal)
        assert (out.double() - expected).abs().max().item() < 1e-5

    with attnbias.use_backends("triton-decode"):
        for index in range(3):
            step()
            lens += 1  # the next token, read by the next call
            if index == 0:
                table[0, 2] = 7
    assert len(planned) == 1, planned
    with attnbias.use_backends("reference"):
        step()
    assert len(planned) == 2, planned


def test_pools_whose_pages_are_not_one_block_are_gathered() -> None:
    """Pools whose rows cannot be viewed as one block (pages padded apart in memory) are
    read through the gather, with the same result, whatever the backend."""
    k, v = pools(8, 6, 2, 16, seed=52)
    k, v = k[:, :4], v[:, :4]  # pages of 4 tokens, 6 apart
    pages = PagedKV(table_of([[3, 1, 0], [4, 5, 6]]), lens_of([5, 9]))
    query = torch.randn(2, 4, 1, 16, device=DEVICE)
    with attnbias.use_backends("triton-decode"):
        text = attnbias.explain(query, k, v, attn_mask=pages + causal_lower_right(),
                                enable_gqa=True)  # fmt: skip
        assert "each row's pages gathered" in text, text
        run_and_check(query, k, v, pages, causal_lower_right())


def test_tables_that_are_strided_views_are_read_right() -> None:
    """A page table or lengths that are strided views (every other column or entry of a
    larger tensor) give the oracle's result: the kernels read dense rows, so such a call
    reads the gathered cache."""
    k, v = pools(8, 4, 2, 16, seed=53)
    wide = torch.zeros(2, 6, dtype=I32, device=DEVICE)
    wide[:, ::2] = table_of([[3, 1, 0], [4, 5, 6]])
    wide[:, 1::2] = 7  # entries between the table's: read them and the result is wrong
    lens = torch.tensor([5, 0, 9, 0], dtype=I32, device=DEVICE)[::2]
    pages = PagedKV(wide[:, ::2], lens)
    query = torch.randn(2, 4, 1, 16, device=DEVICE)
    with attnbias.use_backends("triton-decode"):
        run_and_check(query, k, v, pages, causal_lower_right())


@pytest.mark.parametrize("backend", ["triton-decode", "triton"])
@pytest.mark.parametrize("scale", [None, 0.0, -0.5])
def test_the_kernels_reading_pages_keep_the_numerical_contract(
    backend: str, scale: float | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read in place (a gather fails the test): NaN in every slot that holds none of a row's
    tokens (past a row's length in its last page, pages no row lists) reaches nothing, any
    finite scale (0 and negative ones) gives the oracle's result, and no query gives an
    empty output."""
    _no_gathering(monkeypatch)
    k, v = pools(8, 4, 2, 16, seed=54)
    table = table_of([[3, 1, 0], [4, 5, 6]])
    lens = lens_of([6, 9])
    used = torch.zeros(8, 4, dtype=torch.bool, device=DEVICE)
    for row, count in enumerate([6, 9]):
        for t in range(count):
            used[table[row, t // 4], t % 4] = True
    k[~used], v[~used] = float("nan"), float("nan")
    pages = PagedKV(table, lens)
    rest = causal_lower_right() + SlidingWindowBias(5)
    query = torch.randn(2, 4, 3, 16, device=DEVICE)
    with torch.no_grad(), attnbias.use_backends(backend):
        out = attnbias.sdpa(query, k, v, attn_mask=pages + rest, scale=scale, enable_gqa=True)
        empty = attnbias.sdpa(
            query[:, :, :0], k, v, attn_mask=pages + rest, scale=scale, enable_gqa=True
        )
    expected = paged_attention(query, k, v, table, lens, rest, scale=scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert empty.shape == (2, 4, 0, 16)


def test_a_call_read_in_place_is_checked_as_any_call() -> None:
    """Reading the pages in place checks the call's arguments as the call on the gathered
    cache would: more query heads than key/value heads without enable_gqa, or a dropout the
    kernels do not fuse, are refused by name (nothing silently dropped)."""
    k, v = pools(8, 4, 2, 16, seed=51)
    bias = PagedKV(table_of([[3, 1, 0], [4, 5, 6]]), lens_of([5, 9])) + causal_lower_right()
    query = torch.randn(2, 4, 1, 16, device=DEVICE)
    with torch.no_grad(), attnbias.use_backends("triton-decode"):
        with pytest.raises(ValueError, match="enable_gqa=True"):
            attnbias.sdpa(query, k, v, attn_mask=bias)
        with pytest.raises(ValueError, match="dropout"):
            attnbias.sdpa(query, k, v, attn_mask=bias, dropout_p=0.5, enable_gqa=True)


@pytest.mark.parametrize("rest", ["causal", "window alibi softcap"])
def test_backends_that_read_a_contiguous_cache_get_the_pages_gathered(rest: str) -> None:
    """The exact path (as stock SDPA and FlashAttention 4 would) reads the gathered cache."""
    k, v = pools(10, 4, 2, 16, seed=40)
    pages = PagedKV(table_of([[7, 2, 9, 0], [7, 2, 4, 4], [1, 5, 0, 0]]), lens_of([13, 10, 6]))
    query = torch.randn(3, 4, 2, 16, device=DEVICE)
    with attnbias.use_backends("reference"):
        text = attnbias.explain(query, k, v, attn_mask=pages + RESTS[rest](), enable_gqa=True)
        assert "each row's pages gathered" in text, text
        run_and_check(query, k, v, pages, RESTS[rest]())


@pytest.mark.parametrize("backend", ["triton-decode", "triton"])
def test_the_kernels_read_ragged_rows_pages_in_place(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill and decode rows packed in one query, read in place."""
    _no_gathering(monkeypatch)
    k, v = pools(12, 4, 2, 16, seed=31)
    table = table_of([[3, 4, 5, 6], [0, 1, 0, 0], [8, 9, 10, 11], [2, 0, 0, 0]])
    cu = torch.tensor([0, 5, 6, 6, 9], dtype=I32, device=DEVICE)
    pages = PagedKV(table, lens_of([14, 6, 16, 3]), cu_seqlens_q=cu)
    query = torch.randn(1, 4, 9, 16, device=DEVICE)
    with attnbias.use_backends(backend):
        run_and_check(query, k, v, pages, RESTS["window alibi softcap"]())


def test_ragged_rows_skip_the_query_tiles_before_their_queries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ragged rows run at the placed length, each row's queries at its end: the training
    kernel reading the pages visits no key for a tile of positions before a row's first
    query (its log-sum-exp there is -inf: without the skip those padding positions attend
    the row's earlier keys), and the outputs still match the oracle."""
    from attnbias.kernels import forward

    _no_gathering(monkeypatch)
    seen: list[torch.Tensor] = []
    launch = forward.ForwardPlan.launch

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = launch(self, *args, **kwargs)
        seen.append(found[1])
        return found

    monkeypatch.setattr(forward.ForwardPlan, "launch", spy)
    k, v = pools(24, 16, 2, 16, seed=41)
    table = table_of([list(range(12)), list(range(12, 24))])
    cu = torch.tensor([0, 128, 129], dtype=I32, device=DEVICE)  # a chunk and a decode row
    # the decode row holds more tokens than the placed length: its padding positions would
    # see keys (causal, lower right) if their tiles ran
    pages = PagedKV(table, lens_of([180, 170]), cu_seqlens_q=cu, max_seqlen_q=128)
    query = torch.randn(1, 4, 129, 16, device=DEVICE)
    with attnbias.use_backends("triton"):
        run_and_check(query, k, v, pages, RESTS["causal"]())
    (lse,) = seen
    assert lse.shape == (2, 4, 128)
    assert torch.isfinite(lse[0]).all()  # the chunk fills its placed positions
    assert torch.isinf(lse[1, :, 0]).all() and (lse[1, :, 0] < 0).all()
    assert torch.isfinite(lse[1, :, -1]).all()  # the decode row's one query


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("rest", ["causal", "window alibi softcap"])
def test_short_ragged_rows_run_on_the_decode_kernel_beside_longer_rows(
    rest: str, split: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk among rows of a few queries, placed longer than the decode kernel
    takes: with ``SPLIT_SHORT_ROWS``, the rows of at most ``short_queries()`` queries (here
    8: two query heads a key/value head) run on the decode kernel over every row's last 8
    placed positions, and the training kernel skips all their tiles (its ``query_starts``
    is the placed length for them); a row of 9 queries stays on the training kernel. Split
    or not, every row's output matches the oracle (a short row read from the training
    kernel's skipped tiles would be 0), and the training kernel visits no key for the short
    rows (their log-sum-exp there is -inf)."""
    from attnbias.kernels import decode, forward

    route = _no_gathering(monkeypatch)
    monkeypatch.setattr(route, "SPLIT_SHORT_ROWS", split)
    starts: list[torch.Tensor | None] = []
    tails: list[tuple[int, ...]] = []
    launch, run = forward.ForwardPlan.launch, decode.DecodePlan.run

    lses: list[torch.Tensor] = []

    def spy_forward(self: Any, *args: Any, pages: Any = None, **kwargs: Any) -> Any:
        starts.append(None if pages.query_starts is None else pages.query_starts.clone())
        found = launch(self, *args, pages=pages, **kwargs)
        lses.append(found[1].clone())
        return found

    def spy_decode(self: Any, q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tails.append(tuple(q.shape))
        return run(self, q, *args, **kwargs)

    monkeypatch.setattr(forward.ForwardPlan, "launch", spy_forward)
    monkeypatch.setattr(decode.DecodePlan, "run", spy_decode)
    k, v = pools(40, 16, 2, 16, seed=43)
    table = table_of([list(range(i * 8, i * 8 + 8)) for i in range(5)])
    counts = [70, 1, 8, 9, 0]  # a chunk, a decode row, a short row at the bound, a longer one
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=I32, device=DEVICE)
    pages = PagedKV(table, lens_of([77, 50, 33, 40, 12]), cu_seqlens_q=cu, max_seqlen_q=70)
    query = torch.randn(1, 4, sum(counts), 16, device=DEVICE)
    with attnbias.use_backends("triton-decode", "triton"):
        run_and_check(query, k, v, pages, RESTS[rest]())
        text = attnbias.explain(query, k, v, attn_mask=pages + RESTS[rest](), enable_gqa=True)
    assert route.short_queries(torch.empty(5, 4, 70, 16), k, ()) == (8 if split else 0)
    (found,) = starts
    assert found is not None
    if split:
        assert tails == [(5, 4, 8, 16)]
        assert found.tolist() == [0, 70, 70, 61, 70]
        # the training kernel visits no key for a short row, in any tile (the last one, past
        # the placed length 70 at every tile size, included): its log-sum-exp stays -inf
        (lse,) = lses
        idle = lse[[1, 2, 4]]
        assert torch.isinf(idle).all() and (idle < 0).all()
        assert torch.isfinite(lse[0]).all() and torch.isfinite(lse[3, :, -9:]).all()
        assert "rows of at most 8 queries run on the decode kernel" in text, text
    else:
        assert tails == []
        assert found.tolist() == [0, 69, 62, 61, 70]
        assert "run on the decode kernel instead" not in text, text


@given(
    counts=st.lists(st.integers(0, 7), min_size=1, max_size=9),
    bound=st.integers(1, 8),
    head_dim=st.sampled_from([8, 24]),
    packed=st.booleans(),
    padding=st.sampled_from([0, 0, 5]),
)
@pytest.mark.parametrize("kernel", [True, False])
def test_ragged_rows_are_placed_at_the_end_of_their_positions(
    kernel: bool, counts: list[int], bound: int, head_dim: int, packed: bool, padding: int
) -> None:
    """Each row's packed queries land at the last of its ``L`` placed positions (zeros
    before them), and ``where`` names each packed query's and head's flat position there,
    by the one-launch placement (``kernel``) and by tensor operations alike, for any row
    count (the placement's search over ``cu_seqlens_q``), empty rows, a head dim that is not
    a power of two, a query viewed from ``(1, total, Hq, E)`` (``packed``), and rows past
    the bound (their first queries clamped to the first position: such tables are flagged
    by the call's checks), and queries past the last row (``padding``: not placed, ``where``
    -1; their output read back is zeros)."""
    from attnbias import paged

    total, heads = sum(counts) + padding, 3
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=I32, device=DEVICE)
    if packed:
        query = torch.randn(1, total, heads, head_dim, device=DEVICE).transpose(1, 2)
    else:
        query = torch.randn(1, heads, total, head_dim, device=DEVICE)
    pages = PagedKV(table_of([[0]] * len(counts)), lens_of([8] * len(counts)), cu_seqlens_q=cu,
                    max_seqlen_q=bound)  # fmt: skip
    length = min(bound, total) if total else 1
    query[:, :, total - padding :] = float("nan")  # (no row's: never placed)
    assert paged._places_by_kernel(query) == (DEVICE == "cuda" or interpreting())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged, "_places_by_kernel", lambda _: kernel)
        placed, where = paged._placed(pages, query)
    assert where is not None
    expected = torch.zeros(len(counts), heads, length, head_dim, device=DEVICE)
    rows = torch.full((total, heads), -1, dtype=torch.int64)
    for b, count in enumerate(counts):
        for i in range(count):
            place = max(length - count + i, 0)
            if count <= length:  # (a clamped row's first position holds one of its queries)
                expected[b, :, place] = query[0, :, int(cu[b]) + i]
            rows[int(cu[b]) + i] = (b * heads + torch.arange(heads)) * length + place
    assert where.tolist() == rows.tolist()
    fits = torch.tensor([count <= length for count in counts], device=DEVICE)
    torch.testing.assert_close(placed[fits], expected[fits], rtol=0, atol=0)
    # read back: each packed query's own row of a placed output, zeros for the queries past
    out = torch.randn(*placed.shape[:3], 5, device=DEVICE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged, "_places_by_kernel", lambda _: kernel)
        taken = paged._taken(out, where)
    flat = out.reshape(-1, 5)
    for t in range(total):
        for h in range(heads):
            want = flat[rows[t, h]] if rows[t, h] >= 0 else torch.zeros(5, device=DEVICE)
            assert torch.equal(taken[0, h, t], want), (t, h)


def _call(pages: Any, query: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return attnbias.sdpa(query, k, v, attn_mask=pages)


def test_bad_tables_are_refused_naming_the_values() -> None:
    k, v = pools(4, 4, 1, 8, seed=7)
    query = torch.randn(1, 1, 2, 8, device=DEVICE)
    with pytest.raises(TypeError, match="must hold integers"):
        PagedKV(torch.zeros(1, 2), lens_of([3]))
    with pytest.raises(ValueError, match=r"shape \(B, max_pages\)"):
        PagedKV(lens_of([0, 1]), lens_of([3]))
    with pytest.raises(ValueError, match="seq_lens has 2 rows but block_table has 1"):
        PagedKV(table_of([[0, 1]]), lens_of([3, 4]))
    with pytest.raises(ValueError, match="seq_lens must be >= 0"):
        PagedKV(table_of([[0, 1]]), lens_of([-1]))
    with pytest.raises(ValueError, match="negative page index"):
        PagedKV(table_of([[0, -1]]), lens_of([3]))
    with pytest.raises(ValueError, match="B \\+ 1 = 2 entries"):
        PagedKV(table_of([[0, 1]]), lens_of([3]), cu_seqlens_q=lens_of([0, 1, 2]))
    with pytest.raises(ValueError, match="start at 0 and never decrease"):
        PagedKV(table_of([[0, 1]]), lens_of([3]), cu_seqlens_q=lens_of([1, 2]))
    # checked against the pools: at the call (on the CPU before anything runs) and by validate
    cases = [
        (PagedKV(table_of([[0, 9]]), lens_of([6])), "reads a page index outside the pools"),
        (PagedKV(table_of([[0, 1]]), lens_of([9])), "seq_lens beyond its block_table row"),
        (PagedKV(table_of([[0, 1]]), lens_of([1])), "more queries than tokens"),
    ]
    for pages, said in cases:
        with pytest.raises(ValueError, match=r"row 0\b"):
            pages.validate(k, v, query)
        if DEVICE == "cpu":
            with pytest.raises(ValueError, match=said):
                _call(pages, query, k, v)
    # a page index past the pool only where the row reads it: unread slots may hold anything
    _call(PagedKV(table_of([[0, 9]]), lens_of([4])), query, k, v)


def test_bad_calls_are_refused_naming_the_fix() -> None:
    k, v = pools(4, 4, 2, 8, seed=8)
    pages = PagedKV(table_of([[0, 1]]), lens_of([6]))
    query = torch.randn(1, 2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="causal_upper_left\\(\\) has no meaning"):
        _call(pages + causal_upper_left(), query, k, v)
    with pytest.raises(ValueError, match="is_causal=True"), torch.no_grad():
        attnbias.sdpa(query, k, v, attn_mask=pages, is_causal=True)
    with pytest.raises(ValueError, match="not supported yet"):
        _call(pages + KeyRangeBias(end=[3]), query, k, v)
    with pytest.raises(ValueError, match="BandBias"):
        _call(pages + BandBias(-4, 1), query, k, v)
    with pytest.raises(ValueError, match="at most one PagedKV"):
        _call(pages + PagedKV(table_of([[0, 1]]), lens_of([6])), query, k, v)
    with pytest.raises(ValueError, match="page pool"):
        _call(pages, query, k[0], v[0])
    with pytest.raises(ValueError, match="must share num_pages, page_size and Hkv"):
        _call(pages, query, k, v[:, :2])
    with pytest.raises(ValueError, match=r"\(B=1, Hq, L, E\)"):
        _call(pages, query.expand(2, -1, -1, -1), k, v)
    with pytest.raises(ValueError, match="forward only"):
        attnbias.sdpa(query.requires_grad_(), k, v, attn_mask=pages)
    with pytest.raises(TypeError, match="PagedKV says where each row's keys are"):
        pages.materialize(shape=(1, 2, 2, 8))
    from attnbias.testing import check_bias

    with pytest.raises(TypeError, match="paged_attention instead"):
        check_bias(pages + causal_lower_right())


@pytest.mark.gpu
@pytest.mark.parametrize("length_q", [1, 16, 200])
@pytest.mark.parametrize("rest", ["causal", "window alibi softcap"])
def test_gpu_paged_calls_match_the_oracle(rest: str, length_q: int) -> None:
    """On the GPU's routes (the decode kernel for short queries, the Triton kernel, stock SDPA
    or FlashAttention 4 for longer ones) in bf16: 8 rows of ragged lengths over pages of 16
    tokens, GQA 4/2, head dim 128."""
    gen = torch.Generator().manual_seed(length_q)
    pool_k, pool_v = (torch.randn(80, 16, 2, 128, generator=gen).cuda() for _ in range(2))
    lens = [300, 1000, 216, 555, 1024, 700, 250, 999]
    table = torch.randperm(80, generator=gen)[: 8 * 64 // 8].reshape(8, 8).repeat(1, 8)
    pages = PagedKV(table.to(I32).cuda(), lens_of(lens).cuda())
    query = torch.randn(8, 4, length_q, 128, generator=gen).cuda()
    run_and_check(query, pool_k, pool_v, pages, RESTS[rest](), dtype=torch.bfloat16)


def _captured(step: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` warmed up twice on a side stream, then captured in a CUDA graph: the graph
    and the output tensor its replays write."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.gpu
def test_gpu_a_captured_paged_step_replays_with_new_tables() -> None:
    """A decode step captured in a CUDA graph reads the tables at each replay: a new length
    and a new page written in place between replays give what an eager call gives."""
    pool_k, pool_v = pools(32, 16, 2, 64, seed=9)
    pool_k, pool_v = pool_k.cuda().bfloat16(), pool_v.cuda().bfloat16()
    table = torch.arange(16, dtype=I32, device="cuda").reshape(2, 8)
    lens = lens_of([40, 70]).cuda()
    bias = PagedKV(table, lens) + causal_lower_right() + SlidingWindowBias(32)
    query = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return attnbias.sdpa(query, pool_k, pool_v, attn_mask=bias, enable_gqa=True)

    graph, out = _captured(step)
    for _ in range(3):
        lens += 7
        table[0, 3] = 20 + int(lens[0]) % 5  # a page swapped in
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        expected = paged_attention(
            query, pool_k, pool_v, table, lens, causal_lower_right() + SlidingWindowBias(32)
        )
        assert (out.double() - expected).abs().max().item() < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mask", "score", "query positions", "draft tree"])
@pytest.mark.parametrize("length_q", [1, 16, 64])
def test_gpu_mod_bias_over_pages_matches_the_oracle(name: str, length_q: int) -> None:
    """The generated code of a ModBias over a paged cache (the decode kernel, the Triton
    kernel or FlashAttention 4) in bf16: rows of 300-1000 tokens in pages of 16."""
    gen = torch.Generator().manual_seed(length_q)
    pool_k, pool_v = (torch.randn(80, 16, 2, 64, generator=gen).cuda() for _ in range(2))
    lens = lens_of([300, 1000, 216, 555]).cuda()
    pages_table = torch.randperm(80, generator=gen)[:16].reshape(4, 4).repeat(1, 16)
    pages = PagedKV(pages_table.to(I32).cuda(), lens)
    table = torch.randn(4, 32, generator=gen).cuda()
    query = torch.randn(4, 4, length_q, 64, generator=gen).cuda()
    parts = _mod_parts(lens, length_q, table)[name]
    run_and_check(query, pool_k, pool_v, pages, parts, dtype=torch.bfloat16)


def test_a_compiled_paged_call_reads_the_tables_at_each_call() -> None:
    """Under torch.compile the tables and lengths are still read at each call: a length
    advanced in place gives what the eager call gives."""
    k, v = pools(8, 4, 2, 16, seed=13)
    table = table_of([[0, 1, 2], [5, 3, 0]])
    lens = lens_of([10, 7])
    bias = PagedKV(table, lens) + causal_lower_right()
    query = torch.randn(2, 2, 1, 16, device=DEVICE)
    compiled = torch.compile(lambda q: attnbias.sdpa(q, k, v, attn_mask=bias))
    # on the CPU the Triton kernels run interpreted, which torch.compile does not trace
    pinned = ("sdpa+mask", "reference") if DEVICE == "cpu" else ()
    with torch.no_grad(), attnbias.use_backends(*pinned):
        for _ in range(2):
            out = compiled(query)
            expected = paged_attention(query, k, v, table, lens, causal_lower_right())
            assert (out.double() - expected).abs().max().item() < 1e-5
            lens += 1


def test_pending_checks_read_only_those_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device-side checks of earlier calls are read once their copy to the host is done, a
    problem raised naming the call, and the ones still in flight kept for later."""
    from attnbias import paged

    class Event:
        def __init__(self, done: bool) -> None:
            self.done = done

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.done = True

    ok = torch.zeros(5, dtype=torch.bool)
    bad = torch.tensor([False, True, False, False, False])
    later = (ok.clone(), Event(False), "the third call")
    first, second = (ok, Event(True), "the first call"), (bad, Event(True), "the second call")
    monkeypatch.setattr(paged, "_PENDING", [first, second, later])
    with pytest.raises(ValueError, match="the second call .*seq_lens beyond"):
        paged.check_pending()
    assert len(paged._PENDING) == 1 and paged._PENDING[0] is later
    paged.check_pending(wait=True)  # the last one, waited for: nothing wrong
    assert paged._PENDING == []


@pytest.mark.parametrize("rest", ["causal", "window"])
def test_the_decode_over_pages_says_whether_a_window_evens_the_rows(
    rest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode kernel splits rows of unequal lengths into more shares; a paged call's
    window narrows every row to the window's reach, so its rows keep about as many keys each
    and the route plans the decode with ``even_rows`` (a causal call does not). The result is
    the oracle's either way."""
    decode = importlib.import_module("attnbias.kernels.decode")
    seen: list[bool] = []
    original = decode.plan_decode

    def spy(*args: Any, even_rows: bool = False, **kwargs: Any) -> Any:
        seen.append(even_rows)
        return original(*args, even_rows=even_rows, **kwargs)

    monkeypatch.setattr(decode, "plan_decode", spy)
    k, v = pools(10, 4, 2, 16, seed=31)
    lens = lens_of([13, 10, 6])
    pages = PagedKV(table_of([[7, 2, 9, 0], [7, 2, 4, 4], [1, 5, 0, 0]]), lens)
    query = torch.randn(3, 4, 1, 16, device=DEVICE)
    with attnbias.use_backends("triton-decode"):
        run_and_check(query, k, v, pages, RESTS[rest]())
    assert seen == [rest == "window"]


def test_flashattention4_paged_forms() -> None:
    """The parts FlashAttention 4's paged forward expresses, as its (causal, window_size);
    the others (soft-cap, ALiBi, a ModBias) keep the library's kernels."""
    from attnbias.paged import _fa4_form

    causal = causal_lower_right()
    assert _fa4_form(()) == (False, (None, None))
    assert _fa4_form((causal,)) == (True, (None, 0))
    assert _fa4_form((causal, SlidingWindowBias(255))) == (True, (255, 0))
    assert _fa4_form((SlidingWindowBias(7, 3), SlidingWindowBias(5, 9))) == (False, (5, 3))
    assert _fa4_form((SlidingWindowBias(7, 3), causal)) == (True, (7, 0))
    assert _fa4_form((causal, SoftcapBias(30.0))) is None
    assert _fa4_form((causal, AlibiBias(num_heads=4))) is None


def test_flashattention4_paged_is_not_taken_off_a_gpu() -> None:
    """On the CPU (or without FlashAttention 4) the paged call keeps the library's routes."""
    from attnbias.paged import _split, fa4_paged

    k, v = pools(8, 4, 2, 16, seed=3)
    pages = PagedKV(table_of([[0, 1, 2], [5, 3, 0]]), lens_of([10, 7]))
    query = torch.randn(2, 2, 200, 16, device=DEVICE)
    if DEVICE == "cpu":
        _, rest = _split(pages + causal_lower_right())
        assert fa4_paged(query, k, v, pages, rest, 4, 0.0, None, True) is None


def _fa4_paged_here() -> bool:
    from attnbias.backends import fa4

    return (
        torch.cuda.is_available()
        and fa4._installed()
        and torch.cuda.get_device_capability()[0]
        in importlib.import_module("attnbias.paged").FA4_PAGED_CAPABILITIES
    )


def _poison_shared_memory() -> None:
    """Leave NaN in the GPU's shared memory: every multiprocessor runs matrix products of NaN
    tiles, whose operands pass through shared memory, just before the call under test."""
    import triton
    import triton.language as tl

    @triton.jit
    def products(x_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr):  # type: ignore[no-untyped-def]
        rows, cols = tl.arange(0, M), tl.arange(0, N)
        a = tl.load(x_ptr + rows[:, None] * N + cols[None, :])
        b = tl.load(x_ptr + cols[:, None] * M + rows[None, :])
        acc = tl.dot(a, b)
        tl.store(out_ptr + tl.program_id(0) * M * M + rows[:, None] * M + rows[None, :], acc)

    count = torch.cuda.get_device_properties(0).multi_processor_count * 2
    nan = torch.full((128 * 128,), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = torch.empty(count, 128, 128, device="cuda", dtype=torch.float32)
    products[(count,)](nan, out, 128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("rest", ["causal", "window"])
def test_gpu_chunked_prefill_on_flashattention4_keeps_garbage_out(
    page_size: int, ragged: bool, rest: str
) -> None:
    """Chunked prefill (>= FA4_MIN_QUERIES queries a row) runs on FlashAttention 4's paged
    forward where its pages are not its key tile (16, 64 at head dim 128), and on the
    library's kernel where they are (128: FlashAttention 4 would load whole pages by TMA,
    slots past a row's length included). Slots past each row's length and the pages no row
    uses hold NaN, and so does the shared memory before the call; ragged rows are padded past
    the last row with queries of NaN: the output matches the oracle (zeros for those), finite,
    on either route."""
    if not _fa4_paged_here():
        pytest.skip("needs FlashAttention 4 on a GPU of capability 9")
    gen = torch.Generator().manual_seed(page_size + ragged)
    heads_q, heads_kv, head_dim = 8, 2, 128
    lens = [700, 1000, 333, 517]  # none a multiple of the page sizes
    per_row = -(-max(lens) // page_size)
    num_pages = per_row * len(lens) + 4
    order = torch.randperm(num_pages, generator=gen)
    table = order[: per_row * len(lens)].reshape(len(lens), per_row).to(I32)
    pool_k, pool_v = (
        torch.full((num_pages, page_size, heads_kv, head_dim), float("nan")) for _ in range(2)
    )
    for b, length in enumerate(lens):
        t = torch.arange(length)
        page, slot = table[b, t // page_size].long(), t % page_size
        for pool in (pool_k, pool_v):
            pool[page, slot] = torch.randn(length, heads_kv, head_dim, generator=gen)
    pool_k, pool_v = pool_k.cuda(), pool_v.cuda()
    queries = [200, 130, 300, 150]
    if ragged:  # padded past the last row with 37 queries of NaN (zeros out)
        cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=I32).cuda()
        pages = PagedKV(table.cuda(), lens_of(lens).cuda(), cu_seqlens_q=cu)
        query = torch.randn(1, heads_q, sum(queries) + 37, head_dim, generator=gen).cuda()
        query[:, :, sum(queries) :] = float("nan")
    else:
        pages = PagedKV(table.cuda(), lens_of(lens).cuda())
        query = torch.randn(len(lens), heads_q, 160, head_dim, generator=gen).cuda()
    parts = RESTS[rest]()
    bias = pages + parts
    said = attnbias.explain(
        query.bfloat16(), pool_k.bfloat16(), pool_v.bfloat16(), attn_mask=bias,
        enable_gqa=True,
    )  # fmt: skip
    assert ("FlashAttention 4's paged forward" in said) == (page_size != 128), said
    _poison_shared_memory()
    run_and_check(query, pool_k, pool_v, pages, parts, dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [100, 1000])
def test_gpu_a_prefill_chunk_among_decode_rows_leaves_flashattention4_below_the_mean(
    chunk: int,
) -> None:
    """Ragged rows that the library's kernels split go to FlashAttention 4's paged forward
    only from ``FA4_MIN_RAGGED_MEAN_QUERIES`` queries a row on average: one chunk of 100
    among seven decode rows (13.4 a row) stays on the library's kernels, split, one of 1000
    (125.9 a row) too, and with the bound lowered below it goes to FlashAttention 4; the
    output matches the oracle on either route."""
    if not _fa4_paged_here():
        pytest.skip("needs FlashAttention 4 on a GPU of capability 9")
    route = importlib.import_module("attnbias.paged")
    k, v = pools(8 * 80, 16, 2, 128, seed=chunk)
    table = table_of([list(range(i * 80, i * 80 + 80)) for i in range(8)])
    counts = [chunk] + [1] * 7
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=I32, device=DEVICE)
    pages = PagedKV(table, lens_of([1200, 900, 1279, 64, 700, 1000, 333, 517]), cu_seqlens_q=cu)
    query = torch.randn(1, 8, sum(counts), 128, device=DEVICE)
    parts = RESTS["causal"]()
    for bound in (route.FA4_MIN_RAGGED_MEAN_QUERIES, 100):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(route, "FA4_MIN_RAGGED_MEAN_QUERIES", bound)
            said = attnbias.explain(query.bfloat16(), k.bfloat16(), v.bfloat16(),
                                    attn_mask=pages + parts, enable_gqa=True)  # fmt: skip
            on_fa4 = bound <= sum(counts) / 8
            assert ("FlashAttention 4's paged forward" in said) == on_fa4, said
            assert ("run on the decode kernel instead" in said) == (not on_fa4), said
            run_and_check(query, k, v, pages, parts, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_flashattention4_paged_follows_the_backends_pinned_and_the_lengths() -> None:
    """Decode keeps the decode kernel; a region pinning the Triton kernel or excluding
    FlashAttention 4 keeps chunked prefill off it; a captured prefill step replays with
    lengths advanced in place as an eager call computes it."""
    if not _fa4_paged_here():
        pytest.skip("needs FlashAttention 4 on a GPU of capability 9")
    pool_k, pool_v = (t.cuda().bfloat16() for t in pools(64, 16, 2, 128, seed=21))
    table = torch.arange(64, dtype=I32, device="cuda").reshape(2, 32)
    lens = lens_of([400, 300]).cuda()
    bias = PagedKV(table, lens) + causal_lower_right()
    prefill = torch.randn(2, 8, 160, 128, device="cuda", dtype=torch.bfloat16)
    decode = prefill[:, :, :1]

    def route(query: torch.Tensor) -> str:
        return attnbias.explain(query, pool_k, pool_v, attn_mask=bias, enable_gqa=True)

    assert "FlashAttention 4's paged forward" in route(prefill)
    assert "FlashAttention 4" not in route(decode)
    for region in (attnbias.use_backends("triton"), attnbias.use_backends(exclude=["fa4"])):
        with region:
            assert "FlashAttention 4" not in route(prefill)

    def step() -> torch.Tensor:
        with torch.no_grad():
            return attnbias.sdpa(prefill, pool_k, pool_v, attn_mask=bias, enable_gqa=True)

    graph, out = _captured(step)
    for _ in range(2):
        lens += 33
        graph.replay()
        torch.cuda.synchronize()
        expected = paged_attention(prefill, pool_k, pool_v, table, lens, causal_lower_right())
        assert (out.double() - expected).abs().max().item() < 3e-2


def test_gathered_pages_runs_on_the_gathered_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``gathered_pages()`` a paged call gathers (no kernel over the pages) and still
    matches the oracle; outside it the kernels read the pages again."""
    paged = importlib.import_module("attnbias.paged")
    calls: list[int] = []
    reader = paged._reader

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return reader(*args, **kwargs)

    monkeypatch.setattr(paged, "_reader", spy)
    k, v = pools(8, 4, 2, 16, seed=5)
    pages = PagedKV(table_of([[0, 1, 2], [5, 3, 0]]), lens_of([10, 7]))
    query = torch.randn(2, 4, 2, 16, device=DEVICE)
    with paged.gathered_pages():
        run_and_check(query, k, v, pages, causal_lower_right())
        assert "gathered on the device" in attnbias.explain(
            query, k, v, attn_mask=pages + causal_lower_right(), enable_gqa=True
        )
    assert calls == []
    run_and_check(query, k, v, pages, causal_lower_right())
    assert calls


def test_nothing_made_while_capturing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor a bias makes while a CUDA graph is captured (a key range's default ends) is
    filled only when that graph is replayed: it is not kept for other calls, nor is a plan
    made then (which holds it); the same calls outside a capture keep both."""
    from attnbias import plan_cache
    from attnbias.biases import base

    bias = KeyRangeBias(start=torch.tensor([1, 0], dtype=I32))
    monkeypatch.setattr(base, "capturing_now", lambda: True)
    first = bias.bounds_on(torch.device("cpu"), 2, 6)[1]
    assert first is not bias.bounds_on(torch.device("cpu"), 2, 6)[1]
    monkeypatch.setattr(base, "capturing_now", lambda: False)
    kept = bias.bounds_on(torch.device("cpu"), 2, 6)[1]
    assert kept is bias.bounds_on(torch.device("cpu"), 2, 6)[1]
    assert kept.tolist() == [6, 6]

    spec_module = importlib.import_module("attnbias.spec")
    q = torch.randn(2, 2, 3, 8)
    plan_cache.clear()
    monkeypatch.setattr(spec_module, "capturing", lambda tensor: True)
    attnbias.sdpa(q, q, q, attn_mask=KeyRangeBias(start=torch.tensor([1, 0], dtype=I32)))
    assert len(plan_cache._ENTRIES) == 0
    monkeypatch.setattr(spec_module, "capturing", lambda tensor: False)
    attnbias.sdpa(q, q, q, attn_mask=KeyRangeBias(start=torch.tensor([1, 0], dtype=I32)))
    assert len(plan_cache._ENTRIES) == 1
    plan_cache.clear()


def test_document_ids_copied_while_capturing_are_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Document ids converted while a CUDA graph is captured are filled only when it replays:
    such a copy is not kept for other calls; one made outside a capture is."""
    from attnbias import DocumentBias
    from attnbias.biases import base, documents

    bias = DocumentBias(torch.tensor([0, 0, 1, 1], dtype=I32))
    monkeypatch.setattr(documents, "capturing_now", lambda: True)
    first = bias.ids_on(torch.device("cpu"))[0]
    assert first is not bias.ids_on(torch.device("cpu"))[0]
    monkeypatch.setattr(documents, "capturing_now", base.capturing_now)
    kept = bias.ids_on(torch.device("cpu"))[0]
    assert kept is bias.ids_on(torch.device("cpu"))[0]
    assert kept.tolist() == [[0, 0, 1, 1]]


def test_max_seqlen_q_is_checked() -> None:
    """``max_seqlen_q`` goes with ``cu_seqlens_q`` and is a positive int; a row with more
    queries than it is refused at the call (on the CPU; on a GPU at the next eager call) and
    by ``validate``, naming the row."""
    k, v = pools(8, 4, 2, 16, seed=4)
    table, lens = table_of([[0, 1, 2], [5, 3, 0]]), lens_of([10, 7])
    cu = torch.tensor([0, 3, 4], dtype=I32, device=DEVICE)
    with pytest.raises(ValueError, match="pass it with cu_seqlens_q"):
        PagedKV(table, lens, max_seqlen_q=2)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            PagedKV(table, lens, cu, max_seqlen_q=bad)  # type: ignore[arg-type]
    pages = PagedKV(table, lens, cu, max_seqlen_q=2)
    assert "at most 2 a row" in repr(pages)
    query = torch.randn(1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="row 0 has 3 queries but max_seqlen_q=2"):
        pages.validate(k, v, query)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="more queries than max_seqlen_q"):
            _call(pages + causal_lower_right(), query, k, v)


def test_the_continuous_batching_example_matches_the_oracle_at_every_step() -> None:
    """``examples/paged_continuous_batching.py`` (prompt chunks of up to 80 tokens packed with
    generating rows, pages allocated as rows grow) checks every step against the fp64 oracle
    itself; here it runs under the test's device settings (the interpreted kernels on a CPU:
    its mixed steps are placed past the decode kernel's 64 queries, so they split)."""
    import contextlib
    import io
    import runpy

    path = Path(__file__).resolve().parent.parent / "examples" / "paged_continuous_batching.py"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(str(path), run_name="__main__")
    said = printed.getvalue()
    assert "a step of [70, 1, 1, 1] queries" in said, said
    assert "rows of at most 8 queries run on the decode kernel instead" in said, said
    assert "tokens per row: [152, 10, 42, 22]" in said, said

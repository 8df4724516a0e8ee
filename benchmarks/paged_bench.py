"""Attention over a paged key/value cache (``PagedKV``): the route ``attnbias.sdpa`` takes (a
kernel reading the pages in place), the same call through the gather route (each row's pages
copied into a contiguous cache first), the same tokens already contiguous (each row's at the
end of its cache, a key range keeping them) and, where FlashAttention 4 is installed, its own
paged forward (``page_table``, ``seqused_k``, causal aligned at each row's end, its split
heuristic) and FlexAttention's paged attention (``torch.nn.attention.experimental``: its page
table and logical-to-physical block mask over the same pages, converted once to its
``(1, Hkv, pages * page, E)`` cache; compiled), as CUDA-graph replays.

B = 8 rows of 4096 to 32768 tokens (capacity 32768 a row; B = 32 and 64: those eight lengths
repeated), Hq / Hkv = 32 / 8, E = 128, bf16, ``PagedKV + causal_lower_right()`` with or without
a sliding window of 4096, with a soft-cap of 50, or with a draft tree of the L queries as a
``ModBias`` (each row's last L tokens are the nodes of a binary tree: a node keeps the row's
earlier tokens, itself and its ancestors), pages in a random order in the pool; decode (L = 1,
16) and chunked prefill (L = 512, 2048: each row's last L tokens). Each case: the largest
difference from the contiguous route's output, then ms per call (mean of two rounds, the routes
alternating) and the bytes floor (the keys and values the rows keep, read once at the device's
peak memory bandwidth: 3.35 TB/s on an H100 SXM, 4.8 TB/s on an H200; other devices use the
H100's figure and say so), and the same bytes' measured floor (half of a device-to-device copy
of them, as ``decode_bench.py`` measures its floor).

    python benchmarks/paged_bench.py
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import attnbias
from attnbias import (
    KeyRangeBias,
    ModBias,
    PagedKV,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
)

sys.path.insert(0, str(Path(__file__).parent))
from decode_bench import CAP, floor_ms, graph_ms, tree_ancestors, tree_mask

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, DTYPE = 8, 32, 8, 128, torch.bfloat16
LENGTHS = [4096, 8192, 12000, 16384, 20000, 24576, 28000, 32768]
CAPACITY = 32768
PEAK_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # the data sheets' HBM bandwidth


def peak_bandwidth() -> tuple[float, str]:
    """The device's peak memory bandwidth (bytes/s) and where the figure comes from."""
    name = torch.cuda.get_device_name()
    for model, rate in PEAK_BYTES_PER_S.items():
        if model in name:
            return rate, f"{model} data sheet"
    return PEAK_BYTES_PER_S["H100"], "H100 data sheet (device not listed)"


# (page, L, window, bias besides the causal alignment, rows)
CASES = [(16, 1, None, "causal", 8), (64, 1, None, "causal", 8), (256, 1, None, "causal", 8),
         (16, 16, None, "causal", 8), (64, 16, None, "causal", 8), (16, 1, 4095, "causal", 8),
         (256, 16, 4095, "causal", 8), (64, 512, None, "causal", 8), (64, 2048, None, "causal", 8),
         (64, 1, None, "causal", 32), (64, 1, None, "causal", 64), (64, 1, None, "softcap", 8),
         (64, 16, None, "tree", 8)]  # fmt: skip


def fa4_paged() -> Any:
    """FlashAttention 4's varlen forward (with ``page_table``), or ``None`` where it is not
    installed."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def paged_tree(nodes: int, lens: Tensor) -> Callable[..., Tensor]:
    """The ``mask_mod`` of the draft tree over a paged cache: row ``b``'s last ``nodes``
    tokens (of ``lens[b]``) are the tree's nodes, the queries; ``q_idx`` is a query's index
    among them, ``kv_idx`` a key's position in its row (as ``PagedKV`` and FlexAttention's
    paged attention give them)."""
    table = tree_ancestors(nodes, lens.device)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        cache = lens[b] - nodes
        return (kv_idx < cache) | table[q_idx, (kv_idx - cache).clamp(0, nodes - 1)]

    return mask_mod


def flex_paged(
    q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, table: torch.Tensor,
    lens: torch.Tensor, window: int | None, kind: str = "causal",
) -> Callable[[], Any]:  # fmt: skip
    """FlexAttention's paged attention over the same pages: its ``PagedAttention`` holding
    this table (each row's pages in order), the pools copied once into its cache layout, a
    block mask of the rows' logical keys (causal at each row's end, the window, the draft
    tree) converted to the physical pages, the soft-cap as its ``score_mod``;
    ``torch.compile(flex_attention)``."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, heads_q, length_q, _ = q.shape
    pages, page, heads_kv, dim = pool_k.shape
    paged = PagedAttention(pages, page, batch, device=str(q.device))
    for b, n in enumerate(((lens + page - 1) // page).tolist()):
        rows = table[b, :n].long()
        paged.page_table[b, :n] = rows
        paged.physical_to_logical[b, rows] = torch.arange(n, device=q.device)
        paged.capacity[b] = n * page
    cache_k, cache_v = (
        pool.permute(2, 0, 1, 3).reshape(1, heads_kv, pages * page, dim).contiguous()
        for pool in (pool_k, pool_v)
    )
    lens64 = lens.long()
    tree = paged_tree(length_q, lens64) if kind == "tree" else None

    def keep(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        position = lens64[b] - length_q + q_idx  # the query's position in its row
        kept = kv_idx <= position  # (the block mask spans keys past a row's length too)
        if tree is not None:
            return kept & tree(b, h, q_idx, kv_idx)
        return kept if window is None else kept & (position - kv_idx <= window)

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return CAP * torch.tanh(score / CAP)

    logical = create_block_mask(
        keep, batch, None, length_q, table.shape[1] * page, device=str(q.device),
        BLOCK_SIZE=(128, page),
    )  # fmt: skip
    mask = paged.convert_logical_block_mask(logical, kv_len=lens64)
    # one compiled kernel per case: past dynamo's recompile limit (8) it would run unfused
    torch._dynamo.reset()
    attend = torch.compile(flex_attention)

    def run() -> Any:
        return attend(
            q, cache_k, cache_v, block_mask=mask, enable_gqa=heads_q != heads_kv,
            score_mod=softcap if kind == "softcap" else None,
        )  # fmt: skip

    return run


def add_peer(
    runs: dict[str, Callable[[], Any]], name: str, make: Callable[[], Callable[[], Any]],
    where: str,
) -> None:  # fmt: skip
    """``make()``'s run timed as ``name`` where it builds and runs once; where the peer
    refuses the case, say so and time the rest."""
    try:
        run = make()
        with torch.no_grad():
            run()
    except Exception as error:
        print(f"{name} refused {where}: {error}")
        return
    runs[name] = run


def row_lengths(rows: int = BATCH) -> list[int]:
    """The token counts of ``rows`` rows: :data:`LENGTHS` repeated."""
    return [LENGTHS[b % len(LENGTHS)] for b in range(rows)]


def cache(
    page: int, length_q: int, rows: int = BATCH
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The rows of the table's cases (seeded): ``q`` ``(B, Hq, L, E)``, the pools
    ``(pages, page, Hkv, E)`` (pages in a random order), the table and the lengths, and the
    same tokens contiguous ``(B, Hkv, CAPACITY, E)``, each row's at the end of its cache
    (``B = rows``, of :func:`row_lengths`)."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    lengths = row_lengths(rows)
    need = [-(-n // page) for n in lengths]
    pages = sum(need) + 8
    order = torch.randperm(pages)
    table = torch.zeros(rows, CAPACITY // page, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = order[at : at + n].int()
        at += n
    table = table.to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    pool_k = torch.randn(pages, page, HEADS_KV, HEAD_DIM, device=device, dtype=DTYPE)
    pool_v = torch.randn_like(pool_k)
    q = torch.randn(rows, HEADS_Q, length_q, HEAD_DIM, device=device, dtype=DTYPE)
    k = torch.zeros(rows, HEADS_KV, CAPACITY, HEAD_DIM, device=device, dtype=DTYPE)
    v = torch.zeros_like(k)
    for b, n in enumerate(lengths):
        t = torch.arange(n, device=device)
        rows = table[b, t // page].long() * page + t % page
        k[b, :, CAPACITY - n :] = pool_k.reshape(-1, HEADS_KV, HEAD_DIM)[rows].transpose(0, 1)
        v[b, :, CAPACITY - n :] = pool_v.reshape(-1, HEADS_KV, HEAD_DIM)[rows].transpose(0, 1)
    return q, pool_k, pool_v, table, lens, k, v


def case(
    page: int, length_q: int, window: int | None, kind: str = "causal", rows: int = BATCH,
    peers: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """One row of the table (``kind``: ``"causal"``, ``"softcap"`` or ``"tree"`` besides the
    causal alignment; ``peers``: FlashAttention 4 and FlexAttention too, where they run)."""
    q, pool_k, pool_v, table, lens, k, v = cache(page, length_q, rows)
    extra = causal_lower_right()
    if window is not None:
        extra = extra + SlidingWindowBias(window)
    if kind == "softcap":
        extra = extra + SoftcapBias(CAP)
    bias = PagedKV(table, lens) + extra
    ranged = KeyRangeBias(start=(CAPACITY - lens).int()) + extra
    contiguous_bias = ranged
    if kind == "tree":  # the contiguous rows end at the capacity: the nodes are its last keys
        bias = bias + ModBias(mask_mod=paged_tree(length_q, lens))
        contiguous_bias = ranged + ModBias(mask_mod=tree_mask(length_q, CAPACITY))
    route = importlib.import_module("attnbias.paged")
    reader = route._reader

    def paged() -> Any:
        return attnbias.sdpa(q, pool_k, pool_v, attn_mask=bias, enable_gqa=True)

    def gathered() -> Any:
        # no kernel run over the pages (nor a kept one): the gather route
        route._reader = lambda *_: None
        try:
            return paged()
        finally:
            route._reader = reader

    def contiguous() -> Any:
        return attnbias.sdpa(q, k, v, attn_mask=contiguous_bias, enable_gqa=True)

    runs: dict[str, Callable[[], Any]] = {
        "in place": paged, "gather": gathered, "contiguous": contiguous,
    }  # fmt: skip
    if kind == "tree":
        # the contiguous cache under the paged mask's own form (each row's end read from a
        # tensor, the clamps at both ends): what the mask's form costs apart from the pages
        ends = torch.full_like(lens, CAPACITY)
        same_form = ranged + ModBias(mask_mod=paged_tree(length_q, ends))
        runs["contiguous, paged form"] = lambda: attnbias.sdpa(
            q, k, v, attn_mask=same_form, enable_gqa=True
        )
    where = f"page={page} L={length_q} window={window} {kind} B={rows}"
    peer = fa4_paged() if peers and kind != "tree" else None  # (no tree form written for it)
    if peer is not None:
        options: dict[str, Any] = {}
        if kind == "softcap":  # its own soft-cap argument
            options["softcap"] = CAP

        def fa4() -> Any:
            out = peer(
                q.transpose(1, 2), pool_k, pool_v, seqused_k=lens, page_table=table,
                causal=True, window_size=(window, 0) if window is not None else (None, None),
                num_splits=1,  # its split-KV forward is refused on Hopper
                **options,
            )  # fmt: skip
            return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

        add_peer(runs, "fa4 paged", lambda: fa4, where)
    if peers:
        add_peer(
            runs, "flex paged",
            lambda: flex_paged(q, pool_k, pool_v, table, lens, window, kind), where,
        )  # fmt: skip
    with torch.no_grad():
        outs = {name: run().float() for name, run in runs.items()}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for round_index in range(2):
            for name in list(runs) if round_index == 0 else list(runs)[::-1]:
                times[name].append(graph_ms(runs[name]))
        how = attnbias.explain(q, pool_k, pool_v, attn_mask=bias, enable_gqa=True)
    lengths = row_lengths(rows)
    kept = sum(lengths) if window is None else sum(min(n, window + length_q) for n in lengths)
    read = torch.empty(kept, HEADS_KV, HEAD_DIM, device="cuda", dtype=DTYPE)
    measured = floor_ms(read, read)  # (the copy's speed does not depend on the values)
    del read
    return {
        "page": page, "L": length_q, "window": window, "bias": kind, "B": rows,
        **{name: sum(t) / len(t) for name, t in times.items()},
        "floor": kept * HEADS_KV * HEAD_DIM * 2 * 2 / peak_bandwidth()[0] * 1e3,
        "measured floor": measured,
        "diff": max(float((outs[a] - outs["contiguous"]).abs().max()) for a in outs),
        "route": how.splitlines()[0],
    }  # fmt: skip


def main() -> None:
    rows = [case(*c) for c in CASES]
    rate, source = peak_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"floor at {rate / 1e12:.2f} TB/s ({source})")  # fmt: skip
    print(rows[0]["route"])
    print("| B | page | L | bias | in place ms | gather ms | contiguous ms | FA4 paged ms | "
          "Flex paged ms | in place / contiguous | bytes floor ms | measured floor ms | "
          "in place / measured floor | max diff |")  # fmt: skip
    print("|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        fa4, flex = (f"{r[name]:.3f}" if name in r else "-" for name in ("fa4 paged", "flex paged"))
        bias = r["bias"] if r["window"] is None else f"window {r['window']}"
        print(
            f"| {r['B']} | {r['page']} | {r['L']} | {bias} | {r['in place']:.3f} | "
            f"{r['gather']:.3f} | {r['contiguous']:.3f} | {fa4} | {flex} | "
            f"{r['in place'] / r['contiguous']:.2f} | {r['floor']:.3f} | "
            f"{r['measured floor']:.3f} | {r['in place'] / r['measured floor']:.2f} | "
            f"{r['diff']:.1e} |"
        )
    for r in rows:
        if "contiguous, paged form" in r:
            print(
                f"{r['bias']} at L = {r['L']}: the contiguous cache under the paged mask's form "
                f"(row ends read from a tensor) {r['contiguous, paged form']:.3f} ms; in place "
                f"/ that {r['in place'] / r['contiguous, paged form']:.2f}"
            )


if __name__ == "__main__":
    main()

"""Continuous batching over a paged key/value cache: each step packs the rows that still read
their prompt (a chunk of at most CHUNK tokens each) with the rows that generate (one token
each) into one ragged query, writes the new tokens' keys and values into the rows' pages
(allocated as the rows grow), and attends with one `PagedKV` bias (`cu_seqlens_q`,
`max_seqlen_q`) plus `causal_lower_right()`. The route of the first step that mixes a prompt
chunk with generating rows is printed: on a GPU, the rows of a few queries run on the decode
kernel and the longer rows on the training kernel, both reading the pages in place
(FlashAttention 4's paged forward takes steps of 128 queries a row or more on average where
it is installed). Every step is checked against the fp64 oracle, which reads the pages by
hand.

    python examples/paged_continuous_batching.py

The attention's inputs are random here (no model); a model computes each step's queries, keys
and values from the tokens the step packs.
"""

from __future__ import annotations

import torch

import attnbias
from attnbias import PagedKV, causal_lower_right
from attnbias.testing import oracle

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
heads_q, heads_kv, head_dim, page_size, num_pages = 4, 2, 32, 16, 64
CHUNK = 80  # prompt tokens a row reads per step at most
prompts = [150, 7, 41, 20]  # prompt tokens of each request
new_tokens = [2, 3, 1, 2]  # tokens each request generates
batch = len(prompts)
max_pages = -(-max(p + n for p, n in zip(prompts, new_tokens, strict=True)) // page_size)

pool_k = torch.zeros(num_pages, page_size, heads_kv, head_dim, device=device, dtype=dtype)
pool_v = torch.zeros_like(pool_k)
free_pages = torch.randperm(num_pages).tolist()  # handed out in a shuffled order
pages_of: list[list[int]] = [[] for _ in range(batch)]
lens = [0] * batch  # tokens written so far, per row
printed = False

while any(length < p + n for length, p, n in zip(lens, prompts, new_tokens, strict=True)):
    # the step's queries per row: a chunk of the prompt, one generated token, or none (done)
    counts = []
    for b in range(batch):
        if lens[b] < prompts[b]:
            counts.append(min(CHUNK, prompts[b] - lens[b]))
        else:
            counts.append(1 if lens[b] < prompts[b] + new_tokens[b] else 0)
    total = sum(counts)
    # pages for the new tokens, then their keys and values written at positions lens[b]...
    new_k = torch.randn(total, heads_kv, head_dim, device=device, dtype=dtype)
    new_v = torch.randn_like(new_k)
    pages, slots = [], []
    for b, count in enumerate(counts):
        while len(pages_of[b]) * page_size < lens[b] + count:
            pages_of[b].append(free_pages.pop())
        for t in range(lens[b], lens[b] + count):
            pages.append(pages_of[b][t // page_size])
            slots.append(t % page_size)
        lens[b] += count
    pool_k[pages, slots] = new_k
    pool_v[pages, slots] = new_v
    # the tables: each row's pages in order (unused entries point at page 0, never read)
    table = torch.zeros(batch, max_pages, dtype=torch.int32)
    for b, owned in enumerate(pages_of):
        table[b, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
    table, seq_lens = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    pages_bias = PagedKV(table, seq_lens, cu_seqlens_q=cu.to(device), max_seqlen_q=max(counts))
    bias = pages_bias + causal_lower_right()
    query = torch.randn(1, heads_q, total, head_dim, device=device, dtype=dtype)

    with torch.no_grad():
        out = attnbias.sdpa(query, pool_k, pool_v, attn_mask=bias, enable_gqa=True)
    if not printed and max(counts) > 1 and min(c for c in counts if c) == 1:
        print(f"a step of {counts} queries:")
        print(attnbias.explain(query, pool_k, pool_v, attn_mask=bias, enable_gqa=True))
        printed = True
    want = oracle.paged_attention(
        query, pool_k, pool_v, table, seq_lens, causal_lower_right(), cu_seqlens_q=cu
    )
    torch.testing.assert_close(out.double(), want, rtol=0, atol=tolerance)

print("tokens per row:", lens, "in pages", [len(owned) for owned in pages_of])

"""A serving loop over a paged key/value cache: each step writes the new token's key and value
into its row's page, advances the lengths in place and attends with one `PagedKV` bias (a
causal window and soft-cap on top). On a GPU the step is captured once in a CUDA graph and
replayed: the tables and lengths are read on the device at each replay.

    python examples/paged_decode.py
"""

from __future__ import annotations

import torch

import attnbias
from attnbias import PagedKV, SlidingWindowBias, SoftcapBias, causal_lower_right

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
batch, heads_q, heads_kv, head_dim, page_size, pages_per_row = 4, 8, 2, 64, 16, 8
num_pages = batch * pages_per_row
pool_k = torch.zeros(num_pages, page_size, heads_kv, head_dim, device=device, dtype=dtype)
pool_v = torch.zeros_like(pool_k)
# each row owns pages_per_row pages, in a shuffled order (as an allocator hands them out)
table = torch.randperm(num_pages, device=device).to(torch.int32).reshape(batch, pages_per_row)
lens = torch.tensor([17, 3, 40, 9], dtype=torch.int32, device=device)  # tokens written so far
pool_k.normal_()
pool_v.normal_()
bias = PagedKV(table, lens) + causal_lower_right() + SlidingWindowBias(31) + SoftcapBias(30.0)
query = torch.randn(batch, heads_q, 1, head_dim, device=device, dtype=dtype)
new_k = torch.randn(batch, heads_kv, head_dim, device=device, dtype=dtype)
new_v = torch.randn_like(new_k)
rows = torch.arange(batch, device=device)


@torch.no_grad()
def step() -> torch.Tensor:
    """Write each row's new token at position lens[b], then attend over lens[b] + 1 tokens."""
    page = table[rows, (lens // page_size).long()].long()
    slot = (lens % page_size).long()
    pool_k[page, slot] = new_k
    pool_v[page, slot] = new_v
    lens.add_(1)
    return attnbias.sdpa(query, pool_k, pool_v, attn_mask=bias, enable_gqa=True)


print(attnbias.explain(query, pool_k, pool_v, attn_mask=bias, enable_gqa=True).splitlines()[0])
if device == "cuda":
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and plan before capturing
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(20):
        query.normal_()  # the next token's query, written into the captured buffers
        new_k.normal_()
        new_v.normal_()
        graph.replay()
    torch.cuda.synchronize()
    attnbias.check_errors()  # the tables' device-side checks of the eager steps
else:
    for _ in range(20):
        out = step()
print("lengths after the loop:", lens.tolist(), "output", tuple(out.shape))

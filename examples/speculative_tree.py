"""Verifying a speculative-decoding draft tree in one decode step, with a ``ModBias``.

A draft model proposes a tree of tokens (each node one continuation of its parent); the target
model scores every node in one step: the ``L`` nodes are the step's queries, appended at the end
of the key/value cache. Each node attends the whole cache and, among the new tokens, only its
ancestors and itself: an ``(L, L)`` bool table the ``mask_mod`` reads from a closure.
``causal_lower_right()`` aligns the queries with the end of the cache. On a GPU the few queries
take the Triton decode kernel (the query heads of a key/value group packed into one tile, the
cache split across programs); with gradients (training on trees) the training kernel runs. On a
CPU the exact eager path runs. Both are checked against an independent float64 computation with
stock PyTorch: a softmax over the ``(L, S)`` mask written out as the cache's columns (all kept)
next to the ancestor table.

    python examples/speculative_tree.py
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnbias import AttnBias, ModBias, causal_lower_right, explain, sdpa

# node 0 is the root (the token after the cache); PARENTS[n] is node n's parent
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def ancestors_of(parents: list[int], device: str) -> Tensor:
    """``(L, L)`` bool: ``[i, j]`` is true when node ``j`` is node ``i`` or one of its
    ancestors."""
    table = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        at = node
        while at >= 0:
            table[node, at] = True
            at = parents[at]
    return table.to(device)


def tree_bias(ancestors: Tensor, length_kv: int) -> AttnBias:
    cache = length_kv - ancestors.shape[0]

    def tree_mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        node = (kv_idx - cache).clamp(min=0)
        return (kv_idx < cache) | ancestors[q_idx, node]

    return ModBias(mask_mod=tree_mask) + causal_lower_right()


def reference(q: Tensor, k: Tensor, v: Tensor, keep: Tensor) -> Tensor:
    """Attention with stock PyTorch on the keys where ``keep`` is true; a row that keeps no key
    gives 0, as attnbias's contract says."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # GQA
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)
    weights = torch.softmax(scores.masked_fill(~keep.any(-1, keepdim=True), 0.0), dim=-1)
    return (weights * keep) @ v


def max_errors(got: list[Tensor], expected: list[Tensor]) -> str:
    """The largest errors, printed; raises if one is too large for the inputs' dtype."""
    tolerance = 2e-2 if got[0].dtype == torch.bfloat16 else 1e-5  # of the largest value
    errors = [(a.double() - b).abs().max().item() for a, b in zip(got, expected, strict=False)]
    largest = [b.abs().max().item() for b in expected]
    assert all(e <= tolerance * m for e, m in zip(errors, largest, strict=False)), errors
    labels = ("out", "dq", "dk", "dv")
    return ", ".join(f"{label} {e:.1e}" for label, e in zip(labels, errors, strict=False))


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batch, heads_q, heads_kv, head_dim, cache = (
        (2, 32, 8, 128, 8192) if cuda else (1, 4, 2, 32, 512)
    )
    nodes = len(PARENTS)
    length_kv = cache + nodes
    ancestors = ancestors_of(PARENTS, device)
    bias = tree_bias(ancestors, length_kv)
    torch.manual_seed(0)
    q = torch.randn(batch, heads_q, nodes, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length_kv, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)

    grad_out = torch.randn_like(q)
    # the reference's mask written out, (L, S): every cached key, then the node's ancestors
    # and itself among the new ones; and lower-right causal
    keep = torch.cat([torch.ones(nodes, cache, dtype=torch.bool, device=device), ancestors], 1)
    i, j = torch.arange(nodes, device=device)[:, None], torch.arange(length_kv, device=device)
    keep &= j <= i + (length_kv - nodes)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = reference(*leaves, keep)
    expected = [out.detach(), *torch.autograd.grad(out, leaves, grad_out.double())]

    with torch.no_grad():
        print(
            "decode step route:", explain(q, k, v, attn_mask=bias, enable_gqa=True).splitlines()[0]
        )
        out = sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    print(f"  max error vs float64 stock PyTorch: {max_errors([out], expected)}")

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    route = explain(*leaves, attn_mask=bias, enable_gqa=True).splitlines()[0]
    print("with gradients, route:", route)
    out = sdpa(*leaves, attn_mask=bias, enable_gqa=True)
    got = [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]
    print(f"  max error vs float64 stock PyTorch: {max_errors(got, expected)}")


if __name__ == "__main__":
    main()

"""Verifying a speculative-decoding draft tree in one decode step, with a ``ModBias``.

A draft model proposes a tree of tokens (each node one continuation of its parent); the target
model scores every node in one step: the ``L`` nodes are the step's queries, appended at the end
of the key/value cache. Each node attends the whole cache and, among the new tokens, only its
ancestors and itself: an ``(L, L)`` bool table the ``mask_mod`` reads from a closure.
``causal_lower_right()`` aligns the queries with the end of the cache. On a GPU the few queries
take the Triton decode kernel (the query heads of a key/value group packed into one tile, the
cache split across programs); with gradients (training on trees) the training kernel runs. On a
CPU the exact eager path runs. Both are checked against the exact path.

    python examples/speculative_tree.py
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnbias import AttnBias, ModBias, causal_lower_right, explain, sdpa, use_backends

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


def max_errors(got: list[Tensor], expected: list[Tensor]) -> str:
    return ", ".join(
        f"{label} {(a.double() - b.double()).abs().max().item():.1e}"
        for label, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=False)
    )


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batch, heads_q, heads_kv, head_dim, cache = (
        (2, 32, 8, 128, 8192) if cuda else (1, 4, 2, 32, 512)
    )
    nodes = len(PARENTS)
    length_kv = cache + nodes
    bias = tree_bias(ancestors_of(PARENTS, device), length_kv)
    torch.manual_seed(0)
    q = torch.randn(batch, heads_q, nodes, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length_kv, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)

    with torch.no_grad():
        print(
            "decode step route:", explain(q, k, v, attn_mask=bias, enable_gqa=True).splitlines()[0]
        )
        out = sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
        with use_backends("reference"):
            expected = sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    print(f"  max error vs the exact path: {max_errors([out], [expected])}")

    grad_out = torch.randn_like(q)

    def run() -> list[Tensor]:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = sdpa(*leaves, attn_mask=bias, enable_gqa=True)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]

    leaf = q.detach().requires_grad_()
    route = explain(leaf, k, v, attn_mask=bias, enable_gqa=True).splitlines()[0]
    print("with gradients, route:", route)
    got = run()
    with use_backends("reference"):
        expected_all = run()
    print(f"  max error vs the exact path: {max_errors(got, expected_all)}")


if __name__ == "__main__":
    main()

"""Gradients of the FlashAttention 4 score modifiers (ALiBi, soft-cap) against the library's
float32 eager path, by shape: MHA or GQA, L = S or not. Prints the max error of out, dq, dk, dv."""

from __future__ import annotations

import torch

import attnbias
from attnbias import AlibiBias, SoftcapBias, causal_lower_right
from attnbias.reference import reference_attention


def run(heads_q, heads_kv, length_q, length_kv, kind):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    q = torch.randn(1, heads_q, length_q, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, heads_kv, length_kv, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    g = torch.randn_like(q)
    alibi = AlibiBias(num_heads=heads_q)
    bias = causal_lower_right() + (alibi if kind == "alibi" else SoftcapBias(5.0))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with attnbias.use_backends("fa4"):
        out = attnbias.sdpa(*leaves, attn_mask=bias, enable_gqa=heads_q != heads_kv)
    out.backward(g)
    ref_leaves = [t.float().clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_leaves, bias, enable_gqa=heads_q != heads_kv)
    ref.backward(g.float())
    errors = [(out.float() - ref).abs().max().item()]
    errors += [
        (a.grad.float() - b.grad).abs().max().item()
        for a, b in zip(leaves, ref_leaves, strict=True)
    ]
    print(f"| {kind} | Hq={heads_q} Hkv={heads_kv} L={length_q} S={length_kv} | "
          + " | ".join(f"{e:.2e}" for e in errors) + " |")  # fmt: skip


if __name__ == "__main__":
    for kind in ("alibi", "softcap"):
        for shape in ((4, 4, 256, 256), (4, 4, 200, 456), (4, 2, 256, 256), (4, 2, 200, 456)):
            try:
                run(*shape, kind)
            except Exception as exc:
                print(kind, shape, "ERROR", type(exc).__name__, str(exc)[:300])

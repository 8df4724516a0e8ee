"""Soft-cap in FlashAttention 4: its ``softcap=`` argument against the library's score
modifier, which multiplies by the cap's reciprocal instead of dividing. Times forward and
forward + backward at S = 16384 (bf16, H = 16, E = 128, causal) on the GPU; prints the errors
against float32 eager attention and the times."""

from __future__ import annotations

import torch
from flash_attn.cute import flash_attn_func
from triton.testing import do_bench

from attnbias import SoftcapBias, causal_upper_left
from attnbias.backends.fa4 import _softcap_score_mods
from attnbias.reference import reference_attention

CAP = 50.0


def main() -> None:
    torch.manual_seed(0)
    shape = (1, 16384, 16, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q = (q * 4).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    grad = torch.randn_like(q)
    mod, mod_bwd = _softcap_score_mods(CAP)
    variants = {
        "softcap=": dict(softcap=CAP),
        "score_mod": dict(score_mod=mod, score_mod_bwd=mod_bwd),
    }
    small = [t[:, :2048].detach().clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(
        *(t.detach().float().transpose(1, 2) for t in small),
        SoftcapBias(CAP) + causal_upper_left(),
    ).transpose(1, 2)
    rows = []
    for name, options in variants.items():
        out = flash_attn_func(*small, causal=True, **options)[0]
        error = (out.float() - ref).abs().max().item()
        fwd = lambda o=options: flash_attn_func(q, k, v, causal=True, **o)[0]
        fwd_bwd = lambda f=fwd: f().backward(grad)
        times = []
        for fn in (fwd, fwd_bwd):
            fn()
            times.append(do_bench(fn, warmup=100, rep=500, return_mode="median"))
        rows.append((name, error, *times))
    for name, error, fwd_ms, fb_ms in rows:
        print(f"| {name} | err {error:.2e} | fwd {fwd_ms:.3f} ms | f+b {fb_ms:.3f} ms |")


if __name__ == "__main__":
    main()

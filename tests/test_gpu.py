"""Real sizes on the GPU through ``attnbias.sdpa``, eager and under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_close_to_oracle, attention, run_with_grads

import attnbias
from attnbias import (
    AlibiBias,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    causal_upper_left,
    sdpa,
)

pytestmark = pytest.mark.gpu


def biases(heads: int, length_q: int, length_kv: int) -> dict[str, attnbias.AttnBias]:
    docs = DocumentBias.from_seqlens(
        [length_q // 2, length_q // 4, length_q - length_q // 2 - length_q // 4],
        [length_kv // 3, length_kv // 3, length_kv - 2 * (length_kv // 3)],
        device="cuda",
    )
    return {
        "causal_lower_right": causal_lower_right(),
        "window": SlidingWindowBias(255),
        "documents_causal": docs + causal_lower_right(),
        "alibi_causal": AlibiBias(num_heads=heads) + causal_upper_left(),
        "softcap_causal": SoftcapBias(20.0) + causal_upper_left(),
        "gemma2": SlidingWindowBias(300) + SoftcapBias(30.0) + causal_lower_right(),
    }


NAMES = [
    "causal_lower_right",
    "window",
    "documents_causal",
    "alibi_causal",
    "softcap_causal",
    "gemma2",
]


def check(bias, dtype, batch, heads_q, heads_kv, length_q, length_kv, head_dim, fn=sdpa):  # type: ignore[no-untyped-def]
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(dtype)

    q = draw(batch, heads_q, length_q, head_dim)
    k = draw(batch, heads_kv, length_kv, head_dim)
    v = draw(batch, heads_kv, length_kv, head_dim)
    grad_out = draw(batch, heads_q, length_q, head_dim)
    gqa = heads_q != heads_kv
    route = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=gqa)
    # lower-right causal with L == S is plain causal, which stays on stock SDPA's fused kernel
    assert route.startswith("triton") or route.startswith("sdpa(is_causal=True)"), route
    results = run_with_grads(lambda *t: fn(*t, attn_mask=bias, enable_gqa=gqa), (q, k, v), grad_out)
    expected = run_with_grads(
        lambda *t: attention(*t, bias, enable_gqa=gqa),
        (q.double(), k.double(), v.double()),
        grad_out.double(),
    )
    low = run_with_grads(
        lambda *t: attention(*t, bias, enable_gqa=gqa, dtype=dtype), (q, k, v), grad_out
    )
    assert_close_to_oracle(results, expected, low, dtype, ("out", "dq", "dk", "dv"))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_biases_at_real_size(name: str, dtype: torch.dtype) -> None:
    check(biases(8, 1024, 1024)[name], dtype, 2, 8, 2, 1024, 1024, 128)


@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize(("length_q", "length_kv"), [(1000, 1000), (300, 1100), (1100, 700)])
def test_head_dims_and_lengths(head_dim: int, length_q: int, length_kv: int) -> None:
    for name, bias in biases(4, length_q, length_kv).items():
        if name in ("window", "gemma2", "documents_causal"):
            check(bias, torch.bfloat16, 1, 4, 4, length_q, length_kv, head_dim)


@pytest.mark.parametrize("name", NAMES)
def test_torch_compile_fullgraph(name: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(sdpa, fullgraph=True)
    check(biases(8, 512, 512)[name], torch.bfloat16, 2, 8, 4, 512, 512, 64, fn=compiled)

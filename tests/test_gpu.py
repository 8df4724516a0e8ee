"""Real sizes on the GPU through ``attnbias.sdpa``, eager and under ``torch.compile``.

``slow`` marks the compile tests (minutes of compilation); ``-m "gpu and not slow"`` is the fast
tier. Where FlashAttention 4 is installed, every bias it takes is checked on it too.
"""

from __future__ import annotations

import pytest
import torch

import attnbias
from attnbias import (
    AlibiBias,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    causal_upper_left,
    sdpa,
    use_backends,
)
from attnbias.backends.fa4 import _installed as fa4_installed
from attnbias.biases import parts_of
from attnbias.testing.oracle import (
    assert_call_close,
    assert_close_to_oracle,
    assert_shard_pair_close,
    attention,
    flash_rounding,
    run_with_grads,
    whole_call,
)

pytestmark = pytest.mark.gpu
KERNEL_ROUTES = ("triton", "sdpa(is_causal=True)", "fa4")
needs_fa4 = pytest.mark.skipif(
    not (torch.cuda.is_available() and fa4_installed()),
    reason="FlashAttention 4 (flash_attn.cute) is not installed",
)


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


def check(
    bias,
    dtype,
    batch,
    heads_q,
    heads_kv,
    length_q,
    length_kv,
    head_dim,
    fn=sdpa,
    routes=KERNEL_ROUTES,
    rows_first=False,
):  # type: ignore[no-untyped-def]
    """Twice, on new contents: the second call runs on the decision the first one cached.
    ``rows_first``: the tensors ``(B, L, H, E)`` in memory, as projections leave them."""
    for seed in (0, 1):
        check_once(
            bias, dtype, batch, heads_q, heads_kv, length_q, length_kv, head_dim, fn, routes, seed,
            rows_first,
        )  # fmt: skip


def check_once(
    bias, dtype, batch, heads_q, heads_kv, length_q, length_kv, head_dim, fn, routes, seed,
    rows_first=False,
):  # type: ignore[no-untyped-def]  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(batch: int, heads: int, length: int, dim: int) -> torch.Tensor:
        if rows_first:
            x = torch.randn(batch, length, heads, dim, device="cuda", generator=gen)
            return x.to(dtype).transpose(1, 2)
        return torch.randn(batch, heads, length, dim, device="cuda", generator=gen).to(dtype)

    q = draw(batch, heads_q, length_q, head_dim)
    k = draw(batch, heads_kv, length_kv, head_dim)
    v = draw(batch, heads_kv, length_kv, head_dim)
    grad_out = draw(batch, heads_q, length_q, head_dim)
    gqa = heads_q != heads_kv
    route = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=gqa)
    assert route.split(":")[0] in routes, route
    # every route here is a flash-attention kernel: its own rounding is part of the budget
    rounding = flash_rounding(q, k, v, bias, grad_out)
    assert_call_close(
        lambda *t: fn(*t, attn_mask=bias, enable_gqa=gqa),
        bias, (q, k, v), grad_out, enable_gqa=gqa, rounding=rounding,
    )  # fmt: skip


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


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_torch_compile_fullgraph(name: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(sdpa, fullgraph=True)
    # FlashAttention 4 cannot be traced: a compiled call takes the Triton kernel
    check(biases(8, 512, 512)[name], torch.bfloat16, 2, 8, 4, 512, 512, 64, fn=compiled)


def key_range_biases(heads: int, length_q: int, length_kv: int) -> dict[str, attnbias.AttnBias]:
    """Key ranges of two batch rows, ends off every tile edge, alone and in sums."""
    start = torch.tensor([37, 0], device="cuda")
    end = torch.tensor([length_kv, length_kv - 301], device="cuda")
    docs = DocumentBias.from_seqlens(
        [length_q // 2, length_q - length_q // 2],
        [length_kv // 3, length_kv - length_kv // 3],
        device="cuda",
    )
    return {
        "left_padding": KeyRangeBias(start=start),
        "cache_causal": KeyRangeBias(end=end) + causal_lower_right(),
        "padding_gemma2": (
            KeyRangeBias(start, end) + SlidingWindowBias(255) + SoftcapBias(30.0)
            + causal_lower_right()
        ),
        "padding_documents": KeyRangeBias(start, end) + docs + causal_lower_right(),
        "padding_alibi": (
            KeyRangeBias(start, end) + AlibiBias(num_heads=heads) + causal_upper_left()
        ),
        "one_row_empty": (
            KeyRangeBias(start=[100, 0], end=[100, length_kv]) + causal_lower_right()
        ),
    }  # fmt: skip


KEY_RANGE_NAMES = [
    "left_padding",
    "cache_causal",
    "padding_gemma2",
    "padding_documents",
    "padding_alibi",
    "one_row_empty",
]


@pytest.mark.parametrize("name", KEY_RANGE_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_key_ranges_at_real_size(name: str, dtype: torch.dtype) -> None:
    bias = key_range_biases(8, 1000, 1100)[name]
    check(bias, dtype, 2, 8, 2, 1000, 1100, 128, routes=("triton",))


@pytest.mark.parametrize("name", KEY_RANGE_NAMES)
def test_key_ranges_read_nothing_outside(name: str) -> None:
    """NaN in every key and Inf in every value outside the ranges: each output and gradient
    equals bit for bit that of the same call with zeros there."""
    length_q, length_kv = 1000, 1100
    bias = key_range_biases(8, length_q, length_kv)[name]
    keep = torch.ones(2, length_kv, dtype=torch.bool, device="cuda")
    for part in parts_of(bias):
        if isinstance(part, KeyRangeBias):
            mask = part.materialize("cuda", shape=(2, 1, length_q, length_kv))
            keep &= torch.isfinite(mask[:, 0, 0, :])
    outside = ~keep[:, None, :, None]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, grad_out = (
        torch.randn(2, 8, length_q, 128, device="cuda", generator=gen).bfloat16() for _ in range(2)
    )
    k, v = (
        torch.randn(2, 2, length_kv, 128, device="cuda", generator=gen).bfloat16() for _ in range(2)
    )

    def run(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        return run_with_grads(
            lambda *t: sdpa(*t, attn_mask=bias, enable_gqa=True), (q, k, v), grad_out
        )

    dirty = run(k.masked_fill(outside, float("nan")), v.masked_fill(outside, float("inf")))
    clean = run(k.masked_fill(outside, 0.0), v.masked_fill(outside, 0.0))
    for label, got, want in zip(("out", "dq", "dk", "dv"), dirty, clean, strict=True):
        assert torch.equal(got, want), label
    assert (dirty[2].masked_select(outside) == 0).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", KEY_RANGE_NAMES)
def test_key_ranges_under_torch_compile_fullgraph(name: str) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(sdpa, fullgraph=True)
    bias = key_range_biases(8, 512, 512)[name]
    check(bias, torch.bfloat16, 2, 8, 4, 512, 512, 64, fn=compiled, routes=("triton",))


FA4_BIASES = {
    "causal_upper_left": lambda: causal_upper_left(),
    "causal_lower_right": lambda: causal_lower_right(),
    "window": lambda: SlidingWindowBias(255),
    "window_causal": lambda: SlidingWindowBias(300) + causal_lower_right(),
    "bidirectional": lambda: SlidingWindowBias(100, 37),
    # with L < S, upper-left causal is a window whose right side is negative
    "window_upper_left": lambda: SlidingWindowBias(500) + causal_upper_left(),
    "softcap_causal": lambda: SoftcapBias(20.0) + causal_upper_left(),
    "gemma2": lambda: SlidingWindowBias(300) + SoftcapBias(30.0) + causal_lower_right(),
    "softcap": lambda: SoftcapBias(30.0),
    "alibi_causal": lambda: AlibiBias(num_heads=8) + causal_lower_right(),
    "alibi_window": lambda: (
        AlibiBias(slopes=torch.linspace(0.01, 0.5, 8)) + SlidingWindowBias(90, 40)
    ),
}


@needs_fa4
@pytest.mark.parametrize("name", list(FA4_BIASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fa4_biases(name: str, dtype: torch.dtype) -> None:
    # FlashAttention 4 takes ALiBi without grouped-query attention only
    heads_kv = 8 if name.startswith("alibi") else 2
    with use_backends("fa4"):
        check(FA4_BIASES[name](), dtype, 2, 8, heads_kv, 700, 1100, 128, routes=("fa4",))


@needs_fa4
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("length_q", "length_kv"), [(1000, 1000), (300, 1100), (1100, 700)])
def test_fa4_head_dims_and_lengths(head_dim: int, length_q: int, length_kv: int) -> None:
    # L > S under lower-right causal leaves the first L - S rows with no key: 0, finite grads
    for name in ("causal_lower_right", "window_causal", "gemma2", "bidirectional"):
        with use_backends("fa4"):
            check(FA4_BIASES[name](), torch.bfloat16, 1, 4, 4, length_q, length_kv, head_dim,
                  routes=("fa4",))  # fmt: skip


FA4_DOCUMENTS = {
    "packed_causal": (lambda: [300, 41, 500, 183], None, causal_lower_right, 1024, 1024),
    "packed_window": (lambda: [700, 1, 323], None, lambda: SlidingWindowBias(64), 1024, 1024),
    "packed_bidirectional": (lambda: [129, 895], None, lambda: None, 1024, 1024),
    # a chunk of new queries at the end of each document's keys (same offset for each)
    "suffix_queries": (lambda: [100, 200], lambda: [700, 200], causal_lower_right, 300, 900),
}


@needs_fa4
@pytest.mark.parametrize("name", list(FA4_DOCUMENTS))
def test_fa4_documents(name: str) -> None:
    q_lengths, kv_lengths, band, length_q, length_kv = FA4_DOCUMENTS[name]
    docs = DocumentBias.from_seqlens(
        q_lengths(), None if kv_lengths is None else kv_lengths(), device="cuda"
    )
    extra = band()
    bias = docs if extra is None else docs + extra
    with use_backends("fa4"):
        check(bias, torch.bfloat16, 1, 8, 2, length_q, length_kv, 128, routes=("fa4",))


@needs_fa4
def test_fa4_documents_of_several_batch_rows() -> None:
    # each row its own documents (ids of shape (B, L)), then one layout for every row
    ids = [[0] * 300 + [1] * 724, [5] * 1024, [2] * 10 + [3] * 14 + [4] * 1000]
    per_row = DocumentBias(torch.tensor(ids, device="cuda")) + causal_lower_right()
    shared = DocumentBias.from_seqlens([700, 1, 323], device="cuda") + SlidingWindowBias(64)
    with use_backends("fa4"):
        check(per_row, torch.bfloat16, 3, 8, 2, 1024, 1024, 128, routes=("fa4",), rows_first=True)
        check(shared, torch.float16, 2, 4, 4, 1024, 1024, 64, routes=("fa4",), rows_first=True)


@pytest.mark.parametrize(("rows_first", "heads_kv"), [(False, 8), (True, 2)])
def test_equal_documents_as_separate_sequences_of_stock_sdpa(
    rows_first: bool, heads_kv: int
) -> None:
    # chunked attention: documents of one length run as a batch of sequences (a view)
    chunks = DocumentBias.from_seqlens([256] * 4, device="cuda") + causal_upper_left()
    bidirectional = DocumentBias.from_seqlens([128] * 8, device="cuda")
    routes = ("sdpa(documents as sequences)",)
    with use_backends("sdpa"):
        for bias, dtype in ((chunks, torch.bfloat16), (bidirectional, torch.float16)):
            shape = (2, 8, heads_kv, 1024, 1024, 128)
            check(bias, dtype, *shape, routes=routes, rows_first=rows_first)


def test_chunked_attention_takes_stock_sdpa_where_fa4s_host_time_would_show() -> None:
    # chunks of 1024 at S=16384 (measured: cuDNN 0.16 / 0.76 ms forward / with backward, FA4's
    # variable-length kernel 0.21 / 1.04); chunks of 4096 keep FlashAttention 4 where installed
    q = torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    small = DocumentBias.from_seqlens([1024] * 16, device="cuda") + causal_upper_left()
    assert attnbias.explain(q, q, q, attn_mask=small).startswith("sdpa(documents as sequences)")
    large = DocumentBias.from_seqlens([4096] * 4, device="cuda") + causal_upper_left()
    route = attnbias.explain(q, q, q, attn_mask=large)
    assert route.startswith("fa4:" if fa4_installed() else "sdpa(documents"), route


@needs_fa4
def test_fa4_is_chosen_where_the_priority_list_says() -> None:
    # large enough that the GPU's time, not FlashAttention 4's host time, decides
    q = torch.randn(1, 16, 8192, 128, device="cuda", dtype=torch.bfloat16)
    docs = DocumentBias.from_seqlens([3000, 5192], device="cuda")
    gemma2 = SlidingWindowBias(4095) + SoftcapBias(30.0) + causal_lower_right()
    for bias in (SlidingWindowBias(4095), causal_upper_left(), gemma2, docs):
        assert attnbias.explain(q, q, q, attn_mask=bias).startswith("fa4:")
    # ALiBi: the Triton kernel's forward is as fast; FlashAttention 4's backward is faster
    alibi = AlibiBias(num_heads=16) + causal_lower_right()
    assert attnbias.explain(q, q, q, attn_mask=alibi).startswith("triton:")
    leaf = q.detach().requires_grad_()
    assert attnbias.explain(leaf, leaf, leaf, attn_mask=alibi).startswith("fa4:")
    # documents of several batch rows: one variable-length batch of every row's documents,
    # where the rows flatten as views; (B, H, L, E) memory would be copied: the Triton kernel
    q2 = torch.randn(2, 8192, 16, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert attnbias.explain(q2, q2, q2, attn_mask=docs).startswith("fa4:")
    q2 = q2.contiguous()
    assert attnbias.explain(q2, q2, q2, attn_mask=docs).startswith("triton:")


@needs_fa4
def test_a_tiny_call_does_not_pay_fa4s_host_time() -> None:
    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    text = attnbias.explain(q, q, q, attn_mask=SlidingWindowBias(31))
    assert text.startswith("triton:"), text
    assert "triton before fa4: predicted" in text and "predicted per call: fa4" in text
    # with gradients: stock SDPA's causal call, whose backward costs the host the least
    leaf = q.detach().requires_grad_()
    text = attnbias.explain(leaf, leaf, leaf, attn_mask=causal_upper_left())
    assert text.startswith("sdpa(is_causal=True):"), text
    assert "sdpa before fa4: predicted" in text


@needs_fa4
def test_fa4_refuses_double_backward() -> None:
    q = torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with use_backends("fa4"):
        out = sdpa(q, q, q, attn_mask=SlidingWindowBias(31))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.float().square().sum(), q, create_graph=True)


@needs_fa4
@pytest.mark.parametrize("name", ["causal", "window_softcap", "alibi_causal"])
def test_fa4_gives_a_shard_pair_what_the_exact_path_does(name: str) -> None:
    """Context parallelism's shard pair on FlashAttention 4: its output and log-sum-exp, and
    its share of a merged output's gradients (given the whole call's output and log-sum-exp)
    within the oracle's budget."""
    from attnbias.backends.registry import BACKENDS
    from attnbias.biases.band import BandBias
    from attnbias.spec import make_spec
    from attnbias.terms import Block, Call

    make_bias, heads_kv = {
        "causal": (causal_lower_right, 2),
        # keys i - 100 ..= i + 200: in the pair (the last keys) rows 0..183 keep nothing
        "window_softcap": (lambda: BandBias(-100, 200) + SoftcapBias(5.0), 1),
        "alibi_causal": (lambda: AlibiBias(num_heads=8) + causal_lower_right(), 8),
    }[name]
    batch, heads_q, length_q, length_kv, split = 2, 8, 384, 896, 384
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, grad_out = (
        torch.randn(batch, heads_q, length_q, 128, device="cuda", generator=gen) for _ in "qg"
    )
    k, v = (
        torch.randn(batch, heads_kv, length_kv, 128, device="cuda", generator=gen) for _ in "kv"
    )
    bias = make_bias()
    merged_out, merged_lse = whole_call(q, k, v, bias)
    keys = length_kv - split  # the pair: every query against the last keys
    pair = bias.sub_block(
        Call(batch, heads_q, length_q, length_kv), Block(0, split, length_q, keys)
    )
    inputs = [t.to(torch.bfloat16) for t in (q, k[:, :, split:], v[:, :, split:])]
    spec = make_spec(*inputs, pair, False, None, 0.0, True, needs_lse=True)
    assert BACKENDS["fa4"].not_supported_reasons(spec) == []
    out, lse = BACKENDS["fa4"].forward_lse(spec)
    dq, dk, dv, _ = BACKENDS["fa4"].backward_lse(
        spec, grad_out.to(torch.bfloat16), merged_out.to(torch.bfloat16), merged_lse, []
    )
    empty = assert_shard_pair_close(
        [out, lse, dq, dk, dv], q, k, v, bias, slice(split, None), grad_out, torch.bfloat16
    )
    assert bool(empty.any()) == (name == "window_softcap")


# ModBias functions on FlashAttention 4: generated callbacks and block sparsity (Hopper)
def _fa4_mod_biases() -> dict[str, attnbias.AttnBias]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from chunked_local import ChunkedLocal
    from custom_bias import PrefixLM
    from neighbourhood_2d import Neighbourhood2D
    from t5_bias import T5Bias

    generator = torch.Generator(device="cuda").manual_seed(0)
    table = 2 * torch.randn(8, 32, device="cuda", generator=generator)  # no grad: FA4 gives none
    cuts = torch.tensor([300, 700], device="cuda")
    docs = torch.bucketize(torch.arange(1024, device="cuda"), cuts, right=True)[None].repeat(2, 1)

    def document_causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    def soft_cap(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return 20.0 * torch.tanh(score / 20.0)

    return {
        "prefix_lm": PrefixLM(256),
        "chunked_local": ChunkedLocal(256),
        "neighbourhood_2d": Neighbourhood2D(32, 32, 7, 7),
        "t5_causal": T5Bias(table) + causal_lower_right(),
        "flex_port": ModBias(mask_mod=document_causal, score_mod=soft_cap),
        "prefix_lm_window_softcap": PrefixLM(256) + SlidingWindowBias(300) + SoftcapBias(30.0),
    }


FA4_MOD_NAMES = [
    "prefix_lm",
    "chunked_local",
    "neighbourhood_2d",
    "t5_causal",
    "flex_port",
    "prefix_lm_window_softcap",
]


@needs_fa4
@pytest.mark.usefixtures("generated_mods")  # the chunked mask as its callbacks, not documents
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("name", FA4_MOD_NAMES)
def test_fa4_mod_biases(name: str, head_dim: int) -> None:
    """Each example bias (and a sum with built-ins) on FlashAttention 4, pinned: forward and
    the gradients of q, k and v within the oracle's budget, and explain names it. The T5 table
    reads the heads: no GQA there (FlashAttention 4's backward hands score callbacks packed
    indices under GQA, so such calls stay on the Triton kernel)."""
    bias = _fa4_mod_biases()[name]
    heads_kv = 8 if name in ("t5_causal",) else 2
    q = torch.randn(2, 8, 1024, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, heads_kv, 1024, head_dim, device="cuda", dtype=torch.bfloat16)
    text = attnbias.explain(q, k, k, attn_mask=bias, enable_gqa=heads_kv != 8)
    if torch.cuda.get_device_capability()[0] == 9:
        assert text.startswith("fa4:"), text
    with use_backends("fa4"):
        check(bias, torch.bfloat16, 2, 8, heads_kv, 1024, 1024, head_dim, routes=("fa4",))


@pytest.mark.parametrize("routed", ["kept outside", "control: made in place"])
def test_kept_tensors_lie_outside_a_memory_pool_the_call_is_routed_to(
    routed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call made while the thread's allocations are routed to a memory pool (as
    transformers' continuous batching warms up each step it captures, in the pool its CUDA
    graphs share) keeps what it keeps (ALiBi's slopes, a key range's default ends, the decode
    kernel's split counters, a mask function's block lists) outside that pool, where no
    graph's replay writes; the control,
    with kept tensors made in place, shows that the check finds them in the pool. Outputs
    match the oracle either way."""
    import attnbias.biases.base as base
    from attnbias.kernels import blocks, masks
    from attnbias.kernels import decode as decode_kernels

    if routed.startswith("control"):
        for module in (base, decode_kernels, blocks):
            monkeypatch.setattr(module, "outside_pools", lambda make: make())
    decode_kernels._SCRATCH.clear()
    masks._MOD_LISTS.clear()
    generator = torch.Generator(device="cuda").manual_seed(0)
    heads = 8
    pool = torch.cuda.MemPool()
    kept: list[torch.Tensor] = []
    for length_q, length_kv in ((64, 320), (1, 8192)):  # a prefill call, a split decode call
        q = torch.randn(2, heads, length_q, 64, device="cuda", generator=generator)
        k, v = (torch.randn(2, heads, length_kv, 64, device="cuda", generator=generator)
                for _ in range(2))  # fmt: skip
        q, k, v = (t.half() for t in (q, k, v))
        alibi = AlibiBias(num_heads=heads)
        starts = torch.tensor([5, 40], dtype=torch.int32, device="cuda")
        key_range = KeyRangeBias(start=starts, end=None)
        bias = causal_lower_right() + alibi + key_range
        with torch.no_grad(), torch.cuda.use_mem_pool(pool):
            out = sdpa(q, k, v, attn_mask=bias)
        expected = attention(q, k, v, bias)
        low = attention(q, k, v, bias, dtype=torch.float16)
        assert_close_to_oracle([out], [expected], [low], torch.float16)
        kept += [*alibi._on_device.values(), *key_range._on_device.values()]
    kept += [t for pair in decode_kernels._SCRATCH.values() for t in pair]
    # a mask function's block lists, kept per program
    q, k, v = (torch.randn(2, heads, 256, 64, device="cuda", generator=generator).half()
               for _ in range(3))  # fmt: skip
    prefix_lm = ModBias(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < 40))
    with torch.no_grad(), torch.cuda.use_mem_pool(pool), use_backends("triton"):
        out = sdpa(q, k, v, attn_mask=prefix_lm)
    expected = attention(q, k, v, prefix_lm)
    low = attention(q, k, v, prefix_lm, dtype=torch.float16)
    assert_close_to_oracle([out], [expected], [low], torch.float16)
    for per_size in list(masks._MOD_LISTS.values()):
        for _, lists in per_size.values():
            kept += [t for t in (lists.kv_lists, lists.q_lists) if t is not None]
    assert len(kept) >= 6, "no kept tensors to check"
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]
    inside = [t for t in kept if any(lo <= t.data_ptr() < hi for lo, hi in segments)]
    if routed.startswith("control"):
        assert inside, "the check finds nothing in the pool: it could not fail"
    else:
        assert not inside

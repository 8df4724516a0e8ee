"""Continuous batching on attnbias (``attnbias.integrations.transformers.continuous_batching``):
``generate_batch`` on real model definitions (random weights) against each prompt generated
alone on the model's own attention and against transformers' SDPA batching, and one step's
packed rows (prefill chunks, decode tokens, query padding) against the fp64 oracle row by
row."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from attnbias import SlidingWindowBias, SoftcapBias, causal_lower_right
from attnbias.testing.oracle import assert_close_to_oracle, attention

transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import PagedAttentionCache  # noqa: E402

import attnbias.integrations.transformers as hf  # noqa: E402

# The page size's name in ContinuousBatchingConfig: ``block_size`` up to transformers 5.17,
# ``page_size`` since.
PAGE_FIELD = (
    "page_size"
    if "page_size" in getattr(ContinuousBatchingConfig, "__dataclass_fields__", {})
    else "block_size"
)

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


def _model(kind: str) -> Any:
    """A small model of ``kind``, on transformers' eager attention."""
    torch.manual_seed(0)
    if kind == "llama":  # grouped key/value heads
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    elif kind == "mistral":  # a sliding window shorter than the prompts
        config = transformers.MistralConfig(**COMMON, sliding_window=6)
        model = transformers.MistralForCausalLM(config)
    else:  # Gemma 2: layers alternating a window with full attention, soft-cap, its own scale
        config = transformers.Gemma2Config(
            **COMMON,
            head_dim=16,
            sliding_window=6,
            attn_logit_softcapping=0.2,
            final_logit_softcapping=None,
            query_pre_attn_scalar=24,
            initializer_range=0.1,  # scores the cap changes: without it, other tokens
        )
        model = transformers.Gemma2ForCausalLM(config)
    model.eval().set_attn_implementation("eager")
    return model


PROMPT_LENGTHS = (3, 17, 9, 30, 1)
NEW_TOKENS = 6


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _generate_batch(model: Any, graphs: bool = False) -> dict[str, tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probabilities per request, continuous batching: pages of
    16 and at most 24 tokens a step, so the long prompts are prefilled in chunks against
    their cached keys while other rows decode; ``graphs``: steps captured in CUDA graphs
    (padded to their sizes) and replayed."""
    batching = ContinuousBatchingConfig(
        **{PAGE_FIELD: 16},
        num_blocks=32,
        max_batch_tokens=24,
        max_blocks_per_request=0,
        use_cuda_graph=graphs,
        return_logprobs=True,
    )
    generation = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    outputs = model.generate_batch(
        inputs=_prompts(), generation_config=generation, continuous_batching_config=batching
    )
    return {name: (out.generated_tokens, out.logprobs) for name, out in outputs.items()}


def _generate_each(model: Any) -> dict[str, tuple[list[int], list[float]]]:
    """The same, each prompt alone through ``generate`` (the model's own attention)."""
    found = {}
    for index, prompt in enumerate(_prompts()):
        result = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        tokens = result.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(logits[0].float(), -1)[token].item()
            for logits, token in zip(result.logits, tokens, strict=True)
        ]
        found[f"req_{index}"] = (tokens, logprobs)
    return found


def _assert_same(
    got: dict[str, tuple[list[int], list[float]]],
    expected: dict[str, tuple[list[int], list[float]]],
    tolerance: float = 1e-5,
) -> None:
    assert got.keys() == expected.keys()
    for request, (tokens, logprobs) in expected.items():
        assert got[request][0] == tokens, request
        difference = max(abs(a - b) for a, b in zip(got[request][1], logprobs, strict=True))
        assert difference < tolerance, (request, difference)


# Which pages each kind of model's layers read (page size -> the windows of the layers that
# read them): full attention in place from the cache's pages of 16 once rows have cached keys
# (and the first prefill's keys as one-token pages), a sliding window's ring of slots gathered
PAGES = {
    "llama": {1: {None}, 16: {None}},
    "mistral": {1: {6}},
    "gemma2": {1: {None, 6}, 16: {None}},
}
# transformers before 5.19 updates its cache by indices passed one by one and gives the keys
# gathered: every layer reads gathered keys.
if "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters:
    PAGES = {kind: {1: set().union(*windows.values())} for kind, windows in PAGES.items()}


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_generate_batch_matches_the_model(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens equal to each prompt generated alone on the model's own (eager)
    attention, and their log-probabilities within float32 rounding (Gemma 2's soft-cap
    included: without it, other tokens); for the models transformers batches on SDPA, equal
    to its continuous batching too. Full-attention layers read the cache's pages in place,
    windowed ones the gathered keys. The model's implementation is back on leaving the block.
    (transformers' own ``paged|eager`` leaves Gemma 2's soft-cap out.)"""
    pages: dict[int, set[int | None]] = {}
    step_bias = hf._step_bias

    def spy(*args: Any, **kwargs: Any) -> Any:
        pages.setdefault(kwargs["page"], set()).add(args[4])  # args[4]: the window
        return step_bias(*args, **kwargs)

    monkeypatch.setattr(hf, "_step_bias", spy)
    model = _model(kind)
    alone = _generate_each(model)
    with hf.continuous_batching(model):
        # the name, with the "paged|" prefix transformers 5.17 and 5.18 batch under
        name = model.config._attn_implementation
        assert name.removeprefix("paged|") == hf.CB_IMPLEMENTATION
        got = _generate_batch(model)
    assert model.config._attn_implementation == "eager"
    _assert_same(got, alone)
    assert pages == PAGES[kind]
    if kind != "gemma2":  # transformers batches it on "sdpa"
        model.set_attn_implementation("sdpa")
        _assert_same(got, _generate_batch(model))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_generate_batch_on_a_gpu(kind: str, graphs: bool) -> None:
    """On a GPU (float32, TF32 off), eagerly and with the steps captured in CUDA graphs and
    replayed (padded steps, tables written inside the graphs): greedy tokens equal to each
    prompt generated alone on the model's eager attention, log-probabilities within 1e-4."""
    model = _model(kind).cuda()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        alone = _generate_each(model)
        with hf.continuous_batching(model):
            got = _generate_batch(model, graphs=graphs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    _assert_same(got, alone, tolerance=1e-4)


class _Cache(PagedAttentionCache):
    """transformers' paged cache as :func:`hf.paged_attention_forward` sees it: ``update``
    returns the step's keys and values of every row, gathered and packed, and sets the
    layer's ``cu_seq_lens_k`` and ``max_length_k`` in the call's keyword arguments."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor, cu_k: torch.Tensor) -> None:
        self.gathered = (key, value)
        self.cu_k = cu_k

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs["cu_seq_lens_k"] = self.cu_k
        kwargs["max_length_k"] = int((self.cu_k[1:] - self.cu_k[:-1]).max())
        return self.gathered


class _Layer(torch.nn.Module):
    layer_idx = 0
    is_causal = True


def _step(
    query_lens: list[int],
    past: list[int],
    padding: tuple[int, int],
    window: int | None,
    softcap: float | None,
    scale: float | None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """One step: row ``b`` has ``query_lens[b]`` new tokens after ``past[b]`` cached ones;
    ``padding`` query and key tokens past the rows (a padded step; the padded queries NaN).
    Each row's output against the oracle of that row alone; the padding's outputs zeros."""
    generator = torch.Generator().manual_seed(len(query_lens) + sum(past))
    hq, hkv, e = 4, 2, 16
    key_lens = [n + p for n, p in zip(query_lens, past, strict=True)]
    cu_q = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(key_lens).cumsum(0).tolist()], dtype=torch.int32)
    total_q, total_k = int(cu_q[-1]) + padding[0], int(cu_k[-1]) + padding[1]
    q = torch.randn(1, hq, total_q, e, generator=generator).to(dtype)
    k, v = (torch.randn(1, hkv, total_k, e, generator=generator).to(dtype) for _ in range(2))
    q[:, :, int(cu_q[-1]) :] = float("nan")
    out, weights = hf.paged_attention_forward(
        _Layer(),
        q,
        k[:, :, :1],  # the new keys: what the cache returns replaces them
        v[:, :, :1],
        None,
        scaling=scale,
        softcap=softcap,
        sliding_window=window,
        cache=_Cache(k, v, cu_k),
        cu_seq_lens_q=cu_q,
        max_length_q=max(query_lens),
    )
    assert weights is None
    assert out.shape == (1, total_q, hq, e)
    bias = causal_lower_right()
    if window is not None:
        bias = bias + SlidingWindowBias(window - 1)
    if softcap is not None:
        bias = bias + SoftcapBias(softcap)
    for b in range(len(query_lens)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        parts = q[:, :, rows], k[:, :, keys], v[:, :, keys]
        oracle = attention(*parts, bias, scale=scale, enable_gqa=True)
        stock = attention(*parts, bias, scale=scale, enable_gqa=True, dtype=dtype)
        got = out[:, rows].transpose(1, 2)
        assert_close_to_oracle([got], [oracle], [stock], dtype)
    assert (out[:, int(cu_q[-1]) :] == 0).all()


@pytest.mark.parametrize(
    ("window", "softcap", "scale"), [(None, None, None), (4, None, 0.3), (3, 2.0, None)]
)
def test_a_step_of_rows_matches_the_oracle(
    window: int | None, softcap: float | None, scale: float | None
) -> None:
    """Prefill rows, a chunk of a prompt against its cached keys, decode rows and a row of one
    token, packed: each row's causal alignment, window and soft-cap are its own."""
    _step([5, 3, 1, 1, 4], [0, 6, 9, 0, 2], (0, 0), window, softcap, scale)


def test_a_padded_step_and_the_next_reuse_tables_written_in_place() -> None:
    """Query and key padding past the rows (a step padded for CUDA graphs); then steps of the
    same shape with other lengths, which write the kept tables again: each matches the oracle
    (tables left from the step before fail it)."""
    _step([2, 1, 3], [4, 7, 0], (3, 5), 5, None, None)
    _step([1, 3, 2], [9, 1, 5], (3, 5), 5, None, None)
    _step([3, 2, 1], [0, 2, 11], (3, 5), 5, None, None)


def test_bad_calls_are_refused() -> None:
    """Outside continuous batching, the cache's block-table decode path, a mask, a layer that
    is not causal, attention sinks, and a model that is not one: each refused, named."""
    q = torch.randn(1, 4, 3, 16)
    k = v = torch.randn(1, 2, 3, 16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    cache = _Cache(k, v, cu)
    with pytest.raises(ValueError, match="without transformers' paged cache"):
        hf.paged_attention_forward(_Layer(), q, k, v, None)
    with pytest.raises(NotImplementedError, match="max_blocks_per_request=0"):
        hf.paged_attention_forward(
            _Layer(), q, k, v, None, cache=cache, block_table=torch.zeros(1, 1)
        )
    with pytest.raises(ValueError, match="takes no mask"):
        hf.paged_attention_forward(_Layer(), q, k, v, torch.ones(1, 1, 3, 3), cache=cache)
    with pytest.raises(ValueError, match="not causal"):
        hf.paged_attention_forward(_Layer(), q, k, v, None, cache=cache, is_causal=False)
    with pytest.raises(ValueError, match="s_aux"):
        hf.paged_attention_forward(_Layer(), q, k, v, None, cache=cache, s_aux=torch.zeros(4))
    with (
        pytest.raises(TypeError, match="takes a transformers model"),
        hf.continuous_batching(torch.nn.Linear(2, 2)),
    ):
        pass


def test_step_tables_are_written_whole_at_each_refill() -> None:
    """Tables made while one CUDA graph was captured are filled only when that graph
    replays, and other graphs read them too: each refill writes every entry, not only those
    a step changes. A padded step (4 queries, the rows' 3) has no row for its padding."""
    hf._STEP_ROWS.clear()
    cu_q = torch.tensor([0, 2, 3], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9], dtype=torch.int32)
    hf._step_bias(cu_q, cu_k, 5, 4, None, None, keys=9)
    (found,) = hf._STEP_ROWS.values()
    for table in (found.table, found.lens, found.cu_q):
        table.fill_(-7)  # what a graph that never replayed leaves
    hf._step_bias(cu_q.clone(), cu_k.clone(), 5, 4, None, None, keys=9)  # new sources
    # each row's keys from its first in the step's order (the gathered keys: pages of one)
    assert found.table.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [5, 6, 7, 8, 8, 8, 8, 8]]
    assert found.cu_q.tolist() == [0, 2, 3]
    assert found.lens.tolist() == [5, 4]
    assert found.paged.max_seqlen_q is None  # no bound given
    hf._step_bias(cu_q, cu_k, 5, 4, None, None, keys=9, max_q=2)
    bounded = [rows for rows in hf._STEP_ROWS.values() if rows is not found]
    assert [rows.paged.max_seqlen_q for rows in bounded] == [2]
    hf._STEP_ROWS.clear()

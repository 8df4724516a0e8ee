"""Hugging Face transformers models with ``attn_implementation="attnbias"``.

Tiny models from config (random weights) of Llama, Mistral (sliding window), Qwen2 (a full and
a sliding layer), Gemma 2 (sliding and full layers, soft-cap, ``query_pre_attn_scalar``) and
Gemma 3, each in three copies with the same weights:

- ``ours``: float32, ``attn_implementation="attnbias"``;
- ``oracle``: float64, transformers' own boolean masks (``sdpa_mask``) and the attention of
  ``attnbias.testing.oracle`` (fp64 stock SDPA on the materialised mask, fp64 eager soft-cap),
  registered here as an attention implementation of its own;
- ``stock``: float32, transformers' ``eager`` attention.

Logits and gradients pass when their error against the oracle is at most twice the eager
model's in float32 plus a floor (``assert_close_to_oracle``): the two float32 models share
every other layer, so the eager model's error is the float32 rounding the attnbias model is
allowed. Positions that are padding are not compared (their rows attend to nothing).
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnbias import (
    CausalBias,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
)
from attnbias.biases import parts_of
from attnbias.testing.oracle import assert_close_to_oracle, attention

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface, AutoModelForCausalLM, masking_utils  # noqa: E402

import attnbias.integrations.transformers as hf  # noqa: E402

VOCAB = 64
LENGTH = 10
WINDOW = 4  # keys per query in the sliding layers, the query's own included
ORACLE = "attnbias_test_oracle"
MODELS = ("llama", "mistral", "qwen2", "gemma2", "gemma3")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_config(name: str, **overrides: Any) -> Any:
    """2 layers, hidden size 32, 4 query heads sharing 2 key/value heads, a 64-token vocabulary.
    Weights drawn with std 0.3 (not 0.02) so that attention is far from uniform and the masks
    change the logits."""
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    common.update(overrides)
    if name == "llama":
        return transformers.LlamaConfig(**common)
    if name == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **common)
    if name == "qwen2":
        # layer 0 full, layer 1 sliding
        return transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common
        )
    if name == "gemma2":
        # a cap small enough that tanh bends the scores; a scalar that is not the head dim
        return transformers.Gemma2Config(
            sliding_window=WINDOW, attn_logit_softcapping=0.5, query_pre_attn_scalar=16, **common
        )
    if name == "gemma3":
        return transformers.Gemma3TextConfig(
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            **common,
        )
    raise AssertionError(name)


def _oracle_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    bias = None if attention_mask is None else TensorBias(attention_mask)
    if softcap is not None:
        bias = SoftcapBias(softcap) if bias is None else bias + SoftcapBias(softcap)
    out = attention(query, key, value, bias, scale=scaling, enable_gqa=True, dtype=query.dtype)
    return out.transpose(1, 2).contiguous(), None


def _oracle_mask(**kwargs: Any) -> torch.Tensor | None:
    # transformers' own boolean mask, never skipped in favour of is_causal
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return masking_utils.sdpa_mask(**kwargs)


def _register_oracle() -> None:
    AttentionInterface.register(ORACLE, _oracle_attention)
    masking_utils.AttentionMaskInterface.register(ORACLE, _oracle_mask)


@dataclass
class Models:
    name: str
    ours: Any
    oracle: Any
    stock: Any


def build(name: str, **overrides: Any) -> Models:
    hf.register()
    _register_oracle()
    # one config each: a model records its attention implementation in its config
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(
        tiny_config(name, **overrides), attn_implementation="eager"
    )
    ours = AutoModelForCausalLM.from_config(
        tiny_config(name, **overrides), attn_implementation=hf.ATTN_IMPLEMENTATION
    )
    oracle = AutoModelForCausalLM.from_config(
        tiny_config(name, **overrides), attn_implementation=ORACLE
    )
    ours.load_state_dict(stock.state_dict())
    oracle.load_state_dict(stock.state_dict())
    oracle.double()
    return Models(name, *(m.to(DEVICE).eval() for m in (ours, oracle, stock)))


@pytest.fixture(scope="module", params=MODELS)
def models(request: pytest.FixtureRequest) -> Models:
    return build(str(request.param))


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the integration's once-per-reason warnings afresh."""
    monkeypatch.setattr(hf, "_WARNED", set())


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """The arguments of every attnbias.sdpa call the integration makes."""
    seen: list[dict[str, Any]] = []
    real = hf.sdpa

    def recording(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> Any:
        seen.append(dict(kw, query=query.shape, key=key.shape))
        return real(query, key, value, **kw)

    monkeypatch.setattr(hf, "sdpa", recording)
    yield seen


def inputs(kind: str, seed: int = 1) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
    """``(input_ids, model kwargs, positions to compare)`` for a batch of 2 rows of 10."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=generator)
    if kind == "packed":
        # row 0: sequences of 4 and 6 tokens; row 1: 7 and 3
        positions = torch.tensor([[*range(4), *range(6)], [*range(7), *range(3)]])
        compare = torch.ones(2, LENGTH, dtype=torch.bool)
        kwargs: dict[str, Any] = dict(position_ids=positions.to(DEVICE), use_cache=False)
        return ids.to(DEVICE), kwargs, compare.to(DEVICE)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    if kind == "left_padding":
        mask[0, :3] = 0
    elif kind == "right_padding":
        mask[1, 6:] = 0
    else:
        raise AssertionError(kind)
    return ids.to(DEVICE), dict(attention_mask=mask.to(DEVICE)), mask.bool().to(DEVICE)


def attnbias_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("attnbias:")]


# --------------------------------------------------------------------------------------------
# Whole models against the oracle


@pytest.mark.parametrize("kind", ["left_padding", "right_padding", "packed"])
def test_logits_match_the_oracle(models: Models, kind: str, calls: list[dict[str, Any]]) -> None:
    ids, kwargs, compare = inputs(kind)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = models.ours(ids, **kwargs).logits
        oracle = models.oracle(ids, **kwargs).logits
        stock = models.stock(ids, **kwargs).logits
    assert attnbias_warnings(caught) == []
    assert_close_to_oracle(
        [ours[compare]], [oracle[compare]], [stock[compare]], torch.float32, names=("logits",)
    )
    # every layer ran with bias objects, none of them materialised
    assert len(calls) == 2
    for layer, call in enumerate(calls):
        parts = parts_of(call["attn_mask"])
        kinds = {type(part) for part in parts}
        assert TensorBias not in kinds
        assert CausalBias in kinds
        assert (DocumentBias in kinds) == (kind == "packed")
        assert (KeyRangeBias in kinds) == (kind != "packed")
        sliding = models.name == "mistral" or (
            models.name in ("qwen2", "gemma2", "gemma3")
            and layer == (1 if models.name == "qwen2" else 0)
        )
        assert (SlidingWindowBias(WINDOW - 1) in parts) == sliding
        caps = [p.cap for p in parts if isinstance(p, SoftcapBias)]
        assert caps == ([0.5] if models.name == "gemma2" else [])
        assert call["enable_gqa"] is True
        assert call["query"][1] == 4 and call["key"][1] == 2  # no copies of the key/value heads
        if models.name in ("gemma2", "gemma3"):
            assert call["scale"] == pytest.approx(16**-0.5)


def test_greedy_generation_matches_eager(models: Models, calls: list[dict[str, Any]]) -> None:
    ids, kwargs, _ = inputs("left_padding", seed=2)
    generate = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = models.ours.generate(ids, **kwargs, **generate)
    stock = models.stock.generate(ids, **kwargs, **generate)
    assert torch.equal(ours, stock)
    # prefill, then one query per step against the cache (lower-right causal)
    decode = [c for c in calls if c["query"][2] == 1]
    assert len(decode) == 2 * 5
    assert all(CausalBias in {type(p) for p in parts_of(c["attn_mask"])} for c in decode)


def test_training_step_gradients_match_the_oracle(models: Models) -> None:
    ids, kwargs, _ = inputs("packed", seed=3)
    grads = []
    for model in (models.ours, models.oracle, models.stock):
        model.train()
        model.zero_grad()
        model(ids, labels=ids, **kwargs).loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        model.eval()
    names = sorted(grads[0])
    assert all(grads[0][n].abs().amax() > 0 for n in names if "q_proj" in n)
    assert_close_to_oracle(
        [grads[0][n] for n in names],
        [grads[1][n] for n in names],
        [grads[2][n] for n in names],
        torch.float32,
        names=names,
    )


# --------------------------------------------------------------------------------------------
# The mask function against transformers' own masks


@st.composite
def mask_calls(draw: st.DrawFn) -> dict[str, Any]:
    """Arguments transformers gives a mask function: a dynamic or static cache (full or
    sliding), packed sequences, left, right or no padding."""
    batch = draw(st.integers(1, 3))
    q_length = draw(st.integers(1, 6))
    pattern = draw(st.sampled_from(["causal", "sliding", "packed", "bidirectional"]))
    window = draw(st.integers(1, 5))
    if pattern == "packed":
        past, kv_offset, kv_length = 0, 0, q_length
    else:
        past = draw(st.integers(0, 6))
        cache = draw(st.sampled_from(["dynamic", "static"]))
        kv_offset = max(past - window + 1, 0) if pattern == "sliding" else 0
        kv_length = past + q_length - kv_offset
        if cache == "static":
            kv_length += draw(st.integers(0, 4))  # unfilled slots
    if pattern == "causal":
        function = masking_utils.causal_mask_function
    elif pattern == "sliding":
        function = masking_utils.sliding_window_causal_mask_function(window)
    elif pattern == "bidirectional":
        function = masking_utils.bidirectional_mask_function
    else:
        lengths = []
        while sum(lengths) < q_length:
            lengths.append(draw(st.integers(1, q_length - sum(lengths))))
        positions = torch.cat([torch.arange(n) for n in lengths])[None].expand(batch, -1)
        docs = masking_utils.find_packed_sequence_indices(positions)
        if docs is None:
            docs = torch.zeros(batch, q_length, dtype=torch.long)
        causal = masking_utils.causal_mask_function
        if draw(st.booleans()):
            causal = masking_utils.sliding_window_causal_mask_function(window)
        remap = getattr(masking_utils, "packed_sequence_compatibility_function", None)
        if remap is not None:
            function = remap(causal, positions, docs)
        else:
            function = masking_utils.and_masks(
                causal, masking_utils.packed_sequence_mask_function(docs)
            )
    padding = None
    seen = kv_offset + kv_length if pattern != "packed" else q_length
    style = draw(st.sampled_from(["none", "left", "right"]))
    if style != "none" and pattern != "packed":
        filled = past + q_length  # a static cache's unfilled slots are not in the 2-D mask
        padding = torch.ones(batch, filled, dtype=torch.bool)
        for row in range(batch):
            pad = draw(st.integers(0, filled))
            if style == "left":
                padding[row, :pad] = False
            else:
                padding[row, filled - pad :] = False
    assert seen >= 1
    q_offset: Any = past
    if draw(st.booleans()):
        q_offset = torch.tensor(past)  # as a static cache gives it
    return dict(
        batch_size=batch,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=function,
        attention_mask=padding,
    )


def keep_of(mask: hf.ModelMask, batch: int, q_length: int) -> torch.Tensor:
    """The ``(B, 1, L, kv_length)`` keep-mask a :class:`ModelMask` stands for."""
    keep = torch.ones(batch, 1, q_length, mask.keys, dtype=torch.bool)
    if mask.bias is not None:
        shape = (batch, 1, q_length, mask.keys)
        keep = keep & torch.isfinite(mask.bias.materialize(shape=shape)).expand(shape)
    unused = torch.zeros(batch, 1, q_length, mask.kv_length - mask.keys, dtype=torch.bool)
    return torch.cat([keep, unused], dim=-1)


@given(mask_calls())
def test_mask_is_transformers_mask(call: dict[str, Any]) -> None:
    expected = masking_utils.sdpa_mask(
        **call, allow_is_causal_skip=False, allow_is_bidirectional_skip=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mask = hf.make_mask(**call, config=None)
    assert mask.notes == ()
    assert not any(isinstance(p, TensorBias) for p in parts_of(mask.bias))
    assert torch.equal(keep_of(mask, call["batch_size"], call["q_length"]), expected)


def test_unknown_mask_function_is_materialised() -> None:
    def prefix_lm(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) | (kv_idx < 2)

    call = dict(batch_size=2, q_length=5, kv_length=5, mask_function=prefix_lm)
    mask = hf.make_mask(**call)
    assert isinstance(mask.bias, TensorBias)
    assert mask.notes and "prefix_lm" in mask.notes[0]
    expected = masking_utils.sdpa_mask(**call, allow_is_causal_skip=False)
    assert torch.equal(keep_of(mask, 2, 5), expected)


def test_padding_with_holes_is_a_key_tensor() -> None:
    padding = torch.tensor([[True, False, True, True], [True, True, True, True]])
    call = dict(batch_size=2, q_length=4, kv_length=4, attention_mask=padding)
    mask = hf.make_mask(**call)
    tensors = [p for p in parts_of(mask.bias) if isinstance(p, TensorBias)]
    assert [tuple(t.bias.shape) for t in tensors] == [(2, 1, 1, 4)]
    assert mask.notes and "padding between real tokens" in mask.notes[0]
    expected = masking_utils.sdpa_mask(**call, allow_is_causal_skip=False)
    assert torch.equal(keep_of(mask, 2, 4), expected)


# --------------------------------------------------------------------------------------------
# Fallbacks and arguments through a model


def test_custom_4d_mask_runs_as_a_tensor_bias_and_warns_once() -> None:
    models = build("llama")
    ids, _, _ = inputs("left_padding", seed=4)
    # prefix-LM: the first 3 tokens see each other, the rest is causal (no row fully masked)
    rows = torch.arange(LENGTH)[:, None]
    cols = torch.arange(LENGTH)[None, :]
    keep = (cols <= rows) | (cols < 3)
    additive = torch.zeros(2, 1, LENGTH, LENGTH).masked_fill(~keep, torch.finfo(torch.float32).min)
    mask = additive.to(DEVICE)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = models.ours(ids, attention_mask=mask).logits
        oracle = models.oracle(ids, attention_mask=mask.double()).logits
        stock = models.stock(ids, attention_mask=mask).logits
    said = attnbias_warnings(caught)
    assert len(said) == 1 and "4-D tensor mask" in said[0] and "llama" in said[0]
    assert_close_to_oracle([ours], [oracle], [stock], torch.float32, names=("logits",))


def test_bidirectional_image_tokens_fall_back_with_a_warning() -> None:
    models = build("gemma3", use_bidirectional_attention=True)
    ids, kwargs, compare = inputs("left_padding", seed=5)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = models.ours(ids, **kwargs).logits
        oracle = models.oracle(ids, **kwargs).logits
        stock = models.stock(ids, **kwargs).logits
    said = attnbias_warnings(caught)
    assert said and all("materialised" in s for s in said)
    assert len(said) == len(set(said))
    assert_close_to_oracle(
        [ours[compare]], [oracle[compare]], [stock[compare]], torch.float32, names=("logits",)
    )


def test_dropout_reaches_sdpa_in_training_only(calls: list[dict[str, Any]]) -> None:
    models = build("llama", attention_dropout=0.25)
    ids, kwargs, _ = inputs("left_padding")
    models.ours.train()
    models.ours(ids, **kwargs)
    models.ours.eval()
    with torch.no_grad():
        models.ours(ids, **kwargs)
    assert [c["dropout_p"] for c in calls] == [0.25, 0.25, 0.0, 0.0]


def test_attention_function_returns_what_transformers_expects() -> None:
    class Layer(torch.nn.Module):
        is_causal = True

    query = torch.randn(2, 4, 5, 8)
    key = value = torch.randn(2, 2, 5, 8)
    mask = hf.make_mask(batch_size=2, q_length=5, kv_length=5)
    output, weights = hf.attention_forward(Layer(), query, key, value, mask, scaling=0.3)
    assert weights is None
    assert output.shape == (2, 5, 4, 8) and output.is_contiguous()
    expected = attention(query, key, value, CausalBias(), scale=0.3, enable_gqa=True)
    assert_close_to_oracle(
        [output.transpose(1, 2)],
        [expected],
        [attention(query, key, value, CausalBias(), scale=0.3, enable_gqa=True, dtype=query.dtype)],
        torch.float32,
    )
    with pytest.raises(TypeError, match="attention_mask of type dict"):
        hf.attention_forward(Layer(), query, key, value, {"full_attention": mask})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"S=4 but its mask was made for kv_length=5"):
        hf.attention_forward(Layer(), query, key[:, :, :4], value[:, :, :4], mask)
    with pytest.raises(ValueError, match="attention sinks"):
        hf.attention_forward(Layer(), query, key, value, mask, s_aux=torch.zeros(4))


def test_explain_model_names_each_layers_bias_and_route() -> None:
    models = build("gemma2")
    ids, kwargs, _ = inputs("packed")
    text = hf.explain_model(models.ours, ids, **kwargs)
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("layer 0 Gemma2Attention: CausalBias(LOWER_RIGHT)")
    assert "SlidingWindowBias(window_left=3" in lines[0] and "SoftcapBias(cap=0.5)" in lines[0]
    assert "SlidingWindowBias" not in lines[2] and "DocumentBias" in lines[2]
    routes = ("triton-decode", "triton", "reference", "sdpa+mask", "fa4")
    assert all(line.strip().split(":")[0] in routes for line in lines[1::2])
    with pytest.raises(ValueError, match="made no attention call through attnbias"):
        hf.explain_model(models.stock, ids, **kwargs)


def test_register_is_idempotent() -> None:
    hf.register()
    hf.register()
    assert AttentionInterface._global_mapping["attnbias"] is hf.attention_forward
    masks = masking_utils.AttentionMaskInterface._global_mapping
    assert masks["attnbias"] is hf.make_mask


def test_import_attnbias_does_not_import_transformers() -> None:
    code = (
        "import sys\n"
        "import attnbias, attnbias.integrations\n"
        "assert 'transformers' not in sys.modules, 'import attnbias imported transformers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------
# GPU: the same models at bf16 and a real-ish size


@pytest.mark.gpu
@pytest.mark.parametrize("name", MODELS)
def test_bf16_models_on_gpu(name: str) -> None:
    big = dict(
        hidden_size=1024,
        intermediate_size=2048,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=1024,
        max_position_embeddings=4096,
        initializer_range=0.02,
    )
    models = build(name, **big)
    models.ours.to(torch.bfloat16)
    models.stock.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(6)
    length = 1024
    ids = torch.randint(0, 1024, (2, length), generator=generator).to(DEVICE)
    mask = torch.ones(2, length, dtype=torch.long, device=DEVICE)
    mask[0, :100] = 0
    compare = mask.bool()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = models.ours(ids, attention_mask=mask).logits
        oracle = models.oracle(ids, attention_mask=mask).logits
        stock = models.stock(ids, attention_mask=mask).logits
    assert attnbias_warnings(caught) == []
    assert_close_to_oracle(
        [ours[compare]], [oracle[compare]], [stock[compare]], torch.bfloat16, names=("logits",)
    )
    assert math.isfinite(ours.float().abs().max().item())

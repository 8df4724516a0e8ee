"""Each bias against an independent definition: PyTorch's own causal biases, FlashAttention 2's
window formula, the ALiBi paper's slopes, and plain block-diagonal document masks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import bias as torch_bias

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    explain,
    patch_sdpa,
    sdpa,
)
from attnbias.backends import triton as triton_backend
from attnbias.biases import CompositeBias, alibi_slopes

LENGTHS = [(1, 1), (5, 5), (3, 8), (8, 3), (7, 16), (16, 7)]


@pytest.mark.parametrize(("length_q", "length_kv"), LENGTHS)
def test_causal_matches_pytorch(length_q: int, length_kv: int) -> None:
    for ours, theirs in (
        (causal_upper_left(length_q, length_kv), torch_bias.causal_upper_left(length_q, length_kv)),
        (
            causal_lower_right(length_q, length_kv),
            torch_bias.causal_lower_right(length_q, length_kv),
        ),
    ):
        keep = theirs._materialize(torch.device("cpu"))  # bool, True = attend
        assert ours.materialize().shape == (length_q, length_kv)
        assert torch.equal(ours.materialize() == 0, keep)
        assert torch.isneginf(ours.materialize()[~keep]).all()


def test_causal_lengths_are_checked_and_optional() -> None:
    assert torch.equal(
        CausalBias(CausalVariant.LOWER_RIGHT).materialize(shape=(2, 2, 3, 5)),
        causal_lower_right(3, 5).materialize(),
    )
    with pytest.raises(ValueError, match="L=3, S=5"):
        causal_lower_right(3, 5).materialize(shape=(1, 1, 4, 5))
    with pytest.raises(ValueError, match="sequence lengths"):
        causal_lower_right().materialize()
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="L=3"):
        sdpa(q, q, q, attn_mask=causal_lower_right(3, 4))


def flash_attention_2_window_keep(
    length_q: int, length_kv: int, left: int | None, right: int | None
) -> torch.Tensor:
    """FlashAttention 2's local mask: masked when ``col > row + S - L + right`` or
    ``col < row + S - L - left`` (``-1`` = unbounded there)."""
    left = -1 if left is None else left
    right = -1 if right is None else right
    row = torch.arange(length_q)[:, None]
    col = torch.arange(length_kv)[None, :]
    masked = torch.zeros(length_q, length_kv, dtype=torch.bool)
    if right >= 0:
        masked |= col > row + length_kv - length_q + right
    if left >= 0:
        masked |= col < row + length_kv - length_q - left
    return ~masked


@pytest.mark.parametrize(("length_q", "length_kv"), LENGTHS)
@pytest.mark.parametrize(("left", "right"), [(0, 0), (2, 0), (3, 1), (None, 0), (2, None), (0, 4)])
def test_window_matches_flash_attention_2(
    length_q: int, length_kv: int, left: int | None, right: int | None
) -> None:
    mask = SlidingWindowBias(left, right).materialize(shape=(length_q, length_kv))
    assert torch.equal(mask == 0, flash_attention_2_window_keep(length_q, length_kv, left, right))


def test_window_keeps_w_keys_per_query() -> None:
    width = 4
    keep = SlidingWindowBias(width - 1).materialize(shape=(10, 10)) == 0
    assert keep.sum(-1)[width - 1 :].eq(width).all()
    assert keep[5].nonzero().flatten().tolist() == [2, 3, 4, 5]


def test_alibi_slopes_are_the_papers() -> None:
    # Press et al.: 8 heads -> 1/2 ... 1/256; 16 heads -> 2^-0.5 ... 2^-8;
    # non powers of two: the 2^k slopes, then every other slope of 2^(k+1).
    assert alibi_slopes(8) == [2.0**-n for n in range(1, 9)]
    assert alibi_slopes(16) == pytest.approx([2.0 ** (-n / 2) for n in range(1, 17)])
    assert alibi_slopes(12) == pytest.approx(
        [2.0**-n for n in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    )
    assert len(alibi_slopes(40)) == 40
    assert alibi_slopes(40)[:32] == pytest.approx([2.0 ** (-n / 4) for n in range(1, 33)])
    assert alibi_slopes(40)[32:] == pytest.approx([2.0 ** (-(2 * n + 1) / 8) for n in range(8)])


@pytest.mark.parametrize(("length_q", "length_kv"), LENGTHS)
def test_alibi_values(length_q: int, length_kv: int) -> None:
    slopes = torch.tensor([[0.5, 0.125], [1.0, 0.25]])
    mask = AlibiBias(slopes=slopes).materialize(shape=(2, 2, length_q, length_kv))
    assert mask.shape == (2, 2, length_q, length_kv)
    for b in range(2):
        for h in range(2):
            for i in range(length_q):
                for j in range(length_kv):
                    expected = -slopes[b, h].item() * abs(i + length_kv - length_q - j)
                    assert mask[b, h, i, j].item() == pytest.approx(expected)
    assert AlibiBias(num_heads=2).materialize(shape=(1, 2, length_q, length_kv)).shape == (
        2,
        length_q,
        length_kv,
    )


def test_alibi_under_causal_equals_papers_form() -> None:
    # the paper adds slope * (j - i) below the diagonal; ours is -slope * |i - j|: equal there
    heads, length = 4, 9
    q, k, v = (torch.randn(1, heads, length, 8, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor(alibi_slopes(heads), dtype=torch.float64)[:, None, None]
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    paper = slopes * (j - i) + torch.where(j <= i, 0.0, -math.inf)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=paper)
    out = sdpa(q, k, v, attn_mask=AlibiBias(num_heads=heads), is_causal=True)
    torch.testing.assert_close(out, expected)


def test_documents_are_block_diagonal() -> None:
    bias = DocumentBias.from_seqlens([2, 3, 1])
    blocks = torch.block_diag(torch.ones(2, 2), torch.ones(3, 3), torch.ones(1, 1)).bool()
    assert torch.equal(bias.materialize() == 0, blocks)
    cross = DocumentBias.from_seqlens([2, 1], [1, 3])
    expected = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1]]).bool()
    assert torch.equal(cross.materialize() == 0, expected)
    batched = DocumentBias(torch.tensor([[0, 0, 1], [0, 1, 1]]))
    assert batched.materialize().shape == (2, 1, 3, 3)


def test_key_ranges_keep_start_to_end_per_batch_row() -> None:
    bias = KeyRangeBias(start=[2, 0, 1], end=[4, 3, 1])
    keep = bias.materialize(shape=(3, 2, 5, 4)) == 0
    assert keep.shape == (3, 1, 1, 4)
    expected = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]]).bool()
    assert torch.equal(keep[:, 0, 0], expected)
    # open sides: start 0, end S; one row broadcasts over the batch
    assert torch.equal(
        KeyRangeBias(end=[2]).materialize(shape=(2, 1, 1, 3)) == 0,
        torch.tensor([1, 1, 0]).bool().expand(2, 1, 1, 3),
    )


def test_key_ranges_from_padding_masks() -> None:
    left_right = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    bias = KeyRangeBias.from_padding_mask(left_right)
    assert bias.start is not None and bias.end is not None
    assert bias.start.tolist() == [2, 0, 0, 0]
    assert bias.end.tolist() == [4, 3, 0, 4]
    assert torch.equal(bias.materialize(shape=(4, 1, 1, 4))[:, 0, 0] == 0, left_right.bool())
    with pytest.raises(ValueError, match="row 1 of the mask has padding between"):
        KeyRangeBias.from_padding_mask(torch.tensor([[1, 1, 0], [1, 0, 1]]))
    with pytest.raises(ValueError, match="bool or 0/1"):
        KeyRangeBias.from_padding_mask(torch.tensor([[2, 1, 0]]))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"start": [1.5]}, TypeError, "int positions"),
        ({"start": [True]}, TypeError, "int positions"),
        ({"end": torch.tensor([1.0])}, TypeError, "integer positions"),
        ({"end": [-1]}, ValueError, ">= 0"),
        ({"end": torch.tensor([[1]])}, ValueError, "shape \\(B,\\)"),
        ({"start": [2], "end": [1]}, ValueError, "start <= end"),
        ({"start": [0, 0], "end": [1, 1, 1]}, ValueError, "one position per batch row"),
    ],
)
def test_key_range_errors(kwargs: dict[str, object], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        KeyRangeBias(**kwargs)  # type: ignore[arg-type]


def test_key_range_must_fit_the_call() -> None:
    q = torch.randn(2, 1, 3, 8)
    with pytest.raises(ValueError, match="past the call's S=3"):
        sdpa(q, q, q, attn_mask=KeyRangeBias(end=[4, 2]))
    with pytest.raises(ValueError, match="batch size B=2"):
        sdpa(q, q, q, attn_mask=KeyRangeBias(end=[1, 2, 3]))


def test_bias_docstring_examples() -> None:
    import doctest
    import importlib
    import pkgutil

    import attnbias.biases

    attempted = 0
    for module in pkgutil.iter_modules(attnbias.biases.__path__, "attnbias.biases."):
        result = doctest.testmod(importlib.import_module(module.name))
        assert result.failed == 0, module.name
        attempted += result.attempted
    assert attempted >= 7  # one example per bias kind at least


def test_softcap_matches_eager_definition() -> None:
    q, k, v = (torch.randn(2, 3, 7, 16, dtype=torch.float64) * 3 for _ in range(3))
    cap, scale = 2.0, 0.4
    scores = cap * torch.tanh(scale * (q @ k.transpose(-1, -2)) / cap)
    expected = torch.softmax(scores, -1) @ v
    out = sdpa(q, k, v, attn_mask=SoftcapBias(cap), scale=scale)
    torch.testing.assert_close(out, expected)
    # soft-cap comes before the additive biases and the masks
    alibi = AlibiBias(num_heads=3)
    additive = alibi.materialize(shape=(2, 3, 7, 7), dtype=torch.float64)
    keep = causal_upper_left().materialize(shape=(7, 7), dtype=torch.float64)
    expected = torch.softmax(scores + additive + keep, -1) @ v
    out = sdpa(q, k, v, attn_mask=SoftcapBias(cap) + alibi, scale=scale, is_causal=True)
    torch.testing.assert_close(out, expected)


def test_softcap_has_no_materialized_form() -> None:
    with pytest.raises(TypeError, match="no additive"):
        SoftcapBias(30.0).materialize(shape=(1, 1, 2, 2))
    assert not SoftcapBias(30.0).needs_materialization()


def test_composition() -> None:
    a, b, c = causal_lower_right(), SlidingWindowBias(2), AlibiBias(num_heads=2)
    total = a + b + c
    assert isinstance(total, CompositeBias) and total.parts == (a, b, c)
    assert sum([a, b, c]).parts == (a, b, c)  # type: ignore[union-attr]
    shape = (1, 2, 6, 9)
    torch.testing.assert_close(
        total.materialize(shape=shape),
        a.materialize(shape=shape) + b.materialize(shape=shape) + c.materialize(shape=shape),
    )
    assert (
        repr(total) == "CausalBias(LOWER_RIGHT) + SlidingWindowBias(window_left=2, "
        "window_right=0) + AlibiBias(num_heads=2)"
    )
    assert not total.needs_materialization()
    assert (total + TensorBias(torch.zeros(6, 9))).needs_materialization()
    assert not (total + SoftcapBias(1.0) + TensorBias(torch.zeros(6, 9))).needs_materialization()


def test_repr_never_materializes() -> None:
    huge = DocumentBias(torch.zeros(1_000_000, dtype=torch.long))
    assert "1000000" in repr(huge)
    assert repr(TensorBias(torch.zeros(3, 4))) == "TensorBias(shape=(3, 4), dtype=torch.float32)"


def test_patch_sdpa_routes_and_restores() -> None:
    original = F.scaled_dot_product_attention
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    bias = causal_lower_right() + SoftcapBias(1.0)
    with patch_sdpa():
        assert F.scaled_dot_product_attention is not original
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        # a plain call in the patched function still reaches stock SDPA (no recursion)
        plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert F.scaled_dot_product_attention is original
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=bias))
    torch.testing.assert_close(plain, original(q, k, v, is_causal=True))

    patch = patch_sdpa()
    assert F.scaled_dot_product_attention is not original
    patch.restore()
    assert F.scaled_dot_product_attention is original

    with pytest.raises(RuntimeError, match="boom"), patch_sdpa():
        raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original


def test_explain_names_the_route(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    q = torch.randn(1, 2, 8, 16)
    assert explain(q, q, q).startswith("sdpa:")
    assert explain(q, q, q, attn_mask=causal_upper_left()).startswith("sdpa(is_causal=True)")
    assert explain(q, q, q, attn_mask=SlidingWindowBias(2)).startswith("sdpa+mask")
    assert explain(q, q, q, attn_mask=SoftcapBias(2.0)).startswith("reference")
    assert "float32" in explain(
        q.bfloat16(), q.bfloat16(), q.bfloat16(), attn_mask=AlibiBias(num_heads=2)
    )
    assert explain(q, q, q, attn_mask=torch.zeros(8, 8)).startswith("sdpa:")
    # equal lengths: lower-right is upper-left, and a window wider than the sequence is causal
    assert explain(q, q, q, attn_mask=causal_lower_right() + SlidingWindowBias(100)).startswith(
        "sdpa(is_causal=True)"
    )
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: True)
    assert explain(q, q, q, attn_mask=SlidingWindowBias(2)).startswith("triton")
    assert "dropout" in explain(q, q, q, attn_mask=SlidingWindowBias(2), dropout_p=0.1)


class PrefixLM(AttnBias):
    """Bidirectional over a prefix, causal after it (materialized)."""

    def __init__(self, prefix: int) -> None:
        self.prefix = prefix

    def materialize(self, device=None, *, shape=None, dtype=None):  # type: ignore[no-untyped-def]
        assert shape is not None
        i = torch.arange(shape[-2], device=device)[:, None]
        j = torch.arange(shape[-1], device=device)[None, :]
        keep = (j <= i) | (j < self.prefix)
        zeros = torch.zeros(keep.shape, dtype=dtype or torch.float32, device=device)
        return zeros.masked_fill(~keep, -math.inf)

    def needs_materialization(self) -> bool:
        return True


class Doubled(AttnBias):
    """Dispatch-only: attention with doubled scale, computed by stock SDPA."""

    def needs_materialization(self) -> bool:
        return False

    @staticmethod
    def dispatch(query, key, value, attn_bias, causal, scale, dropout_p, enable_gqa=False):  # type: ignore[no-untyped-def]
        scale = (1 / math.sqrt(query.shape[-1])) if scale is None else scale
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=causal, scale=2 * scale, enable_gqa=enable_gqa
        )


def test_user_subclasses() -> None:
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64) for _ in range(3))
    out = sdpa(q, k, v, attn_mask=PrefixLM(2))
    mask = PrefixLM(2).materialize(shape=(6, 6), dtype=torch.float64)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    # a user bias composes with built-ins, soft-cap included (then the eager path runs)
    capped = sdpa(q, k, v, attn_mask=PrefixLM(2) + SoftcapBias(1.0))
    scores = torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8)) + mask
    torch.testing.assert_close(capped, torch.softmax(scores, -1) @ v)
    assert explain(q, k, v, attn_mask=Doubled()).startswith("Doubled.dispatch")
    torch.testing.assert_close(
        sdpa(q, k, v, attn_mask=Doubled(), is_causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=2 / math.sqrt(8)),
    )


def test_public_api_is_complete() -> None:
    names = {
        "AttnBias", "TensorBias", "CausalBias", "CausalVariant", "causal_upper_left",
        "causal_lower_right", "AlibiBias", "SlidingWindowBias", "DocumentBias", "SoftcapBias",
        "sdpa", "patch_sdpa", "explain",
    }  # fmt: skip
    assert names <= set(attnbias.__all__)
    assert attnbias.__all__ == sorted(attnbias.__all__)


def test_import_does_not_import_triton() -> None:
    import subprocess
    import sys

    code = "import sys, attnbias, attnbias.kernels; print('triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_small_tensors_are_copied_to_a_device_once() -> None:
    # a host-to-device copy on every call would synchronise the device with the host
    documents = DocumentBias.from_seqlens([3, 5])
    assert documents.ids_on("cpu")[0] is documents.ids_on(torch.device("cpu"))[0]
    assert documents.ids_on("cpu")[0].shape == (1, 8)
    alibi = AlibiBias(num_heads=4)
    assert alibi.slope_tensor("cpu") is alibi.slope_tensor("cpu")
    assert alibi.slope_tensor("cpu").tolist() == [alibi_slopes(4)]

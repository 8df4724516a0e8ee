"""Bad input gets a ValueError / TypeError that names the values and the fix."""

from __future__ import annotations

import math

import pytest
import torch

from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    sdpa,
)


def qkv(
    batch: int = 1, heads_q: int = 4, heads_kv: int = 4, length_q: int = 6, length_kv: int = 6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.randn(batch, heads_q, length_q, 8),
        torch.randn(batch, heads_kv, length_kv, 8),
        torch.randn(batch, heads_kv, length_kv, 8),
    )


def test_inputs_must_be_4d() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"query must be 4-D .* got shape \(4, 6, 8\)"):
        sdpa(q[0], k, v)


def test_mismatched_batch_head_dim_dtype_device() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="batch sizes differ"):
        sdpa(q, k.expand(2, -1, -1, -1), v)
    with pytest.raises(ValueError, match="E=8 and 4"):
        sdpa(q, k[..., :4], v)
    with pytest.raises(TypeError, match="share a dtype"):
        sdpa(q, k.double(), v)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        sdpa(q, k.tolist(), v)  # type: ignore[arg-type]
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="one device"):
            sdpa(q, k.cuda(), v)


def test_gqa_errors() -> None:
    q, k, v = qkv(heads_q=6, heads_kv=4)
    with pytest.raises(ValueError, match="Hq=6 and Hkv=4. Hq must be a multiple of Hkv"):
        sdpa(q, k, v, enable_gqa=True)
    q, k, v = qkv(heads_q=8, heads_kv=4)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        sdpa(q, k, v)
    assert sdpa(q, k, v, enable_gqa=True).shape == q.shape


def test_bad_dropout_and_scale() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p"):
        sdpa(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="scale"):
        sdpa(q, k, v, scale=math.nan)
    with pytest.raises(TypeError, match="attn_mask must be"):
        sdpa(q, k, v, attn_mask="causal")  # type: ignore[arg-type]


def test_tensor_bias_that_does_not_broadcast() -> None:
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"shape \(5, 6\) does not broadcast .*\(1, 4, 6, 6\)"):
        sdpa(q, k, v, attn_mask=TensorBias(torch.zeros(5, 6)))
    with pytest.raises(TypeError, match="dtype=torch.int64"):
        TensorBias(torch.zeros(6, 6, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        TensorBias([[0.0]])  # type: ignore[arg-type]


def test_document_ids() -> None:
    with pytest.raises(ValueError, match="decreases at position 2"):
        DocumentBias(torch.tensor([0, 1, 0]))
    with pytest.raises(TypeError, match="integer document ids"):
        DocumentBias(torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"shape \(L,\) or \(B, L\)"):
        DocumentBias(torch.zeros(1, 2, 3, dtype=torch.long))
    q, k, v = qkv(length_q=6, length_kv=6)
    with pytest.raises(ValueError, match="length 5 but the call has L=6"):
        sdpa(q, k, v, attn_mask=DocumentBias.from_seqlens([2, 3]))
    q, k, v = qkv(length_q=5, length_kv=6)
    with pytest.raises(ValueError, match="pass kv_doc_ids when S != L"):
        sdpa(q, k, v, attn_mask=DocumentBias.from_seqlens([2, 3]))
    q, k, v = qkv(batch=3)
    with pytest.raises(ValueError, match="batch size B=3"):
        sdpa(q, k, v, attn_mask=DocumentBias(torch.zeros(2, 6, dtype=torch.long)))
    with pytest.raises(ValueError, match="one kv length per document"):
        DocumentBias.from_seqlens([2, 3], [5])
    with pytest.raises(ValueError, match="non-negative"):
        DocumentBias.from_seqlens([2, -1])


def test_softcap_and_window_values() -> None:
    for cap in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="cap must be finite and > 0"):
            SoftcapBias(cap)
    with pytest.raises(TypeError, match="positive float"):
        SoftcapBias("50")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window_left must be >= 0.*got -1"):
        SlidingWindowBias(-1)
    with pytest.raises(ValueError, match="window_right must be >= 0"):
        SlidingWindowBias(3, -2)
    with pytest.raises(TypeError, match="int or None"):
        SlidingWindowBias(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at most one SoftcapBias"):
        SoftcapBias(1.0) + SoftcapBias(2.0)


def test_alibi_values() -> None:
    with pytest.raises(ValueError, match="exactly one of num_heads or slopes"):
        AlibiBias()
    with pytest.raises(ValueError, match="exactly one"):
        AlibiBias(num_heads=4, slopes=torch.ones(4))
    with pytest.raises(ValueError, match="shape"):
        AlibiBias(slopes=torch.ones(1, 2, 4))
    q, k, v = qkv(heads_q=4, heads_kv=4)
    with pytest.raises(ValueError, match="slopes for 3 heads but the query has Hq=4"):
        sdpa(q, k, v, attn_mask=AlibiBias(num_heads=3))
    q, k, v = qkv(batch=3)
    with pytest.raises(ValueError, match="batch size B=3"):
        sdpa(q, k, v, attn_mask=AlibiBias(slopes=torch.ones(2, 4)))


def test_causal_variant() -> None:
    from attnbias import CausalBias

    with pytest.raises(ValueError, match="UPPER_LEFT or LOWER_RIGHT"):
        CausalBias(7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive int"):
        causal_lower_right(0, 4)


def test_subclass_with_neither_path() -> None:
    with pytest.raises(TypeError, match="neither materialize\\(\\) nor dispatch\\(\\)"):

        class Empty(AttnBias):
            def needs_materialization(self) -> bool:
                return False

    class MaterializeOnly(AttnBias):
        def materialize(self, device=None, *, shape=None, dtype=None):  # type: ignore[no-untyped-def]
            return torch.zeros(6, 6)

        def needs_materialization(self) -> bool:
            return False  # a lie: it has no dispatch

    q, k, v = qkv()
    with pytest.raises(TypeError, match="does not implement dispatch"):
        sdpa(q, k, v, attn_mask=MaterializeOnly())


def test_use_backends_takes_a_name_a_list_or_a_tuple_as_exclude_does() -> None:
    from attnbias import explain, use_backends

    q, k, v = qkv()
    for pin in ("reference", ["reference"], ("reference", "sdpa+mask")):
        with use_backends(pin):
            assert explain(q, k, v, attn_mask=SlidingWindowBias(3)).startswith("reference:")
    with (
        pytest.raises(TypeError, match="named by a string, got 3 of type int; the backends"),
        use_backends(3),  # type: ignore[arg-type]
    ):
        pass


def test_excluding_every_backend_says_which_are_excluded() -> None:
    from attnbias import use_backends
    from attnbias.planner import BACKENDS

    q, k, v = qkv()
    with (
        use_backends(exclude=list(BACKENDS)),
        pytest.raises(ValueError, match=r"Every backend that could run it is excluded .*"
                                        r"excluded \['fa4', 'gluon', 'reference'.*\]\)\. "
                                        r"Allow more"),
    ):  # fmt: skip
        sdpa(q, k, v, attn_mask=SlidingWindowBias(3))


def test_a_functions_own_exception_surfaces_as_itself() -> None:
    """An exception a mask function raises itself is that exception (with a note naming the
    function where Python keeps notes); an operation a traced value lacks is a trace error
    that names it."""
    import sys

    from attnbias import ModBias

    q, k, v = qkv()

    def own(b: object, h: object, q_idx: object, kv_idx: object) -> object:
        raise KeyError("window must be set first")

    with pytest.raises(KeyError, match="window must be set first") as raised:
        sdpa(q, k, v, attn_mask=ModBias(mask_mod=own))
    if sys.version_info >= (3, 11):
        assert raised.value.__notes__ == ["(raised by mask_mod " + own.__qualname__
                                          + " while attnbias traced it)"]  # fmt: skip

    def lacking(b: object, h: object, q_idx: object, kv_idx: object) -> object:
        return q_idx.cumsum(0) > 0  # type: ignore[attr-defined]

    with pytest.raises(TypeError, match="failed while being traced .*'cumsum'"):
        sdpa(q, k, v, attn_mask=ModBias(mask_mod=lacking))


def test_pytorchs_causal_bias_is_taken_as_ours() -> None:
    """``torch.nn.attention.bias.causal_lower_right(L, S)`` as attn_mask and in ``+``: the
    causal bias of the same alignment and lengths (no plain-Tensor warning), checked against
    the call's lengths; stock PyTorch with the same object is the reference."""
    import warnings

    from torch.nn.attention.bias import causal_lower_right as torch_lower_right
    from torch.nn.attention.bias import causal_upper_left as torch_upper_left

    q, k, v = qkv(length_q=4, length_kv=6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "plain Tensor" warning
        out = sdpa(q, k, v, attn_mask=torch_lower_right(4, 6))
    wide = [t.double() for t in (q, k, v)]
    expected = torch.nn.functional.scaled_dot_product_attention(
        *wide, attn_mask=causal_lower_right(4, 6).materialize(dtype=torch.float64)
    )
    assert (out.double() - expected).abs().max() < 1e-6
    assert repr(torch_upper_left(4, 6) + SlidingWindowBias(2)) == (
        "CausalBias(UPPER_LEFT, seq_len_q=4, seq_len_kv=6) + "
        "SlidingWindowBias(window_left=2, window_right=0)"
    )
    assert repr(SlidingWindowBias(2) + torch_lower_right(4, 6)).endswith(
        "CausalBias(LOWER_RIGHT, seq_len_q=4, seq_len_kv=6)"
    )
    with pytest.raises(ValueError, match="built for L=5, S=6 but .* asks for L=4, S=6"):
        sdpa(q, k, v, attn_mask=torch_lower_right(5, 6))


def test_adding_a_plain_tensor_to_a_bias_says_to_wrap_it() -> None:
    for add in (lambda b, t: b + t, lambda b, t: t + b):
        with pytest.raises(TypeError, match=r"shape \(4, 6\) .* wrap the tensor in "
                                            r"attnbias.TensorBias"):  # fmt: skip
            add(SlidingWindowBias(2), torch.zeros(4, 6))
    assert repr(sum([SlidingWindowBias(2), causal_lower_right()])) == repr(
        SlidingWindowBias(2) + causal_lower_right()
    )


@pytest.mark.parametrize("route", ["reference", "triton"])
def test_a_mask_function_of_a_constant_or_a_number(route: str) -> None:
    """A mask function returning Python ``False`` keeps nothing (rows of zeros) and ``True``
    everything (stock SDPA without a mask); one returning an int or a float is refused,
    naming the rewrite, instead of being read as ``!= 0``."""
    from attnbias import ModBias, use_backends

    q = torch.randn(1, 2, 16, 16)
    with use_backends(route):
        nothing = sdpa(q, q, q, attn_mask=ModBias(mask_mod=lambda b, h, i, j: False))
        assert torch.equal(nothing, torch.zeros_like(q))
        everything = sdpa(q, q, q, attn_mask=ModBias(mask_mod=lambda b, h, i, j: True))
        wide = q.double()
        expected = torch.nn.functional.scaled_dot_product_attention(wide, wide, wide)
        assert (everything.double() - expected).abs().max() < 1e-5
        for fn, kind in ((lambda b, h, i, j: i - j, "an int"), (lambda b, h, i, j: i * 0.5,
                                                                "a float")):  # fmt: skip
            with pytest.raises(TypeError, match=f"returns {kind} value, not a bool: .* != 0"):
                sdpa(q, q, q, attn_mask=ModBias(mask_mod=fn))

"""FlexAttention's own mask helpers (``and_masks``, ``or_masks``, ``noop_mask``), the
one-value constructors they use (``new_ones``, ``new_zeros``, ``ones_like``, ...), the exp / log
family (``exp2`` as attention-gym's ALiBi uses it, ``log1p``, ...) and powers in a ModBias:
each against the fp64 oracle (``attnbias.testing.oracle``, which runs the functions eagerly), on the
exact path and on the Triton kernel (interpreted on the CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

import attnbias
from attnbias import ModBias, use_backends
from attnbias.testing.oracle import assert_call_close

SHAPE = (1, 2, 16, 16)  # B, H, L = S, E


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx


def near(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (q_idx - kv_idx).abs() <= 3


def first(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx == torch.zeros_like(kv_idx)


def scaled(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score * score.new_full((), 0.5) + torch.full_like(score, 0.25) * h


MASKS = {
    "and_masks": and_masks(causal, near),
    "or_masks": or_masks(causal, first),
    "noop_mask": noop_mask,
    "and of none": and_masks(),
    "new_zeros": lambda b, h, q_idx, kv_idx: (
        (q_idx - kv_idx).new_zeros((), dtype=torch.bool) | causal(b, h, q_idx, kv_idx)
    ),
    "ones_like": lambda b, h, q_idx, kv_idx: (
        torch.ones_like(q_idx, dtype=torch.bool) & near(b, h, q_idx, kv_idx)
    ),
}


def _check(route: str, bias: ModBias, inputs: tuple[Tensor, Tensor, Tensor], grad: Tensor) -> None:
    """The call on ``route`` against the oracle; on the kernel, within a flash kernel's budget
    (its own rounding included)."""
    with use_backends(route):
        assert_call_close(
            lambda *t: attnbias.sdpa(*t, attn_mask=bias), bias, inputs, grad,
            flash=route == "triton",
        )  # fmt: skip


@pytest.mark.parametrize("route", ["reference", "triton"])
@pytest.mark.parametrize("name", list(MASKS))
def test_flex_mask_helpers(name: str, route: str) -> None:
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(SHAPE, generator=generator) for _ in range(4))
    bias = ModBias(mask_mod=MASKS[name], score_mod=scaled if name == "and_masks" else None)
    _check(route, bias, (q, k, v), grad)


def test_a_new_tensor_of_more_than_one_value_is_refused() -> None:
    def rows(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return b.new_ones((4,), dtype=torch.bool)[0] & causal(b, h, q_idx, kv_idx)

    q = torch.randn(SHAPE)
    with pytest.raises(TypeError, match=r"a new tensor of size \(4,\) .* use size \(\)"):
        attnbias.sdpa(q, q, q, attn_mask=ModBias(mask_mod=rows))


def gym_alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """attention-gym's ALiBi: slopes 2 ** (-8 (h + 1) / H) through torch.exp2."""
    return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / SHAPE[1]))


def exp_log_family(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return (
        score
        + 0.01 * (q_idx - kv_idx) ** 2
        + 2 ** (-(h + 1.0))
        + 0.1 * torch.log1p(q_idx + 0.0)
        + 0.1 * torch.log2(kv_idx + 1.0)
        - torch.expm1(h * 0.1)
        + torch.rsqrt(kv_idx + 1.0)
        + 0.01 * torch.square(q_idx * 0.5)
        + 0.1 * torch.log10(kv_idx + 2.0)
        + torch.pow(score, 1) * 0.0
    )


@pytest.mark.parametrize("route", ["reference", "triton"])
@pytest.mark.parametrize("score_mod", [gym_alibi, exp_log_family])
def test_the_exp_log_family_and_powers(score_mod: Any, route: str) -> None:
    generator = torch.Generator().manual_seed(1)
    q, k, v, grad = (torch.randn(SHAPE, generator=generator) for _ in range(4))
    bias = ModBias(mask_mod=causal, score_mod=score_mod)
    _check(route, bias, (q, k, v), grad)


def test_a_power_that_does_not_compile_names_the_rewrite() -> None:
    q = torch.randn(SHAPE)
    for fn, said in (
        (lambda s, b, h, i, j: s + (i - j) ** 1.5, r"x \*\* 1.5 .* torch.exp\(y \* torch.log"),
        (lambda s, b, h, i, j: s + (-2) ** i, r"-2 \*\* x \(only a positive number"),
    ):
        with pytest.raises(TypeError, match=said):
            attnbias.sdpa(q, q, q, attn_mask=ModBias(score_mod=fn))


def floor_of_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return score + 0.01 * (score // 0.5)


WIDE_TABLE = torch.randn(SHAPE[2], dtype=torch.float64, generator=torch.Generator().manual_seed(2))


def wide_table(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    """A float64 table with float32 inputs: eager promotion, the score kept in float32."""
    return score + WIDE_TABLE[kv_idx]


@pytest.mark.parametrize("route", ["reference", "triton"])
def test_a_wider_table_promotes_as_eager_does(route: str) -> None:
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(SHAPE, generator=generator) for _ in range(4))
    bias = ModBias(score_mod=wide_table)
    _check(route, bias, (q, k, v), grad)


@pytest.mark.parametrize("route", ["reference", "triton"])
def test_float_floor_division(route: str) -> None:
    """Forward only: eager PyTorch has no derivative for floor_divide."""
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(SHAPE, generator=generator) for _ in range(3))
    with use_backends(route):
        out = attnbias.sdpa(q, k, v, attn_mask=ModBias(score_mod=floor_of_score))
    wide = [t.double() for t in (q, k, v)]
    scores = wide[0] @ wide[1].transpose(-1, -2) / SHAPE[3] ** 0.5
    expected = floor_of_score(scores, None, None, None, None).softmax(-1) @ wide[2]
    assert (out.double() - expected).abs().max() < 1e-5

"""Copies of biases: ``copy.copy``, ``copy.deepcopy`` and ``pickle`` of every kind, built and
used, ``ModBias`` included (its traced functions and generated code hold locks and functions
made at run time, which a copy leaves out and works out again).

A copy computes what the original does (float64, the exact path, against the oracle); a deep
copy of a ``ModBias`` subclass owns copies of its tensor fields (an EMA copy of a model gets
its own tables: writes to them and their gradients are its own); tensors captured in a closure
stay shared, with a warning where one requires grad.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.testing.oracle import attention


def causal_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx


@dataclass(frozen=True, eq=False)
class Table(ModBias):
    """A learnable per-head table of clipped relative positions."""

    table: Tensor  # (H, 7)

    def score_mod(self, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + self.table[h, (kv_idx - q_idx).clamp(-3, 3) + 3]


def _biases() -> list[tuple[str, Any]]:
    torch.manual_seed(0)
    return [
        ("causal", causal_upper_left()),
        ("window + lower-right", SlidingWindowBias(2) + causal_lower_right()),
        ("alibi", AlibiBias(num_heads=2)),
        ("alibi slopes", AlibiBias(slopes=torch.tensor([0.5, 0.25]))),
        ("documents", DocumentBias.from_seqlens([3, 5])),
        ("key ranges", KeyRangeBias([1], [6])),
        ("soft-cap + causal", SoftcapBias(2.0) + causal_upper_left()),
        ("tensor", TensorBias(torch.randn(8, 8))),
        ("mod mask", ModBias(mask_mod=causal_mask)),
        ("mod table", Table(torch.randn(2, 7))),
        ("mod table + window", Table(torch.randn(2, 7)) + SlidingWindowBias(3)),
        ("two mods", Table(torch.randn(2, 7)) + ModBias(mask_mod=causal_mask)),
    ]


def _pickled(bias: Any) -> Any:
    return pickle.loads(pickle.dumps(bias))


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_used_bias_copies_and_computes_what_the_original_does(how: str) -> None:
    make = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": _pickled}[how]
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    for name, bias in _biases():
        attnbias.sdpa(q, k, v, attn_mask=bias)  # used: what it works out for calls is kept
        copied = make(bias)
        assert type(copied) is type(bias), name
        got = attnbias.sdpa(q, k, v, attn_mask=copied)
        want = attention(q, k, v, bias, dtype=torch.float64)
        torch.testing.assert_close(got, want, msg=f"{name}, {how}")


def test_a_deep_copy_owns_its_tables() -> None:
    """Writes into the copy's table change the copy's result only; a backward through the
    copy gives its table a gradient and the original's none."""
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    original = Table(torch.randn(2, 7, dtype=torch.float64, requires_grad=True))
    before = attnbias.sdpa(q, k, v, attn_mask=original).detach()
    twin = copy.deepcopy(original)
    assert twin.table is not original.table and torch.equal(twin.table, original.table)
    assert twin.table.requires_grad
    with torch.no_grad():
        twin.table.mul_(3.0)
    changed = attnbias.sdpa(q, k, v, attn_mask=twin)
    assert not torch.allclose(changed, before)
    torch.testing.assert_close(changed, attention(q, k, v, twin, dtype=torch.float64))
    torch.testing.assert_close(attnbias.sdpa(q, k, v, attn_mask=original), before)
    changed.sum().backward()
    assert twin.table.grad is not None and original.table.grad is None


def test_a_deep_copy_warns_that_closure_tensors_stay_shared() -> None:
    weight = torch.randn(2, requires_grad=True)
    bias = ModBias(score_mod=lambda score, b, h, q_idx, kv_idx: score + weight[h])
    with pytest.warns(UserWarning, match="capture 1 tensor\\(s\\) that require grad"):
        twin = copy.deepcopy(bias)
    assert twin.score_mod is bias.score_mod  # the function, and its tensor, are shared
    frozen = torch.randn(2)
    quiet = ModBias(score_mod=lambda score, b, h, q_idx, kv_idx: score + frozen[h])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy.deepcopy(quiet)


def test_a_model_holding_a_mod_bias_deep_copies() -> None:
    """An EMA copy of a module that holds a used ModBias."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(2, 7, dtype=torch.float64))
            self.bias = Table(self.table)

        def forward(self, q: Tensor) -> Tensor:
            return attnbias.sdpa(q, q, q, attn_mask=self.bias)

    model = Attention()
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    out = model(q)
    ema = copy.deepcopy(model)
    assert ema.bias.table is ema.table  # the memo maps the field to the copy's parameter
    torch.testing.assert_close(ema(q), out)

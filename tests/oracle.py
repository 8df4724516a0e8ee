"""The one oracle of the test-suite, and the error budget.

The oracle is float64 stock PyTorch SDPA on ``bias.materialize(...)``; soft-cap, which has no
materialized form, uses a float64 eager softmax written here (independent of the library's own
eager path). A result passes when its error against the oracle is at most about twice the error
that stock PyTorch makes in the same low precision, plus a floor of a few units in the last place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from attnbias import AttnBias, CausalVariant, SoftcapBias, causal_upper_left
from attnbias.bias import CompositeBias


def _split(bias: AttnBias | None) -> tuple[float | None, AttnBias | None]:
    if bias is None:
        return None, None
    parts = list(bias.parts) if isinstance(bias, CompositeBias) else [bias]
    caps = [p.cap for p in parts if isinstance(p, SoftcapBias)]
    rest = [p for p in parts if not isinstance(p, SoftcapBias)]
    total: AttnBias | None = None
    for part in rest:
        total = part if total is None else total + part
    return (caps[0] if caps else None), total


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    enable_gqa: bool = False,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Attention in ``dtype`` by stock PyTorch (float64 for the oracle, low precision for the
    error budget). Inputs are cast to ``dtype`` first."""
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    if is_causal:
        bias = causal_upper_left() if bias is None else bias + causal_upper_left()
    cap, rest = _split(bias)
    batch, heads, length_q, head_dim = q.shape
    length_kv = k.shape[-2]
    shape = (batch, heads, length_q, length_kv)
    mask = None if rest is None else rest.materialize(q.device, shape=shape, dtype=dtype)
    if cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = cap * torch.tanh(scores / cap)
    if mask is not None:
        scores = scores + mask
    kept = torch.isfinite(scores)
    scores = scores.masked_fill(~kept, -math.inf)
    any_kept = kept.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~any_kept, 0.0), dim=-1) * any_kept
    return weights @ v


def floor(dtype: torch.dtype) -> float:
    """A few units in the last place of ``dtype`` at magnitude one."""
    return 4 * torch.finfo(dtype).eps


def max_error(result: Tensor, reference: Tensor) -> float:
    return (result.double() - reference.double()).abs().max().item() if result.numel() else 0.0


def assert_close_to_oracle(
    results: Sequence[Tensor],
    oracles: Sequence[Tensor],
    stock_low: Sequence[Tensor],
    dtype: torch.dtype,
    names: Sequence[str] = ("out",),
) -> None:
    """Each result's error vs the oracle is at most 2x stock low precision's, plus a floor."""
    for name, result, oracle, stock in zip(names, results, oracles, stock_low, strict=True):
        assert not torch.isnan(result).any(), f"{name}: NaN in result"
        error = max_error(result, oracle)
        # stock low precision can itself fail (NaN, e.g. fp16 with scale 0 on CUDA): the
        # floor alone then
        stock_error = max_error(stock, oracle)
        stock_error = 0.0 if math.isnan(stock_error) else stock_error
        budget = 2 * stock_error + floor(dtype) * max(1.0, oracle.abs().max().item())
        assert error <= budget, (
            f"{name}: max error {error:.3g} vs fp64 oracle exceeds budget {budget:.3g} "
            f"(stock {dtype} error {stock_error:.3g})"
        )


def run_with_grads(fn, inputs: Sequence[Tensor], grad_out: Tensor) -> list[Tensor]:  # type: ignore[no-untyped-def]
    """``[out, *grads]`` of ``fn(*leaves)`` for fresh leaf copies of ``inputs``."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    return [out.detach()] + [
        torch.zeros_like(x) if g is None else g.detach() for x, g in zip(leaves, grads, strict=True)
    ]


__all__ = [
    "CausalVariant",
    "assert_close_to_oracle",
    "attention",
    "floor",
    "max_error",
    "run_with_grads",
]

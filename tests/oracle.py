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
from attnbias.biases import CompositeBias


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
    if q.shape[0] * q.shape[1] * q.shape[2] == 0:
        # No output element: stock SDPA itself ends the process on some of these shapes
        # (Hq = 0 in torch 2.11). Zero gradients: nothing depends on the inputs.
        empty = q.new_zeros((*q.shape[:3], v.shape[-1]))
        return empty + 0 * (q.sum() + k.sum() + v.sum())
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


@torch.no_grad()
def flash_rounding_sizes(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    s: Tensor,
    empty: Tensor,
    scale: float,
) -> tuple[dict[str, float], dict[str, float]]:
    """What a flash-attention kernel's rounding is relative to, per result (fp64 inputs; ``s``
    the ``(B, Hq, L, S)`` scores with masked pairs -inf, ``empty`` the rows that keep nothing,
    which hold finite dummy scores): ``(in_dtype, in_fp32)``, to be multiplied by the epsilon
    of the inputs' dtype and of fp32.

    * in the inputs' dtype: the kernel rounds ``P`` and ``dS = P * (dP - delta)`` to it before
      the products ``P V``, ``P^T dO``, ``dS K``, ``dS^T Q``, so each result is off by eps
      times the size of its terms, ``|P| |V|`` and so on, which can exceed the result itself
      where the terms cancel; and ``delta = rowsum(dO * O)`` reads the output as stored in
      that dtype, which moves ``dS`` by ``P * rowsum(|dO| |O|)`` times eps;
    * in fp32: the kernel recomputes ``P = exp(s - lse)`` from a stored log-sum-exp, so
      rounding ``s`` or ``lse`` moves ``p`` by about ``p * eps * (|s| + |lse|)`` (large with a
      steep ALiBi slope), which eager softmax avoids by rounding only ``s - max``; and
      ``dP - delta`` keeps the rounding of the terms that cancel in it (with one key per row
      the exact dK is 0): ``(P (1 + |s| + |lse|) (|dO| |V|^T + rowsum(|dO| |O|)))``, carried
      through the same products.
    """
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    names = ("out", "dq", "dk", "dv")
    if p.numel() == 0:
        return dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)

    def through_products(p_like: Tensor, ds_like: Tensor) -> dict[str, float]:
        """The four products' term sizes, from sizes standing in for ``P`` and ``dS``."""
        return {
            "out": (p_like @ v.abs()).amax().item(),
            "dv": (p_like.transpose(-1, -2) @ grad_out.abs()).amax().item(),
            "dq": abs(scale) * (ds_like @ k.abs()).amax().item(),
            "dk": abs(scale) * (ds_like.transpose(-1, -2) @ q.abs()).amax().item(),
        }

    dp = grad_out @ v.transpose(-1, -2)
    delta = (grad_out * out).sum(-1, keepdim=True)
    # delta is read from the output as stored, rounded to the inputs' dtype
    delta_terms = (grad_out.abs() * out.abs()).sum(-1, keepdim=True)
    in_dtype = through_products(p, (p * (dp - delta)).abs() + p * delta_terms)
    exponent = s.abs().nan_to_num(posinf=0.0) + lse.nan_to_num(neginf=0.0).abs()[..., None]
    p_error = p * exponent
    cancelling = (p + p_error) * (
        grad_out.abs() @ v.abs().transpose(-1, -2)
        + (grad_out.abs() * out.abs()).sum(-1, keepdim=True)
    )
    return in_dtype, through_products(p_error, cancelling)


@torch.no_grad()
def flash_rounding(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None,
    grad_out: Tensor,
    *,
    scale: float | None = None,
    is_causal: bool = False,
) -> list[float]:
    """The part of a flash-attention kernel's error budget that its own rounding is relative
    to (:func:`flash_rounding_sizes` times the epsilons), for ``out, dq, dk, dv`` of a call
    in ``query.dtype``: to pass as ``rounding`` to :func:`assert_close_to_oracle`."""
    dtype = query.dtype
    q, k, v, g = (t.detach().double() for t in (query, key, value, grad_out))
    if is_causal:
        bias = causal_upper_left() if bias is None else bias + causal_upper_left()
    cap, rest = _split(bias)
    batch, heads, length_q, head_dim = q.shape
    length_kv = k.shape[-2]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    group = heads // k.shape[1]
    s = (q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    if rest is not None:
        shape = (batch, heads, length_q, length_kv)
        s = s + rest.materialize(q.device, shape=shape, dtype=torch.float64)
    keep = torch.isfinite(s)
    empty = ~keep.any(dim=-1, keepdim=True)
    s = s.masked_fill(~keep, -math.inf).masked_fill(empty, 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty[..., 0], -math.inf)
    p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    out = p @ v.repeat_interleave(group, dim=1)
    in_dtype, in_fp32 = flash_rounding_sizes(q, k, v, out, lse, g, s, empty, scale)
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    return [eps * in_dtype[n] + eps32 * in_fp32[n] for n in ("out", "dq", "dk", "dv")]


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
    rounding: Sequence[float] | None = None,
) -> None:
    """Each result's error vs the oracle is at most 2x stock low precision's, plus a floor,
    plus (for a flash-attention kernel) what its own rounding is relative to (``rounding``,
    from :func:`flash_rounding`)."""
    extra = list(rounding) if rounding is not None else [0.0] * len(names)
    for name, result, oracle, stock, own in zip(
        names, results, oracles, stock_low, extra, strict=True
    ):
        assert not torch.isnan(result).any(), f"{name}: NaN in result"
        error = max_error(result, oracle)
        # stock low precision can itself fail (NaN, e.g. fp16 with scale 0 on CUDA): the
        # floor alone then
        stock_error = max_error(stock, oracle)
        stock_error = 0.0 if math.isnan(stock_error) else stock_error
        budget = 2 * stock_error + floor(dtype) * max(1.0, oracle.abs().max().item()) + own
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
    "flash_rounding",
    "flash_rounding_sizes",
    "floor",
    "max_error",
    "run_with_grads",
]

"""The exact eager path: the semantics of the README, written out with plain tensor operations.

It materializes the ``(B, Hq, L, S)`` scores, so it is meant for CPU tensors, for what the fused
kernel does not cover (dropout with soft-cap, user biases combined with soft-cap), and as a
readable statement of the semantics.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnbias.bias import AttnBias, CompositeBias, SoftcapBias, parts_of

__all__ = ["reference_attention"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs are computed in float32: the path is exact up to float32 rounding.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def split_softcap(bias: AttnBias | None) -> tuple[float | None, AttnBias | None]:
    """``(cap, rest)``: the soft-cap of ``bias`` (if any) and the sum of its other parts."""
    parts = parts_of(bias)
    caps = [p.cap for p in parts if isinstance(p, SoftcapBias)]
    rest = [p for p in parts if not isinstance(p, SoftcapBias)]
    cap = caps[0] if caps else None
    if not rest:
        return cap, None
    return cap, rest[0] if len(rest) == 1 else CompositeBias(tuple(rest))


def reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None = None,
    *,
    scale: float | None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> Tensor:
    """Attention computed eagerly, exactly as specified.

    Args:
        query: ``(B, Hq, L, E)``.
        key: ``(B, Hkv, S, E)``.
        value: ``(B, Hkv, S, Ev)``.
        bias: any :class:`AttnBias` (soft-cap included), or ``None``.
        scale: defaults to ``1 / sqrt(E)``.
        dropout_p: dropout on the attention weights.
        enable_gqa: share each key/value head among ``Hq // Hkv`` query heads.

    Returns:
        ``(B, Hq, L, Ev)`` in the dtype of ``query``. Half-precision inputs are computed in
        float32. A query row with no kept key gives 0, and its gradients are 0.
    """
    batch, heads_q, length_q, head_dim = query.shape
    length_kv = key.shape[-2]
    compute = _compute_dtype(query.dtype)
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    if enable_gqa and key.shape[1] != heads_q:
        group = heads_q // key.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    scores = (q @ k.transpose(-2, -1)) * scale  # (B, Hq, L, S)
    cap, rest = split_softcap(bias)
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if rest is not None:
        additive = rest.materialize(
            query.device, shape=(batch, heads_q, length_q, length_kv), dtype=compute
        )
        scores = scores + additive

    # Softmax that maps a row with no finite score to all-zero weights (and zero gradients)
    # instead of NaN: subtract a finite row maximum and guard the denominator.
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(denom == 0, torch.ones_like(denom), denom)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p)
    return (weights @ v).to(query.dtype)

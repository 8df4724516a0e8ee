"""Lowering built-in biases to the kernel's model, and choosing the route of a call.

Every built-in mask and every sum of them is a diagonal band intersected with documents::

    keep(i, j) = band_lo <= j - i <= band_hi  and  doc_q[i] == doc_kv[j]

plus two score modifiers (soft-cap, ALiBi). :func:`lower` computes that form; :func:`plan`
chooses where the call runs and why, so that :func:`attnbias.sdpa` and
:func:`attnbias.explain` can never disagree.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from attnbias.bias import (
    AlibiBias,
    AttnBias,
    CausalBias,
    CausalVariant,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
    parts_of,
)
from attnbias.reference import reference_attention

__all__ = ["Lowered", "Route", "lower", "plan", "stock_sdpa", "with_causal"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_KERNEL_HEAD_DIM = 256


@dataclass(frozen=True, eq=False)
class Lowered:
    """A bias in the kernel's terms for one call of shape ``(B, Hq, L, S)``."""

    band_lo: int | None
    band_hi: int | None
    q_doc: Tensor | None  # (1 or B, L) int64
    kv_doc: Tensor | None  # (1 or B, S) int64
    slopes: Tensor | None  # (1 or B, Hq) float32
    softcap: float | None
    others: tuple[AttnBias, ...]  # parts with no kernel form (materialized additively)

    @property
    def _band_only(self) -> bool:
        return (
            self.q_doc is None and self.slopes is None and self.softcap is None and not self.others
        )

    @property
    def is_plain_causal(self) -> bool:
        return self._band_only and self.band_lo is None and self.band_hi == 0

    @property
    def is_empty(self) -> bool:
        return self._band_only and self.band_lo is None and self.band_hi is None

    def describe(self) -> str:
        terms = []
        if self.band_lo is not None or self.band_hi is not None:
            lo = "-inf" if self.band_lo is None else str(self.band_lo)
            hi = "+inf" if self.band_hi is None else str(self.band_hi)
            terms.append(f"band {lo} <= j - i <= {hi}")
        if self.q_doc is not None:
            terms.append("documents")
        if self.slopes is not None:
            terms.append("ALiBi")
        if self.softcap is not None:
            terms.append(f"soft-cap {self.softcap:g}")
        terms += [f"{type(p).__name__} (materialized)" for p in self.others]
        return ", ".join(terms) if terms else "no mask"


def _merge_docs(
    first: tuple[Tensor, Tensor], second: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """Ids whose equality means equality under both document layouts (still non-decreasing)."""
    q1, kv1 = first
    q2, kv2 = second
    low = torch.minimum(q2.min(), kv2.min())
    span = torch.maximum(q2.max(), kv2.max()) - low + 1
    return (q1 * span + (q2 - low)), (kv1 * span + (kv2 - low))


def lower(bias: AttnBias | None, length_q: int, length_kv: int, device: torch.device) -> Lowered:
    """Lower ``bias`` to a band, documents and score modifiers for a call with ``(L, S)``."""
    band_lo: int | None = None
    band_hi: int | None = None
    docs: tuple[Tensor, Tensor] | None = None
    slopes: Tensor | None = None
    softcap: float | None = None
    others: list[AttnBias] = []

    def tighten(lo: int | None, hi: int | None) -> None:
        nonlocal band_lo, band_hi
        if lo is not None:
            band_lo = lo if band_lo is None else max(band_lo, lo)
        if hi is not None:
            band_hi = hi if band_hi is None else min(band_hi, hi)

    for part in parts_of(bias):
        if isinstance(part, CausalBias):
            tighten(None, part.offset_hi(length_q, length_kv))
        elif isinstance(part, SlidingWindowBias):
            tighten(*part.offsets(length_q, length_kv))
        elif isinstance(part, DocumentBias):
            # One document bias passes its cached device tensors on unchanged, so the kernel
            # can recognise them from call to call; the kernel broadcasts (1, L) against (B, S).
            new = part.ids_on(device)
            if docs is not None:
                rows = max(t.shape[0] for t in new + docs)  # 1 or B
                docs = _merge_docs(
                    (docs[0].expand(rows, -1), docs[1].expand(rows, -1)),
                    (new[0].expand(rows, -1), new[1].expand(rows, -1)),
                )
            else:
                docs = new
        elif isinstance(part, AlibiBias):
            term = part.slope_tensor(device)
            slopes = term if slopes is None else slopes + term
        elif isinstance(part, SoftcapBias):
            softcap = part.cap
        else:
            others.append(part)

    # A side of the band that every (i, j) satisfies is no constraint at all.
    if band_lo is not None and band_lo <= -(length_q - 1):
        band_lo = None
    if band_hi is not None and band_hi >= length_kv - 1:
        band_hi = None
    return Lowered(
        band_lo=band_lo,
        band_hi=band_hi,
        q_doc=None if docs is None else docs[0].contiguous(),
        kv_doc=None if docs is None else docs[1].contiguous(),
        slopes=None if slopes is None else slopes.contiguous(),
        softcap=softcap,
        others=tuple(others),
    )


@dataclass(frozen=True)
class Route:
    """Where a call runs (``name``), why (``reason``), and how (``run``)."""

    name: str
    reason: str
    run: Callable[[], Tensor]

    def __str__(self) -> str:
        return f"{self.name}: {self.reason}"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_obstacle(
    query: Tensor, key: Tensor, value: Tensor, lowered: Lowered, dropout_p: float
) -> str | None:
    """Why the Triton kernel cannot take this call, or ``None`` when it can."""
    if query.device.type != "cuda" and not (query.device.type == "cpu" and _interpreting()):
        return f"the Triton kernel needs CUDA tensors and these are on {query.device.type}"
    if dropout_p > 0.0:
        return f"dropout_p={dropout_p} is not fused in the Triton kernel"
    if lowered.others:
        names = ", ".join(type(p).__name__ for p in lowered.others)
        return f"{names} has no kernel form"
    if query.dtype not in _KERNEL_DTYPES:
        return f"dtype {query.dtype} is not one of the kernel's (float16, bfloat16, float32)"
    if value.shape[-1] != query.shape[-1]:
        return (
            f"the value head dim ({value.shape[-1]}) differs from the query head dim "
            f"({query.shape[-1]})"
        )
    if query.shape[-1] > _MAX_KERNEL_HEAD_DIM:
        return f"head dim {query.shape[-1]} is above the kernel's {_MAX_KERNEL_HEAD_DIM}"
    if not torch.compiler.is_compiling() and not _triton_installed():
        return "Triton is not installed"
    return None


@functools.cache
def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def stock_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Tensor:
    return _original_sdpa(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


# Kept at import so that patch_sdpa() can never make the library call itself.
_original_sdpa = F.scaled_dot_product_attention


def _run_kernel(
    query: Tensor, key: Tensor, value: Tensor, lowered: Lowered, scale: float
) -> Tensor:
    from kernels import block_sparse_attention

    return block_sparse_attention(
        query,
        key,
        value,
        scale=scale,
        band_lo=lowered.band_lo,
        band_hi=lowered.band_hi,
        q_doc=lowered.q_doc,
        kv_doc=lowered.kv_doc,
        alibi_slopes=lowered.slopes,
        softcap=lowered.softcap,
    )


def plan(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None,
    causal: bool,
    scale: float | None,
    dropout_p: float,
    enable_gqa: bool,
) -> Route:
    """Choose the route of a call whose bias is built from the library's own biases."""
    batch, heads, length_q, head_dim = query.shape
    length_kv = key.shape[-2]
    bias = with_causal(bias, causal)
    lowered = lower(bias, length_q, length_kv, query.device)
    stock = partial(
        stock_sdpa, query, key, value, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )
    described = lowered.describe()

    if lowered.is_empty:
        return Route(
            "sdpa", f"{described}: stock SDPA without a mask", partial(stock, is_causal=False)
        )
    if lowered.is_plain_causal:
        return Route(
            "sdpa(is_causal=True)",
            f"{described} is plain upper-left causal, which stock SDPA's fused causal kernels "
            f"(cuDNN / FlashAttention on CUDA) run faster than the Triton kernel",
            partial(stock, is_causal=True),
        )
    obstacle = _kernel_obstacle(query, key, value, lowered, dropout_p)
    if obstacle is None:
        kernel_scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        return Route(
            "triton",
            f"{described} runs in the block-sparse Triton kernel, skipping masked blocks",
            partial(_run_kernel, query, key, value, lowered, kernel_scale),
        )
    shape = (batch, heads, length_q, length_kv)
    reference = partial(
        reference_attention,
        query,
        key,
        value,
        bias,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=enable_gqa,
    )
    if lowered.softcap is not None:
        return Route(
            "reference",
            f"{described}: {obstacle}, and soft-cap has no materialized form, so the exact "
            f"eager path runs (it materializes the scores)",
            reference,
        )
    if lowered.slopes is not None and query.dtype in (torch.float16, torch.bfloat16):
        return Route(
            "reference",
            f"{described}: {obstacle}; ALiBi materialized in {query.dtype} would lose precision, "
            f"so the exact eager path runs in float32",
            reference,
        )

    def materialized() -> Tensor:
        assert bias is not None  # not empty, see above
        mask = bias.materialize(query.device, shape=shape, dtype=query.dtype)
        return stock(attn_mask=mask, is_causal=False)

    return Route(
        "sdpa+mask",
        f"{described}: {obstacle}, so stock SDPA runs with the materialized (L, S) mask",
        materialized,
    )


def with_causal(bias: AttnBias | None, causal: bool) -> AttnBias | None:
    """``bias`` with ``is_causal=True`` folded in: ``bias + CausalBias(UPPER_LEFT)``."""
    if not causal:
        return bias
    causal_part = CausalBias(CausalVariant.UPPER_LEFT)
    return causal_part if bias is None else bias + causal_part

"""The materialized form every materializing route shares, and the checks of what a user
class's ``materialize`` and ``dispatch`` return.

Each bias gives its own form (:meth:`attnbias.AttnBias.masked`); a sum merges its parts'
forms (:meth:`MaskedBias.merge`). Shape legend: ``B`` batch, ``H`` heads, ``L`` queries, ``S``
keys, ``Ev`` value head dim.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

Device = torch.device | str | int | None

__all__ = [
    "MaskedBias",
    "check_dispatched",
    "check_materialized",
    "compute_dtype",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is materialized in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _keep_to_additive(keep: Tensor, dtype: torch.dtype) -> Tensor:
    zeros = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zeros, torch.full((), -math.inf, dtype=dtype, device=keep.device))


_SOFTCAP_HAS_NO_TENSOR = (
    "SoftcapBias transforms the scores (cap * tanh(s / cap)) and has no additive "
    "tensor form; pass it to attnbias.sdpa as attn_mask instead of materializing it"
)


@dataclass(frozen=True, eq=False)
class MaskedBias:
    """A bias as a keep-mask and an additive part, each broadcastable to ``(B, H, L, S)``,
    and the soft-cap of its scores.

    ``keep`` (bool, ``True`` = attend) selects; it is never added to the scores, so a
    non-finite score at a masked pair cannot reach a kept one. ``additive`` is float32 or wider
    and holds only the score biases (its ``-inf`` entries are moved to ``keep``). ``None`` means
    every pair is kept, or nothing is added. ``cap`` (``cap * tanh(s / cap)``, applied to the
    scores before the rest) has no tensor form: a form with one cannot become a tensor.
    """

    keep: Tensor | None
    additive: Tensor | None
    cap: float | None = None
    # score functions (a ModBias's score_mod on the call's grid), applied in order after the
    # additive part; like the cap, they have no tensor form
    score_fns: tuple[Callable[[Tensor], Tensor], ...] = ()
    # (built with every field named: torch.compile 2.11 guards a default a frozen dataclass's
    # constructor takes by a Python call on each run of the compiled function)

    @classmethod
    def of_tensor(cls, result: Tensor, compute: torch.dtype) -> MaskedBias:
        """The form of a checked ``materialize`` result: a bool keep-mask, or an additive
        float tensor whose ``-inf`` entries mask."""
        if result.dtype == torch.bool:
            return cls(result, None, None, ())
        result = result.to(compute)
        masked = torch.isneginf(result)
        return cls(~masked, result.masked_fill(masked, 0.0), None, ())

    def merge(self, other: MaskedBias) -> MaskedBias:
        """Both forms at once: keep-masks intersect, additive parts add up."""
        keep, additive = self.keep, self.additive
        if other.keep is not None:
            keep = other.keep if keep is None else keep & other.keep
        if other.additive is not None:
            additive = other.additive if additive is None else additive + other.additive
        return MaskedBias(
            keep,
            additive,
            self.cap if other.cap is None else other.cap,
            self.score_fns + other.score_fns,
        )

    def narrowed(self, start: int, stop: int) -> MaskedBias:
        """This form for the call's keys ``[start, stop)`` alone: the key dimension of the
        keep-mask and of the additive part sliced (a view; one broadcast over every key stays
        as it is). Not for score functions, which are bound to the whole call's grid."""
        if self.score_fns:
            raise ValueError("a form with score functions cannot be narrowed to some keys")

        def narrow(tensor: Tensor | None) -> Tensor | None:
            if tensor is None or tensor.shape[-1] == 1:
                return tensor
            return tensor[..., start:stop]

        return MaskedBias(narrow(self.keep), narrow(self.additive), self.cap, ())

    def additive_form(self, dtype: torch.dtype) -> Tensor | None:
        """The single float tensor of ``materialize``: ``additive`` with ``-inf`` where masked
        (``None`` when nothing is masked or added)."""
        if self.cap is not None:
            raise TypeError(_SOFTCAP_HAS_NO_TENSOR)
        if self.score_fns:
            raise TypeError(
                "a ModBias score_mod that is not score + something of the indices has no "
                "additive tensor form; pass the bias to attnbias.sdpa as attn_mask instead of "
                "materializing it"
            )
        if self.additive is None:
            return None if self.keep is None else _keep_to_additive(self.keep, dtype)
        if self.keep is None:
            return self.additive.to(dtype)
        return self.additive.masked_fill(~self.keep, -math.inf).to(dtype)

    def tensor(self, dtype: torch.dtype) -> Tensor:
        """:meth:`additive_form`, a zero scalar when nothing is masked or added."""
        form = self.additive_form(dtype)
        return torch.zeros((1, 1), dtype=dtype) if form is None else form


def _expected_device(device: Device) -> torch.device:
    expected = torch.device("cpu") if device is None else torch.device(device)
    if expected.type == "cuda" and expected.index is None:
        expected = torch.device("cuda", torch.cuda.current_device())
    return expected


def check_materialized(
    bias: object, result: Any, shape: tuple[int, ...] | None, device: Device
) -> Tensor:
    """``result`` of ``bias.materialize(device, shape=shape, ...)``, checked for the routes.

    It must be a bool keep-mask (``True`` = attend) or a float additive tensor (``-inf`` =
    masked; no NaN or ``+inf``), on ``device``, broadcastable to ``shape=(B, H, L, S)``.
    Raises ``TypeError`` / ``ValueError`` naming the class, the value and the fix.
    """
    owner = f"{type(bias).__name__}.materialize"
    wanted = (
        f"return a bool keep-mask (True = attend) or a float additive tensor (-inf = masked) "
        f"broadcastable to (B, H, L, S)={shape}"
    )
    if not isinstance(result, Tensor):
        raise TypeError(f"{owner} returned {type(result).__name__}, not a tensor; {wanted}")
    if result.dtype != torch.bool and not result.is_floating_point():
        raise TypeError(
            f"{owner} returned a tensor of dtype={result.dtype}; {wanted} (convert a 0/1 mask "
            f"with .bool())"
        )
    if result.device != _expected_device(device):
        raise ValueError(
            f"{owner} returned a tensor on {result.device} but the inputs are on "
            f"{_expected_device(device)}; create it with device=device"
        )
    try:
        fits = shape is None or torch.broadcast_shapes(result.shape, shape) == torch.Size(shape)
    except RuntimeError:
        fits = False
    if not fits or result.dim() > 4:
        raise ValueError(
            f"{owner} returned a tensor of shape {tuple(result.shape)}, which does not broadcast "
            f"to (B, H, L, S)={shape}; give it a shape such as (L, S), (B, 1, L, S) or (B, H, L, S)"
        )
    if result.dim() < 2:
        result = result.reshape((1,) * (2 - result.dim()) + tuple(result.shape))
    if result.is_floating_point() and not torch.compiler.is_compiling():
        bad = torch.isnan(result) | torch.isposinf(result)
        if bool(bad.any()):
            index = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{owner} returned {result.detach()[index].item()} at index {index} "
                f"({int(bad.sum())} NaN or +inf entries); return 0 where attended, -inf where "
                f"masked and finite values for score biases"
            )
    return result


def check_dispatched(bias: object, result: Any, query: Tensor, value: Tensor) -> Tensor:
    """``result`` of ``type(bias).dispatch(query, key, value, ...)``, checked: a tensor of shape
    ``(B, Hq, L, Ev)`` in the dtype and on the device of ``query``."""
    owner = f"{type(bias).__name__}.dispatch"
    batch, heads, length_q, _ = query.shape
    expected = (batch, heads, length_q, value.shape[-1])
    if not isinstance(result, Tensor):
        raise TypeError(
            f"{owner} returned {type(result).__name__}, not a tensor; return the attention "
            f"output of shape (B, Hq, L, Ev)={expected}"
        )
    if tuple(result.shape) != expected:
        raise ValueError(
            f"{owner} returned shape {tuple(result.shape)}; the attention output must have shape "
            f"(B, Hq, L, Ev)={expected}"
        )
    if result.dtype != query.dtype or result.device != query.device:
        raise TypeError(
            f"{owner} returned a tensor of dtype={result.dtype} on {result.device}; the output "
            f"must match the query: dtype={query.dtype} on {query.device}"
        )
    return result

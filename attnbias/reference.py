"""The exact eager path: the semantics of the README, written out with plain tensor operations.

It materializes the ``(B, Hq, L, S)`` scores, so it is meant for CPU tensors, for what the fused
kernel does not cover (dropout with soft-cap, user biases combined with soft-cap), and as a
readable statement of the semantics.

It also holds the one mechanism by which every materializing route keeps non-finite values at
masked positions out of the results (:class:`FiniteInputs`), and what those routes read of the
keys (:func:`read_keys`: on CPU, only the span of keys some row keeps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias.biases.base import AttnBias, materialize_masked
from attnbias.materialize import MaskedBias, compute_dtype

__all__ = [
    "FiniteInputs",
    "attention_with_lse",
    "attention_with_lse_backward",
    "kept_key_span",
    "masked_reference_attention",
    "read_keys",
    "reference_attention",
]


def _zero_bad_rows(tensor: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(tensor with its rows that hold a non-finite entry zeroed, those rows (bool, all but
    the last dimension))``; ``(tensor, None)`` where every entry is finite.

    One pass when it is: the sum of every entry is finite exactly when each is (a NaN or an
    infinity makes any sum that takes it non-finite), unless the sum overflowed. Only then are
    the rows summed, and checked entry by entry where a row's sum says so (it may only have
    overflowed too)."""
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    data = tensor.detach()  # the checks record no autograd graph
    if data.numel() == 0 or math.isfinite(float(data.sum(dtype=wide))):
        return tensor, None
    bad = ~torch.isfinite(data.sum(-1, dtype=wide))
    if not bool(bad.any()):
        return tensor, bad
    rows = bad.nonzero(as_tuple=True)
    bad[rows] = ~torch.isfinite(data[rows]).all(-1)
    zeroed = tensor.clone()
    zeroed[bad] = 0
    return zeroed, bad


def kept_key_span(keep: Tensor | None, length_kv: int) -> tuple[int, int] | None:
    """``(start, stop)``: the keys ``[start, stop)`` outside of which no row keeps any key,
    from ``keep`` (bool, broadcastable to ``(B, H, L, S)``), or ``None`` where that is every
    key (or ``keep`` cannot tell). Where no row keeps any key, one key, ``[0, 1)``."""
    if keep is None or length_kv == 0 or keep.shape[-1] != length_kv:
        return None
    # the end keys first: where some row keeps each (causal, documents, full masks), the span
    # is every key, found without reading the rest of the mask
    if bool(keep[..., 0].any()) and bool(keep[..., -1].any()):
        return None
    kept = keep.any(dim=tuple(range(keep.dim() - 1))) if keep.dim() > 1 else keep
    columns = kept.nonzero()
    span = (0, 1) if columns.numel() == 0 else (int(columns[0]), int(columns[-1]) + 1)
    return None if span == (0, length_kv) else span


def read_keys(
    key: Tensor, value: Tensor, masked: MaskedBias, *, dropout_p: float = 0.0
) -> tuple[Tensor, Tensor, MaskedBias]:
    """``key`` ``(B, Hkv, S, E)``, ``value`` and ``masked`` narrowed to the keys some row
    keeps (:func:`kept_key_span`), as views: what the exact routes read.

    Why: a key that no row keeps changes no output and no gradient, so it need not be read at
    all; the unfilled end of a key/value cache or the padding of a batch (often NaN) is then
    never checked, copied or multiplied, and the attention is over fewer keys. The gradient of
    a key or value outside the span is 0, through the slice. Not done where the span would
    cost a synchronisation (off the CPU, or under torch.compile, which cannot branch on
    values), under dropout (a seeded call draws the same mask as stock SDPA with the same
    materialized mask) or with score functions (bound to the call's whole grid).
    """
    if (
        dropout_p > 0.0
        or masked.score_fns
        or key.device.type != "cpu"
        or torch.compiler.is_compiling()
    ):
        return key, value, masked
    span = kept_key_span(masked.keep, key.shape[-2])
    if span is None:
        return key, value, masked
    start, stop = span
    return key[:, :, start:stop], value[:, :, start:stop], masked.narrowed(start, stop)


@dataclass(frozen=True, eq=False)
class FiniteInputs:
    """Query, key and value with every non-finite entry replaced by 0, and which rows must
    still come out NaN.

    Why: a keep-mask is per ``(i, j)``, but attention contracts over ``j`` (``weights @ v``
    forward, ``dscores @ k`` backward): a weight of 0 times a NaN value is NaN, so no selection
    of the scores keeps a NaN key or value that row ``i`` does not attend out of row ``i`` (stock
    SDPA's fused kernels do not either, bool mask or not). So the attention runs on the zeroed
    inputs, where every product is finite and masked pairs contribute exactly 0, forward and
    backward; then each row that attends a non-finite key or value, or whose own query is
    non-finite and attends any key, is set to NaN (with a NaN gradient), as stock SDPA would
    give it. A row is poisoned whole: one NaN in a value makes its whole output row NaN.

    Shapes: ``query`` ``(B, Hq, L, E)``, ``key`` ``(B, Hkv, S, E)``, ``value`` ``(B, Hkv, S,
    Ev)``.
    """

    query: Tensor
    key: Tensor
    value: Tensor
    bad_query: Tensor  # (B, Hq, L) bool
    bad_key_value: Tensor  # (B, Hq, S) bool, key/value heads repeated for GQA

    clean: bool = False  # every entry is finite: nothing to poison

    @classmethod
    def of(cls, query: Tensor, key: Tensor, value: Tensor) -> FiniteInputs:
        heads_q, heads_kv = query.shape[1], key.shape[1]
        if query.device.type == "cpu" and not torch.compiler.is_compiling():
            # one sum per tensor finds whether it holds a non-finite entry (no device to wait
            # for here; not under torch.compile, whose graph cannot branch on values), one per
            # row which rows do: a bad row is zeroed whole (its other entries reach only rows
            # that come out NaN anyway), the others are not copied
            (query, bad_query), (key, bad_key), (value, bad_value) = (
                _zero_bad_rows(t) for t in (query, key, value)
            )
            found = [bad for bad in (bad_query, bad_key, bad_value) if bad is not None]
            clean = not any(bool(bad.any()) for bad in found)
            # the rows of a tensor found clean: one False, expanded (nothing allocated)
            no_bad = torch.zeros((), dtype=torch.bool)
            batch, length_q, length_kv = query.shape[0], query.shape[2], key.shape[2]
            if bad_key is None or bad_value is None:
                bad_key_value = bad_value if bad_key is None else bad_key
            else:
                bad_key_value = bad_key | bad_value
            if bad_key_value is None:
                bad_key_value = no_bad.expand(batch, heads_q, length_kv)
            elif heads_kv not in (0, heads_q):
                bad_key_value = bad_key_value.repeat_interleave(heads_q // heads_kv, dim=1)
            if bad_query is None:
                bad_query = no_bad.expand(batch, heads_q, length_q)
            return cls(query, key, value, bad_query, bad_key_value, clean=clean)
        finite = [torch.isfinite(t) for t in (query, key, value)]
        bad_key_value = ~(finite[1].all(-1) & finite[2].all(-1))
        if heads_kv not in (0, heads_q):
            bad_key_value = bad_key_value.repeat_interleave(heads_q // heads_kv, dim=1)
        zero = [torch.zeros((), dtype=t.dtype, device=t.device) for t in (query, key, value)]
        return cls(
            query=torch.where(finite[0], query, zero[0]),
            key=torch.where(finite[1], key, zero[1]),
            value=torch.where(finite[2], value, zero[2]),
            bad_query=~finite[0].all(-1),
            bad_key_value=bad_key_value,
            clean=False,
        )

    def poisoned_rows(self, keep: Tensor | None) -> Tensor:
        """``(B, Hq, L)`` bool: rows that attend a non-finite key/value, or have a non-finite
        query and attend some key. ``keep`` (bool, broadcastable to ``(B, Hq, L, S)``) is the
        whole keep-mask of the call; ``None`` keeps every pair."""
        batch, heads, _ = self.bad_query.shape
        bad = self.bad_key_value
        if bad.shape[-1] == 0 or self.clean:  # no key, or nothing non-finite
            return torch.zeros_like(self.bad_query)
        if keep is None:
            return bad.any(-1, keepdim=True) | (self.bad_query & (bad.shape[-1] > 0))
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        keep_b, keep_h, keep_l, keep_s = keep.shape
        if keep_s == 1:  # one column broadcast over every key
            bad = bad.any(-1, keepdim=True)
        # rows_reached[b, h, i] = any_j keep[b, h, i, j] & bad[b, h, j], as one matmul per
        # (b, h) of the keep-mask's own size: the broadcast batch and head dimensions of the
        # mask become columns of the right operand instead of copies of the mask.
        # [keep_b, keep_h, S', n] with n = (B // keep_b) * (Hq // keep_h)
        right = (
            bad.reshape(keep_b, batch // keep_b, keep_h, heads // keep_h, bad.shape[-1])
            .permute(0, 2, 4, 1, 3)
            .reshape(keep_b, keep_h, bad.shape[-1], -1)
        )
        counts = keep.to(torch.float32) @ right.to(torch.float32)  # [keep_b, keep_h, keep_l, n]
        reached = (
            (counts > 0)
            .reshape(keep_b, keep_h, keep_l, batch // keep_b, heads // keep_h)
            .permute(0, 3, 1, 4, 2)
            .reshape(batch, heads, keep_l)
        )
        return reached | (self.bad_query & keep.any(-1))

    def poison(self, out: Tensor, keep: Tensor | None) -> Tensor:
        """``out`` ``(B, Hq, L, Ev)`` with the poisoned rows NaN, their gradient NaN too."""
        if out.numel() == 0 or self.clean:
            return out
        rows = self.poisoned_rows(keep)[..., None]
        # a product, not a selection: the gradient of a poisoned row is NaN as well, and every
        # other row's passes unchanged (a where would send 0 * NaN to every row's gradient)
        factor = torch.where(rows, math.nan, 1.0).to(out.dtype)
        return out * factor


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
        ``(B, Hq, L, Ev)`` in the dtype of ``query``. Half-precision inputs, and the additive
        biases, are computed in float32. A query row with no kept key gives 0, and its gradients
        are 0. A NaN or Inf in a key or value that a row does not attend does not reach that
        row (nor any gradient of the pairs it attends); one in a key or value that it attends
        makes that row NaN.
    """
    masked = _materialized(query, key, bias)
    return masked_reference_attention(
        query,
        key,
        value,
        masked,
        cap=masked.cap,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=enable_gqa,
    )


def masked_reference_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    masked: MaskedBias,
    *,
    cap: float | None,
    scale: float | None,
    dropout_p: float,
    enable_gqa: bool,
) -> Tensor:
    """:func:`reference_attention` for a bias already materialized as ``masked``."""
    key, value, masked = read_keys(key, value, masked, dropout_p=dropout_p)
    scores, v, inputs = _kept_scores(query, key, value, masked, cap, scale, enable_gqa)

    # Softmax that maps a row with no finite score to all-zero weights (and zero gradients)
    # instead of NaN: subtract a finite row maximum and guard the denominator.
    if scores.shape[-1] == 0:
        row_max = scores.new_zeros((*scores.shape[:-1], 1))
    else:
        row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(denom == 0, torch.ones_like(denom), denom)
    if dropout_p > 0.0:
        weights = torch.nn.functional.dropout(weights, p=dropout_p)
    out = inputs.poison(weights @ v, masked.keep)
    return out.to(query.dtype)


def _scale(query: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _computed(inputs: FiniteInputs, enable_gqa: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The finite query, key and value in the compute dtype, the key/value heads repeated
    for the query heads (GQA)."""
    compute = compute_dtype(inputs.query.dtype)
    q, k, v = inputs.query.to(compute), inputs.key.to(compute), inputs.value.to(compute)
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if enable_gqa and heads_kv not in (0, heads_q):
        k = k.repeat_interleave(heads_q // heads_kv, dim=1)
        v = v.repeat_interleave(heads_q // heads_kv, dim=1)
    return q, k, v


def _scores(q: Tensor, k: Tensor, masked: MaskedBias, cap: float | None, scale: float) -> Tensor:
    """``(B, Hq, L, S)`` scores in the semantics' order (scale, soft-cap, additive terms,
    score functions), not masked."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    if masked.additive is not None:
        scores = scores + masked.additive
    for score_fn in masked.score_fns:
        # a table of a wider dtype promotes the scores, as in eager PyTorch; they go on in
        # the dtype the path computes in (FlexAttention casts a score_mod's result back too)
        scores = score_fn(scores).to(scores.dtype)
    return scores


def _materialized(query: Tensor, key: Tensor, bias: AttnBias | None) -> MaskedBias:
    """``bias`` materialized for the call of ``query`` ``(B, Hq, L, E)`` and ``key``."""
    batch, heads_q, length_q, _ = query.shape
    shape = (batch, heads_q, length_q, key.shape[-2])
    return materialize_masked(bias, query.device, shape, query.dtype)


def _kept_scores(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    masked: MaskedBias,
    cap: float | None,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[Tensor, Tensor, FiniteInputs]:
    """The scores ``(B, Hq, L, S)`` with masked pairs ``-inf``, the value (heads repeated)
    and the finite inputs, all differentiable (tensors that require grad)."""
    inputs = FiniteInputs.of(query, key, value)
    q, k, v = _computed(inputs, enable_gqa)
    scores = _scores(q, k, masked, cap, _scale(query, scale))
    if masked.keep is not None:
        scores = scores.masked_fill(~masked.keep, -math.inf)
    return scores, v, inputs


def _finite_or_zero(lse: Tensor) -> Tensor:
    return torch.where(torch.isfinite(lse), lse, 0.0)


def attention_with_lse(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None,
    *,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[Tensor, Tensor]:
    """Eager attention and its log-sum-exp, for merging with other keys' (no autograd: the
    gradients come from :func:`attention_with_lse_backward`).

    Shapes: ``query`` ``(B, Hq, L, E)``, ``key`` ``(B, Hkv, S, E)``, ``value`` ``(B, Hkv, S,
    Ev)``. Returns ``out`` ``(B, Hq, L, Ev)`` and ``lse`` ``(B, Hq, L)`` (natural log), both in
    :func:`~attnbias.materialize.compute_dtype` of the inputs: a row that keeps no key has
    ``out = 0`` and ``lse = -inf``; a row that attends a non-finite key or value (or whose own
    query is not finite and keeps a key) has both NaN; a non-finite entry it does not attend
    reaches nothing.
    """
    with torch.no_grad():
        masked = _materialized(query, key, bias)
        key, value, masked = read_keys(key, value, masked)
        scores, v, inputs = _kept_scores(query, key, value, masked, masked.cap, scale, enable_gqa)
        lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is kept
        out = torch.exp(scores - _finite_or_zero(lse)[..., None]) @ v
        poisoned = inputs.poisoned_rows(masked.keep)
        out = out.masked_fill(poisoned[..., None], math.nan)
        return out, lse.masked_fill(poisoned, math.nan)


def attention_with_lse_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias | None,
    grad_out: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float | None,
    enable_gqa: bool,
    wrt: Sequence[Tensor] = (),
) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """The gradients of this call's keys' share of a merged attention output (flash-style).

    ``out`` ``(B, Hq, L, Ev)`` and ``lse`` ``(B, Hq, L)`` are the output and log-sum-exp of the
    whole attention these keys are part of (other keys' shares merged in), ``grad_out`` the
    gradient of that output. With ``P = exp(s - lse)`` over this call's pairs, ``dV = P^T dO``
    and ``dS = P * (dO V^T - rowsum(dO * out))``, carried by autograd through the scores to
    the query, the key and ``wrt`` (tensors the bias's scores are computed from: ALiBi slopes,
    a tensor bias, a ModBias table; ``None`` for one they do not reach). Returns ``(dq, dk,
    dv, [d wrt])``, ``dq, dk, dv`` in the inputs' dtypes.
    """
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        masked = _materialized(q, k, bias)  # under grad mode: it reaches ``wrt``
        # sliced: the keys outside the span get a zero gradient
        k_read, v_read, masked = read_keys(k, v, masked)
        scores, v_rep, _ = _kept_scores(q, k_read, v_read, masked, masked.cap, scale, enable_gqa)
        compute = scores.dtype
        weights = torch.exp(scores - _finite_or_zero(lse.to(compute))[..., None])
        grad = grad_out.to(compute)
        delta = (grad * out.to(compute)).sum(-1)  # (B, Hq, L)
        # d/dP of this surrogate is dO V^T - delta, and d/dV is P^T dO
        surrogate = (grad * (weights @ v_rep)).sum() - (delta * weights.sum(-1)).sum()
        wanted = [q, k, v, *(t for t in wrt if t.requires_grad)]
        grads = torch.autograd.grad(surrogate, wanted, allow_unused=True)
    dq, dk, dv = (
        torch.zeros_like(t) if g is None else g.to(t.dtype)
        for t, g in zip((query, key, value), grads[:3], strict=True)
    )
    found = iter(grads[3:])
    return dq, dk, dv, [next(found) if t.requires_grad else None for t in wrt]

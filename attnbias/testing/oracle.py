"""The one oracle of attnbias's tests (and of :func:`attnbias.testing.check_bias`), and the
error budget.

The oracle is float64 stock PyTorch SDPA on ``bias.materialize(...)``; soft-cap, which has no
materialized form, uses a float64 eager softmax written here (independent of the library's own
eager path). A sum holding ``ModBias`` parts takes the same eager softmax, with each part's own
``mask_mod`` / ``score_mod`` evaluated here on broadcast index grids (never its ``materialize``
nor anything else of the library's implementation of it). A result passes when its error
against the oracle is at most about twice the error that stock PyTorch makes in the same low
precision, plus a floor of a few units in the last place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import attnbias
from attnbias import AttnBias, CausalVariant, SoftcapBias, causal_upper_left
from attnbias.biases import CompositeBias

Shape4 = tuple[int, int, int, int]


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


# --------------------------------------------------------------------------------------------
# ModBias parts: their own mask_mod / score_mod on broadcast index grids


def _mod_bias_class() -> type | None:
    """``attnbias.ModBias``, or ``None`` where the library does not have it."""
    return getattr(attnbias, "ModBias", None)


def is_mod_bias(part: object) -> bool:
    cls = _mod_bias_class()
    return cls is not None and isinstance(part, cls)


def has_mod_bias(bias: AttnBias | None) -> bool:
    """Whether ``bias`` is a ModBias or a sum holding one."""
    if bias is None:
        return False
    parts = bias.parts if isinstance(bias, CompositeBias) else (bias,)
    return any(is_mod_bias(p) for p in parts)


def mod_functions(bias: Any) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """``(mask_mod, score_mod)`` of a ModBias: a subclass's bound methods, or the plain
    functions a wrapper ``ModBias(mask_mod=..., score_mod=...)`` holds; ``None`` where absent.

    A method the ModBias class itself defines and the subclass leaves alone counts as absent:
    it is the library's placeholder, not the bias's function, and it can only mean "keep every
    pair" or "leave the score as it is"."""
    cls = _mod_bias_class()
    found: list[Callable[..., Any] | None] = []
    for name in ("mask_mod", "score_mod"):
        function = getattr(bias, name, None)
        placeholder = getattr(cls, name, None) if cls is not None else None
        if callable(placeholder) and getattr(function, "__func__", None) is placeholder:
            function = None
        found.append(function)
    return found[0], found[1]


def function_name(function: Callable[..., Any]) -> str:
    return str(getattr(function, "__qualname__", None) or getattr(function, "__name__", function))


def index_grids(
    batch: int, heads: int, length_q: int, length_kv: int, device: Any = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``b, h, q_idx, kv_idx``: int64 ``arange``s of shapes ``(B, 1, 1, 1)``, ``(1, H, 1, 1)``,
    ``(1, 1, L, 1)`` and ``(1, 1, 1, S)``, which broadcast to the scores' ``(B, H, L, S)``
    (``h`` is the query head, as in FlexAttention)."""

    def along(size: int, dim: int) -> Tensor:
        shape = [1, 1, 1, 1]
        shape[dim] = size
        return torch.arange(size, dtype=torch.int64, device=device).reshape(shape)

    return along(batch, 0), along(heads, 1), along(length_q, 2), along(length_kv, 3)


def _keep_on_grid(result: Any, shape: Shape4, function: Callable[..., Any], device: Any) -> Tensor:
    keep = torch.as_tensor(result, device=device)
    if keep.dtype != torch.bool:
        raise TypeError(
            f"mask_mod {function_name(function)} returned {keep.dtype}; a mask_mod returns bool"
        )
    return keep.broadcast_to(shape)


def grid_mask(
    bias: Any, batch: int, heads: int, length_q: int, length_kv: int, *, device: Any = None
) -> Tensor:
    """``(B, H, L, S)`` bool: the pairs a ModBias's ``mask_mod`` keeps, evaluated once on the
    index grids of :func:`index_grids` (every pair when it has no ``mask_mod``)."""
    shape = (batch, heads, length_q, length_kv)
    mask_mod, _ = mod_functions(bias)
    if mask_mod is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    grids = index_grids(*shape, device=device)
    return _keep_on_grid(mask_mod(*grids), shape, mask_mod, device)


def grid_score(bias: Any, score: Tensor) -> Tensor:
    """A ModBias's ``score_mod`` on ``(B, H, L, S)`` scores and the index grids, broadcast to
    ``score``'s shape and in its dtype (``score`` itself when it has no ``score_mod``)."""
    _, score_mod = mod_functions(bias)
    if score_mod is None:
        return score
    batch, heads, length_q, length_kv = score.shape
    grids = index_grids(batch, heads, length_q, length_kv, device=score.device)
    result = torch.as_tensor(score_mod(score, *grids), device=score.device)
    # in low precision the modified score is rounded to the inputs' dtype, as a materialized
    # bias is: the stock error the budget scales with
    return result.to(score.dtype).broadcast_to(score.shape)


def pointwise(
    function: Callable[..., Any], *args: Tensor, count: int = 12, seed: int = 0
) -> tuple[list[tuple[int, ...]], Tensor]:
    """``function`` called one element at a time, as FlexAttention calls it (under vmap, every
    argument a 0-d tensor): ``args`` (``score`` for a score_mod, then ``b, h, q_idx, kv_idx``,
    e.g. from :func:`index_grids`) broadcast to one shape, and at ``count`` positions of it
    (the first, the last and others drawn with ``seed``) ``function`` gets each argument's 0-d
    element there (int64 for the indices). Returns the positions and the ``(count,)`` results,
    to compare with a grid evaluation at the same positions."""
    shape = torch.broadcast_shapes(*(a.shape for a in args))
    total = math.prod(shape)
    if total == 0:
        return [], torch.empty(0)
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.randperm(total, generator=generator)[: max(count - 2, 0)].tolist()
    flat = list(dict.fromkeys([0, total - 1, *drawn]))[:count]
    positions = []
    for index in flat:
        position = []
        for size in reversed(shape):
            index, rest = divmod(index, size)
            position.append(rest)
        positions.append(tuple(reversed(position)))
    expanded = [a.broadcast_to(shape) for a in args]
    values = [torch.as_tensor(function(*(a[p] for a in expanded))) for p in positions]
    for value in values:
        if value.dim() != 0:
            raise ValueError(
                f"{function_name(function)} returned shape {tuple(value.shape)} for 0-d "
                f"arguments; a mask_mod or score_mod returns one value per element"
            )
    return positions, torch.stack(values)


def _mod_scores(
    q: Tensor, k: Tensor, bias: AttnBias, scale: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Scores of a sum holding ModBias parts, in the semantics' order: ``scale * q k^T``,
    soft-cap, the built-in additive parts (materialized: ALiBi, tensor biases), then each
    ModBias's ``score_mod`` in the order of the sum. Returns the ``(B, H, L, S)`` scores, not
    masked, and the ``(B, H, L, S)`` bool of the pairs every mask keeps (the built-ins', every
    ``mask_mod``, and a ``score_mod`` that returned ``-inf``). ``k`` has the heads of ``q``."""
    return _biased_scores((q @ k.transpose(-1, -2)) * scale, bias, dtype)


def _biased_scores(scores: Tensor, bias: AttnBias, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`_mod_scores` from the scaled dot products ``scores`` ``(B, H, L, S)``."""
    parts = bias.parts if isinstance(bias, CompositeBias) else (bias,)
    mods = [p for p in parts if is_mod_bias(p)]
    caps = [p.cap for p in parts if isinstance(p, SoftcapBias)]
    builtins = [p for p in parts if not is_mod_bias(p) and not isinstance(p, SoftcapBias)]
    shape = tuple(scores.shape)
    device = scores.device
    if caps:
        scores = caps[0] * torch.tanh(scores / caps[0])
    keep = torch.ones(shape, dtype=torch.bool, device=device)
    if builtins:
        rest = builtins[0]
        for part in builtins[1:]:
            rest = rest + part
        tensor = rest.materialize(device, shape=shape, dtype=dtype)
        if tensor.dtype == torch.bool:
            keep = keep & tensor
        else:
            # masked pairs leave the scores: a score_mod after them must not see -inf
            masked = torch.isneginf(tensor)
            keep = keep & ~masked
            scores = scores + tensor.masked_fill(masked, 0.0)
    for part in mods:
        scores = grid_score(part, scores)
        keep = keep & grid_mask(part, *shape, device=device)
    keep = keep & ~torch.isneginf(scores)
    return scores, keep.broadcast_to(shape)


def _kept_softmax(scores: Tensor, keep: Tensor) -> Tensor:
    """Softmax weights of ``scores`` (``-inf`` where not kept) over the last dim; a row that
    keeps nothing gets 0 weights (the semantics' empty rows)."""
    any_kept = keep.any(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~any_kept, 0.0), dim=-1) * any_kept


def shard_pair(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias,
    keys: slice,
    grad_out: Tensor,
    *,
    wrt: Sequence[Tensor] = (),
    dtype: torch.dtype = torch.float64,
) -> list[Tensor]:
    """Context parallelism's oracle for one shard pair: every query of a call against the keys
    ``keys`` of it, in ``dtype`` by stock PyTorch, from ``bias`` over the whole call.

    Returns ``[out, lse, dq, dk, dv, *grads]``: the pair's own attention ``(B, Hq, L, Ev)``
    and natural log-sum-exp ``(B, Hq, L)`` (0 and ``-inf`` for a row the pair keeps nothing
    of), and the gradients of the whole call's output (with ``grad_out``) through this pair
    only: ``dq`` through its scores, ``dk`` and ``dv`` of its keys ``(B, Hkv, S', E)``, and
    those of ``wrt`` (tensors the bias is made from, through the pair's scores)."""
    q, k, v, grad_out = (x.detach().to(dtype) for x in (query, key, value, grad_out))
    group = q.shape[1] // k.shape[1]
    # q twice: one leaf for the pair's columns, one for the rest, so that dq is the pair's
    q_pair, q_rest, k, v = (x.clone().requires_grad_() for x in (q, q, k, v))
    k_all, v_all = (x.repeat_interleave(group, dim=1) for x in (k, v))
    scale = 1 / math.sqrt(q.shape[-1])
    columns = torch.zeros(k.shape[-2], dtype=torch.bool)
    columns[keys] = True
    dots = torch.where(
        columns.to(q.device), q_pair @ k_all.transpose(-1, -2), q_rest @ k_all.transpose(-1, -2)
    )
    scores, keep = _biased_scores(dots * scale, bias, dtype)
    scores = scores.masked_fill(~keep, -math.inf)
    out = _kept_softmax(scores, keep) @ v_all
    wanted = [q_pair, k, v, *wrt]
    grads = torch.autograd.grad(out, wanted, grad_out, allow_unused=True)
    pair_scores, pair_keep = scores[..., keys], keep[..., keys]
    pair_out = (_kept_softmax(pair_scores, pair_keep) @ v_all[..., keys, :]).detach()
    pair_lse = torch.logsumexp(pair_scores, dim=-1).detach()
    dq, dk, dv, *rest = (None if g is None else g.detach() for g in grads)
    assert dq is not None and dk is not None and dv is not None
    return [pair_out, pair_lse, dq, dk[..., keys, :], dv[..., keys, :], *rest]


def whole_call(query: Tensor, key: Tensor, value: Tensor, bias: AttnBias) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of the whole call in float64: what a ring merges from every pair."""
    zeros = torch.zeros(*query.shape[:-1], value.shape[-1], dtype=torch.float64)
    out, lse, *_ = shard_pair(query, key, value, bias, slice(None), zeros.to(query.device))
    return out, lse


def assert_shard_pair_close(
    got: Sequence[Tensor],
    query: Tensor,
    key: Tensor,
    value: Tensor,
    bias: AttnBias,
    keys: slice,
    grad_out: Tensor,
    dtype: torch.dtype,
) -> Tensor:
    """A backend's ``[out, lse, dq, dk, dv]`` for a shard pair (:func:`shard_pair`) within the
    budget, its inputs in ``dtype``; a row the pair keeps nothing of must have ``lse = -inf``
    (then compared as 0). Returns those rows, ``(B, Hq, L)`` bool."""
    exact = shard_pair(query, key, value, bias, keys, grad_out)
    low = shard_pair(query, key, value, bias, keys, grad_out, dtype=dtype)
    got = list(got)
    empty = exact[1].isneginf()
    assert torch.equal(got[1].isneginf(), empty), "rows with lse = -inf differ"
    for results in (got, exact, low):
        results[1] = results[1].masked_fill(results[1].isneginf(), 0.0)
    assert_close_to_oracle(got, exact, low, dtype, ("out", "lse", "dq", "dk", "dv"))
    return empty


def _mod_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, scale: float | None, enable_gqa: bool
) -> Tensor:
    """Eager attention in the dtype of ``q, k, v`` for a sum holding ModBias parts."""
    heads = q.shape[1]
    if k.shape[1] != heads:
        if not enable_gqa:
            raise ValueError(f"Hq={heads} != Hkv={k.shape[1]} needs enable_gqa=True")
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores, keep = _mod_scores(q, k, bias, scale, q.dtype)
    return _kept_softmax(scores.masked_fill(~keep, -math.inf), keep) @ v


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
    error budget). Inputs are cast to ``dtype`` first. A sum holding ModBias parts runs the
    eager softmax, with each part's own functions evaluated on the index grids; tensors they
    read (a score_mod's table) keep their dtype and get their gradient."""
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    if q.shape[0] * q.shape[1] * q.shape[2] == 0:
        # No output element: stock SDPA itself ends the process on some of these shapes
        # (Hq = 0 in torch 2.11). Zero gradients: nothing depends on the inputs.
        empty = q.new_zeros((*q.shape[:3], v.shape[-1]))
        return empty + 0 * (q.sum() + k.sum() + v.sum())
    if is_causal:
        bias = causal_upper_left() if bias is None else bias + causal_upper_left()
    if has_mod_bias(bias):
        return _mod_attention(q, k, v, bias, scale, enable_gqa)  # type: ignore[arg-type]
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
    return _kept_softmax(scores.masked_fill(~kept, -math.inf), kept) @ v


def _shifted_functions(
    mask: Callable[..., Any] | None, score: Callable[..., Any] | None, row: int
) -> tuple[Callable[..., Any] | None, Callable[..., Any] | None]:
    """``mask`` and ``score`` reading the batch row ``b + row``."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        assert mask is not None
        return mask(b + row, h, q_idx, kv_idx)

    def score_mod(value: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        assert score is not None
        return score(value, b + row, h, q_idx, kv_idx)

    return (None if mask is None else mask_mod), (None if score is None else score_mod)


def _at_batch_row(bias: AttnBias | None, row: int) -> AttnBias | None:
    """``bias`` for a call of batch row ``row`` alone: its ModBias parts' functions read
    ``b + row`` (the row they would see in the whole batch); other parts as they are."""
    if bias is None or not has_mod_bias(bias):
        return bias
    cls = _mod_bias_class()
    assert cls is not None
    parts: list[AttnBias] = []
    for part in bias.parts if isinstance(bias, CompositeBias) else (bias,):
        if is_mod_bias(part):
            part = cls(*_shifted_functions(*mod_functions(part), row))
        parts.append(part)
    return parts[0] if len(parts) == 1 else CompositeBias(tuple(parts))


def paged_attention(
    query: Tensor,
    key_pool: Tensor,
    value_pool: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    bias: AttnBias | None,
    *,
    cu_seqlens_q: Tensor | None = None,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """Attention over a paged cache by stock PyTorch, row by row: each row's keys and values
    read from its pages by hand (``(num_pages, page_size, Hkv, E)`` pools, row ``b``'s token
    ``t`` at ``block_table[b, t // page_size]``, slot ``t % page_size``), its queries the last
    ones, and :func:`attention` of that row with ``bias`` (the parts besides the ``PagedKV``,
    aligned at the row's last key). ``(B, Hq, L, Ev)``, or ``(1, Hq, total, Ev)`` with
    ``cu_seqlens_q`` (the queries past its last row, a padded step's, give zeros)."""
    page_size = key_pool.shape[1]
    table, lens = block_table.tolist(), seq_lens.tolist()
    rows = []
    for b, length in enumerate(lens):
        tokens = [table[b][t // page_size] * page_size + t % page_size for t in range(length)]
        k = key_pool.reshape(-1, *key_pool.shape[2:])[tokens].transpose(0, 1)[None]
        v = value_pool.reshape(-1, *value_pool.shape[2:])[tokens].transpose(0, 1)[None]
        if cu_seqlens_q is None:
            q = query[b : b + 1]
        else:
            start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
            q = query[:, :, start:end]
        row_bias = _at_batch_row(bias, b)
        rows.append(attention(q, k, v, row_bias, scale=scale, enable_gqa=True, dtype=dtype))
    if cu_seqlens_q is None:
        return torch.cat(rows, dim=0)
    past = query.shape[2] - int(cu_seqlens_q[-1])
    rows.append(torch.zeros_like(rows[0][:, :, :1]).expand(-1, -1, past, -1))
    return torch.cat(rows, dim=2)


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
    parameters: Sequence[Tensor] = (),
) -> list[float]:
    """The part of a flash-attention kernel's error budget that its own rounding is relative
    to (:func:`flash_rounding_sizes` times the epsilons), for ``out, dq, dk, dv`` of a call
    in ``query.dtype``: to pass as ``rounding`` to :func:`assert_close_to_oracle`.

    ``parameters``: tensors that require grad and that a ModBias part's ``score_mod`` reads
    (a T5 table); an entry for each follows ``dv``, from :func:`_parameter_rounding`."""
    dtype = query.dtype
    q, k, v, g = (t.detach().double() for t in (query, key, value, grad_out))
    if is_causal:
        bias = causal_upper_left() if bias is None else bias + causal_upper_left()
    batch, heads, length_q, head_dim = q.shape
    length_kv = k.shape[-2]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    group = heads // k.shape[1]
    if bias is not None and has_mod_bias(bias):
        s, keep = _mod_scores(q, k.repeat_interleave(group, dim=1), bias, scale, torch.float64)
    else:
        cap, rest = _split(bias)
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
    rounding = [eps * in_dtype[n] + eps32 * in_fp32[n] for n in ("out", "dq", "dk", "dv")]
    if parameters:
        if bias is None or not has_mod_bias(bias):
            raise ValueError("parameters= is for tensors a ModBias part's score_mod reads")
        sizes = _parameter_rounding(q, k, v, out, lse, g, s, p, bias, scale, parameters)
        rounding += [
            eps * in_dtype_size + eps32 * in_fp32_size for in_dtype_size, in_fp32_size in sizes
        ]
    return rounding


def _parameter_rounding(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
    s: Tensor,
    p: Tensor,
    bias: AttnBias,
    scale: float,
    parameters: Sequence[Tensor],
) -> list[tuple[float, float]]:
    """``(in_dtype, in_fp32)`` sizes for the gradient of each tensor a ``score_mod`` reads
    (fp64 inputs, ``s`` and ``p`` as in :func:`flash_rounding`): the gradient is
    ``sum dS * d(score)/d(parameter)`` over the kept pairs, so its rounding is relative to the
    same sizes ``dS`` stands for in :func:`flash_rounding_sizes` (``|dS|`` and what the
    stored output moves it by, in the inputs' dtype; the recomputed ``P`` and the terms that
    cancel in ``dP - delta``, in fp32), carried through ``d(score)/d(parameter)`` by autograd
    with these non-negative sizes as weights: exact for a score_mod that adds a parameter's
    entries (a T5 table), an estimate where the derivative changes sign."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    dp = grad_out @ v.transpose(-1, -2)
    delta = (grad_out * out).sum(-1, keepdim=True)
    delta_terms = (grad_out.abs() * out.abs()).sum(-1, keepdim=True)
    exponent = s.abs().nan_to_num(posinf=0.0) + lse.nan_to_num(neginf=0.0).abs()[..., None]
    cancelling = (p + p * exponent) * (grad_out.abs() @ v.abs().transpose(-1, -2) + delta_terms)
    weights = ((p * (dp - delta)).abs() + p * delta_terms, cancelling)
    sizes: list[list[float]] = [[0.0, 0.0] for _ in parameters]
    with torch.enable_grad():
        for which, weight in enumerate(weights):
            scores, keep = _mod_scores(q, k, bias, scale, torch.float64)
            total = (weight * scores.masked_fill(~keep, 0.0)).sum()
            grads = torch.autograd.grad(total, list(parameters), allow_unused=True)
            for n, grad in enumerate(grads):
                sizes[n][which] = 0.0 if grad is None else grad.abs().max().item()
    return [(a, b) for a, b in sizes]


def floor(dtype: torch.dtype) -> float:
    """A few units in the last place of ``dtype`` at magnitude one."""
    return 4 * torch.finfo(dtype).eps


def max_error(result: Tensor, reference: Tensor) -> float:
    return (result.double() - reference.double()).abs().max().item() if result.numel() else 0.0


def oracle_errors(
    results: Sequence[Tensor],
    oracles: Sequence[Tensor],
    stock_low: Sequence[Tensor],
    dtype: torch.dtype,
    names: Sequence[str] = ("out",),
    rounding: Sequence[float] | None = None,
) -> list[tuple[str, float, float, float]]:
    """``(name, error, budget, stock error)`` of each result: its largest error against the
    oracle (NaN where the result holds a NaN), and the budget of
    :func:`assert_close_to_oracle`."""
    extra = list(rounding) if rounding is not None else [0.0] * len(names)
    found = []
    for name, result, oracle, stock, own in zip(
        names, results, oracles, stock_low, extra, strict=True
    ):
        error = math.nan if torch.isnan(result).any() else max_error(result, oracle)
        # stock low precision can itself fail (NaN, e.g. fp16 with scale 0 on CUDA): the
        # floor alone then
        stock_error = max_error(stock, oracle)
        stock_error = 0.0 if math.isnan(stock_error) else stock_error
        scale = max(1.0, oracle.abs().max().item()) if oracle.numel() else 1.0
        budget = 2 * stock_error + floor(dtype) * scale + own
        found.append((name, error, budget, stock_error))
    return found


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
    for name, error, budget, stock_error in oracle_errors(
        results, oracles, stock_low, dtype, names, rounding
    ):
        assert not math.isnan(error), f"{name}: NaN in result"
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


def assert_call_close(
    call: Callable[[Tensor, Tensor, Tensor], Tensor],
    bias: AttnBias | None,
    inputs: tuple[Tensor, Tensor, Tensor],
    grad_out: Tensor,
    *,
    enable_gqa: bool = False,
    scale: float | None = None,
    rounding: Sequence[float] | None = None,
    flash: bool = False,
) -> list[Tensor]:
    """``call(q, k, v)`` (a call with ``bias``, ``scale`` and ``enable_gqa``) against the
    oracle: its output and the gradients of ``q, k, v`` (with ``grad_out``) within the budget
    of stock PyTorch in the inputs' dtype (:func:`assert_close_to_oracle`, a flash kernel's own
    ``rounding`` included where given). ``flash=True``: the call runs a flash-attention kernel
    (such as ``use_backends("triton")``), whose own rounding (:func:`flash_rounding` of this
    call) joins the budget. Returns ``[out, dq, dk, dv]``."""
    q, k, v = inputs
    dtype = q.dtype
    if flash:
        if rounding is not None:
            raise ValueError("assert_call_close: give rounding or flash=True, not both")
        rounding = flash_rounding(q, k, v, bias, grad_out, scale=scale)
    got = run_with_grads(call, inputs, grad_out)
    expected = run_with_grads(
        lambda q, k, v: attention(q, k, v, bias, scale=scale, enable_gqa=enable_gqa),
        (q.double(), k.double(), v.double()),
        grad_out.double(),
    )
    low = run_with_grads(
        lambda q, k, v: attention(q, k, v, bias, scale=scale, enable_gqa=enable_gqa, dtype=dtype),
        inputs,
        grad_out,
    )
    assert_close_to_oracle(got, expected, low, dtype, ("out", "dq", "dk", "dv"), rounding)
    return got


__all__ = [
    "CausalVariant",
    "assert_call_close",
    "assert_close_to_oracle",
    "assert_shard_pair_close",
    "attention",
    "flash_rounding",
    "flash_rounding_sizes",
    "floor",
    "function_name",
    "grid_mask",
    "grid_score",
    "has_mod_bias",
    "index_grids",
    "is_mod_bias",
    "max_error",
    "mod_functions",
    "oracle_errors",
    "paged_attention",
    "pointwise",
    "run_with_grads",
    "shard_pair",
    "whole_call",
]

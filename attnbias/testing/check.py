"""``check_bias``: a bias on every route it can take here, against the fp64 oracle."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

import attnbias
from attnbias.biases import AttnBias, CompositeBias
from attnbias.kinds import Form
from attnbias.testing.oracle import (
    attention,
    flash_rounding,
    has_mod_bias,
    oracle_errors,
)

__all__ = ["DEFAULT_SHAPES", "CheckReport", "check_bias"]

#: ``(B, Hq, Hkv, L, S, E)``: square, fewer queries than keys (a chunk), more queries than
#: keys, and GQA.
DEFAULT_SHAPES: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 2, 2, 16, 16, 16),
    (2, 2, 2, 8, 24, 16),
    (1, 2, 2, 24, 8, 16),
    (2, 4, 2, 16, 16, 16),
)
# The kernels whose own rounding (a stored log-sum-exp, probabilities rounded to the inputs'
# dtype) the budget adds (``flash_rounding``).
_FLASH = frozenset({"triton", "triton-decode", "fa4"})

BiasOrFactory = AttnBias | Callable[[int, int], AttnBias]


@dataclasses.dataclass
class CheckReport:
    """What :func:`check_bias` checked: per route, the calls checked and the worst error as a
    fraction of its budget (1.0 is the bound) with the quantity it was in; per route not
    checked, why."""

    routes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        lines = ["route | calls | worst error / budget | in"]
        for name, found in self.routes.items():
            lines.append(
                f"{name} | {found['calls']} | {found['worst']:.3f} | {found['where']}"
                + (" (forward only)" if found.get("forward_only") else "")
            )
        for name, why in self.skipped.items():
            lines.append(f"{name} | not checked: {why}")
        return "\n".join(lines)


def check_bias(
    bias: BiasOrFactory,
    *,
    shapes: Sequence[tuple[int, int, int, int, int, int]] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    grads: bool = True,
    seed: int = 0,
) -> CheckReport:
    """Run attention with ``bias`` on every route that can take it on this machine and compare
    each against an fp64 oracle in eager PyTorch.

    The routes: the exact path (``reference``), stock SDPA on the materialized mask
    (``sdpa+mask``), stock SDPA's fused kernels where the bias is plain causal (``sdpa``), the
    Triton kernels (``triton``, and ``triton-decode`` for short queries, forward only; on a CPU
    where Triton's interpreter is on, ``TRITON_INTERPRET=1`` set before Triton is imported),
    FlashAttention 4 where it is installed (``fa4``); a bias class with its own ``dispatch``
    runs through it (``dispatch``), and one that needs materialization through ``sdpa+mask``.
    A ``ModBias`` whose class overrides ``materialize`` has that checked too (``materialize``:
    eager attention on the tensor it returns), since the library's routes run its functions.

    The oracle never goes through the library's tracer or compiled code: a ``ModBias``'s
    ``mask_mod`` / ``score_mod`` are evaluated on broadcast index tensors, other biases give
    ``bias.materialize(...)``, and soft-cap runs in an eager softmax. The output, the
    gradients of q, k and v and of every tensor of the bias that requires grad
    (:meth:`AttnBias.parameters`: fields, and tensors a ``ModBias``'s functions read) are
    compared, each within about twice the error stock PyTorch makes in the same low precision
    (plus a few units in the last place, plus a flash kernel's own rounding): the library's
    numerical contract.

    Args:
        bias: the bias, or a function ``(L, S) -> bias`` for one whose construction depends on
            the lengths (documents, key ranges, tables).
        shapes: ``(B, Hq, Hkv, L, S, E)`` tuples (:data:`DEFAULT_SHAPES`: square, L < S,
            L > S, GQA at small sizes).
        dtypes: default ``(torch.float32,)`` on the CPU, ``(torch.bfloat16,)`` on CUDA.
        device: default CUDA where there is one, else the CPU.
        grads: compare the gradients too (the forward alone otherwise).
        seed: the inputs are standard normal from a generator seeded with it.

    Returns:
        A :class:`CheckReport`: the routes checked, with their worst error against its budget,
        and those not checked, with why.

    Raises:
        AssertionError: a route's result is off the oracle beyond the budget (or NaN): the
            message names the route, the shape, the dtype, the quantity and the error against
            the bound.
        ValueError: no route can take the bias on these shapes (with each route's reasons).

    Example::

        >>> import torch
        >>> from attnbias import ModBias, causal_lower_right
        >>> from attnbias.testing import check_bias
        >>> prefix_lm = ModBias(mask_mod=lambda b, h, q, kv: (kv <= q) | (kv < 4))
        >>> report = check_bias(prefix_lm, shapes=[(1, 2, 2, 12, 12, 16)])
        >>> "reference" in report.routes
        True
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtypes is None:
        dtypes = (torch.bfloat16,) if device.type == "cuda" else (torch.float32,)
    shapes = DEFAULT_SHAPES if shapes is None else tuple(shapes)
    for shape in shapes:
        if len(shape) != 6 or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise ValueError(
                f"check_bias: a shape is (B, Hq, Hkv, L, S, E) of positive ints, got {shape!r}"
            )
        if shape[1] % shape[2]:
            raise ValueError(
                f"check_bias: Hq={shape[1]} is not a multiple of Hkv={shape[2]} in {shape!r}"
            )
    report = CheckReport()
    refused: dict[str, list[str]] = {}
    made: AttnBias | None = None
    for shape in shapes:
        length_q, length_kv = shape[3], shape[4]
        made = bias if isinstance(bias, AttnBias) else bias(length_q, length_kv)
        if not isinstance(made, AttnBias):
            raise TypeError(
                f"check_bias takes an AttnBias or a function (L, S) -> AttnBias; got "
                f"{type(made).__name__}"
            )
        if made.holds_pages:
            raise TypeError(
                f"check_bias runs biases on contiguous (B, H, S, E) keys and values; {made!r} "
                f"holds a PagedKV, whose keys are page pools: compare its calls with "
                f"attnbias.testing.oracle.paged_attention instead"
            )
        gqa = shape[1] != shape[2]
        for dtype in dtypes:
            inputs = _inputs(shape, dtype, device, seed)
            pinned, routes = _routes(made, inputs[:3], gqa, grads, refused)
            for name, forward_only in routes.items():
                _check_route(
                    report, name, forward_only, pinned, made, shape, dtype, inputs, grads, gqa
                )
    for name, reasons in refused.items():
        if name not in report.routes:
            report.skipped[name] = "; ".join(dict.fromkeys(reasons))
    if not report.routes:
        raise ValueError(f"check_bias: no route can take {made!r} here: {report.skipped}")
    return report


def _routes(
    bias: AttnBias,
    qkv: tuple[Tensor, ...],
    gqa: bool,
    grads: bool,
    refused: dict[str, list[str]],
) -> tuple[bool, dict[str, bool]]:
    """Whether the call's routes are chosen by ``use_backends`` (a bias that lowers; the
    other forms have one route each), and the routes that can take it, each with whether it
    takes the forward only; the reasons of those that cannot go into ``refused``."""
    from attnbias.backends import BACKENDS
    from attnbias.spec import call_form, make_spec

    query, key, value = qkv
    attnbias.explain(query, key, value, attn_mask=bias, enable_gqa=gqa)  # one that does not fit
    form = call_form(query, bias)
    if form != Form.BIAS:  # one route: the class's own dispatch, or the materialized mask
        return False, {"dispatch" if form == Form.DISPATCH else "sdpa+mask": False}
    extra = {"materialize": False} if _own_materialize(bias) else {}
    q, k, v = (t.detach().requires_grad_(grads) for t in qkv)
    wanting = make_spec(q, k, v, bias, False, None, 0.0, gqa)
    q, k, v = (t.detach() for t in qkv)
    plain = make_spec(q, k, v, bias, False, None, 0.0, gqa)
    routes: dict[str, bool] = {}
    for name, backend in BACKENDS.items():
        reasons = backend.not_supported_reasons(wanting)
        if not reasons:
            routes[name] = False
        elif grads and not backend.not_supported_reasons(plain):
            routes[name] = True  # a forward-only route (the decode kernel): its forward
        else:
            refused.setdefault(name, reasons)
    return True, {**routes, **extra}


def _own_materialize(bias: AttnBias) -> bool:
    """Whether a ``ModBias`` part overrides ``materialize`` (the library's routes run its
    functions, so the override is checked on its own: the ``materialize`` route)."""
    from attnbias import ModBias, SoftcapBias

    parts = bias.parts if isinstance(bias, CompositeBias) else (bias,)
    if any(isinstance(part, SoftcapBias) for part in parts):
        return False  # no materialized form
    return any(
        isinstance(part, ModBias) and type(part).materialize is not ModBias.materialize
        for part in parts
    )


def _materialized_attention(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, gqa: bool) -> Tensor:
    """Attention in eager PyTorch with ``bias.materialize(...)`` as it stands: a bool mask
    keeps its ``True`` pairs, a float one is added (``-inf`` drops a pair); a row that keeps
    nothing gives 0."""
    heads = q.shape[1]
    if gqa:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    shape = (q.shape[0], heads, q.shape[2], k.shape[2])
    mask = bias.materialize(q.device, shape=shape, dtype=q.dtype)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if mask.dtype == torch.bool:
        keep = mask.broadcast_to(shape)
    else:
        scores = scores + mask
        keep = ~torch.isneginf(scores)
    scores = scores.masked_fill(~keep, -math.inf)
    any_kept = keep.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~any_kept, 0.0), dim=-1) * any_kept
    return weights @ v


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    batch, heads_q, heads_kv, length_q, length_kv, head_dim = shape
    generator = torch.Generator().manual_seed(seed)

    def draw(heads: int, length: int) -> Tensor:
        return torch.randn(batch, heads, length, head_dim, generator=generator).to(device, dtype)

    return (
        draw(heads_q, length_q),
        draw(heads_kv, length_kv),
        draw(heads_kv, length_kv),
        draw(heads_q, length_q),
    )


def _parameters(bias: AttnBias) -> list[Tensor]:
    """The bias's tensors that require grad, once each: its :meth:`parameters` (for a
    ``ModBias`` every tensor its functions read, from fields, closures or globals)."""
    unique: dict[int, Tensor] = {}
    for t in bias.parameters():
        if t.requires_grad:
            unique.setdefault(id(t), t)
    return list(unique.values())


def _run(
    call: Callable[..., Tensor],
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
    grad_out: Tensor,
    grads: bool,
) -> list[Tensor]:
    """``[out, dq, dk, dv, *d(params)]`` of ``call(q, k, v)`` on fresh leaves (gradients of
    the parameters summed over this call only), or ``[out]`` without ``grads``."""
    if not grads:
        with torch.no_grad():
            return [call(*(t.detach() for t in inputs)).detach()]
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = call(*leaves)
    wanted = [*leaves, *params]
    found = torch.autograd.grad(out, wanted, grad_out.to(out.dtype), allow_unused=True)
    return [out.detach()] + [
        torch.zeros_like(t) if g is None else g.detach() for t, g in zip(wanted, found, strict=True)
    ]


def _check_route(
    report: CheckReport,
    name: str,
    forward_only: bool,
    pinned: bool,
    bias: AttnBias,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    inputs: tuple[Tensor, Tensor, Tensor, Tensor],
    grads: bool,
    gqa: bool,
) -> None:
    q, k, v, grad_out = inputs
    grads = grads and not forward_only
    params = _parameters(bias) if grads else []
    names = ["out", "dq", "dk", "dv"][: 4 if grads else 1] + [
        f"d(bias tensor {n}, shape {tuple(p.shape)})" for n, p in enumerate(params)
    ]

    def routed(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if name == "materialize":
            return _materialized_attention(q, k, v, bias, gqa)
        if not pinned:
            return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=gqa)
        with attnbias.use_backends(name):
            return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=gqa)

    got = _run(routed, (q, k, v), params, grad_out, grads)
    exact = _run(
        lambda q, k, v: attention(q, k, v, bias, enable_gqa=gqa),
        [t.double() for t in (q, k, v)], params, grad_out.double(), grads,
    )  # fmt: skip
    low = _run(
        lambda q, k, v: attention(q, k, v, bias, enable_gqa=gqa, dtype=dtype),
        (q, k, v), params, grad_out, grads,
    )  # fmt: skip
    rounding = None
    if name in _FLASH:
        rounding = flash_rounding(
            q, k, v, bias, grad_out, parameters=params if has_mod_bias(bias) else ()
        )[: len(names)]
        rounding += [0.0] * (len(names) - len(rounding))
    where = f"B, Hq, Hkv, L, S, E = {tuple(shape)}, {str(dtype).removeprefix('torch.')}"
    found = report.routes.setdefault(name, {"calls": 0, "worst": 0.0, "where": ""})
    found["calls"] += 1
    if forward_only:
        found["forward_only"] = True
    for quantity, error, budget, stock_error in oracle_errors(
        got, exact, low, dtype, names, rounding
    ):
        if math.isnan(error) or error > budget:
            raise AssertionError(
                f"check_bias: route {name!r}, {where}: {quantity} "
                + ("holds NaN" if math.isnan(error) else f"max error {error:.3g}")
                + f" against the fp64 oracle, over its bound {budget:.3g} (twice stock "
                f"PyTorch's {str(dtype).removeprefix('torch.')} error {stock_error:.3g}, plus "
                f"rounding); bias {bias!r}"
            )
        ratio = error / budget if budget > 0 else 0.0
        if ratio >= found["worst"]:
            found["worst"], found["where"] = ratio, f"{quantity}, {where}"

"""Valid key ranges (``KeyRangeBias``: padding in a batch, the filled part of a cache) through
``attnbias.sdpa`` on every route that takes them: the Triton kernel (interpreted on CPU), stock
SDPA with the materialized mask and the exact eager path.

Every result is held to the fp64 oracle's budget (``attnbias.testing.oracle``). Keys outside a row's
range must reach nothing at all, forward or backward, on every route: with NaN and Inf written
into every key and value outside the ranges, each output and gradient must equal, bit for bit,
that of the same call with zeros there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    causal_upper_left,
    sdpa,
)
from attnbias.backends import triton as triton_backend
from attnbias.biases import parts_of
from attnbias.spec import lower, make_spec
from attnbias.testing.oracle import (
    assert_close_to_oracle,
    attention,
    flash_rounding,
    run_with_grads,
)
from attnbias.testing.strategies import draw_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("out", "dq", "dk", "dv")
BATCH, HEADS_Q, HEADS_KV, LENGTH_Q, LENGTH_KV, HEAD_DIM = 2, 2, 1, 20, 40, 16

# One range per batch row of S = 40 keys (16-key tiles under the interpreter: ends on and
# between tile edges), alone and in a sum with every other built-in bias.
BIASES: dict[str, Callable[[], AttnBias]] = {
    "left_padding": lambda: KeyRangeBias(start=[7, 0]),
    "right_padding": lambda: KeyRangeBias(end=[40, 21]),
    "from_padding_mask": lambda: KeyRangeBias.from_padding_mask(
        torch.arange(LENGTH_KV)[None, :] >= torch.tensor([[16], [3]])
    ),
    "shared_by_the_batch": lambda: KeyRangeBias(start=[4], end=[29]),
    "causal_upper_left": lambda: KeyRangeBias([3, 10], [30, 40]) + causal_upper_left(),
    # a cache filled up to end[b], with the new queries at its end
    "cache_causal_lower_right": lambda: KeyRangeBias(end=[33, 17]) + causal_lower_right(),
    "window": lambda: KeyRangeBias(start=[5, 19]) + SlidingWindowBias(9),
    "documents": lambda: (
        KeyRangeBias([2, 12], [37, 31]) + DocumentBias.from_seqlens([8, 12], [15, 25])
    ),
    "alibi": lambda: (
        KeyRangeBias(start=[6, 1], end=[35, 26]) + AlibiBias(num_heads=HEADS_Q)
        + causal_lower_right()
    ),
    "softcap": lambda: KeyRangeBias(start=[9, 0]) + SoftcapBias(3.0) + SlidingWindowBias(12, 4),
    "two_ranges_intersect": lambda: (
        KeyRangeBias(start=[2, 9]) + KeyRangeBias(start=[6, 1], end=[30, 38])
    ),
    "one_row_empty": lambda: KeyRangeBias(start=[5, 0], end=[5, 40]) + causal_lower_right(),
    "disjoint_ranges_empty": lambda: KeyRangeBias(end=[10, 40]) + KeyRangeBias(start=[10, 0]),
}  # fmt: skip

ROUTES = ("triton", "sdpa+mask", "reference")


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest) -> Iterator[str]:
    with attnbias.use_backends(request.param):
        yield str(request.param)


def runs_on(route: str, bias: AttnBias, dtype: torch.dtype) -> bool:
    """The ``sdpa+mask`` route refuses soft-cap (stock SDPA has none) and ALiBi in half
    precision (it would lose precision)."""
    if route != "sdpa+mask":
        return True
    parts = parts_of(bias)
    half = dtype in (torch.float16, torch.bfloat16)
    return not any(isinstance(p, SoftcapBias) or (half and isinstance(p, AlibiBias)) for p in parts)


def tensors(dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    shape = (BATCH, HEADS_Q, HEADS_KV, LENGTH_Q, LENGTH_KV)
    return draw_inputs(shape, HEAD_DIM, dtype, seed, DEVICE)


def outside(bias: AttnBias) -> Tensor:
    """``(B, S)`` bool: the keys outside each batch row's range (of every range in the sum)."""
    keep = torch.ones(BATCH, LENGTH_KV, dtype=torch.bool)
    for part in parts_of(bias):
        if isinstance(part, KeyRangeBias):
            mask = part.materialize("cpu", shape=(BATCH, 1, LENGTH_Q, LENGTH_KV))
            keep &= torch.isfinite(mask[:, 0, 0, :])
    return (~keep).to(DEVICE)


def ours(bias: AttnBias) -> Callable[..., Tensor]:
    return lambda q, k, v: sdpa(q, k, v, attn_mask=bias, enable_gqa=True)


# One dtype and one poison per bias, alternating, keep the interpreted kernel's time short.
DTYPE_OF = {name: (torch.float32, torch.bfloat16)[n % 2] for n, name in enumerate(BIASES)}
POISON_OF = {name: (math.nan, math.inf)[n % 2] for n, name in enumerate(BIASES)}
# the kernel's own tests (tests/test_kernels.py) poison more cases than these
KERNEL_POISONED = (
    "left_padding",
    "cache_causal_lower_right",
    "documents",
    "alibi",
    "softcap",
    "two_ranges_intersect",
    "one_row_empty",
)


@pytest.mark.parametrize("name", list(BIASES))
def test_matches_the_oracle(route: str, name: str) -> None:
    bias, dtype = BIASES[name](), DTYPE_OF[name]
    if not runs_on(route, bias, dtype):
        pytest.skip("the route refuses this bias")
    q, k, v, grad_out = tensors(dtype)
    results = run_with_grads(ours(bias), (q, k, v), grad_out)
    expected = run_with_grads(
        lambda *t: attention(*t, bias, enable_gqa=True),
        [x.double() for x in (q, k, v)],
        grad_out.double(),
    )
    low = run_with_grads(
        lambda *t: attention(*t, bias, enable_gqa=True, dtype=dtype), (q, k, v), grad_out
    )
    # the kernel is a flash-attention kernel: its own rounding is part of its budget
    rounding = flash_rounding(q, k, v, bias, grad_out) if route == "triton" else None
    assert_close_to_oracle(results, expected, low, dtype, NAMES, rounding)
    # rows of a batch row whose range is empty keep nothing: 0, and zero gradients
    empty = outside(bias).all(dim=-1)
    for result in results:
        assert torch.isfinite(result).all()
        assert (result[empty] == 0).all()
    # keys outside the range are kept by no row: exactly zero gradients
    keys_out = outside(bias)[:, None, :, None].expand_as(k)
    assert (results[2][keys_out] == 0).all() and (results[3][keys_out] == 0).all()


@pytest.mark.parametrize("name", list(BIASES))
def test_nothing_outside_the_range_reaches_anything(route: str, name: str) -> None:
    """NaN or Inf (values: its negation) in every key and value outside the ranges: each
    output and gradient equals bit for bit that of the same call with zeros there."""
    bias, poison = BIASES[name](), POISON_OF[name]
    if not runs_on(route, bias, torch.float16):
        pytest.skip("the route refuses this bias")
    if route == "triton" and name not in KERNEL_POISONED:
        pytest.skip("interpreted kernel time; tests/test_kernels.py covers the kernel")
    q, k, v, grad_out = tensors(torch.float16, seed=1)
    keys_out = outside(bias)[:, None, :, None]
    dirty = run_with_grads(
        ours(bias), (q, k.masked_fill(keys_out, poison), v.masked_fill(keys_out, -poison)), grad_out
    )
    clean = run_with_grads(
        ours(bias), (q, k.masked_fill(keys_out, 0.0), v.masked_fill(keys_out, 0.0)), grad_out
    )
    for label, got, want in zip(NAMES, dirty, clean, strict=True):
        assert torch.equal(got, want), f"{label}: a key outside the range reached it"


def test_a_nan_inside_the_range_still_propagates(route: str) -> None:
    """A NaN in a key that rows attend reaches exactly those rows, as in stock SDPA."""
    bias = KeyRangeBias(start=[3, 0], end=[30, 12]) + causal_lower_right()
    q, k, v, _ = tensors(torch.float32)
    k[0, :, 24] = math.nan  # inside batch row 0's range; row i keeps j <= i + 20
    k[1, :, 24] = math.nan  # outside batch row 1's range
    out = sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    nan_rows = out.isnan().any(dim=-1)
    assert nan_rows[0, :, 4:].all() and not nan_rows[0, :, :4].any()
    assert not nan_rows[1].any()


def test_the_default_route_is_the_kernel_and_explain_names_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q, k, v, _ = tensors(torch.float32)
    bias = KeyRangeBias(end=[33, 17]) + causal_lower_right()
    # without gradients these short queries take the decode kernel, which takes key ranges too
    inference = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True)
    assert inference.startswith("triton-decode: band -inf <= j - i <= 20, key range kv_start")
    q.requires_grad_(True)
    text = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True)
    first = text.splitlines()[0]
    assert first.startswith("triton: band -inf <= j - i <= 20, key range kv_start[b] <= j < ")
    assert "reading no key outside each batch row's key range" in first
    assert "sdpa: a key range (KeyRangeBias) needs a mask" in text
    assert "fa4: " in text and "a key range (KeyRangeBias)" in text.split("fa4: ")[1]
    # without the kernel (CPU, no interpreter) the materialized mask takes it
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    q, k, v = (t.detach().cpu() for t in (q, k, v))
    assert attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True).startswith(
        "sdpa+mask: band -inf <= j - i <= 20, key range"
    )


def test_lowering_intersects_ranges_on_the_device() -> None:
    q, k, v, _ = tensors(torch.float32)
    bias = (
        KeyRangeBias(start=[2, 9])
        + causal_lower_right()
        + KeyRangeBias(start=[6, 1], end=[30, 38])
        + KeyRangeBias(end=torch.tensor([35]))
    )
    lowered = make_spec(q, k, v, bias, False, None, 0.0, True).terms
    assert lowered.kv_start is not None and lowered.kv_end is not None
    assert lowered.kv_start.dtype == lowered.kv_end.dtype == torch.int32
    assert lowered.kv_start.device == q.device
    assert lowered.kv_start.tolist() == [6, 9] and lowered.kv_end.tolist() == [30, 35]
    # the range adds no kind of its own, and stock SDPA's fused forms no longer apply
    upper_left = make_spec(q, k, v, bias + causal_upper_left(), False, None, 0.0, True).terms
    assert lowered.kind == "band" and upper_left.kind == "causal"
    assert upper_left.band_hi == 0 and not upper_left.is_plain_causal
    alone = make_spec(q, k, v, KeyRangeBias(end=[3, 5]), False, None, 0.0, True).terms
    assert alone.kind == "none" and not alone.is_empty
    # lowered without the batch size, a range keeps its own rows (the kernels broadcast one)
    shared = lower(KeyRangeBias(end=[3]), LENGTH_Q, LENGTH_KV, q.device)
    assert shared.kv_end is not None and shared.kv_end.tolist() == [3]
    # a range with no bound is no range
    open_range = make_spec(q, k, v, KeyRangeBias(), False, None, 0.0, True).terms
    assert open_range.kv_start is None and open_range.is_empty


def test_ranges_past_the_keys_are_refused() -> None:
    q, k, v, _ = tensors(torch.float32)
    with pytest.raises(ValueError, match=r"goes past the call's S=40"):
        sdpa(q, k, v, attn_mask=KeyRangeBias(end=[41, 3]), enable_gqa=True)


def _decode_steps(
    backend: str,
    bias: AttnBias,
    fresh: Callable[[], AttnBias],
    end: Tensor,
    steps: int,
    seed: int,
    move: Callable[[], None] = lambda: None,
) -> None:
    """Decode steps on a cache of 40 slots filled to ``end`` (NaN past 33): each call of the
    one ``bias`` against the oracle of ``fresh()``, a bias built from the positions now; then
    each row's next key and value go in at ``end``, ``end += 1`` and ``move()``."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(2, 4, length, 16, generator=generator).to(DEVICE) for length in (2, 40, 40)
    )
    k[:, :, 33:] = math.nan  # not filled yet
    v[:, :, 33:] = math.nan
    with torch.no_grad(), attnbias.use_backends(backend):
        for _ in range(steps):  # the first call plans, the next ones reuse the plan
            out = attnbias.sdpa(q, k, v, attn_mask=bias)
            expected = attention(q, k.nan_to_num(), v.nan_to_num(), fresh())
            low = attention(q, k.nan_to_num(), v.nan_to_num(), fresh(), dtype=q.dtype)
            assert_close_to_oracle([out], [expected], [low], q.dtype)
            # the next token of each row: its key and value go in at `end`, then the range grows
            for row, position in enumerate(end.tolist()):
                k[row, :, position] = torch.randn(4, 16, generator=generator).to(DEVICE)
                v[row, :, position] = torch.randn(4, 16, generator=generator).to(DEVICE)
            end += 1
            move()


@pytest.mark.parametrize("backend", ["triton-decode", "triton", "sdpa+mask", "reference"])
def test_positions_written_in_place_are_seen_by_the_next_call(backend: str) -> None:
    """int32 ``(B,)`` positions on the inputs' device are used, not copied: a cache that fills
    writes ``end += 1`` between decode steps, and the same bias (and a prepared plan, or a
    captured graph) sees it."""
    end = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    bias = KeyRangeBias(start=torch.tensor([3, 0], dtype=torch.int32, device=DEVICE), end=end)
    _decode_steps(
        backend,
        bias + causal_lower_right(),
        lambda: KeyRangeBias(start=[3, 0], end=end.tolist()) + causal_lower_right(),
        end,
        steps=3,
        seed=3,
    )


@pytest.mark.parametrize("backend", ["triton-decode", "triton", "sdpa+mask", "reference"])
def test_two_ranges_written_in_place_are_seen_by_the_next_call(backend: str) -> None:
    """A sum of two ranges (left padding and the filled part, each its own bias) intersects
    them on the device; the kept plan intersects them again at each call, so writes into
    either range are seen: the window of the last keys moves with ``start``, the cache
    fills with ``end``."""
    padding = torch.tensor([3, 0], dtype=torch.int32, device=DEVICE)
    window = torch.tensor([10, 0], dtype=torch.int32, device=DEVICE)
    end = torch.tensor([20, 33], dtype=torch.int32, device=DEVICE)
    bias = KeyRangeBias(start=padding) + KeyRangeBias(start=window, end=end)

    def fresh() -> AttnBias:
        return (
            KeyRangeBias(start=padding.tolist())
            + KeyRangeBias(start=window.tolist(), end=end.tolist())
            + causal_lower_right()
        )

    def move() -> None:
        window.add_(2)  # the window of the last keys moves on

    _decode_steps(backend, bias + causal_lower_right(), fresh, end, steps=4, seed=5, move=move)


@pytest.mark.parametrize("backend", ["triton", "sdpa+mask", "reference"])
def test_positions_the_bias_copies_are_copied_again_after_a_write(backend: str) -> None:
    """int64 positions (and positions of one row for a batch of two) are copied for the
    kernels; a write into them bumps their version, and the next call copies them again."""
    generator = torch.Generator().manual_seed(6)
    q, k, v = (
        torch.randn(2, 4, length, 16, generator=generator).to(DEVICE) for length in (3, 40, 40)
    )
    start = torch.tensor([2], dtype=torch.int64, device=DEVICE)
    end = torch.tensor([20, 33], dtype=torch.int64, device=DEVICE)
    bias = KeyRangeBias(start=start, end=end)
    with torch.no_grad(), attnbias.use_backends(backend):
        for _ in range(4):
            out = attnbias.sdpa(q, k, v, attn_mask=bias)
            fresh = KeyRangeBias(start=start.tolist() * 2, end=end.tolist())
            expected = attention(q, k, v, fresh)
            low = attention(q, k, v, fresh, dtype=q.dtype)
            assert_close_to_oracle([out], [expected], [low], q.dtype)
            start += 3
            end -= 2


def test_a_range_reused_over_a_growing_cache_keeps_a_bounded_number_of_copies() -> None:
    """A range whose ends default to S, called once per key count as a decode loop grows its
    cache, keeps at most ``KEPT_PER_CACHE`` default-end tensors (not one per step), and each
    call still matches the oracle."""
    from attnbias.biases.base import KEPT_PER_CACHE

    generator = torch.Generator().manual_seed(8)
    bias = KeyRangeBias(start=torch.tensor([1, 3], dtype=torch.int32, device=DEVICE), end=None)
    steps = KEPT_PER_CACHE + 5
    with torch.no_grad(), attnbias.use_backends("triton"):
        for length_kv in range(8, 8 + steps):
            q, k, v = (
                torch.randn(2, 2, length, 16, generator=generator).to(DEVICE)
                for length in (1, length_kv, length_kv)
            )
            out = attnbias.sdpa(q, k, v, attn_mask=bias)
            expected = attention(q, k, v, bias)
            low = attention(q, k, v, bias, dtype=q.dtype)
            assert_close_to_oracle([out], [expected], [low], q.dtype)
            assert len(bias._on_device) <= KEPT_PER_CACHE
    assert len(bias._on_device) == KEPT_PER_CACHE


def test_ranges_from_padding_masks_are_int32_on_the_masks_device() -> None:
    """``from_padding_mask`` gives int32 positions on the mask's device, which the kernels
    read where they are (no copy kept per call)."""
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], device=DEVICE)
    bias = KeyRangeBias.from_padding_mask(mask)
    assert bias.start is not None and bias.end is not None
    for bound in (bias.start, bias.end):
        assert bound.dtype == torch.int32 and bound.device == mask.device
    assert bias.start.tolist() == [1, 0] and bias.end.tolist() == [4, 2]

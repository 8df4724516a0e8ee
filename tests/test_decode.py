"""The decode kernel (``kernels/decode.py``) and its backend, ``triton-decode``.

The kernel is called with the arguments a bias lowers to (``attnbias.spec.lower``), or with raw
bands whose oracle bias is the keep-mask written from the definition, and held to the one error
budget of ``attnbias.testing.oracle``. Every ``torch.empty`` is poisoned with NaN, so an output or
partial buffer that the kernel leaves unwritten fails. Without CUDA the kernels run under
Triton's interpreter with 16-key blocks and tiles of at most 16 packed rows, on a fixed
4-multiprocessor machine: the shapes are small but span several key blocks, row tiles and
splits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import attnbias
import attnbias.backends.triton as triton_backend
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
    planner,
    use_backends,
)
from attnbias.backends import BACKENDS
from attnbias.kernels import decode
from attnbias.kernels.decode import decode_forward, num_splits, visited_key_blocks
from attnbias.kernels.limits import MAX_DECODE_QUERIES
from attnbias.kernels.program import MaskProgram
from attnbias.planner import plan
from attnbias.spec import lower, make_spec
from attnbias.testing.oracle import _split, assert_close_to_oracle, attention, flash_rounding
from attnbias.testing.strategies import DTYPES, finite_scales, kernel_bias

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
# the key block of the tests' head dim and dtypes (the GPU's tiles differ)
BLOCK_N = decode.decode_config(
    16, rows=64, keys=2**20, itemsize=4, device=torch.device(DEVICE)
).block_n


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """Every ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` starts as NaN,
    so unwritten outputs and partials fail; returns the float tensors ``torch.empty`` made
    (the partial results of a launch on the CPU), for tests that check which buffers a call
    allocated."""
    made: list[Tensor] = []

    def poisoning(real: Callable[..., Tensor], record: bool) -> Callable[..., Tensor]:
        def poisoned(*args: Any, **kwargs: Any) -> Tensor:
            t = real(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
                if record:
                    made.append(t)
            return t

        return poisoned

    monkeypatch.setattr(torch, "empty", poisoning(torch.empty, True))
    monkeypatch.setattr(torch, "empty_like", poisoning(torch.empty_like, False))
    monkeypatch.setattr(Tensor, "new_empty", poisoning(Tensor.new_empty, False))
    return made


# --------------------------------------------------------------------------------------
# Running the kernel against the oracle
# --------------------------------------------------------------------------------------


def make_qkv(
    batch: int,
    heads_q: int,
    heads_kv: int,
    length_q: int,
    length_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Drawn in float32, then rounded to ``dtype`` (the oracle reads the rounded values)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = (
        (batch, heads_q, length_q, head_dim),
        (batch, heads_kv, length_kv, head_dim),
        (batch, heads_kv, length_kv, head_dim),
    )
    q, k, v = (torch.randn(*s, generator=generator).to(DEVICE, dtype) for s in shapes)
    return q, k, v


def program_of(bias: AttnBias, length_q: int, length_kv: int) -> MaskProgram:
    """The mask program ``bias`` lowers to (it must have a kernel form)."""
    lowered = lower(bias, length_q, length_kv, torch.device(DEVICE))
    assert not lowered.others
    return lowered.program


def band_bias(length_q: int, length_kv: int, lo: int | None, hi: int | None) -> TensorBias:
    """The keep-mask of ``lo <= j - i <= hi`` (``None`` open), from the definition."""
    i = torch.arange(length_q)[:, None]
    j = torch.arange(length_kv)[None, :]
    keep = torch.ones(length_q, length_kv, dtype=torch.bool)
    if lo is not None:
        keep &= j - i >= lo
    if hi is not None:
        keep &= j - i <= hi
    return TensorBias(keep.to(DEVICE))


def kept_rows(bias: AttnBias, shape: tuple[int, int, int, int]) -> Tensor:
    """``(B, Hq, L)`` bool: the rows that keep at least one key (soft-cap masks nothing)."""
    _, rest = _split(bias)
    if rest is None:
        return torch.ones(shape[:3], dtype=torch.bool, device=DEVICE)
    mask = rest.materialize(DEVICE, shape=shape, dtype=torch.float64)
    return torch.isfinite(mask).expand(shape).any(-1)


def check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    oracle_bias: AttnBias,
    program: MaskProgram,
    *,
    splits: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Run the kernel and hold its output to the oracle's budget; rows that keep nothing
    must be exactly 0."""
    resolved = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = decode_forward(q, k, v, program, scale=resolved, num_splits=splits)
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_contiguous()
    gqa = q.shape[1] != k.shape[1]
    expected = attention(q, k, v, oracle_bias, scale=scale, enable_gqa=gqa)
    low = attention(q, k, v, oracle_bias, scale=scale, enable_gqa=gqa, dtype=q.dtype)
    rounding = flash_rounding(q, k, v, oracle_bias, torch.zeros_like(q), scale=scale)[:1]
    assert_close_to_oracle([out], [expected], [low], q.dtype, ("out",), rounding)
    empty = ~kept_rows(oracle_bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    assert (out[empty] == 0).all(), "a row that keeps no key must be 0"
    return out


def check_bias(
    bias: AttnBias,
    batch: int,
    heads_q: int,
    heads_kv: int,
    length_q: int,
    length_kv: int,
    head_dim: int = 16,
    dtype: torch.dtype = BF16,
    *,
    splits: int | None = None,
    seed: int = 0,
) -> Tensor:
    q, k, v = make_qkv(batch, heads_q, heads_kv, length_q, length_kv, head_dim, dtype, seed)
    return check(q, k, v, bias, program_of(bias, length_q, length_kv), splits=splits)


# --------------------------------------------------------------------------------------
# Every bias kind and sums
# --------------------------------------------------------------------------------------

# Raw bands (lo, hi) of j - i as functions of (L, S): open sides, windows, bands ahead of or
# behind the diagonal j - i = S - L (negative sides in FlashAttention's terms), empty bands.
BANDS = {
    "none": lambda L, S: (None, None),
    "causal_upper_left": lambda L, S: (None, 0),
    "causal_lower_right": lambda L, S: (None, S - L),
    "window": lambda L, S: (S - L - 20, S - L),
    "window_both_sides": lambda L, S: (S - L - 5, S - L + 9),
    "left_only": lambda L, S: (S - L - 30, None),
    "ahead_of_the_diagonal": lambda L, S: (S - L + 3, S - L + 40),
    "behind_the_diagonal": lambda L, S: (S - L - 37, S - L - 4),
    "narrow_off_diagonal": lambda L, S: (2, 3),
    "empty_band": lambda L, S: (5, 2),
}


@pytest.mark.parametrize(
    ("band", "length_q"),
    [(band, (1, 2, 3, 7, 16)[n % 5]) for n, band in enumerate(BANDS)],
)
def test_bands(band: str, length_q: int) -> None:
    length_kv = 93  # not a multiple of the key block
    lo, hi = BANDS[band](length_q, length_kv)
    q, k, v = make_qkv(1, 4, 2, length_q, length_kv, 16, BF16)
    program = MaskProgram(band_lo=lo, band_hi=hi)
    check(q, k, v, band_bias(length_q, length_kv, lo, hi), program)


# A bias per kind and sums of them, each on its own shape: (bias, B, Hq, Hkv, L, S).
BIASES: dict[str, Any] = {
    "causal_lower_right": lambda: (causal_lower_right(), 1, 8, 2, 3, 100),
    "causal_upper_left_l_lt_s": lambda: (causal_upper_left(), 1, 2, 1, 7, 40),
    "window_lower_right": lambda: (SlidingWindowBias(24) + causal_lower_right(), 2, 4, 1, 2, 90),
    # upper-left causal with a window and L < S: the band's right side is negative
    "window_upper_left": lambda: (SlidingWindowBias(30) + causal_upper_left(), 1, 3, 1, 5, 70),
    "bidirectional_window": lambda: (SlidingWindowBias(11, 6), 1, 2, 2, 16, 60),
    "alibi_paper_gqa": lambda: (AlibiBias(num_heads=8) + causal_lower_right(), 1, 8, 2, 2, 70),
    "alibi_window_both_sides": lambda: (
        AlibiBias(slopes=torch.linspace(0.05, 0.8, 6)) + SlidingWindowBias(20, 7), 1, 6, 2, 3, 64,
    ),
    "softcap": lambda: (SoftcapBias(2.0), 1, 4, 4, 3, 50),
    "gemma2": lambda: (
        causal_lower_right() + SlidingWindowBias(40) + SoftcapBias(30.0), 2, 4, 2, 4, 100,
    ),
    "alibi_softcap": lambda: (AlibiBias(num_heads=3) + SoftcapBias(5.0), 1, 3, 1, 7, 45),
    "documents_shared": lambda: (
        DocumentBias.from_seqlens([1, 2], [40, 35]) + causal_lower_right(), 2, 4, 2, 3, 75,
    ),
    # left padding of a batch, and caches filled to different lengths
    "key_range_left_padding": lambda: (
        KeyRangeBias(start=[0, 37], end=[100, 100]) + causal_lower_right(), 2, 4, 2, 3, 100,
    ),
    "key_range_cache_window": lambda: (
        KeyRangeBias(end=[61, 17]) + SlidingWindowBias(30, 5) + SoftcapBias(9.0), 2, 6, 2, 2, 90,
    ),
    "key_range_empty_row": lambda: (
        KeyRangeBias(start=[5, 40], end=[5, 71]) + AlibiBias(num_heads=4), 2, 4, 4, 3, 80,
    ),
    "everything": lambda: (
        DocumentBias.from_seqlens([2, 3], [30, 50])
        + SlidingWindowBias(33, 2)
        + AlibiBias(slopes=torch.rand(2, 4, generator=torch.Generator().manual_seed(1)))
        + SoftcapBias(4.0),
        2, 4, 2, 5, 80,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BIASES))
def test_biases(name: str) -> None:
    bias, *shape = BIASES[name]()
    check_bias(bias, *shape)


@pytest.mark.parametrize("dtype", [FP32, FP16, BF16])
def test_dtypes(dtype: torch.dtype) -> None:
    bias = causal_lower_right() + SlidingWindowBias(50) + SoftcapBias(20.0)
    check_bias(bias + AlibiBias(num_heads=4), 1, 4, 2, 4, 77, 32, dtype)


@pytest.mark.parametrize(
    ("length_q", "group"),
    # every L and every group size; G * L past one 16-row tile (several row tiles) included
    [(1, 8), (2, 3), (3, 4), (7, 2), (16, 1), (7, 3), (3, 8), (16, 4), (1, 1)],
)
def test_queries_and_groups(length_q: int, group: int) -> None:
    # ALiBi slopes differ per packed head; the band differs per packed query
    bias = AlibiBias(num_heads=group * 2) + causal_lower_right() + SlidingWindowBias(45)
    check_bias(bias, 1, group * 2, 2, length_q, 61)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_documents(per_batch: bool, causal: bool) -> None:
    # query document 1 has no keys (rows that keep nothing); key document 2 has no queries
    q_ids = torch.tensor([[0, 0, 1, 3, 3], [0, 3, 3, 3, 3]])
    kv_lengths = [[20, 0, 15, 50], [7, 0, 30, 48]]
    kv_ids = torch.stack(
        [torch.repeat_interleave(torch.arange(4), torch.tensor(n)) for n in kv_lengths]
    )
    if not per_batch:
        q_ids, kv_ids = q_ids[:1], kv_ids[:1]
    bias: AttnBias = DocumentBias(q_ids.to(DEVICE), kv_ids.to(DEVICE))
    if causal:
        bias = bias + causal_lower_right()
    out = check_bias(bias, 2, 6, 2, 5, 85)
    assert (out[0, :, 2] == 0).all()  # the query of document 1, which has no keys


@pytest.mark.parametrize(
    ("rows", "band"),
    # the bands keep distances i + S - L - j of one sign (either), or of both
    [(None, "causal_lower_right"), (1, "ahead_of_the_diagonal"), (2, "none"), (2, "window")],
)
def test_alibi_slope_shapes(rows: int | None, band: str) -> None:
    lo, hi = BANDS[band](4, 70)
    generator = torch.Generator().manual_seed(2)
    slopes = torch.rand((6,) if rows is None else (rows, 6), generator=generator)
    alibi = AlibiBias(slopes=slopes.to(DEVICE))
    q, k, v = make_qkv(2, 6, 2, 4, 70, 16, FP32)
    program = program_of(alibi, 4, 70).replace(band_lo=lo, band_hi=hi)
    check(q, k, v, alibi + band_bias(4, 70, lo, hi), program)


@pytest.mark.parametrize("head_dim", [24, 80, 96, 256])
def test_head_dims(head_dim: int) -> None:
    check_bias(causal_lower_right() + SoftcapBias(10.0), 1, 4, 2, 3, 50, head_dim, FP16)


def test_fully_masked_rows_are_zero() -> None:
    # row i keeps keys i - 6 .. i - 4: rows 0..3 keep nothing, rows 4..6 one to three keys
    lo, hi = -6, -4
    q, k, v = make_qkv(1, 4, 2, 7, 5, 16, FP32)
    program = MaskProgram(band_lo=lo, band_hi=hi)
    for splits in (1, 3):
        out = check(q, k, v, band_bias(7, 5, lo, hi), program, splits=splits)
        assert (out[:, :, :4] == 0).all()
        assert (out[:, :, 4:] != 0).all()


# --------------------------------------------------------------------------------------
# Splits
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma2", "everything", "documents_shared"])
def test_forced_splits_agree(name: str, poison_empty: list[Tensor]) -> None:
    """One split writes the output directly; 3 and more splits than key blocks (shares with
    no key at all) go through the merge; every one is held to the oracle, and their results
    agree with each other."""
    bias, batch, heads_q, heads_kv, length_q, length_kv = BIASES[name]()
    q, k, v = make_qkv(batch, heads_q, heads_kv, length_q, length_kv, 16, FP32)
    program = program_of(bias, length_q, length_kv)
    blocks = -(-length_kv // BLOCK_N)
    results = {}
    for splits in (1, 3, blocks + 3):
        if DEVICE == "cuda":
            # a stream keeps its partial results from launch to launch: poisoned too (and
            # large enough that this launch makes no new ones)
            scratch = decode.split_scratch(torch.device(DEVICE), 1024, 1 << 20)
            assert scratch is not None
            scratch[1].fill_(float("nan"))
        poison_empty.clear()
        results[splits] = check(q, k, v, bias, program, splits=splits)
        partials = [t for t in poison_empty if t.dim() == 1]
        # on the CPU the partial outputs and log-sum-exps come from the poisoned torch.empty
        assert len(partials) == (1 if splits > 1 and DEVICE == "cpu" else 0)
    for out in results.values():
        torch.testing.assert_close(out, results[1], rtol=0, atol=1e-5)


def test_a_split_whose_rows_keep_nothing_merges_to_zero() -> None:
    # the queries of document 0 look at keys 58.. (window) but its keys end at 50: they keep
    # nothing; the tile visits one key block, so most shares see no key at all
    bias = DocumentBias.from_seqlens([2, 2], [50, 13]) + SlidingWindowBias(1, 1)
    for splits in (1, 4, 9):
        out = check_bias(bias, 1, 2, 1, 4, 63, dtype=FP32, splits=splits)
        assert (out[:, :, :2] == 0).all()  # their band does not reach back into document 0


def test_the_last_share_merges_and_leaves_the_counters_at_zero(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shares of a tile count themselves done on its counter; the last one merges them
    into the output (held to the oracle) and sets the counter back to 0, so the next launch
    on the stream can use the same counters. A counter beyond the launch's tiles is left
    alone."""
    bias = causal_lower_right() + SlidingWindowBias(40) + SoftcapBias(20.0)
    batch, heads_q, heads_kv, length_q, length_kv = 2, 6, 2, 3, 77
    q, k, v = make_qkv(batch, heads_q, heads_kv, length_q, length_kv, 16, FP32)
    program = program_of(bias, length_q, length_kv)
    plan = decode.plan_decode(q, k, v, program, scale=0.25, num_splits=3)
    assert plan.layout is not None and plan.layout.splits == 3
    tiles = batch * heads_kv * plan.layout.row_tiles
    counters = torch.zeros(tiles + 1, dtype=torch.int32, device=DEVICE)
    counters[tiles] = 7
    monkeypatch.setattr(
        decode,
        "split_scratch",
        lambda device, tiles, size: (counters, torch.empty(size, dtype=FP32, device=device)),
    )
    for _ in range(2):
        out = plan.launch(q, k, v)
        assert counters[:tiles].eq(0).all() and counters[tiles] == 7
        expected = attention(q, k, v, bias, scale=0.25, enable_gqa=True)
        low = attention(q, k, v, bias, scale=0.25, enable_gqa=True, dtype=FP32)
        rounding = flash_rounding(q, k, v, bias, torch.zeros_like(q), scale=0.25)[:1]
        assert_close_to_oracle([out], [expected], [low], FP32, ("out",), rounding)


@pytest.mark.parametrize("name", ["everything", "documents_shared"])
def test_the_merge_kernel_gives_what_the_last_share_gives(
    name: str, monkeypatch: pytest.MonkeyPatch, poison_empty: list[Tensor]
) -> None:
    """Launches that keep no counters (captured in a CUDA graph, traced) merge the shares in
    a second kernel: the same output, bit for bit, also with shares that see no key."""
    bias, batch, heads_q, heads_kv, length_q, length_kv = BIASES[name]()
    q, k, v = make_qkv(batch, heads_q, heads_kv, length_q, length_kv, 16, FP32)
    program = program_of(bias, length_q, length_kv)
    for splits in (3, -(-length_kv // BLOCK_N) + 3):
        merged_last = check(q, k, v, bias, program, splits=splits)
        with monkeypatch.context() as patch:
            patch.setattr(decode, "merges_in_kernel", lambda device: False)
            apart = check(q, k, v, bias, program, splits=splits)
        assert torch.equal(apart, merged_last)


def test_traced_launches_merge_in_a_second_kernel() -> None:
    """A launch traced by ``torch.compile`` keeps no counters (it may end up in a CUDA graph
    replayed on any stream); an eager one merges in its last share."""
    from attnbias.kernels.launch import traceable_launches

    device = torch.device(DEVICE)
    assert decode.merges_in_kernel(device)
    assert decode.split_scratch(device, 2, 8) is not None
    with traceable_launches():
        assert not decode.merges_in_kernel(device)
        assert decode.split_scratch(device, 2, 8) is None


def test_split_scratch_is_zeroed_counters_and_room_for_the_partials() -> None:
    scratch = decode.split_scratch(torch.device(DEVICE), 5, 300)
    assert scratch is not None
    counters, parts = scratch
    assert counters.dtype == torch.int32 and counters.numel() >= 5
    assert counters.eq(0).all()
    assert parts.dtype == FP32 and parts.numel() >= 300


@pytest.mark.gpu
def test_split_scratch_is_kept_per_stream_and_grows() -> None:
    """One stream's launches share its counters and partials (they run one after another);
    another stream gets its own; a launch that needs more gets larger ones."""
    device = torch.device("cuda")
    first = decode.split_scratch(device, 5, 300)
    again = decode.split_scratch(device, 3, 100)
    assert first is not None and again is not None
    assert first[0] is again[0] and first[1] is again[1]
    with torch.cuda.stream(torch.cuda.Stream()):
        other = decode.split_scratch(device, 5, 300)
    assert other is not None
    assert other[0].data_ptr() != first[0].data_ptr()
    assert other[1].data_ptr() != first[1].data_ptr()
    grown = decode.split_scratch(device, 5, first[1].numel() + 1)
    assert grown is not None and grown[1].numel() > first[1].numel() and grown[0] is first[0]


def test_a_window_reads_only_its_keys() -> None:
    """Keys and values outside the blocks a window visits are never read, with any number of
    splits: NaN there changes nothing (the split range is the visited blocks, not [0, S))."""
    length_q, length_kv, window = 3, 200, 20
    bias = causal_lower_right() + SlidingWindowBias(window - 1)
    q, k, v = make_qkv(1, 4, 1, length_q, length_kv, 16, FP32)
    first_key = length_kv - length_q - (window - 1)
    unread = first_key // BLOCK_N * BLOCK_N  # keys before the first visited block
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[:, :, :unread] = math.nan
    dirty_v[:, :, :unread] = math.nan
    program = program_of(bias, length_q, length_kv)
    for splits in (None, 1, 3, 8):
        clean = decode_forward(q, k, v, program, scale=0.25, num_splits=splits)
        dirty = decode_forward(q, dirty_k, dirty_v, program, scale=0.25, num_splits=splits)
        assert torch.equal(clean, dirty)
    check(q, dirty_k.nan_to_num(), dirty_v.nan_to_num(), bias, program)


def test_keys_outside_the_key_range_are_never_read() -> None:
    """NaN and Inf in every key and value outside each batch row's key range change nothing,
    bit for bit, with any number of splits (they are neither loaded nor weighted)."""
    bias = KeyRangeBias(start=[3, 21], end=[50, 44]) + causal_lower_right()
    length_q, length_kv = 4, 70
    q, k, v = make_qkv(2, 4, 2, length_q, length_kv, 16, FP32)
    outside = torch.ones(2, length_kv, dtype=torch.bool, device=DEVICE)
    for row, (start, end) in enumerate(((3, 50), (21, 44))):
        outside[row, start:end] = False
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[outside[:, None, :, None].expand_as(k)] = math.nan
    dirty_v[outside[:, None, :, None].expand_as(v)] = math.inf
    zero_k = k.masked_fill(outside[:, None, :, None], 0.0)
    zero_v = v.masked_fill(outside[:, None, :, None], 0.0)
    program = program_of(bias, length_q, length_kv)
    for splits in (None, 1, 3, 9):
        clean = decode_forward(q, zero_k, zero_v, program, scale=0.25, num_splits=splits)
        dirty = decode_forward(q, dirty_k, dirty_v, program, scale=0.25, num_splits=splits)
        assert torch.equal(clean, dirty)
    check(q, zero_k, zero_v, bias, program)


def test_visited_key_blocks() -> None:
    block = 64
    # a window of W keys visits about W / block blocks whatever S is
    for length_kv in (4096, 32768):
        lo, hi = length_kv - 4 - 255, length_kv - 4  # 256-key window, L = 4
        assert visited_key_blocks(4, length_kv, lo, hi, False, block) in (5, 6)
    assert visited_key_blocks(4, 32768, None, 32768 - 4, False, block) == 512
    assert visited_key_blocks(4, 32768, None, None, False, block) == 512
    assert visited_key_blocks(4, 32768, 100, None, False, block) == 511  # keys 100..32767
    # documents: their extent is on the device, so every key counts
    assert visited_key_blocks(4, 32768, 32000, 32764, True, block) == 512
    assert visited_key_blocks(4, 100, 5, 2, False, block) == 0  # an empty band
    assert visited_key_blocks(4, 100, None, -10, False, block) == 0  # keys before the first


# the shapes num_splits is drawn at
SPLIT_SHAPES = {
    "batch": st.integers(1, 64),
    "kv_heads": st.integers(1, 64),
    "row_tiles": st.integers(1, 8),
    "key_blocks": st.integers(0, 4096),
    "sms": st.sampled_from([16, 108, 132, 148]),
}


@given(**SPLIT_SHAPES)
def test_num_splits_properties(
    batch: int, kv_heads: int, row_tiles: int, key_blocks: int, sms: int
) -> None:
    splits = num_splits(
        batch=batch, kv_heads=kv_heads, row_tiles=row_tiles, key_blocks=key_blocks, sms=sms
    )
    assert 1 <= splits <= max(1, key_blocks)
    assert splits <= decode.MAX_SPLITS
    programs = batch * kv_heads * row_tiles
    if programs >= sms:  # the programs fill the GPU already
        assert splits == 1
    # never more than two waves of programs (rounded up to whole splits)
    assert programs * splits < 2 * sms + programs


def test_num_splits_choices() -> None:
    h100 = 132

    def splits(batch: int, kv_heads: int, key_blocks: int, row_tiles: int = 1) -> int:
        return num_splits(
            batch=batch, kv_heads=kv_heads, row_tiles=row_tiles, key_blocks=key_blocks, sms=h100
        )

    # B = 8, Hkv = 8, L = 4, S = 32768 with 64-key blocks: 64 programs, half the GPU idle
    assert splits(8, 8, 512) > 1
    # a long cache at batch size 1 splits further
    assert splits(1, 8, 512) > splits(8, 8, 512)
    # enough programs: no split
    assert splits(32, 8, 512) == 1
    assert splits(4, 8, 512, row_tiles=4) == 1
    # a 256-key window visits 5 blocks: fewer splits than the full cache, at most 5
    assert splits(1, 8, 5) < splits(1, 8, 512)
    assert splits(1, 8, 5) <= 5
    assert splits(1, 8, 1) == 1
    # tiles that compute little per key: half the GPU busy is busy enough
    assert num_splits(batch=8, kv_heads=8, row_tiles=1, key_blocks=256, sms=h100,
                      full_enough=0.45) == 1  # fmt: skip
    assert num_splits(batch=4, kv_heads=8, row_tiles=1, key_blocks=256, sms=h100,
                      full_enough=0.45) > 1  # fmt: skip


@pytest.mark.parametrize(
    ("bandwidth", "sms", "expected"),
    [
        (3.35e12, 132, 0.45),  # an H100: the share as measured there
        (2.04e12, 108, 0.45),  # less bandwidth a multiprocessor (an A100): never lowered
        (4.8e12, 132, 0.45 * 4.8 / 3.35),  # an H200: scaled
        (8.0e12, 148, decode.FULL_ENOUGH),  # far more (a B200): capped
    ],
)
def test_small_tiles_keep_more_multiprocessors_busy_where_each_reads_faster(
    bandwidth: float, sms: int, expected: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The small tiles' share of busy multiprocessors scales with the memory bandwidth per
    multiprocessor against the H100's; so a window's 64 programs at L = 1 split in two on
    an H200 (measured faster there) and not on an H100 (measured faster unsplit)."""
    monkeypatch.setattr(decode, "interpreting", lambda: False)
    monkeypatch.setattr(decode, "_cuda_bandwidth_per_sm", lambda index: bandwidth / sms)
    small = decode._GPU_SMALL_TILE_CONFIGS[128]
    share = decode.full_enough_on(small, torch.device("cuda", 0))
    assert share == pytest.approx(expected)
    general = decode._GPU_CONFIGS[128]  # (the general tiles' share is not the small tiles')
    assert decode.full_enough_on(general, torch.device("cuda", 0)) == general.full_enough
    window = num_splits(batch=8, kv_heads=8, row_tiles=1, key_blocks=32, sms=132,
                        full_enough=share)  # fmt: skip
    assert window == (2 if bandwidth / sms > 1.1 * 3.35e12 / 132 else 1)


@given(**SPLIT_SHAPES, min_share=st.integers(1, 64))
def test_num_splits_ragged_properties(
    batch: int, kv_heads: int, row_tiles: int, key_blocks: int, sms: int, min_share: int
) -> None:
    """Rows of unequal lengths: never fewer splits than even rows get; beyond that count,
    within the same bounds, at most RAGGED_WAVES waves' worth, shares of at least
    ``min_share`` blocks, and waves filled within SPLIT_EFFICIENCY of the best count's; no
    count that leaves the largest share as the count below it does."""
    shape = {"batch": batch, "kv_heads": kv_heads, "row_tiles": row_tiles, "sms": sms}
    even = num_splits(key_blocks=key_blocks, **shape)
    splits = num_splits(key_blocks=key_blocks, ragged=True, min_share=min_share, **shape)
    assert 1 <= splits <= max(1, key_blocks)
    assert splits <= decode.MAX_SPLITS
    assert splits >= even
    programs = batch * kv_heads * row_tiles
    if splits > even:
        assert programs * splits < decode.RAGGED_WAVES * sms + programs
        assert key_blocks // splits >= min_share

        def efficiency(count: int) -> float:
            waves = programs * count / sms
            return waves / math.ceil(waves)

        changes = [
            count
            for count in range(1, splits + 1)
            if count == 1 or -(-key_blocks // count) < -(-key_blocks // (count - 1))
        ]
        assert efficiency(splits) >= decode.SPLIT_EFFICIENCY * max(map(efficiency, changes))
    if splits > 1:
        assert -(-key_blocks // splits) < -(-key_blocks // (splits - 1))


def test_rows_of_unequal_lengths_split_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Key ranges (or documents) whose band does not bound a row's keys: each row's keys cut
    into shares for several waves of programs (B = 8, Hkv = 8, a cache of 32768, as a
    server's rows of 4096 to 32768 tokens), not one program per row and head, which leaves
    the longest row's programs running alone; a window's band (or ``even_rows``) keeps the
    even rule; the interpreter keeps the even rule."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(decode, "interpreting", lambda: False)
    monkeypatch.setattr(decode, "_cuda_shared_memory", lambda index: 227 * 1024)  # H100
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(decode, "_cuda_bandwidth_per_sm", lambda index: 3.35e12 / 132)
    starts = torch.zeros(8, dtype=torch.int32)
    ranged = MaskProgram(band_hi=32767, kv_start=starts)
    plain = MaskProgram(band_hi=32767)
    windowed = MaskProgram(band_lo=32767 - 4095, band_hi=32767, kv_start=starts)

    def splits(
        program: MaskProgram,
        device: torch.device = cuda,
        k_shape: tuple[int, ...] = (8, 8, 32768, 128),
        **kwargs: Any,
    ) -> int:
        layout = decode.decode_layout(
            (8, 32, 1, 128), k_shape, device, program, itemsize=2, **kwargs
        )
        return layout.splits

    assert splits(plain) == 1  # 64 programs of little work per key: busy enough
    # 2 waves of 132 programs where 64 fill half of one (4 shares of 8192 keys each)
    assert splits(ranged) == 4
    # a short cache: no share below RAGGED_MIN_KEYS, so the even rule's count
    short = MaskProgram(band_hi=2047, kv_start=starts)
    assert splits(short, k_shape=(8, 8, 2048, 128)) == 1
    assert splits(ranged, even_rows=True) == splits(plain)
    assert splits(windowed) == splits(MaskProgram(band_lo=32767 - 4095, band_hi=32767))
    monkeypatch.setattr(decode, "interpreting", lambda: True)
    assert splits(ranged, torch.device("cpu")) == splits(plain, torch.device("cpu"))


def test_small_tiles_take_their_config_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of at most 16 packed rows at E=128 on key ranges of at most 32768 keys take
    longer key blocks and split less, on a GPU whose shared memory holds their blocks (16-bit
    inputs; not fp32, not another head dim, not more rows or keys); the interpreter always
    takes its own small tiles."""
    cuda = torch.device("cuda", 0)
    small, large = decode._GPU_SMALL_TILE_CONFIGS[128], decode._GPU_CONFIGS[128]
    assert small.block_n > large.block_n and small.full_enough < large.full_enough

    def config(block_e: int = 128, rows: int = 4, keys: int = 4096, itemsize: int = 2) -> Any:
        return decode.decode_config(block_e, rows=rows, keys=keys, itemsize=itemsize, device=cuda)

    monkeypatch.setattr(decode, "interpreting", lambda: True)
    assert config() == decode.INTERPRETER_CONFIG
    monkeypatch.setattr(decode, "interpreting", lambda: False)
    monkeypatch.setattr(decode, "_cuda_shared_memory", lambda index: 227 * 1024)  # H100
    assert config() is small
    assert config(rows=16, keys=decode.SMALL_TILE_MAX_KEYS) is small
    assert config(rows=17) is large
    assert config(keys=decode.SMALL_TILE_MAX_KEYS + 1) is large
    assert config(itemsize=4) is large
    assert config(block_e=64) is decode._GPU_CONFIGS[64]
    monkeypatch.setattr(decode, "_cuda_shared_memory", lambda index: 99 * 1024)
    assert config() is large
    # what a layout passes: the keys its band visits (a window's, not the cache's)
    seen: list[int] = []
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(
        decode, "decode_config", lambda *args, keys, **kwargs: seen.append(keys) or large
    )
    window = MaskProgram(band_lo=131071 - 4095, band_hi=131071)
    decode.decode_layout((8, 32, 1, 128), (8, 8, 131072, 128), cuda, window, itemsize=2)
    assert seen == [4096]


# --------------------------------------------------------------------------------------
# Layouts, empty dimensions
# --------------------------------------------------------------------------------------


def test_non_contiguous_inputs() -> None:
    generator = torch.Generator().manual_seed(5)
    # (B, L, H, E) storage seen as (B, H, L, E); keys and values interleaved with stride 2
    q = torch.randn(2, 3, 4, 16, generator=generator).to(DEVICE, FP16).transpose(1, 2)
    kv = torch.randn(2, 70, 2, 2, 32, generator=generator).to(DEVICE, FP16)
    k = kv[:, :, 0, :, ::2].transpose(1, 2)
    v = kv[:, :, 1, :, 1::2].transpose(1, 2)
    bias = causal_lower_right() + AlibiBias(num_heads=4)
    check(q, k, v, bias, program_of(bias, 3, 70), splits=3)


def test_empty_dimensions() -> None:
    program = MaskProgram()
    q, k, v = make_qkv(1, 4, 2, 3, 0, 16, FP32)  # no keys: every row is 0
    assert torch.equal(decode_forward(q, k, v, program, scale=0.25), torch.zeros_like(q))
    q, k, v = make_qkv(1, 4, 2, 0, 20, 16, FP32)  # no queries
    assert decode_forward(q, k, v, program, scale=0.25).shape == (1, 4, 0, 16)


@given(scale=finite_scales(), seed=st.integers(0, 2**16))
def test_any_finite_scale(scale: float, seed: int) -> None:
    q, k, v = make_qkv(1, 2, 1, 2, 30, 16, FP32, seed)
    bias = causal_lower_right() + SlidingWindowBias(20)
    check(q, k, v, bias, program_of(bias, 2, 30), splits=2, scale=scale)


# --------------------------------------------------------------------------------------
# Through attnbias.sdpa, and the planner
# --------------------------------------------------------------------------------------


@st.composite
def decode_calls(draw: st.DrawFn) -> tuple[Tensor, Tensor, Tensor, AttnBias, float | None]:
    """A short-query call the decode kernel takes: any kernel-form bias, GQA groups of 1 to
    4, L from 1 to 16 against S from 1 to 40, any dtype."""
    batch = draw(st.integers(1, 2))
    heads_kv = draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.sampled_from([1, 2, 3, 4]))
    length_q = draw(st.integers(1, 16))
    length_kv = draw(st.integers(1, 40))
    dtype = draw(st.sampled_from(DTYPES))
    bias = draw(kernel_bias(batch, heads_q, length_q, length_kv))
    q, k, v = make_qkv(
        batch, heads_q, heads_kv, length_q, length_kv, 16, dtype, draw(st.integers(0, 2**16))
    )
    return q, k, v, bias, draw(st.sampled_from([None, 0.3]))


@given(call=decode_calls())
def test_sdpa_on_the_decode_kernel(
    call: tuple[Tensor, Tensor, Tensor, AttnBias, float | None],
) -> None:
    q, k, v, bias, scale = call
    gqa = q.shape[1] != k.shape[1]
    with use_backends("triton-decode"):
        out = attnbias.sdpa(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    expected = attention(q, k, v, bias, scale=scale, enable_gqa=gqa)
    low = attention(q, k, v, bias, scale=scale, enable_gqa=gqa, dtype=q.dtype)
    rounding = flash_rounding(q, k, v, bias, torch.zeros_like(q), scale=scale)[:1]
    assert_close_to_oracle([out], [expected], [low], q.dtype, ("out",), rounding)


def fake_gpu(monkeypatch: pytest.MonkeyPatch, generation: str) -> None:
    """CPU tensors that the planner takes for a GPU's (the kernels run interpreted)."""
    monkeypatch.setattr(planner, "generation", lambda device: generation)
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: True)
    monkeypatch.setattr(triton_backend, "_triton_installed", lambda: True)


def short_call(
    length_q: int = 4, *, needs_grad: bool = False, bias: AttnBias | None = None
) -> dict[str, Any]:
    q, k, v = make_qkv(2, 8, 2, length_q, 96, 16, BF16)
    return dict(
        query=q.requires_grad_(needs_grad),
        key=k,
        value=v,
        attn_mask=causal_lower_right() + SlidingWindowBias(40) if bias is None else bias,
        enable_gqa=True,
    )


@pytest.mark.parametrize("generation", ["hopper", "cuda", "cpu"])
def test_planner_takes_the_decode_kernel_for_short_queries(
    monkeypatch: pytest.MonkeyPatch, generation: str
) -> None:
    fake_gpu(monkeypatch, generation)
    text = attnbias.explain(**short_call())
    assert text.startswith("triton-decode: "), text
    assert "4 query heads x 4 queries per key/value head packed into 1 tile of 16 rows" in text
    assert "  triton: could run it, after triton-decode in the order" in text.splitlines()
    out = attnbias.sdpa(**short_call())
    call = short_call()
    expected = attention(
        call["query"], call["key"], call["value"], call["attn_mask"], enable_gqa=True
    )
    low = attention(
        call["query"], call["key"], call["value"], call["attn_mask"], enable_gqa=True, dtype=BF16
    )
    assert_close_to_oracle([out], [expected], [low], BF16)


def test_planner_takes_the_training_kernel_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, "cuda")
    text = attnbias.explain(**short_call(needs_grad=True))
    assert text.startswith("triton: "), text
    assert "  triton-decode: gradients are required: the training kernel runs" in text
    long = MAX_DECODE_QUERIES + 1
    text = attnbias.explain(**short_call(long))
    assert text.startswith("triton: "), text
    assert f"L={long} queries is above the decode kernel's {MAX_DECODE_QUERIES}" in text
    # ALiBi on Hopper: the decode kernel first, then the training kernel, then FlashAttention 4
    call = short_call(bias=AlibiBias(num_heads=8) + causal_lower_right())
    assert planner.PRIORITY["hopper"]["alibi"].inference[:2] == ("triton-decode", "triton")
    fake_gpu(monkeypatch, "hopper")
    assert attnbias.explain(**call).startswith("triton-decode: ")


def test_a_traced_call_takes_the_decode_kernel_and_a_training_call_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_gpu(monkeypatch, "cuda")
    call = short_call()
    spec = make_spec(
        call["query"], call["key"], call["value"], call["attn_mask"], False, None, 0.0, True
    )
    assert plan(spec).backend.name == "triton-decode"
    assert plan(dataclasses.replace(spec, compiling=True)).backend.name == "triton-decode"
    training = plan(dataclasses.replace(spec, needs_grad=True))
    assert training.backend.name == "triton"
    assert "triton-decode: gradients are required" in training.explain()


def fake_capture(monkeypatch: pytest.MonkeyPatch, capturing: bool) -> None:
    """Calls that the planner and the plan cache take for calls being captured in a CUDA
    graph (``capturing``), or not; FlashAttention 4 faked as installed on a Hopper GPU."""
    import attnbias.backends.fa4 as fa4
    import attnbias.plan_cache as plan_cache
    import attnbias.spec as spec_module

    for module in (spec_module, plan_cache):
        monkeypatch.setattr(module, "capturing", lambda tensor: capturing)
    for module in (planner, plan_cache):
        monkeypatch.setattr(module, "capturable", lambda tensor: True)
    monkeypatch.setattr(fa4, "_on_cuda", lambda device: True)
    monkeypatch.setattr(fa4, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(fa4, "_installed", lambda: True)


def captured_call(
    length_q: int, length_kv: int, bias: AttnBias, heads_q: int = 8, heads_kv: int = 2
) -> dict[str, Any]:
    q, k, v = make_qkv(1, heads_q, heads_kv, length_q, length_kv, 64, BF16)
    return dict(query=q, key=k, value=v, attn_mask=bias, enable_gqa=True)


WINDOW_40 = causal_lower_right() + SlidingWindowBias(40)


@pytest.mark.parametrize(
    ("length_q", "length_kv", "bias", "heads_q", "first"),
    [
        (4, 96, WINDOW_40, 8, "fa4"),  # 16 packed rows
        (16, 9000, WINDOW_40, 8, "fa4"),  # a window keeps few of many keys
        (4, 8192, causal_lower_right(), 8, "fa4"),  # 8192 keys, the most
        (4, 8193, causal_lower_right(), 8, "triton-decode"),  # one key more
        (3, 96, WINDOW_40, 8, "triton-decode"),  # 12 packed rows
        (4, 96, WINDOW_40, 4, "triton-decode"),  # 8 packed rows
        (4, 96, causal_lower_right() + AlibiBias(num_heads=8), 8, "triton-decode"),
        (4, 96, causal_lower_right() + SoftcapBias(30.0), 8, "triton-decode"),
    ],
)
def test_captured_decodes_try_flash_attention_4_first_where_it_is_faster(
    monkeypatch: pytest.MonkeyPatch,
    length_q: int,
    length_kv: int,
    bias: AttnBias,
    heads_q: int,
    first: str,
) -> None:
    """Captured in a CUDA graph, a band or causal decode of at least 16 packed rows over at
    most 8192 keys takes FlashAttention 4 (faster in graph replays there); the same call
    uncaptured takes the decode kernel (FlashAttention 4's host time is far above it), and
    explain says why."""
    fake_gpu(monkeypatch, "hopper")
    call = captured_call(length_q, length_kv, bias, heads_q=heads_q)
    fake_capture(monkeypatch, False)
    assert attnbias.explain(**call).startswith("triton-decode: ")
    fake_capture(monkeypatch, True)
    text = attnbias.explain(**call)
    assert text.startswith(f"{first}: "), text
    captured = "captured in a CUDA graph, a decode of at least 16 packed rows over at most 8192"
    assert (captured in text) == (first == "fa4"), text
    if first == "fa4":
        assert "  triton-decode: could run it, after fa4 in the order" in text.splitlines()


def test_one_plan_cache_entry_serves_both_capture_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call warmed up eagerly and then captured keeps its one plan-cache entry (the capture
    validates and plans nothing again), which takes FlashAttention 4 while capturing and the
    decode kernel otherwise. A first call made while capturing is not kept (what its lowering
    made then is filled only when that graph replays): the eager call after it makes the one
    entry, which the next captured call takes."""
    import attnbias.backends.fa4 as fa4
    from attnbias import plan_cache

    class MarkedFa4(fa4.FlashAttention4):
        """FlashAttention 4's reasons (on the faked Hopper GPU), a marker for its output."""

        def prepare(self, spec: Any) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
            return lambda query, key, value: torch.full_like(query, 7.0)

    fake_gpu(monkeypatch, "hopper")
    monkeypatch.setitem(BACKENDS, "fa4", MarkedFa4())
    call = captured_call(4, 96, WINDOW_40)
    for first_captured in (False, True):
        plan_cache.clear()
        outs = {}
        for index, capturing in enumerate((first_captured, not first_captured, first_captured)):
            fake_capture(monkeypatch, capturing)
            with torch.no_grad():
                outs[capturing] = attnbias.sdpa(**call)
            assert len(plan_cache._ENTRIES) == (0 if first_captured and index == 0 else 1)
        assert (outs[True] == 7.0).all()
        expected = attention(call["query"], call["key"], call["value"], WINDOW_40, enable_gqa=True)
        low = attention(
            call["query"], call["key"], call["value"], WINDOW_40, enable_gqa=True, dtype=BF16
        )
        assert_close_to_oracle([outs[False]], [expected], [low], BF16)


def test_captured_calls_keep_the_decode_kernel_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off Hopper and Blackwell, with gradients, beyond the decode kernel's queries, or with
    a key range, capture changes nothing."""
    fake_capture(monkeypatch, True)
    call = captured_call(4, 96, WINDOW_40)
    spec = make_spec(
        call["query"], call["key"], call["value"], call["attn_mask"], False, None, 0.0, True
    )
    assert spec.capturing
    assert planner.captured_fa4_first("hopper", spec)
    assert planner.captured_fa4_first("blackwell", spec)
    assert not planner.captured_fa4_first("cuda", spec)
    assert not planner.captured_fa4_first("hopper", dataclasses.replace(spec, needs_grad=True))
    long = captured_call(MAX_DECODE_QUERIES + 1, 96, WINDOW_40)
    spec = make_spec(long["query"], long["key"], long["value"], WINDOW_40, False, None, 0.0, True)
    assert not planner.captured_fa4_first("hopper", spec)  # not a decode
    ranged = WINDOW_40 + KeyRangeBias(torch.tensor([0]), torch.tensor([90]))
    spec = make_spec(call["query"], call["key"], call["value"], ranged, False, None, 0.0, True)
    assert not planner.captured_fa4_first("hopper", spec)


def test_refusals_name_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpu(monkeypatch, "cuda")
    decode_backend = BACKENDS["triton-decode"]

    def reasons(**changes: Any) -> str:
        call = short_call()
        q, k, v = (changes.pop(name, call[name]) for name in ("query", "key", "value"))
        spec = make_spec(
            q, k, v, call["attn_mask"], False, None, changes.pop("dropout_p", 0.0), True
        )
        return "; ".join(decode_backend.not_supported_reasons(spec))

    call = short_call()
    assert "dropout_p=0.5 is not fused in the decode kernel" in reasons(dropout_p=0.5)
    assert "value head dim (8) differs from the query head dim (16)" in reasons(
        value=call["value"][..., :8]
    )
    wide = torch.randn(2, 2, 96, 272, dtype=BF16)
    assert "head dim 272 is above the kernel's 256" in reasons(
        query=torch.randn(2, 8, 4, 272, dtype=BF16), key=wide, value=wide
    )
    monkeypatch.setattr(triton_backend, "_interpreting", lambda: False)
    on_cpu = {name: call[name].cpu() for name in ("query", "key", "value")}
    assert "the decode kernel needs CUDA tensors and these are on cpu" in reasons(**on_cpu)


# --------------------------------------------------------------------------------------
# GPU: real sizes, CUDA graphs
# --------------------------------------------------------------------------------------


def gpu_bias(name: str, heads: int, length_q: int, length_kv: int) -> AttnBias:
    """A bias of each kind at a real size; documents per batch row, the queries in the last."""
    if name == "documents":
        starts = torch.tensor([[3000], [5000]])
        kv_ids = (torch.arange(length_kv)[None, :] >= starts).long()
        q_ids = torch.ones(2, length_q, dtype=torch.long)
        return DocumentBias(q_ids.cuda(), kv_ids.cuda()) + causal_lower_right()
    return {
        "causal_lower_right": lambda: causal_lower_right(),
        "window": lambda: causal_lower_right() + SlidingWindowBias(1023),
        "alibi": lambda: AlibiBias(num_heads=heads) + causal_lower_right(),
        "gemma2": lambda: causal_lower_right() + SlidingWindowBias(4095) + SoftcapBias(50.0),
        # left padding in one batch row, a cache filled to 6000 keys in the other
        "key_range": lambda: (
            KeyRangeBias(
                start=torch.tensor([0, 1000]).cuda(), end=torch.tensor([6000, 8192]).cuda()
            )
            + causal_lower_right()
        ),
    }[name]()


GPU_NAMES = ["causal_lower_right", "window", "documents", "alibi", "gemma2", "key_range"]


@pytest.mark.gpu
@pytest.mark.parametrize("length_q", [1, 4, 16])
@pytest.mark.parametrize("name", GPU_NAMES)
def test_real_size_on_the_gpu(name: str, length_q: int) -> None:
    batch, heads_q, heads_kv, length_kv, head_dim = 2, 32, 8, 8192, 128
    bias = gpu_bias(name, heads_q, length_q, length_kv)
    q, k, v = make_qkv(batch, heads_q, heads_kv, length_q, length_kv, head_dim, BF16)
    with use_backends("triton-decode"):
        route = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True)
        out = attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)
    assert route.startswith("triton-decode:"), route
    expected = attention(q, k, v, bias, enable_gqa=True)
    low = attention(q, k, v, bias, enable_gqa=True, dtype=BF16)
    rounding = flash_rounding(q, k, v, bias, torch.zeros_like(q))[:1]
    assert_close_to_oracle([out], [expected], [low], BF16, ("out",), rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["window", "documents", "alibi", "gemma2", "key_range"])
def test_cuda_graph_capture_and_replay(name: str) -> None:
    """One decode call captured in a CUDA graph, replayed on new contents of the same
    buffers, gives what an eager call gives (nothing on the host depends on the contents)."""
    q, k, v = make_qkv(2, 32, 8, 4, 8192, 128, BF16)
    bias = gpu_bias(name, 32, 4, 8192)

    def call() -> Tensor:
        with use_backends("triton-decode"):
            return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

    with use_backends("triton-decode"):
        route = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True)
    assert route.startswith("triton-decode:"), route
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels and keep the plan before capturing
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for target, new in zip((q, k, v), make_qkv(2, 32, 8, 4, 8192, 128, BF16, seed=1), strict=True):
        target.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    ("name", "length_q"), [("window", 4), ("window", 16), ("causal_lower_right", 16)]
)
def test_a_captured_call_takes_its_graph_route_and_matches_the_oracle(
    name: str, length_q: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Decodes of 16 and 64 packed rows over 8192 keys, warmed up eagerly (the decode kernel)
    and then captured: the captured call takes FlashAttention 4 where it is installed on
    Hopper or Blackwell (faster in replays), the decode kernel elsewhere, and its replays on
    new contents are held to the oracle."""
    from attnbias.backends import fa4

    q, k, v = make_qkv(2, 32, 8, length_q, 8192, head_dim, dtype)
    bias = gpu_bias(name, 32, length_q, 8192)

    def call() -> Tensor:
        return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

    assert attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True).startswith("triton-decode")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
        spec = make_spec(q, k, v, bias, False, None, 0.0, True)
        route = plan(spec).backend.name
    assert spec.capturing
    gen = planner.generation(q.device)
    faster = fa4._installed() and gen in ("hopper", "blackwell")
    assert route == ("fa4" if faster else "triton-decode")
    new_inputs = make_qkv(2, 32, 8, length_q, 8192, head_dim, dtype, seed=1)
    for target, new in zip((q, k, v), new_inputs, strict=True):
        target.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    expected = attention(q, k, v, bias, enable_gqa=True)
    low = attention(q, k, v, bias, enable_gqa=True, dtype=dtype)
    rounding = flash_rounding(q, k, v, bias, torch.zeros_like(q))[:1]
    assert_close_to_oracle([out], [expected], [low], dtype, ("out",), rounding)


@pytest.mark.gpu
def test_split_launches_share_counters_per_stream() -> None:
    """Eager split launches in a row on one stream, and interleaved on two streams, each give
    the same output bit for bit (the merge by the last share to finish races with nothing),
    and leave every stream's counters at 0."""
    q, k, v = make_qkv(2, 32, 8, 4, 8192, 128, BF16)
    bias = gpu_bias("window", 32, 4, 8192)
    plan = decode.plan_decode(q, k, v, program_of(bias, 4, 8192), scale=0.1, num_splits=8)
    first = plan.launch(q, k, v)
    expected = attention(q, k, v, bias, scale=0.1, enable_gqa=True)
    low = attention(q, k, v, bias, scale=0.1, enable_gqa=True, dtype=BF16)
    rounding = flash_rounding(q, k, v, bias, torch.zeros_like(q), scale=0.1)[:1]
    assert_close_to_oracle([first], [expected], [low], BF16, ("out",), rounding)
    streams = [torch.cuda.current_stream(), torch.cuda.Stream()]
    streams[1].wait_stream(streams[0])
    outs = []
    for n in range(200):
        with torch.cuda.stream(streams[n % 2]):
            outs.append(plan.launch(q, k, v))
    torch.cuda.synchronize()
    assert all(torch.equal(out, first) for out in outs)
    for stream in streams:
        with torch.cuda.stream(stream):
            scratch = decode.split_scratch(q.device, 1, 1)
            assert scratch is not None and scratch[0].eq(0).all()


@pytest.mark.gpu
def test_the_merge_kernel_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated launches that merge in a second kernel (the second one goes through the
    compiled kernels' own launchers) give what the last share's merge gives, bit for bit."""
    q, k, v = make_qkv(2, 32, 8, 4, 8192, 128, BF16)
    bias = gpu_bias("window", 32, 4, 8192)
    plan = decode.plan_decode(q, k, v, program_of(bias, 4, 8192), scale=0.1, num_splits=8)
    merged_last = plan.launch(q, k, v)
    assert plan.merge is not None and not plan.merge.runners
    # what a launch sees while its stream is capturing a CUDA graph
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True)
    for _ in range(3):
        assert torch.equal(plan.launch(q, k, v), merged_last)
    assert plan.merge.runners  # the second kernel ran, through its own launcher after the first


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", ["window", "key_range"])
def test_a_compiled_decode_step_runs_the_decode_kernel(name: str) -> None:
    """Under ``torch.compile(fullgraph=True)`` a short query takes the decode kernel's op (in
    the traced graph), and with ``mode="reduce-overhead"`` (CUDA graphs) gives what the eager
    decode kernel gives."""
    q, k, v = make_qkv(2, 32, 8, 4, 8192, 128, BF16)
    bias = gpu_bias(name, 32, 4, 8192)

    def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

    targets: list[str] = []

    def record(graph: torch.fx.GraphModule, inputs: list[Tensor]) -> Callable[..., Any]:
        targets.extend(str(node.target) for node in graph.graph.nodes)
        return graph.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(step, backend=record, fullgraph=True)(q, k, v)
        assert any("decode_fwd" in target for target in targets), targets
        assert not any("attention_fwd" in target for target in targets), targets
        expected = step(q, k, v)
        compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):  # warm-up, recording, replay
            out = compiled(q, k, v).clone()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)

"""Attention forward for short queries against long key/value caches (decoding, speculative
decoding, short chunks of new tokens): the same mask model and score modifiers as
``kernels/forward.py``, laid out for ``L`` of at most :data:`MAX_DECODE_QUERIES`.

Why the training kernel is slow here: it launches one program per (query block, query head,
batch entry), so a query of a few rows fills a few of the tile's rows, every query head of a
grouped-query group reads its key/value head again (``Hq / Hkv`` times the traffic), and
``B * Hq`` programs, each streaming the whole cache, leave most of a large GPU idle.

Packing. The ``G = Hq // Hkv`` query heads that share a key/value head and the ``L`` query rows
form one column of ``G * L`` rows, ordered query-major (row ``r`` is query ``r // G`` of head
``kv_head * G + r % G``), cut into tiles of ``BLOCK_M`` rows (at least 16, the tensor cores'
minimum). Each key/value block is then read once per group and tile instead of once per query
head, and consecutive queries share a tile, so a tile's key range is that of a few consecutive
rows: ``[row_lo[first], row_hi[last])``, the bound arithmetic of the training kernel. Each row
keeps its own ALiBi slope (heads differ within a tile).

Splitting. The key blocks a tile visits (its band and documents decide them, so a window of
``W`` keys visits about ``W / BLOCK_N`` blocks whatever ``S`` is) are cut into ``num_splits``
even shares, one program each; :func:`num_splits` picks the count on the host from the shapes
and the band alone (never from tensor contents, so the launch is CUDA-graph safe). Where the
rows' extents are on the device (documents, key ranges, pages) and the band does not bound
them, the rows may be of very unequal lengths: more, shorter shares then keep the GPU busy
while the longest row is read (:data:`RAGGED_WAVES`, :data:`RAGGED_MIN_KEYS`). With one
split the program normalises and stores the output. With more, each program stores its
normalised partial output ``o_s`` and its base-2 log-sum-exp ``lse_s`` in float32 and counts
itself done on the tile's counter; the program that finishes last merges the shares per row::

    M = max_s lse_s,    out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)

and sets the counter back to 0. Merging in the kernel that computed the shares, instead of in
a second kernel, saves a launch and its gap on the GPU and on the host. The counters (int32
zeros) and the partial results are kept per stream and shared by its launches
(:func:`split_scratch`): they run one after another, and each leaves the counters at 0.

A share with no kept key (empty, or all masked) has ``o_s = 0`` and ``lse_s = -inf``, so it
weighs nothing; a row whose shares are all empty gets 0.

Everything inside a tile (the inner loop over key blocks, masking by selection, any finite
scale, non-finite values in partial tiles) is the training kernel's ``_attn_fwd_inner``.

Shape legend: ``B`` batch, ``Hq`` query heads, ``Hkv`` key/value heads (``G = Hq // Hkv``),
``L`` queries (1 to :data:`MAX_DECODE_QUERIES`), ``S`` keys, ``E`` head dim (16 to 256).
"""

# The @triton.jit bodies annotate only their constexpr parameters.
# mypy: allow-incomplete-defs, allow-untyped-defs

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import triton
from torch import Tensor

from .configs import dot_precision, padded_head_dim
from .decode_kernels import _decode_fwd, _decode_merge
from .forward import check_identity, identity_of, stand_in
from .launch import PreparedLaunch, empty_contiguous, launches_traceable
from .limits import MAX_DECODE_QUERIES, interpreting
from .masks import launch_mask
from .pools import outside_pools
from .program import MaskProgram
from .record import MaskRecord, Pages, page_tensors

__all__ = [
    "MAX_DECODE_QUERIES",
    "DecodeConfig",
    "DecodeLayout",
    "DecodePlan",
    "decode_config",
    "decode_forward",
    "decode_layout",
    "merges_in_kernel",
    "num_splits",
    "plan_decode",
    "split_scratch",
    "visited_key_blocks",
]

MIN_ROWS = 16  # the smallest row count of a tensor-core product
MAX_SPLITS = 128  # beyond this the merge costs more than the parallelism gains
# FlashAttention 2's rule: take the fewest splits whose waves of programs fill the GPU to
# within this fraction of the best split count's.
SPLIT_EFFICIENCY = 0.85
# Below this fraction of the SMs busy, splitting the keys pays.
FULL_ENOUGH = 0.8
# Where each row's keys are known only on the device (documents, key ranges, pages), the rows
# of one call may hold far fewer keys than the cache: a row's share is then cut for up to this
# many waves of programs, so that the longest row's shares do not run alone while the rest of
# the GPU idles (a share past a row's end costs a program that stores an empty partial result),
# but no shorter than RAGGED_MIN_KEYS keys: rows that are full after all (a key range over a
# whole cache) then lose little to the extra shares and their merge. H100, rows of 4096 to
# 32768 keys: 2 waves as fast as 4 or 8; full rows of 8192 to 131072 keys lose 2-5% at 2 waves
# and up to 2.4x (B = 1, 8192 keys) at 8 waves without the shortest share.
RAGGED_WAVES = 2
RAGGED_MIN_KEYS = 2048
# The interpreter has no SMs: a fixed small machine keeps CPU tests deterministic, splitting
# the keys of one or two programs, and fast (each program costs the interpreter time).
INTERPRETER_SM_COUNT = 4
# Packed rows per program of the merge kernel
MERGE_ROWS = 4


# --------------------------------------------------------------------------------------
# Host side: configuration, layout and the number of splits
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel: ``block_n`` keys per block, at most
    ``max_rows`` packed rows per tile, the kernel's warps and pipeline stages, and
    ``full_enough``: the share of the multiprocessors that, each given a program, keeps the
    GPU busy enough that the keys are not split (:func:`num_splits`)."""

    block_n: int
    max_rows: int
    num_warps: int
    num_stages: int
    full_enough: float = FULL_ENOUGH


# Keyed by the head dim padded to a power of two (the warps at head dim 256 follow the
# training kernel's forward).
_GPU_CONFIGS = {
    16: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    32: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    64: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    128: DecodeConfig(block_n=64, max_rows=64, num_warps=4, num_stages=3),
    256: DecodeConfig(block_n=32, max_rows=64, num_warps=8, num_stages=2),
}
# A tile of at most 16 packed rows (a query or a few per group of heads) computes little per
# key it reads: on a key range of up to SMALL_TILE_MAX_KEYS, longer key blocks, more of them
# in flight, and one program per tile even when only half of the multiprocessors get one keep
# the memory as busy without the merge; longer ranges keep the general tiles, which are faster
# there (benchmarks/NOTES.md, "Figures behind the code's choices"). Taken where the stages'
# key and value blocks fit the device's shared memory.
_GPU_SMALL_TILE_CONFIGS = {
    128: DecodeConfig(block_n=128, max_rows=MIN_ROWS, num_warps=4, num_stages=3, full_enough=0.45),
}
SMALL_TILE_MAX_KEYS = 32768
# Shared memory a decode program needs beside its key and value blocks (the query tile,
# the compiler's scratch)
SHARED_MEMORY_SLACK = 16 * 1024
# The interpreter runs each program in numpy: small tiles keep CPU tests fast and still span
# several key blocks and row tiles.
INTERPRETER_CONFIG = DecodeConfig(block_n=16, max_rows=16, num_warps=1, num_stages=1)


@functools.cache
def _cuda_shared_memory(index: int) -> int:
    properties = torch.cuda.get_device_properties(index)
    return int(getattr(properties, "shared_memory_per_block_optin", 0))


def decode_config(
    block_e: int, *, rows: int, keys: int, itemsize: int, device: torch.device
) -> DecodeConfig:
    """The launch parameters for a head dim padded to ``block_e``, ``rows`` packed rows per
    key/value head (``Hq // Hkv * L``) that visit up to ``keys`` keys, inputs of ``itemsize``
    bytes, on ``device`` (the one place to tune)."""
    if interpreting():
        return INTERPRETER_CONFIG
    small = _GPU_SMALL_TILE_CONFIGS.get(block_e)
    if (
        small is not None
        and rows <= small.max_rows
        and keys <= SMALL_TILE_MAX_KEYS
        and device.type == "cuda"
    ):
        index = _cuda_index(device)
        blocks = small.num_stages * 2 * small.block_n * block_e * itemsize
        if blocks + SHARED_MEMORY_SLACK <= _cuda_shared_memory(index):
            return small
    return _GPU_CONFIGS[block_e]


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of ``device`` (a fixed count under the interpreter)."""
    if interpreting() or device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return _cuda_sm_count(_cuda_index(device))


def _cuda_index(device: torch.device) -> int:
    """The index of the CUDA ``device`` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


# The small tiles' ``full_enough`` was measured on an H100 (3.35 TB/s over 132
# multiprocessors). A GPU whose memory feeds each multiprocessor faster needs more of them
# reading to keep it busy: there the share scales with the bandwidth per multiprocessor, up
# to FULL_ENOUGH (an H200, 4.8 TB/s over 132: windows of 4096 keys at L = 1 and 4 17-21%
# faster in two splits than in one; on the H100 one split was 3% faster).
H100_BYTES_PER_S_PER_SM = 3.35e12 / 132


@functools.cache
def _cuda_bandwidth_per_sm(index: int) -> float:
    """``index``'s memory bandwidth per multiprocessor (bytes/s; double data rate over the
    bus), 0 where the driver does not give the memory's clock or bus width."""
    props = torch.cuda.get_device_properties(index)
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    return 2 * clock_khz * 1e3 * bus_bits / 8 / max(1, props.multi_processor_count)


def full_enough_on(config: DecodeConfig, device: torch.device) -> float:
    """``config.full_enough`` on ``device``: a share below :data:`FULL_ENOUGH` (the small
    tiles') scaled by the device's memory bandwidth per multiprocessor against the H100's
    (never lowered, at most :data:`FULL_ENOUGH`)."""
    if config.full_enough >= FULL_ENOUGH or interpreting() or device.type != "cuda":
        return config.full_enough
    scale = max(1.0, _cuda_bandwidth_per_sm(_cuda_index(device)) / H100_BYTES_PER_S_PER_SM)
    return min(FULL_ENOUGH, config.full_enough * scale)


def visited_key_blocks(
    seq_q: int,
    seq_k: int,
    band_lo: int | None,
    band_hi: int | None,
    has_docs: bool,
    block_n: int,
) -> int:
    """How many key blocks the queries visit: those holding keys ``[lo, hi)`` that some row
    keeps under the band (``band_lo <= j - i <= band_hi``, ``None`` open), all ``S`` keys
    with documents (their extent is on the device, not known here)."""
    lo, hi = 0, seq_k
    if band_lo is not None and band_hi is not None and band_lo > band_hi:
        return 0  # an empty band
    if not has_docs:
        if band_lo is not None:
            lo = max(lo, band_lo)  # the first row, i = 0, reaches furthest back
        if band_hi is not None:
            hi = min(hi, seq_q - 1 + band_hi + 1)  # the last row reaches furthest ahead
    if hi <= lo or seq_q == 0:
        return 0
    return (hi - 1) // block_n - lo // block_n + 1


def num_splits(
    *,
    batch: int,
    kv_heads: int,
    row_tiles: int,
    key_blocks: int,
    sms: int,
    full_enough: float = FULL_ENOUGH,
    ragged: bool = False,
    min_share: int = 1,
) -> int:
    """How many programs share the key blocks of one (batch entry, key/value head, row tile).

    One while ``batch * kv_heads * row_tiles`` programs keep ``full_enough`` of the ``sms``
    multiprocessors busy; otherwise FlashAttention 2's rule: the fewest splits whose waves of
    programs fill the GPU nearly as well as the best count does, counting only split counts
    that change the blocks per split, never more splits than ``key_blocks`` nor
    :data:`MAX_SPLITS`, nor more than two waves' worth (beyond that a split adds merge work
    and fills the GPU no better).

    ``ragged``: the rows' key counts are on the device (documents, key ranges, pages), up to
    ``key_blocks`` each; the host cannot see how unequal they are. Then, where it is more
    than the even rows' count, the most splits that fill their waves as well as the best
    count does, up to :data:`RAGGED_WAVES` waves' worth and shares of at least
    ``min_share`` blocks (and the same bounds), so that no row's share is long against the
    GPU's whole work.
    """
    programs = batch * kv_heads * row_tiles
    if programs == 0 or key_blocks <= 1:
        return 1

    def changes_share(splits: int) -> bool:
        # a split count that leaves the largest share as it was only adds merge work
        return splits == 1 or -(-key_blocks // splits) != -(-key_blocks // (splits - 1))

    def efficiency(splits: int) -> float:
        waves = programs * splits / sms
        return waves / -(-waves // 1)

    def fill(limit: int, most: bool) -> int:
        candidates = [s for s in range(1, max(1, limit) + 1) if changes_share(s)]
        best = max(efficiency(s) for s in candidates)
        good = [s for s in candidates if efficiency(s) >= SPLIT_EFFICIENCY * best]
        return good[-1] if most else good[0]

    if programs >= full_enough * sms:
        even = 1
    else:
        even = fill(min(MAX_SPLITS, key_blocks, -(-2 * sms // programs)), most=False)
    if not ragged:
        return even
    limit = min(MAX_SPLITS, key_blocks // max(1, min_share), -(-RAGGED_WAVES * sms // programs))
    return max(even, fill(limit, most=True))


@dataclass(frozen=True)
class DecodeLayout:
    """How a call runs: ``block_m`` packed rows per tile, ``row_tiles`` tiles per key/value
    head, ``splits`` programs per tile, and the launch ``config``."""

    group_size: int
    block_m: int
    row_tiles: int
    splits: int
    config: DecodeConfig


def decode_layout(
    q_shape: tuple[int, ...] | torch.Size,
    k_shape: tuple[int, ...] | torch.Size,
    device: torch.device,
    program: MaskProgram,
    *,
    itemsize: int,
    splits: int | None = None,
    even_rows: bool = False,
) -> DecodeLayout:
    """The layout of a call with ``q`` ``(B, Hq, L, E)`` and ``k`` ``(B, Hkv, S, E)`` of
    ``itemsize``-byte elements, from shapes and the program's band only (``splits`` forces
    the split count; ``even_rows``: the caller knows the rows keep about as many keys each,
    so the keys are not split for rows of unequal lengths)."""
    batch, num_heads, seq_q, head_dim = q_shape
    num_kv_heads, seq_k = k_shape[1], k_shape[2]
    band_lo, band_hi = program.band_lo, program.band_hi
    # the extent of documents and key ranges is on the device: count every key
    has_docs = program.has_docs or program.has_key_range
    group_size = num_heads // num_kv_heads if num_kv_heads else 1
    rows = group_size * seq_q
    keys = visited_key_blocks(seq_q, seq_k, band_lo, band_hi, has_docs, 1)
    config = decode_config(
        padded_head_dim(head_dim), rows=rows, keys=keys, itemsize=itemsize, device=device
    )
    block_m = min(config.max_rows, max(MIN_ROWS, triton.next_power_of_2(max(rows, 1))))
    row_tiles = triton.cdiv(rows, block_m)
    if splits is None:
        key_blocks = visited_key_blocks(seq_q, seq_k, band_lo, band_hi, has_docs, config.block_n)
        # rows of unequal lengths where the band does not bound what a row visits (a window
        # does: each row's tile visits its width); the interpreter's tests keep the two-wave
        # rule (each program costs it time)
        ragged = (
            has_docs
            and not even_rows
            and device.type == "cuda"
            and not interpreting()
            and visited_key_blocks(seq_q, seq_k, band_lo, band_hi, False, config.block_n)
            >= key_blocks
        )
        splits = num_splits(
            batch=batch,
            kv_heads=num_kv_heads,
            row_tiles=row_tiles,
            key_blocks=key_blocks,
            sms=sm_count(device),
            full_enough=full_enough_on(config, device),
            ragged=ragged,
            min_share=-(-RAGGED_MIN_KEYS // config.block_n),
        )
    return DecodeLayout(group_size, block_m, row_tiles, splits, config)


# --------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------


# (device index, stream) -> (counters, partial results) of the eager split launches on that
# stream: int32 zeros, one per tile, that each launch counts the finished shares of a tile in
# and sets back to 0 before it ends, and the float32 partial results the shares leave for the
# last one. The launches of one stream run one after another, so they can share both; a
# launch on another stream could run at the same time, so each stream has its own.
_SCRATCH: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def merges_in_kernel(device: torch.device) -> bool:
    """Whether a split launch now merges in its last share (on counters) rather than in a
    second kernel: yes for eager launches and under the interpreter; no for launches being
    traced by ``torch.compile`` or captured in a CUDA graph (a graph may be replayed on any
    stream, so it could not share counters with the launches of one)."""
    if launches_traceable():
        return False
    return device.type != "cuda" or not torch._C._cuda_isCurrentStreamCapturing()


def split_scratch(device: torch.device, tiles: int, part_size: int) -> tuple[Tensor, Tensor] | None:
    """``(counters, parts)`` for an eager split launch on ``device`` whose last share merges:
    at least ``tiles`` int32 zeros and ``part_size`` float32 elements, kept per CUDA stream
    (fresh ones on the CPU, under the interpreter); ``None`` when the launch merges in a
    second kernel instead (:func:`merges_in_kernel`)."""
    if not merges_in_kernel(device):
        return None
    if device.type != "cuda":
        counters = torch.zeros(tiles, dtype=torch.int32, device=device)
        return counters, torch.empty(part_size, dtype=torch.float32, device=device)
    index = device.index if device.index is not None else torch._C._cuda_getDevice()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    found = _SCRATCH.get(key)
    if found is None or found[0].numel() < tiles or found[1].numel() < part_size:
        # grown to powers of two; a buffer given up here is reused by the allocator only
        # after the launches already queued on this stream
        # (made where no CUDA graph writes: the counters must read zero at each launch)
        if found is None or found[0].numel() < tiles:
            size = triton.next_power_of_2(tiles)
            kept_counters = outside_pools(
                lambda: torch.zeros(size, dtype=torch.int32, device=device)
            )
        else:
            kept_counters = found[0]
        if found is None or found[1].numel() < part_size:
            size = triton.next_power_of_2(part_size)
            kept_parts = outside_pools(
                lambda: torch.empty(size, dtype=torch.float32, device=device)
            )
        else:
            kept_parts = found[1]
        found = _SCRATCH[key] = (kept_counters, kept_parts)
    return found


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """The decode forward of one call identity, worked out once (the decode layout, its split
    count, the mask arguments, the grid): :meth:`launch` only allocates the output (and the
    partial results where the stream keeps none) and launches the kernel with the call's
    tensors.

    Made by :func:`plan_decode` for the shapes, dtypes and devices of ``q``, ``k``, ``v``
    (checked on each launch) and the mask arguments, whose tensors (document ranges, slopes,
    key ranges) it holds: the kernel reads their contents at each launch, so they must not be
    written in place while the plan is used. Strides and the data pointers' alignment may
    change from call to call (each combination gets its compiled kernel).
    """

    identity: tuple[object, ...]
    layout: DecodeLayout | None  # None: an empty output, nothing to launch
    mask: MaskRecord | None  # the kernel's mask record (its tensors are read at each launch)
    scalars: tuple[int | float, ...]  # the output's strides and the scalars after them
    kernel: PreparedLaunch | None  # with more than one split, its last share merges
    part_size: int  # float32 elements of the partial results (one split: 0, none)
    tiles: int  # B * Hkv * row_tiles: the counters a split launch needs
    # with more than one split, for launches that keep no counters: the shares only, then
    # the merge kernel and its runtime scalars
    kernel_apart: PreparedLaunch | None = None
    merge: PreparedLaunch | None = None
    merge_scalars: tuple[int, ...] = ()
    # [(stream, (counters, parts))]: the CUDA stream of this plan's last direct split launch
    # and that stream's split_scratch, so that a launch on the same stream skips the lookup
    # (one item, replaced whole: threads launching on other streams read a consistent pair)
    last_stream: list[tuple[int, tuple[Tensor, Tensor]] | None] = field(
        default_factory=lambda: [None]
    )

    def launch(self, q: Tensor, k: Tensor, v: Tensor, *, checked: bool = True) -> Tensor:
        """``out`` as :func:`decode_forward` returns it. No host synchronisation: one launch,
        or two where a split launch cannot keep counters (:func:`merges_in_kernel`).

        ``checked=False`` skips checking that the tensors are of the plan's identity, for a
        caller that has (the plan cache keys on it); :meth:`run` is that call."""
        if checked:
            check_identity("decode", self.identity, q, k, v)
        return self.run(q, k, v)

    def run(self, q: Tensor, k: Tensor, v: Tensor, pages: Pages | None = None) -> Tensor:
        """:meth:`launch` without the identity check; ``pages``: for a plan made with them
        (:func:`plan_decode`), where this call's keys lie in ``k`` and ``v``."""
        out = empty_contiguous(q)  # (B, Hq, L, E): the strides the plan holds
        kernel, merge = self.kernel, None
        if kernel is None or self.mask is None:
            return out
        direct = kernel.direct()
        parts = counters = None
        if self.part_size:
            scratch = (
                self._stream_scratch(q)
                if direct
                else split_scratch(q.device, self.tiles, self.part_size)
            )
            if scratch is not None:
                counters, parts = scratch
            else:
                parts = torch.empty(self.part_size, dtype=torch.float32, device=q.device)
                kernel, merge = self.kernel_apart, self.merge
                assert kernel is not None  # a split plan has both
        q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
        if direct:
            # What the compiled kernel is specialised on beyond the plan: the strides, and
            # each tensor's 16-byte alignment, spelled out only when some tensor lacks it
            # (the output and partial results come from the allocator: their strides are
            # the plan's).
            ptrs = q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()
            if parts is not None:
                ptrs |= parts.data_ptr()
            call_key: tuple[object, ...] | None = (q_stride, k_stride, v_stride)
            if ptrs % 16:
                call_key = (
                    q_stride,
                    k_stride,
                    v_stride,
                    *(t is None or t.data_ptr() % 16 == 0 for t in (q, k, v, out, parts)),
                )
        else:
            call_key = None
        kernel(
            call_key, q, k, v, out, parts, counters, *self.mask.values(*page_tensors(pages)),
            *q_stride, *k_stride, *v_stride, *self.scalars,
        )  # fmt: skip
        if merge is not None:
            assert parts is not None  # the launch's fresh partial results
            merge_key = None
            if direct:
                merge_key = (parts.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
            merge(merge_key, parts, out, *self.merge_scalars)
        return out

    def _stream_scratch(self, q: Tensor) -> tuple[Tensor, Tensor] | None:
        """:func:`split_scratch` for a direct launch (a CUDA one, not traced), found from
        the current stream alone when it is the stream of the plan's last launch."""
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = torch._C._cuda_getCurrentRawStream(q.get_device())
        last = self.last_stream[0]
        if last is None or last[0] != stream:
            scratch = split_scratch(q.device, self.tiles, self.part_size)
            if scratch is None:
                return None
            last = self.last_stream[0] = (stream, scratch)
        return last[1]


def plan_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    num_splits: int | None = None,
    pages: Pages | None = None,
    even_rows: bool = False,
) -> DecodePlan:
    """The :class:`DecodePlan` of :func:`decode_forward` with these arguments; ``q``, ``k``,
    ``v`` (and ``pages``) give only their shapes, dtypes and devices (the plan keeps none
    of them). ``even_rows``: as :func:`decode_layout` takes it."""
    if program.blocks is not None:
        raise ValueError(
            "the decode kernel iterates the analytic band only; a mask program with block "
            "lists runs in the training kernel (attention_forward)"
        )
    batch, num_heads, seq_q, head_dim = q.shape
    if pages is not None:
        # the call's keys as the mask and the layout see them: (B, Hkv, S, E)
        k, v = (stand_in(t, batch, pages.keys) for t in (k, v))
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    identity = identity_of(q, k, v)
    if batch * num_heads * seq_q * head_dim == 0:
        return DecodePlan(identity, None, None, (), None, 0, 0)
    mask = launch_mask(q, k, program, scale=scale, rows=True, cols=False, lists=False, pages=pages)
    layout = decode_layout(
        q.shape, k.shape, q.device, program, itemsize=q.element_size(), splits=num_splits,
        even_rows=even_rows,
    )  # fmt: skip
    cfg = layout.config
    block_e = padded_head_dim(head_dim)
    split = layout.splits > 1
    tiles = batch * num_kv_heads * layout.row_tiles
    grid = (layout.splits, num_kv_heads * layout.row_tiles, batch)
    options = dict(
        HEAD_DIM=head_dim,
        BLOCK_E=block_e,
        BLOCK_M=layout.block_m,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION=dot_precision(q),
        **mask.options(backward=False, decode=True),
        EVEN_N=seq_k % cfg.block_n == 0,
        SPLIT=split,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    # the output is allocated contiguous: (B, Hq, L, E)
    out_strides = (num_heads * seq_q * head_dim, seq_q * head_dim, head_dim, 1)
    kernel_apart = merge = None
    merge_scalars: tuple[int, ...] = ()
    if split:
        kernel_apart = PreparedLaunch(
            mask.kernel(_decode_fwd), grid, {**options, "MERGE_LAST": False}
        )
        rows = min(MERGE_ROWS, layout.block_m)
        merge_options = dict(
            HEAD_DIM=head_dim, BLOCK_E=block_e, BLOCK_M=layout.block_m, ROWS=rows,
            num_warps=cfg.num_warps, num_stages=1,
        )  # fmt: skip
        merge_grid = (grid[1] * (layout.block_m // rows), batch)
        merge = PreparedLaunch(_decode_merge, merge_grid, merge_options)
        merge_scalars = (*out_strides, layout.group_size, layout.row_tiles, seq_q, layout.splits)
    return DecodePlan(
        identity,
        layout,
        mask.record,
        (*out_strides, layout.group_size, layout.row_tiles, seq_q, seq_k, *mask.mod_args()),
        PreparedLaunch(mask.kernel(_decode_fwd), grid, {**options, "MERGE_LAST": split}),
        layout.splits * tiles * layout.block_m * (block_e + 1) if split else 0,
        tiles,
        kernel_apart,
        merge,
        merge_scalars,
    )


def decode_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    program: MaskProgram,
    *,
    scale: float,
    num_splits: int | None = None,
    pages: Pages | None = None,
) -> Tensor:
    """Attention forward for short queries, the arguments of ``attention_forward``:
    :func:`plan_decode`, then its launch.

    Args:
        q: ``(B, Hq, L, E)`` with ``L <= MAX_DECODE_QUERIES``; k, v: ``(B, Hkv, S, E)``, same
            dtype (fp16, bf16 or fp32) and device, any strides.
        program: the mask and score terms (:class:`~.program.MaskProgram`, the analytic band
            source only); no key outside a batch row's key range is read.
        scale: multiplies ``q @ k^T`` (any finite value).
        num_splits: programs per tile of packed rows over its keys; ``None`` picks it from
            the shapes, the band and the GPU (:func:`num_splits`).
        pages: for keys in a paged pool (:class:`~.record.Pages`, read in place): ``k``
            and ``v`` are then the pools' rows ``(1 | B, Hkv, R, E)``.

    Returns:
        ``out`` ``(B, Hq, L, E)`` in ``q.dtype`` (contiguous); a row that keeps no key is 0.

    No host synchronisation: everything on the host depends on shapes, dtypes and the band,
    so a call can be captured in a CUDA graph. Inputs are assumed valid.
    """
    if pages is None:
        return plan_decode(q, k, v, program, scale=scale, num_splits=num_splits).launch(q, k, v)
    plan = plan_decode(q, k, v, program, scale=scale, num_splits=num_splits, pages=pages)
    return plan.run(q, k.expand(q.shape[0], *k.shape[1:]), v.expand(q.shape[0], *v.shape[1:]),
                    pages)  # fmt: skip

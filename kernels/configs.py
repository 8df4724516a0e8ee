"""Tile sizes and launch parameters per GPU generation, head dim and element size."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from .common import TANH_APPROX, TANH_EXACT, TANH_LIBDEVICE
from .limits import interpreting

__all__ = [
    "DKDV_CONFIGS",
    "DQ_CONFIGS",
    "FORWARD_CONFIGS",
    "INTERPRETER_CONFIG",
    "LISTED_MASK_FORWARD_CONFIGS",
    "KernelConfig",
    "padded_head_dim",
    "pick_config",
    "tanh_mode",
]


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of one kernel (``BLOCK_M`` queries, ``BLOCK_N`` keys)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Keyed by (GPU major compute capability, head dim padded to a power of two, bytes per
# element). Capability 0 holds the rows for GPUs without their own (Ampere and older, ROCm).
# Retune here; nothing else in this module depends on the numbers. The Hopper bf16 rows for
# head dims 64, 128 and 256 were picked by timing B=4, H=16, L=S=4096 causal, sliding-window
# and unmasked problems on an H100; the other rows (fp32, head dims 16/32, other GPUs) are
# conservative guesses that still need a sweep.
_C = KernelConfig
FORWARD_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {
    (9, 16, 2): _C(128, 64, 4, 3),
    (9, 32, 2): _C(128, 64, 4, 3),
    (9, 64, 2): _C(128, 64, 4, 3),
    (9, 128, 2): _C(128, 64, 8, 3),
    (9, 256, 2): _C(128, 64, 8, 2),
    (0, 16, 2): _C(128, 64, 4, 3),
    (0, 32, 2): _C(128, 64, 4, 3),
    (0, 64, 2): _C(128, 64, 4, 3),
    (0, 128, 2): _C(128, 64, 8, 3),
    (0, 256, 2): _C(64, 32, 4, 2),
    (0, 16, 4): _C(64, 32, 4, 2),
    (0, 32, 4): _C(64, 32, 4, 2),
    (0, 64, 4): _C(64, 32, 4, 2),
    (0, 128, 4): _C(64, 32, 4, 2),
    (0, 256, 4): _C(32, 32, 4, 1),
}
# dK/dV kernel: BLOCK_N keys stay resident while BLOCK_M query tiles stream past.
DKDV_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {
    (9, 16, 2): _C(32, 128, 4, 3),
    (9, 32, 2): _C(32, 128, 4, 3),
    (9, 64, 2): _C(32, 128, 4, 3),
    (9, 128, 2): _C(32, 64, 4, 3),
    (9, 256, 2): _C(64, 64, 8, 2),
    (0, 16, 2): _C(32, 64, 4, 2),
    (0, 32, 2): _C(32, 64, 4, 2),
    (0, 64, 2): _C(32, 64, 4, 2),
    (0, 128, 2): _C(32, 64, 4, 2),
    (0, 256, 2): _C(32, 32, 4, 1),
    (0, 16, 4): _C(32, 32, 4, 1),
    (0, 32, 4): _C(32, 32, 4, 1),
    (0, 64, 4): _C(32, 32, 4, 1),
    (0, 128, 4): _C(32, 32, 4, 1),
    (0, 256, 4): _C(16, 32, 4, 1),
}
# dQ kernel: BLOCK_M queries stay resident while BLOCK_N key tiles stream past.
DQ_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {
    (9, 16, 2): _C(64, 128, 4, 3),
    (9, 32, 2): _C(64, 128, 4, 3),
    (9, 64, 2): _C(64, 128, 4, 3),
    (9, 128, 2): _C(128, 64, 8, 4),
    (9, 256, 2): _C(128, 32, 8, 2),
    (0, 16, 2): _C(64, 32, 4, 2),
    (0, 32, 2): _C(64, 32, 4, 2),
    (0, 64, 2): _C(64, 32, 4, 2),
    (0, 128, 2): _C(64, 32, 4, 2),
    (0, 256, 2): _C(32, 32, 4, 1),
    (0, 16, 4): _C(32, 32, 4, 1),
    (0, 32, 4): _C(32, 32, 4, 1),
    (0, 64, 4): _C(32, 32, 4, 1),
    (0, 128, 4): _C(32, 32, 4, 1),
    (0, 256, 4): _C(32, 16, 4, 1),
}
# The forward where block lists drive it and partial tiles evaluate generated mask functions,
# where it differs from the table above (keyed like it). Smaller tiles keep more programs in
# flight over short, uneven lists and halve a partial tile's mask work per row; the backward's
# tiles for these lists gained nothing from the same change (benchmarks/NOTES.md, "Figures
# behind the code's choices").
LISTED_MASK_FORWARD_CONFIGS: dict[tuple[int, int, int], KernelConfig] = {
    (9, 128, 2): _C(64, 64, 4, 3),
}
del _C
# The interpreter runs each program in numpy: small tiles keep CPU tests fast.
INTERPRETER_CONFIG = KernelConfig(16, 16, 1, 1)


def _arch(device: torch.device) -> int:
    if device.type != "cuda" or torch.version.hip is not None:
        return 0
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_arch(index: int) -> int:
    major, _ = torch.cuda.get_device_capability(index)
    return 9 if major >= 9 else 0


def pick_config(
    table: dict[tuple[int, int, int], KernelConfig],
    q: Tensor,
    block_e: int,
    first: dict[tuple[int, int, int], KernelConfig] | None = None,
) -> KernelConfig:
    """The row of ``table`` for ``q``'s GPU, head dim ``block_e`` and element size (the row of
    ``first`` where it has one)."""
    if interpreting():
        return INTERPRETER_CONFIG
    elem = 4 if q.dtype == torch.float32 else 2
    key = (_arch(q.device), block_e, elem)
    if first is not None and key in first:
        return first[key]
    return table.get(key) or table[(0, block_e, elem)]


def tanh_mode(q: Tensor) -> int:
    if interpreting():
        return TANH_EXACT
    if q.dtype == torch.float32 or torch.version.hip is not None:
        return TANH_LIBDEVICE
    return TANH_APPROX


def dot_precision(q: Tensor) -> str:
    """The kernels' ``DOT_PRECISION`` for inputs of ``q``'s dtype: fp32 inputs multiply in
    full precision, fp16 and bf16 ones in their own (``tf32`` is ignored for them)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def padded_head_dim(head_dim: int) -> int:
    """The head dim of a tile: the next power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())

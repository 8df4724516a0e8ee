"""ALiBi: linear biases by distance."""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from attnbias.biases.base import (
    Device,
    KernelBias,
    Shape,
    cached_on,
    check_head_range,
    device_key,
    resolve_lengths,
)
from attnbias.materialize import MaskedBias, compute_dtype
from attnbias.terms import Block, Call, Terms

__all__ = ["AlibiBias", "alibi_slopes"]


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's head slopes for any number of heads.

    For a power of two ``n`` the slopes are the geometric sequence starting at
    ``2 ** (-8 / n)``; otherwise the slopes of the closest smaller power of two are followed by
    every other slope of twice that power (Press et al., 2022).

    >>> alibi_slopes(4)
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"alibi_slopes needs a positive number of heads, got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**k for k in range(n)]

    if math.log2(num_heads).is_integer():
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: num_heads - closest]


def _check_slopes(slopes: Any) -> None:
    if not isinstance(slopes, Tensor):
        raise TypeError(
            f"AlibiBias slopes must be a torch.Tensor of shape (Hq,) or (B, Hq), got "
            f"{type(slopes).__name__}; wrap them with torch.tensor(...)"
        )
    if not slopes.is_floating_point():
        raise TypeError(
            f"AlibiBias slopes must be a real floating point tensor, got dtype={slopes.dtype}; "
            f"convert them with .float()"
        )
    if slopes.dim() not in (1, 2) or slopes.numel() == 0:
        raise ValueError(
            f"AlibiBias slopes must have shape (Hq,) or (B, Hq) with Hq > 0, got shape "
            f"{tuple(slopes.shape)}"
        )
    if slopes.is_meta:
        raise ValueError(
            "AlibiBias slopes are a meta tensor, which has no values; build them on the "
            "inputs' device"
        )
    if torch.compiler.is_compiling():
        return
    finite = torch.isfinite(slopes.detach())
    if not bool(finite.all()):
        index = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ValueError(
            f"AlibiBias slopes must be finite, got {slopes.detach()[index].item()} at index "
            f"{index}; the paper's slopes for H heads are AlibiBias(num_heads=H)"
        )


@dataclass(frozen=True, eq=False)
class AlibiBias(KernelBias):
    """ALiBi: adds ``-slope_h * |i + (S - L) - j|`` to the scores of head ``h``.

    Bottom-right aligned and symmetric, as FlashAttention 2; under a causal mask it equals the
    paper's ``slope_h * (j - i')`` up to a per-row constant, so the outputs agree. Give either
    ``num_heads`` (the paper's slopes, for any head count) or ``slopes`` of shape ``(Hq,)`` or
    ``(B, Hq)``.

    ``shift`` moves the distances along the diagonal, ``-slope_h * |i + (S - L) + shift - j|``:
    it is how a block of a call sees the call's ALiBi (:meth:`sub_block`, context parallelism).
    The Triton kernels take a shift where the band keeps every pair on one side of the shifted
    diagonal (a causal call's blocks do) and the slopes need no gradient; otherwise a shifted
    ALiBi runs on the materializing routes.

    >>> AlibiBias(num_heads=2).materialize(shape=(1, 2, 2, 2))[0]
    tensor([[-0.0000, -0.0625],
            [-0.0625, -0.0000]])
    """

    num_heads: int | None = None
    slopes: Tensor | None = field(default=None, repr=False)
    shift: int = 0
    _on_device: dict[Any, Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.num_heads is None) == (self.slopes is None):
            raise ValueError(
                f"AlibiBias takes exactly one of num_heads or slopes, got num_heads="
                f"{self.num_heads!r} and slopes={'None' if self.slopes is None else 'a tensor'}"
            )
        if self.num_heads is not None:
            if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int):
                raise TypeError(
                    f"AlibiBias num_heads must be a positive int, got {self.num_heads!r}"
                )
            if self.num_heads < 1:
                raise ValueError(
                    f"AlibiBias num_heads must be a positive int, got {self.num_heads!r}"
                )
        if self.slopes is not None:
            _check_slopes(self.slopes)
        if isinstance(self.shift, bool) or not isinstance(self.shift, int):
            raise TypeError(f"AlibiBias shift must be an int, got {self.shift!r}")

    @property
    def heads(self) -> int:
        if self.slopes is not None:
            return int(self.slopes.shape[-1])
        assert self.num_heads is not None  # guaranteed by __post_init__
        return self.num_heads

    def slope_tensor(self, device: Device = None) -> Tensor:
        """Slopes as a float32 tensor of shape ``(1, Hq)`` or ``(B, Hq)``.

        The paper's slopes are built once per device. Slopes you pass are converted on each
        call (no copy when they are already float32 on ``device``).
        """
        if self.slopes is None:
            return cached_on(
                self._on_device,
                device_key(device),
                lambda: torch.tensor(
                    [alibi_slopes(self.heads)], dtype=torch.float32, device=device
                ),
            )
        slopes = self.slopes.to(device=device, dtype=torch.float32)
        return slopes if slopes.dim() == 2 else slopes[None]

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        length_q, length_kv = resolve_lengths(shape, None, None, "AlibiBias")
        device = (
            device
            if device is not None
            else (self.slopes.device if self.slopes is not None else None)
        )
        rows = torch.arange(length_q, device=device, dtype=torch.float64)[:, None]
        cols = torch.arange(length_kv, device=device, dtype=torch.float64)[None, :]
        distance = (rows + (length_kv - length_q + self.shift) - cols).abs()
        slopes = self.slope_tensor(device).to(torch.float64)[..., None, None]  # (B|1, H, 1, 1)
        bias = (-slopes * distance).to(dtype or torch.float32)
        return bias if self.slopes is not None and self.slopes.dim() == 2 else bias[0]

    def validate_call(self, call: Call) -> None:
        batch, heads = call.batch_size, call.heads
        if self.heads != heads:
            raise ValueError(
                f"AlibiBias has slopes for {self.heads} heads but the query has Hq={heads}; "
                f"build it with AlibiBias(num_heads={heads})"
            )
        shape = () if self.slopes is None else tuple(self.slopes.shape)
        if len(shape) == 2 and shape[0] not in (1, batch):
            raise ValueError(
                f"AlibiBias slopes of shape {shape} do not match batch "
                f"size B={batch}; use shape (Hq,) or (B, Hq)"
            )

    def lower(self, call: Call) -> Terms:
        if self.shift and self.slopes is not None and self.slopes.requires_grad:
            # the kernels' form of a shifted ALiBi has no slope gradient: materialized
            return Terms.of(others=(self,))
        return Terms.of(
            slopes=self.slope_tensor(call.device), alibi_shift=self.shift, alibi_parts=(self,)
        )

    def sub_block(self, call: Call, block: Block) -> AlibiBias:
        """The same slopes, the distances shifted to the block's place in the call."""
        shift = (
            self.shift
            + (call.length_kv - call.length_q)
            - (block.length_kv - block.length_q)
            - block.offset
        )
        if self.slopes is None:
            return AlibiBias(num_heads=self.num_heads, shift=shift)
        return AlibiBias(slopes=self.slopes, shift=shift)

    def sub_heads(self, call: Call, start: int, count: int) -> AlibiBias:
        """The slopes of the heads ``[start, start + count)``, the same shift. Slopes you
        passed are narrowed (a view: their gradient reaches yours); the paper's slopes for
        ``num_heads`` become the slice's own slopes, made once per range and device."""
        check_head_range(call, start, count, "AlibiBias")
        self.validate_call(call)  # slopes for the call's heads, or a ValueError saying so
        if start == 0 and count == self.heads:
            return self
        if self.slopes is not None:
            return AlibiBias(slopes=self.slopes.narrow(-1, start, count), shift=self.shift)
        heads = self.heads
        slopes = cached_on(
            self._on_device,
            (device_key(call.device), start, count),
            lambda: torch.tensor(
                alibi_slopes(heads)[start : start + count],
                dtype=torch.float32,
                device=call.device,
            ),
        )
        return AlibiBias(slopes=slopes, shift=self.shift)

    def masked(self, device: Device, shape: Shape, dtype: torch.dtype) -> MaskedBias:
        return MaskedBias(
            None, self.materialize(device, shape=shape, dtype=compute_dtype(dtype)), None, ()
        )

    def cache_key(self) -> Hashable | None:
        # the paper's slopes by value; slopes you pass are converted on each call, so that
        # their gradient is recorded each time
        return (AlibiBias, self.num_heads, self.shift) if self.slopes is None else None

    def parameters(self) -> tuple[Tensor, ...]:
        return () if self.slopes is None else (self.slopes,)

    def __repr__(self) -> str:
        shift = f", shift={self.shift}" if self.shift else ""
        if self.slopes is None:
            return f"AlibiBias(num_heads={self.num_heads}{shift})"
        return f"AlibiBias(slopes of shape {tuple(self.slopes.shape)}{shift})"

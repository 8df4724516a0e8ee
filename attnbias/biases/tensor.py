"""A plain tensor as a bias."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias.biases.base import AttnBias, Device, Shape, check_head_range, keep_to_additive
from attnbias.materialize import MaskedBias, compute_dtype
from attnbias.terms import Block, Call

__all__ = ["TensorBias"]


@dataclass(frozen=True, eq=False)
class TensorBias(AttnBias):
    """A plain additive (float) or keep (bool) tensor, broadcastable to ``(B, Hq, L, S)``.

    Always materialised: ``sdpa`` passes it to stock SDPA (a bool tensor as a keep-mask), or
    to the float32 eager path when half-precision inputs cannot hold a float bias exactly. A
    float bias that requires grad gets its exact gradient; its ``-inf`` entries mask, and a NaN
    or ``+inf`` entry makes its row NaN, as in stock SDPA. A bool tensor keeps ``True`` pairs
    (PyTorch's convention). Any rank up to 4 that broadcasts to ``(B, Hq, L, S)`` works.

    >>> TensorBias(torch.tensor([[0.0, -1.0], [float("-inf"), 0.5]])).materialize()
    tensor([[ 0.0000, -1.0000],
            [   -inf,  0.5000]])
    """

    bias: Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.bias, Tensor):
            raise TypeError(
                f"TensorBias expects a torch.Tensor, got {type(self.bias).__name__}; "
                f"wrap values with torch.tensor(...)"
            )
        if self.bias.dtype != torch.bool and not self.bias.is_floating_point():
            raise TypeError(
                f"TensorBias expects a floating point (additive) or bool (keep) tensor, got "
                f"dtype={self.bias.dtype}; convert it with .float() or .bool()"
            )
        if self.bias.dim() > 4:
            raise ValueError(
                f"TensorBias must broadcast to (B, H, L, S), got a {self.bias.dim()}-D tensor "
                f"of shape {tuple(self.bias.shape)}"
            )
        if self.bias.is_meta:
            raise ValueError(
                f"TensorBias holds a meta tensor of shape {tuple(self.bias.shape)}, which has no "
                f"values; build it from a tensor on the inputs' device"
            )

    @property
    def matrix(self) -> Tensor:
        """The tensor with at least two dimensions, ``(..., L or 1, S or 1)``: stock SDPA
        indexes a mask's last two dimensions, so ``(S,)`` becomes ``(1, S)``."""
        bias = self.bias
        return bias.reshape((1,) * (2 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 2 else bias

    def materialize(
        self, device: Device = None, *, shape: Shape = None, dtype: torch.dtype | None = None
    ) -> Tensor:
        bias = self.matrix
        if shape is not None:
            self._check_broadcast(tuple(shape))
        if bias.dtype == torch.bool:
            bias = keep_to_additive(bias, dtype or torch.float32)
        elif dtype is not None:
            bias = bias.to(dtype)
        if device is not None:
            bias = bias.to(device)
        return bias

    def needs_materialization(self) -> bool:
        return True

    def _check_broadcast(self, shape: tuple[int, ...]) -> None:
        try:
            ok = torch.broadcast_shapes(tuple(self.bias.shape), shape) == torch.Size(shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"TensorBias of shape {tuple(self.bias.shape)} does not broadcast to the "
                f"attention scores of shape (B, Hq, L, S)={shape}; give it a shape such as "
                f"(L, S), (B, 1, L, S) or (B, Hq, L, S)"
            )

    def validate_call(self, call: Call) -> None:
        self._check_broadcast((call.batch_size, call.heads, call.length_q, call.length_kv))

    def masked(self, device: Device, shape: Shape, dtype: torch.dtype) -> MaskedBias:
        # The tensor as given: a NaN or +inf entry is the user's, and makes its row NaN.
        if shape is not None:
            self._check_broadcast(tuple(shape))
        result = self.matrix if device is None else self.matrix.to(device)
        return MaskedBias.of_tensor(result, compute_dtype(dtype))

    def parameters(self) -> tuple[Tensor, ...]:
        return (self.bias,)

    def sub_block(self, call: Call, block: Block) -> TensorBias:
        """A view of the block's rows and columns (a dimension of 1 broadcasts and stays)."""
        bias = self.matrix
        if bias.shape[-2] != 1:
            bias = bias.narrow(-2, block.q_start, block.length_q)
        if bias.shape[-1] != 1:
            bias = bias.narrow(-1, block.kv_start, block.length_kv)
        return TensorBias(bias)

    def sub_heads(self, call: Call, start: int, count: int) -> TensorBias:
        """A view of the heads ``[start, start + count)`` where the tensor has a head
        dimension; the bias itself where it is the same for every head."""
        check_head_range(call, start, count, "TensorBias")
        bias = self.bias
        if bias.dim() < 3 or bias.shape[-3] == 1:
            return self
        if bias.shape[-3] != call.heads:
            raise ValueError(
                f"TensorBias of shape {tuple(bias.shape)} has {bias.shape[-3]} heads but the "
                f"call has Hq={call.heads}; give it a head dimension of Hq or 1"
            )
        if start == 0 and count == call.heads:
            return self
        return TensorBias(bias.narrow(-3, start, count))

    def __repr__(self) -> str:
        return f"TensorBias(shape={tuple(self.bias.shape)}, dtype={self.bias.dtype})"

"""Llama 4's chunked attention as a ``ModBias``: causal inside chunks of 1024 tokens.

Llama 4's local layers cut the sequence into chunks and attend causally inside each one. As a
``mask_mod`` that is one line. Equal chunks and a causal comparison are built-in masks written
as a function (documents of ``chunk`` tokens, and the causal band), so the call runs as those
built-ins: documents of one length are separate sequences, so stock SDPA's causal kernel (cuDNN
on a GPU) runs them on a view of q, k and v, where that is fastest; else FlashAttention 4's
variable-length kernel where installed, or the Triton kernel, visiting only the tiles on the
diagonal blocks of the chunks; never an L x S mask. ``explain`` shows the route. A mask that is
not such a form runs as generated code in the Triton and FlashAttention 4 kernels. The output
and gradients are checked against the exact path (``use_backends("reference")``).

    python examples/chunked_local.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import ModBias

# isort: split
# a sibling module: the examples' folder is on sys.path when one runs
from route_check import check


@dataclass(frozen=True)
class ChunkedLocal(ModBias):
    """Keeps ``j <= i`` inside the same chunk of ``chunk`` tokens."""

    chunk: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx // self.chunk == kv_idx // self.chunk) & (kv_idx <= q_idx)


def main() -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        device, dtype, chunk = "cuda", torch.bfloat16, 1024
        batch, heads_q, heads_kv, length, head_dim = 1, 8, 2, 4096, 128
    else:
        device, dtype, chunk = "cpu", torch.float32, 64
        batch, heads_q, heads_kv, length, head_dim = 1, 4, 2, 256, 32
    torch.manual_seed(0)
    q = torch.randn(batch, heads_q, length, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    name = f"chunks of {chunk}, causal inside, L = {length}"
    check(name, q, k, v, ChunkedLocal(chunk), enable_gqa=True)


if __name__ == "__main__":
    main()

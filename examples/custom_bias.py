"""Writing your own bias: a prefix-LM mask as a ``ModBias``.

A prefix-LM (T5, PaLI, UL2) attends bidirectionally within a prefix and causally after it. Write
the rule as a ``mask_mod`` with FlexAttention's signature (``b, h, q_idx, kv_idx`` are integer
tensors) in a frozen dataclass whose fields are its parameters. On a GPU the function is compiled
into the Triton kernels, which skip the tiles it keeps nothing of and never build an L x S mask;
on a CPU the same call runs the exact eager path. It composes with the built-in biases by ``+``.
Each call is checked, output and gradients, against the exact path (``use_backends("reference")``).

    python examples/custom_bias.py

A bias can also implement ``materialize`` itself: an ``AttnBias`` subclass that returns its mask
as a tensor (and ``True`` from ``needs_materialization``) runs stock SDPA with that mask (see
"API at a glance" in the README).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import ModBias, SlidingWindowBias, SoftcapBias

# isort: split
# a sibling module: the examples' folder is on sys.path when one runs
from route_check import check


@dataclass(frozen=True)
class PrefixLM(ModBias):
    """Keeps ``j <= i`` (causal) or ``j < prefix`` (the prefix is visible to every query)."""

    prefix: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batch, heads_q, heads_kv, length, head_dim = (2, 8, 2, 2048, 64) if cuda else (2, 4, 2, 256, 32)
    torch.manual_seed(0)
    q = torch.randn(batch, heads_q, length, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, length, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)

    prefix = PrefixLM(length // 4)
    window = length // 8
    check("prefix-LM", q, k, v, prefix, enable_gqa=True)
    check("prefix-LM + soft-cap 30", q, k, v, prefix + SoftcapBias(30.0), enable_gqa=True)
    check(
        f"prefix-LM + a window of {window} keys",
        q, k, v, prefix + SlidingWindowBias(window - 1), enable_gqa=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()

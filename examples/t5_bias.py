"""A learnable T5 relative-position bias as a ``ModBias``, trained with an optimizer.

T5 adds to each score a learned value per head and per bucket of the distance ``i - j``: exact
below 16, log-spaced up to 128, one bucket beyond. As a ``score_mod`` that is a lookup in an
``(H, 32)`` table held in a dataclass field; the table requires grad and gets its gradient
through ``sdpa``. A few Adam steps fit it to a target (the attention output under another
table) and the loss goes down; the first step's output and gradients, the table's included, are
checked against the exact path (``use_backends("reference")``). The optimizer updates the table
in place, and the one bias object built before the loop sees each step's values.

    python examples/t5_bias.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import ModBias, causal_lower_right, explain, sdpa, use_backends

BUCKETS, MAX_DISTANCE, STEPS = 32, 128, 20


def t5_bucket(relative: Tensor) -> Tensor:
    """T5's ``relative_position_bucket`` of ``relative = kv_idx - q_idx`` for a decoder
    (``bidirectional=False``): keys after the query share bucket 0."""
    distance = (-relative).clamp(min=0)
    exact = BUCKETS // 2
    ratio = torch.log(distance.clamp(min=exact).to(torch.float32) / exact)
    ratio = ratio / math.log(MAX_DISTANCE / exact)
    large = (exact + (ratio * (BUCKETS - exact)).to(torch.int64)).clamp(max=BUCKETS - 1)
    return torch.where(distance < exact, distance, large)


@dataclass(frozen=True, eq=False)
class T5Bias(ModBias):
    """Adds ``table[h, bucket(j - i)]`` to the scores; ``table`` is ``(H, BUCKETS)``."""

    table: Tensor

    def score_mod(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return score + self.table[h, t5_bucket(kv_idx - q_idx)]


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    batch, heads, length, head_dim = (2, 8, 2048, 64) if cuda else (1, 4, 256, 32)
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, length, head_dim, device=device, dtype=dtype) for _ in range(3)
    )
    with torch.no_grad():
        truth = T5Bias(2 * torch.randn(heads, BUCKETS, device=device)) + causal_lower_right()
        target = sdpa(q, k, v, attn_mask=truth).float()

    table = torch.zeros(heads, BUCKETS, device=device, requires_grad=True)
    bias = T5Bias(table) + causal_lower_right()

    def outputs_and_grads() -> tuple[Tensor, list[Tensor]]:
        """The loss, then ``[out, dq, dk, dv, dtable]`` of one call."""
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = sdpa(*leaves, attn_mask=bias)
        loss = (out.float() - target).pow(2).mean()
        return loss, [out.detach(), *torch.autograd.grad(loss, [*leaves, table])]

    leaf = q.detach().requires_grad_()
    print("route:", explain(leaf, k, v, attn_mask=bias).splitlines()[0])
    _, got = outputs_and_grads()
    with use_backends("reference"):
        _, expected = outputs_and_grads()
    errors = ", ".join(
        f"{label} {(a.double() - b.double()).abs().max().item():.1e}"
        for label, a, b in zip(("out", "dq", "dk", "dv", "dtable"), got, expected, strict=True)
    )
    print(f"max error vs the exact path: {errors}")

    optimizer = torch.optim.Adam([table], lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = (sdpa(q, k, v, attn_mask=bias).float() - target).pow(2).mean()
        loss.backward()
        optimizer.step()  # in place: the bias reads the new table at the next call
        if step % 4 == 0 or step == STEPS - 1:
            print(f"step {step:2d}: loss {loss.item():.3e}")


if __name__ == "__main__":
    main()

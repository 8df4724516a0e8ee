"""A learnable T5 relative-position bias as a ``ModBias``, trained with an optimizer.

T5 adds to each score a learned value per head and per bucket of the distance ``i - j``: exact
below 16, log-spaced up to 128, one bucket beyond. As a ``score_mod`` that is a lookup in an
``(H, 32)`` table held in a dataclass field; the table requires grad and gets its gradient
through ``sdpa``. A few Adam steps fit it to a target (the attention output under another
table) and the loss goes down; the first step's output and gradients, the table's included, are
checked against an independent float64 computation with stock PyTorch: the table looked up with
``t5_bucket`` on an ``(L, S)`` grid of ``j - i``, added to the scores, causal mask, softmax. The
optimizer updates the table in place, and the one bias object built before the loop sees each
step's values.

    python examples/t5_bias.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from attnbias import ModBias, causal_lower_right, explain, sdpa

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

    # the first step's [out, dq, dk, dv, dtable]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    print("route:", explain(*leaves, attn_mask=bias).splitlines()[0])
    out = sdpa(*leaves, attn_mask=bias)
    loss = (out.float() - target).pow(2).mean()
    got = [out.detach(), *torch.autograd.grad(loss, [*leaves, table])]

    # the same in float64 with stock PyTorch: scores + table[h, bucket(j - i)], keys j <= i
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    q64, k64, v64, table64 = leaves
    i, j = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(head_dim) + table64[:, t5_bucket(j - i)]
    # every row keeps its own key (j = i): no row whose output must be 0
    weights = torch.softmax(scores.masked_fill(j > i, -math.inf), dim=-1)
    out = weights @ v64
    loss = (out - target.double()).pow(2).mean()
    expected = [out.detach(), *torch.autograd.grad(loss, leaves)]

    errors = [(a.double() - b).abs().max().item() for a, b in zip(got, expected, strict=True)]
    labels = ("out", "dq", "dk", "dv", "dtable")
    text = ", ".join(f"{label} {e:.1e}" for label, e in zip(labels, errors, strict=True))
    print(f"max error vs float64 stock PyTorch: {text}")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # of the largest value
    largest = [b.abs().max().item() for b in expected]
    assert all(e <= tolerance * m for e, m in zip(errors, largest, strict=True)), errors

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

"""``DocumentBias`` ids written in place between calls: every route reads the ids as they are
at the call (the Triton kernel under the interpreter, stock SDPA's separate sequences, the exact
path), whether the earlier call was planned and kept (the plan cache) or not; ids made to
decrease are refused as at construction. The oracle materializes the bias at the call."""

from __future__ import annotations

import pytest
import torch

import attnbias
from attnbias import DocumentBias, causal_upper_left, use_backends
from attnbias.testing.oracle import assert_close_to_oracle, attention, run_with_grads


def _call(bias: object, route: str, seed: int) -> None:
    """One call through ``route`` against the oracle (output and q, k, v gradients)."""
    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(1, 2, 16, 8, generator=generator) for _ in range(4))

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with use_backends(route):
            return attnbias.sdpa(q, k, v, attn_mask=bias)

    got = run_with_grads(ours, (q, k, v), grad)
    exact = run_with_grads(lambda *t: attention(*t, bias, dtype=torch.float64),
                           [t.double() for t in (q, k, v)], grad.double())  # fmt: skip
    low = run_with_grads(lambda *t: attention(*t, bias, dtype=torch.float32), (q, k, v), grad)
    assert_close_to_oracle(got, exact, low, torch.float32, ("out", "dq", "dk", "dv"))


@pytest.mark.parametrize(
    ("route", "causal"),
    [("triton", True), ("triton", False), ("sdpa", True), ("reference", True)],
)
def test_ids_written_in_place_are_seen_by_the_next_call(route: str, causal: bool) -> None:
    ids = torch.tensor([0] * 8 + [1] * 8)  # two documents of 8: stock SDPA's sequences too
    documents = DocumentBias(ids)
    bias = documents + causal_upper_left() if causal else documents
    _call(bias, route, 0)
    _call(bias, route, 1)  # planned, then run from the plan cache
    for written in ([0] * 4 + [1] * 4 + [2] * 4 + [3] * 4, [0] * 16, [0] * 8 + [1] * 8):
        ids.copy_(torch.tensor(written))
        _call(bias, route, 2)
        with use_backends(route):
            first_line = attnbias.explain(*(torch.zeros(1, 2, 16, 8),) * 3, attn_mask=bias)
        assert route in first_line.splitlines()[0], first_line
    ids[5] = 3  # decreases after it
    q = torch.randn(1, 2, 16, 8)
    with use_backends(route), pytest.raises(ValueError, match="must be non-decreasing"):
        attnbias.sdpa(q, q, q, attn_mask=bias)

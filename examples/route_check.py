"""What the examples print for a call: its route, and its largest errors against the exact
path (``use_backends("reference")``), for the output and every gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnbias import AttnBias, explain, sdpa, use_backends


def check(name: str, q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, **kwargs: Any) -> None:
    """Print the route of a training call and its largest errors (output and gradients)
    against the exact path."""
    grad_out = torch.randn_like(q)

    def run() -> list[Tensor]:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = sdpa(*leaves, attn_mask=bias, **kwargs)
        return [out.detach(), *torch.autograd.grad(out, leaves, grad_out)]

    leaf = q.detach().requires_grad_()
    print(f"{name}\n  route: {explain(leaf, k, v, attn_mask=bias, **kwargs).splitlines()[0]}")
    got = run()
    with use_backends("reference"):
        expected = run()
    errors = ", ".join(
        f"{label} {(a.double() - b.double()).abs().max().item():.1e}"
        for label, a, b in zip(("out", "dq", "dk", "dv"), got, expected, strict=True)
    )
    print(f"  max error vs the exact path: {errors}")

"""Building calls for the planner's tests on the CPU: inputs, specs, a faked GPU (the generation,
FlashAttention 4's install and device checks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

import attnbias.backends.fa4 as fa4
import attnbias.backends.triton as triton_backend
from attnbias import AttnBias, planner
from attnbias.spec import Spec, make_spec


def qkv(
    *,
    length_q: int = 16,
    length_kv: int = 16,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    heads_q: int = 2,
    heads_kv: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    needs_grad: bool = False,
    batch: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)

    def draw(heads: int, length: int, dim: int) -> Tensor:
        x = torch.randn(batch, heads, length, dim, generator=generator).to(dtype)
        return x.requires_grad_(needs_grad)

    return (
        draw(heads_q, length_q, head_dim),
        draw(heads_kv, length_kv, head_dim),
        draw(heads_kv, length_kv, head_dim if head_dim_v is None else head_dim_v),
    )


def spec_of(
    bias: AttnBias | None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    **shape: Any,
) -> Spec:
    q, k, v = qkv(**shape)
    return make_spec(q, k, v, bias, is_causal, scale, dropout_p, q.shape[1] != k.shape[1])


def set_generation(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(planner, "generation", lambda device: name)


def skip_without_the_interpreter() -> None:
    """ModBias calls on a faked GPU build their block lists with the Triton kernels on CPU
    tensors (the planner's reach, explain's tile counts): under Triton's interpreter only, which
    a machine with CUDA does not run (it is chosen when Triton is first imported)."""
    if torch.cuda.is_available():
        pytest.skip("block lists of CPU tensors need Triton's interpreter (CPU-only machines)")


def fake_gpu(
    monkeypatch: pytest.MonkeyPatch,
    *,
    capability: tuple[int, int] = (9, 0),
    fa4_installed: bool = True,
) -> None:
    """CPU tensors that the planner and FlashAttention 4's checks take for a GPU's."""
    set_generation(monkeypatch, {9: "hopper", 10: "blackwell"}.get(capability[0], "cuda"))
    monkeypatch.setattr(fa4, "_on_cuda", lambda device: True)
    monkeypatch.setattr(fa4, "_capability", lambda index: capability)
    monkeypatch.setattr(fa4, "_installed", lambda: fa4_installed)
    # the Triton kernel takes CPU tensors only under its interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_backend, "_triton_installed", lambda: True)

"""A training step of a small transformer with FSDP2 and context parallelism together.

Four CPU processes joined by gloo on 127.0.0.1 form a 2 x 2 mesh: data parallel over the
batch (``dp``) and context parallel over the sequence (``cp``, a ``DeviceMesh`` dimension
passed as the group). FSDP2 (``fully_shard``) shards the parameters over all four ranks. Two
steps of SGD in float64 must give the loss and the parameters' gradients of the same model
trained in one process on the whole batch and sequence, in both modes of
``distributed.sdpa``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import attnbias
from attnbias import SlidingWindowBias, causal_upper_left, distributed

# isort: split
from test_distributed import spawn

DIM, HEADS, VOCAB, LENGTH, BATCH = 32, 4, 50, 16, 2
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
Steps = list[tuple[float, list[Tensor]]]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x: Tensor, attend: Attend) -> Tensor:
        batch, length, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, HEADS, DIM // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, L, E)
        x = x + self.out(attend(q, k, v).transpose(1, 2).reshape(batch, length, DIM))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Embedding(LENGTH, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)


def _single(model: Model, tokens: Tensor, bias: Any) -> Steps:
    """Loss and gradients of two SGD steps on the whole batch and sequence."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    positions = torch.arange(LENGTH)[None].expand(tokens.shape[0], LENGTH)
    steps = []
    for _ in range(2):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1], positions,
                       lambda q, k, v: attnbias.sdpa(q, k, v, attn_mask=bias))  # fmt: skip
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        steps.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
        optimizer.step()
    return steps


def _parallel(model: Model, tokens: Tensor, bias: Any, mesh: Any, mode: str) -> Steps:
    """The same with FSDP2 over every rank, the batch split over ``dp`` and the sequence over
    ``cp`` (zigzag); each rank's loss is its share of the mean over every token."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    for block in model.blocks:
        fully_shard(block, mesh=mesh["flat"])
    fully_shard(model, mesh=mesh["flat"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    row, cp = mesh["dp"].get_local_rank(), mesh["cp"]
    mine = tokens[row * BATCH : (row + 1) * BATCH]
    inputs = distributed.shard(mine[:, :-1], group=cp, dim=1)
    targets = distributed.shard(mine[:, 1:], group=cp, dim=1)
    positions = distributed.positions(LENGTH, group=cp)[None].expand(BATCH, -1)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return distributed.sdpa(q, k, v, attn_mask=bias, group=cp, mode=mode)

    steps = []
    for _ in range(2):
        optimizer.zero_grad()
        logits = model(inputs, positions, attend)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
        loss = loss / tokens[:, 1:].numel()
        (loss * world).backward()  # FSDP averages the ranks' gradients
        total = loss.detach().clone()
        dist.all_reduce(total)
        steps.append((total.item(), [p.grad.full_tensor() for p in model.parameters()]))
        optimizer.step()
    return steps


def _compare(got: Steps, expected: Steps, where: str) -> None:
    for step, ((loss, grads), (want, wanted)) in enumerate(zip(got, expected, strict=True)):
        assert abs(loss - want) <= 1e-12, f"{where}, step {step}: loss {loss} != {want}"
        error = max((g - w).abs().max().item() for g, w in zip(grads, wanted, strict=True))
        assert error <= 1e-12, f"{where}, step {step}: gradients differ by {error:.3g}"


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        flat = init_device_mesh("cpu", (world,), mesh_dim_names=("flat",))
        mesh = {"dp": grid["dp"], "cp": grid["cp"], "flat": flat}
        torch.manual_seed(0)
        tokens = torch.randint(0, VOCAB, (2 * BATCH, LENGTH + 1))
        initial = Model().double().state_dict()
        for bias in (causal_upper_left(), causal_upper_left() + SlidingWindowBias(5)):
            reference = Model().double()
            reference.load_state_dict(initial)
            expected = _single(reference, tokens, bias)
            for mode in ("sequence", "heads"):
                model = Model().double()
                model.load_state_dict(initial)
                got = _parallel(model, tokens, bias, mesh, mode)
                _compare(got, expected, f"{bias!r}, {mode} mode")
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fsdp2_with_context_parallelism_trains_as_one_process() -> None:
    spawn(_worker, 4)

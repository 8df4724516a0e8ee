"""A training step of a small transformer with FSDP2 and context parallelism together.

Four CPU processes joined by gloo on 127.0.0.1 form a 2 x 2 mesh: data parallel over the
batch (``dp``) and context parallel over the sequence (``cp``, a ``DeviceMesh`` dimension
passed as the group). FSDP2 (``fully_shard``) shards the parameters over all four ranks. Two
steps of SGD in float64 must give the loss and the parameters' gradients of the same model
trained in one process on the whole batch and sequence, in both modes of
``distributed.sdpa``.

Where the host has two GPUs or more, the same runs with NCCL, one process per GPU, in float32
on a model of GPU size: there the loss and the gradients must agree with one GPU's within a
few times the difference between two one-GPU runs that only sum in another order (the batch
as one, and as two micro-batches whose gradients add up).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
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

Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
Steps = list[tuple[float, list[Tensor]]]


@dataclass(frozen=True)
class Size:
    dim: int
    heads: int
    vocab: int
    length: int
    batch: int  # per data-parallel row
    window: int


CPU = Size(dim=32, heads=4, vocab=50, length=16, batch=2, window=5)
GPU = Size(dim=256, heads=4, vocab=1000, length=2048, batch=2, window=256)


class Block(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        dim = size.dim
        self.heads = size.heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x: Tensor, attend: Attend) -> Tensor:
        batch, length, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, L, E)
        x = x + self.out(attend(q, k, v).transpose(1, 2).reshape(batch, length, dim))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, size: Size) -> None:
        super().__init__()
        self.vocab = size.vocab
        self.embed = nn.Embedding(size.vocab, size.dim)
        self.position = nn.Embedding(size.length, size.dim)
        self.blocks = nn.ModuleList([Block(size), Block(size)])
        self.head = nn.Linear(size.dim, size.vocab)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(x)


def _single(model: Model, tokens: Tensor, bias: Any, micro: int = 1) -> Steps:
    """Loss and gradients of two SGD steps on the whole batch and sequence (in ``micro``
    micro-batches whose gradients add up)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    length = tokens.shape[1] - 1
    steps = []
    for _ in range(2):
        optimizer.zero_grad()
        total = 0.0
        for rows in tokens.chunk(micro):
            positions = torch.arange(length, device=tokens.device)[None].expand(len(rows), -1)
            logits = model(rows[:, :-1], positions,
                           lambda q, k, v: attnbias.sdpa(q, k, v, attn_mask=bias))  # fmt: skip
            loss = (
                F.cross_entropy(
                    logits.reshape(-1, model.vocab), rows[:, 1:].reshape(-1), reduction="sum"
                )
                / tokens[:, 1:].numel()
            )
            loss.backward()
            total += loss.item()
        steps.append((total, [p.grad.clone() for p in model.parameters()]))
        optimizer.step()
    return steps


def _parallel(model: Model, tokens: Tensor, bias: Any, mesh: Any, mode: str) -> Steps:
    """The same with FSDP2 over every rank, the batch split over ``dp`` and the sequence over
    ``cp`` (zigzag); each rank's loss is its share of the mean over every token."""
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    batch, length = tokens.shape[0] // mesh["dp"].size(), tokens.shape[1] - 1
    for block in model.blocks:
        fully_shard(block, mesh=mesh["flat"])
    fully_shard(model, mesh=mesh["flat"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    row, cp = mesh["dp"].get_local_rank(), mesh["cp"]
    mine = tokens[row * batch : (row + 1) * batch]
    inputs = distributed.shard(mine[:, :-1], group=cp, dim=1)
    targets = distributed.shard(mine[:, 1:], group=cp, dim=1)
    positions = distributed.positions(length, group=cp)[None].expand(batch, -1)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return distributed.sdpa(q, k, v, attn_mask=bias, group=cp, mode=mode)

    steps = []
    for _ in range(2):
        optimizer.zero_grad()
        logits = model(inputs, positions, attend)
        loss = F.cross_entropy(
            logits.reshape(-1, model.vocab), targets.reshape(-1), reduction="sum"
        )
        loss = loss / tokens[:, 1:].numel()
        (loss * world).backward()  # FSDP averages the ranks' gradients
        total = loss.detach().clone()
        dist.all_reduce(total)
        steps.append((total.item(), [p.grad.full_tensor() for p in model.parameters()]))
        optimizer.step()
    return steps


def _difference(got: Steps, expected: Steps) -> tuple[float, float]:
    """The largest differences of the losses and of the gradients over the steps."""
    loss = max(abs(a - b) for (a, _), (b, _) in zip(got, expected, strict=True))
    grads = max(
        (g - w).abs().max().item()
        for (_, gs), (_, ws) in zip(got, expected, strict=True)
        for g, w in zip(gs, ws, strict=True)
    )
    return loss, grads


def _run(rank: int, world: int, port: int, backend: str, size: Size, dtype: torch.dtype) -> None:
    """Both biases and both modes over a (W / 2) x 2 mesh of ``dp`` x ``cp``."""
    from torch.distributed.device_mesh import init_device_mesh

    kind = "cuda" if backend == "nccl" else "cpu"
    device = torch.device(kind, rank if kind == "cuda" else 0)
    if kind == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        grid = init_device_mesh(kind, (world // 2, 2), mesh_dim_names=("dp", "cp"))
        flat = init_device_mesh(kind, (world,), mesh_dim_names=("flat",))
        mesh = {"dp": grid["dp"], "cp": grid["cp"], "flat": flat}
        torch.manual_seed(0)
        tokens = torch.randint(0, size.vocab, (world // 2 * size.batch, size.length + 1))
        tokens = tokens.to(device)
        initial = Model(size).to(device, dtype).state_dict()

        def fresh() -> Model:
            model = Model(size).to(device, dtype)
            model.load_state_dict(initial)
            return model

        biases = (causal_upper_left(), causal_upper_left() + SlidingWindowBias(size.window))
        for bias in biases:
            expected = _single(fresh(), tokens, bias)
            budget_loss = budget_grads = 1e-12  # float64 on the CPU
            if kind == "cuda":
                # a few times the difference that summing in another order makes
                loss, grads = _difference(_single(fresh(), tokens, bias, micro=2), expected)
                budget_loss, budget_grads = 4 * loss + 1e-6, 4 * grads + 1e-7
            for mode in ("sequence", "heads"):
                got = _parallel(fresh(), tokens, bias, mesh, mode)
                loss, grads = _difference(got, expected)
                where = f"{bias!r}, {mode} mode, {dtype}"
                if rank == 0 and kind == "cuda":
                    print(f"{where}: loss {loss:.2e} (budget {budget_loss:.2e}), gradients "
                          f"{grads:.2e} (budget {budget_grads:.2e})", flush=True)  # fmt: skip
                assert loss <= budget_loss, f"{where}: losses differ by {loss:.3g}"
                assert grads <= budget_grads, f"{where}: gradients differ by {grads:.3g}"
    finally:
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    torch.set_num_threads(1)
    _run(rank, world, port, "gloo", CPU, torch.float64)


def _gpu_worker(rank: int, world: int, port: int) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    _run(rank, world, port, "nccl", GPU, torch.float32)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fsdp2_with_context_parallelism_trains_as_one_process() -> None:
    spawn(_worker, 4)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fsdp2_with_context_parallelism_trains_as_one_gpu() -> None:
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs two GPUs or more, found {count}")
    spawn(_gpu_worker, 4 if count >= 4 else 2)

"""Context parallelism: one attention call over a sequence split across processes.

Spawns two CPU processes joined by gloo (or one process per GPU with NCCL, when there are
several GPUs). Each rank holds its zigzag part of the queries, keys and values, and every rank
passes the same bias over the whole sequence: causal + a sliding window + packed documents.
The key/value parts travel around the ring; each rank gets its rows of the output, and the
gradients of its parts. Both are checked against single-process ``attnbias.sdpa``.

    python examples/context_parallel.py
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnbias
from attnbias import DocumentBias, SlidingWindowBias, causal_lower_right, distributed


def run(rank: int, world: int, port: int, cuda: bool) -> None:
    backend, device = ("nccl", f"cuda:{rank}") if cuda else ("gloo", "cpu")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    dtype, length = (torch.bfloat16, 8192) if cuda else (torch.float32, 512)
    torch.manual_seed(0)  # the same whole tensors on every rank, to check against
    q = torch.randn(2, 8, length, 64, device=device, dtype=dtype)
    k, v = (torch.randn(2, 2, length, 64, device=device, dtype=dtype) for _ in range(2))
    grad = torch.randn_like(q)
    seqlens = [length // 8, length // 2, length - length // 8 - length // 2]
    bias = (
        causal_lower_right()
        + SlidingWindowBias(length // 4)
        + DocumentBias.from_seqlens(seqlens, device=device)
    )

    parts = [distributed.shard(t).requires_grad_() for t in (q, k, v)]  # zigzag parts
    out = distributed.sdpa(*parts, attn_mask=bias, enable_gqa=True)
    out.backward(distributed.shard(grad))

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = attnbias.sdpa(*whole, attn_mask=bias, enable_gqa=True)
    expected.backward(grad)
    pairs = [(out, expected), *((p.grad, w.grad) for p, w in zip(parts, whole, strict=True))]
    errors = [(got - distributed.shard(want)).abs().max().item() for got, want in pairs]
    print(f"rank {rank}/{world} ({backend}, {dtype}): max error against single-process sdpa "
          + ", ".join(f"{n} {e:.2e}" for n, e in zip(("out", "dq", "dk", "dv"), errors,
                                                       strict=True)))  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    cuda = torch.cuda.device_count() >= 2
    world = torch.cuda.device_count() if cuda else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run, args=(world, port, cuda), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()

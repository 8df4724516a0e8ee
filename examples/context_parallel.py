"""Context parallelism: one attention call over a sequence split across processes.

Spawns two CPU processes joined by gloo (or one process per GPU with NCCL, when there are
several GPUs). Each rank holds its zigzag part of the queries, keys and values, and every rank
passes the same bias over the whole sequence: causal + a sliding window + packed documents.
The key/value parts travel around the ring; each rank gets its rows of the output, and the
gradients of its parts. Both are checked against an independent float64 computation with stock
PyTorch over the whole sequence (a softmax over the mask written out with ``torch.arange``
comparisons), cut into the zigzag parts by hand.

    python examples/context_parallel.py
"""

from __future__ import annotations

import math
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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

    # the reference: float64 attention with stock PyTorch on the whole sequence, its (L, S)
    # mask written out: causal, at most length // 4 keys before the query, the same document
    i, j = torch.arange(length, device=device)[:, None], torch.arange(length, device=device)
    doc = torch.arange(len(seqlens), device=device).repeat_interleave(
        torch.tensor(seqlens, device=device)
    )
    keep = (j <= i) & (j >= i - length // 4) & (doc[:, None] == doc[None, :])
    assert bool(keep.any(-1).all())  # every row keeps a key: no row whose output must be 0
    whole = [t.double().requires_grad_() for t in (q, k, v)]
    outputs = []
    for b in range(q.shape[0]):  # one batch row at a time: the (H, L, S) scores are large
        q_b, k_b, v_b = (t[b].repeat_interleave(8 // t.shape[1], dim=0) for t in whole)  # GQA
        scores = (q_b @ k_b.transpose(-1, -2) / math.sqrt(64)).masked_fill(~keep, -math.inf)
        out_b = torch.softmax(scores, dim=-1) @ v_b
        out_b.backward(grad[b].double())
        outputs.append(out_b.detach())
    expected = [torch.stack(outputs), *(t.grad for t in whole)]

    def zigzag(x: torch.Tensor) -> torch.Tensor:
        """This rank's part, cut by hand: chunks ``rank`` and ``2W - 1 - rank`` of ``2W``."""
        chunks = x.chunk(2 * world, dim=2)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=2)

    got = [out.detach(), *(p.grad for p in parts)]
    expected = [zigzag(x) for x in expected]
    errors = [(a.double() - b).abs().max().item() for a, b in zip(got, expected, strict=True)]
    labels = ("out", "dq", "dk", "dv")
    text = ", ".join(f"{label} {e:.1e}" for label, e in zip(labels, errors, strict=True))
    print(f"rank {rank}/{world} ({backend}, {dtype}): max error vs float64 stock PyTorch: {text}")
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # of the largest value
    largest = [b.abs().max().item() for b in expected]
    assert all(e <= tolerance * m for e, m in zip(errors, largest, strict=True)), errors
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

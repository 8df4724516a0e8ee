"""Whether the head mode's exchanges could hide behind its attention, on two GPUs: per rank,
the attention the head mode runs at W = 2 (8 of 16 heads, the whole sequence, bf16, E = 128,
forward + backward through ``attnbias.sdpa``), a step's exchanged bytes moved alone, and the
same bytes moved on a side stream while the attention runs, once over NCCL's all-to-all and
once by copy engines into the peer's buffer (symmetric memory, then a device barrier).

The bytes: a step of the head mode sends eight shares of ``(S / 2) x 8 heads x E`` to the
peer (q, k and v; the output; its gradient; the gradients of q, k and v), here two messages
of four shares each. The all-to-all carries each rank's own half as well (as
``dist.all_to_all_single`` does); the copies carry only the peer's.

    python benchmarks/probes/cp_overlap.py [--length 32768]

Prints the slowest rank's median time of each (ms) and the rate of each transfer.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnbias
from attnbias import causal_upper_left

HEADS, HEAD_DIM, WORLD = 8, 128, 2


def slowest_median(step: Callable[[], None], device: torch.device, reps: int = 8) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    found = torch.tensor([statistics.median(times)], device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return float(found.item())


def run_rank(rank: int, port: int, length: int, out: Any) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        device_id=device,
    )  # fmt: skip
    group = dist.group.WORLD
    assert group is not None
    side = torch.cuda.Stream()
    shape = (1, HEADS, length, HEAD_DIM)
    q, k, v = (
        torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(shape, device=device, dtype=torch.bfloat16)

    def attention() -> None:
        attnbias.sdpa(q, k, v, attn_mask=causal_upper_left()).backward(grad)

    n = 4 * (length // WORLD) * HEADS * HEAD_DIM  # four shares: one message
    send = torch.randn(WORLD * n, device=device, dtype=torch.bfloat16)
    received = torch.empty_like(send)

    def nccl() -> None:
        for _ in range(2):
            dist.all_to_all_single(received, send, group=group)

    buffer = symm_mem.empty(WORLD * n, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buffer, group.group_name)
    peer = 1 - rank
    peer_buffer = handle.get_buffer(peer, (WORLD * n,), torch.bfloat16, 0)

    def copies() -> None:
        for _ in range(2):
            peer_buffer[rank * n : (rank + 1) * n].copy_(send[peer * n : (peer + 1) * n])
            handle.barrier(channel=0)

    def beside(exchange: Callable[[], None]) -> Callable[[], None]:
        def step() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                exchange()
            attention()
            torch.cuda.current_stream().wait_stream(side)

        return step

    found = {
        name: slowest_median(step, device)
        for name, step in (
            ("attention", attention), ("NCCL all-to-all", nccl), ("copy engines", copies),
            ("attention beside NCCL", beside(nccl)), ("attention beside copies", beside(copies)),
        )
    }  # fmt: skip
    if rank == 0:
        out.update(found)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=32768)
    length = parser.parse_args().length
    if torch.cuda.device_count() < WORLD:
        raise SystemExit("cp_overlap needs two GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(run_rank, args=(port, length, out), nprocs=WORLD, start_method="spawn")
        found = dict(out)
    peer_mib = 2 * 4 * (length // WORLD) * HEADS * HEAD_DIM * 2 / 2**20
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, S = {length}, "
          f"{peer_mib:.0f} MiB to the peer per step")  # fmt: skip
    print("| what | ms | GB/s to the peer |")
    print("|---|--:|--:|")
    for name, ms in found.items():
        moved = name in ("NCCL all-to-all", "copy engines")
        rate = f"{peer_mib * 2**20 / ms / 1e6:.0f}" if moved else ""
        print(f"| {name} | {ms:.2f} | {rate} |")
    for name, beside_name in (("NCCL all-to-all", "attention beside NCCL"),
                              ("copy engines", "attention beside copies")):  # fmt: skip
        in_turn = found["attention"] + found[name]
        print(f"{name}: beside the attention {found[beside_name]:.2f} ms, in turn {in_turn:.2f}")


if __name__ == "__main__":
    main()

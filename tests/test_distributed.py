"""``attnbias.distributed``: a sequence split across the ranks of a process group.

Each test with ranks spawns ``W`` CPU processes joined by the gloo backend on 127.0.0.1, runs
every check of that ``W`` in them, and fails if they take longer than ``TIMEOUT_S``. The
expected values are built here from the layouts' definitions (rank ``r`` holds chunk ``r`` of
``W``, or chunks ``r`` and ``2W - 1 - r`` of ``2W``), not by the functions under test.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnbias import distributed

TIMEOUT_S = 120


def expected_positions(length: int, world: int, rank: int, layout: str) -> list[int]:
    if layout == "contiguous":
        size = length // world
        return list(range(rank * size, (rank + 1) * size))
    size = length // (2 * world)
    first = list(range(rank * size, (rank + 1) * size))
    mirror = 2 * world - 1 - rank
    return first + list(range(mirror * size, (mirror + 1) * size))


def _checks(rank: int, world: int) -> None:
    """Every check of one rank (run in each spawned process)."""
    for layout in distributed.LAYOUTS:
        length = 4 * world
        want = expected_positions(length, world, rank, layout)
        assert distributed.positions(length, layout=layout).tolist() == want, layout
        # (B, H, S, E) of distinct values: a part is the whole's rows at the rank's positions
        whole = torch.arange(2 * 3 * length * 5, dtype=torch.float64).reshape(2, 3, length, 5)
        part = distributed.shard(whole, layout=layout)
        assert torch.equal(part, whole[:, :, want]), layout
        assert torch.equal(distributed.unshard(part, layout=layout), whole), layout
        # another dim, negative
        other = whole.transpose(1, 2).contiguous()  # (B, S, H, E)
        part = distributed.shard(other, layout=layout, dim=-3)
        assert torch.equal(part, other[:, want]), layout
        assert torch.equal(distributed.unshard(part, layout=layout, dim=1), other), layout

        # gradients: every rank's loss reads the whole tensor with its own weights
        weights = torch.arange(length, dtype=torch.float64) + 100 * rank
        leaf = whole.clone().requires_grad_()
        gathered = distributed.unshard(distributed.shard(leaf, layout=layout), layout=layout)
        (gathered * weights[:, None]).sum().backward()
        total = sum(torch.arange(length, dtype=torch.float64) + 100 * r for r in range(world))
        grad = torch.zeros_like(whole)
        grad[:, :, want] = total[want][:, None]  # a rank's shard sends back its positions only
        assert leaf.grad is not None
        assert torch.equal(leaf.grad, grad), layout

        # a length the layout cannot split
        bad = 2 * world + 1
        with pytest.raises(ValueError, match=f"length {bad}.*{layout!r}.*{world} ranks"):
            distributed.shard(torch.zeros(1, 1, bad, 1), layout=layout)


def _worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        _checks(rank, world)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(fn: Any, world: int) -> None:
    """Run ``fn(rank, world, port)`` in ``world`` processes; fail on an error or a timeout."""
    context = mp.start_processes(
        fn, args=(world, _free_port()), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} ranks took longer than {TIMEOUT_S} s")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_and_unshard_over_gloo(world: int) -> None:
    spawn(_worker, world)


def test_without_a_process_group_the_error_says_how_to_start_one() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        distributed.shard(torch.zeros(1, 1, 4, 1))


def test_an_unknown_layout_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="layout='ring'.*'contiguous', 'zigzag'"):
        distributed._chunks(8, 2, "ring")


def test_a_dim_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="dim=4 is out of range"):
        distributed._check_dim(torch.zeros(1, 1, 4, 1), 4)

"""Device tensors kept from call to call, allocated where no CUDA graph writes.

A thread can route its CUDA allocations to a memory pool that CUDA graphs share
(``torch.cuda.use_mem_pool``); transformers' continuous batching runs the eager warm-up of
every step it captures that way. Memory an earlier graph used for its temporaries is free
in that pool between captures, so a tensor kept by such a call (a copy of a bias's small
tensors, a kernel's scratch counters) can be handed that memory, and the earlier graph
overwrites it at each of its replays: the calls that read it afterwards, eager or captured,
compute something else. Routing is per thread, so :func:`outside_pools` makes kept tensors
on a worker thread of its own, which no pool routes, on the caller's CUDA stream.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["outside_pools"]

T = TypeVar("T")

# a job: what to make, and where to put what it made (or the exception it raised)
_Job = tuple[Callable[[], object], "queue.SimpleQueue[object]"]
_WORK: queue.SimpleQueue[_Job] | None = None
_PID = 0  # the process that started the worker (a forked child starts its own)
_THREAD: threading.Thread | None = None
_START = threading.Lock()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _serve(work: queue.SimpleQueue[_Job]) -> None:
    while True:
        make, answer = work.get()
        try:
            answer.put(make())
        except BaseException as error:  # handed back to the caller, raised there
            answer.put(_Failed(error))


def _worker() -> queue.SimpleQueue[_Job]:
    global _WORK, _PID, _THREAD
    with _START:
        if _WORK is None or os.getpid() != _PID:
            work: queue.SimpleQueue[_Job] = queue.SimpleQueue()
            thread = threading.Thread(
                target=_serve, args=(work,), name="attnbias-kept", daemon=True
            )
            thread.start()
            _WORK, _PID, _THREAD = work, os.getpid(), thread
    return _WORK


def outside_pools(make: Callable[[], T]) -> T:
    """``make()``, with the CUDA tensors it allocates in the caching allocator's own pools
    (not in a memory pool the calling thread routes its allocations to).

    For tensors kept from call to call. ``make`` runs on a worker thread, on the caller's
    current device and stream (its work is queued in the caller's stream order), without
    gradients; its exceptions are raised here. Without CUDA (or before CUDA is initialised,
    when no pool can route anything) ``make()`` runs here. Not for calls being captured in a
    CUDA graph: what a capture makes belongs to its graph.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return make()
    if threading.current_thread() is _THREAD:  # made within a make: here already
        return make()
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream(device)

    def on_stream() -> T:
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            return make()

    answer: queue.SimpleQueue[object] = queue.SimpleQueue()
    _worker().put((on_stream, answer))
    made = answer.get()
    if isinstance(made, _Failed):
        raise made.error
    if isinstance(made, torch.Tensor) and made.is_cuda and made.device.index != device:
        # made on another device, on the worker's stream there (that device's default)
        other = made.device
        torch.cuda.current_stream(other).wait_stream(torch.cuda.default_stream(other))
    return made  # type: ignore[return-value]

"""The backends a lowered call can run on, each one module stating what it supports.

``BACKENDS`` maps each name to its backend; ``explain`` lists them in this order. Which of them
a call tries, and in what order, is the planner's (``attnbias.planner``).
"""

from attnbias.backends.base import Backend
from attnbias.backends.fa4 import FlashAttention4
from attnbias.backends.reference import Reference
from attnbias.backends.stock import MaterializedSDPA, StockSDPA, stock_sdpa
from attnbias.backends.triton import TritonKernel

BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        FlashAttention4(),
        TritonKernel(),
        StockSDPA(),
        MaterializedSDPA(),
        Reference(),
    )
}

__all__ = [
    "BACKENDS",
    "Backend",
    "FlashAttention4",
    "MaterializedSDPA",
    "Reference",
    "StockSDPA",
    "TritonKernel",
    "stock_sdpa",
]

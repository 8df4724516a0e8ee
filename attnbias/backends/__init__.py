"""The backends a lowered call can run on, each one module stating what it supports."""

from attnbias.backends.base import Backend
from attnbias.backends.decode import TritonDecode
from attnbias.backends.fa4 import FlashAttention4
from attnbias.backends.reference import Reference
from attnbias.backends.registry import BACKENDS, ROUTES
from attnbias.backends.stock import MaterializedSDPA, StockSDPA, stock_sdpa
from attnbias.backends.triton import TritonKernel

__all__ = [
    "BACKENDS",
    "ROUTES",
    "Backend",
    "FlashAttention4",
    "MaterializedSDPA",
    "Reference",
    "StockSDPA",
    "TritonDecode",
    "TritonKernel",
    "stock_sdpa",
]

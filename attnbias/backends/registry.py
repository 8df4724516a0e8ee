"""The registry: every backend by name, in the order ``explain`` lists them.

Which of them a call tries, and in what order, is the planner's (``attnbias.planner``).
"""

from attnbias.backends.base import Backend
from attnbias.backends.decode import TritonDecode
from attnbias.backends.empty import EmptyOutput
from attnbias.backends.fa4 import FlashAttention4
from attnbias.backends.gluon import GluonForward
from attnbias.backends.own_dispatch import OwnDispatch
from attnbias.backends.reference import Reference
from attnbias.backends.stock import MaterializedSDPA, StockSDPA
from attnbias.backends.triton import TritonKernel

__all__ = ["BACKENDS", "ROUTES"]

BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        FlashAttention4(),
        TritonDecode(),
        TritonKernel(),
        GluonForward(),
        StockSDPA(),
        MaterializedSDPA(),
        Reference(),
    )
}
# Every route by name: the backends above and the two that serve a call form of their own
# (``attnbias.planner.FORM_ROUTES``): no output element, a bias class's own dispatch.
ROUTES: dict[str, Backend] = {
    **BACKENDS,
    **{backend.name: backend for backend in (EmptyOutput(), OwnDispatch())},
}

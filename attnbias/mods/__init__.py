"""The ModBias compiler's front end: ``mask_mod`` / ``score_mod`` functions traced into the graph
of :mod:`attnbias.kernels.modgraph` (:mod:`~attnbias.mods.symbols`, :mod:`~attnbias.mods.trace`),
that graph evaluated with torch operations on index grids (:mod:`~attnbias.mods.eager`), and
each call's tensor reads proven within their tensors (:mod:`~attnbias.mods.reads`). The
emitters read only the graph: Triton code in :mod:`attnbias.kernels.modemit` and
:mod:`attnbias.kernels.modtiles`, CuTe code in :mod:`attnbias.backends.fa4_mods`.

Nothing here knows about bias classes: the front end (:class:`attnbias.ModBias`) hands in plain
callables.
"""

from attnbias.mods.eager import (
    EXACT_LIMIT,
    check_errors,
    check_reads,
    evaluate,
    mask_grid,
    pending_checks,
    score_grid,
)
from attnbias.mods.symbols import SUPPORTED, ModTraceError, Sym
from attnbias.mods.trace import same_graph, trace_mods

__all__ = [
    "EXACT_LIMIT",
    "SUPPORTED",
    "ModTraceError",
    "Sym",
    "check_errors",
    "check_reads",
    "evaluate",
    "mask_grid",
    "pending_checks",
    "same_graph",
    "score_grid",
    "trace_mods",
]

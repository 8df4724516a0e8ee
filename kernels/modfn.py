"""The kernels' form of traced mask and score functions: their generated Triton code compiled
once per graph structure (:class:`CompiledMods`), with the runtime arguments of each call, and
the names of their flat wrappers (:func:`~.record.flat_kernel` passes them to the kernels).

The graph is :mod:`attnbias.kernels.modgraph`; it is traced by :mod:`attnbias.mods`, generated
as Triton code by :mod:`~attnbias.kernels.modemit` and :mod:`~attnbias.kernels.modtiles`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import linecache
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .modemit import generate
from .modgraph import TracedMods

__all__ = ["CompiledMods", "jit_from_source", "module_suffix"]


_SOURCES: dict[tuple[str, str], dict[str, Any]] = {}


def jit_from_source(
    source: str, prefix: str, names: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Execute generated ``source`` as a module (its text registered with ``linecache``, where
    Triton and ``inspect`` read a function's source) and return its namespace, which starts
    with ``names``; the same source and ``prefix`` give the same namespace, so its Triton
    functions compile once per process (callers giving other ``names`` give another
    ``prefix``)."""
    found = _SOURCES.get((source, prefix))
    if found is not None:
        return found
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    filename = f"<attnbias-{prefix}-{digest}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": f"attnbias_generated_{prefix}_{digest}"}
    namespace.update(names or {})
    exec(compile(source, filename, "exec"), namespace)
    _SOURCES[(source, prefix)] = namespace
    return namespace


@dataclass(frozen=True, eq=False)
class CompiledMods:
    """The Triton functions of traced mask and score functions, with the runtime arguments
    they read (``args``: the flat tuple of :meth:`TracedMods.runtime_args`)."""

    traced: TracedMods
    mask_fn: Any
    score_fn: Any
    score_grad_fn: Any
    param_grad_fn: Any
    source: str
    tile_fn: Any = None

    @classmethod
    def of(cls, traced: TracedMods) -> CompiledMods:
        source = generate(traced)
        namespace = jit_from_source(source, "mods")
        made = cls(
            traced,
            namespace["mask_fn"],
            namespace["score_fn"],
            namespace["score_grad_fn"],
            namespace["param_grad_fn"],
            source,
            namespace["tile_fn"],
        )
        # registered now, outside any torch.compile trace: a registration traced there would
        # only be applied after the graph is built, and the ops' fake forms look it up before
        made.register()
        return made

    @property
    def has_mask(self) -> bool:
        return len(self.traced.masks) > 0  # (not bool(list): torch.compile traces this)

    @property
    def has_score(self) -> bool:
        return len(self.traced.scores) > 0

    def args(self) -> list[Any]:
        return self.traced.runtime_args()

    def bound(self, param_grads: bool) -> dict[str, Any]:
        """The kernels' generated-function parameters and this form's functions for them
        (``None`` where it has none; the parameters' gradient function only with
        ``param_grads``)."""
        return {
            "MASK_FN": self.mask_fn if self.has_mask else None,
            "SCORE_FN": self.score_fn if self.has_score else None,
            "SCORE_GRAD_FN": self.score_grad_fn if self.has_score else None,
            "PARAM_GRAD_FN": self.param_grad_fn if param_grads else None,
            "TILE_FN": self.tile_fn if self.has_mask else None,
            # for tiles of rows of several heads (the decode kernel's packed rows): only where
            # the masks do not read the head
            "HEADLESS_TILE_FN": (
                self.tile_fn if self.has_mask and "h" not in self.traced.reads() else None
            ),
        }

    def describe(self) -> str:
        names = [f.name for f in (*self.traced.masks, *self.traced.scores)]
        return "generated " + ", ".join(names)

    # -- through the registered ops: functions by number, parameters and numbers as values --

    def register(self) -> int:
        """This form's number in the process's registry (the same generated code, the same
        number), which the registered ops carry instead of the functions."""
        key = (self.source, tuple(type(c) for c in self.traced.consts))
        number = _REGISTERED.get(key)
        if number is None:
            # the template holds the graph and the code, not the tensors it was made with:
            # each call hands in its own (:meth:`unpack_from`)
            stand_ins = [_STAND_IN] * len(self.traced.params)
            template = dataclasses.replace(
                self, traced=dataclasses.replace(self.traced, params=stand_ins)
            )
            number = _REGISTERED[key] = len(_TEMPLATES)
            _TEMPLATES.append(template)
        return number

    def pack_into(self, tensors: list[Any], ints: list[int], floats: list[float]) -> None:
        """Append the parameters to ``tensors`` and the numbers to ``ints`` / ``floats``."""
        tensors.extend(self.traced.params)
        for value in self.traced.consts:
            if isinstance(value, int):
                ints.append(value)
            else:
                floats.append(value)

    @classmethod
    def unpack_from(
        cls, number: int, tensors: Iterator[Any], ints: Iterator[int], floats: Iterator[float]
    ) -> CompiledMods:
        """The form :meth:`pack_into` wrote, with registry number ``number``."""
        template = _TEMPLATES[number]
        old = template.traced
        params = [next(tensors) for _ in old.params]
        consts: list[int | float] = [
            next(ints) if isinstance(value, int) else next(floats) for value in old.consts
        ]
        traced = dataclasses.replace(old, params=params, consts=consts)
        return dataclasses.replace(template, traced=traced)


#: The registry of generated forms: one entry per generated source and kinds of numbers (as
#: many as the Triton compilations they cost), holding no tensor of the user's.
_REGISTERED: dict[tuple[str, tuple[type, ...]], int] = {}
_TEMPLATES: list[CompiledMods] = []
_STAND_IN = torch.empty(0, device="meta")


def module_suffix(functions: Iterable[Any]) -> str:
    """A name for a set of generated functions (or ``None``s): their generated module's name
    holds its source's digest, so one name per set ("free" for none)."""
    origin = "".join(sorted({fn.fn.__module__ for fn in functions if fn is not None}))
    return hashlib.sha256(origin.encode()).hexdigest()[:8] if origin else "free"

"""The kernels' form of traced mask and score functions: their generated Triton code compiled
once per graph structure (:class:`CompiledMods`), with the runtime arguments of each call, and
the flat wrappers that pass them to the kernels (:func:`with_flat_mods`).

The graph is :mod:`attnbias.kernels.modgraph`; it is traced by :mod:`attnbias.mods`, generated
as Triton code by :mod:`~attnbias.kernels.modemit` and :mod:`~attnbias.kernels.modtiles`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import linecache
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .modemit import generate
from .modgraph import TracedMods

__all__ = ["CompiledMods", "jit_from_source", "with_flat_mods"]


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


_WRAPPERS: dict[tuple[Any, ...], Any] = {}


def with_flat_mods(kernel: Any, count: int, bound: Mapping[str, Any] | None = None) -> Any:
    """A kernel that takes ``kernel``'s runtime parameter ``MOD`` (the tuple of generated
    functions' arguments) as ``count`` flat parameters in its place and calls ``kernel`` with
    them as one tuple: a launch, ``torch.compile``'s tracing of a launch and the compiled
    kernel's own launcher all take flat arguments only.

    ``bound`` fixes ``tl.constexpr`` parameters of ``kernel`` to generated functions (or
    ``None``): the new kernel calls them by name, so they are not among its own parameters
    (``torch.compile`` writes a kernel's source with the functions it calls, but cannot write
    a function passed as a launch argument). Names ``kernel`` does not take are ignored."""
    # looked up on every launch: the key first (a signature costs the host tens of µs)
    key = (kernel, count, *((name, id(fn)) for name, fn in (bound or {}).items()))
    found = _WRAPPERS.get(key)
    if found is not None:
        return found
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = [p.name for p in params]
    if "MOD" not in names:
        raise TypeError(f"{kernel} has no MOD parameter")
    fixed = {name: fn for name, fn in (bound or {}).items() if name in names}
    # the functions by their own names (generated together, so distinct), the kernel by its
    namespace: dict[str, Any] = {kernel.__name__: kernel}
    for fn in fixed.values():
        if fn is not None:
            namespace[fn.__name__] = fn
    flat = [f"MOD{i}" for i in range(count)]
    signature, call = [], []
    for param in params:
        if param.name == "MOD":
            signature += flat
            call.append(f"({', '.join(flat)},)" if flat else "()")
        elif param.name in fixed:
            fn = fixed[param.name]
            call.append(f"{param.name}={'None' if fn is None else fn.__name__}")
        elif "constexpr" in str(param.annotation):
            default = "" if param.default is inspect.Parameter.empty else " = None"
            signature.append(f"{param.name}: tl.constexpr{default}")
            call.append(f"{param.name}={param.name}")
        else:
            signature.append(param.name)
            call.append(param.name)
    # one name per set of functions: their generated module's name holds its source's digest
    origin = "".join(sorted({fn.fn.__module__ for fn in fixed.values() if fn is not None}))
    suffix = hashlib.sha256(origin.encode()).hexdigest()[:8] if origin else "free"
    name = f"{kernel.__name__}_mods{count}_{suffix}"
    # the functions' numbers change between calls: specialized on their type only (Triton
    # would compile a variant for a value of 1 or a multiple of 16)
    jit = f"@triton.jit(do_not_specialize={flat!r})" if flat else "@triton.jit"
    source = (
        f"import triton\nimport triton.language as tl\n\n\n{jit}\n"
        f"def {name}({', '.join(signature)}):\n    {kernel.__name__}({', '.join(call)})\n"
    )
    made = jit_from_source(source, name, namespace)[name]
    _WRAPPERS[key] = made
    return made

"""Launching the ``@triton.jit`` kernels: traceable for ``torch.compile``, cheap on the host
otherwise."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Hashable, Iterator
from typing import Any

import torch
from torch import Tensor

from .limits import interpreting

__all__ = [
    "CachedLaunch",
    "KeptLaunch",
    "PreparedLaunch",
    "current_device",
    "empty_contiguous",
    "empty_rows",
    "launcher",
    "launches_traceable",
    "traceable_launches",
]

# Set while a launcher runs as the body of a registered op (kernels/ops.py). Only then are the
# launches routed through ``wrap_triton``, so ``torch.compile`` can trace them; a direct call
# launches the kernel itself, because the traceable wrapper costs ~0.1 ms of host time per
# launch in eager mode.
_TRACEABLE_LAUNCH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "attnbias_traceable_launch", default=False
)


@contextlib.contextmanager
def traceable_launches() -> Iterator[None]:
    """Route kernel launches through ``torch.library.wrap_triton`` inside this block."""
    token = _TRACEABLE_LAUNCH.set(True)
    try:
        yield
    finally:
        _TRACEABLE_LAUNCH.reset(token)


def launches_traceable() -> bool:
    """Whether launches are being traced (inside :func:`traceable_launches`)."""
    return _TRACEABLE_LAUNCH.get()


def launcher(kernel: Any) -> Any:
    """``kernel`` as something to launch with ``[grid](*args, **constexprs)``: traceable
    inside :func:`traceable_launches`, the plain kernel under the interpreter, and otherwise
    a :class:`CachedLaunch` of it."""
    if interpreting():
        return kernel
    if _TRACEABLE_LAUNCH.get():
        from torch.library import wrap_triton

        return wrap_triton(kernel)
    launcher = CACHED_LAUNCHES.get(kernel)
    if launcher is None:
        launcher = CACHED_LAUNCHES[kernel] = CachedLaunch(kernel)
    return launcher


# A compiled kernel launches through ``compiled[grid](*args)``: a closure that looks up the
# current stream, builds the launch metadata that Triton's launch hooks read (profilers
# register them) and calls the kernel's launcher, ``compiled.run(gridX, gridY, gridZ, stream,
# function, kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, *args)``
# (Triton 3.6 names the first five and takes the rest, in the same order, as variadic
# arguments). A kept launch calls that launcher itself while no hook is registered: less host
# time per launch (``benchmarks/NOTES.md``, "Host time of a short training call"). Launchers
# of another signature (other Triton versions) go through the closure.
_LAUNCHER_PARAMETERS = (
    "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
    "launch_enter_hook", "launch_exit_hook",
)  # fmt: skip


def _direct_launcher(compiled: Any) -> Any:
    """``compiled``'s own launcher where it takes :data:`_LAUNCHER_PARAMETERS` (all of them
    named, or the first five) then variadic arguments, and the compiled kernel has the
    function and metadata it passes; else ``None``."""
    run = getattr(compiled, "run", None)
    if run is None or not all(hasattr(compiled, a) for a in ("function", "packed_metadata")):
        return None
    try:
        parameters = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):
        return None
    if not parameters or parameters[-1].kind is not inspect.Parameter.VAR_POSITIONAL:
        return None
    names = tuple(p.name for p in parameters[:-1])
    if names not in (_LAUNCHER_PARAMETERS, _LAUNCHER_PARAMETERS[:5]):
        return None
    return run


@functools.cache
def _runtime_knobs() -> Any:
    """Triton's runtime settings (one object; its hooks are read at each launch)."""
    from triton import knobs

    return knobs.runtime


def _launch_hooks() -> bool:
    """Whether Triton has a launch hook registered (a hook chain with calls, or a hook of a
    version without chains)."""
    runtime = _runtime_knobs()
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _current_stream(device: int) -> int:
    """The raw CUDA stream Triton launches on for ``device``: PyTorch's current stream, which
    Triton's CUDA driver reads, taken from PyTorch at once where it can be."""
    return _stream_getter()(device)


@functools.cache
def _stream_getter() -> Any:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    from triton.runtime import driver

    return driver.active.get_current_stream


class KeptLaunch:
    """A compiled kernel, launched with a grid of three dimensions, the device and the
    arguments only (constexprs last): through the compiled kernel's launcher directly where it
    can be (see :data:`_LAUNCHER_PARAMETERS`), on the current stream of the device at each
    call (so a CUDA graph can capture it), and through its own closure otherwise."""

    __slots__ = ("compiled", "function", "launch", "metadata")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.launch = _direct_launcher(compiled)
        self.function = getattr(compiled, "function", None)
        self.metadata = getattr(compiled, "packed_metadata", None)

    def __call__(self, grid: tuple[int, ...], device: int, *args: Any) -> None:
        if self.launch is None or _launch_hooks():
            self.compiled[grid](*args)
            return
        x, y, z = grid
        stream = _current_stream(device)
        self.launch(x, y, z, stream, self.function, self.metadata, None, None, None, *args)


def _specialized(arg: Any, width_only: bool) -> object:
    """What Triton specializes a kernel on of ``arg`` (a tuple element by element)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if width_only and type(arg) is int:
        return "i32" if -(2**31) <= arg < 2**31 else "i64"
    if width_only and type(arg) is float:
        return "fp32"
    if width_only and type(arg) is tuple:
        return tuple(_specialized(item, True) for item in arg)
    return (type(arg), arg)


class CachedLaunch:
    """Launches one ``@triton.jit`` kernel, reusing the compiled kernel when a call repeats
    what Triton specializes the kernel on.

    Triton specializes on tensors' dtypes and 16-byte alignment, on ``None`` as a constant,
    and on integers' width and on their being 1 or a multiple of 16, except for parameters
    marked ``do_not_specialize`` (width only; a tuple's elements too). The key here holds each
    tensor's dtype and alignment, each number of a ``do_not_specialize`` parameter (or tuple)
    by its type and width, and every other scalar by value, so a repeated key has the same
    compiled kernel, and a length that changes on every call (a growing cache) or a number of a
    ModBias needs no new key when its parameter is marked. A
    launch through the jit function binds and specializes every argument and builds its own
    cache key on each call, several times what the compiled kernel's own launcher takes
    (``benchmarks/NOTES.md``, "Figures behind the code's choices"). Only the first call with a
    new key goes through the jit function (which compiles if needed). The kernel's
    ``tl.constexpr`` parameters must come last and be passed by keyword (checked).
    """

    MAX_KEYS = 1024  # forget them all beyond this many (shapes that never repeat)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        params = kernel.params
        flags = [param.is_constexpr for param in params]
        self.num_args = flags.index(True) if True in flags else len(flags)
        if any(not flag for flag in flags[self.num_args :]):
            raise TypeError(f"{kernel}: constexpr parameters must come last")
        self.constexpr_names = [param.name for param in params[self.num_args :]]
        self.width_only = tuple(
            bool(getattr(param, "do_not_specialize", False)) for param in params[: self.num_args]
        )
        self.compiled: dict[tuple[object, ...], KeptLaunch] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        # a compiled kernel's own launcher reads three grid dimensions
        return functools.partial(self.run, (*grid, 1, 1)[:3])

    def key(self, args: tuple[Any, ...], options: dict[str, Any]) -> tuple[object, ...]:
        """What the compiled kernel for ``args`` and ``options`` depends on."""
        parts: list[object] = [
            current_device(),
            options.get("num_warps"),
            options.get("num_stages"),
        ]
        parts += [options[name] for name in self.constexpr_names]
        for arg, width_only in zip(args, self.width_only, strict=True):
            parts.append(_specialized(arg, width_only))
        return tuple(parts)

    def run(self, grid: tuple[int, ...], *args: Any, **options: Any) -> KeptLaunch | None:
        """Launch on a grid of three dimensions; returns the compiled kernel that ran, kept,
        or ``None`` when the launch handed none back (then nothing is reused)."""
        if len(args) != self.num_args:
            raise TypeError(f"expected {self.num_args} runtime arguments, got {len(args)}")
        key = self.key(args, options)
        kept = self.compiled.get(key)
        if kept is None:
            if len(self.compiled) >= self.MAX_KEYS:
                self.compiled.clear()
            launched = self.kernel[grid](*args, **options)
            if hasattr(launched, "__getitem__"):  # a compiled kernel with its own launcher
                self.compiled[key] = kept = KeptLaunch(launched)
        else:
            constexprs = [options[name] for name in self.constexpr_names]
            kept(grid, current_device(), *args, *constexprs)
        return kept


CACHED_LAUNCHES: dict[Any, CachedLaunch] = {}


def empty_contiguous(t: Tensor) -> Tensor:
    """An uninitialised contiguous tensor of ``t``'s shape, dtype and device.

    ``torch.empty_like`` costs the host ~3 µs less per call than ``torch.empty`` with a
    shape, dtype and device (H100 host); a launch being traced takes ``torch.empty``, the
    form ``torch.compile``'s functional graphs are built from."""
    if _TRACEABLE_LAUNCH.get():
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def empty_rows(t: Tensor) -> Tensor:
    """An uninitialised float32 tensor of ``t``'s shape without its last dimension (one value
    per row: a log-sum-exp), on ``t``'s device; cheap on the host as
    :func:`empty_contiguous` is."""
    if _TRACEABLE_LAUNCH.get():
        return torch.empty(t.shape[:-1], dtype=torch.float32, device=t.device)
    return t.new_empty(t.shape[:-1], dtype=torch.float32)


def current_device() -> int:
    """The current CUDA device: a compiled kernel is loaded into one device's context. Read
    from the runtime directly (``torch.cuda.current_device`` first checks that CUDA is set
    up, ~0.3 µs per launch): a direct launch has CUDA tensors, so it is."""
    return torch._C._cuda_getDevice()


class PreparedLaunch:
    """One kernel launch of a prepared plan: the grid, the constexprs and launch options are
    fixed, and so is every runtime argument but those of the call's own tensors.

    A call passes every runtime argument again (cheap) together with ``call_key``: what
    Triton specializes on among the arguments that may change from call to call. The plan
    that owns this launch builds ``call_key`` from exactly the arguments it does not hold
    itself (the call's tensors' 16-byte alignment, and their strides by value); a call with
    an unseen key goes through :class:`CachedLaunch`, which keys on every argument, and its
    compiled kernel's launcher is kept here for that key. A kept launcher is called with the
    arguments only; it looks up the current stream itself on each call, so launches can be
    captured in a CUDA graph. Whether Triton interprets is read once, when the launch is
    made (``TRITON_INTERPRET`` is set before a process launches anything).
    """

    MAX_KEYS = 64  # forget them all beyond this many (strides that never repeat)

    def __init__(self, kernel: Any, grid: tuple[int, ...], options: dict[str, Any]) -> None:
        self.kernel = kernel
        # a compiled kernel's own launcher takes exactly three grid dimensions
        self.grid = (*grid, *(1,) * (3 - len(grid)))
        self.options = options
        self.runners: dict[Hashable, tuple[KeptLaunch, tuple[Any, ...]]] = {}
        self.interpreted = interpreting()

    def direct(self) -> bool:
        """Whether this launch goes to a compiled kernel directly, neither traced nor
        interpreted: then it needs its ``call_key`` (tensors being traced have no data
        pointer to key on)."""
        return not (self.interpreted or _TRACEABLE_LAUNCH.get())

    def __call__(self, call_key: Hashable | None, *args: Any) -> None:
        """Launch with ``args``; ``call_key`` is ``None`` unless :meth:`direct`."""
        if call_key is None:
            launcher(self.kernel)[self.grid](*args, **self.options)
            return
        key = (current_device(), call_key)
        found = self.runners.get(key)
        if found is not None:
            kept, constexprs = found
            kept(self.grid, key[0], *args, *constexprs)
            return
        cached = launcher(self.kernel)
        kept = cached.run(self.grid, *args, **self.options)
        if kept is not None:
            if len(self.runners) >= self.MAX_KEYS:
                self.runners.clear()
            constexprs = tuple(self.options[name] for name in cached.constexpr_names)
            self.runners[key] = (kept, constexprs)

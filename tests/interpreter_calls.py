"""Triton's interpreter (``TRITON_INTERPRET=1``, how the CPU tests run the kernels) patches
``triton.language`` when a kernel launches and restores it when the launch ends; it also
patches it again at every call of a ``@triton.jit`` helper inside the launch, which scans the
language's modules (``inspect.getmembers``) and finds their members already patched: a
quarter of an interpreted test's time, for nothing. :func:`skip_repatching` makes a helper's
call inside a launch skip that scan where the launch patched the modules the helper sees
(``triton.language`` and ``triton.language.core`` are shared by every module, so it always
has), and leaves everything else to the interpreter; where the interpreter's internals are
not the ones this was written against, it changes nothing.
"""

from __future__ import annotations

import inspect
from typing import Any


def skip_repatching() -> bool:
    """Wrap the interpreter's ``_patch_lang``; whether it was wrapped (now or before)."""
    import triton.language as tl

    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch is None or not isinstance(executor, type):
        return False
    if getattr(patch, "skips_repatching", False):
        return True
    launches = [0]
    patched: list[frozenset[int] | None] = [None]  # the launch's patched language modules

    class _Nothing:
        def restore(self) -> None:
            pass

    known: dict[Any, frozenset[int]] = {}

    def langs(fn: Any) -> frozenset[int]:
        found = known.get(fn)
        if found is None:
            modules = getattr(fn, "__globals__", {}).values()
            found = frozenset(id(m) for m in modules if inspect.ismodule(m) and m in (tl, tl.core))
            known[fn] = found
        return found

    def _patch_lang(fn: Any) -> Any:
        seen = langs(fn)
        if patched[0] is not None and seen <= patched[0]:
            return _Nothing()  # a helper inside a launch: those modules are patched
        scope = patch(fn)
        if launches[0]:  # the launch's own patch (first) or a helper's (never restored)
            patched[0] = seen if patched[0] is None else patched[0] | seen
        return scope

    _patch_lang.skips_repatching = True  # type: ignore[attr-defined]
    launch = executor.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches[0] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches[0] -= 1
            if not launches[0]:
                patched[0] = None

    interpreter._patch_lang = _patch_lang
    executor.__call__ = __call__
    return True

"""Tracing functions into the graph (:func:`trace_mods`), and comparing two traces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from attnbias.kernels.modgraph import INDEX_NAMES, TracedFunction, TracedMods, node_inputs
from attnbias.mods.symbols import SUPPORTED, ModTraceError, Sym, _cast, _Tracer, _way_out

__all__ = ["same_graph", "trace_mods"]


def _function_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return str(name)


def trace_mods(
    masks: Sequence[Callable[..., Any]],
    scores: Sequence[Callable[..., Any]],
    *,
    bind: Callable[[Callable[[Any], tuple[Sym, int]]], tuple[Sequence[Any], Sequence[Any]]]
    | None = None,
) -> TracedMods:
    """Trace mask functions ``f(b, h, q_idx, kv_idx) -> bool`` and score functions
    ``f(score, b, h, q_idx, kv_idx) -> score`` into one graph. Raises :class:`ModTraceError`
    naming the function and the operator it cannot compile.

    ``bind``, where given, makes the functions to trace instead of ``masks`` and ``scores``:
    it receives ``slot_of(number) -> (value, slot)``, which makes a runtime number of the
    trace (a traced value) and says which of :attr:`TracedMods.consts` holds it."""
    tracer = _Tracer("?")
    inputs = {name: tracer.add("input", (name,), "int").node for name in INDEX_NAMES}
    inputs["score"] = tracer.add("input", ("score",), "float").node
    if bind is not None:

        def slot_of(value: Any) -> tuple[Sym, int]:
            sym = tracer.const(value)
            return sym, len(tracer.consts) - 1

        masks, scores = bind(slot_of)
    index_syms = [Sym(tracer, inputs[name]) for name in INDEX_NAMES]
    traced_masks, traced_scores = [], []
    score: Sym = Sym(tracer, inputs["score"])
    for fn in masks:
        tracer.name = f"mask_mod {_function_name(fn)}"
        result = tracer.lift(_call(tracer, fn, index_syms))
        if result.kind != "bool":
            raise ModTraceError(
                f"{tracer.name} returns {'an' if result.kind == 'int' else 'a'} {result.kind} "
                f"value, not a bool: a mask function "
                f"keeps a pair where it returns True (a comparison, e.g. kv_idx <= q_idx); "
                f"write (...) != 0 to keep the pairs where the value is not zero"
            )
        traced_masks.append(_traced(tracer, result.node, inputs))
    for fn in scores:
        tracer.name = f"score_mod {_function_name(fn)}"
        result = tracer.lift(_call(tracer, fn, [score, *index_syms]))
        if result.kind != "float":
            result = _cast(result, torch.float32)
        traced_scores.append(_traced(tracer, result.node, inputs))
        score = result
    return TracedMods(
        tracer.nodes, traced_masks, traced_scores, tracer.params, tracer.consts, inputs
    )


def same_graph(a: TracedMods, b: TracedMods) -> bool:
    """Whether two traces compute the same: from each function's result down, the same
    operations on the same inputs, tensors (by identity) and numbers (by type and value),
    wherever their slots are."""
    table: dict[Any, int] = {}

    def forms(traced: TracedMods) -> list[int]:
        out: list[int] = []
        for node in traced.nodes:
            form: tuple[Any, ...]
            if node.op == "const":
                value = traced.consts[node.args[0]]
                form = ("=", type(value), value.hex() if isinstance(value, float) else value)
            elif node.op == "load":
                form = ("load", id(traced.params[node.args[0]]), *(out[i] for i in node.args[1:]))
            elif node.op == "cast":
                form = ("cast", out[node.args[0]], *node.args[1:])
            elif node.op in ("input", "bool"):
                form = (node.op, *node.args)
            else:
                form = (node.op, *(out[i] for i in node.args))
            out.append(table.setdefault((node.kind, form), len(table)))
        return out

    ours, theirs = forms(a), forms(b)
    return [ours[f.result] for f in a.masks] == [theirs[f.result] for f in b.masks] and [
        ours[f.result] for f in a.scores
    ] == [theirs[f.result] for f in b.scores]


def _call(tracer: _Tracer, fn: Callable[..., Any], args: list[Sym]) -> Any:
    """``fn(*args)``. An exception the function raised itself (its last frame is neither
    this module nor torch's) surfaces as itself, with a note naming the function; one raised
    by an operation on a traced value becomes a :class:`ModTraceError` naming the function
    and what the kernels compile."""
    try:
        return fn(*args)
    except ModTraceError:
        raise
    except Exception as exc:
        if _raised_by_user(exc):
            if hasattr(exc, "add_note"):  # Python 3.11 and later
                exc.add_note(f"(raised by {tracer.name} while attnbias traced it)")
            raise
        if not isinstance(exc, (TypeError, RuntimeError, IndexError, ValueError, AttributeError)):
            raise
        raise ModTraceError(
            f"{tracer.name} failed while being traced ({type(exc).__name__}: {exc}); it may use "
            f"an operator outside what the kernels compile ({SUPPORTED}); "
            f"{_way_out(tracer.name)}"
        ) from exc


_OURS = (__file__, str(Path(torch.__file__).parent))


def _raised_by_user(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc`` is outside this module and torch (a ``raise``
    in the user's own function), and the error is not about a traced value (a method a
    traced value lacks fails in the function's own frame)."""
    tb = exc.__traceback__
    if tb is None or isinstance(getattr(exc, "obj", None), Sym) or "'Sym'" in str(exc):
        return False  # an operation on a traced value: not the function's own error
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = tb.tb_frame.f_code.co_filename
    return not (filename == _OURS[0] or filename.startswith(_OURS[1]))


def _traced(tracer: _Tracer, result: int, inputs: dict[str, int]) -> TracedFunction:
    reads = set()
    stack, seen = [result], set()
    index_ids = {inputs[name]: name for name in INDEX_NAMES}
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current in index_ids:
            reads.add(index_ids[current])
        stack.extend(node_inputs(tracer.nodes[current]))
    return TracedFunction(tracer.name, result, frozenset(reads))

"""FlashAttention 4's form of a traced ModBias graph: CuTe DSL source for its ``mask_mod`` /
``score_mod`` / ``score_mod_bwd`` callbacks (:func:`generate`), what that source writes
(the operations, and those whose derivative it writes exactly), and the slots of its runtime
numbers. Compiling the source, the reasons a graph has no form here and the tensors handed over
are in :mod:`attnbias.backends.fa4_mods`, which describes the callbacks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from attnbias.kernels.modgraph import INDEX_NAMES, Node, TracedMods, node_inputs

__all__ = [
    "DIFFERENTIABLE", "WRITTEN", "Options", "backward_problems", "generate",
    "score_path",
]  # fmt: skip


_LOG2E = 1.4426950408889634
# The operations the source writes, by node op; anything else is refused with its name.
_BINARY = {"add": "+", "sub": "-", "mul": "*"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_LOGIC = {"and": "&", "or": "|", "xor": "^"}
_UNARY_FLOAT = ("exp", "log", "tanh", "sqrt", "sigmoid")
WRITTEN = frozenset(
    {
        "input", "const", "bool", "load", "cast", "truediv", "floordiv", "mod", "neg", "abs",
        "not", "invert", "minimum", "maximum", "where", *_BINARY, *_COMPARE, *_LOGIC,
        *_UNARY_FLOAT,
    }
)  # fmt: skip
# The operations of the score's path whose derivative the backward writes (on ties of minimum,
# maximum and abs, and at the steps of // and %, the derivative has no one value).
DIFFERENTIABLE = frozenset(
    {"input", "cast", "add", "sub", "mul", "truediv", "neg", "where", *_UNARY_FLOAT}
)

_CUTE_TYPE = {"bool": "cutlass.Boolean", "int": "cutlass.Int32", "float": "cutlass.Float32"}


@dataclass(frozen=True)
class Options:
    """What the callbacks hold besides the graph: the band's sides folded into the mask
    (FlashAttention 4 takes no window with a ``mask_mod``), the soft-cap before the score
    functions, and whether numbers are runtime ``aux_scalars``."""

    band_lo: bool = False
    band_hi: bool = False
    softcap: bool = False
    scalars: bool = True


def score_path(traced: TracedMods) -> set[int]:
    """The nodes computed from the score (the score input included)."""
    score = traced.inputs["score"]
    found = {score}
    for node_id, node in enumerate(traced.nodes):
        if any(arg in found for arg in node_inputs(node)):
            found.add(node_id)
    return found


class _Scalars:
    """Slots of the runtime numbers, in the order :func:`aux_scalars` gives them."""

    def __init__(self, traced: TracedMods, options: Options) -> None:
        self.count = len(traced.consts)
        self.band: dict[str, int] = {}
        for side, present in (("lo", options.band_lo), ("hi", options.band_hi)):
            if present:
                self.band[side] = self.count
                self.count += 1
        self.softcap = -1
        if options.softcap:
            self.softcap = self.count
            self.count += 2  # cap, 1 / cap
        self.params: list[int] = []
        for param in traced.params:
            self.params.append(self.count)
            self.count += 2 * param.dim()  # per dimension: its last index, its stride


def _literal(value: int | float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    return repr(value)


class _Emitter:
    """Writes a callback's statements: each node once, as a local variable."""

    def __init__(
        self,
        traced: TracedMods,
        slots: _Scalars,
        values: Sequence[int | float] | None,
        inputs: Mapping[str, str],
    ) -> None:
        self.traced = traced
        self.slots = slots
        self.values = values  # numbers written as literals, or None: aux_scalars
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.prelude: dict[str, str] = {}
        for name, var in inputs.items():
            self.names[traced.inputs[name]] = var
        self.tangents: dict[int, str | None] = {}
        self.count = 0
        self.converted: dict[tuple[str, str], str] = {}
        self.divided: dict[tuple[str, str], tuple[str, str, str]] = {}

    # -- helpers ----------------------------------------------------------------------------

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def emit(self, stem: str, expr: str) -> str:
        var = self.fresh(stem)
        self.lines.append(f"{var} = {expr}")
        return var

    def ref(self, name: str) -> str:
        """A value every callback may need, written once at its top."""
        exprs = {
            "_zi": "cute.full_like(q_idx, 0)",
            "_oi": "cute.full_like(q_idx, 1)",
            "_f": "q_idx.to(cutlass.Float32)",
            "_zf": "cute.full_like(_f, 0.0)",
            "_of": "cute.full_like(_f, 1.0)",
            "_true": "q_idx == q_idx",
            "_false": "q_idx != q_idx",
        }
        if name in ("_zf", "_of"):
            self.ref("_f")
        self.prelude.setdefault(name, exprs[name])
        return name

    def scalar(self, slot: int, kind: str) -> str:
        """Runtime number ``slot`` as a TensorSSA of ``kind`` ("int" or "float")."""
        if self.values is None:
            number = f"{_CUTE_TYPE[kind]}(aux_scalars[{slot}])"
        else:
            value = self.values[slot]
            number = _literal(int(value) if kind == "int" else float(value))
        template = "q_idx" if kind == "int" else self.ref("_f")
        return self.emit("c", f"cute.full_like({template}, {number})")

    def convert(self, var: str, source: str, target: str) -> str:
        """``var`` of kind ``source`` as kind ``target``."""
        if source == target:
            return var
        found = self.converted.get((var, target))
        if found is None:
            found = self.converted[var, target] = self._convert(var, source, target)
        return found

    def _convert(self, var: str, source: str, target: str) -> str:
        if target == "bool":
            zero = self.ref("_zf") if source == "float" else self.ref("_zi")
            return self.emit("v", f"{var} != {zero}")
        if source == "bool":
            var = self.emit("v", f"cute.where({var}, {self.ref('_oi')}, {self.ref('_zi')})")
            source = "int"
        if target == "float":
            return self.emit("v", f"{var}.to(cutlass.Float32)")
        return self.emit("v", f"{var}.to(cutlass.Int32)")  # float to int: truncates

    def operand(self, node_id: int, kind: str) -> str:
        return self.convert(self.value(node_id), self.traced.nodes[node_id].kind, kind)

    # -- values -----------------------------------------------------------------------------

    def value(self, node_id: int) -> str:
        found = self.names.get(node_id)
        if found is None:
            node = self.traced.nodes[node_id]
            found = self.names[node_id] = self._node(node)
        return found

    def _node(self, node: Node) -> str:
        op, args, kind = node.op, node.args, node.kind
        if op == "const":
            value = self.traced.consts[args[0]]
            return self.scalar(args[0], "int" if isinstance(value, int) else "float")
        if op == "bool":
            return self.ref("_true") if args[0] else self.ref("_false")
        if op == "load":
            return self._load(node)
        if op == "cast":
            target = args[1]
            return self.operand(args[0], target)
        if op in _BINARY:
            a, b = (self.operand(arg, kind) for arg in args)
            return self.emit("v", f"{a} {_BINARY[op]} {b}")
        if op == "truediv":
            a, b = (self.operand(arg, "float") for arg in args)
            return self.emit("v", f"{a} / {b}")
        if op in ("floordiv", "mod"):
            return self._floor_division(op, *args)
        if op in _COMPARE:
            kinds = [self.traced.nodes[arg].kind for arg in args]
            common = "float" if "float" in kinds else "int"
            a, b = (self.operand(arg, common) for arg in args)
            return self.emit("v", f"{a} {_COMPARE[op]} {b}")
        if op in _LOGIC:
            a, b = (self.operand(arg, kind) for arg in args)
            return self.emit("v", f"{a} {_LOGIC[op]} {b}")
        if op == "neg":
            a = self.operand(args[0], kind)
            zero = self.ref("_zf") if kind == "float" else self.ref("_zi")
            return self.emit("v", f"{zero} - {a}")
        if op == "abs":
            a = self.operand(args[0], kind)
            absolute = "absf" if kind == "float" else "absi"
            wrapped = f"mlir_math.{absolute}({a})"
            return self.emit("v", f"cute.TensorSSA({wrapped}, {a}.shape, {a}.dtype)")
        if op == "not":
            a = self.operand(args[0], "bool")
            return self.emit("v", f"{a} == {self.ref('_false')}")
        if op == "invert":  # ~a == -a - 1 in two's complement
            a = self.operand(args[0], "int")
            return self.emit("v", f"{self.ref('_zi')} - {a} - {self.ref('_oi')}")
        if op in ("minimum", "maximum"):
            a, b = (self.operand(arg, kind) for arg in args)
            compare = "<" if op == "minimum" else ">"
            return self.emit("v", f"cute.where({a} {compare} {b}, {a}, {b})")
        if op == "where":
            condition = self.operand(args[0], "bool")
            a, b = (self.operand(arg, kind) for arg in args[1:])
            return self.emit("v", f"cute.where({condition}, {a}, {b})")
        x = self.operand(args[0], "float")
        if op == "exp":
            return self.emit("v", f"cute.math.exp2({x} * {_LOG2E!r})")
        if op == "log":
            return self.emit("v", f"cute.math.log({x})")
        if op == "tanh":
            return self.emit("v", f"cute.math.tanh({x})")
        if op == "sqrt":
            return self.emit("v", f"cute.math.sqrt({x})")
        if op == "sigmoid":
            exp = self.emit("v", f"cute.math.exp2(({self.ref('_zf')} - {x}) * {_LOG2E!r})")
            return self.emit("v", f"{self.ref('_of')} / ({self.ref('_of')} + {exp})")
        raise AssertionError(f"no source for {op}")  # reasons() refuses it first

    def _floor_division(self, op: str, a_id: int, b_id: int) -> str:
        """Python's floor division and remainder of integers, whatever the sign convention of
        the DSL's ``//`` (floor or truncation): the quotient steps down by one where the
        remainder is nonzero and of the other sign than the divisor."""
        a, b = self.operand(a_id, "int"), self.operand(b_id, "int")
        zero, one = self.ref("_zi"), self.ref("_oi")
        found = self.divided.get((a, b))
        if found is None:
            quotient = self.emit("v", f"{a} // {b}")
            remainder = self.emit("v", f"{a} - {quotient} * {b}")
            off = self.emit(
                "v", f"({remainder} != {zero}) & (({remainder} < {zero}) ^ ({b} < {zero}))"
            )
            found = self.divided[a, b] = (quotient, remainder, off)
        quotient, remainder, off = found
        if op == "floordiv":
            return self.emit("v", f"{quotient} - cute.where({off}, {one}, {zero})")
        return self.emit("v", f"{remainder} + cute.where({off}, {b}, {zero})")

    def _load(self, node: Node) -> str:
        """One element of a flattened tensor parameter per pair (the callbacks see one pair at a
        time where they read tensors: FlashAttention 4's vector size is 1 with aux tensors).
        A negative index counts from the end where one may be negative
        (:meth:`~attnbias.kernels.modgraph.TracedMods.wrapped_reads`); the clamp after it only
        guards the memory (the host proved every read at a valid position in range)."""
        slot, *indices = node.args
        base = self.slots.params[slot]
        zero = self.ref("_zi")
        wraps = self.traced.wrapped_reads()
        node_id = self.traced.id_of(node)
        offset = None
        for dim, index in enumerate(indices):
            position = self.operand(index, "int")
            last = self.scalar(base + 2 * dim, "int")
            if (node_id, dim) in wraps:
                size = self.emit("v", f"{last} + {self.ref('_oi')}")
                position = self.emit(
                    "v", f"cute.where({position} < {zero}, {position} + {size}, {position})"
                )
            clamped = self.emit(
                "v",
                f"cute.where({position} < {zero}, {zero}, "
                f"cute.where({position} > {last}, {last}, {position}))",
            )
            stride = self.scalar(base + 2 * dim + 1, "int")
            term = self.emit("v", f"{clamped} * {stride}")
            offset = term if offset is None else self.emit("v", f"{offset} + {term}")
        if offset is None:
            offset = zero  # a 0-d tensor: its one element
        element = "Float32" if node.kind == "float" else "Int32"
        where = self.fresh("r")
        read = self.fresh("x")
        self.lines += [
            f"{where} = cute.make_rmem_tensor(1, cutlass.Int32)",
            f"{where}.store({offset})",
            f"{read} = cute.make_rmem_tensor(1, cutlass.{element})",
            f"{read}[0] = aux_tensors[{slot}][{where}[0]]",
        ]
        loaded = self.emit("v", f"{read}.load()")
        if node.kind == "bool":
            return self.emit("v", f"{loaded} != {zero}")
        return loaded

    # -- the derivative in the score (forward mode) ------------------------------------------

    def tangent(self, node_id: int, path: set[int]) -> str | None:
        """``d node / d score`` (``None``: zero) as a variable, for nodes of the score's path."""
        if node_id in self.tangents:
            return self.tangents[node_id]
        node = self.traced.nodes[node_id]
        result: str | None
        if node_id not in path or node.kind != "float":
            result = None
        else:
            result = self._tangent(node_id, node, path)
        self.tangents[node_id] = result
        return result

    def _tangent(self, node_id: int, node: Node, path: set[int]) -> str | None:
        op, args = node.op, node.args
        if op == "cast":
            return self.tangent(args[0], path)
        t = [self.tangent(a, path) for a in node_inputs(node)]
        if op in ("add", "sub"):
            if t[1] is None:
                return t[0]
            if t[0] is None:
                return t[1] if op == "add" else self.emit("t", f"{self.ref('_zf')} - {t[1]}")
            return self.emit("t", f"{t[0]} {_BINARY[op]} {t[1]}")
        if op == "mul":
            a, b = (self.operand(arg, "float") for arg in args)
            terms = [f"{t[0]} * {b}" if t[0] else None, f"{a} * {t[1]}" if t[1] else None]
            present = [term for term in terms if term is not None]
            return self.emit("t", " + ".join(present)) if present else None
        if op == "truediv":
            a, b = (self.operand(arg, "float") for arg in args)
            first = f"{t[0]} / {b}" if t[0] else None
            second = f"{t[1]} * {a} / ({b} * {b})" if t[1] else None
            if second is None:
                return self.emit("t", first) if first else None
            if first is None:
                return self.emit("t", f"{self.ref('_zf')} - {second}")
            return self.emit("t", f"{first} - {second}")
        if op == "neg":
            return None if t[0] is None else self.emit("t", f"{self.ref('_zf')} - {t[0]}")
        if op == "where":
            if t[1] is None and t[2] is None:
                return None
            condition = self.operand(args[0], "bool")
            first = t[1] or self.ref("_zf")
            second = t[2] or self.ref("_zf")
            return self.emit("t", f"cute.where({condition}, {first}, {second})")
        if t[0] is None:
            return None
        value, x = self.value(node_id), self.operand(args[0], "float")
        factor = {
            "exp": value,
            "log": f"({self.ref('_of')} / {x})",
            "tanh": f"({self.ref('_of')} - {value} * {value})",
            "sqrt": f"({self.ref('_of')} / ({value} + {value}))",
            "sigmoid": f"({value} * ({self.ref('_of')} - {value}))",
        }[op]
        return self.emit("t", f"{t[0]} * {factor}")

    def function(self, header: str, result: str) -> str:
        body = [f"{name} = {expr}" for name, expr in self.prelude.items()]
        body += [*self.lines, f"return {result}"]
        return "\n".join(["@cute.jit", header, *(f"    {line}" for line in body)])


def generate(traced: TracedMods, options: Options, values: Sequence[int | float] | None) -> str:
    """The Python source of the callbacks of ``traced`` with ``options``: ``mask_mod`` (when the
    graph has mask functions), ``score_mod`` and ``score_mod_bwd`` (when it has score functions
    or the options a soft-cap; ``score_mod_bwd`` where :func:`backward_problems` finds none).
    ``values``: the numbers to write as literals (``None``: they are read from
    ``aux_scalars``, in :func:`aux_scalars`'s order). The source expects ``cute``, ``cutlass``
    and ``mlir_math`` in its namespace."""
    slots = _Scalars(traced, options)
    parts = [
        f"# attnbias: FlashAttention 4 callbacks of a traced ModBias graph ({len(traced.nodes)} "
        f"nodes; numbers {'as literals' if values is not None else 'from aux_scalars'})"
    ]
    indices = ", ".join(f"{n}_idx" if n in ("b", "h") else n for n in INDEX_NAMES)
    tail = "seqlen_info, aux_tensors, aux_scalars=None"
    inputs = dict(zip(INDEX_NAMES, ("b_idx", "h_idx", "q_idx", "kv_idx"), strict=True))

    if traced.masks or options.band_lo or options.band_hi:
        emitter = _Emitter(traced, slots, values, inputs)
        results = [emitter.operand(f.result, "bool") for f in traced.masks]
        if options.band_lo or options.band_hi:
            diagonal = emitter.emit("v", "kv_idx - q_idx")
            if options.band_lo:
                low = emitter.scalar(slots.band["lo"], "int")
                results.append(emitter.emit("v", f"{diagonal} >= {low}"))
            if options.band_hi:
                high = emitter.scalar(slots.band["hi"], "int")
                results.append(emitter.emit("v", f"{diagonal} <= {high}"))
        keep = results[0]
        for other in results[1:]:
            keep = emitter.emit("v", f"{keep} & {other}")
        parts.append(emitter.function(f"def mask_mod({indices}, {tail}):", keep))

    additive = traced.additive_score() and not options.softcap
    # no score_mod_bwd where a derivative is not written (calls without gradients only)
    writable = not backward_problems(traced)
    if traced.scores or options.softcap:
        for backward in (False, True) if writable else (False,):
            emitter = _Emitter(traced, slots, values, {**inputs, "score": "score"})
            score_input = traced.inputs["score"]
            if options.softcap:
                cap = emitter.scalar(slots.softcap, "float")
                inverse = emitter.scalar(slots.softcap + 1, "float")
                capped = emitter.emit("v", f"cute.math.tanh(score * {inverse}, fastmath=True)")
                emitter.names[score_input] = emitter.emit("v", f"{capped} * {cap}")
                # d (cap * tanh(s / cap)) / ds
                emitter.tangents[score_input] = emitter.emit(
                    "t", f"{emitter.ref('_of')} - {capped} * {capped}"
                )
            elif backward and not additive:
                emitter.tangents[score_input] = emitter.ref("_of")
            result = traced.scores[-1].result if traced.scores else score_input
            if not backward:
                value = emitter.operand(result, "float")
                parts.append(emitter.function(f"def score_mod(score, {indices}, {tail}):", value))
                continue
            if additive:
                gradient = "grad"
            else:
                path = score_path(traced)
                tangent = emitter.tangent(result, path)
                gradient = "grad * " + (tangent or emitter.ref("_zf"))
                gradient = emitter.emit("g", gradient)
            parts.append(
                emitter.function(f"def score_mod_bwd(grad, score, {indices}, {tail}):", gradient)
            )
    return "\n\n\n".join(parts) + "\n"


def backward_problems(traced: TracedMods) -> list[str]:
    """Why ``score_mod_bwd`` cannot be written exactly (empty: it can): an operation of the
    score's path whose derivative it does not write."""
    if not traced.scores or traced.additive_score():
        return []
    path = score_path(traced) & traced.ancestors(traced.scores[-1].result)
    return [
        f"the derivative of {op} of the score (the backward callback is written for + - * /, "
        f"casts, where, exp, log, tanh, sqrt and sigmoid)"
        for op in dict.fromkeys(
            traced.nodes[i].op
            for i in sorted(path)
            if traced.nodes[i].kind == "float" and traced.nodes[i].op not in DIFFERENTIABLE
        )
    ]

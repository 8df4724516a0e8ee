"""Tile classification by intervals, generated as Triton code: whether the masks may keep, or
may drop, any pair of a tile (the block lists' and the kernels' ``TILE_FN``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .modgraph import Node, TracedMods, node_inputs

__all__ = ["TileEmitter", "function_source", "tile_function"]


# -- tile classification by intervals: whether the masks may keep, or may drop, any pair of a
# block of queries and keys, from bounds on every value over the block ---------------------------

#: Bounds past this magnitude make a value unknown (no sum of two known values overflows).
_TILE_LIMIT = 2**40
#: Factors of a product whose bounds stay within this magnitude (the product fits 64 bits).
_TILE_FACTOR = 2**31
#: Relative and absolute widening of a float bound after an operation that rounds: room for
#: the kernels' fused multiply-adds and approximate exp, log and tanh (a few ulp) against the
#: bound computed here, so that a bound never cuts off a value the kernel computes.
_FLOAT_SLACK = 2.0**-16
_FLOAT_TINY = 1e-30
#: The float operations with bounds (the rest are unknown).
_FLOAT_TILE_OPS = frozenset(
    ("neg", "abs", "exp", "tanh", "sigmoid", "log", "sqrt", "minimum", "maximum", "add", "sub",
     "mul", "truediv")
)  # fmt: skip


class TileEmitter:
    """Writes ``tile_fn``: interval arithmetic over the masks' graph for one block of pairs
    (scalar bounds of each integer: ``lo``, ``hi``, and ``unknown``; of each bool: whether it
    may be true, whether it may be false). A table read whose every index is one value over
    the block (``lens[b]``, ``slopes[h]``, ``starts[b, 0]``) is that element, loaded; other
    reads, floats past the bounded operations and bitwise integer operators are unknown: only
    their users' verdicts widen, so the answer stays sound."""

    def __init__(self, traced: TracedMods, prefix: str = "") -> None:
        self.traced = traced
        self.lines: list[str] = []
        self.done: dict[int, tuple[str, ...]] = {}
        self.input_names = {node: name for name, node in traced.inputs.items()}
        self.prefix = prefix  # of the variables written, beside the caller's

    def bounds(self, node_id: int) -> tuple[str, ...]:
        """``("int", lo, hi, unknown)``, ``("bool", may_true, may_false)`` or
        ``("float", lo, hi, unknown)``."""
        found = self.done.get(node_id)
        if found is None:
            node = self.traced.nodes[node_id]
            for arg in node_inputs(node):
                self.bounds(arg)
            found = self.done[node_id] = self._node(node_id, node)
        return found

    def as_int(self, node_id: int) -> tuple[str, str, str]:
        found = self.bounds(node_id)
        if found[0] == "int":
            return found[1], found[2], found[3]
        if found[0] == "bool":
            low = f"tl.where({found[2]}, 0, 1).to(tl.int64)"
            return low, f"tl.where({found[1]}, 1, 0).to(tl.int64)", "NO"
        return "ZERO", "ZERO", "YES"

    def as_float(self, node_id: int) -> tuple[str, str, str]:
        found = self.bounds(node_id)
        if found[0] == "float":
            return found[1], found[2], found[3]
        if found[0] == "int":
            return f"{found[1]}.to(tl.float32)", f"{found[2]}.to(tl.float32)", found[3]
        return f"tl.where({found[2]}, 0.0, 1.0)", f"tl.where({found[1]}, 1.0, 0.0)", "NO"

    def _choice(
        self, args: tuple[Any, ...], bound: Callable[[int], tuple[str, str, str]]
    ) -> tuple[str, str, str]:
        """``(lo, hi, unknown)`` of ``where(c, x, y)``: the branch the condition settles, or
        both (``bound`` gives a branch's bounds as integers or floats)."""
        c = self.bounds(args[0])
        lx, hx, ux = bound(args[1])
        ly, hy, uy = bound(args[2])
        t, f = (c[1], c[2]) if c[0] == "bool" else ("YES", "YES")
        return (
            f"tl.where({t} & {f}, tl.minimum({lx}, {ly}), tl.where({t}, {lx}, {ly}))",
            f"tl.where({t} & {f}, tl.maximum({hx}, {hy}), tl.where({t}, {hx}, {hy}))",
            f"({t} & {ux}) | ({f} & {uy})",
        )

    def _int(self, i: int, lo: str, hi: str, unknown: str) -> tuple[str, ...]:
        p = self.prefix
        self.lines += [f"{p}l{i} = {lo}", f"{p}h{i} = {hi}"]
        self.lines.append(
            f"{p}u{i} = {unknown} | ({p}l{i} < -{_TILE_LIMIT}) | ({p}h{i} > {_TILE_LIMIT})"
        )
        return ("int", f"{p}l{i}", f"{p}h{i}", f"{p}u{i}")

    def _bool(self, i: int, may_true: str, may_false: str) -> tuple[str, ...]:
        p = self.prefix
        self.lines += [f"{p}t{i} = {may_true}", f"{p}f{i} = {may_false}"]
        return ("bool", f"{p}t{i}", f"{p}f{i}")

    def _float(self, i: int, lo: str, hi: str, unknown: str, rounded: bool) -> tuple[str, ...]:
        """Bounds of a float; ``rounded``: widened by :data:`_FLOAT_SLACK` for the rounding
        of an operation the kernels may evaluate otherwise (fused, approximate)."""
        p = self.prefix
        if rounded:
            self.lines += [f"{p}a{i} = {lo}", f"{p}b{i} = {hi}"]
            lo = f"{p}a{i} - tl.abs({p}a{i}) * {_FLOAT_SLACK} - {_FLOAT_TINY}"
            hi = f"{p}b{i} + tl.abs({p}b{i}) * {_FLOAT_SLACK} + {_FLOAT_TINY}"
        self.lines += [f"{p}l{i} = {lo}", f"{p}h{i} = {hi}"]
        self.lines.append(f"{p}u{i} = {unknown} | ({p}l{i} != {p}l{i}) | ({p}h{i} != {p}h{i})")
        return ("float", f"{p}l{i}", f"{p}h{i}", f"{p}u{i}")

    def _node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args, kind = node.op, node.args, node.kind
        if op == "input":
            name = self.input_names[i]
            if name == "score":
                return self._float(i, "FZERO", "FZERO", "YES", False)
            low, high = {"b": ("b", "b"), "h": ("h", "h"), "q_idx": ("q_lo", "q_hi"),
                         "kv_idx": ("kv_lo", "kv_hi")}[name]  # fmt: skip
            return self._int(i, f"{low}.to(tl.int64)", f"{high}.to(tl.int64)", "NO")
        if kind == "float":
            return self._float_node(i, node)
        if op == "bool":
            return self._bool(i, "YES" if args[0] else "NO", "NO" if args[0] else "YES")
        if op == "const":
            value = f"tl.cast(MOD[{args[0]}], tl.int64)"
            return self._int(i, value, value, "NO")
        if op == "load":
            return self._load(i, node)
        if op in ("and", "or", "xor") and kind == "int":
            return self._int(i, "ZERO", "ZERO", "YES")
        if kind == "bool":
            return self._bool_node(i, node)
        return self._int_node(i, node)

    def _load(self, i: int, node: Node) -> tuple[str, ...]:
        """A read of a parameter: exactly its element where every index is one value over the
        block, within the tensor (a negative index, which counts from the end, is left
        unknown); unknown otherwise. The element read is clamped into the tensor, so that a
        read left unknown loads some element of it and no other memory."""
        p = self.prefix
        slot, sizes, strides = self.traced.read_args(node)
        exact, offset = "YES", "ZERO"
        for dim, index in enumerate(node.args[1:]):
            lo, hi, unknown = self.as_int(index)
            size, stride = f"MOD[{sizes[dim]}]", f"MOD[{strides[dim]}]"
            exact = f"{exact} & ~({unknown}) & ({lo} == {hi}) & ({lo} >= 0) & ({lo} < {size})"
            offset = f"{offset} + tl.minimum(tl.maximum({lo}, 0), {size} - 1) * {stride}"
        self.lines += [f"{p}x{i} = {exact}", f"{p}r{i} = tl.load(MOD[{slot}] + {offset})"]
        read, loose = f"{p}r{i}", f"~{p}x{i}"
        if node.kind == "bool":
            return self._bool(i, f"({read} != 0) | {loose}", f"({read} == 0) | {loose}")
        if node.kind == "float":
            value = f"{read}.to(tl.float32)"
            return self._float(i, value, value, loose, False)
        value = f"{read}.to(tl.int64)"
        return self._int(i, value, value, loose)

    def _bool_node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args = node.op, node.args
        if op in ("and", "or", "xor", "not", "invert") and all(
            self.bounds(a)[0] == "bool" for a in args
        ):
            a = self.bounds(args[0])
            if op in ("not", "invert"):
                return self._bool(i, a[2], a[1])
            b = self.bounds(args[1])
            if op == "and":
                return self._bool(i, f"{a[1]} & {b[1]}", f"{a[2]} | {b[2]}")
            if op == "or":
                return self._bool(i, f"{a[1]} | {b[1]}", f"{a[2]} & {b[2]}")
            true = f"({a[1]} & {b[2]}) | ({a[2]} & {b[1]})"
            return self._bool(i, true, f"({a[1]} & {b[1]}) | ({a[2]} & {b[2]})")
        if op == "not":  # of an integer: true where it is 0
            la, ha, ua = self.as_int(args[0])
            return self._bool(
                i, f"(({la} <= 0) & ({ha} >= 0)) | {ua}", f"~(({la} == 0) & ({ha} == 0)) | {ua}"
            )
        if op == "where":
            c = self.bounds(args[0])
            x, y = self.bounds(args[1]), self.bounds(args[2])
            if c[0] != "bool" or x[0] != "bool" or y[0] != "bool":
                return self._bool(i, "YES", "YES")
            true = f"({c[1]} & {x[1]}) | ({c[2]} & {y[1]})"
            return self._bool(i, true, f"({c[1]} & {x[2]}) | ({c[2]} & {y[2]})")
        if op == "cast":
            la, ha, ua = self.as_int(args[0])
            return self._bool(
                i, f"~(({la} == 0) & ({ha} == 0)) | {ua}", f"(({la} <= 0) & ({ha} >= 0)) | {ua}"
            )
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            if any(self.bounds(a)[0] == "float" for a in args):
                la, ha, ua = self.as_float(args[0])
                lb, hb, ub = self.as_float(args[1])
            else:
                la, ha, ua = self.as_int(args[0])
                lb, hb, ub = self.as_int(args[1])
            unknown = f"{ua} | {ub}"
            true, false = {
                "lt": (f"{la} < {hb}", f"{ha} >= {lb}"),
                "le": (f"{la} <= {hb}", f"{ha} > {lb}"),
                "gt": (f"{ha} > {lb}", f"{la} <= {hb}"),
                "ge": (f"{ha} >= {lb}", f"{la} < {hb}"),
                "eq": (
                    f"({la} <= {hb}) & ({lb} <= {ha})",
                    f"~(({la} == {ha}) & ({lb} == {hb}) & ({la} == {lb}))",
                ),
                "ne": (
                    f"~(({la} == {ha}) & ({lb} == {hb}) & ({la} == {lb}))",
                    f"({la} <= {hb}) & ({lb} <= {ha})",
                ),
            }[op]
            return self._bool(i, f"({true}) | {unknown}", f"({false}) | {unknown}")
        return self._bool(i, "YES", "YES")

    def _int_node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args = node.op, node.args
        if op == "cast":
            if self.bounds(args[0])[0] == "float":
                # truncation toward zero keeps the order
                lf, hf, uf = self.as_float(args[0])
                limit = f"{float(_TILE_LIMIT)}"
                la = f"tl.minimum(tl.maximum({lf}, -{limit}), {limit}).to(tl.int64)"
                ha = f"tl.minimum(tl.maximum({hf}, -{limit}), {limit}).to(tl.int64)"
                ua = f"{uf} | ({lf} < -{limit}) | ({hf} > {limit})"
            else:
                la, ha, ua = self.as_int(args[0])
            if args[2] == 32:
                ua = f"{ua} | ({la} < -{2**31}) | ({ha} > {2**31 - 1})"
            return self._int(i, la, ha, ua)
        if op == "where":
            return self._int(i, *self._choice(args, self.as_int))
        la, ha, ua = self.as_int(args[0])
        if op == "neg":
            return self._int(i, f"0 - {ha}", f"0 - {la}", ua)
        if op == "invert":
            return self._int(i, f"-1 - {ha}", f"-1 - {la}", ua)
        if op == "abs":
            return self._int(
                i,
                f"tl.where({la} >= 0, {la}, tl.where({ha} <= 0, 0 - {ha}, 0))",
                f"tl.maximum(0 - {la}, {ha})",
                ua,
            )
        if len(args) != 2:
            return self._int(i, "ZERO", "ZERO", "YES")
        lb, hb, ub = self.as_int(args[1])
        unknown = f"{ua} | {ub}"
        if op == "add":
            return self._int(i, f"{la} + {lb}", f"{ha} + {hb}", unknown)
        if op == "sub":
            return self._int(i, f"{la} - {hb}", f"{ha} - {lb}", unknown)
        if op in ("minimum", "maximum"):
            return self._int(i, f"tl.{op}({la}, {lb})", f"tl.{op}({ha}, {hb})", unknown)
        if op == "mul":
            corners = [f"{x} * {y}" for x in (la, ha) for y in (lb, hb)]
            big = " | ".join(
                f"({x} < -{_TILE_FACTOR}) | ({x} > {_TILE_FACTOR})" for x in (la, ha, lb, hb)
            )
            pairs = [f"{corners[0]}, {corners[1]}", f"{corners[2]}, {corners[3]}"]
            low = f"tl.minimum(tl.minimum({pairs[0]}), tl.minimum({pairs[1]}))"
            high = f"tl.maximum(tl.maximum({pairs[0]}), tl.maximum({pairs[1]}))"
            return self._int(i, low, high, f"{unknown} | {big}")
        if op == "floordiv":
            # a positive divisor: floor(a / b) grows with a, and moves with b the other way
            # from a's sign, so the corners bound it
            safe_lb = f"tl.maximum({lb}, 1)"
            safe_hb = f"tl.maximum({hb}, 1)"
            low = f"tl.minimum(_floordiv({la}, {safe_lb}), _floordiv({la}, {safe_hb}))"
            high = f"tl.maximum(_floordiv({ha}, {safe_lb}), _floordiv({ha}, {safe_hb}))"
            return self._int(i, low, high, f"{unknown} | ({lb} <= 0)")
        if op == "mod":
            # a positive divisor: the remainder is in [0, b); exactly a's when a's interval
            # stays within one multiple of a single divisor
            safe = f"tl.maximum({lb}, 1)"
            same = f"({lb} == {hb}) & (_floordiv({la}, {safe}) == _floordiv({ha}, {safe}))"
            return self._int(
                i,
                f"tl.where({same}, _floormod({la}, {safe}), 0)",
                f"tl.where({same}, _floormod({ha}, {safe}), {hb} - 1)",
                f"{unknown} | ({lb} <= 0)",
            )
        return self._int(i, "ZERO", "ZERO", "YES")

    def _float_node(self, i: int, node: Node) -> tuple[str, ...]:
        op, args = node.op, node.args
        if op == "const":
            value = f"tl.cast(MOD[{args[0]}], tl.float32)"
            return self._float(i, value, value, "NO", False)
        if op == "cast":  # to float from an integer, a bool or a float: monotone
            la, ha, ua = self.as_float(args[0])
            return self._float(i, la, ha, ua, False)
        if op == "where":
            return self._float(i, *self._choice(args, self.as_float), False)
        if op == "load":
            return self._load(i, node)
        if op == "input" or op not in _FLOAT_TILE_OPS:
            return self._float(i, "FZERO", "FZERO", "YES", False)
        la, ha, ua = self.as_float(args[0])
        if op == "neg":
            return self._float(i, f"0.0 - {ha}", f"0.0 - {la}", ua, False)
        if op == "abs":
            low = f"tl.where({la} >= 0.0, {la}, tl.where({ha} <= 0.0, 0.0 - {ha}, 0.0))"
            return self._float(i, low, f"tl.maximum(0.0 - {la}, {ha})", ua, False)
        if op in ("exp", "tanh", "sigmoid"):  # increasing
            x = {
                "exp": "tl.exp({})",
                "tanh": "_tanh({}, 0)",
                "sigmoid": "(1.0 / (1.0 + tl.exp(0.0 - {})))",
            }[op]
            return self._float(i, x.format(la), x.format(ha), ua, True)
        if op in ("log", "sqrt"):  # increasing where defined
            return self._float(i, f"tl.{op}({la})", f"tl.{op}({ha})", f"{ua} | ({la} < 0.0)", True)
        lb, hb, ub = self.as_float(args[1])
        unknown = f"{ua} | {ub}"
        if op in ("minimum", "maximum"):
            return self._float(i, f"tl.{op}({la}, {lb})", f"tl.{op}({ha}, {hb})", unknown, False)
        if op == "add":
            return self._float(i, f"{la} + {lb}", f"{ha} + {hb}", unknown, True)
        if op == "sub":
            return self._float(i, f"{la} - {hb}", f"{ha} - {lb}", unknown, True)
        # mul, truediv: the extremes are at the corners (a divisor that may be 0: unknown)
        sign = "*" if op == "mul" else "/"
        if op == "truediv":
            unknown = f"{unknown} | (({lb} <= 0.0) & ({hb} >= 0.0))"
        corners = [f"{x} {sign} {y}" for x in (la, ha) for y in (lb, hb)]
        low = (
            f"tl.minimum(tl.minimum({corners[0]}, {corners[1]}), "
            f"tl.minimum({corners[2]}, {corners[3]}))"
        )
        high = (
            f"tl.maximum(tl.maximum({corners[0]}, {corners[1]}), "
            f"tl.maximum({corners[2]}, {corners[3]}))"
        )
        return self._float(i, low, high, unknown, True)


def tile_function(traced: TracedMods) -> str:
    """``tile_fn(b, h, q_lo, q_hi, kv_lo, kv_hi, MOD) -> (may_keep, may_drop)``: whether the
    masks may keep some pair, and may drop some pair, of queries ``[q_lo, q_hi]`` and keys
    ``[kv_lo, kv_hi]`` of batch row ``b`` and head ``h`` (bounds included; sound, not exact:
    both may be true where the block is in fact all kept or all dropped)."""
    emitter = TileEmitter(traced)
    keep, drop = [], []
    for function in traced.masks:
        result = emitter.bounds(function.result)
        if result[0] != "bool":
            keep.append("YES")
            drop.append("YES")
        else:
            keep.append(result[1])
            drop.append(result[2])
    body = [
        "YES = q_lo == q_lo",
        "NO = q_lo != q_lo",
        "ZERO = q_lo.to(tl.int64) * 0",
        "FZERO = ZERO.to(tl.float32)",
        *emitter.lines,
        f"return {' & '.join(keep) or 'YES'}, {' | '.join(drop) or 'NO'}",
    ]
    return function_source("tile_fn", "b, h, q_lo, q_hi, kv_lo, kv_hi, MOD", body)


def function_source(name: str, params: str, body: list[str]) -> str:
    lines = [f"@triton.jit\ndef {name}({params}):"]
    lines += [f"    {line}" for line in body]
    return "\n".join(lines) + "\n"

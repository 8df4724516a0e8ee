"""Triton code of a traced graph: the mask and score functions the kernels call, and the
gradients of the score functions in their parameters."""

from __future__ import annotations

from dataclasses import dataclass

from .modgraph import INDEX_NAMES, Node, TracedMods, node_inputs
from .modtiles import TileEmitter, function_source, tile_function

__all__ = ["generate"]


# -- Triton code -------------------------------------------------------------------------------

_HEADER = """\
import triton
import triton.language as tl

from attnbias.kernels.common import _tanh


@triton.jit
def _floordiv(a, b):
    q = a // b
    r = a - q * b
    return q - ((r != 0) & ((r < 0) != (b < 0))).to(q.dtype)


@triton.jit
def _floormod(a, b):
    r = a % b
    return r + tl.where((r != 0) & ((r < 0) != (b < 0)), b, 0)
"""


class _Emitter:
    """Writes the Triton statements of a graph's nodes, each once, as local variables."""

    def __init__(self, traced: TracedMods, seed: int | None = None, prefix: str = "v") -> None:
        self.traced = traced
        self.lines: list[str] = []
        self.names: dict[int, str] = {}
        self.prefix = prefix
        # nodes bound to one value for the whole tile (:func:`_score_cut`): no read below them
        # depends on the positions
        self.uniform = False
        # d node / d seed (the score input unless ``seed`` names a node): None is 0, "1" one
        self.tangents: dict[int, str | None] = {}
        self.seed = traced.inputs["score"] if seed is None else seed
        self.narrow = traced.narrow_casts()
        self.wide = traced.wide_nodes()
        self.wraps = traced.wrapped_reads()
        # where each parameter's runtime arguments start in the flat argument tuple
        self.param_slot = traced.param_slots()

    def bind_inputs(self, names: dict[str, str]) -> None:
        for name, var in names.items():
            self.names[self.traced.inputs[name]] = var
        score = self.traced.inputs["score"]
        self.tangents[score] = "1" if self.seed == score else None

    def bind_uniform(self, values: dict[int, str]) -> None:
        """Bind nodes to scalars, each the node's one value over the tile: the nodes of
        :func:`_score_cut`, so that what the score functions compute from them is a scalar
        per tile (the reads below them one load each, no gather)."""
        self.uniform = True
        for node_id, var in values.items():
            self.names[node_id] = var
            self.tangents[node_id] = None

    def value(self, node_id: int, tangent: bool = False) -> str:
        if node_id not in self.names:
            node = self.traced.nodes[node_id]
            for arg in node_inputs(node):
                self.value(arg, tangent)
            var = f"{self.prefix}{node_id}"
            self.lines.append(f"{var} = {self._expr(node, node_id)}")
            self.names[node_id] = var
            if tangent:
                self.tangents[node_id] = (
                    "1" if node_id == self.seed else self._tangent(node_id, node)
                )
        elif tangent and node_id not in self.tangents:
            self.tangents[node_id] = None
        return self.names[node_id]

    def _expr(self, node: Node, node_id: int = -1) -> str:
        op, args = node.op, node.args
        n = self.names
        if node_id in self.wide:  # int64 operands: the value may leave int32
            operands = args[1:] if op == "where" else tuple(node_inputs(node))
            n = dict(n)
            for arg in operands:
                if self.traced.nodes[arg].kind != "float":
                    n[arg] = f"tl.cast({self.names[arg]}, tl.int64)"  # a number too
        if op == "const":
            return f"MOD[{args[0]}]"
        if op == "bool":
            return "True" if args[0] else "False"
        if op == "load":
            gathered = None if self.uniform else self._gathered_load(node)
            if gathered is not None:
                return gathered
            load = f"tl.load(MOD[{self.param_slot[args[0]]}] + {self.offset(node)})"
            return f"{load}.to(tl.float32)" if node.kind == "float" else load
        if op == "cast":
            kind, width = args[1], args[2]
            source = self.traced.nodes[args[0]].kind
            if kind == "bool":
                return f"({n[args[0]]} != 0)"
            if kind == "int":
                width = 32 if node_id in self.narrow else width
                return f"{n[args[0]]}.to(tl.int{width})"
            return f"{n[args[0]]}.to(tl.float32)" if source != "float" else n[args[0]]
        binary = {
            "add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^",
            "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
        }  # fmt: skip
        if op in binary:
            return f"({n[args[0]]} {binary[op]} {n[args[1]]})"
        if op == "truediv":
            return f"({n[args[0]]}.to(tl.float32) / {n[args[1]]})"
        if op in ("floordiv", "mod"):
            a, b = args
            if node.kind == "int":
                helper = "_floordiv" if op == "floordiv" else "_floormod"
                return f"{helper}({n[a]}, {n[b]})"
            quotient = f"tl.floor({n[a]}.to(tl.float32) / {n[b]})"
            return quotient if op == "floordiv" else f"({n[a]} - {quotient} * {n[b]})"
        if op == "neg":
            return f"(0 - {n[args[0]]})"
        if op == "abs":
            return f"tl.abs({n[args[0]]})"
        if op == "not":
            return f"({n[args[0]]} == 0)"
        if op == "invert":
            return f"(~{n[args[0]]})"
        if op in ("minimum", "maximum"):
            return f"tl.{op}({n[args[0]]}, {n[args[1]]})"
        if op == "where":
            return f"tl.where({n[args[0]]}, {n[args[1]]}, {n[args[2]]})"
        x = f"{n[args[0]]}.to(tl.float32)"
        return {
            "exp": f"tl.exp({x})",
            "log": f"tl.log({x})",
            "tanh": f"_tanh({x}, 0)",
            "sqrt": f"tl.sqrt({x})",
            "sigmoid": f"(1.0 / (1.0 + tl.exp(0.0 - {x})))",
        }[op]

    # -- a parameter read ``node`` (op "load"): its runtime arguments, by dimension ------------

    def size(self, node: Node, dim: int) -> str:
        return f"MOD[{self.traced.read_args(node)[1][dim]}]"

    def stride(self, node: Node, dim: int) -> str:
        return f"MOD[{self.traced.read_args(node)[2][dim]}]"

    def clamped(self, node: Node, dim: int) -> str:
        """The read's element index along ``dim``: a negative index counts from the end (where
        one may be negative, :func:`_wrapped_reads`), as eager PyTorch reads it; then clamped
        into the tensor, only a guard for the memory: :func:`attnbias.mods.check_reads` proved
        every read at a valid position in range, and the kernels clamp the positions of a
        tile's padding into the sequences."""
        index = self.names[node.args[1 + dim]]
        size = self.size(node, dim)
        if (self.traced.id_of(node), dim) in self.wraps:
            index = f"tl.where({index} < 0, {index} + {size}, {index})"
        return f"tl.minimum(tl.maximum({index}, 0), {size} - 1)"

    def offset(self, node: Node, skip: int | None = None) -> str:
        """The read's element offset, in int64, over every dimension but ``skip``."""
        offset = "0"
        for dim in range(len(node.args) - 1):
            if dim != skip:
                offset = (
                    f"{offset} + {self.clamped(node, dim)}.to(tl.int64) * {self.stride(node, dim)}"
                )
        return offset

    def _gathered_load(self, node: Node) -> str | None:
        """A tile's reads of a small table row through a register gather, or None where the
        read is not of that form.

        The form: one index of the read depends on both positions (a tile's ``[M, N]`` of
        entries, ``table[h, bucket(q_idx - kv_idx)]``), the others on neither, and the table
        has at most :data:`GATHER_LIMIT` entries along that index. The row is loaded once per
        tile (``[1 or rows, T]``) and each pair picks its entry with ``tl.gather``, instead of
        one load from memory per pair."""
        args = node.args
        positions = {self.traced.inputs["q_idx"], self.traced.inputs["kv_idx"]}
        reads = [self.traced.ancestors(i) & positions for i in args[1:]]
        varying = [d for d, r in enumerate(reads) if r]
        if len(varying) != 1 or reads[varying[0]] != positions:
            return None
        param = self.traced.params[args[0]]
        dim = varying[0]
        entries = int(param.shape[dim])
        if not 0 < entries <= GATHER_LIMIT:
            return None
        slot = self.param_slot[args[0]]
        width = 1 << (entries - 1).bit_length()
        size, stride = self.size(node, dim), self.stride(node, dim)
        tag = f"{self.prefix}{len(self.lines)}"
        self.lines += [
            f"te{tag} = tl.arange(0, {width})[None, :]",
            f"tr{tag} = tl.load(MOD[{slot}] + {self.offset(node, skip=dim)} + te{tag} * {stride}, "
            f"mask=te{tag} < {size}, other=0)",
            f"ti{tag} = {self.clamped(node, dim)}.to(tl.int32)",
            f"tg{tag} = tl.gather("
            f"tl.broadcast_to(tr{tag}, (ti{tag}.shape[0], {width})), ti{tag}, 1)",
        ]
        return f"tg{tag}.to(tl.float32)" if node.kind == "float" else f"tg{tag}"

    def _tangent(self, node_id: int, node: Node) -> str | None:
        """``d node / d score`` as an expression of earlier variables (None: zero)."""
        op, args = node.op, node.args
        if node.kind != "float" or op in ("const", "load"):
            return None
        t = [self.tangents.get(a) for a in node_inputs(node)]
        n = self.names
        var = n[node_id]

        def scaled(tangent: str | None, factor: str) -> str | None:
            if tangent is None:
                return None
            return factor if tangent == "1" else f"({tangent} * {factor})"

        def plus(a: str | None, b: str | None, sign: str = "+") -> str | None:
            if b is None:
                return a
            if a is None:
                return b if sign == "+" else f"(0.0 - {b})"
            return f"({a} {sign} {b})"

        if op == "cast":
            return t[0]
        if op == "add":
            return plus(t[0], t[1])
        if op == "sub":
            return plus(t[0], t[1], "-")
        if op == "mul":
            return plus(scaled(t[0], n[args[1]]), scaled(t[1], n[args[0]]))
        if op == "truediv":
            a, b = n[args[0]], n[args[1]]
            return plus(scaled(t[0], f"(1.0 / {b})"), scaled(t[1], f"(0.0 - {a} / ({b} * {b}))"))
        if op == "neg":
            return None if t[0] is None else f"(0.0 - {t[0]})"
        if op == "abs":
            return None if t[0] is None else f"tl.where({n[args[0]]} < 0, 0.0 - {t[0]}, {t[0]})"
        if op in ("minimum", "maximum"):
            if t[0] is None and t[1] is None:
                return None
            cmp = "<=" if op == "minimum" else ">="
            first = "1.0" if t[0] == "1" else t[0] or "0.0"
            second = "1.0" if t[1] == "1" else t[1] or "0.0"
            return f"tl.where({n[args[0]]} {cmp} {n[args[1]]}, {first}, {second})"
        if op == "where":
            if t[1] is None and t[2] is None:
                return None
            first = "1.0" if t[1] == "1" else t[1] or "0.0"
            second = "1.0" if t[2] == "1" else t[2] or "0.0"
            return f"tl.where({n[args[0]]}, {first}, {second})"
        if op in ("floordiv", "mod"):
            return None if op == "floordiv" else t[0]
        x = n[args[0]]
        factor = {
            "exp": var,
            "log": f"(1.0 / {x})",
            "tanh": f"(1.0 - {var} * {var})",
            "sqrt": f"(0.5 / {var})",
            "sigmoid": f"({var} * (1.0 - {var}))",
        }[op]
        return scaled(t[0], factor)


def generate(traced: TracedMods) -> str:
    """The Python source of the module with the kernels' functions of ``traced``:

    * ``mask_fn(b, h, q_idx, kv_idx, MOD)``: whether each pair is kept (all masks);
    * ``score_fn(score, b, h, q_idx, kv_idx, MOD)``: the scores after every score function;
    * ``score_grad_fn(score, ...)``: that and its derivative in ``score``.

    ``MOD`` is the tuple of :meth:`TracedMods.runtime_args`.
    """
    parts = [_HEADER]
    index_args = ", ".join(INDEX_NAMES)
    names = {name: name for name in (*INDEX_NAMES, "score")}

    emitter = _Emitter(traced)
    emitter.bind_inputs(names)
    results = [emitter.value(f.result) for f in traced.masks]
    body = [*emitter.lines, f"return {' & '.join(results) if results else 'True'}"]
    parts.append(function_source("mask_fn", f"{index_args}, MOD", body))

    tiled = _score_tile(traced)
    for with_grad in (False, True):
        plain = _score_body(traced, with_grad, "v")
        if tiled is None:
            body = _tiled_body(None, plain, plain)
        else:
            uniform = _score_body(traced, with_grad, "w", tiled)
            body = _tiled_body(tiled, uniform, plain)
        name = "score_grad_fn" if with_grad else "score_fn"
        params = f"score, {index_args}, MOD, TILED: tl.constexpr = False"
        parts.append(function_source(name, params, body))
    parts.append(
        function_source(
            "param_grad_fn",
            f"score, {index_args}, MOD, ds, TILED: tl.constexpr = False",
            _tiled_body(
                tiled,
                _param_grads(traced, tiled) if tiled is not None else [],
                _param_grads(traced),
            ),
        )
    )
    parts.append(tile_function(traced))
    return "\n".join(parts)


@dataclass(frozen=True)
class _ScoreTile:
    """How the score functions' tiles are checked for one value over the tile: the lines of
    the cut's bounds, the condition that each is a single value, and those values."""

    lines: list[str]
    uniform: str
    values: dict[int, str]


_TILE_PRELUDE = [
    "q_lo = tl.min(tl.min(q_idx, 1), 0)",
    "q_hi = tl.max(tl.max(q_idx, 1), 0)",
    "kv_lo = tl.min(tl.min(kv_idx, 1), 0)",
    "kv_hi = tl.max(tl.max(kv_idx, 1), 0)",
    "YES = q_lo == q_lo",
    "NO = q_lo != q_lo",
    "ZERO = q_lo.to(tl.int64) * 0",
    "FZERO = ZERO.to(tl.float32)",
]


def _score_cut(traced: TracedMods) -> list[int] | None:
    """The integer and bool nodes through which the positions reach the score functions'
    result: walking back from it through float nodes, the first ones that are not floats and
    depend on ``q_idx`` or ``kv_idx``. Where each of them has one value over a tile, the
    score functions add (or apply) one value per tile (a relative-position bucket that
    saturates far from the diagonal). ``None``: no such nodes, or one that no tile of several
    queries and keys gives one value (a position, their difference, its ``abs``)."""
    if not traced.scores:
        return None
    positions = {traced.inputs["q_idx"], traced.inputs["kv_idx"]}
    cut: set[int] = set()
    seen: set[int] = set()
    stack = [traced.scores[-1].result]
    while stack:
        node_id = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        if not traced.ancestors(node_id) & positions:
            continue
        node = traced.nodes[node_id]
        if node.kind != "float":
            cut.add(node_id)
        else:
            stack.extend(node_inputs(node))
    if not cut or any(not _may_collapse(traced, node_id, positions) for node_id in cut):
        return None
    return sorted(cut)


#: Operations whose value may be one over a range of positions (a clamp, a choice, a
#: quotient, a comparison, a table read); the others (sums, differences, |.|) vary with them.
_COLLAPSING = frozenset(
    ("minimum", "maximum", "where", "floordiv", "mod", "cast", "lt", "le", "gt", "ge", "eq",
     "ne", "and", "or", "xor", "not", "invert", "load", "mul")
)  # fmt: skip


def _may_collapse(traced: TracedMods, node_id: int, positions: set[int]) -> bool:
    """Whether a node may have one value over a tile of several queries and keys: some
    operation between it and the positions may collapse a range."""
    return any(
        traced.nodes[i].op in _COLLAPSING
        for i in traced.ancestors(node_id)
        if traced.ancestors(i) & positions
    )


def _score_tile(traced: TracedMods) -> _ScoreTile | None:
    cut = _score_cut(traced)
    if cut is None:
        return None
    emitter = TileEmitter(traced, prefix="k")
    checks, values = [], {}
    for node_id in cut:
        found = emitter.bounds(node_id)
        if found[0] == "int":
            checks.append(f"({found[1]} == {found[2]}) & ~{found[3]}")
        else:
            checks.append(f"({found[1]} != {found[2]})")
        values[node_id] = found[1]
    return _ScoreTile([*_TILE_PRELUDE, *emitter.lines], " & ".join(checks), values)


def _score_body(
    traced: TracedMods, with_grad: bool, prefix: str, tile: _ScoreTile | None = None
) -> list[str]:
    """Lines that set ``r0`` (the scores after every score function) and, ``with_grad``,
    ``r1`` (their derivative in the input score); per pair, or with ``tile`` from the cut's
    one value per tile."""
    emitter = _Emitter(traced, prefix=prefix)
    emitter.bind_inputs({name: name for name in (*INDEX_NAMES, "score")})
    if tile is not None:
        emitter.bind_uniform(tile.values)
    result = "score"
    for function in traced.scores:
        result = emitter.value(function.result, tangent=with_grad)
    last = traced.scores[-1].result if traced.scores else None
    if last is not None and traced.inputs["score"] not in traced.ancestors(last):
        result = f"({result} + tl.zeros_like(score))"  # the tile's shape in either branch
    lines = [*emitter.lines, f"r0 = {result}"]
    if with_grad:
        tangent = emitter.tangents.get(traced.scores[-1].result) if traced.scores else "1"
        tangent = "1.0" if tangent == "1" else tangent or "0.0"
        lines.append(f"r1 = tl.zeros_like(score) + {tangent}")
    return lines


def _tiled_body(tile: _ScoreTile | None, uniform: list[str], plain: list[str]) -> list[str]:
    """A generated function's body: ``plain`` per pair, and with ``TILED`` (the training
    kernels' tiles, ``b`` and ``h`` scalars) and ``tile``, ``uniform`` where the tile's cut
    nodes each have one value. Returns ``r0`` (and ``r1``) where ``plain`` sets them."""
    returns = [n for n in ("r0", "r1") if any(line.startswith(f"{n} = ") for line in plain)]
    ending = [f"return {', '.join(returns)}"] if returns else []
    if tile is None:
        return [*plain, *ending] or ["pass"]

    def indent(lines: list[str]) -> list[str]:
        return [f"    {line}" for line in lines] or ["    pass"]

    return [
        "if TILED:",
        *indent([*tile.lines, f"UNIFORM = {tile.uniform}", "if UNIFORM:"]),
        *indent(indent(uniform)),
        "    else:",
        *indent(indent(plain)),
        "else:",
        *indent(plain),
        *ending,
    ]


#: Tables with at most this many entries along the index that both positions set are read a
#: row per tile and gathered in registers (``_Emitter._gathered_load``).
GATHER_LIMIT = 64

#: Above this many entries indexed by the positions, a tensor's gradient is added one score at
#: a time (atomics); at or below it, each tile sums per entry first and adds once.
ONE_HOT_LIMIT = 256


def _param_grads(traced: TracedMods, tile: _ScoreTile | None = None) -> list[str]:
    """The body of ``param_grad_fn``: for each float tensor the score functions read, the
    gradient ``ds * d scores / d read`` of a tile's pairs added into its float32 buffer (at
    the end of the runtime arguments, one per float tensor). Each read sums over the tile:
    entirely when its index depends on neither position, else per entry of the dimensions
    that do (a loop over the entries between the least and the greatest that the tile's
    nonzero gradients read, for tables of at most ``ONE_HOT_LIMIT`` such entries; beyond it
    one atomic per nonzero score). With ``tile``, every read is of one entry over the tile
    (the cut's values): one sum and one atomic per read."""
    if not traced.scores:
        return ["pass"]
    result = traced.scores[-1].result
    ancestors = traced.ancestors(result)
    floats = [slot for slot, p in enumerate(traced.params) if p.is_floating_point()]
    grad_slot = len(traced.runtime_args())
    positions = {traced.inputs["q_idx"], traced.inputs["kv_idx"]}
    names = {name: name for name in (*INDEX_NAMES, "score")}
    body: list[str] = []
    for node_id in sorted(ancestors):
        node = traced.nodes[node_id]
        if node.op != "load" or node.args[0] not in floats:
            continue
        emitter = _Emitter(traced, seed=node_id, prefix="v" if tile is None else "w")
        emitter.bind_inputs(names)
        if tile is not None:
            emitter.bind_uniform(tile.values)
        emitter.value(result, tangent=True)
        tangent = emitter.tangents.get(result)
        if tangent is None:
            continue
        slot = node.args[0]
        dims = len(node.args) - 1
        grad = f"MOD[{grad_slot + floats.index(slot)}]"
        sizes = [emitter.size(node, d) for d in range(dims)]
        # contiguous strides of the float32 gradient buffer
        strides = [" * ".join(sizes[d + 1 :]) or "1" for d in range(dims)]
        index = [emitter.clamped(node, d) for d in range(dims)]
        varying = [d for d, i in enumerate(node.args[1:]) if traced.ancestors(i) & positions]
        uniform = [d for d in range(dims) if d not in varying]
        g = f"g{node_id}"
        lines = [*emitter.lines]
        if tile is not None:
            offset = " + ".join(f"{index[d]}.to(tl.int64) * ({strides[d]})" for d in range(dims))
            factor = "1.0" if tangent == "1" else tangent
            lines.append(f"w{g} = tl.where(ds == 0.0, 0.0, ds * {factor})")
            lines.append(f"tl.atomic_add({grad} + {offset or '0'}, tl.sum(tl.sum(w{g}, 1), 0))")
            body += lines
            continue
        lines.append(f"{g} = tl.where(ds == 0.0, 0.0, ds * {'1.0' if tangent == '1' else tangent})")
        offset = " + ".join(f"{index[d]}.to(tl.int64) * ({strides[d]})" for d in uniform) or "0"
        lines.append(f"u{node_id} = {offset}")
        if not varying:
            lines.append(f"tl.atomic_add({grad} + u{node_id}, tl.sum(tl.sum({g}, 1), 0))")
        else:
            count = " * ".join(sizes[d] for d in varying)
            inner = [" * ".join(sizes[e] for e in varying if e > d) or "1" for d in varying]
            flat = " + ".join(f"{index[d]} * ({inner[k]})" for k, d in enumerate(varying))
            entry = " + ".join(
                f"((e // ({inner[k]})) % {sizes[d]}).to(tl.int64) * ({strides[d]})"
                for k, d in enumerate(varying)
            )
            every = " + ".join(f"{index[d]}.to(tl.int64) * ({strides[d]})" for d in varying)
            lines += [
                f"f{node_id} = {flat}",
                f"if {count} <= {ONE_HOT_LIMIT}:",
                # only the entries the tile's kept pairs read: a relative-position table
                # gives most tiles one or a few
                f"    nz = {g} != 0.0",
                f"    lo = tl.min(tl.min(tl.where(nz, f{node_id}, {count}), 1), 0)",
                f"    hi = tl.max(tl.max(tl.where(nz, f{node_id}, -1), 1), 0)",
                "    for e in range(lo, hi + 1):",
                f"        c = tl.sum(tl.sum(tl.where(f{node_id} == e, {g}, 0.0), 1), 0)",
                f"        tl.atomic_add({grad} + u{node_id} + {entry}, c)",
                "else:",
                f"    tl.atomic_add({grad} + u{node_id} + {every}, {g}, mask={g} != 0.0)",
            ]
        body += lines
    return body or ["pass"]

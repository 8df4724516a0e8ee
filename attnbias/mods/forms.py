"""Mask functions that are built-in masks written as functions: their band and documents.

A traced ``mask_mod`` (:class:`~attnbias.kernels.modgraph.TracedMods`) that is a conjunction of

- comparisons of ``kv_idx - q_idx`` (up to a constant, on either side, either sign) with a
  constant: a diagonal band ``lo <= j - i <= hi``, for example a causal sliding window
  ``(kv_idx <= q_idx) & (q_idx - kv_idx < W)``;
- one equality ``(q_idx + a) // C == (kv_idx + c) // C`` with a constant ``C > 0``: documents of
  ``C`` positions, for example Llama 4's chunked attention ``q_idx // C == kv_idx // C``;
- one equality of an integer read of the query side and one of the key side,
  ``x(b, q_idx) == y(b, kv_idx)``: document ids, for example FlexAttention's packed documents
  ``docs[b, q_idx] == docs[b, kv_idx]`` over a ``(B, S)`` tensor of ids. These are documents
  only where the ids do not decrease along the sequence, which the values decide: the front-end
  evaluates both sides on the call's positions and checks that, per tensor version;

keeps exactly the pairs of that band and those documents, so it can run as the built-in terms
(their analytic tile ranges, and every backend that takes the built-ins) instead of as a
generated function. A score function ``cap * tanh(score / cap)`` with one positive number
``cap`` is a soft-cap. :func:`builtin_form` finds these forms, reading the traced graph only:
anything else (another operator, a read of ``h``, a float, an ``|``, any other score function)
gives ``None`` and the functions run as they are.

Nothing here knows about bias classes or terms; the front-end turns a form into terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnbias.kernels.modgraph import Node, TracedMods

__all__ = ["BuiltinForm", "builtin_form"]


@dataclass(frozen=True)
class BuiltinForm:
    """The band ``band_lo <= j - i <= band_hi`` (``None``: open side), the documents
    ``(i + q_offset) // chunk == (j + kv_offset) // chunk`` (``chunk`` ``None``: no chunks)
    and the document ids ``x(b, i) == y(b, j)`` (``ids``: the graph's nodes ``x`` and ``y``,
    reading the parameters of the slots ``id_params``) that the mask functions keep, pair for
    pair, and the soft-cap ``cap * tanh(score / cap)`` that the score function is
    (``softcap`` ``None``: no score function)."""

    band_lo: int | None = None
    band_hi: int | None = None
    chunk: int | None = None
    q_offset: int = 0
    kv_offset: int = 0
    ids: tuple[int, int] | None = None
    id_params: tuple[int, ...] = ()
    softcap: float | None = None

    @property
    def needs_host(self) -> bool:
        """Whether lowering the form reads or builds tensors on the host (the chunks' ids, the
        ids' order) or may fall back to the functions (a soft-cap in a sum with score terms):
        not under ``torch.compile``, which runs the functions instead."""
        return self.chunk is not None or self.ids is not None or self.softcap is not None


# A linear form ``a_q * q_idx + a_kv * kv_idx + c`` of exact Python integers.
_Linear = tuple[int, int, int]

# comparisons ``x OP 0`` flipped by a negation of ``x``, and negated by ``not``
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def builtin_form(traced: TracedMods) -> BuiltinForm | None:
    """The band, documents and soft-cap that the functions of ``traced`` are, or ``None``
    (also for no function at all)."""
    if not traced.masks and not traced.scores:
        return None
    reader = _Reader(traced)
    softcap: float | None = None
    if traced.scores:
        if len(traced.scores) != 1:
            return None
        softcap = reader.softcap(traced.scores[0].result)
        if softcap is None:
            return None
    atoms: list[int] = []
    for function in traced.masks:
        if not reader.conjuncts(function.result, atoms):
            return None
    lo: int | None = None
    hi: int | None = None
    chunk: tuple[int, int, int] | None = None
    ids: tuple[int, int] | None = None
    for atom in atoms:
        found = reader.band(atom)
        if found is not None:
            atom_lo, atom_hi = found
            if atom_lo is not None:
                lo = atom_lo if lo is None else max(lo, atom_lo)
            if atom_hi is not None:
                hi = atom_hi if hi is None else min(hi, atom_hi)
            continue
        documents = reader.chunks(atom)
        if documents is not None:
            if chunk is not None and chunk != documents:
                return None
            chunk = documents
            continue
        read = reader.ids(atom)
        if read is None or (ids is not None and ids != read):
            return None
        ids = read
    id_params = () if ids is None else reader.params_read(ids)
    size, q_offset, kv_offset = chunk or (None, 0, 0)
    return BuiltinForm(lo, hi, size, q_offset, kv_offset, ids, id_params, softcap)


class _Reader:
    def __init__(self, traced: TracedMods) -> None:
        self.traced = traced
        self.nodes = traced.nodes
        self.q = traced.inputs["q_idx"]
        self.kv = traced.inputs["kv_idx"]
        self.index_names = {node_id: name for name, node_id in traced.inputs.items()}

    def node(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def conjuncts(self, node_id: int, into: list[int]) -> bool:
        """Append the operands of the ``&`` tree at ``node_id`` to ``into`` (a ``True``
        constant adds nothing); ``False`` where it is not a bool of that shape."""
        node = self.node(node_id)
        if node.kind != "bool":
            return False
        if node.op == "and":
            return all(self.conjuncts(arg, into) for arg in node.args)
        if node.op == "bool":
            return bool(node.args[0])  # `& True` adds nothing; a False mask is no built-in
        into.append(node_id)
        return True

    def linear(self, node_id: int) -> _Linear | None:
        """``node_id`` as ``a_q * q_idx + a_kv * kv_idx + c``, or ``None``."""
        node = self.node(node_id)
        if node.kind != "int":
            return None
        if node_id == self.q:
            return (1, 0, 0)
        if node_id == self.kv:
            return (0, 1, 0)
        op, args = node.op, node.args
        if op == "const":
            value = self.traced.consts[args[0]]
            return (0, 0, value) if isinstance(value, int) else None
        if op == "cast":  # to int64: the value as it is (narrower casts may wrap)
            return self.linear(args[0]) if args[1:] == ("int", 64) else None
        if op == "neg":
            found = self.linear(args[0])
            return None if found is None else (-found[0], -found[1], -found[2])
        if op in ("add", "sub", "mul"):
            a, b = self.linear(args[0]), self.linear(args[1])
            if a is None or b is None:
                return None
            if op == "add":
                return (a[0] + b[0], a[1] + b[1], a[2] + b[2])
            if op == "sub":
                return (a[0] - b[0], a[1] - b[1], a[2] - b[2])
            if a[:2] == (0, 0):  # a constant times a form
                return (a[2] * b[0], a[2] * b[1], a[2] * b[2])
            if b[:2] == (0, 0):
                return (b[2] * a[0], b[2] * a[1], b[2] * a[2])
        return None

    def comparison(self, node_id: int) -> tuple[str, int, int] | None:
        """A comparison as ``(op, left, right)``, a ``not`` of one turned into its opposite."""
        node = self.node(node_id)
        if node.op == "not":
            inner = self.comparison(node.args[0])
            if inner is None or inner[0] not in _NEGATED:
                return None
            return _NEGATED[inner[0]], inner[1], inner[2]
        if node.op in _FLIPPED:
            return node.op, node.args[0], node.args[1]
        return None

    def band(self, node_id: int) -> tuple[int | None, int | None] | None:
        """The atom as ``lo <= j - i <= hi``: a comparison whose sides differ by
        ``±(kv_idx - q_idx) + c``."""
        found = self.comparison(node_id)
        if found is None:
            return None
        op, left, right = found
        a, b = self.linear(left), self.linear(right)
        if a is None or b is None:
            return None
        a_q, a_kv, c = a[0] - b[0], a[1] - b[1], a[2] - b[2]  # left - right OP 0
        if (a_q, a_kv) == (1, -1):  # -(j - i) + c OP 0  <=>  (j - i) - c FLIPPED(OP) 0
            op, c = _FLIPPED[op], -c
        elif (a_q, a_kv) != (-1, 1):
            return None
        # (j - i) + c OP 0
        if op == "lt":
            return None, -c - 1
        if op == "le":
            return None, -c
        if op == "gt":
            return -c + 1, None
        if op == "ge":
            return -c, None
        return -c, -c  # eq

    def chunks(self, node_id: int) -> tuple[int, int, int] | None:
        """The atom as ``(chunk, q_offset, kv_offset)``: ``(q_idx + q_offset) // chunk ==
        (kv_idx + kv_offset) // chunk`` with a constant ``chunk > 0``, either side first."""
        node = self.node(node_id)
        if node.op != "eq":
            return None
        sides = [self.floor_of_one_index(arg) for arg in node.args]
        if sides[0] is None or sides[1] is None:
            return None
        (index_a, chunk_a, offset_a), (index_b, chunk_b, offset_b) = sides[0], sides[1]
        if chunk_a != chunk_b or {index_a, index_b} != {"q", "kv"}:
            return None
        if index_a == "q":
            return chunk_a, offset_a, offset_b
        return chunk_a, offset_b, offset_a

    def floor_of_one_index(self, node_id: int) -> tuple[str, int, int] | None:
        """``(index + offset) // chunk`` as ``(index name, chunk, offset)``."""
        node = self.node(node_id)
        if node.op == "cast" and node.args[1:] == ("int", 64):
            return self.floor_of_one_index(node.args[0])
        if node.op != "floordiv":
            return None
        inner, divisor = self.linear(node.args[0]), self.linear(node.args[1])
        if inner is None or divisor is None or divisor[:2] != (0, 0) or divisor[2] <= 0:
            return None
        if inner[:2] == (1, 0):
            return "q", divisor[2], inner[2]
        if inner[:2] == (0, 1):
            return "kv", divisor[2], inner[2]
        return None

    def reads(self, node_id: int) -> set[str]:
        """The inputs (``b``, ``h``, ``q_idx``, ``kv_idx``, ``score``) ``node_id`` depends on."""
        return {
            self.index_names[i] for i in self.traced.ancestors(node_id) if i in self.index_names
        }

    def ids(self, node_id: int) -> tuple[int, int] | None:
        """The atom as ``x(b, q_idx) == y(b, kv_idx)`` of integers: ``(x, y)``."""
        node = self.node(node_id)
        if node.op != "eq":
            return None
        sides: dict[str, int] = {}
        for arg in node.args:
            if self.node(arg).kind != "int":
                return None
            reads = self.reads(arg)
            if reads in ({"q_idx"}, {"b", "q_idx"}):
                sides.setdefault("q", arg)
            elif reads in ({"kv_idx"}, {"b", "kv_idx"}):
                sides.setdefault("kv", arg)
        if len(sides) != 2:
            return None
        return sides["q"], sides["kv"]

    def params_read(self, nodes: tuple[int, ...]) -> tuple[int, ...]:
        """The slots of the tensor parameters that ``nodes`` read, in slot order."""
        slots = {
            self.node(i).args[0]
            for node_id in nodes
            for i in self.traced.ancestors(node_id)
            if self.node(i).op == "load"
        }
        return tuple(sorted(slots))

    def number(self, node_id: int) -> float | None:
        """A constant node's value as a float, or ``None``."""
        node = self.node(node_id)
        if node.op != "const":
            return None
        value = self.traced.consts[node.args[0]]
        return None if isinstance(value, bool) else float(value)

    def softcap(self, node_id: int) -> float | None:
        """The score function's result as ``cap * tanh(score / cap)`` (either factor first)
        with one finite ``cap > 0``: ``cap``, or ``None``."""
        node = self.node(node_id)
        if node.op != "mul":
            return None
        for cap_node, tanh_node in (node.args, node.args[::-1]):
            cap, inner = self.number(cap_node), self.node(tanh_node)
            if cap is None or not (0 < cap < float("inf")) or inner.op != "tanh":
                continue
            divided = self.node(inner.args[0])
            if (
                divided.op == "truediv"
                and divided.args[0] == self.traced.inputs["score"]
                and self.number(divided.args[1]) == cap
            ):
                return cap
        return None

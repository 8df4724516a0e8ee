"""Mask functions that are built-in masks written as functions: their band and documents.

A traced ``mask_mod`` (:class:`~attnbias.kernels.modfn.TracedMods`) that is a conjunction of

- comparisons of ``kv_idx - q_idx`` (up to a constant, on either side, either sign) with a
  constant: a diagonal band ``lo <= j - i <= hi``, for example a causal sliding window
  ``(kv_idx <= q_idx) & (q_idx - kv_idx < W)``;
- one equality ``(q_idx + a) // C == (kv_idx + c) // C`` with a constant ``C > 0``: documents of
  ``C`` positions, for example Llama 4's chunked attention ``q_idx // C == kv_idx // C``;

keeps exactly the pairs of that band and those documents, so it can run as the built-in terms
(their analytic tile ranges, and every backend that takes the built-ins) instead of as a
generated function. :func:`builtin_form` finds that form, reading the traced graph only:
anything else (another operator, a read of ``b``, ``h`` or a tensor, a float, an ``|``) gives
``None`` and the function runs as it is.

Nothing here knows about bias classes or terms; the front-end turns a form into terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnbias.kernels.modfn import Node, TracedMods

__all__ = ["BuiltinForm", "builtin_form"]


@dataclass(frozen=True)
class BuiltinForm:
    """The band ``band_lo <= j - i <= band_hi`` (``None``: open side) and the documents
    ``(i + q_offset) // chunk == (j + kv_offset) // chunk`` (``chunk`` ``None``: no documents)
    that a mask function keeps, pair for pair."""

    band_lo: int | None = None
    band_hi: int | None = None
    chunk: int | None = None
    q_offset: int = 0
    kv_offset: int = 0


# A linear form ``a_q * q_idx + a_kv * kv_idx + c`` of exact Python integers.
_Linear = tuple[int, int, int]

# comparisons ``x OP 0`` flipped by a negation of ``x``, and negated by ``not``
_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}


def builtin_form(traced: TracedMods) -> BuiltinForm | None:
    """The band and documents that the mask functions of ``traced`` are, or ``None`` (also for
    no mask function at all)."""
    if not traced.masks:
        return None
    reader = _Reader(traced)
    atoms: list[int] = []
    for function in traced.masks:
        if not reader.conjuncts(function.result, atoms):
            return None
    lo: int | None = None
    hi: int | None = None
    chunk: tuple[int, int, int] | None = None
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
        if documents is None or (chunk is not None and chunk != documents):
            return None
        chunk = documents
    if chunk is None:
        return BuiltinForm(lo, hi)
    return BuiltinForm(lo, hi, *chunk)


class _Reader:
    def __init__(self, traced: TracedMods) -> None:
        self.traced = traced
        self.nodes = traced.nodes
        self.q = traced.inputs["q_idx"]
        self.kv = traced.inputs["kv_idx"]

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

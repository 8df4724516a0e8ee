"""The graph evaluated with torch operations on broadcast index tensors: what eager PyTorch
computes from the same functions (int64 indices; a read at an index in ``[-size, 0)`` counts from
the end of its dimension). The oracle of the generated code, the materialized form of a
``ModBias`` and the exact path's scores.

And tensor reads within their tensors: each call's reads proven in range on the host before
anything runs (:func:`check_reads`), by interval bounds, by the values of the integer tensors
an index reads, or by evaluating the index on the call's grid; where that would synchronise and
cannot, checked on the device and reported later (:func:`check_errors`). The generated code
relies on it: it wraps negative indices and clamps only as a guard for the memory.

Shape legend: ``B`` batch, ``H`` heads, ``L`` queries, ``S`` keys.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from attnbias.kernels.modgraph import INDEX_NAMES, Node, TracedMods, _Range, value_ranges

__all__ = [
    "EXACT_LIMIT",
    "check_errors",
    "check_reads",
    "evaluate",
    "mask_grid",
    "pending_checks",
    "proof_key",
    "read_versions",
    "score_grid",
]


def _eval_load(traced: TracedMods, node: Node, cache: dict[int, Any]) -> Tensor:
    """A read as eager PyTorch makes it: an index in ``[-size, 0)`` counts from the end, one
    outside ``[-size, size)`` raises the IndexError of :func:`_out_of_range` (checked on the
    host, except where no synchronisation can happen: :func:`check_reads` proved
    the call's reads before)."""
    tensor = traced.params[node.args[0]]
    index = []
    for dim, arg in enumerate(node.args[1:]):
        value = torch.as_tensor(cache[arg], device=tensor.device)
        if value.dtype == torch.bool:
            value = value.to(torch.int64)
        size = int(tensor.shape[dim])
        if value.numel() and _sync_refused(tensor.device) is None:
            low, high = torch.stack(torch.aminmax(value.reshape(-1))).tolist()
            if low < -size or high >= size:
                with _PENDING_LOCK:  # raised here: not again by a check of the same call
                    _PENDING[:] = [entry for entry in _PENDING if entry[0] is not traced]
                raise _out_of_range(traced, (traced.id_of(node), dim), low, high)
        index.append(torch.where(value < 0, value + size, value))
    return tensor[tuple(index)] if index else tensor


def _eval_cast(traced: TracedMods, node: Node, cache: dict[int, Any]) -> Tensor:
    value = torch.as_tensor(cache[node.args[0]])
    kind, width = node.args[1], node.args[2]
    if kind == "bool":
        return value != 0
    if kind == "int":
        return value.to(torch.int64 if width == 64 else torch.int32)
    return value.to(torch.float64 if value.dtype == torch.float64 else torch.float32)


def _floordiv(a: Any, b: Any) -> Any:
    return torch.div(torch.as_tensor(a), b, rounding_mode="floor")


def _torch_eval() -> dict[str, Callable[[TracedMods, Node, dict[int, Any]], Any]]:
    def binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
        return lambda traced, node, cache: fn(cache[node.args[0]], cache[node.args[1]])

    def unary(fn: Callable[[Any], Any]) -> Callable[..., Any]:
        return lambda traced, node, cache: fn(torch.as_tensor(cache[node.args[0]]))

    def as_float(x: Any) -> Tensor:
        x = torch.as_tensor(x)
        return x if x.is_floating_point() else x.to(torch.float32)

    return {
        "const": lambda traced, node, cache: traced.consts[node.args[0]],
        "bool": lambda traced, node, cache: node.args[0],
        "load": _eval_load,
        "cast": _eval_cast,
        "add": binary(lambda a, b: a + b),
        "sub": binary(lambda a, b: a - b),
        "mul": binary(lambda a, b: a * b),
        "truediv": binary(lambda a, b: as_float(a) / b),
        "floordiv": binary(_floordiv),
        "mod": binary(lambda a, b: torch.remainder(torch.as_tensor(a), b)),
        "and": binary(lambda a, b: torch.as_tensor(a) & b),
        "or": binary(lambda a, b: torch.as_tensor(a) | b),
        "xor": binary(lambda a, b: torch.as_tensor(a) ^ b),
        "lt": binary(lambda a, b: torch.as_tensor(a) < b),
        "le": binary(lambda a, b: torch.as_tensor(a) <= b),
        "gt": binary(lambda a, b: torch.as_tensor(a) > b),
        "ge": binary(lambda a, b: torch.as_tensor(a) >= b),
        "eq": binary(lambda a, b: torch.as_tensor(a) == b),
        "ne": binary(lambda a, b: torch.as_tensor(a) != b),
        "neg": unary(lambda a: -a.to(torch.int64) if a.dtype == torch.bool else -a),
        "abs": unary(torch.abs),
        "not": unary(torch.logical_not),
        "invert": unary(torch.bitwise_not),
        "minimum": binary(lambda a, b: torch.minimum(torch.as_tensor(a), torch.as_tensor(b))),
        "maximum": binary(lambda a, b: torch.maximum(torch.as_tensor(a), torch.as_tensor(b))),
        "where": lambda traced, node, cache: torch.where(
            torch.as_tensor(cache[node.args[0]]),
            torch.as_tensor(cache[node.args[1]]),
            torch.as_tensor(cache[node.args[2]]),
        ),
        "exp": unary(lambda a: torch.exp(as_float(a))),
        "log": unary(lambda a: torch.log(as_float(a))),
        "tanh": unary(lambda a: torch.tanh(as_float(a))),
        "sqrt": unary(lambda a: torch.sqrt(as_float(a))),
        "sigmoid": unary(lambda a: torch.sigmoid(as_float(a))),
    }


_TORCH_EVAL = _torch_eval()


def _evaluate(traced: TracedMods, wanted: Sequence[int], values: dict[str, Tensor]) -> list[Tensor]:
    cache: dict[int, Any] = {}
    for name, node_id in traced.inputs.items():
        if name in values:
            cache[node_id] = values[name]
    needed = set().union(*(traced.ancestors(i) for i in wanted))
    for node_id in sorted(needed - set(cache)):  # a node comes after its inputs
        cache[node_id] = _TORCH_EVAL[traced.nodes[node_id].op](traced, traced.nodes[node_id], cache)
    return [cache[i] for i in wanted]


def evaluate(traced: TracedMods, node_id: int, **values: Tensor) -> Tensor:
    """The value of ``node_id`` on broadcast index tensors named as the inputs (``b``,
    ``h``, ``q_idx``, ``kv_idx``, ``score``); those it depends on must be given."""
    (result,) = _evaluate(traced, [node_id], values)
    return torch.as_tensor(result)


def mask_grid(
    traced: TracedMods, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
) -> Tensor | None:
    """The masks on broadcast int64 index tensors: bool, their broadcast shape (``None``
    without masks)."""
    if not traced.masks:
        return None
    values = dict(zip(INDEX_NAMES, (b, h, q_idx, kv_idx), strict=True))
    results = _evaluate(traced, [f.result for f in traced.masks], values)
    keep = torch.ones((), dtype=torch.bool, device=q_idx.device)
    for result in results:
        keep = keep & torch.as_tensor(result, device=q_idx.device).bool()
    # a mask that reads no index (a constant True or False) still covers the grid
    return keep.expand(torch.broadcast_shapes(keep.shape, q_idx.shape, kv_idx.shape))


def score_grid(
    traced: TracedMods, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
) -> Tensor:
    """The score functions applied in order to ``score`` (differentiable in the score and
    in the parameters)."""
    if not traced.scores:
        return score
    values = dict(zip(INDEX_NAMES, (b, h, q_idx, kv_idx), strict=True), score=score)
    # each score function was traced on the result of the one before: the last is all
    (result,) = _evaluate(traced, [traced.scores[-1].result], values)
    return result


# -- tensor reads: within their tensors, as eager PyTorch indexes ------------------------------


def check_reads(
    traced: TracedMods, batch: int | None, heads: int, length_q: int, length_kv: int
) -> None:
    """Prove that every tensor read of the functions stays within its tensor on a call of
    ``(B, Hq, L, S)`` = ``(batch, heads, length_q, length_kv)`` (``batch`` ``None``: one
    row): each index in ``[-size, size)``, a negative one counting from the end as in
    eager PyTorch. The kernels rely on it (they wrap negative indices and clamp only as a
    memory guard).

    Interval bounds of every node over the call's positions first (no device work); then
    the integer tensors read on the way to an index still unbounded, bounded by their
    least and greatest values (one host synchronisation per new version of them); then an
    index still unbounded is evaluated on the grid of the positions it reads (at most
    :data:`EXACT_LIMIT` of them). A proof is kept per call shape, numbers and tensors
    (with the versions of those whose values it read), so a repeated call costs a lookup
    and a comparison of them.

    Raises:
        IndexError: a read reaches outside its tensor; the message names the function,
            the tensor, the dimension, its size and the range the indices reach.
        ValueError: a read cannot be proven in range: an index of too many positions or of
            the score, or a proof that needs tensor values while ``torch.compile`` traces
            or a CUDA graph is being captured.
    """
    shape = (1 if batch is None else batch, heads, length_q, length_kv)
    proven: dict[Any, Any] | None = traced.__dict__.get("_proven")
    if proven is None:
        proven = traced.__dict__["_proven"] = {}
    found = proven.get(shape)
    if found is not None and _still_proven(found, traced):
        return
    reads = traced.read_list()
    if not reads or min(shape) <= 0:
        return
    if torch.compiler.is_compiling():
        _prove_reads(traced, shape, reads)  # bounds alone: no synchronisation, nothing kept
        return
    used, deferred = _prove_reads(traced, shape, reads)
    versions = tuple((slot, _version(traced.params[slot])) for slot in used)
    if not deferred and all(version is not None for _, version in versions):
        if len(proven) >= _PROVEN_LIMIT:
            proven.pop(next(iter(proven)), None)
        proven[shape] = (
            list(traced.consts),
            tuple(weakref.ref(p) for p in traced.params),
            tuple(p.shape for p in traced.params),
            versions,
        )


def proven_on_device(
    traced: TracedMods, shape: tuple[int, int, int, int], read: tuple[int, int], key: Any
) -> None:
    """Keep that the device found ``read`` within its tensor on a call of ``shape``, for
    the numbers and tensor versions of :func:`proof_key` ``key`` (those of the check)."""
    kept = traced.__dict__.setdefault("_device_proven", {})
    if len(kept) >= _PROVEN_LIMIT:
        kept.clear()
    kept[shape, read] = key


def proof_key(traced: TracedMods, read: tuple[int, int]) -> tuple[Any, ...]:
    """The numbers, and the tensors (by identity and version) ``read``'s index reads."""
    tables = _tables(traced, _index_of(traced, read))
    return (
        tuple((type(c), c) for c in traced.consts),
        tuple((slot, id(traced.params[slot]), _version(traced.params[slot])) for slot in tables),
    )


def read_versions(traced: TracedMods) -> tuple[int, ...] | None:
    """The versions of the tensors that the indices of reads are computed from (``ids`` of
    ``table[ids[q_idx]]``), whose values :func:`check_reads` may read: a cache of calls
    that skips it must hold them, so that a call after an in-place write proves its reads
    again. ``None`` where one has no version counter (an inference tensor: such calls are
    not for a cache)."""
    found = traced.__dict__.get("_index_tables")
    if found is None:
        found = traced.__dict__["_index_tables"] = sorted(
            {
                traced.nodes[i].args[0]
                for read in traced.read_list()
                for i in traced.ancestors(_index_of(traced, read))
                if traced.nodes[i].op == "load"
            }
        )
    versions = [_version(traced.params[slot]) for slot in found]
    return None if None in versions else tuple(v for v in versions if v is not None)


#: An index the interval bounds leave open is evaluated on the grid of the positions it reads
#: where that grid has at most this many elements (:func:`check_reads`).
EXACT_LIMIT = 2**24
#: Proofs of calls kept per graph (:func:`check_reads`).
_PROVEN_LIMIT = 32
#: Least and greatest values of integer tensors read as indices, at their version then.
_VALUE_BOUNDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _version(tensor: Tensor) -> int | None:
    """``tensor``'s version counter (an in-place write bumps it), ``None`` where it has none
    (an inference tensor)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


def _still_proven(found: Any, traced: TracedMods) -> bool:
    """Whether a proof kept for a call shape holds for ``traced`` now: the same numbers, the
    same tensors of the same shapes, and those whose values it read at the same versions."""
    numbers, refs, shapes, versions = found
    params = traced.params
    return (
        numbers == traced.consts
        and all(ref() is p for ref, p in zip(refs, params, strict=True))
        and all(p.shape == shape for p, shape in zip(params, shapes, strict=True))
        and all(_version(params[slot]) == version for slot, version in versions)
    )


def _sync_refused(device: torch.device) -> str | None:
    """Why reading a value of ``device`` on the host cannot happen now (``None``: it can)."""
    if torch.compiler.is_compiling():
        return "while torch.compile traces the call"
    if (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.is_current_stream_capturing()
    ):
        return "while a CUDA graph is being captured"
    return None


def _index_of(traced: TracedMods, read: tuple[int, int]) -> int:
    node_id, dim = read
    return int(traced.nodes[node_id].args[1 + dim])


def _size_of(traced: TracedMods, read: tuple[int, int]) -> int:
    node_id, dim = read
    return int(traced.params[traced.nodes[node_id].args[0]].shape[dim])


def _out_of_range(
    traced: TracedMods,
    read: tuple[int, int],
    low: float,
    high: float,
    shape: tuple[int, ...] | None = None,
) -> IndexError:
    """The error of a read whose indices reach ``[low, high]``, beyond its tensor."""
    node_id, dim = read
    param = traced.params[traced.nodes[node_id].args[0]]
    size = _size_of(traced, read)
    call = "" if shape is None else f" on a call of (B, Hq, L, S)={shape}"
    bound = f" (.clamp(0, {size - 1}) or % {size})" if size > 0 else ""
    return IndexError(
        f"{traced.function_of(node_id)} reads a tensor of shape {tuple(param.shape)} "
        f"({param.dtype}) at dim {dim} with indices reaching [{int(low)}, {int(high)}]{call}, "
        f"outside its size {size} (indices in [-{size}, {size - 1}] read as eager PyTorch "
        f"does, negative ones from the end); make the tensor cover every position, or bound "
        f"the index in the function{bound}"
    )


def _unproven(traced: TracedMods, read: tuple[int, int], why: str) -> ValueError:
    """The error of a read that cannot be proven within its tensor, ``why``."""
    node_id, dim = read
    param = traced.params[traced.nodes[node_id].args[0]]
    size = _size_of(traced, read)
    return ValueError(
        f"{traced.function_of(node_id)} reads a tensor of shape {tuple(param.shape)} "
        f"({param.dtype}) at dim {dim} with an index that cannot be proven within "
        f"[-{size}, {size - 1}]: {why}; bound the index in the function (.clamp(0, "
        f"{max(size - 1, 0)}) or % {size}) so that its range is known without the call"
    )


def _within(traced: TracedMods, ranges: list[_Range], read: tuple[int, int]) -> bool:
    low, high, _ = ranges[_index_of(traced, read)]
    size = _size_of(traced, read)
    return -size <= low and high < size


def _tight(traced: TracedMods, node_id: int) -> bool:
    """Whether interval arithmetic bounds ``node_id`` exactly: sums, differences, negations,
    minima and maxima of positions and numbers (and products with a number), each position
    used once, every corner of the call's grid then being reached."""
    seen: set[int] = set()

    def walk(current: int) -> bool:
        node = traced.nodes[current]
        if node.op == "const":
            return True
        if node.op == "input":
            if node.args[0] == "score" or current in seen:
                return False
            seen.add(current)
            return True
        if node.op == "cast":
            source = traced.nodes[node.args[0]].kind
            return node.args[1:] == ("int", 64) and source == "int" and walk(node.args[0])
        if node.op in ("add", "sub", "minimum", "maximum"):
            return all(walk(arg) for arg in node.args)
        if node.op == "neg":
            return walk(node.args[0])
        if node.op == "mul":
            consts = [arg for arg in node.args if traced.nodes[arg].op == "const"]
            others = [arg for arg in node.args if traced.nodes[arg].op != "const"]
            return len(consts) >= 1 and all(walk(arg) for arg in others)
        return False

    return walk(node_id)


def _tables(traced: TracedMods, index: int) -> list[int]:
    """The slots of the tensors whose values node ``index`` is computed from."""
    return sorted(
        {traced.nodes[i].args[0] for i in traced.ancestors(index) if traced.nodes[i].op == "load"}
    )


def _integer_tables(traced: TracedMods, index: int) -> list[int]:
    """The slots of the integer tensors whose values ``index`` is computed from."""
    return sorted(
        {
            traced.nodes[i].args[0]
            for i in traced.ancestors(index)
            if traced.nodes[i].op == "load" and traced.nodes[i].kind == "int"
        }
    )


def _tensor_bounds(
    traced: TracedMods, slots: list[int], read: tuple[int, int]
) -> dict[int, _Range]:
    """The least and greatest values of the integer tensors in ``slots``, by slot: kept per
    tensor and version, the others read in one host synchronisation (refused where none can
    happen, naming ``read``, the read that needs them). Empty tensors are left out."""
    why = "its range depends on the values of an integer tensor, which cannot be read"
    if torch.compiler.is_compiling():  # (a traced graph cannot read them, nor keep them)
        raise _unproven(traced, read, f"{why} while torch.compile traces the call")
    found: dict[int, _Range] = {}
    fresh = []
    for slot in slots:
        param = traced.params[slot]
        if param.numel() == 0:
            continue
        version = _version(param)
        kept = _VALUE_BOUNDS.get(param) if version is not None else None
        if kept is not None and kept[0] == (version, tuple(param.shape)):
            found[slot] = kept[1]
        else:
            fresh.append(slot)
    if not fresh:
        return found
    refusal = _sync_refused(traced.params[fresh[0]].device)
    if refusal is not None:
        raise _unproven(
            traced,
            read,
            f"{why} {refusal} (run the call once before capturing: the values read then are "
            f"kept until the tensor changes)",
        )
    extremes = torch.stack(
        [
            torch.stack(torch.aminmax(traced.params[slot].detach().reshape(-1))).to(torch.int64)
            for slot in fresh
        ]
    ).tolist()  # one host synchronisation
    for slot, (low, high) in zip(fresh, extremes, strict=True):
        param = traced.params[slot]
        found[slot] = (float(low), float(high), False)
        version = _version(param)
        if version is not None:
            _VALUE_BOUNDS[param] = ((version, tuple(param.shape)), found[slot])
    return found


def _evaluated_bounds(
    traced: TracedMods, read: tuple[int, int], shape: tuple[int, int, int, int]
) -> tuple[int, int] | None:
    """The least and greatest index of ``read`` on the call, evaluated with torch operations
    on the grid of the positions the index reads (on its tensors' device; one host
    synchronisation). Past :data:`EXACT_LIMIT` positions on a GPU, ``None``: the bounds are
    found on the device and read at the next call (:func:`check_errors`). Raises the
    ValueError of :func:`_unproven` where neither can be done (a CPU tensor past the limit,
    an index of the score, a capture or a trace that cannot synchronise)."""
    index = _index_of(traced, read)
    ancestors = traced.ancestors(index)
    if traced.inputs["score"] in ancestors:
        raise _unproven(traced, read, "the index depends on the score")
    names = [name for name in INDEX_NAMES if traced.inputs[name] in ancestors]
    sizes = dict(zip(INDEX_NAMES, shape, strict=True))
    count = math.prod(sizes[name] for name in names)
    tables = _tables(traced, index)
    device = traced.params[tables[0]].device if tables else torch.device("cpu")
    refusal = _sync_refused(device)
    if refusal is not None:
        raise _unproven(
            traced,
            read,
            f"its bounds are not known from the operations, and evaluating it cannot happen "
            f"{refusal}",
        )
    if count > EXACT_LIMIT and _defers(device):
        _check_on_device(traced, read, shape, names, device)
        return None
    if count > EXACT_LIMIT:
        raise _unproven(
            traced,
            read,
            f"its bounds are not known from the operations, and the {count} positions it "
            f"reads on this call are more than the {EXACT_LIMIT} evaluated on the host to find "
            f"them",
        )
    low, high = torch.stack(_index_bounds(traced, index, sizes, names, device)).tolist()
    return int(low), int(high)  # (a synchronisation)


def _index_bounds(
    traced: TracedMods,
    index: int,
    sizes: dict[str, int],
    names: list[str],
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """The least and greatest value of node ``index`` over the grid of the positions ``names``
    of ``sizes``, as int64 tensors on ``device`` (no synchronisation), evaluated in slices of
    at most :data:`EXACT_LIMIT` positions along the longest axis."""
    longest = max(names, key=lambda name: sizes[name])
    rest = math.prod(sizes[name] for name in names if name != longest)
    step = max(1, EXACT_LIMIT // max(rest, 1))
    low = high = None
    for first in range(0, sizes[longest], step):
        grids = {}
        for axis, name in enumerate(INDEX_NAMES):
            if name in names:
                view = [1] * len(INDEX_NAMES)
                stop = min(first + step, sizes[name]) if name == longest else sizes[name]
                start = first if name == longest else 0
                view[axis] = stop - start
                grids[name] = torch.arange(start, stop, device=device).reshape(view)
        value = evaluate(traced, index, **grids).to(device=device, dtype=torch.int64)
        part_low, part_high = torch.aminmax(value.reshape(-1))
        low = part_low if low is None else torch.minimum(low, part_low)
        high = part_high if high is None else torch.maximum(high, part_high)
    assert low is not None and high is not None
    return low, high


def _defers(device: torch.device) -> bool:
    """Whether a read past :data:`EXACT_LIMIT` positions is checked on ``device`` while the
    kernels run (a GPU: no synchronisation) rather than refused (on the CPU that would be
    unbounded host work on every call until it is read)."""
    return device.type != "cpu"


#: Reads checked on the device for a call whose host proof was inconclusive, each with the
#: bounds its indices reached there (no synchronisation yet): read by :func:`check_errors`.
_PENDING: list[
    tuple[TracedMods, tuple[int, int], tuple[int, int, int, int], Tensor, Tensor, Any]
] = []
_PENDING_LOCK = threading.Lock()


def _check_on_device(
    traced: TracedMods,
    read: tuple[int, int],
    shape: tuple[int, int, int, int],
    names: list[str],
    device: torch.device,
) -> None:
    sizes = dict(zip(INDEX_NAMES, shape, strict=True))
    low, high = _index_bounds(traced, _index_of(traced, read), sizes, names, device)
    key = proof_key(traced, read)  # the numbers and versions the check was made with
    with _PENDING_LOCK:
        _PENDING.append((traced, read, shape, low, high, key))


def pending_checks() -> bool:
    """Whether a device-side check of an earlier call's reads is still to be read."""
    return bool(_PENDING)


def check_errors() -> None:
    """Read the device-side checks of earlier calls (one synchronisation, only where one is
    pending): raises the ``IndexError`` of a read that went outside its tensor, naming the
    call; that call's output is not to be trusted (the kernels only kept its loads in
    memory). Called at the start of each eager call of :func:`attnbias.sdpa`."""
    with _PENDING_LOCK:
        pending = list(_PENDING)
        _PENDING.clear()
    for traced, read, shape, low, high, key in pending:
        low_value, high_value = torch.stack((low, high)).tolist()
        size = _size_of(traced, read)
        if low_value < -size or high_value >= size:
            # the same read with the same numbers and tensors raises at once from now on
            failed = traced.__dict__.setdefault("_device_failed", {})
            failed[shape, read] = (key, low_value, high_value)
            error = _out_of_range(traced, read, low_value, high_value, shape)
            raise IndexError(
                f"an earlier call (its index bounds could not be proven on the host, so they "
                f"were checked on the device; its output is wrong): {error}"
            )
        proven_on_device(traced, shape, read, key)


def _prove_reads(
    traced: TracedMods, shape: tuple[int, int, int, int], reads: list[tuple[int, int]]
) -> tuple[list[int], bool]:
    """:func:`check_reads` for a call of ``shape`` ``(B, Hq, L, S)``, none empty:
    raises where a read is out of range or unproven; returns the slots of the tensors whose
    values the proof read (a proof by bounds alone reads none), and whether a read is left to
    a check on the device (:func:`check_errors`)."""
    inputs = {
        name: (0.0, float(size - 1), False) for name, size in zip(INDEX_NAMES, shape, strict=True)
    }
    ranges = value_ranges(traced, inputs)
    open_reads = [read for read in reads if not _within(traced, ranges, read)]
    if not open_reads:
        return [], False
    for read in open_reads:
        low, high, _ = ranges[_index_of(traced, read)]
        size = _size_of(traced, read)
        if _tight(traced, _index_of(traced, read)) or high < -size or low >= size:
            raise _out_of_range(traced, read, low, high, shape)
    used: set[int] = set()
    slots = sorted(
        {s for read in open_reads for s in _integer_tables(traced, _index_of(traced, read))}
    )
    if slots:
        loads = _tensor_bounds(traced, slots, open_reads[0])
        used.update(loads)
        ranges = value_ranges(traced, inputs, loads)
        open_reads = [read for read in open_reads if not _within(traced, ranges, read)]
    deferred = False
    for read in open_reads:
        used.update(_tables(traced, _index_of(traced, read)))
        key = proof_key(traced, read)  # what a check on the device found holds for
        if traced.__dict__.get("_device_proven", {}).get((shape, read)) == key:
            continue
        failed = traced.__dict__.get("_device_failed", {}).get((shape, read))
        if failed is not None and failed[0] == key:
            raise _out_of_range(traced, read, failed[1], failed[2], shape)
        bounds = _evaluated_bounds(traced, read, shape)
        if bounds is None:  # checked on the device, read at the next call
            deferred = True
            continue
        low, high = bounds
        size = _size_of(traced, read)
        if low < -size or high >= size:
            raise _out_of_range(traced, read, low, high, shape)
    return sorted(used), deferred

"""A ModBias computes with the values its functions read at the time of each call.

A number in a closure, a field of a (non-frozen) dataclass, an attribute set in ``__init__``, a
module global and a tensor a closure is rebound to, each changed five times between calls:
every call agrees with the fp64 oracle (``attnbias.testing.oracle``, which runs the functions
eagerly with the values of the moment), on the exact path and on the Triton kernel (interpreted
on the CPU, compiled on a GPU). Counted: such a change traces nothing and generates no new
source (the trace takes these numbers as runtime arguments, written anew where they change); an
unchanged call traces nothing. A number the function computes with on the Python side, or one
that a helper function reads as well, traces the functions once per change and still generates
no new source. A Python branch on a closure value gives the other function's graph.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

import attnbias
from attnbias import ModBias, use_backends
from attnbias.kernels import modfn
from attnbias.mods import trace
from attnbias.testing.oracle import assert_call_close

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]
ROUTES = ["reference", "triton"]
SHAPE = (1, 2, 16, 16)  # B, H, L = S, E: one tile of the interpreted kernel


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of times functions were traced so far (one element, updated)."""
    count = [0]
    original = trace.trace_mods

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(trace, "trace_mods", counting)
    yield count


def _inputs(device: str, seed: int) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q, k, v, grad = (torch.randn(SHAPE, generator=generator).to(device) for _ in range(4))
    return (q, k, v), grad


def _check(bias: ModBias, device: str, route: str, seed: int) -> None:
    inputs, grad = _inputs(device, seed)
    # a flash kernel's budget includes its own rounding, as every kernel test's does
    with use_backends(route):
        assert_call_close(lambda q, k, v: attnbias.sdpa(q, k, v, attn_mask=bias), bias,
                          inputs, grad, flash=route == "triton")  # fmt: skip


def _changes(
    bias: ModBias,
    change: Callable[[Any], None],
    values: list[Any],
    device: str,
    route: str,
    traces: list[int],
    per_change: int = 0,
) -> None:
    """Call, then for each value: ``change(value)``, call (right each time), counted: each
    change traces the functions ``per_change`` times."""
    _check(bias, device, route, 0)
    _check(bias, device, route, 1)  # nothing changed: nothing traced
    before, sources = traces[0], len(modfn._SOURCES)
    _check(bias, device, route, 2)
    assert traces[0] == before, "a call with nothing changed traced the functions again"
    for n, value in enumerate(values):
        change(value)
        _check(bias, device, route, 3 + n)
        assert traces[0] == before + (n + 1) * per_change, (
            f"change {n}: traced {traces[0] - before} times"
        )
    assert len(modfn._SOURCES) == sources, "a new value generated new source"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_closure_number(device: str, route: str, traces: list[int]) -> None:
    slope = 0.5
    reach = 3

    def score(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return s - slope * (q_idx - kv_idx).abs()

    def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx) % 4 < reach) | (kv_idx == 0)

    bias = ModBias(mask_mod=mask, score_mod=score)

    def change(value: tuple[float, int]) -> None:
        nonlocal slope, reach
        slope, reach = value

    values = [(1.5, 1), (0.0, 4), (-0.25, 2), (3.0, 2), (0.125, 3)]
    _changes(bias, change, values, device, route, traces)


@dataclass
class Stripes(ModBias):
    """A plain (not frozen) dataclass: its field can be assigned."""

    period: int
    weight: float

    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx % self.period != 1) | (q_idx == kv_idx)

    def score_mod(self, s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return s + self.weight * h


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_dataclass_field(device: str, route: str, traces: list[int]) -> None:
    bias = Stripes(period=3, weight=0.5)

    def change(value: tuple[int, float]) -> None:
        bias.period, bias.weight = value

    values = [(2, -1.0), (5, 0.0), (7, 2.5), (3, 0.75), (4, -0.5)]
    _changes(bias, change, values, device, route, traces)


class Reach(ModBias):
    """An attribute set in ``__init__`` and read by the method."""

    def __init__(self, reach: int) -> None:
        super().__init__()
        self.reach = reach

    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx - kv_idx).abs() * 2 <= self.reach


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("device", DEVICES)
def test_an_attribute(device: str, route: str, traces: list[int]) -> None:
    bias = Reach(4)

    def change(value: int) -> None:
        bias.reach = value

    _changes(bias, change, [9, 3, 30, 2, 5], device, route, traces)


OFFSET = 2


def _global_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return kv_idx <= q_idx + OFFSET


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_module_global(device: str, route: str, traces: list[int]) -> None:
    module = sys.modules[__name__]
    bias = ModBias(mask_mod=_global_mask)
    try:
        _changes(bias, lambda value: setattr(module, "OFFSET", value), [0, 7, -3, 15, 1],
                 device, route, traces)  # fmt: skip
    finally:
        module.OFFSET = 2  # type: ignore[attr-defined]


@pytest.mark.parametrize("device", DEVICES)
def test_a_rebound_tensor_and_a_branch_on_a_closure_value(device: str) -> None:
    """A closure rebound to another tensor reads the new one; a Python ``if`` on a closure
    flag (not on the indices) gives the other branch's graph at the next call."""
    # (seeded: drawn from the global generator, the tables depended on the tests a worker
    # ran before this one)
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(SHAPE[1], 2 * SHAPE[2], generator=generator).to(device)
    symmetric = True

    def score(s: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        if symmetric:
            return s + table[h, (q_idx - kv_idx).abs()]
        return s + table[h, q_idx + kv_idx]

    bias = ModBias(score_mod=score)
    for n in range(5):
        _check(bias, device, "triton", n)
        table = torch.randn(SHAPE[1], 2 * SHAPE[2], generator=generator).to(device)
        symmetric = not symmetric


@pytest.mark.parametrize("route", ["reference"])  # (what traces again is route-independent)
@pytest.mark.parametrize("case", ["python_side", "type_test", "helper_reads_it"])
def test_numbers_the_trace_cannot_take_as_runtime_numbers(
    case: str, route: str, traces: list[int]
) -> None:
    """Where the trace cannot stand for a number, a change traces again (once) and the call is
    still right: a number the function computes with on the Python side (``reach - 1``), a
    type test on one, and a cell a helper function reads too."""
    reach = 3

    def python_side(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx).abs() <= reach - 1) | (q_idx == kv_idx)

    def type_test(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx - kv_idx).abs() <= (reach if isinstance(reach, int) else 0)

    def helper(kv_idx: Any) -> Any:
        return kv_idx % 8 == reach

    def helper_reads_it(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx).abs() <= reach) | helper(kv_idx)

    mask = {"python_side": python_side, "type_test": type_test}.get(case, helper_reads_it)
    bias = ModBias(mask_mod=mask)

    def change(value: int) -> None:
        nonlocal reach
        reach = value

    _changes(bias, change, [5, 2, 7, 3, 4], "cpu", route, traces, per_change=1)


class Shared(ModBias):
    """An attribute the bias's method reads from ``self`` and a helper from the bias held in
    a module-level registry: a change reaches the helper too."""

    def __init__(self, reach: int) -> None:
        super().__init__()
        self.reach = reach

    def mask_mod(self, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx).abs() <= self.reach) | _registered_reach(kv_idx)


REGISTRY: list[Shared] = []


def _registered_reach(kv_idx: Any) -> Any:
    return kv_idx == REGISTRY[0].reach


@pytest.mark.parametrize("route", ["reference"])
def test_an_attribute_also_read_through_another_path(route: str, traces: list[int]) -> None:
    bias = Shared(2)
    REGISTRY.append(bias)
    try:

        def change(value: int) -> None:
            bias.reach = value

        _changes(bias, change, [5, 1, 7, 3, 0], "cpu", route, traces, per_change=1)
    finally:
        REGISTRY.clear()


@pytest.mark.gpu
def test_numbers_that_triton_would_specialize_compile_nothing_new(traces: list[int]) -> None:
    """Triton specializes integer arguments equal to 1 or divisible by 16; the functions'
    numbers are marked not to be, so a closure number moving through such values compiles no
    kernel (counted at Triton's compiler) and traces nothing."""
    import triton.compiler

    reach = 3

    def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return ((q_idx - kv_idx).abs() <= reach) | (kv_idx == 0)

    bias = ModBias(mask_mod=mask)
    _check(bias, "cuda", "triton", 0)  # compiles the kernels once
    compiled: list[str] = []
    original = triton.compiler.compile

    def counting(*args: Any, **kwargs: Any) -> Any:
        compiled.append(str(getattr(getattr(args[0], "fn", None), "__name__", args[0])))
        return original(*args, **kwargs)

    before = traces[0]
    try:
        triton.compiler.compile = counting
        for n, value in enumerate([16, 1, 32, 5, 48]):
            reach = value
            _check(bias, "cuda", "triton", 1 + n)
    finally:
        triton.compiler.compile = original
    assert compiled == [], compiled
    assert traces[0] == before


def test_under_torch_compile_a_changed_value_is_never_used_stale() -> None:
    """The compiler guards on the values a ModBias reads: a compiled call after a change
    either runs with the new values (without ``fullgraph=True``, eagerly; with it, after one
    call outside the compiled function) or, under ``fullgraph=True`` without that call,
    raises naming the fix. Never the old values."""
    torch._dynamo.reset()
    reach = 3

    def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx - kv_idx).abs() <= reach

    bias = ModBias(mask_mod=mask)
    inputs, grad = _inputs("cpu", 0)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attnbias.sdpa(q, k, v, attn_mask=bias)

    # the kernels do not run under torch.compile on the interpreter: the CPU's exact route
    with use_backends("reference"):
        loose = torch.compile(attend, backend="aot_eager")
        for value in (3, 6, 1, 4, 9):
            reach = value
            assert_call_close(loose, bias, inputs, grad)
        torch._dynamo.reset()
        whole = torch.compile(attend, backend="aot_eager", fullgraph=True)
        assert_call_close(whole, bias, inputs, grad)
        for value in (5, 2, 7):
            reach = value
            with pytest.raises(Exception, match="changed since the bias was last used outside"):
                whole(*inputs)
            attnbias.sdpa(*inputs, attn_mask=bias)  # once outside: the next compiled call is right
            assert_call_close(whole, bias, inputs, grad)


def test_the_registry_of_generated_forms_keeps_no_tensor_of_the_user() -> None:
    """The registered ops carry a form's number; the registry's template must not keep the
    tensors of the first bias of that form alive after the bias is gone."""
    import gc
    import weakref

    from attnbias.kernels.modfn import CompiledMods

    def made() -> tuple[CompiledMods, Any]:
        table = torch.randn(4, 8)
        traced = trace.trace_mods([], [lambda s, b, h, q, kv: s + table[h, kv % 8]])
        return CompiledMods.of(traced), weakref.ref(table)

    compiled, gone = made()
    number = compiled.register()
    assert compiled.traced.params[0] is gone()  # the form in use holds it
    del compiled
    gc.collect()
    assert gone() is None
    # a call of the same form hands its own tensors to the registered form
    other = torch.randn(4, 8)
    again = CompiledMods.of(trace.trace_mods([], [lambda s, b, h, q, kv: s + other[h, kv % 8]]))
    assert again.register() == number
    tensors: list[Any] = []
    ints: list[int] = []
    floats: list[float] = []
    again.pack_into(tensors, ints, floats)
    unpacked = CompiledMods.unpack_from(number, iter(tensors), iter(ints), iter(floats))
    assert len(unpacked.traced.params) == 1 and unpacked.traced.params[0] is other
    assert unpacked.traced.consts == again.traced.consts

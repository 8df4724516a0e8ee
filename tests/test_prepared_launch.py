"""Prepared launches: a repeated call runs the forward (and, in training, the backward) planned
for its identity (the training and the decode kernel), gives what a fresh call gives, and never
runs a plan made for other inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    SlidingWindowBias,
    SoftcapBias,
    causal_lower_right,
    plan_cache,
)
from attnbias.kernels import backward, decode, forward, launch
from attnbias.kernels.ops import block_sparse_attention
from attnbias.kernels.program import MaskProgram
from attnbias.testing.oracle import assert_close_to_oracle, attention, run_with_grads

# the kernels run on the GPU where there is one, under the interpreter otherwise
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

KERNELS = {
    # backend, the planning function it prepares with, query length
    "training": ("triton", forward, "plan_forward", 24),
    "decode": ("triton-decode", decode, "plan_decode", 3),
}


@pytest.fixture(autouse=True)
def fresh_plans() -> None:
    plan_cache.clear()


def counted_plans(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """Every plan ``module.name`` makes."""
    made: list[Any] = []
    original = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(original(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(module, name, counting)
    return made


def inputs(
    length_q: int, length_kv: int = 40, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(  # type: ignore[return-value]
        torch.randn(2, 2, length, 16, generator=generator).to(DEVICE, dtype)
        for length in (length_q, length_kv, length_kv)
    )


def check(q: Tensor, k: Tensor, v: Tensor, bias: AttnBias, out: Tensor) -> None:
    oracle = attention(q, k, v, bias)
    # on fresh copies: stock SDPA's CUDA kernels fail on misaligned float32 inputs ("misaligned
    # address", torch 2.11), which the kernels here take
    stock = attention(q.clone(), k.clone(), v.clone(), bias, dtype=q.dtype)
    assert_close_to_oracle([out], [oracle], [stock], q.dtype)


def biases(length_q: int, length_kv: int) -> dict[str, AttnBias]:
    return {
        "causal": causal_lower_right(),
        "window": causal_lower_right() + SlidingWindowBias(5),
        "alibi": causal_lower_right() + AlibiBias(2),
        "softcap": SoftcapBias(4.0) + SlidingWindowBias(7, 3),
        "documents": DocumentBias.from_seqlens(
            [length_q // 2, length_q - length_q // 2], [length_kv // 2, length_kv - length_kv // 2]
        ),
    }


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("bias_name", ["causal", "window", "alibi", "softcap", "documents"])
def test_a_prepared_plan_gives_what_a_fresh_call_gives(
    monkeypatch: pytest.MonkeyPatch, kernel: str, bias_name: str
) -> None:
    backend, module, name, length_q = KERNELS[kernel]
    made = counted_plans(monkeypatch, module, name)
    q, k, v = inputs(length_q)
    bias = biases(length_q, k.shape[2])[bias_name]
    with torch.no_grad(), attnbias.use_backends(backend):
        outs = [attnbias.sdpa(q, k, v, attn_mask=bias) for _ in range(3)]
        assert len(made) == 1  # planned once, then launched
        lowered = attnbias.spec.lower(bias, length_q, k.shape[2], q.device, batch=q.shape[0])
        fresh = getattr(module, name)(q, k, v, lowered.program, scale=16**-0.5).launch(q, k, v)
    fresh_out = fresh[0] if kernel == "training" else fresh
    for out in outs:
        assert torch.equal(out, fresh_out)
    check(q, k, v, bias, outs[-1])


@pytest.mark.parametrize("bias_name", ["causal", "window", "alibi", "softcap", "documents"])
def test_a_training_call_reuses_its_forward_and_backward_plans(
    monkeypatch: pytest.MonkeyPatch, bias_name: str
) -> None:
    made = counted_plans(monkeypatch, forward, "plan_forward")
    made_backward = counted_plans(monkeypatch, backward, "plan_backward")
    q, k, v = inputs(24)
    bias = biases(24, k.shape[2])[bias_name]
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def call(*leaves: Tensor) -> Tensor:
        return attnbias.sdpa(*leaves, attn_mask=bias)

    with attnbias.use_backends("triton"):
        runs = [run_with_grads(call, (q, k, v), grad_out) for _ in range(3)]
    assert len(made) == 1  # planned with the call's decision, then launched
    assert len(made_backward) == 1  # the backward too (a fresh one each call would count 4)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))
    oracle = run_with_grads(lambda *t: attention(*t, bias), (q, k, v), grad_out)
    stock = run_with_grads(
        lambda *t: attention(*t, bias, dtype=q.dtype), (q.clone(), k.clone(), v.clone()), grad_out
    )
    assert_close_to_oracle(runs[0], oracle, stock, q.dtype, names=("out", "dq", "dk", "dv"))


def _misaligned(t: Tensor) -> Tensor:
    storage = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = storage[1:].view(t.shape)
    view.copy_(t)
    return view


# Each variant of the first call: whether it needs a plan of its own.
VARIANTS: dict[str, tuple[Callable[[Tensor, Tensor, Tensor], tuple[Tensor, ...]], bool]] = {
    "same": (lambda q, k, v: (q, k, v), False),
    "other contents": (lambda q, k, v: (q.flip(2).contiguous(), k, v * 2), False),
    "another query length": (lambda q, k, v: (q[:, :, :-1], k, v), True),
    "another key length": (lambda q, k, v: (q, k[:, :, :-3], v[:, :, :-3]), True),
    "another dtype": (lambda q, k, v: (q.half(), k.half(), v.half()), True),
    # another layout is another call (the fastest backend depends on it: routing by
    # measurement tells layouts apart), so it gets its own plan
    "non-contiguous": (
        lambda q, k, v: tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)),
        True,
    ),
    # alignment is per launch: the plan stays, the kernel follows it
    "misaligned": (lambda q, k, v: tuple(_misaligned(t) for t in (q, k, v)), False),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_plan_serves_only_its_identity(
    monkeypatch: pytest.MonkeyPatch, kernel: str, variant: str
) -> None:
    backend, module, name, length_q = KERNELS[kernel]
    made = counted_plans(monkeypatch, module, name)
    q, k, v = inputs(length_q)
    bias = causal_lower_right() + SlidingWindowBias(6)
    change, replans = VARIANTS[variant]
    with torch.no_grad(), attnbias.use_backends(backend):
        check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
        q2, k2, v2 = change(q, k, v)
        check(q2, k2, v2, bias, attnbias.sdpa(q2, k2, v2, attn_mask=bias))
    assert len(made) == (2 if replans else 1)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_another_bias_gets_another_plan(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    backend, module, name, length_q = KERNELS[kernel]
    made = counted_plans(monkeypatch, module, name)
    q, k, v = inputs(length_q)
    with torch.no_grad(), attnbias.use_backends(backend):
        for bias in biases(length_q, k.shape[2]).values():
            check(q, k, v, bias, attnbias.sdpa(q, k, v, attn_mask=bias))
    assert len(made) == 5


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_a_plan_refuses_other_inputs(kernel: str) -> None:
    _, module, name, length_q = KERNELS[kernel]
    q, k, v = inputs(length_q)
    plan = getattr(module, name)(q, k, v, MaskProgram(band_hi=0), scale=0.25)
    with pytest.raises(ValueError, match="plan was made for q, k, v of shapes"):
        plan.launch(q[:, :, :-1], k, v)
    with pytest.raises(ValueError, match="make a new plan"):
        plan.launch(q.double(), k.double(), v.double())


def test_no_autograd_node_without_gradients() -> None:
    q, k, v = inputs(8)
    causal = MaskProgram(band_hi=0)
    with torch.no_grad():
        q.requires_grad_()
        assert block_sparse_attention(q, k, v, causal, scale=0.25).grad_fn is None
    assert block_sparse_attention(q.detach(), k, v, causal, scale=0.25).grad_fn is None
    out = block_sparse_attention(q, k, v, causal, scale=0.25)
    assert out.grad_fn is not None
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


class _FakeParam:
    def __init__(self, name: str) -> None:
        self.name = name
        self.is_constexpr = name == "BLOCK"
        self.do_not_specialize = False


class _FakeKernel:
    """Records launches through the jit function (compiling) and through compiled kernels."""

    def __init__(self) -> None:
        self.params = [_FakeParam(n) for n in ("X", "stride_x", "BLOCK")]
        self.launches: list[tuple[str, tuple[Any, ...]]] = []
        self.compiled_grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def jit_launch(*args: Any, **options: Any) -> Any:
            self.launches.append(("jit", args))
            kernel = self

            class Compiled:
                def __getitem__(self, grid: tuple[int, ...]) -> Any:
                    kernel.compiled_grids.append(grid)
                    return lambda *a: kernel.launches.append(("compiled", a))

            return Compiled()

        return jit_launch


def test_prepared_launch_reuses_a_compiled_kernel_per_call_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prepared launch calls the compiled kernel only for a call key it has seen, passing the
    constexprs after the arguments; an unseen key (another alignment) compiles through the
    launch cache, which keys on every argument. The compiled kernel's launcher gets a grid of
    three dimensions (it indexes all three), whatever the plan gave."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    fake = _FakeKernel()
    monkeypatch.setitem(launch.CACHED_LAUNCHES, fake, launch.CachedLaunch(fake))
    prepared = launch.PreparedLaunch(fake, (1,), {"BLOCK": 16, "num_warps": 4})
    assert prepared.direct()
    base = torch.zeros(64)
    x, y, odd = base[:16], base[16:32], base[1:17]
    prepared((1, True), x, 1)
    prepared((1, True), y, 1)
    assert fake.launches == [("jit", (x, 1)), ("compiled", (y, 1, 16))]
    prepared((1, False), odd, 1)
    assert fake.launches[-1] == ("jit", (odd, 1))
    prepared((1, False), odd, 1)
    assert fake.launches[-1] == ("compiled", (odd, 1, 16))
    assert fake.compiled_grids and set(fake.compiled_grids) == {(1, 1, 1)}
    with launch.traceable_launches():
        assert not prepared.direct()


class _Launcher:
    """A compiled kernel's launcher of the signature Triton's have (or ``signature``'s)."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def __call__(
        self, gridX: int, gridY: int, gridZ: int, stream: int, function: object,
        kernel_metadata: object, launch_metadata: object, launch_enter_hook: object,
        launch_exit_hook: object, *args: Any,
    ) -> None:  # fmt: skip
        self.calls.append(
            (gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
             launch_enter_hook, launch_exit_hook, *args)
        )  # fmt: skip


class _Compiled:
    def __init__(self, run: Any) -> None:
        self.run, self.function, self.packed_metadata = run, "fn", "meta"
        self.through_runner: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args: self.through_runner.append((grid, *args))


def test_a_kept_launch_calls_the_launcher_itself_unless_a_hook_is_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no launch hook registered, a kept launch calls the compiled kernel's launcher with
    the grid, the current stream of the given device, the kernel's function and metadata, no launch
    metadata and no hooks, then the arguments; with a hook registered (a profiler's), or a
    launcher of another signature, it goes through the compiled kernel's own closure."""
    from triton import knobs

    monkeypatch.setattr(launch, "_current_stream", lambda device: 1000 + device)
    calls: list[tuple[Any, ...]] = []
    compiled = _Compiled(_Launcher(calls))
    kept = launch.KeptLaunch(compiled)
    kept((4, 2, 1), 3, "x", 7)
    assert calls == [(4, 2, 1, 1003, "fn", "meta", None, None, None, "x", 7)]
    assert compiled.through_runner == []

    hooks = knobs.runtime.launch_enter_hook
    if hasattr(hooks, "add"):  # a chain of hooks
        hook = lambda metadata: None
        hooks.add(hook)
        try:
            kept((4, 2, 1), 3, "y", 8)
        finally:
            hooks.remove(hook)
    else:  # a single hook
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
        kept((4, 2, 1), 3, "y", 8)
        monkeypatch.undo()
        monkeypatch.setattr(launch, "_current_stream", lambda device: 1000 + device)
    assert compiled.through_runner == [((4, 2, 1), "y", 8)]
    assert len(calls) == 1
    kept((4, 2, 1), 3, "z", 9)
    assert calls[-1][-2:] == ("z", 9)

    def five_named(
        gridX: int, gridY: int, gridZ: int, stream: int, function: object, *args: Any
    ) -> None:  # (Triton 3.6's)
        calls.append((gridX, gridY, gridZ, stream, function, *args))

    launch.KeptLaunch(_Compiled(five_named))((2, 1, 1), 0, "v", 3)
    assert calls[-1] == (2, 1, 1, 1000, "fn", "meta", None, None, None, "v", 3)

    def other(grid: Any, stream: int, *args: Any) -> None:
        calls.append(("other", *args))

    odd = _Compiled(other)
    launch.KeptLaunch(odd)((1, 1, 1), 0, "w", 1)
    assert odd.through_runner == [((1, 1, 1), "w", 1)]
    assert calls[-1][-2:] == ("v", 3)


def test_a_planned_backward_under_create_graph_is_first_order_only() -> None:
    """A repeated training call (its backward planned) differentiated with ``create_graph``:
    the first-order gradients are the oracle's, and a second backward through them raises."""
    q, k, v = inputs(12)
    bias = causal_lower_right() + SlidingWindowBias(4)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with attnbias.use_backends("triton"):
        for _ in range(2):  # the second call runs the kept plan
            out = attnbias.sdpa(*leaves, attn_mask=bias)
        grads = torch.autograd.grad(out, leaves, grad_out, create_graph=True)
    oracle = run_with_grads(lambda *t: attention(*t, bias), (q, k, v), grad_out)
    stock = run_with_grads(
        lambda *t: attention(*t, bias, dtype=q.dtype), (q.clone(), k.clone(), v.clone()), grad_out
    )
    assert_close_to_oracle(
        [out.detach(), *(g.detach() for g in grads)], oracle, stock, q.dtype,
        names=("out", "dq", "dk", "dv"),
    )  # fmt: skip
    with pytest.raises(NotImplementedError):
        torch.autograd.grad(grads[0].sum(), leaves[0])

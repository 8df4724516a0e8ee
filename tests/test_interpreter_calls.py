"""The CPU tests' shortcut through Triton's interpreter (``tests/interpreter_calls.py``): a
kernel whose helpers it no longer re-patches for computes what it did, the language is
restored after each launch, and the helpers' calls inside a launch scan nothing."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only"
)


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))


@triton.jit
def _twice(x):
    return _softplus(x) + _softplus(-x)


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    total = tl.zeros((N,), tl.float32)
    for _ in tl.static_range(CALLS):
        total += _twice(x)
    tl.store(out_ptr + offs, total + tl.sum(x, axis=0))


def launch(calls: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-30, 30, 16)
    out = torch.empty_like(x)
    _kernel[(1,)](x, out, N=16, CALLS=calls)
    return x, out


def test_a_kernel_with_helpers_computes_what_torch_does() -> None:
    x, out = launch(3)
    want = 3 * (torch.nn.functional.softplus(x) + torch.nn.functional.softplus(-x)) + x.sum()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_the_language_is_restored_after_a_launch() -> None:
    spaces = (tl, tl.core, tl.math, tl.tensor)
    before = [
        {name: value for name in dir(space) if tl.core.is_builtin(value := getattr(space, name))}
        for space in spaces
    ]
    assert sum(map(len, before)) > 100
    launch(2)
    for space, was in zip(spaces, before, strict=True):
        changed = [name for name, value in was.items() if getattr(space, name) is not value]
        assert not changed, f"{space.__name__}: {changed} left patched"


def test_helpers_inside_a_launch_scan_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter

    scans = [0]
    scan = interpreter._patch_builtin

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        scans[0] += 1
        return scan(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    counts = []
    for calls in (0, 4):
        launch(calls)  # (compiled and rewritten on the first launch of each)
        scans[0] = 0
        launch(calls)
        counts.append(scans[0])
    # the launch's own patch only, however many helper calls (8 with four calls of _twice)
    assert counts[0] == counts[1] > 0, counts
    assert triton.runtime.interpreter._patch_lang.skips_repatching

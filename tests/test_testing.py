"""``attnbias.testing``: ``check_bias`` passes on every built-in and on the examples' custom
biases, and fails, naming the route, on wrong ones (a ``dispatch`` that disagrees with its
``materialize``, a ``ModBias`` with a wrong ``materialize``, a route that clamps an index, a
route that freezes a closure's number); its strategies build valid biases; ``hypothesis``
stays optional."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

import attnbias
from attnbias import (
    AlibiBias,
    AttnBias,
    DocumentBias,
    KeyRangeBias,
    ModBias,
    SlidingWindowBias,
    SoftcapBias,
    TensorBias,
    causal_lower_right,
    causal_upper_left,
)
from attnbias.testing import check_bias, strategies

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

# small: the Triton kernels run under the interpreter on a CPU
SHAPES = [(1, 2, 2, 12, 12, 16), (2, 4, 2, 8, 20, 16)]


def _documents(length_q: int, length_kv: int) -> DocumentBias:
    return DocumentBias.from_seqlens(
        [length_q // 3, length_q - length_q // 3], [length_kv // 3, length_kv - length_kv // 3]
    )


BUILTINS: dict[str, Any] = {
    "causal upper-left": causal_upper_left(),
    "causal lower-right": causal_lower_right(),
    "window": SlidingWindowBias(3, 1),
    "alibi + causal": AlibiBias(num_heads=4) + causal_lower_right(),
    "softcap + window": SoftcapBias(2.0) + SlidingWindowBias(5),
    "documents + causal": lambda L, S: _documents(L, S) + causal_lower_right(),
    "key ranges": KeyRangeBias(start=torch.tensor([1, 0]), end=torch.tensor([7, 5])),
    "tensor": lambda L, S: TensorBias(
        torch.randn(L, S, generator=torch.Generator().manual_seed(0))
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BUILTINS))
def test_every_builtin_passes_on_every_route_it_takes(name: str) -> None:
    # ALiBi's slopes are for 4 heads, the key ranges for a batch of 2
    shapes = [(2, 4, 2, 8, 20, 16)] if name in ("alibi + causal", "key ranges") else SHAPES
    report = check_bias(BUILTINS[name], shapes=shapes)
    assert all(found["worst"] <= 1.0 for found in report.routes.values())
    if name == "tensor":  # a tensor bias has one route: its materialized form
        assert list(report.routes) == ["sdpa+mask"]
        return
    assert "reference" in report.routes
    if torch.cuda.is_available() or _interpreting():
        assert "triton" in report.routes, report
    assert "fa4" in report.routes or "fa4" in report.skipped  # checked, or said why not
    assert str(report).startswith("route | calls")


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def test_the_examples_custom_biases_pass() -> None:
    from chunked_local import ChunkedLocal
    from custom_bias import PrefixLM
    from neighbourhood_2d import Neighbourhood2D
    from t5_bias import BUCKETS, T5Bias

    table = 0.1 * torch.randn(4, BUCKETS, generator=torch.Generator().manual_seed(0))
    table.requires_grad_()
    for bias in (
        PrefixLM(prefix=3),
        ChunkedLocal(chunk=4) + SoftcapBias(5.0),
        Neighbourhood2D(height=4, width=5, window_h=3, window_w=3),
        T5Bias(table) + causal_lower_right(),
    ):
        shapes = [(1, 4, 2, 20, 20, 16)]
        report = check_bias(bias, shapes=shapes)
        assert report.routes, report
    # the table's gradient was compared: its quantity appears where it was the worst
    report = check_bias(T5Bias(table), shapes=[(1, 4, 4, 6, 6, 16)], grads=True)
    assert report.routes["reference"]["calls"] == 1


class _DisagreeingDispatch(AttnBias):
    """Materializes a causal mask, but its own ``dispatch`` runs full attention."""

    def materialize(self, device: Any = None, *, shape: Any = None, dtype: Any = None) -> Tensor:
        length_q, length_kv = shape[-2], shape[-1]
        return torch.ones(length_q, length_kv, dtype=torch.bool, device=device).tril()

    def needs_materialization(self) -> bool:
        return False

    @staticmethod
    def dispatch(  # type: ignore[override]
        query: Tensor, key: Tensor, value: Tensor, attn_bias: Any, causal: bool,
        scale: float | None, dropout_p: float, enable_gqa: bool = False,
    ) -> Tensor:  # fmt: skip
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, scale=scale, enable_gqa=enable_gqa
        )


class _AgreeingDispatch(_DisagreeingDispatch):
    @staticmethod
    def dispatch(  # type: ignore[override]
        query: Tensor, key: Tensor, value: Tensor, attn_bias: Any, causal: bool,
        scale: float | None, dropout_p: float, enable_gqa: bool = False,
    ) -> Tensor:  # fmt: skip
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )


def test_a_dispatch_that_disagrees_with_its_materialize_fails_naming_the_route() -> None:
    square = [(1, 2, 2, 10, 10, 16)]
    assert list(check_bias(_AgreeingDispatch(), shapes=square).routes) == ["dispatch"]
    with pytest.raises(AssertionError, match=r"route 'dispatch'.*out.*max error"):
        check_bias(_DisagreeingDispatch(), shapes=square)


class _WrongMaterialize(ModBias):
    """A prefix-LM whose ``materialize`` forgets the prefix."""

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < 4)

    def materialize(self, device: Any = None, *, shape: Any = None, dtype: Any = None) -> Tensor:
        length_q, length_kv = shape[-2], shape[-1]
        return torch.ones(length_q, length_kv, dtype=torch.bool, device=device).tril()


class _RightMaterialize(_WrongMaterialize):
    def materialize(self, device: Any = None, *, shape: Any = None, dtype: Any = None) -> Tensor:
        length_q, length_kv = shape[-2], shape[-1]
        q = torch.arange(length_q, device=device)[:, None]
        kv = torch.arange(length_kv, device=device)[None, :]
        return (kv <= q) | (kv < 4)


def test_a_wrong_materialize_fails_naming_its_route() -> None:
    shapes = [(1, 2, 2, 10, 10, 16)]
    assert "materialize" in check_bias(_RightMaterialize(), shapes=shapes).routes
    with pytest.raises(AssertionError, match=r"route 'materialize'"):
        check_bias(_WrongMaterialize(), shapes=shapes)


def test_a_route_that_clamps_an_index_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """``table[h, kv - q]`` reads negative indices, which wrap in eager PyTorch; a route that
    clamped them instead (the library's eager evaluation of the functions, sabotaged here)
    is caught."""
    length = 10
    table = torch.randn(2, length, generator=torch.Generator().manual_seed(3))
    bias = ModBias(score_mod=lambda s, b, h, q, kv: s + table[h, kv - q])
    shapes = [(1, 2, 2, length, length, 16)]
    check_bias(bias, shapes=shapes)  # as eager PyTorch: passes

    from attnbias.mods import eager

    original = eager._eval_load

    def clamping(traced: Any, node: Any, cache: dict[int, Any]) -> Tensor:
        cache = dict(cache)
        tensor = traced.params[node.args[0]]
        for dim, arg in enumerate(node.args[1:]):
            cache[arg] = torch.as_tensor(cache[arg]).clamp(0, int(tensor.shape[dim]) - 1)
        return original(traced, node, cache)

    monkeypatch.setitem(eager._TORCH_EVAL, "load", clamping)
    attnbias.plan_cache.clear()
    with pytest.raises(AssertionError, match=r"route '(sdpa\+mask|reference)'"):
        check_bias(ModBias(score_mod=lambda s, b, h, q, kv: s + table[h, kv - q]), shapes=shapes)


def test_a_route_that_freezes_a_closure_number_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    window = 2
    bias = ModBias(mask_mod=lambda b, h, q, kv: (q - kv <= window) & (kv <= q))
    shapes = [(1, 2, 2, 12, 12, 16)]
    check_bias(bias, shapes=shapes)
    window = 6  # read at the next call, as eager PyTorch reads it
    check_bias(bias, shapes=shapes)
    # sabotaged: the values are not read again, the trace keeps the old number
    from attnbias.biases import mod

    monkeypatch.setattr(mod, "unchanged", lambda probes: True)
    window = 1
    with pytest.raises(AssertionError, match=r"route '[a-z+-]+'.*max error"):
        check_bias(bias, shapes=shapes)


def test_bad_arguments_raise_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\(B, Hq, Hkv, L, S, E\)"):
        check_bias(causal_lower_right(), shapes=[(1, 2, 8, 8, 16)])
    with pytest.raises(ValueError, match="not a multiple of Hkv"):
        check_bias(causal_lower_right(), shapes=[(1, 3, 2, 8, 8, 16)])
    with pytest.raises(TypeError, match="AttnBias or a function"):
        check_bias(lambda L, S: "causal", shapes=[(1, 2, 2, 8, 8, 16)])  # type: ignore[arg-type, return-value]


@given(other=strategies.builtin_biases())
def test_strategies_drive_a_bias_summed_with_any_length_free_builtin(other: AttnBias) -> None:
    """The README's pattern: a bias of your own plus any built-in that fits every call."""
    from custom_bias import PrefixLM

    report = check_bias(PrefixLM(prefix=2) + other, shapes=[(1, 2, 1, 7, 9, 16)], grads=False)
    assert "reference" in report.routes


@given(data=st.data())
def test_sized_builtin_biases_are_valid_for_their_call(data: st.DataObject) -> None:
    batch, heads_q, heads_kv, length_q, length_kv, head_dim = data.draw(
        strategies.shapes(max_len=12)
    )
    bias = data.draw(strategies.builtin_biases(length_q, length_kv, batch=batch, heads_q=heads_q))
    q = torch.randn(batch, heads_q, length_q, head_dim)
    k = v = torch.randn(batch, heads_kv, length_kv, head_dim)
    out = attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=heads_q != heads_kv)
    assert out.shape == q.shape and not out.isnan().any()
    mask = data.draw(strategies.padding_masks(batch, length_kv))
    assert mask.shape == (batch, length_kv) and mask.dtype == torch.bool
    KeyRangeBias.from_padding_mask(mask)  # one contiguous run per row: accepted


def test_hypothesis_is_optional() -> None:
    """``import attnbias`` and ``attnbias.testing`` never import hypothesis; the strategies
    module says what to install."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["hypothesis"] = None  # as if it were not installed
        import attnbias, attnbias.testing
        assert "hypothesis" not in {m.split(".")[0] for m in sys.modules if sys.modules[m]}
        try:
            import attnbias.testing.strategies
        except ImportError as error:
            assert "pip install 'attnbias[test]'" in str(error), error
            print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_a_report_names_the_worst_quantity() -> None:
    report = check_bias(causal_lower_right(), shapes=[(1, 2, 2, 6, 6, 16)])
    for found in report.routes.values():
        assert found["calls"] == 1 and 0.0 <= found["worst"] <= 1.0
        assert found["where"].split(",")[0] in ("out", "dq", "dk", "dv")
    assert math.isfinite(sum(f["worst"] for f in report.routes.values()))


def _fa4_installed() -> bool:
    from attnbias.backends import fa4

    return fa4._installed()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BUILTINS))
def test_on_the_gpu_every_builtin_passes_on_the_compiled_kernels(name: str) -> None:
    """On CUDA at the default shapes and dtype: the compiled Triton kernels, and FlashAttention
    4 where it is installed, against the oracle."""
    shapes = [(2, 4, 2, 64, 200, 64), (2, 4, 4, 130, 130, 128)]  # key ranges: 2 batch rows
    report = check_bias(BUILTINS[name], shapes=shapes, device="cuda")
    assert report.routes and all(found["worst"] <= 1.0 for found in report.routes.values())
    if name == "tensor":
        return
    assert "triton" in report.routes, report
    if _fa4_installed() and name in ("causal lower-right", "window", "alibi + causal"):
        assert "fa4" in report.routes, report


@pytest.mark.gpu
def test_on_the_gpu_the_examples_custom_biases_pass_and_a_wrong_route_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from custom_bias import PrefixLM
    from t5_bias import BUCKETS, T5Bias

    table = 0.1 * torch.randn(4, BUCKETS, device="cuda").requires_grad_()
    shapes = [(2, 4, 2, 96, 96, 64)]
    for bias in (PrefixLM(prefix=30), T5Bias(table) + causal_lower_right()):
        report = check_bias(bias, shapes=shapes, device="cuda")
        assert "triton" in report.routes, report
        if _fa4_installed():
            assert "fa4" in report.routes or "fa4" in report.skipped, report
    # a planted fault on the compiled route (its output 20% off): caught, naming it
    from attnbias.backends.triton import TritonKernel

    window = SlidingWindowBias(8)
    check_bias(window, shapes=shapes, device="cuda")
    original = TritonKernel.prepare

    def off(self: Any, spec: Any) -> Any:
        prepared = original(self, spec)
        return lambda q, k, v: prepared(q, k, v) * 1.2

    monkeypatch.setattr(TritonKernel, "prepare", off)
    attnbias.plan_cache.clear()
    with pytest.raises(AssertionError, match=r"route 'triton'"):
        check_bias(window, shapes=shapes, device="cuda")


def test_assert_call_close_with_a_flash_kernels_budget() -> None:
    """``flash=True`` adds a flash kernel's own rounding to the budget: the exact call passes,
    a call off by 0.1% in float32 (far beyond that rounding) fails, and ``flash`` with an
    explicit ``rounding`` is refused."""
    from attnbias.testing.oracle import assert_call_close, attention

    bias = causal_lower_right() + SlidingWindowBias(3)
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(4))

    def exact(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, bias, dtype=torch.float32)

    def off(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return exact(q, k, v) * 1.001

    assert_call_close(exact, bias, (q, k, v), grad, flash=True)
    with pytest.raises(AssertionError):
        assert_call_close(off, bias, (q, k, v), grad, flash=True)
    with pytest.raises(ValueError, match="not both"):
        assert_call_close(exact, bias, (q, k, v), grad, flash=True, rounding=[0.0] * 4)

"""Custom biases written as functions: ``attnbias.ModBias`` against FlexAttention.

The cases of the custom-bias benchmark: prefix-LM (prefix S/8, causal after it), chunked local
attention (chunk 1024, causal inside, as Llama 4), 2-D neighbourhood attention over a 64 x 128
image with a 15 x 15 window clamped at the border, a T5 relative-position table (16 heads x 32
buckets) with causal, a causal sliding window of 1024 keys written as a ``mask_mod`` beside
the built-in ``SlidingWindowBias``, and a FlexAttention port (``examples/flex_port.py``: causal
packed documents read from a closure over per-row ids, Gemma 2's soft-cap as ``score_mod``)
beside the built-ins it is. bf16, H=16, E=128, B·S=16k tokens.

Contenders: ``attnbias`` = ``attnbias.sdpa(q, k, v, attn_mask=ModBias(...))``; ``flex`` =
``torch.compile(flex_attention)`` with ``create_block_mask`` built once (its Triton backend);
``flex (FLASH)`` = the same with ``kernel_options={"BACKEND": "FLASH"}`` (FlashAttention 4's
kernels; a row only where it runs); ``builtin`` = the built-in bias where one exists;
``attnbias (functions)`` = a mask that attnbias runs as the built-in it is (a band, equal
chunks) run as its generated functions instead (``ModBias.run_as_builtin = False``);
``flex (table learns)`` = FlexAttention with the T5 table requiring grad, its forward +
backward asking for the table's gradient too (its default blocks run out of shared memory in
that backward on the H100, so the first of ``LEARNED_TABLE_OPTIONS`` that compiles). Times
are medians of ``do_bench`` over two rounds in alternating order; ``first call`` is the first
``sdpa`` call of a fresh bias (tracing, lists, and compiling where the generated code is new);
``lists`` is the cost of building the block lists for a new length (the classification kernel
and the list writers): their GPU time (the kernels' own time, from the profiler) and the wall
time of the whole build, host included, when nothing else is queued.

Run on the GPU: ``python benchmarks/mod_bench.py [--seq 8192 16384]``; prints markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attnbias
from attnbias import DocumentBias, ModBias, SlidingWindowBias, SoftcapBias, causal_upper_left

HEADS, HEAD_DIM, TOKENS = 16, 128, 16384
IMAGE = (64, 128)
WINDOW_2D = 7  # half width: 15 x 15
PORT_SOFTCAP = 20.0


@dataclass(frozen=True)
class PrefixLM(ModBias):
    prefix: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) | (kv_idx < self.prefix)


@dataclass(frozen=True)
class ChunkedLocal(ModBias):
    chunk: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx // self.chunk == kv_idx // self.chunk)


@dataclass(frozen=True)
class Neighbourhood2D(ModBias):
    height: int
    width: int
    half: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_row, q_col = q_idx // self.width, q_idx % self.width
        k_row, k_col = kv_idx // self.width, kv_idx % self.width
        centre_row = torch.clamp(q_row, self.half, self.height - 1 - self.half)
        centre_col = torch.clamp(q_col, self.half, self.width - 1 - self.half)
        return (torch.abs(k_row - centre_row) <= self.half) & (
            torch.abs(k_col - centre_col) <= self.half
        )


def t5_bucket(distance: Tensor) -> Tensor:
    """T5's causal buckets of ``q_idx - kv_idx >= 0``: exact below 16, logarithmic to 128."""
    exact = torch.clamp(distance, min=0)
    log_bucket = 16 + (torch.log(exact.float() / 16 + 1e-6) / math.log(8) * 16).long()
    return torch.where(exact < 16, exact, torch.clamp(log_bucket, max=31))


@dataclass(frozen=True, eq=False)
class T5Bias(ModBias):
    table: Tensor  # (H, 32)

    def score_mod(
        self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor
    ) -> Tensor:
        return score + self.table[h, t5_bucket(q_idx - kv_idx)]


@dataclass(frozen=True)
class WindowMod(ModBias):
    window: int

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < self.window)


# FlexAttention's kernel options tried in turn for the T5 table that learns: its default
# blocks, then smaller ones for the backward (the default needs 233 KB of shared memory there).
LEARNED_TABLE_OPTIONS: tuple[dict[str, int] | None, ...] = (
    None,
    {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
    {"BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16, "num_stages": 1},
)


def cases(seq: int, device: torch.device) -> dict[str, tuple[Any, Any, Any, Any, Any]]:
    """name -> (attnbias bias, flex mask_mod, flex score_mod, built-in bias or None, (flex
    score_mod reading a table that requires grad, that table) or None)."""
    # attnbias learns the table (its gradient from the fused backward); FlexAttention gets the
    # same values without a gradient (its backward with a learnable buffer ran out of shared
    # memory on the H100), and plain causal attention is the "builtin" row of this case
    table = (torch.randn(HEADS, 32, device=device) * 0.5).requires_grad_()
    t5 = T5Bias(table)
    fixed = table.detach()

    def causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return kv <= q

    def t5_score(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return score + fixed[h, t5_bucket(q - kv)]

    learned = table.detach().clone().requires_grad_()

    def t5_learned(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return score + learned[h, t5_bucket(q - kv)]

    made: dict[str, tuple[Any, Any, Any, Any, Any]] = {
        "prefix-LM": (PrefixLM(seq // 8), PrefixLM(seq // 8).mask_mod, None, None, None),
        "chunked local": (ChunkedLocal(1024), ChunkedLocal(1024).mask_mod, None, None, None),
        "T5 table + causal": (
            t5 + causal_upper_left(),
            causal,
            t5_score,
            causal_upper_left(),
            (t5_learned, learned),
        ),
        "window as mask_mod": (
            WindowMod(1024),
            WindowMod(1024).mask_mod,
            None,
            causal_upper_left() + SlidingWindowBias(1023),
            None,
        ),
    }
    if seq == IMAGE[0] * IMAGE[1]:
        image = Neighbourhood2D(*IMAGE, WINDOW_2D)
        made["2-D neighbourhood"] = (image, image.mask_mod, None, None, None)
    made["FlexAttention port"] = _flex_port(TOKENS // seq, seq, device)
    return made


def _flex_port(batch: int, seq: int, device: torch.device) -> tuple[Any, Any, Any, Any, Any]:
    """``examples/flex_port.py``'s functions as FlexAttention code has them: causal packed
    documents (five cuts per row, drawn once) read from a closure over ``(B, S)`` ids, and a
    soft-cap ``score_mod``; the built-in row is the same as ``DocumentBias`` + causal +
    ``SoftcapBias``."""
    cuts = torch.randint(1, seq, (batch, 5), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).repeat(batch, 1)
    docs = torch.searchsorted(cuts.sort(dim=-1).values, positions, right=True).to(device)

    def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    def soft_cap(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return PORT_SOFTCAP * torch.tanh(score / PORT_SOFTCAP)

    builtin = DocumentBias(docs) + causal_upper_left() + SoftcapBias(PORT_SOFTCAP)
    port = ModBias(mask_mod=document_causal, score_mod=soft_cap)
    return port, document_causal, soft_cap, builtin, None


def timed(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def peak_mib(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run(seq: int, only: list[str] | None = None) -> list[str]:
    device = torch.device("cuda")
    batch = TOKENS // seq
    q, k, v = (
        torch.randn(
            batch, HEADS, seq, HEAD_DIM, device=device, dtype=torch.bfloat16
        ).requires_grad_()
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    rows = []
    for name, (bias, mask_mod, score_mod, builtin, learned) in cases(seq, device).items():
        if only and name not in only:
            continue
        # a fresh compilation per case: past dynamo's recompile limit flex_attention falls back
        # to its eager path (L x S memory), which would time the wrong thing
        torch._dynamo.reset()
        flex = torch.compile(flex_attention)
        start = time.perf_counter()
        out = attnbias.sdpa(q, k, v, attn_mask=bias)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - start) * 1e3
        route = attnbias.explain(q, k, v, attn_mask=bias).splitlines()[0].split(":")[0]
        block_mask = create_block_mask(_function(mask_mod), batch, None, seq, seq, device="cuda")
        flex_out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
        diff = (out.float() - flex_out.float()).abs().max().item()

        def forward(call: Callable[[], Tensor]) -> Callable[[], Any]:
            def fn() -> Any:
                with torch.no_grad():
                    return call()

            return fn

        def forward_backward(
            call: Callable[[], Tensor], wrt: tuple[Tensor, ...] = ()
        ) -> Callable[[], Any]:
            def fn() -> Any:
                torch.autograd.grad(call(), (q, k, v, *wrt), grad)

            return fn

        calls: dict[str, Callable[[], Tensor]] = {
            "attnbias": lambda bias=bias: attnbias.sdpa(q, k, v, attn_mask=bias),
            "flex": lambda mask=block_mask, score=score_mod, flex=flex: flex(
                q, k, v, score_mod=score, block_mask=mask
            ),
        }
        flash = _flex_flash(flex, q, k, v, score_mod, block_mask)
        if flash is not None:
            calls["flex (FLASH)"] = flash
        wrt: dict[str, tuple[Tensor, ...]] = {}
        if learned is not None:
            learning = _flex_learned(flex, q, k, v, learned, block_mask)
            if learning is not None:
                calls["flex (table learns)"] = learning
                wrt["flex (table learns)"] = (learned[1],)
        if builtin is not None:
            calls["builtin (triton)"] = lambda bias=builtin: _pinned(q, k, v, bias)
        if isinstance(bias, ModBias) and bias.builtin_form() is not None:
            # the same mask as generated code (what it ran as before it was recognised); a bias
            # of its own, as the decisions of calls are kept per bias
            as_functions = (
                dataclasses.replace(bias)
                if dataclasses.is_dataclass(bias)
                else ModBias(mask_mod=bias.mask_mod, score_mod=bias.score_mod)
            )
            calls["attnbias (functions)"] = lambda bias=as_functions: _as_functions(q, k, v, bias)
        for contender, call in calls.items():  # compiled (again, after a reset) before timing
            forward(call)()
            forward_backward(call, wrt.get(contender, ()))()
        times: dict[str, list[float]] = {}
        for r in range(2):
            order = list(calls) if r == 0 else list(calls)[::-1]
            for contender in order:
                times.setdefault(contender + " fwd", []).append(timed(forward(calls[contender])))
                times.setdefault(contender + " f+b", []).append(
                    timed(forward_backward(calls[contender], wrt.get(contender, ())))
                )
        ms = {key: statistics.fmean(values) for key, values in times.items()}
        memory = peak_mib(forward_backward(calls["attnbias"]))
        flex_memory = peak_mib(forward_backward(calls["flex"]))
        lists_gpu_ms, lists_wall_ms = _lists_ms(bias, q, k)
        for contender in calls:
            fwd, fb = ms[contender + " fwd"], ms[contender + " f+b"]
            ratio = (
                f"{ms['flex fwd'] / fwd:.2f} / {ms['flex f+b'] / fb:.2f}"
                if contender != "flex"
                else "1.00 / 1.00"
            )
            extra = (
                f"{memory:.0f}"
                if contender == "attnbias"
                else f"{flex_memory:.0f}"
                if contender == "flex"
                else ""
            )
            detail = (
                f"route {route}; first call {first_ms:.0f} ms; lists {lists_gpu_ms:.3f} ms GPU, "
                f"{lists_wall_ms:.3f} ms wall; "
                f"max diff vs flex {diff:.1e}"
                if contender == "attnbias"
                else ""
            )
            rows.append(
                f"| {name} | {seq} | {contender} | {fwd:.3f} | {fb:.3f} | {ratio} | {extra} "
                f"| {detail} |"
            )
        print("\n".join(rows[-len(calls) :]), flush=True)
    return rows


def _flex_flash(
    flex: Any, q: Tensor, k: Tensor, v: Tensor, score_mod: Any, block_mask: Any
) -> Callable[[], Tensor] | None:
    """FlexAttention's FLASH backend (FlashAttention 4's kernels), or None where it refuses."""

    def call() -> Tensor:
        return flex(
            q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options={"BACKEND": "FLASH"}
        )

    try:
        torch.autograd.grad(call(), (q, k, v), torch.ones_like(q))
    except Exception as exc:  # any refusal makes a skipped row
        print(f"flex (FLASH) skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
        return None
    return call


def _flex_learned(
    flex: Any, q: Tensor, k: Tensor, v: Tensor, learned: tuple[Any, Tensor], block_mask: Any
) -> Callable[[], Tensor] | None:
    """FlexAttention with a score function reading a table that requires grad, under the first
    of :data:`LEARNED_TABLE_OPTIONS` whose forward + backward (the table's gradient included)
    compiles and runs; None where none does."""
    score_mod, table = learned
    for options in LEARNED_TABLE_OPTIONS:

        def call(options: dict[str, int] | None = options) -> Tensor:
            return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options)

        try:
            torch.autograd.grad(call(), (q, k, v, table), torch.ones_like(q))
        except Exception as exc:  # the next options, or a skipped row
            print(f"flex (table learns) {options}: {type(exc).__name__}: {str(exc)[:160]!r}")
            torch._dynamo.reset()
            continue
        print(f"flex (table learns) runs with kernel_options={options}")
        return call
    return None


def _function(method: Any) -> Any:
    """A plain function of a bound method (``create_block_mask`` takes functions only)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return method(b, h, q_idx, kv_idx)

    return mask_mod


@contextlib.contextmanager
def _functions_only() -> Iterator[None]:
    """Masks run as their generated functions, not as the built-ins some of them are."""
    ModBias.run_as_builtin = False
    try:
        yield
    finally:
        ModBias.run_as_builtin = True


def _as_functions(q: Tensor, k: Tensor, v: Tensor, bias: Any) -> Tensor:
    """The call with the mask run as its generated functions, not as the built-in it is."""
    with _functions_only():
        return attnbias.sdpa(q, k, v, attn_mask=bias)


def _pinned(q: Tensor, k: Tensor, v: Tensor, bias: Any) -> Tensor:
    with attnbias.use_backends("triton"):
        return attnbias.sdpa(q, k, v, attn_mask=bias)


def _lists_ms(bias: Any, q: Tensor, k: Tensor) -> tuple[float, float]:
    """Building the block lists of ``bias`` for these shapes once more (a new length):
    ``(GPU ms, wall ms)``, each per build; of its generated functions where it runs as a
    built-in (which needs no lists)."""
    from attnbias.kernels.masks import _MOD_LISTS, launch_mask
    from attnbias.spec import lower

    with _functions_only():
        program = lower(bias, q.shape[2], k.shape[2], q.device, batch=q.shape[0]).program
    if program.mods is None or not program.mods.has_mask:
        return 0.0, 0.0

    def build() -> None:
        _MOD_LISTS.pop(program, None)
        launch_mask(q, k, program, scale=1.0, rows=True, cols=False)

    builds = 20
    build()
    torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA
    with torch.profiler.profile(activities=[activity]) as profile:
        for _ in range(builds):
            build()
        torch.cuda.synchronize()
    gpu_us = sum(  # the kernels' events (an operator's event would count its kernels again)
        getattr(event, "self_device_time_total", 0)
        for event in profile.key_averages()
        if not event.key.startswith("aten::")
    )
    walls = []
    for _ in range(builds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        build()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e3)
    return gpu_us / 1e3 / builds, statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(
        "\n| case | S | contender | fwd ms | f+b ms | flex ÷ this (fwd / f+b) | f+b MiB | notes |"
        "\n|---|--:|---|--:|--:|--:|--:|---|"
    )
    rows = []
    for seq in args.seq:
        rows += run(seq, args.cases)
    print("\n## Summary\n")
    print("| case | S | contender | fwd ms | f+b ms | flex ÷ this (fwd / f+b) | f+b MiB | notes |")
    print("|---|--:|---|--:|--:|--:|--:|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()

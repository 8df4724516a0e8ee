"""Short queries against long key/value caches: attnbias against FlexAttention (compiled; it
picks its decoding kernel for short queries), FlashAttention 4 (its split heuristic,
``num_splits=0``, on Blackwell; Hopper has none: one split) and the bytes floor, plus chunked
prefill and the host time per call.

bf16, B=8, Hq=32, Hkv=8, E=128, lower-right causal with a window, ALiBi or soft-cap added,
and a speculative-decoding draft tree (``examples/speculative_tree.py``: the ``L`` queries are
the nodes of a binary tree appended to the cache, each attending the cache and its ancestors)
as a ``ModBias`` against the same ``mask_mod`` in FlexAttention.
GPU times are CUDA-graph replays of 20 calls (what a serving loop runs), taken in two rounds
with the contenders in alternating order, best of both; the floor is reading K and V once,
measured as half of a device-to-device copy of K and V (a copy reads and writes every byte).
Host time per call is a tiny problem's calls issued without waiting, where the GPU is idle
and each call costs its host time: ``sdpa`` against the launcher it ends in.

Run on the GPU: ``python benchmarks/decode_bench.py [--quick]``; prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attnbias
from attnbias import AlibiBias, ModBias, SlidingWindowBias, SoftcapBias, causal_lower_right
from attnbias.biases import alibi_slopes

# isort: split
# A sibling, found through the folder of this script on sys.path.
from measure import host_us_interleaved

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = 8, 32, 8, 128
WINDOW = 4096
CAP = 50.0
CALLS_PER_GRAPH = 20

Call = Callable[[], Tensor]


BIASES = ("causal", "window", "alibi", "softcap", "tree")


def biases(heads: int, length_q: int, length_kv: int) -> dict[str, Any]:
    """The biases of :data:`BIASES` for a call of ``(L, S)``."""
    return {
        "causal": causal_lower_right(),
        "window": causal_lower_right() + SlidingWindowBias(WINDOW - 1),
        "alibi": causal_lower_right() + AlibiBias(num_heads=heads),
        "softcap": causal_lower_right() + SoftcapBias(CAP),
        "tree": ModBias(mask_mod=tree_mask(length_q, length_kv)) + causal_lower_right(),
    }


def tree_ancestors(nodes: int, device: Any = "cuda") -> Tensor:
    """``(nodes, nodes)`` bool: whether node ``j`` is node ``i`` or one of its ancestors in a
    binary tree (node ``n``'s parent is ``(n - 1) // 2``)."""
    found = torch.zeros(nodes, nodes, dtype=torch.bool)
    for node in range(nodes):
        at = node
        while True:
            found[node, at] = True
            if at == 0:
                break
            at = (at - 1) // 2
    return found.to(device)


def tree_mask(nodes: int, length_kv: int, device: str = "cuda") -> Callable[..., Tensor]:
    """The ``mask_mod`` of a binary draft tree of ``nodes`` queries appended to a cache of
    ``length_kv - nodes`` keys (:func:`tree_ancestors`): every query keeps the cache, and
    among the new keys the node itself and its ancestors."""
    table = tree_ancestors(nodes, device)
    cache = length_kv - nodes

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx < cache) | table[q_idx, (kv_idx - cache).clamp(min=0)]

    return mask_mod


def flex_call(name: str, q: Tensor, k: Tensor, v: Tensor) -> Call:
    length_q, length_kv = q.shape[2], k.shape[2]
    offset = length_kv - length_q
    slopes = torch.tensor(alibi_slopes(HEADS_Q), device=q.device)

    def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return q_idx + offset >= kv_idx

    def window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx + offset >= kv_idx) & (q_idx + offset - kv_idx < WINDOW)

    def alibi(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score - slopes[h] * (q_idx + offset - kv_idx).abs()

    def softcap(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return CAP * torch.tanh(score / CAP)

    mask_mod = {"window": window, "tree": tree_mask(length_q, length_kv)}.get(name, causal)
    score_mod = {"alibi": alibi, "softcap": softcap}.get(name)
    block_mask = create_block_mask(mask_mod, None, None, length_q, length_kv, device=q.device)
    # one compiled kernel per shape and mask: past dynamo's recompile limit it would fall back
    # to the unfused path (an L x S score matrix), so each case starts from a clean slate
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    return lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)


def fa4_call(name: str, q: Tensor, k: Tensor, v: Tensor) -> Call | None:
    if name == "tree":  # no FlashAttention 4 form written here
        return None
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None
    from attnbias.backends import fa4

    # its split heuristic (num_splits=0) exists on Blackwell only; Hopper runs one split
    splits = 0 if torch.cuda.get_device_capability(q.device)[0] >= 10 else 1
    options: dict[str, Any] = {"causal": True, "num_splits": splits}
    if name == "window":
        options["window_size"] = (WINDOW - 1, 0)
    elif name == "softcap":
        options["score_mod"], _ = fa4._softcap_score_mods(CAP)
    elif name == "alibi":
        options["score_mod"], _ = fa4._alibi_score_mods()
        options["aux_tensors"] = [torch.tensor(alibi_slopes(HEADS_Q), device=q.device)]
        options["pack_gqa"] = False
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return lambda: flash_attn_func(qt, kt, vt, **options)[0].transpose(1, 2)


def graph_ms(call: Call) -> float:
    """GPU time of one call: a CUDA graph of several calls replayed (eager if capture fails)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS_PER_GRAPH):
                call()
        run, per_run = graph.replay, CALLS_PER_GRAPH
    except Exception:
        run, per_run = call, 1
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = max(1, 200 // per_run)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (reps * per_run)


def floor_ms(k: Tensor, v: Tensor) -> float:
    """Reading K and V once: half a device-to-device copy of them."""
    source = torch.cat([k.flatten(), v.flatten()])
    target = torch.empty_like(source)
    return graph_ms(lambda: target.copy_(source)) / 2


def draw(length_q: int, length_kv: int) -> tuple[Tensor, Tensor, Tensor]:
    def one(heads: int, length: int) -> Tensor:
        shape = (BATCH, heads, length, HEAD_DIM)
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    return one(HEADS_Q, length_q), one(HEADS_KV, length_kv), one(HEADS_KV, length_kv)


def timed(contenders: dict[str, Call]) -> dict[str, float]:
    """Best of two rounds, the second in reverse order."""
    times: dict[str, float] = {}
    for order in (list(contenders), list(reversed(contenders))):
        for name in order:
            try:
                ms = graph_ms(contenders[name])
            except Exception as exc:  # one contender failing keeps the others' rows
                print(f"  {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                continue
            times[name] = min(times.get(name, math.inf), ms)
    return times


def decode_table(lengths_q: list[int], lengths_kv: list[int], names: list[str]) -> None:
    print("| bias | L | S | route (captured) | attnbias ms | decode kernel ms | floor ms | × floor "
          "| flex ms | fa4 ms | flex / attnbias | fa4 / attnbias | max diff vs flex |")  # fmt: skip
    print("|---|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for length_kv in lengths_kv:
        for length_q in lengths_q:
            for row in decode_rows(length_q, length_kv, names):
                print(row)
            torch.cuda.empty_cache()


def captured_route(q: Tensor, k: Tensor, v: Tensor, bias: Any) -> str:
    """The backend a call takes when captured in a CUDA graph, as the timed calls are."""
    from attnbias.planner import plan
    from attnbias.spec import make_spec

    spec = make_spec(q, k, v, bias, False, None, 0.0, True)
    return plan(dataclasses.replace(spec, capturing=True)).backend.name


def decode_rows(length_q: int, length_kv: int, names: list[str]) -> list[str]:
    q, k, v = draw(length_q, length_kv)
    floor = floor_ms(k, v)
    rows = []
    for name in names:
        bias = biases(HEADS_Q, length_q, length_kv)[name]

        def ours(bias: Any = bias) -> Tensor:
            return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

        def decode_kernel(bias: Any = bias) -> Tensor:
            with attnbias.use_backends("triton-decode"):
                return attnbias.sdpa(q, k, v, attn_mask=bias, enable_gqa=True)

        route = captured_route(q, k, v, bias)
        eager = attnbias.explain(q, k, v, attn_mask=bias, enable_gqa=True).split(":")[0]
        contenders: dict[str, Call] = {"attnbias": ours}
        if route != "triton-decode" and eager == "triton-decode":
            # the decode kernel's own time where a captured call takes another route
            contenders["decode"] = decode_kernel
            route = f"{route} (eager: {eager})"
        try:
            contenders["flex"] = flex_call(name, q, k, v)
        except Exception as exc:
            print(f"  flex: {type(exc).__name__}")
        fa4 = fa4_call(name, q, k, v)
        if fa4 is not None:
            contenders["fa4"] = fa4
        times = timed(contenders)
        diff = math.nan
        if "flex" in times:
            diff = (ours().float() - contenders["flex"]().float()).abs().max().item()
        mine = times.get("attnbias", math.nan)
        flex, fa = times.get("flex", math.nan), times.get("fa4", math.nan)
        own = f"{times['decode']:.3f}" if "decode" in times else "="
        rows.append(
            f"| {name} | {length_q} | {length_kv} | {route} | {mine:.3f} | {own} | {floor:.3f} "
            f"| {mine / floor:.2f} | {flex:.3f} | {fa:.3f} | {flex / mine:.2f} "
            f"| {fa / mine:.2f} | {diff:.1e} |"
        )
    return rows


def bare_launch(plan: Any, q: Tensor, k: Tensor, v: Tensor) -> Call:
    """The least a launch of ``plan``'s kernels costs: its outputs allocated and the compiled
    kernels' own launchers called with the arguments ``plan.launch`` passed them (recorded
    from one call, after which the plan's launchers are as they were)."""
    launches = [plan.kernel]
    recorded: list[tuple[Any, tuple[Any, ...]]] = []
    for launch in launches:
        (key, (runner, constexprs)), *_ = launch.runners.items()

        def record(*args: Any, runner: Any = runner) -> None:
            recorded.append((runner, args))
            runner(*args)

        launch.runners[key] = (record, constexprs)
    plan.launch(q, k, v)
    for launch, (runner, _) in zip(launches, recorded, strict=True):
        key, (_, constexprs) = next(iter(launch.runners.items()))
        launch.runners[key] = (runner, constexprs)
    # allocated as the plans allocate them: the output (B, Hq, L, E), and beside it the
    # forward's float32 lse (a split decode keeps its partial results and counters per stream)
    from attnbias.kernels.decode import DecodePlan
    from attnbias.kernels.launch import empty_contiguous, empty_rows

    has_lse = not isinstance(plan, DecodePlan)

    def run() -> Tensor:
        out = empty_contiguous(q)
        if has_lse:
            empty_rows(q)
        for runner, args in recorded:
            runner(*args)
        return out

    return run


def host_table() -> None:
    from attnbias import plan_cache, use_backends
    from attnbias.kernels.decode import plan_decode
    from attnbias.kernels.forward import plan_forward
    from attnbias.spec import lower

    q = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    short = q[:, :, :4]
    print("| bias | kernel | bare launch µs | plan µs | sdpa µs | sdpa − bare µs | stock SDPA µs |")
    print("|---|---|--:|--:|--:|--:|--:|")
    # the built-ins (a tree's mask depends on the lengths, which differ between the two rows)
    built_in = {name: bias for name, bias in biases(1, 4, 128).items() if name != "tree"}
    for name, bias in built_in.items():
        for label, query, planner, backend in (
            ("decode (L=4)", short, plan_decode, "triton-decode"),
            ("training (L=128)", q, plan_forward, "triton"),
        ):
            lowered = lower(bias, query.shape[2], q.shape[2], q.device)
            plan = planner(query, q, q, lowered.program, scale=0.125)
            plan.launch(query, q, q)
            plan_cache.clear()

            # the kernel's own route, whatever else is installed (FlashAttention 4 would take
            # some of these calls)
            with torch.no_grad(), use_backends(backend):
                times = host_us_interleaved(
                    {
                        "bare": bare_launch(plan, query, q, q),
                        "plan": lambda query=query, plan=plan: plan.launch(query, q, q),
                        "sdpa": lambda query=query, bias=bias: attnbias.sdpa(
                            query, q, q, attn_mask=bias
                        ),
                        "stock": lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q),
                    }
                )
            print(
                f"| {name} | {label} | {times['bare']:.1f} | {times['plan']:.1f} "
                f"| {times['sdpa']:.1f} | {times['sdpa'] - times['bare']:.1f} "
                f"| {times['stock']:.1f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S = 32768 only")
    parser.add_argument("--kv", type=int, nargs="+", help="cache lengths (default: all three)")
    parser.add_argument("--biases", nargs="+", default=list(BIASES), choices=BIASES)
    parser.add_argument(
        "--tables", nargs="+", default=["decode", "prefill", "host"],
        choices=["decode", "prefill", "host"],
    )  # fmt: skip
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if "decode" in args.tables:
        print("\n## Decode (CUDA-graph replays)\n")
        lengths_kv = args.kv or ([32768] if args.quick else [8192, 32768, 131072])
        decode_table([1, 4, 16], lengths_kv, args.biases)
    if "prefill" in args.tables:
        print("\n## Chunked prefill\n")
        decode_table([1024], [16384], ["causal"])
    if "host" in args.tables:
        print("\n## Host time per forward call (B=1, H=1, S=128, E=64, no grad)\n")
        host_table()


if __name__ == "__main__":
    main()

"""Continuous batching (``generate_batch``) of the ~1B-parameter Llama-like model of
``transformers_bench.py`` (random weights, bf16): attnbias (``continuous_batching(model)``)
against transformers' own SDPA batching (which builds a dense mask per step), on ragged
prompts, tokens per second over two rounds in alternating order, and whether the greedy
outputs agree (bf16: the two may part ways after a near tie; the count of requests whose
tokens are equal is printed).

    pip install -e ".[transformers]" && python benchmarks/batching_bench.py [--graphs off]

With CUDA graphs, ``generate_batch`` first warms up (transformers' default): it captures its
largest step, one made-up request of the step's most new tokens reading as many cached keys
as the cache holds, and runs it, a full attention of that size in every layer, before the
first real step; ``--warmup off`` leaves that out (each bucket captured when first met), as a
server that warmed up once would run.

``--requests``, ``--new-tokens``, ``--prompts MIN MAX``: the workload (default 64 requests of
256 to 4096 prompt tokens, 128 new tokens each).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers_bench import config  # a sibling, found through this script's folder

import attnbias
import attnbias.integrations.transformers as attnbias_hf


def run(
    model: torch.nn.Module,
    prompts: list[list[int]],
    new_tokens: int,
    graphs: bool | None,
    warmup: bool = True,
) -> tuple[float, dict]:
    """Seconds for one ``generate_batch`` of ``prompts`` and its outputs (``graphs``: CUDA
    graphs on, off, or ``None`` for transformers' choice; ``warmup``: its warm-up step, run
    where graphs are on)."""
    generation = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    batching = ContinuousBatchingConfig(max_blocks_per_request=0, use_cuda_graph=graphs)
    torch.cuda.synchronize()
    began = time.perf_counter()
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=generation,
        continuous_batching_config=batching,
        warmup=warmup,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - began, {k: v.generated_tokens for k, v in outputs.items()}


def add_workload(parser: argparse.ArgumentParser, requests: int, new_tokens: int) -> None:
    """The workload's options: ``--requests``, ``--new-tokens``, ``--prompts MIN MAX``."""
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--prompts", type=int, nargs=2, default=(256, 4096))


def workload(args: argparse.Namespace) -> tuple[list[list[int]], torch.nn.Module]:
    """The prompts of ``args`` (seeded: the same in every run) and the model (random weights,
    bf16, on the GPU, on stock SDPA until a batching context sets its own)."""
    torch.manual_seed(0)
    lengths = torch.randint(args.prompts[0], args.prompts[1] + 1, (args.requests,)).tolist()
    prompts = [torch.randint(1, 32000, (n,)).tolist() for n in lengths]
    model = AutoModelForCausalLM.from_config(config(8192), dtype=torch.bfloat16)
    model = model.cuda().eval()
    model.set_attn_implementation("sdpa")
    return prompts, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload(parser, requests=64, new_tokens=128)
    parser.add_argument(
        "--graphs", choices=("auto", "on", "off"), default="auto",
        help="CUDA graphs for both (auto: transformers' choice, which is on for attnbias, "
        "whose steps need no mask, and off for SDPA)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", choices=("on", "off"), default="on",
        help="generate_batch's warm-up step where CUDA graphs are on (on: transformers' default)",
    )  # fmt: skip
    args = parser.parse_args()
    warmup = args.warmup == "on"
    graphs = {"auto": None, "on": True, "off": False}[args.graphs]
    attnbias_hf.register()
    prompts, model = workload(args)
    names = ("sdpa", "attnbias")

    def one(name: str) -> tuple[float, dict]:
        if name == "sdpa":
            return run(model, prompts, args.new_tokens, graphs, warmup)
        with attnbias_hf.continuous_batching(model):
            return run(model, prompts, args.new_tokens, graphs, warmup)

    for name in names:  # warm up: kernels compiled, CUDA graphs captured
        one(name)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    outputs: dict[str, dict] = {}
    for order in (names, names[::-1]):
        for name in order:
            took, outputs[name] = one(name)
            seconds[name].append(took)
    tokens = args.requests * args.new_tokens
    same = sum(outputs["sdpa"][k] == outputs["attnbias"].get(k) for k in outputs["sdpa"])

    def agreed(a: list[int], b: list[int]) -> int:  # tokens before the first difference
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))

    before = [agreed(v, outputs["attnbias"].get(k, [])) for k, v in outputs["sdpa"].items()]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, attnbias "
          f"{attnbias.__version__}; {args.requests} requests of {args.prompts[0]}-"
          f"{args.prompts[1]} prompt tokens, {args.new_tokens} new each; CUDA graphs "
          f"{args.graphs}, warm-up {args.warmup}")  # fmt: skip
    print("| implementation | s (two rounds) | tokens/s |")
    print("|---|--:|--:|")
    for name in names:
        mean = sum(seconds[name]) / len(seconds[name])
        rounds = " / ".join(f"{s:.2f}" for s in seconds[name])
        print(f"| {name} | {rounds} | {tokens / mean:.0f} |")
    print(f"requests with equal greedy tokens: {same} of {len(outputs['sdpa'])}; tokens before "
          f"the first difference: median {sorted(before)[len(before) // 2]}, least "
          f"{min(before)}")  # fmt: skip


if __name__ == "__main__":
    main()

"""A ~1B-parameter Llama-like model (from config, random weights, bf16) on each attention
implementation of transformers: training step (forward + backward) at 4k and 16k tokens and
greedy generation, with peak memory. Prints a markdown table.

    pip install -e ".[transformers]" && python benchmarks/transformers_bench.py

Implementations: ``attnbias`` (this library, after ``register()``), ``sdpa``, ``flex_attention``
and ``eager``. A cell that runs out of memory says so (eager at 16k tokens needs its 32 heads'
16k x 16k scores in every layer, and is not run there: ``--eager-16k`` tries it anyway).
About 3-5 minutes on an H100.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import attnbias
import attnbias.integrations.transformers as attnbias_hf

IMPLEMENTATIONS = ("attnbias", "sdpa", "flex_attention", "eager")
TRAIN_TOKENS = (4096, 16384)
GIB = 2**30


def config(max_positions: int) -> LlamaConfig:
    """Llama 3.2 1B's shape: 16 layers, hidden 2048, 32 query and 8 key/value heads of 64,
    MLP 8192, a 32k vocabulary (1.1B parameters with untied embeddings)."""
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
    )


@dataclass
class Cell:
    ms: float | None = None
    peak_gib: float | None = None
    note: str = ""

    def show_time(self) -> str:
        return self.note if self.ms is None else f"{self.ms:.1f}"

    def show_peak(self) -> str:
        return "" if self.peak_gib is None else f"{self.peak_gib:.1f}"


@dataclass
class Row:
    implementation: str
    train: dict[int, Cell] = field(default_factory=dict)
    generate: Cell = field(default_factory=Cell)
    tokens_per_s: float | None = None


def measure(step: Callable[[], object], iterations: int) -> Cell:
    """Median time of ``step`` over ``iterations`` after one warm-up (which also compiles),
    and the peak memory allocated during them."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        step()
        torch.cuda.synchronize()
        times = []
        for _ in range(iterations):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return Cell(note="out of memory")
    except Exception as error:  # one implementation failing must not lose the others' rows
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  failed: {type(error).__name__}: {error}", flush=True)
        return Cell(note=f"failed ({type(error).__name__})")
    return Cell(statistics.median(times), torch.cuda.max_memory_allocated() / GIB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="rows generated together")
    parser.add_argument("--eager-16k", action="store_true", help="try eager at 16k tokens")
    parser.add_argument("--only", nargs="*", default=IMPLEMENTATIONS, choices=IMPLEMENTATIONS)
    args = parser.parse_args()
    attnbias_hf.register()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config(max(TRAIN_TOKENS)), dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    parameters = sum(p.numel() for p in model.parameters())
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 32000, (args.batch, args.prompt), generator=generator).cuda()
    padding = torch.ones_like(prompts)
    for row in range(args.batch):
        padding[row, : row * args.prompt // (2 * args.batch)] = 0  # left padding, row by row

    rows = []
    for implementation in args.only:
        model.set_attn_implementation(implementation)
        row = Row(implementation)
        for tokens in TRAIN_TOKENS:
            if implementation == "eager" and tokens > 4096 and not args.eager_16k:
                row.train[tokens] = Cell(note="not run (L×S scores)")
                continue
            ids = torch.randint(0, 32000, (1, tokens), generator=generator).cuda()
            model.train()

            def train_step(ids: torch.Tensor = ids) -> None:
                model.zero_grad(set_to_none=True)
                model(ids, labels=ids, use_cache=False).loss.backward()

            row.train[tokens] = measure(train_step, args.iterations)
            model.zero_grad(set_to_none=True)
            print(implementation, tokens, row.train[tokens], flush=True)
        model.eval()

        def generate() -> None:
            with torch.no_grad():
                model.generate(
                    prompts,
                    attention_mask=padding,
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )

        row.generate = measure(generate, max(1, args.iterations - 1))
        if row.generate.ms is not None:
            row.tokens_per_s = args.batch * args.new_tokens / (row.generate.ms / 1e3)
        print(implementation, "generate", row.generate, flush=True)
        rows.append(row)

    q = torch.randn(1, 32, 4096, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 8, 4096, 64, device="cuda", dtype=torch.bfloat16)
    route = attnbias.explain(
        q, kv, kv, attn_mask=attnbias.causal_lower_right(), enable_gqa=True
    ).splitlines()[0]
    print()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
        f"{__import__('transformers').__version__}; Llama-like model, {parameters / 1e9:.2f}B "
        f"parameters, bf16. Train: one sequence, forward + backward of the loss (median of "
        f"{args.iterations}). Generate: {args.batch} rows of {args.prompt} prompt tokens (left "
        f"padded), {args.new_tokens} new tokens each, greedy. Peak: max_memory_allocated."
    )
    print(f"attnbias route of the training calls: {route}")
    print()
    head = ["implementation"]
    for tokens in TRAIN_TOKENS:
        head += [f"train {tokens // 1024}k ms", "peak GiB"]
    head += ["generate tok/s", "peak GiB"]
    print("| " + " | ".join(head) + " |")
    print("|---" + "|--:" * (len(head) - 1) + "|")
    for row in rows:
        cells = [row.implementation]
        for tokens in TRAIN_TOKENS:
            cells += [row.train[tokens].show_time(), row.train[tokens].show_peak()]
        speed = row.generate.note if row.tokens_per_s is None else f"{row.tokens_per_s:.0f}"
        cells += [speed, row.generate.show_peak()]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

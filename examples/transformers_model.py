"""A Hugging Face transformers model on attnbias: ``attn_implementation="attnbias"``.

A tiny Gemma 2 (random weights, from config): its layers alternate between a sliding window
and full attention, and every score is soft-capped, which transformers' own SDPA path cannot
run. The same weights run with transformers' eager attention and with attnbias; the logits
and the greedy generations agree, and each layer's bias and route is printed.

    pip install -e ".[transformers]" && python examples/transformers_model.py

Takes seconds on a CPU; on a GPU the same calls run on the fused kernels.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Gemma2Config

import attnbias.integrations.transformers as attnbias_hf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def main() -> None:
    attnbias_hf.register()  # once per process: adds "attnbias" to transformers' registries

    def config() -> Gemma2Config:
        return Gemma2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,  # grouped key/value heads: attnbias runs them without copies
            head_dim=16,
            sliding_window=8,  # transformers counts the query itself: SlidingWindowBias(7)
            attn_logit_softcapping=50.0,
            query_pre_attn_scalar=16,
            initializer_range=0.3,
        )

    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(config(), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(config(), attn_implementation="attnbias")
    ours.load_state_dict(
        eager.state_dict()
    )  # a real model: from_pretrained(name, attn_implementation="attnbias")
    eager, ours = eager.to(DEVICE).eval(), ours.to(DEVICE).eval()

    # Two prompts of 16 and 11 tokens, the shorter one left-padded
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    padding = torch.ones(2, 16, dtype=torch.long, device=DEVICE)
    padding[1, :5] = 0

    with torch.no_grad():
        expected = eager(ids, attention_mask=padding).logits
        got = ours(ids, attention_mask=padding).logits
    real = padding.bool()
    error = (got - expected)[real].abs().max().item()
    print(f"largest logit difference vs eager on real tokens: {error:.2e}")

    greedy = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    same = torch.equal(
        eager.generate(ids, attention_mask=padding, **greedy),
        ours.generate(ids, attention_mask=padding, **greedy),
    )
    print(f"greedy generation with the KV cache, same tokens as eager: {same}")
    print()
    print("what each layer ran (prefill):")
    print(attnbias_hf.explain_model(ours, ids, attention_mask=padding))


if __name__ == "__main__":
    main()

"""A Hugging Face transformers model on attnbias: ``attn_implementation="attnbias"``.

A tiny Gemma 2 (random weights, from config): its layers alternate between a sliding window
and full attention, and every score is soft-capped, which transformers' own SDPA path cannot
run. The same weights run with attnbias and with transformers' eager attention (stock PyTorch,
independent of attnbias): the logits agree with eager run in float64, the greedy generations
with eager in the same precision, and each layer's bias and route is printed. Then the same
prompts batched continuously (``generate_batch``) on attnbias.

    pip install -e ".[transformers]" && python examples/transformers_model.py

Takes seconds on a CPU; on a GPU the same calls run on the fused kernels.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, Gemma2Config, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

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

    real = padding.bool()  # the logits of padding tokens mean nothing
    with torch.no_grad():
        got = ours(ids, attention_mask=padding).logits
        # the reference: each prompt alone, unpadded, through eager attention in float64
        # (rotary positions are relative: the shift by the padding leaves the logits as they are)
        reference = copy.deepcopy(eager).double()
        expected = [reference(ids[b, real[b]][None]).logits[0] for b in range(len(ids))]
    error = max((got[b, real[b]].double() - e).abs().max().item() for b, e in enumerate(expected))
    print(f"largest logit difference vs float64 eager on real tokens: {error:.2e}")
    assert error <= 1e-5 * max(e.abs().max().item() for e in expected), error  # of the largest

    greedy = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    same = torch.equal(
        eager.generate(ids, attention_mask=padding, **greedy),
        ours.generate(ids, attention_mask=padding, **greedy),
    )
    print(f"greedy generation with the KV cache, same tokens as eager: {same}")
    print()
    print("what each layer ran (prefill):")
    print(attnbias_hf.explain_model(ours, ids, attention_mask=padding))

    # Continuous batching: prompts of unequal lengths, prefill and decode packed in each step
    prompts = [ids[0].tolist(), ids[1, 5:].tolist(), ids[0, :3].tolist()]
    with attnbias_hf.continuous_batching(ours):
        batched = ours.generate_batch(
            inputs=prompts,
            generation_config=GenerationConfig(**greedy, eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(
                num_blocks=16, max_batch_tokens=16, max_blocks_per_request=0
            ),
        )
    alone = [
        eager.generate(torch.tensor([p], device=DEVICE), **greedy)[0, len(p) :].tolist()
        for p in prompts
    ]
    same = [batched[f"req_{i}"].generated_tokens == a for i, a in enumerate(alone)]
    print(f"continuous batching (generate_batch), same tokens as each prompt alone: {same}")


if __name__ == "__main__":
    main()

"""Would a self-speculative draft pay on SmolLM2? Early-exit acceptance, measured.

    python -m benchmarks.self_speculative [--layers 6 10 15 20 25] [--max-new-tokens 96]

A LayerSkip-style draft runs the model's first L layers, its final norm and its own head; a
proposed token is accepted when it equals the full model's greedy token. This generates
greedily with transformers on chat prompts, then reads every position's hidden state after
layer L and prints, per L, the share of positions where the early exit's argmax is the full
model's token, next to what a draft of L layers costs (L / num_layers of a step per proposed
token). A draft pays only when its acceptance clearly beats its cost share; a model trained
without LayerSkip's early-exit loss is not expected to get there. Figures, never a pass/fail.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

from shared.model_files import load_tokenizer, resolve_model

PROMPTS = [
    "Explain how a hash table works and when to use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for learning a new language quickly.",
    "Rewrite this sentence in the passive voice: The committee approved the new budget yesterday.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How do vaccines train the immune system?",
    "Write a Python function that reverses a linked list.",
]


def early_exit_agreement(model, tok, layers: list[int], max_new_tokens: int) -> tuple[int, dict[int, int]]:
    """(greedy tokens generated, per L how many of them the first L layers' exit predicted)."""
    agree = dict.fromkeys(layers, 0)
    total = 0
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
            hidden = model(out, output_hidden_states=True).hidden_states  # [embeddings, after layer 1, ...]
            start = ids.shape[1]
            target = out[0, start:]  # the token at t is predicted from the state at t - 1
            for n in layers:
                exit_logits = model.lm_head(model.model.norm(hidden[n][0, start - 1:-1]))
                agree[n] += int((exit_logits.argmax(-1) == target).sum())
        total += len(target)
    return total, agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--layers", type=int, nargs="+", default=[6, 10, 15, 20, 25])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    if max(args.layers) >= num_layers:
        raise SystemExit(f"--layers must be below the model's {num_layers}")
    total, agree = early_exit_agreement(model, load_tokenizer(args.model), args.layers, args.max_new_tokens)
    print(json.dumps({"tokens": total, "num_layers": num_layers}))
    print("| draft layers L | cost per proposal (L / layers) | acceptance |")
    print("|---|---|---|")
    for n in args.layers:
        print(f"| {n} | {n / num_layers:.2f} | {agree[n] / total:.3f} |")


if __name__ == "__main__":
    main()

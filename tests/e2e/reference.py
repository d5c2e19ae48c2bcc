"""transformers' own greedy generate, the reference our served outputs must equal."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt, EOS ignored (generation runs the full length)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out

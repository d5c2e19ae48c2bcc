"""Test helpers for LoRA adapters: PEFT adapters with random, non-zero B (so they change the
output) made on a base model directory, and the merged model transformers runs them as."""

from __future__ import annotations

from pathlib import Path

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base_dir: Path, out: Path, rank: int = 8, seed: int = 0, targets=ALL_TARGETS,
                      alpha: int | None = None, scale: float = 1.0, use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of the model in base_dir, saved to out; B random (init_lora_weights=False),
    its weights multiplied by scale."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets), lora_dropout=0.0,
                        init_lora_weights=False, use_rslora=use_rslora)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    model.save_pretrained(out)
    return out


def merged_model(base_dir: Path, adapter_dir: Path | None):
    """transformers' model with the adapter merged into its weights (float32, eval); the base alone
    for None."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()

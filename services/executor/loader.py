"""Load a Hugging Face model directory (config.json + safetensors) into our model.

The model is built on the meta device, so no memory is spent on random init, then
materialised directly in the target dtype and device and filled from the
safetensors files, tensor by tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from kernels.attention import AttentionBackend, get_backend
from services.executor.models.llama import LlamaForCausalLM

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {list(DTYPES)}")
    return DTYPES[dtype]


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    dtype = parse_dtype(dtype)
    backend = backend or get_backend("auto", str(device))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, device=device)
    model = model.to(dtype).to_empty(device=device)
    with torch.no_grad():
        model.load_weights(iter_safetensors(model_dir))
    return model.eval()

"""Load a Hugging Face model directory (config.json + safetensors) into our model.

The model is built on the meta device, so no memory is spent on random init, then
materialised directly in the target dtype and device and filled from the
safetensors files, tensor by tensor. Under tensor parallelism (`tp`) each rank builds
only its shard and copies in only its part of each checkpoint tensor; the quantized
copies (`--quantization`) are then made of that shard, calibrated by each rank alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from kernels.attention import AttentionBackend, get_backend
from services.executor.models.llama import LlamaForCausalLM
from services.executor.prepack import attach_packed
from services.executor.quantization import attach_int4, attach_int8_head, int4_copies, int8_head_copy
from services.executor.tp_group import TPGroup

log = logging.getLogger(__name__)

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
    quantization: str = "none",
    int4_max_rows: int | None = None,
    tp: TPGroup | None = None,
    prepack: str = "none",
) -> LlamaForCausalLM:
    """The model in `dtype` on `device`; `quantization` (see services.executor.quantization) may add
    int4 copies of the decoder's weights for small steps."""
    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    dtype = parse_dtype(dtype)
    backend = backend or get_backend("auto", str(device))
    quantize = quantization != "none"
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend, device=device, tp=tp)
    # int4 copies are made from the checkpoint's own values, before a cast can move them off their grid
    model = model.to(torch.float32 if quantize else dtype).to_empty(device=device)
    with torch.no_grad():
        model.load_weights(iter_safetensors(model_dir))
        copies, why = int4_copies(model, quantization, device) if quantize else (None, "asked for none")
        head, head_why = int8_head_copy(model, quantization, device) if quantize else (None, "asked for none")
        model = model.to(dtype)
        log.info("quantization %s -> %s: %s", quantization, "int4" if copies else "none", why)
        if copies:
            log.info(attach_int4(model, copies, dtype, int4_max_rows))
        if head is not None:
            log.info("head: %s; %s", head_why, attach_int8_head(model, head, dtype, int4_max_rows))
        log.info(attach_packed(model, prepack))
    return model.eval()

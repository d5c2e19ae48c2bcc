"""A LoRA adapter's files in PEFT's format, read and checked without torch.

A PEFT directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora,
base_model_name_or_path, ...) and `adapter_model.safetensors`, whose tensors are named
`base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight`: A is
[r, in_features], B [out_features, r], and the delta a projection adds is
x @ A^T @ B^T * scaling, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora).

`read_adapter` reads the config and the safetensors header (names, dtypes, shapes) and
hashes both files (the digest names the adapter's KV in the prefix cache); `check_adapter`
holds it to the base model's shapes and to the rank limit. Either raises `AdapterError`
with the HTTP status to answer (404: no such directory; 400: anything else, naming it),
so a bad adapter is refused where it is registered and never reaches a stage.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_DTYPES = {"F32", "F16", "BF16"}
_MAX_HEADER_BYTES = 64 * 1024 * 1024


class AdapterError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: each projection's (in_features, out_features), the layers, and
    names the base model goes by (checked against the adapter's base_model_name_or_path)."""

    projections: dict[str, tuple[int, int]]
    num_layers: int
    names: frozenset[str] = frozenset()

    @classmethod
    def of_config(cls, config, names: set[str] = frozenset()) -> BaseShapes:
        """From a transformers Llama-family config."""
        hidden, inter = config.hidden_size, config.intermediate_size
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, (config.num_key_value_heads or config.num_attention_heads) * head_dim
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                  "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        own = getattr(config, "_name_or_path", "") or ""
        return cls(shapes, config.num_hidden_layers, frozenset(_base_name(n) for n in {*names, own} if n))


@dataclass(frozen=True)
class AdapterFiles:
    path: Path
    config: dict
    tensors: dict[str, tuple[str, list[int]]]  # safetensors name -> (dtype, shape)
    digest: str  # SHA-256 (hex) of the config's bytes and the weights' bytes

    @property
    def scaling(self) -> float:
        r, alpha = self.config["r"], self.config.get("lora_alpha", self.config["r"])
        return alpha / r**0.5 if self.config.get("use_rslora") else alpha / r

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE


def read_adapter(path: str | Path) -> AdapterFiles:
    root = Path(path)
    if not root.is_dir():
        raise AdapterError(f"LoRA adapter path {str(path)!r} is not a directory", 404)
    try:
        config_bytes = (root / CONFIG_FILE).read_bytes()
        weights = (root / WEIGHTS_FILE).read_bytes()
    except OSError as exc:
        raise AdapterError(f"LoRA adapter at {str(path)!r}: cannot read {exc.filename or 'its files'} "
                           f"({exc.strerror}); a PEFT adapter has {CONFIG_FILE} and {WEIGHTS_FILE}") from exc
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise AdapterError(f"LoRA adapter at {str(path)!r}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"LoRA adapter at {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    digest = hashlib.sha256(hashlib.sha256(config_bytes).digest() + hashlib.sha256(weights).digest()).hexdigest()
    return AdapterFiles(root, config, _safetensors_header(weights, path), digest)


def _safetensors_header(data: bytes, path) -> dict[str, tuple[str, list[int]]]:
    """Names, dtypes and shapes of a safetensors file, its offsets checked against its size."""
    bad = f"LoRA adapter at {str(path)!r}: {WEIGHTS_FILE} is not a valid safetensors file"
    if len(data) < 8:
        raise AdapterError(f"{bad} (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise AdapterError(f"{bad} (header of {size} bytes)")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError as exc:
        raise AdapterError(f"{bad} (header: {exc})") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{bad} (header is not an object)")
    body = len(data) - 8 - size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterError(f"{bad} (entry {name!r})") from exc
        if dtype not in _DTYPES:
            raise AdapterError(f"LoRA adapter at {str(path)!r}: tensor {name!r} is {dtype}; F32, F16 or BF16 only")
        count = 1
        for d in shape:
            count *= d
        width = 4 if dtype == "F32" else 2
        if not (0 <= start <= end <= body and end - start == count * width):
            raise AdapterError(f"{bad} (tensor {name!r} lies outside the file or has the wrong size)")
        out[name] = (dtype, shape)
    return out


def check_adapter(files: AdapterFiles, base: BaseShapes, max_rank: int) -> None:
    """Raise AdapterError (400, naming what is wrong) unless the adapter fits the base model."""
    c, where = files.config, f"LoRA adapter at {str(files.path)!r}"
    if str(c.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{where}: peft_type {c.get('peft_type')!r} is not LORA")
    r = c.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{where}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise AdapterError(f"{where}: rank {r} is over this server's --max-lora-rank {max_rank}")
    alpha = c.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    for unsupported in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "fan_in_fan_out"):
        if c.get(unsupported):
            raise AdapterError(f"{where}: {unsupported} is not supported")
    if c.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias {c.get('bias')!r} is not supported (only 'none')")
    named = c.get("base_model_name_or_path")
    if named and base.names and _base_name(named) not in base.names:
        raise AdapterError(f"{where}: base_model_name_or_path {named!r} is not this server's model "
                           f"({', '.join(sorted(base.names))})")
    seen: dict[tuple[int, str], set[str]] = {}
    for name, (_, shape) in files.tensors.items():
        m = _KEY.match(name)
        if m is None or m.group(2) not in PROJECTIONS:
            raise AdapterError(f"{where}: tensor {name!r} is not a LoRA A or B of a q/k/v/o or gate/up/down "
                               f"projection (only those are supported)")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if layer >= base.num_layers:
            raise AdapterError(f"{where}: tensor {name!r} is for layer {layer}; the base model has "
                               f"{base.num_layers}")
        fan_in, fan_out = base.projections[proj]
        want = [r, fan_in] if ab == "A" else [fan_out, r]
        if shape != want:
            raise AdapterError(f"{where}: tensor {name!r} has shape {shape}, the base model needs {want} "
                               f"(rank {r}): an adapter for another base model?")
        seen.setdefault((layer, proj), set()).add(ab)
    if not seen:
        raise AdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, proj), parts in seen.items():
        if parts != {"A", "B"}:
            raise AdapterError(f"{where}: layer {layer} {proj} has lora_{''.join(sorted(parts))} without its pair")


def _base_name(name: str) -> str:
    """A model's name without its directory or hub namespace, lowercased."""
    return re.split(r"[\\/]", str(name).rstrip("/\\"))[-1].lower()

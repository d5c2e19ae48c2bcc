"""What the worker needs of the model itself: its directory (Dynamo's frontend reads the
tokenizer and chat template there), its context length and its EOS token ids (used when
Dynamo's request names none)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.model_files import resolve_model


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    max_model_len: int
    eos_token_ids: list[int]


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def model_info(model: str, max_model_len: int | None) -> ModelInfo:
    from transformers import AutoConfig, GenerationConfig

    path = resolve_model(model)
    config = AutoConfig.from_pretrained(path).get_text_config()
    length = max_model_len or getattr(config, "max_position_embeddings", None)
    if not length:
        raise SystemExit(f"{path}/config.json has no max_position_embeddings: pass --max-model-len")
    eos = set(_ids(config.eos_token_id))
    try:
        eos |= set(_ids(GenerationConfig.from_pretrained(path).eos_token_id))
    except OSError:
        pass  # no generation_config.json
    return ModelInfo(path, int(length), sorted(eos))

"""/v1/embeddings bodies and answers (OpenAI's shapes), and the model's own pooling.

A body: `input` (a string, a list of strings, a list of token ids, or a list of those lists;
at most `max_embedding_inputs`), `model` (checked as for every route), `encoding_format`
("float", the default, or "base64": the little-endian float32 bytes, as OpenAI sends them),
`dimensions` (the first that many components, renormalised to unit length as Matryoshka
models are used; a 400 above the model's hidden size), `user` (accepted), vLLM's
`add_special_tokens`. Other fields follow the one field policy (`field_policy`): those that
would change the answer and are not implemented (`truncate_prompt_tokens`) are refused.

Each input runs down the pipeline as a prefill-only request (`SamplingParams.pooling`); the
answer is `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage": {"prompt_tokens", "total_tokens"}}`.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.gateway.limits import RequestLimits
from services.gateway.openai.errors import ApiError, wrong_type
from services.gateway.openai.field_policy import HARMLESS, UNSUPPORTED, is_unused
from services.gateway.openai.readers import boolean, integer, is_token_id
from services.gateway.openai.request import check_model
from shared.messages import GenerateRequest, LoraAdapter, SamplingParams

log = logging.getLogger(__name__)

KNOWN = frozenset({"input", "model", "encoding_format", "dimensions", "user", "add_special_tokens"})
ENCODINGS = ("float", "base64")
# sentence-transformers' Pooling config key -> our pooling
_ST_MODES = (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_lasttoken", "last"),
             ("pooling_mode_cls_token", "cls"))


def model_pooling(model_dir: str | Path) -> str | None:
    """The pooling a sentence-transformers model declares (modules.json -> its Pooling
    module's config.json), or None (no such config, or a mode we do not have)."""
    root = Path(model_dir)
    try:
        modules = json.loads((root / "modules.json").read_text())
        path = next(m["path"] for m in modules if m.get("type", "").endswith(".Pooling"))
        config = json.loads((root / path / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return None
    return next((ours for key, ours in _ST_MODES if config.get(key)), None)


def resolve_pooling(flag: str | None, model_dir: str | Path) -> str:
    """--pooling, else the model's own, else mean (over the prompt's tokens, for a causal LM)."""
    pooling = flag or model_pooling(model_dir) or "mean"
    log.info("/v1/embeddings pools by %s%s", pooling, "" if flag else " (the model's pooling config, or the default)")
    return pooling


def model_hidden_size(model_dir: str | Path) -> int:
    """The length of the model's hidden states, the embeddings' (0 when the config does not say)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    return int(getattr(config, "hidden_size", 0) or 0)


@dataclass(frozen=True)
class EmbeddingsRequest:
    inputs: list[tuple[str | None, list[int] | None]]  # (text, None) or (None, token ids) each
    encoding_format: str = "float"
    dimensions: int | None = None
    add_special_tokens: bool | None = None
    lora: LoraAdapter | None = None  # the adapter the model runs under (`model` naming one)

    def to_generates(self, request_id: str, pooling: str) -> list[GenerateRequest]:
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling, lora=self.lora)
        return [GenerateRequest(request_id=f"{request_id}-{i}", params=params, prompt=text, prompt_token_ids=ids,
                                add_special_tokens=self.add_special_tokens)
                for i, (text, ids) in enumerate(self.inputs)]


def parse_embeddings(body: dict, model_names: set[str], hidden_size: int, limits: RequestLimits,
                     ) -> EmbeddingsRequest:
    check_model(body, model_names)
    _check_fields(body)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise ApiError(f"'encoding_format' must be one of {', '.join(ENCODINGS)}, got {encoding!r}.",
                       param="encoding_format")
    dimensions = integer(body, "dimensions", None)
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise ApiError(f"'dimensions' must be between 1 and the model's hidden size ({hidden_size}), got "
                       f"{dimensions}.", param="dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise wrong_type("user", "a string", user)
    return EmbeddingsRequest(_inputs(body.get("input"), limits), encoding, dimensions,
                             boolean(body, "add_special_tokens", None))


def _check_fields(body: dict) -> None:
    for name, value in body.items():
        if name in KNOWN or name in HARMLESS:
            continue
        if name in UNSUPPORTED and not is_unused(value, UNSUPPORTED[name]):
            raise ApiError(f"'{name}' is not supported by this server: it would change the answer, so it is "
                           f"refused rather than ignored.", param=name)


def _inputs(value, limits: RequestLimits) -> list[tuple[str | None, list[int] | None]]:
    if value is None:
        raise ApiError("'input' is required.", param="input")
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, list) and value and all(is_token_id(t) for t in value):
        items = [value]  # one input as token ids
    elif isinstance(value, list) and value:
        items = value
    elif isinstance(value, list):
        raise ApiError("'input' must not be empty.", param="input")
    else:
        raise wrong_type("input", "a string, an array of strings, an array of token ids, or an array of those",
                         value)
    if len(items) > limits.max_embedding_inputs:
        raise ApiError(f"Too many inputs: {len(items)}, at most {limits.max_embedding_inputs}.", param="input")
    out = []
    for i, item in enumerate(items):
        where = f"input[{i}]" if items is value else "input"
        if isinstance(item, str):
            if not item:
                raise ApiError(f"'{where}' must not be empty.", param="input")
            out.append((item, None))
        elif isinstance(item, list) and item and all(is_token_id(t) for t in item):
            out.append((None, item))
        elif isinstance(item, list) and not item:
            raise ApiError(f"'{where}' must not be empty.", param="input")
        else:
            raise ApiError(f"'{where}' must be a string or an array of non-negative integer token ids.",
                           param="input")
    return out


def vector_of(data: bytes, dimensions: int | None) -> np.ndarray:
    """The engine's unit vector (float32 little-endian bytes), cut to dimensions and renormalised."""
    v = np.frombuffer(data, dtype="<f4")
    if dimensions is None or dimensions >= len(v):
        return v
    v = v[:dimensions]
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).astype("<f4")


def embeddings_body(vectors: list[np.ndarray], prompt_tokens: int, model: str, encoding_format: str) -> dict:
    if encoding_format == "base64":
        encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        encoded = [v.tolist() for v in vectors]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def request_schema(model_names: list[str], limits: RequestLimits) -> dict:
    """The body, for /openapi.json."""
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}}
    text = {"type": "string", "minLength": 1}
    return {"type": "object", "required": ["input"], "properties": {
        "input": {"oneOf": [text, ids,
                            {"type": "array", "minItems": 1, "maxItems": limits.max_embedding_inputs, "items": text},
                            {"type": "array", "minItems": 1, "maxItems": limits.max_embedding_inputs, "items": ids}]},
        "model": {"type": "string", "enum": model_names} if model_names else {"type": "string"},
        "encoding_format": {"type": "string", "enum": list(ENCODINGS)},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
        "add_special_tokens": {"type": "boolean"},
    }}


RESPONSE_SCHEMA = {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
    "object": {"type": "string", "enum": ["list"]},
    "data": {"type": "array", "items": {"type": "object", "required": ["object", "index", "embedding"], "properties": {
        "object": {"type": "string", "enum": ["embedding"]}, "index": {"type": "integer"},
        "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]}}}},
    "model": {"type": "string"},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}},
}}

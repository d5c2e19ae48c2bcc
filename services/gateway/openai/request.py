"""What every OpenAI body goes through: JSON that is an object of valid Unicode, a served model
(404 otherwise), `n` in range, the field policy, `stream` and `stream_options`; and the
ParsedRequest the endpoints build."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from services.gateway.limits import RequestLimits
from services.gateway.openai.errors import ApiError, wrong_type
from services.gateway.openai.field_policy import unsupported_field
from services.gateway.openai.fields import bounds
from services.gateway.openai.readers import boolean, integer
from services.gateway.openai.tools import ToolMode
from shared.messages import ChatMessage, ChatOptions, GenerateRequest, SamplingParams


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    echo_only: bool = False  # echo with max_tokens 0: the prompt (and its logprobs) alone
    chat: ChatOptions | None = None
    add_special_tokens: bool | None = None
    tool_mode: ToolMode | None = None  # chat with tools: how the answer becomes tool_calls
    batch: list[tuple[str | None, list[int] | None]] | None = None  # several prompts: (text, ids) each
    include_reasoning: bool = True  # chat with a reasoning parser: show reasoning_content
    priority: int = 0  # lower first under --scheduling-policy priority (the gateway refuses it under fcfs)

    @property
    def num_prompts(self) -> int:
        return len(self.batch) if self.batch else 1

    def to_generate(self, request_id: str) -> GenerateRequest:
        return GenerateRequest(
            request_id=request_id, params=self.params, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, messages=self.messages, chat=self.chat,
            add_special_tokens=self.add_special_tokens, priority=self.priority,
        )

    def to_generates(self, request_id: str) -> list[GenerateRequest]:
        """One engine request per prompt of a batch (they share by prefix cache)."""
        if not self.batch:
            return [self.to_generate(request_id)]
        return [GenerateRequest(request_id=f"{request_id}-{i}", params=self.params, prompt=text, prompt_token_ids=ids,
                                add_special_tokens=self.add_special_tokens, priority=self.priority)
                for i, (text, ids) in enumerate(self.batch)]


class _IntegerOutOfRange(ValueError):
    pass


def _wire_int(digits: str) -> int:
    """An integer of the body, held to what msgpack (the stages' wire format) carries: a
    tool schema's `-21545974458559721472` would otherwise fail the send with a 500."""
    value = int(digits)
    if not -(2**63) <= value < 2**64:
        raise _IntegerOutOfRange(f"The request body holds an integer beyond 64 bits ({digits[:32]}...); "
                                 f"no field takes one: write it as a float or a string.")
    return value


def parse_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(f"The request body is not valid UTF-8: {exc}") from exc
    try:
        body = json.loads(text, parse_int=_wire_int)
    except _IntegerOutOfRange as exc:
        raise ApiError(str(exc)) from exc
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise ApiError(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object.")
    try:  # JSON escapes can spell unpaired surrogates, which no stage could encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError("The request body holds a string that is not valid Unicode (an unpaired surrogate).") from exc
    return body


def check_common(body: dict, model_names: set[str], endpoint: str, limits: RequestLimits) -> None:
    check_model(body, model_names)
    _check_fields(body, endpoint, limits)


def check_model(body: dict, model_names: set[str]) -> None:
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise wrong_type("model", "a string", model)
        if model not in model_names:
            served = ", ".join(public_model_names(model_names))
            raise ApiError(
                f"The model `{model}` does not exist. This server serves: {served}.", 404,
                param="model", code="model_not_found",
            )


def _check_fields(body: dict, endpoint: str, limits: RequestLimits) -> None:
    n, (low, high) = integer(body, "n", 1), bounds("n", limits)
    if not low <= n <= high:
        raise ApiError(f"'n' must be between {low} and {high}, got {n}.", param="n")
    refused = unsupported_field(body, endpoint)
    if refused is not None:
        raise ApiError(f"'{refused}' is not supported by this server: it would change the answer, so it is "
                       f"refused rather than ignored.", param=refused)


def public_model_names(model_names) -> list[str]:
    """The names a client may be shown: a model given as a file path is the server's business."""
    return sorted(n for n in model_names if not os.path.isabs(n))


def stream_flags(body: dict) -> tuple[bool, bool]:
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    if not stream:
        raise ApiError("'stream_options' can only be set when 'stream' is true.", param="stream_options")
    return stream, boolean(options, "include_usage", True)  # as vLLM: options given mean usage wanted

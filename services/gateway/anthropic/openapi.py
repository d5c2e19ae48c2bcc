"""The OpenAPI description of /v1/messages and /v1/messages/count_tokens (merged into /openapi.json
by services/gateway/openai/openapi.py): their bodies, the message they answer with, and every
status they can answer, each error in Anthropic's shape."""

from __future__ import annotations

from services.gateway.limits import RequestLimits

_STRING = {"type": "string"}
_OBJECT = {"type": "object"}
_TEXT = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": _STRING}}
_BLOCK = {"type": "object", "required": ["type"], "description": "text, tool_use (assistant), tool_result (user), "
          "or thinking (assistant, dropped)", "properties": {
              "type": {"type": "string", "enum": ["text", "tool_use", "tool_result", "thinking"]}, "text": _STRING,
              "id": _STRING, "name": _STRING, "input": _OBJECT, "tool_use_id": _STRING,
              "content": {"oneOf": [_STRING, {"type": "array", "items": _TEXT}]}, "is_error": {"type": "boolean"}}}
_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["user", "assistant"]},
    "content": {"oneOf": [_STRING, {"type": "array", "items": _BLOCK}]}}}


def _body(lim: RequestLimits, model_names: list[str], count_only: bool) -> dict:
    props = {
        "model": {"type": "string", "enum": model_names},
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "system": {"oneOf": [_STRING, {"type": "array", "items": _TEXT}]},
        "tools": {"type": "array", "maxItems": lim.max_tools, "items": {
            "type": "object", "required": ["name", "input_schema"], "properties": {
                "name": {"type": "string", "minLength": 1}, "description": _STRING, "input_schema": _OBJECT}}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": _STRING,
            "disable_parallel_tool_use": {"type": "boolean"}}},
        "thinking": {"type": "object", "required": ["type"], "description": "enabled or adaptive: the thinking as a "
                     "first thinking block (needs --reasoning-parser; budget_tokens is not enforced beyond "
                     "max_tokens); disabled or absent: dropped", "properties": {
                         "type": {"type": "string", "enum": ["enabled", "adaptive", "disabled"]},
                         "budget_tokens": {"type": "integer", "minimum": 1024},
                         "display": {"type": "string", "enum": ["summarized", "omitted"]}}},
    }
    if not count_only:
        props.update({
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
            "stop_sequences": {"type": "array", "maxItems": lim.max_stop, "items": {
                "type": "string", "minLength": 1, "maxLength": lim.max_stop_chars}},
            "stream": {"type": "boolean"},
            "temperature": {"type": "number", "minimum": 0, "maximum": 1},
            "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0},
            "metadata": _OBJECT,
            "output_config": {"type": "object", "properties": {"format": {
                "type": "object", "required": ["type", "schema"], "properties": {
                    "type": {"type": "string", "enum": ["json_schema"]}, "schema": _OBJECT}}}},
        })
    return {"type": "object", "required": ["messages"] if count_only else ["max_tokens", "messages"],
            "properties": props}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/AnthropicError"}}}}


_ERRORS = {
    "400": _error("invalid_request_error: a field has a wrong type or range, is not built, or the prompt does not fit"),
    "401": _error("authentication_error: missing or wrong API key (when the server has one)"),
    "404": _error("not_found_error: unknown model"),
    "408": _error("The request body did not arrive in time"),
    "413": _error("request_too_large: the request body is too large"),
    "415": _error("The request body is not sent as application/json"),
    "429": _error("rate_limit_error: too many requests are waiting (Retry-After)"),
    "503": _error("overloaded_error: shutting down, or a stage of the pipeline is unavailable (Retry-After)"),
    "504": _error("api_error: the request timed out"),
}

SCHEMAS = {
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": _STRING, "message": _STRING}}}},
    "AnthropicMessage": {"type": "object", "required": ["id", "type", "role", "content", "model", "stop_reason",
                                                        "stop_sequence", "usage"], "properties": {
        "id": _STRING, "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": ["assistant"]},
        "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["thinking", "text", "tool_use"]}}}},
        "model": _STRING,
        "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": {**_STRING, "nullable": True},
        "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
            "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}}}}},
}


def anthropic_paths(model_names: list[str], lim: RequestLimits) -> dict:
    def post(summary: str, body: dict, answer: dict, errors: dict) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": body}}}, "responses": {"200": answer, **errors}}}

    message = {"description": "The message, whole (JSON) or streamed (server-sent events)", "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/AnthropicMessage"}},
        # one server-sent event: its name in event, its JSON in data
        "text/event-stream": {"schema": {"type": "object", "required": ["event", "data"], "properties": {
            "event": _STRING, "data": _STRING}}}}}
    count = {"description": "The prompt's token count", "content": {"application/json": {"schema": {
        "type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}}}}
    count_errors = {k: v for k, v in _ERRORS.items() if k not in ("429", "504")}
    return {
        "/v1/messages": post("Answer a conversation (Anthropic's Messages API)", _body(lim, model_names, False),
                             message, _ERRORS),
        "/v1/messages/count_tokens": post("Count a conversation's input tokens (Anthropic's Messages API)",
                                          _body(lim, model_names, True), count, count_errors),
    }

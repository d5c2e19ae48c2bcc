"""The OpenAPI 3.0 description of the gateway's HTTP API, served at /openapi.json.

Each request body is the one fields.py declares (the parsers hold the same types, ranges and
sizes); with every status a route can answer, so a fuzzer (schemathesis, in the tests) can check the server against it:
schema-valid bodies must not cause a 5xx, invalid ones must get documented 4xx errors.
"""

from __future__ import annotations

from services.gateway.anthropic.openapi import SCHEMAS as ANTHROPIC_SCHEMAS
from services.gateway.anthropic.openapi import anthropic_paths
from services.gateway.limits import DEFAULT_LIMITS, RequestLimits
from services.gateway.openai import embeddings
from services.gateway.openai.fields import CHAT, COMPLETION, DETOKENIZE, TOKENIZE, request_schema
from services.gateway.responses_api.openapi import responses_paths


def _nullable(schema: dict) -> dict:
    return {**schema, "nullable": True}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _retry_after(description: str) -> dict:
    return {**_error(description), "headers": {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}}


_GENERATION_ERRORS = {
    "400": _error("Invalid request: a field has a wrong type or range, or the prompt does not fit"),
    "401": _error("Missing or wrong API key (when the server has one)"),
    "404": _error("Unknown model"),
    "408": _error("The request body did not arrive in time"),
    "413": _error("The request body is too large"),
    "415": _error("The request body is not sent as application/json"),
    "429": _retry_after("Too many requests are waiting"),
    "503": _retry_after("Shutting down, or a stage of the pipeline is unavailable"),
    "504": _error("The request timed out"),
}



def _tokenize_paths(model_names: list[str], lim: RequestLimits) -> dict:
    errors = {k: _GENERATION_ERRORS[k] for k in ("400", "401", "404", "413", "415", "503")}
    tokenize, detokenize = (request_schema(e, lim, model_names) for e in (TOKENIZE, DETOKENIZE))

    def post(summary: str, schema: dict, answer: dict) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": schema}}}, "responses": {"200": {"description": "The answer", "content": {
                "application/json": {"schema": answer}}}, **errors}}}

    return {
        "/tokenize": post("Token ids of a prompt or of chat messages (vLLM's shape)", tokenize, {
            "type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
                "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                "tokens": {"type": "array", "items": {"type": "integer"}},
                "token_strs": _nullable({"type": "array", "items": {"type": "string"}})}}),
        "/detokenize": post("Text of token ids (vLLM's shape)", detokenize, {
            "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}),
        "/version": {"get": {"summary": "The server's version", "responses": {
            "200": {"description": "Version", "content": {"application/json": {"schema": {
                "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}},
            "401": _GENERATION_ERRORS["401"]}}},
    }


_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"},
}}


def _response(obj: str, choice: dict) -> dict:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": {"type": "string"}, "object": {"type": "string", "enum": [obj]}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": _USAGE,
        "choices": {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"],
                                               "properties": {"index": {"type": "integer"}, **choice,
                                                              "finish_reason": _nullable({"type": "string"})}}},
    }}


_SCHEMAS = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})},
    }}},
    "Completion": _response("text_completion", {"text": {"type": "string"}}),
    "ChatCompletion": _response("chat.completion", {"message": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"type": "string"}, "content": _nullable({"type": "string"}),
                       "tool_calls": {"type": "array", "items": {"type": "object", "required": ["id", "function"]}}}},
        "logprobs": _nullable({"type": "object"}), "stop_reason": _nullable({"oneOf": [{"type": "string"},
                                                                                        {"type": "integer"}]})}),
    "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"type": "string", "enum": ["list"]},
        "data": {"type": "array", "items": {"type": "object", "required": ["id", "object"],
                                            "properties": {"id": {"type": "string"}, "object": {"type": "string"}}}},
    }},
    "Health": {"type": "object", "required": ["status", "not_ready", "stages"], "properties": {
        "status": {"type": "string", "enum": ["ok", "unavailable"]},
        "not_ready": {"type": "array", "items": {"type": "string"}},
        "stages": {"type": "object"},
    }},
}


def _generation(summary: str, request_schema: dict, response_ref: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}},
        "responses": {
            "200": {"description": "The answer, whole (JSON) or streamed (server-sent events)", "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{response_ref}"}},
                # one server-sent event: a JSON chunk in data, or [DONE] at the end
                "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                 "properties": {"data": {"type": "string"}}}},
            }},
            **_GENERATION_ERRORS,
        },
    }}


def openapi_spec(model_names: list[str], secured: bool, metrics_public: bool = False,
                 lim: RequestLimits = DEFAULT_LIMITS) -> dict:
    responses, response_schemas = responses_paths(model_names, lim.max_tools, _GENERATION_ERRORS)
    spec = {
        "openapi": "3.0.3",
        "info": {"title": "pagedserve", "version": "0.1.0",
                 "description": "OpenAI-compatible completions, chat completions, responses and embeddings, and "
                                "Anthropic's Messages API, over PagedAttention."},
        "paths": {
            "/v1/completions": _generation("Complete a prompt", request_schema(COMPLETION, lim, model_names),
                                           "Completion"),
            "/v1/chat/completions": _generation("Answer a chat", request_schema(CHAT, lim, model_names),
                                                "ChatCompletion"),
            "/v1/embeddings": {"post": {
                "summary": "Embed inputs: the model's pooled last hidden states, unit length",
                "requestBody": {"required": True, "content": {"application/json": {
                    "schema": embeddings.request_schema(model_names, lim)}}},
                "responses": {"200": {"description": "One embedding per input", "content": {"application/json": {
                    "schema": embeddings.RESPONSE_SCHEMA}}}, **_GENERATION_ERRORS}}},
            **_tokenize_paths(model_names, lim),
            **anthropic_paths(model_names, lim),
            **responses,
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": {"description": "Models", "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ModelList"}}}},
                "401": _GENERATION_ERRORS["401"],
            }}},
            "/health": {"get": {"summary": "Whether every stage is ready", "security": [], "responses": {
                "200": {"description": "Every stage is ready",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}}},
                "503": {"description": "Some stage is not ready",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}}},
            }}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "security": [], "responses": {
                "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            }}},
        },
        "components": {"schemas": {**_SCHEMAS, **ANTHROPIC_SCHEMAS, **response_schemas}},
    }
    if secured:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                 "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        spec["security"] = [{"bearer": []}, {"apiKey": []}]  # either one
        if not metrics_public:  # then /health and /metrics need the key too
            for path in ("/health", "/metrics"):
                get = spec["paths"][path]["get"]
                del get["security"]
                get["responses"]["401"] = _GENERATION_ERRORS["401"]
    return spec

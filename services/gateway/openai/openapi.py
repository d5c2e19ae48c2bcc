"""The OpenAPI 3.0 description of the gateway's HTTP API, served at /openapi.json.

It states what the parsers of this package accept (types, ranges, sizes) and every status a route
can answer, so a fuzzer (schemathesis, in the tests) can check the server against it:
schema-valid bodies must not cause a 5xx, invalid ones must get documented 4xx errors.
"""

from __future__ import annotations

from services.gateway.limits import DEFAULT_LIMITS, RequestLimits
from services.gateway.openai.fields import (
    CHAT_ROLES,
    MAX_CACHE_SALT_CHARS,
    MAX_LENGTH_PENALTY,
    MAX_LOGIT_BIAS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
)

_INT64_MAX = 2**63 - 1


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



def _stop(lim: RequestLimits) -> dict:
    return {"oneOf": [
        {"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars},
        {"type": "array", "maxItems": lim.max_stop,
         "items": {"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars}},
    ], "nullable": True}


_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": _INT64_MAX}}


def _sampling(model_names: list[str], lim: RequestLimits) -> dict:
    return {
        "model": _nullable({"type": "string", "enum": model_names}),
        "max_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": _INT64_MAX,
                                 "description": "0 only with echo (prompt scoring)"}),
        "n_predict": _nullable({"type": "integer", "minimum": -1, "maximum": _INT64_MAX,
                                "description": "llama.cpp's max_tokens; -1: the rest of the context"}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": _INT64_MAX}),
        "seed": _nullable({"type": "integer", "minimum": -(2**63), "maximum": _INT64_MAX}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": lim.max_n}),
        "use_beam_search": _nullable({"type": "boolean"}),
        "beam_width": _nullable({"type": "integer", "minimum": 1, "maximum": lim.max_n}),
        "length_penalty": _nullable({"type": "number", "minimum": -MAX_LENGTH_PENALTY,
                                     "maximum": MAX_LENGTH_PENALTY}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "presence_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                         "maximum": MAX_REPETITION_PENALTY}),
        "logit_bias": _nullable({"type": "object", "maxProperties": lim.max_logit_bias,
                                 "description": "token id (as a string) -> bias added to its logit",
                                 "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                          "maximum": MAX_LOGIT_BIAS}}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "maximum": _INT64_MAX,
                                 "description": "at most max_tokens; EOS and stop_token_ids are masked until then"}),
        "allowed_token_ids": _nullable({"type": "array", "minItems": 1, "maxItems": lim.max_allowed_token_ids,
                                        "items": {"type": "integer", "minimum": 0, "maximum": _INT64_MAX}}),
        "stop": _stop(lim),
        "stop_token_ids": _nullable({"type": "array", "maxItems": lim.max_stop_token_ids,
                                     "items": {"type": "integer", "minimum": 0, "maximum": _INT64_MAX}}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "include_stop_str_in_output": _nullable({"type": "boolean"}),
        "return_token_ids": _nullable({"type": "boolean"}),
        "response_format": _nullable({"type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                                             "strict": _nullable({"type": "boolean"})}}}}),
        "guided_json": _nullable({"oneOf": [{"type": "object"}, {"type": "string"}]}),
        "guided_regex": _nullable({"type": "string"}),
        "guided_choice": _nullable({"type": "array", "items": {"type": "string"}}),
        "guided_grammar": _nullable({"type": "string"}),
        "json_schema": _nullable({"type": "object", "description": "llama.cpp's: the output's JSON schema"}),
        "structured_outputs": _nullable({"type": "object", "description": "vLLM's: one of json, regex, choice, "
                                         "grammar (xgrammar EBNF), json_object", "properties": {
            "json": {"oneOf": [{"type": "object"}, {"type": "string"}]}, "regex": {"type": "string"},
            "choice": {"type": "array", "items": {"type": "string"}}, "grammar": {"type": "string"},
            "json_object": {"type": "boolean"}}}),
        "skip_special_tokens": _nullable({"type": "boolean"}),
        "bad_words": _nullable({"type": "array", "maxItems": lim.max_bad_words, "items": {
            "type": "string", "minLength": 1, "maxLength": lim.max_bad_words_chars, "pattern": "\\S"}}),
        "spaces_between_special_tokens": _nullable({"type": "boolean"}),
        "add_special_tokens": _nullable({"type": "boolean"}),
        "prompt_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": lim.max_logprobs,
                                      "description": "vLLM's: each prompt token's logprob and this many top ones"}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                                 "description": "vLLM's: requests with different salts share no cached KV"}),
        "user": {"type": "string"},
    }


def _completion_request(model_names: list[str], lim: RequestLimits) -> dict:
    one = [{"type": "string", "minLength": 1}, _TOKEN_IDS]
    batch = {"type": "array", "minItems": 1, "maxItems": lim.max_prompts, "items": {"oneOf": one},
             "description": "a batch: choice index = prompt * n + sample"}
    prompt = {"oneOf": [*one, batch]}
    return {"type": "object", "required": ["prompt"],
            "properties": {"prompt": prompt, **_sampling(model_names, lim),
                           "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": lim.max_logprobs}),
                           "echo": _nullable({"type": "boolean", "description": "with max_tokens 0: the prompt "
                                                                                "alone, scored"})}}


_CHAT_OPTIONS = {
    "add_generation_prompt": _nullable({"type": "boolean"}),
    "continue_final_message": _nullable({"type": "boolean", "description": "needs add_generation_prompt false"}),
    "chat_template_kwargs": _nullable({"type": "object", "description": "variables for the chat template"}),
}


def _chat_message() -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    return {"type": "object", "required": ["role"], "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}], "nullable": True},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
            "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
            "function": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string"}, "arguments": {"type": "string"}}}}}},
    }}


def _tokenize_paths(model_names: list[str]) -> dict:
    model = _nullable({"type": "string", "enum": model_names})
    errors = {k: _GENERATION_ERRORS[k] for k in ("400", "401", "404", "413", "415", "503")}
    tokenize = {"type": "object", "properties": {
        "model": model, "prompt": {"type": "string"}, "messages": {"type": "array", "minItems": 1,
                                                                   "items": _chat_message()},
        "add_special_tokens": _nullable({"type": "boolean"}), "return_token_strs": _nullable({"type": "boolean"}),
        **_CHAT_OPTIONS}}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "model": model, "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                             "maximum": _INT64_MAX}}}}

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


def _chat_request(model_names: list[str], lim: RequestLimits) -> dict:
    message = _chat_message()
    return {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "items": message},
        "logprobs": _nullable({"type": "boolean"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": lim.max_logprobs}),
        **_CHAT_OPTIONS,
        "tools": _nullable({"type": "array", "maxItems": lim.max_tools, "items": {
            "type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                    "parameters": {"type": "object"}}}}}}),
        "tool_choice": _nullable({"oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"], "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "max_completion_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": _INT64_MAX}),
        **_sampling(model_names, lim),
    }}


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
    spec = {
        "openapi": "3.0.3",
        "info": {"title": "pagedserve", "version": "0.1.0",
                 "description": "OpenAI-compatible completions and chat completions over PagedAttention."},
        "paths": {
            "/v1/completions": _generation("Complete a prompt", _completion_request(model_names, lim), "Completion"),
            "/v1/chat/completions": _generation("Answer a chat", _chat_request(model_names, lim), "ChatCompletion"),
            **_tokenize_paths(model_names),
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
        "components": {"schemas": _SCHEMAS},
    }
    if secured:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
        if not metrics_public:  # then /health and /metrics need the key too
            for path in ("/health", "/metrics"):
                get = spec["paths"][path]["get"]
                del get["security"]
                get["responses"]["401"] = _GENERATION_ERRORS["401"]
    return spec

"""The Responses API's part of `/openapi.json`: the `POST /v1/responses` body (the fields read
here, with the chat path's bounds; `reasoning` with the values request.py accepts), `GET` / `DELETE /v1/responses/{response_id}` and the
response object; merged into the gateway's description by services/gateway/openai/openapi.py."""

from __future__ import annotations

from services.gateway.openai.fields import INT64_MAX, MAX_TEMPERATURE
from services.gateway.responses_api.items import ROLES
from services.gateway.responses_api.request import MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE

_STRING = {"type": "string"}
_TEXT = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["input_text", "output_text"]}, "text": _STRING}}
_ITEM = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"type": "string", "enum": ["message"]}, "role": {"type": "string", "enum": list(ROLES)},
        "content": {"oneOf": [_STRING, {"type": "array", "items": _TEXT}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"type": "string", "enum": ["function_call"]}, "call_id": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1}, "arguments": _STRING}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"type": "string", "enum": ["function_call_output"]}, "call_id": {"type": "string", "minLength": 1},
        "output": _STRING}},
]}
_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string", "minLength": 1},
    "description": _STRING, "parameters": {"type": "object"}, "strict": {"type": "boolean", "nullable": True}}}
_FORMAT = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "name", "schema"], "properties": {
        "type": {"type": "string", "enum": ["json_schema"]}, "name": _STRING, "schema": {"type": "object"},
        "strict": {"type": "boolean", "nullable": True}}},
]}
_RESPONSE = {"type": "object", "required": ["id", "object", "created_at", "status", "model", "output"], "properties": {
    "id": _STRING, "object": {"type": "string", "enum": ["response"]}, "created_at": {"type": "integer"},
    "status": {"type": "string", "enum": ["completed", "incomplete", "in_progress"]}, "model": _STRING,
    "output": {"type": "array", "items": {"type": "object", "required": ["type"]}},
    "usage": {"type": "object", "nullable": True, "required": ["input_tokens", "output_tokens", "total_tokens"]},
}}


def request_schema(model_names: list[str], max_tools: int) -> dict:
    return {"type": "object", "required": ["input"], "properties": {
        "model": {"type": "string", "enum": model_names},
        "input": {"oneOf": [_STRING, {"type": "array", "minItems": 1, "items": _ITEM}]},
        "instructions": {**_STRING, "nullable": True},
        "tools": {"type": "array", "maxItems": max_tools, "items": _TOOL},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["none", "auto", "required"]}, {
            "type": "object", "required": ["type", "name"], "properties": {
                "type": {"type": "string", "enum": ["function"]}, "name": _STRING}}]},
        "parallel_tool_calls": {"type": "boolean", "nullable": True},
        "text": {"type": "object", "properties": {"format": _FORMAT, "verbosity": {"type": "string",
                                                                                  "enum": ["medium"]}}},
        "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": INT64_MAX, "nullable": True},
        "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE, "nullable": True},
        "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
        "stream": {"type": "boolean", "nullable": True},
        "store": {"type": "boolean", "nullable": True, "description": "default true: kept for GET and "
                                                                      "previous_response_id (bounded, expiring)"},
        "previous_response_id": {**_STRING, "nullable": True},
        "metadata": {"type": "object", "maxProperties": MAX_METADATA_PAIRS, "additionalProperties": {
            "type": "string", "maxLength": MAX_METADATA_VALUE}, "nullable": True,
            "description": f"keys of at most {MAX_METADATA_KEY} characters"},
        "reasoning": {"type": "object", "nullable": True, "properties": {
            "effort": {"type": "string", "nullable": True, "enum": [None],
                       "description": "not settable here: only null (a value is a 400)"},
            "summary": {"type": "string", "nullable": True, "enum": ["auto", "concise", "detailed", None],
                        "description": "accepted; no summary is made, the reasoning item carries the whole "
                                       "thinking (with --reasoning-parser)"},
            "context": {"type": "string", "nullable": True, "enum": ["auto", "current_turn", None]},
            "mode": {"type": "string", "nullable": True, "enum": ["standard", None]}}},
        "user": _STRING,
    }}


def responses_paths(model_names: list[str], max_tools: int, errors: dict) -> tuple[dict, dict]:
    """(the paths, the component schemas) of the Responses API; errors: the generation routes' statuses."""
    ref = {"$ref": "#/components/schemas/Response"}
    by_id = {"name": "response_id", "in": "path", "required": True, "schema": _STRING}
    missing = {"401": errors["401"], "404": {**errors["404"], "description": "No stored response of this id"}}
    deleted = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": _STRING, "object": {"type": "string", "enum": ["response"]}, "deleted": {"type": "boolean"}}}
    paths = {
        "/v1/responses": {"post": {
            "summary": "Create a response (OpenAI's Responses API)",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": request_schema(model_names, max_tools)}}},
            "responses": {"200": {"description": "The response, whole (JSON) or as typed server-sent events",
                                  "content": {"application/json": {"schema": ref}, "text/event-stream": {
                                      "schema": {"type": "object", "required": ["data"],
                                                 "properties": {"event": _STRING, "data": _STRING}}}}},
                          **errors, "404": {**errors["404"], "description": "Unknown model or previous_response_id"}},
        }},
        "/v1/responses/{response_id}": {
            "get": {"summary": "A stored response", "parameters": [by_id], "responses": {
                "200": {"description": "The response", "content": {"application/json": {"schema": ref}}}, **missing}},
            "delete": {"summary": "Delete a stored response", "parameters": [by_id], "responses": {
                "200": {"description": "Deleted", "content": {"application/json": {"schema": deleted}}}, **missing}},
        },
    }
    return paths, {"Response": _RESPONSE}

"""Output constraints (structured output): OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, llama.cpp's json_schema; at most one per request, held to the schema and grammar
size limits. The tokenizer stage compiles the constraint (a 400 if it does not compile). JSON numbers
are bounded in the grammar (shared.json_grammar) unless `structured_outputs.unbounded_numbers` is true,
which goes with any of these fields."""

from __future__ import annotations

import json

import msgspec

from services.gateway.limits import LimitExceeded, RequestLimits, schema_json
from services.gateway.openai.errors import ApiError, too_long, wrong_type
from shared.messages import StructuredOutput


def output_constraint(body: dict, limits: RequestLimits) -> StructuredOutput | None:
    """One constraint from OpenAI's response_format, vLLM's structured_outputs (or its older
    guided_* fields), or llama.cpp's json_schema; the tokenizer stage compiles it (400 if bad)."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise wrong_type("response_format", "an object", fmt)
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", StructuredOutput("json")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ApiError("'response_format.json_schema.schema' must be a JSON schema object.",
                               param="response_format")
            found.append(("response_format", json_schema_constraint("response_format", schema, limits)))
        elif kind != "text":
            raise ApiError("'response_format.type' must be text, json_object or json_schema.", param="response_format")
    outputs = body.get("structured_outputs")
    unbounded = False
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise wrong_type("structured_outputs", "an object", outputs)
        unbounded = outputs.get("unbounded_numbers") or False
        if not isinstance(unbounded, bool):
            raise ApiError("'structured_outputs.unbounded_numbers' must be a boolean.", param="structured_outputs")
        for key in ("json", "regex", "choice", "grammar", "json_object"):
            if outputs.get(key) not in (None, False):
                found.append(("structured_outputs",
                              _constraint(f"structured_outputs.{key}", key, outputs[key], limits)))
    for key in ("json", "regex", "choice", "grammar"):
        if body.get(f"guided_{key}") is not None:
            found.append((f"guided_{key}", _constraint(f"guided_{key}", key, body[f"guided_{key}"], limits)))
    if body.get("json_schema") is not None:  # llama.cpp's
        found.append(("json_schema", _constraint("json_schema", "json", body["json_schema"], limits)))
    if len(found) > 1:
        raise ApiError(f"Only one output constraint may be given, not {found[0][0]} and {found[1][0]}.",
                       param=found[1][0])
    if not found:
        return None
    constraint = found[0][1]
    if unbounded and constraint.kind in ("json", "json_schema"):
        constraint = msgspec.structs.replace(constraint, unbounded_numbers=True)
    return constraint


def _constraint(name: str, key: str, value, limits: RequestLimits) -> StructuredOutput:
    param = name.split(".")[0]
    if key == "json_object":
        return StructuredOutput("json")
    if key == "json":
        if isinstance(value, str):
            if len(value) > limits.max_schema_chars:
                raise too_long(name, "schema", limits.max_schema_chars, param)
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as exc:
                raise ApiError(f"'{name}' is not valid JSON: {exc}", param=param) from exc
        if not isinstance(value, dict):
            raise wrong_type(name, "a JSON schema object", value)
        return json_schema_constraint(name, value, limits, param)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(f"'{name}' must be a non-empty array of non-empty strings.", param=param)
        spec = json.dumps(value)
        if len(spec) > limits.max_grammar_chars:
            raise too_long(name, "choice list", limits.max_grammar_chars, param)
        return StructuredOutput("choice", spec)
    if not isinstance(value, str) or not value:
        raise ApiError(f"'{name}' must be a non-empty string.", param=param)
    if len(value) > limits.max_grammar_chars:
        raise too_long(name, key, limits.max_grammar_chars, param)
    return StructuredOutput(key, value)


def json_schema_constraint(name: str, schema: dict, limits: RequestLimits, param: str | None = None) -> StructuredOutput:
    try:
        return StructuredOutput("json_schema", schema_json(schema, limits))
    except LimitExceeded as exc:
        raise ApiError(f"The schema of '{name}' {exc}.", param=param or name) from exc

"""`POST /v1/responses` bodies, translated into the request the chat path builds.

The Responses body becomes a chat body (instructions as a system message, then the stored
conversation of `previous_response_id`, then the input items as messages; function tools in
the chat shape; `text.format` as `response_format`; `max_output_tokens` as
`max_completion_tokens`) and goes through parse_chat, so sampling, tools, structured output and
the request limits are checked exactly as on /v1/chat/completions; an error it raises names the
Responses field. The fields not built here are refused by fields.py first.

`reasoning`: the effort a model thinks with is not something this server can set (a prompt
or template switch would be a guess per model), so any `effort` but null is a 400 rather
than ignored; `summary` (and the deprecated `generate_summary`) only asks for a description of
the thinking beside the answer, which is accepted: the reasoning item carries the whole thinking
(with `--reasoning-parser`) and no summary. `context` may be "auto" or "current_turn" (what is
done: earlier reasoning is never put back into the prompt), `mode` "standard".

`strict` on a function tool is honoured where the call is forced (tool_choice required or named:
the arguments follow the schema by grammar); with tool_choice auto the model's calls are parsed,
not constrained, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.limits import RequestLimits
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.errors import ApiError, wrong_type
from services.gateway.openai.readers import boolean, integer
from services.gateway.openai.request import ParsedRequest, check_model
from services.gateway.responses_api.fields import PASSED, refused_field
from services.gateway.responses_api.items import input_messages
from services.gateway.responses_api.store import ResponseStore

MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # as OpenAI
# the chat field an error names -> the Responses field it came from
_PARAMS = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ParsedRequest  # what goes down the pipeline
    stream: bool
    store: bool
    messages: list[dict]  # the conversation without the instructions: stored for a later previous_response_id
    echo: dict = field(default_factory=dict)  # the request's settings, as the response object shows them


def parse_responses(body: dict, model_names: set[str], limits: RequestLimits, store: ResponseStore
                    ) -> ResponsesRequest:
    check_model(body, model_names)
    refused = refused_field(body)
    if refused is not None:
        raise ApiError(f"'{refused}' is not supported by this server: it would change the answer, so it is "
                       f"refused rather than ignored.", param=refused)
    if body.get("input") is None:
        raise ApiError("'input' is required.", param="input")
    instructions = body.get("instructions")
    if not isinstance(instructions, (str, type(None))):
        raise wrong_type("instructions", "a string", instructions)
    messages = _history(body, store) + input_messages(body["input"])
    max_output = integer(body, "max_output_tokens", None)
    if max_output is not None and max_output < 1:
        raise ApiError(f"'max_output_tokens' must be at least 1, got {max_output}.", param="max_output_tokens")
    tools, tool_choice = _tools(body.get("tools")), _tool_choice(body.get("tool_choice"))
    text = _text_format(body.get("text"))
    _reasoning(body.get("reasoning"))
    chat_body = {
        "model": body.get("model"), "max_completion_tokens": max_output,
        "messages": ([{"role": "system", "content": instructions}] if instructions else []) + messages,
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": body.get("parallel_tool_calls"),
        "response_format": _response_format(text["format"]),
        **{k: body[k] for k in PASSED if k in body},
    }
    try:
        chat = parse_chat(chat_body, model_names, limits)
    except ApiError as exc:
        param, message = _PARAMS.get((exc.param or "").split("[")[0], exc.param), exc.message
        for chat_name, name in _PARAMS.items():
            message = message.replace(f"'{chat_name}", f"'{name}")
        raise ApiError(message, exc.status, param, exc.error_type, exc.code, exc.headers) from exc
    echo = {
        "instructions": instructions, "max_output_tokens": max_output, "metadata": _metadata(body.get("metadata")),
        "parallel_tool_calls": boolean(body, "parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "store": boolean(body, "store", True),
        "temperature": chat.params.temperature, "top_p": chat.params.top_p, "text": text,
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "tools": body.get("tools") or [], "truncation": "disabled", "user": body.get("user"),
    }
    return ResponsesRequest(chat, boolean(body, "stream", False), echo["store"], messages, echo)


def _history(body: dict, store: ResponseStore) -> list[dict]:
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise wrong_type("previous_response_id", "a string", previous)
    entry = store.get(previous)
    if entry is None:
        raise ApiError(f"Previous response with id '{previous}' not found (it was not stored, was deleted or has "
                       f"expired).", 404, param="previous_response_id", code="previous_response_not_found")
    return list(entry.messages)


# reasoning.<key> -> the values accepted (None: the key left out)
_REASONING = {"effort": (None,), "summary": (None, "auto", "concise", "detailed"),
              "generate_summary": (None, "auto", "concise", "detailed"), "context": (None, "auto", "current_turn"),
              "mode": (None, "standard")}


def _reasoning(reasoning) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise wrong_type("reasoning", "an object", reasoning)
    for key, value in reasoning.items():
        if value is None:
            continue
        if key == "effort":
            raise ApiError(f"'reasoning.effort' {str(value)[:32]!r} is not supported: this server cannot set how "
                           f"much a model thinks, so it refuses the field rather than ignore it (leave it out or "
                           f"null).", param="reasoning.effort")
        if key not in _REASONING or value not in _REASONING[key]:
            accepted = ", ".join(repr(v) for v in _REASONING.get(key, (None,)))
            raise ApiError(f"'reasoning.{str(key)[:32]}' {str(value)[:32]!r} is not supported; accepted: {accepted}.",
                           param=f"reasoning.{str(key)[:32]}")


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise wrong_type("tools", "an array", tools)
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(f"tools[{i}] must be a function tool {{\"type\": \"function\", \"name\", \"parameters\"}}"
                           f"; {kind!r} tools are not supported.", param="tools")
        fn = {"name": tool["name"], "description": tool.get("description"), "parameters": tool.get("parameters")}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError("'tool_choice' must be none, auto, required or {\"type\": \"function\", \"name\": <a tool>}.",
                   param="tool_choice")


def _text_format(text) -> dict:
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise wrong_type("text", "an object", text)
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError("'text.verbosity' other than medium is not supported.", param="text.verbosity")
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("'text.format.type' must be text, json_object or json_schema.", param="text.format")
    if fmt["type"] == "json_schema" and (not isinstance(fmt.get("schema"), dict)
                                        or not isinstance(fmt.get("name"), str)):
        raise ApiError("'text.format' json_schema needs a 'name' and a 'schema' object.", param="text.format")
    return {"format": fmt}


def _response_format(fmt: dict) -> dict | None:
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    return None if fmt["type"] == "text" else {"type": fmt["type"]}


def _metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY and isinstance(v, str)
                       and len(v) <= MAX_METADATA_VALUE for k, v in metadata.items())):
        raise ApiError(f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} string values (keys up to "
                       f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}).", param="metadata")
    return metadata

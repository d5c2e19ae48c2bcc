"""A /v1/messages body as the OpenAI chat body the chat path parses, then parsed by it.

Translated:
- `system` (a string or text blocks) -> a first system message;
- `messages`: user and assistant turns whose content is a string or blocks: `text`; `tool_use`
  (assistant) -> the message's tool_calls; `tool_result` (user) -> a tool message answering
  `tool_use_id` (`is_error` writes "Error: " before its text); `thinking` blocks of earlier
  turns are dropped, as Anthropic drops them. A last assistant turn is a prefill: the answer
  continues it (continue_final_message);
- `tools` (name, description, input_schema) and `tool_choice` (auto, any -> required, tool ->
  a named function, none; `disable_parallel_tool_use`) -> the chat tools;
- `stop_sequences` -> stop, `max_tokens` (required, >= 1) -> max_tokens; `output_config.format`
  (a JSON schema) -> the json_schema response_format; `thinking` (enabled with a `budget_tokens`
  of at least 1024 and below max_tokens, or adaptive) -> show_thinking, which needs the server's
  `--reasoning-parser` (a 400 without one); disabled or absent: the thinking is dropped; `temperature`, `top_p`, `top_k`, `stream`,
  `model` and `metadata` have the chat path's own meaning; consecutive turns of one role are one
  turn, as Anthropic merges them. Caching hints (`cache_control`), routing and attribution
  fields (`speed`, `inference_geo`, `service_tier`, ...) are accepted: they leave the answer as it is.
Any other field goes to the chat body as it is, so the chat field policy applies to it (an
extension such as `seed` or `min_p` works; one that would change the answer and is not built
is refused). Refused by name here: the chat fields this API does in its own way or whose answer
a message cannot hold (`stop`, `n` > 1, `logprobs`, ...), and Anthropic features not built
(`thinking` between_tools, MCP servers, containers). Blocks other than text, tool_use, tool_result
and thinking (images, documents, server tools) are refused too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.gateway.limits import DEFAULT_LIMITS, RequestLimits
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.errors import ApiError, type_name, wrong_type
from services.gateway.openai.field_policy import is_unused
from services.gateway.openai.readers import integer
from services.gateway.openai.request import ParsedRequest

# read here and not passed on: the chat body gets their translation
_TRANSLATED = frozenset({"system", "messages", "max_tokens", "stop_sequences", "tools", "tool_choice", "thinking",
                         "output_config"})
# accepted and not passed on: caching hints (the prefix cache needs none), routing, attribution
_HARMLESS = frozenset({"cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id",
                       "anthropic_version", "anthropic_beta"})
# refused unless "not used" (field_policy.is_unused): name -> its neutral values
_REFUSED = {
    # the chat path's fields that a Messages field replaces, or whose answer a message cannot hold
    "stop": (), "max_completion_tokens": (), "n_predict": (), "n": (1,), "logprobs": (), "top_logprobs": (0,),
    "prompt_logprobs": (), "echo": (), "stream_options": (), "return_token_ids": (), "parallel_tool_calls": (True,),
    "add_generation_prompt": (True,), "continue_final_message": (), "messages_format": (),
    # Anthropic features not built
    "mcp_servers": (), "container": (), "context_management": (), "output_format": (),
}
_INSTEAD = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "n_predict": "max_tokens",
            "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
            "add_generation_prompt": "a last assistant turn (a prefill)",
            "continue_final_message": "a last assistant turn (a prefill)"}
ROLES = ("user", "assistant")


@dataclass(frozen=True)
class MessagesRequest:
    parsed: ParsedRequest  # the chat path's request: template, tools, sampling, stop strings
    stop_sequences: tuple[str, ...] = ()
    single_call: bool = False  # disable_parallel_tool_use: at most one tool_use block
    show_thinking: bool = False  # thinking enabled: the reasoning parser's thinking as a thinking block


def parse_messages_request(body: dict, model_names: set[str], limits: RequestLimits = DEFAULT_LIMITS,
                           count_only: bool = False, reasoning_parser: str | None = None) -> MessagesRequest:
    """count_only: a /v1/messages/count_tokens body (no max_tokens needed); reasoning_parser: the
    server's `--reasoning-parser`, without which thinking cannot be enabled."""
    _refuse_fields(body)
    chat = {k: v for k, v in body.items() if k not in _TRANSLATED and k not in _HARMLESS}
    messages = _system(body.get("system")) + _messages(body.get("messages"))
    if messages[-1]["role"] == "assistant":  # a prefill: the answer continues it
        chat.update(add_generation_prompt=False, continue_final_message=True)
    chat["messages"] = messages
    if not count_only:
        chat["max_tokens"] = _max_tokens(body)
    stops = _stop_sequences(body)
    if stops:
        chat["stop"] = stops
    show_thinking = _thinking(body.get("thinking"), chat.get("max_tokens"), reasoning_parser)
    _output_config(body.get("output_config"), chat)
    single = _tools(body, chat)
    if count_only:
        chat.pop("stream", None)
    return MessagesRequest(parse_chat(chat, model_names, limits), tuple(stops), single, show_thinking)


def _refuse_fields(body: dict) -> None:
    for name, neutral in _REFUSED.items():
        if name in body and not is_unused(body[name], neutral):
            instead = f" (use {_INSTEAD[name]})" if name in _INSTEAD else ""
            raise ApiError(f"'{name}' is not supported on /v1/messages{instead}: it would change the answer, "
                           f"so it is refused rather than ignored.", param=name)


def _max_tokens(body: dict) -> int:
    value = integer(body, "max_tokens", None)
    if value is None:
        raise ApiError("'max_tokens' is required.", param="max_tokens")
    if value < 1:
        raise ApiError(f"'max_tokens' must be at least 1, got {value}.", param="max_tokens")
    return value


def _stop_sequences(body: dict) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise wrong_type("stop_sequences", "an array of strings", stops)
    return stops  # counts and lengths are held to the limits as the chat path's `stop`


def _thinking(value, max_tokens: int | None, reasoning_parser: str | None) -> bool:
    """Whether the answer shows its thinking. Enabled is held to Anthropic's rules (budget_tokens
    >= 1024 and < max_tokens); the budget itself is not enforced (see the README): max_tokens
    bounds thinking and text together, as at Anthropic. display "omitted" drops the thinking."""
    if value is None:
        return False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return False
    if kind not in ("enabled", "adaptive"):
        raise ApiError("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": int}, {\"type\": "
                       "\"adaptive\"} or {\"type\": \"disabled\"}.", param="thinking")
    if kind == "enabled":
        budget = integer(value, "budget_tokens", None)
        if budget is None or budget < 1024:
            raise ApiError(f"'thinking.budget_tokens' must be at least 1024, got {budget}.", param="thinking")
        if max_tokens is not None and budget >= max_tokens:
            raise ApiError(f"'max_tokens' must be greater than 'thinking.budget_tokens' ({budget}), got "
                           f"{max_tokens}.", param="thinking")
    display = value.get("display")
    if display not in (None, "summarized", "omitted"):
        raise ApiError("'thinking.display' must be summarized or omitted.", param="thinking")
    if reasoning_parser is None:
        raise ApiError("'thinking' needs a server started with --reasoning-parser (such as deepseek_r1), which "
                       "splits the model's thinking off its answer; this one has none.", param="thinking")
    return display != "omitted"


def _output_config(config, chat: dict) -> None:
    """`format` (a JSON schema the answer follows) is the chat path's json_schema response_format;
    `effort` is refused: no model here reads it."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise wrong_type("output_config", "an object", config)
    if config.get("effort") is not None:
        raise ApiError("'output_config.effort' is not supported by this server.", param="output_config")
    fmt = config.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise ApiError("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": object}.",
                       param="output_config")
    if chat.get("response_format") is not None:
        raise ApiError("'output_config.format' and 'response_format' cannot both be given.", param="output_config")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _text_blocks(where: str, blocks) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise wrong_type(where, "a string or an array of text blocks", blocks)
    return "\n".join(_text(f"{where}[{i}]", b) for i, b in enumerate(blocks))


def _text(where: str, block) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type_name(block)
        raise ApiError(f"{where} must be a text block {{\"type\": \"text\", \"text\": ...}}, not {kind!r}.",
                       param=where)
    return block["text"]


def _system(system) -> list[dict]:
    if system is None:
        return []
    text = _text_blocks("system", system)
    return [{"role": "system", "content": text}] if text else []


def _messages(messages) -> list[dict]:
    if messages is None:
        raise ApiError("'messages' is required.", param="messages")
    if not isinstance(messages, list):
        raise wrong_type("messages", "an array", messages)
    if not messages:
        raise ApiError("'messages' must hold at least one message.", param="messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise wrong_type(where, "an object", msg)
        role = msg.get("role")
        if role not in ROLES:
            raise ApiError(f"{where}.role must be user or assistant, got {role!r}.", param=where)
        content = msg.get("content")
        if isinstance(content, str):
            turn = [{"role": role, "content": content}]
        elif isinstance(content, list):
            turn = _turn(where, role, content)
        else:
            raise wrong_type(f"{where}.content", "a string or an array of content blocks", content)
        if out and out[-1]["role"] == turn[0]["role"] != "tool":  # consecutive turns of a role are one turn
            last, first = out[-1], turn.pop(0)
            last["content"] = "\n".join(t for t in (last["content"], first["content"]) if t)
            last["tool_calls"] = last.get("tool_calls", []) + first.get("tool_calls", [])
        out += turn
    if not out:
        raise ApiError("'messages' holds no content.", param="messages")
    return out


def _turn(where: str, role: str, blocks: list) -> list[dict]:
    """One turn's blocks as chat messages: a user turn's tool results first (one tool message
    each), then its text; an assistant turn's text with its tool calls."""
    texts, calls, results = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(at, block))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(at, block))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(at, block))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's thinking is not part of the prompt (as Anthropic's own API)
        else:
            shown = kind if kind is not None else type_name(block)
            allowed = "text, tool_use or thinking" if role == "assistant" else "text or tool_result"
            raise ApiError(f"{at}: a {role} block must be {allowed}, not {shown!r}.", param=at)
    text = "\n".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _tool_use(where: str, block: dict) -> dict:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise ApiError(f"{where} must be {{\"type\": \"tool_use\", \"id\": str, \"name\": str, \"input\": "
                       f"object}}.", param=where)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _tool_result(where: str, block: dict) -> dict:
    call_id, is_error = block.get("tool_use_id"), block.get("is_error")
    if not isinstance(call_id, str) or not isinstance(is_error, (bool, type(None))):
        raise ApiError(f"{where} must be {{\"type\": \"tool_result\", \"tool_use_id\": str, \"content\", "
                       f"\"is_error\": bool}}.", param=where)
    content = block.get("content")
    text = "" if content is None else _text_blocks(f"{where}.content", content)
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if is_error else text}


def _tools(body: dict, chat: dict) -> bool:
    """Puts the chat tools and tool_choice in chat; True when at most one call may be made."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    names = []
    if tools is not None:
        if not isinstance(tools, list):
            raise wrong_type("tools", "an array", tools)
        chat["tools"] = [_tool(f"tools[{i}]", t) for i, t in enumerate(tools)]
        names = [t["function"]["name"] for t in chat["tools"]]
    strict = isinstance(tools, list) and any(isinstance(t, dict) and t.get("strict") is True for t in tools)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if strict and kind not in ("any", "tool"):  # only a forced call is held to its schema (by the grammar)
        raise ApiError("'strict' tools need tool_choice any or tool: only a forced call is held to its schema.",
                       param="tools")
    if choice is None:
        return False
    kind = choice.get("type") if isinstance(choice, dict) else None
    single = choice.get("disable_parallel_tool_use") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none") or not isinstance(single, (bool, type(None))):
        raise ApiError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}, with "
                       "\"name\" for tool and an optional boolean \"disable_parallel_tool_use\".", param="tool_choice")
    if kind in ("any", "tool") and not names:
        raise ApiError(f"'tool_choice' {kind} needs 'tools'.", param="tool_choice")
    if kind == "tool":
        if choice.get("name") not in names:
            raise ApiError("'tool_choice'.name must name one of the tools.", param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(kind, kind)
    if single:
        chat["parallel_tool_calls"] = False
    return bool(single)


def _tool(where: str, tool) -> dict:
    if not isinstance(tool, dict):
        raise wrong_type(where, "an object", tool)
    if tool.get("type") not in (None, "custom"):
        raise ApiError(f"{where}: only client tools (name, description, input_schema) are supported, not "
                       f"{str(tool.get('type'))[:64]!r}.", param="tools")
    name, description, schema = tool.get("name"), tool.get("description"), tool.get("input_schema")
    if not isinstance(name, str) or not name or not isinstance(description, (str, type(None))) \
            or not isinstance(schema, dict):
        raise ApiError(f"{where} must be {{\"name\": str, \"description\": str, \"input_schema\": object}}.",
                       param="tools")
    return {"type": "function", "function": {"name": name, "description": description or "", "parameters": schema}}

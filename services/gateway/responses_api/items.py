"""Responses items as chat messages, the shape the chat path reads.

Input: a string (one user message) or a list of items: messages (`type` "message" or left
out; role user, system, developer or assistant; content a string or `input_text` /
`output_text` parts), `function_call` items (the assistant's calls: consecutive ones, and a
text message of the assistant just before them, become one assistant message with tool_calls)
and `function_call_output` items (a tool message answering its call_id). `reasoning` items
are dropped (chat templates leave past reasoning out). Anything else (images, files, item
references, built-in tool calls) is a 400 naming the item.

Output: a response's output items become the assistant message that continues the
conversation (previous_response_id).
"""

from __future__ import annotations

import json

from services.gateway.openai.errors import ApiError, type_name

ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(value) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(f"'input' must be a string or an array of items, not {type_name(value)}.", param="input")
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where} must be an object, not {type_name(item)}.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(where, item))
        elif kind == "function_call":
            _append_call(messages, _call(where, item))
        elif kind == "function_call_output":
            messages.append(_call_output(where, item))
        elif kind != "reasoning":
            raise ApiError(f"{where}: items of type {kind!r} are not supported; send messages, function_call "
                           f"and function_call_output items.", param="input")
    if not messages:
        raise ApiError("'input' must hold at least one message.", param="input")
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """The assistant turn a response's output items make (its text, then its calls)."""
    messages: list[dict] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(p["text"] for p in item["content"] if p["type"] == "output_text")
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            _append_call(messages, {"id": item["call_id"], "type": "function",
                                    "function": {"name": item["name"], "arguments": item["arguments"]}})
    return messages


def _message(where: str, item: dict) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise ApiError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}.", param="input")
    return {"role": role, "content": _text(f"{where}.content", item.get("content"))}


def _text(where: str, content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"{where} must be a string or an array of input_text parts.", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type_name(part)
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(f"{where}[{j}] must be an input_text part {{\"type\": \"input_text\", \"text\": ...}}; "
                           f"only text is supported, not {kind!r}.", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _call(where: str, item: dict) -> dict:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise ApiError(f"{where}: a function_call item needs a call_id and a name.", param="input")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _append_call(messages: list[dict], call: dict) -> None:
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _call_output(where: str, item: dict) -> dict:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError(f"{where}: a function_call_output item needs the call_id it answers.", param="input")
    output = item.get("output")
    if isinstance(output, list):
        output = _text(f"{where}.output", output)
    elif not isinstance(output, str):
        raise ApiError(f"{where}.output must be a string or an array of input_text parts.", param="input")
    return {"role": "tool", "content": output, "tool_call_id": call_id}

"""/v1/chat/completions bodies: messages (text parts, tool calls), the chat template's options,
tools, logprobs (`logprobs` true with `top_logprobs`), as a ParsedRequest."""

from __future__ import annotations

import json

import msgspec

from services.gateway.limits import DEFAULT_LIMITS, RequestLimits
from services.gateway.openai.errors import ApiError, type_name, wrong_type
from services.gateway.openai.fields import CHAT, CHAT_ROLES
from services.gateway.openai.readers import boolean, integer
from services.gateway.openai.request import ParsedRequest, check_common, stream_flags
from services.gateway.openai.sampling import check_work, generation_params, logprob_count, read_max_tokens
from services.gateway.openai.tools import ToolError, parse_tools
from shared.messages import ChatMessage, ChatOptions, ToolCall

# apply_chat_template's own arguments: not template variables a client may set
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def parse_chat(body: dict, model_names: set[str], limits: RequestLimits = DEFAULT_LIMITS) -> ParsedRequest:
    check_common(body, model_names, CHAT, limits)
    messages = parse_messages(body)
    # default: the rest of the context, which the tokenizer stage works out (None)
    if body.get("max_completion_tokens") is not None:
        max_tokens = read_max_tokens(body, "max_completion_tokens", None)
    else:
        max_tokens = read_max_tokens(body, "max_tokens", None)
    stream, include_usage = stream_flags(body)
    wants = boolean(body, "logprobs", False)
    top = logprob_count(body, "top_logprobs", limits)
    if top is not None and not wants and top > 0:
        raise ApiError("'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    params = generation_params(body, max_tokens, (top or 0) if wants else None,
                               logprob_count(body, "prompt_logprobs", limits), False, limits)
    check_work(params, [sum(len(m.content) for m in messages)], limits, "prompt_logprobs")
    try:
        tool_defs, tool_mode, tool_constraint = parse_tools(body, limits)
    except ToolError as exc:
        raise ApiError(str(exc), param=exc.param) from exc
    if tool_constraint is not None:
        if params.structured is not None:
            raise ApiError("A required or named tool_choice cannot be combined with another output constraint.",
                           param="tool_choice")
        if params.use_beam_search or params.ignore_eos:
            raise ApiError("'tool_choice' required or named cannot be combined with beam search or ignore_eos.",
                           param="tool_choice")
        params = msgspec.structs.replace(params, structured=tool_constraint)
    chat = msgspec.structs.replace(chat_options(body), tools=tool_defs)
    return ParsedRequest(
        "chat", params, stream, include_usage, boolean(body, "return_token_ids", False),
        messages=messages, chat=chat, add_special_tokens=boolean(body, "add_special_tokens", None),
        tool_mode=tool_mode, include_reasoning=boolean(body, "include_reasoning", True),
        priority=integer(body, "priority", 0),
    )


def chat_options(body: dict) -> ChatOptions:
    """vLLM's chat fields: add_generation_prompt, continue_final_message, chat_template_kwargs."""
    add = boolean(body, "add_generation_prompt", True)
    cont = boolean(body, "continue_final_message", False)
    if add and cont:
        raise ApiError("'continue_final_message' needs 'add_generation_prompt': false.", param="continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise wrong_type("chat_template_kwargs", "an object", kwargs)
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ApiError(f"'chat_template_kwargs' may not set {', '.join(reserved)}.", param="chat_template_kwargs")
    return ChatOptions(add_generation_prompt=add, continue_final_message=cont, template_kwargs=kwargs)


def parse_messages(body: dict) -> list[ChatMessage]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError("'messages' is required.", param="messages")
    if not isinstance(messages, list):
        raise wrong_type("messages", "an array", messages)
    if not messages:
        raise ApiError("'messages' must hold at least one message.", param="messages")
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, msg) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise wrong_type(where, "an object", msg)
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}.", param=where)
    content = msg.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "\n".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    elif not isinstance(content, str):
        raise wrong_type(f"{where}.content", "a string or an array of text parts", content)
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list) or (calls and role != "assistant"):
        raise ApiError(f"{where}.tool_calls must be an array, on an assistant message.", param=where)
    tool_calls = [_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    call_id, name = msg.get("tool_call_id"), msg.get("name")
    if not isinstance(call_id, (str, type(None))) or not isinstance(name, (str, type(None))):
        raise ApiError(f"{where}.tool_call_id and name must be strings.", param=where)
    return ChatMessage(role=role, content=content, tool_calls=tool_calls, tool_call_id=call_id, name=name)


def _tool_call(where: str, call) -> ToolCall:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                       f"\"arguments\"}}}}.", param=where)
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return ToolCall(id=str(call.get("id") or ""), name=fn["name"], arguments=args)


def _text_part(where: str, part) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type_name(part)
        raise ApiError(
            f"{where} must be a text part {{\"type\": \"text\", \"text\": ...}}; "
            f"only text content is supported, not {kind!r}.", param=where,
        )
    return part["text"]

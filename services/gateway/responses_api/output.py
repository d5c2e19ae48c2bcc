"""The response object of `/v1/responses` and its output items, as OpenAI shapes them.

A finished answer becomes output items: its thinking (with a reasoning parser, thinking.py) as
a `reasoning` item first (the text as one `reasoning_text` part in `content`; `summary` is
empty, no summaries are made), then a `message` with one `output_text` part, and/or
`function_call` items (tool calls found as the chat path finds them, services/gateway/openai/
tools.py). A choice cut short by the token limit makes the response (and its items)
"incomplete", with `incomplete_details.reason` "max_output_tokens".
"""

from __future__ import annotations

import time
import uuid

from services.gateway.openai.tools import ToolMode, extract_calls_off_loop
from shared.messages import ToolCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status != "in_progress" else []}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [reasoning_part(text)] if status != "in_progress" else []}


def reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


async def output_items(mode: ToolMode | None, text: str, status: str, reasoning: str = "",
                       reasoning_status: str = "completed") -> list[dict]:
    """The items of a finished answer: its reasoning, if any, then its text (the content alone) as
    a message, or the tool calls in it (and the text around them, if any). An answer that is all
    reasoning has no message; one with nothing at all, an empty one."""
    items = [reasoning_item(new_id("rs"), reasoning, reasoning_status)] if reasoning else []
    content, calls = text, []
    if mode is not None and mode.choice != "none":
        content, calls = await extract_calls_off_loop(mode, text)
    if content or not (calls or items):
        items.append(message_item(new_id("msg"), content, status))
    return items + [call_from(c, status) for c in calls]


def call_from(call: ToolCall, status: str) -> dict:
    return call_item(new_id("fc"), call.id, call.name, call.arguments, status)


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseObject:
    """One response's envelope: its id, creation time, model and the request's settings."""

    def __init__(self, model: str, echo: dict):
        self.id, self.created_at, self.model, self.echo = new_id("resp"), int(time.time()), model, echo

    def body(self, status: str, output: list[dict], usage_: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
                "reasoning": {"effort": None, "summary": None}, "usage": usage_, **self.echo}

"""Anthropic's answer of one request, from its TextDeltas: the whole message, or the typed events
of its stream.

A message is `{"id": "msg_...", "type": "message", "role": "assistant", "content": [blocks],
"model", "stop_reason", "stop_sequence", "usage": {"input_tokens", "output_tokens"}}`. The blocks
are the answer's text and, with tools, the calls the chat path's tool machinery finds in it
(services/gateway/openai/tools.py) as `tool_use` blocks (`input` the call's arguments, an
object; a call whose arguments are not one, as when max_tokens cut it short, stays text).
stop_reason: "max_tokens" when the length ran out, "stop_sequence" (with `stop_sequence`) when
one of the request's stop_sequences ended it, "tool_use" when it made calls, else "end_turn".

A stream sends message_start (with the input tokens) and a ping, then each block as
content_block_start, content_block_delta (text_delta or input_json_delta) and
content_block_stop, then message_delta (stop_reason and usage) and message_stop. Text streams
as it comes; with tools (other than tool_choice none) the answer is held back, as on the chat
path, and its blocks are sent whole at the end.
"""

from __future__ import annotations

import json
import uuid

from services.gateway.openai.tools import ToolMode, extract_calls_off_loop
from shared.messages import ToolCall


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(finish_reason: str | None, stopped_by, stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an answer that ended with this finish_reason and stop_reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stopped_by, str) and stopped_by in stop_sequences:
        return "stop_sequence", stopped_by
    return "end_turn", None


def _tool_use(call: ToolCall) -> dict | None:
    try:  # not strict: the grammar lets a string hold raw control characters
        args = json.loads(call.arguments, strict=False)
    except (ValueError, RecursionError):
        return None
    if not isinstance(args, dict):
        return None
    return {"type": "tool_use", "id": _tool_use_id(), "name": call.name, "input": args}


async def content_blocks(mode: ToolMode | None, text: str, single_call: bool) -> tuple[list[dict], bool]:
    """(the answer's blocks, whether it made tool calls)."""
    if mode is None or mode.choice == "none":
        return ([{"type": "text", "text": text}] if text else []), False
    content, calls = await extract_calls_off_loop(mode, text)
    uses = [_tool_use(c) for c in (calls[:1] if single_call else calls)]
    if not uses or any(u is None for u in uses):
        return ([{"type": "text", "text": text}] if text else []), False
    return ([{"type": "text", "text": content}] if content else []) + uses, True


class MessageShape:
    """One request's message: its counts as the deltas come, then the body or the stream's events."""

    def __init__(self, message_id: str, model: str, mode: ToolMode | None, stop_sequences: tuple[str, ...],
                 single_call: bool = False):
        self.id, self.model = message_id, model
        self.mode = mode if mode is not None and mode.choice != "none" else None
        self.stop_sequences, self.single_call = stop_sequences, single_call
        self.input_tokens = self.output_tokens = 0
        self.finish_reason: str | None = None
        self.stopped_by: int | str | None = None

    def record(self, msg) -> bool:
        """Note a TextDelta's counts; True once the answer ended."""
        self.input_tokens, self.output_tokens = msg.num_prompt_tokens, msg.num_output_tokens
        if msg.finish_reason is not None:
            self.finish_reason, self.stopped_by = msg.finish_reason, msg.stop_reason
            return True
        return False

    def _ending(self, made_calls: bool) -> tuple[str, str | None]:
        reason, sequence = stop_reason(self.finish_reason, self.stopped_by, self.stop_sequences)
        return ("tool_use", None) if made_calls and reason == "end_turn" else (reason, sequence)

    def usage(self) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}

    def _message(self, content: list[dict], reason: str | None, sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content, "model": self.model,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    async def full(self, text: str) -> dict:
        blocks, made_calls = await content_blocks(self.mode, text, self.single_call)
        return self._message(blocks, *self._ending(made_calls), self.usage())

    # --- a stream: (event name, data) pairs -----------------------------------------------

    def start(self) -> list[tuple[str, dict]]:
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0}
        return [("message_start", {"type": "message_start", "message": self._message([], None, None, usage)}),
                ("ping", {"type": "ping"})]


class EventStream:
    """The events of one streamed message, delta by delta (each TextDelta recorded first)."""

    def __init__(self, shape: MessageShape):
        self.shape = shape
        self._held: list[str] = []  # with tools: the answer so far, sent as blocks at the end
        self._open = False  # the streamed text block was started

    def on_text(self, text: str) -> list[tuple[str, dict]]:
        if self.shape.mode is not None:
            self._held.append(text)
            return []
        if not text:
            return []
        events = [] if self._open else [_block_start(0, {"type": "text", "text": ""})]
        self._open = True
        return events + [_delta(0, {"type": "text_delta", "text": text})]

    async def end(self) -> list[tuple[str, dict]]:
        """The rest of the events, once the answer ended."""
        made_calls, events = False, []
        if self.shape.mode is not None:
            blocks, made_calls = await content_blocks(self.shape.mode, "".join(self._held), self.shape.single_call)
            for index, block in enumerate(blocks):
                events += _whole_block(index, block)
        elif self._open:
            events.append(_block_stop(0))
        reason, sequence = self.shape._ending(made_calls)
        events.append(("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                            "stop_sequence": sequence},
                                         "usage": self.shape.usage()}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def _block_start(index: int, block: dict) -> tuple[str, dict]:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def _delta(index: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _block_stop(index: int) -> tuple[str, dict]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


def _whole_block(index: int, block: dict) -> list[tuple[str, dict]]:
    if block["type"] == "text":
        start = _block_start(index, {"type": "text", "text": ""})
        delta = _delta(index, {"type": "text_delta", "text": block["text"]})
    else:
        start = _block_start(index, {**block, "input": {}})
        delta = _delta(index, {"type": "input_json_delta",
                               "partial_json": json.dumps(block["input"], ensure_ascii=False)})
    return [start, delta, _block_stop(index)]

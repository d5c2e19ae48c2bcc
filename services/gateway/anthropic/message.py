"""Anthropic's answer of one request, from its TextDeltas: the whole message, or the typed events
of its stream.

A message is `{"id": "msg_...", "type": "message", "role": "assistant", "content": [blocks],
"model", "stop_reason", "stop_sequence", "usage": {"input_tokens", "output_tokens"}}`. With the
server's `--reasoning-parser`, each delta's thinking is split off first (services/gateway/reasoning.py):
with thinking enabled it is a first `{"type": "thinking", "thinking", "signature": ""}` block (no
signature: nothing here signs it), otherwise dropped; the rest of the blocks are made of the content
alone. The blocks are the answer's text and, with tools, the calls the chat path's tool machinery finds in it
(services/gateway/openai/tools.py) as `tool_use` blocks (`input` the call's arguments, an
object; a call whose arguments are not one, as when max_tokens cut it short, stays text).
stop_reason: "max_tokens" when the length ran out, "stop_sequence" (with `stop_sequence`) when
one of the request's stop_sequences ended it, "tool_use" when it made calls, else "end_turn".

A stream sends message_start (with the input tokens) and a ping, then each block as
content_block_start, content_block_delta (thinking_delta, text_delta or input_json_delta) and
content_block_stop, then message_delta (stop_reason and usage) and message_stop. Thinking and
text stream as they come (no signature_delta: the signature stays the start's ""); with tools
(other than tool_choice none) the content is held back, as on the chat path, and its blocks are
sent whole at the end (the thinking still streams before them).
"""

from __future__ import annotations

import json
import uuid

from services.gateway.openai.tools import ToolMode, extract_calls_off_loop
from services.gateway.reasoning import make_parser
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
                 single_call: bool = False, reasoning_parser: str | None = None, show_thinking: bool = False):
        self.id, self.model = message_id, model
        self._reasoning = make_parser(reasoning_parser)
        self.show_thinking = show_thinking and self._reasoning is not None
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

    def split(self, msg) -> tuple[str, str]:
        """A TextDelta's (thinking, content): all content without a reasoning parser, no thinking
        unless it is shown. Call once per delta, in order (the last one hands over what was held)."""
        if self._reasoning is None:
            return "", msg.text
        thinking, content = self._reasoning.feed(msg.text)
        if msg.finish_reason is not None:
            more_thinking, more_content = self._reasoning.finish()
            thinking, content = thinking + more_thinking, content + more_content
        return (thinking if self.show_thinking else ""), content

    def _ending(self, made_calls: bool) -> tuple[str, str | None]:
        reason, sequence = stop_reason(self.finish_reason, self.stopped_by, self.stop_sequences)
        return ("tool_use", None) if made_calls and reason == "end_turn" else (reason, sequence)

    def usage(self) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}

    def _message(self, content: list[dict], reason: str | None, sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "content": content, "model": self.model,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    async def full(self, text: str, thinking: str = "") -> dict:
        """text: the content; thinking: what split() showed of the thinking."""
        blocks, made_calls = await content_blocks(self.mode, text, self.single_call)
        if thinking:
            blocks.insert(0, {"type": "thinking", "thinking": thinking, "signature": ""})
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
        self._held: list[str] = []  # with tools: the content so far, sent as blocks at the end
        self._blocks = 0  # blocks started so far: the last one's index is this - 1
        self._open: str | None = None  # the type of the block being streamed, if one is

    def on_delta(self, thinking: str, text: str) -> list[tuple[str, dict]]:
        """The events of a delta's (thinking, content), as MessageShape.split gives them."""
        events = []
        if thinking:
            events += self._into({"type": "thinking", "thinking": "", "signature": ""})
            events.append(_delta(self._blocks - 1, {"type": "thinking_delta", "thinking": thinking}))
        if self.shape.mode is not None:
            self._held.append(text)
        elif text:
            events += self._into({"type": "text", "text": ""})
            events.append(_delta(self._blocks - 1, {"type": "text_delta", "text": text}))
        return events

    def _into(self, block: dict) -> list[tuple[str, dict]]:
        """Start a block of this one's type unless one is open (closing another type's)."""
        if self._open == block["type"]:
            return []
        events = self._close()
        self._open, self._blocks = block["type"], self._blocks + 1
        return events + [_block_start(self._blocks - 1, block)]

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        self._open = None
        return [_block_stop(self._blocks - 1)]

    async def end(self) -> list[tuple[str, dict]]:
        """The rest of the events, once the answer ended."""
        made_calls, events = False, self._close()
        if self.shape.mode is not None:
            blocks, made_calls = await content_blocks(self.shape.mode, "".join(self._held), self.shape.single_call)
            for offset, block in enumerate(blocks):
                events += _whole_block(self._blocks + offset, block)
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

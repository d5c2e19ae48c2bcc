"""The typed server-sent events of a streamed response, each numbered (`sequence_number`).

`response.created` and `response.in_progress` open the stream; each output item is
`response.output_item.added`, its deltas (`response.output_text.delta` inside a
`response.content_part.added` / `.done` pair for a message, `response.function_call_arguments.delta`
for a call, `response.reasoning_text.delta` inside a `content_part` pair with a `reasoning_text`
part for a reasoning item), its `.done` event and `response.output_item.done`; `response.completed` (or
`response.incomplete`) carries the whole response last. An item is either streamed live (text,
or the arguments of a call forced by a named tool_choice) or, when the answer must be parsed for
calls first (tool_choice auto or required), sent whole at the end by `replay`. With a reasoning
parser the thinking streams live as a reasoning item (`reasoning`), whatever the tool choice, and
the message opens at the answer's first text (`text`), closing the reasoning item first.
"""

from __future__ import annotations

from services.gateway.responses_api.output import (
    ResponseObject,
    call_item,
    message_item,
    new_id,
    reasoning_item,
    reasoning_part,
    text_part,
)


class ResponseEvents:
    def __init__(self, obj: ResponseObject):
        self.obj = obj
        self.seq = 0
        self.output: list[dict] = []  # the finished items
        self._open: dict | None = None  # the item being streamed
        self._text: list[str] = []

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        body = self.obj.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def open_message(self, item_id: str | None = None) -> list[dict]:
        self._open, self._text = message_item(item_id or new_id("msg"), "", "in_progress"), []
        return [self._added(), self._event("response.content_part.added", **self._where(), content_index=0,
                                           part=text_part(""))]

    def open_reasoning(self) -> list[dict]:
        self._open, self._text = reasoning_item(new_id("rs"), "", "in_progress"), []
        return [self._added(), self._event("response.content_part.added", **self._where(), content_index=0,
                                           part=reasoning_part(""))]

    def reasoning(self, text: str) -> list[dict]:
        """Thinking text: the reasoning item's delta, the item opened first if need be."""
        if not text:
            return []
        return (self.open_reasoning() if self._open is None else []) + self.delta(text)

    def text(self, text: str) -> list[dict]:
        """The answer's text: the message's delta, the reasoning item closed and the message opened
        first if need be."""
        if not text:
            return []
        events = self.close("completed") if self.reasoning_open else []
        if self._open is None:
            events += self.open_message()
        return events + self.delta(text)

    @property
    def reasoning_open(self) -> bool:
        return self._open is not None and self._open["type"] == "reasoning"

    def end_live(self, status: str) -> list[dict]:
        """The end of a live answer: the open item closed; a message, empty, if no item came."""
        events = self.open_message() if self._open is None and not self.output else []
        return events + (self.close(status) if self._open is not None else [])

    def open_call(self, call_id: str, name: str, item_id: str | None = None) -> list[dict]:
        self._open, self._text = call_item(item_id or new_id("fc"), call_id, name, "", "in_progress"), []
        return [self._added()]

    def delta(self, text: str) -> list[dict]:
        if not text or self._open is None:
            return []
        self._text.append(text)
        if self._open["type"] == "message":
            return [self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                logprobs=[])]
        if self._open["type"] == "reasoning":
            return [self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)]
        return [self._event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def close(self, status: str) -> list[dict]:
        item, text = self._open, "".join(self._text)
        self._open = None
        where = {"item_id": item["id"], "output_index": len(self.output)}
        item["status"] = status
        if item["type"] == "message":
            item["content"] = [text_part(text)]
            events = [self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        elif item["type"] == "reasoning":
            item["content"] = [reasoning_part(text)]
            events = [self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                      self._event("response.content_part.done", **where, content_index=0, part=item["content"][0])]
        else:
            item["arguments"] = text
            events = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=text)]
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def replay(self, items: list[dict], status: str) -> list[dict]:
        """Finished items (parsed at the end), as the events that stream each one whole."""
        events = []
        for item in items:
            if item["type"] == "message":
                events += self.open_message(item["id"]) + self.delta(item["content"][0]["text"])
            else:
                events += self.open_call(item["call_id"], item["name"], item["id"]) + self.delta(item["arguments"])
            events += self.close(status)
        return events

    def finish(self, status: str, usage_: dict) -> dict:
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return self._event(kind, response=self.obj.body(status, self.output, usage_))

    def error(self, code: str, message: str, param: str | None) -> dict:
        """The event that ends a stream the pipeline failed (a dropped stage, a timeout)."""
        return self._event("error", code=code, message=message, param=param)

    def _added(self) -> dict:
        return self._event("response.output_item.added", output_index=len(self.output), item=dict(self._open))

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output)}

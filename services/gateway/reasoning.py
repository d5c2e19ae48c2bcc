"""Reasoning parsers: a model's thinking split off its answer, as text arrives (`--reasoning-parser`).

`deepseek_r1` (vLLM's meaning): everything up to the first `</think>` is reasoning, the
rest is content; a `<think>` before it is dropped, and may be missing (the chat template
opened the thinking itself). An answer with no `</think>` is reasoning only. A parser is
fed text deltas and returns (reasoning_delta, content_delta) for each: a marker split across
deltas is held back until it is whole or can no longer be one, so no part of a marker is
ever emitted, and any split of a text into deltas gives the same two strings as the whole
text in one `feed` (then `finish`, which hands over what was held). One parser per choice;
the chat response (openai/responses.py), the Messages API (anthropic/message.py) and the
Responses API (responses_api/thinking.py) use it.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1",)


class ThinkParser:
    """deepseek_r1: `<think>` (optional) reasoning `</think>` content."""

    start, end = "<think>", "</think>"

    def __init__(self) -> None:
        self._held = ""  # text that may be the start of a marker
        self._thinking = True
        self._opened = False  # a <think> was seen (and dropped)

    def feed(self, text: str) -> tuple[str, str]:
        if not self._thinking:
            return "", text
        text = self._held + text
        self._held = ""
        if not self._opened:
            at, ends = text.find(self.start), text.find(self.end)
            if at >= 0 and (ends < 0 or at < ends):
                text, self._opened = text[:at] + text[at + len(self.start):], True
        at = text.find(self.end)
        if at >= 0:
            self._thinking = False
            return text[:at], text[at + len(self.end):]
        keep = self._partial(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""

    def _partial(self, text: str) -> int:
        """The length of the longest end of text that begins a marker still looked for."""
        markers = (self.end,) if self._opened else (self.end, self.start)
        for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
            if any(m.startswith(text[-n:]) for m in markers):
                return n
        return 0

    @property
    def thinking(self) -> bool:
        """No `</think>` seen yet: what comes is still reasoning."""
        return self._thinking

    def finish(self) -> tuple[str, str]:
        """What was held back (a marker's start that never completed: plain reasoning text)."""
        held, self._held = self._held, ""
        return (held, "") if self._thinking else ("", held)


def make_parser(name: str | None) -> ThinkParser | None:
    if name is None:
        return None
    if name == "deepseek_r1":
        return ThinkParser()
    raise ValueError(f"unknown reasoning parser {name!r}; one of {', '.join(REASONING_PARSERS)}")


def split_reasoning(name: str, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    parser = make_parser(name)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2

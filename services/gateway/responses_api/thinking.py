"""One response's thinking, split off its answer as the text arrives (`--reasoning-parser`).

The server's reasoning parser (services/gateway/reasoning.py) is run on an answer only when it
is free text: an answer constrained by a grammar (`text.format` JSON, a forced tool call) is
the answer from its first token, with no room for a `<think>`, so it is all content. The
content alone is what the message, tool-call parsing and the stored conversation are made of;
the reasoning becomes a `reasoning` output item.

`num_tokens` counts the output tokens of the deltas that arrived while the model was still
thinking, the `</think>` marker's included; a delta of several tokens that ends the thinking
and starts the answer counts as answer (exact when each delta carries one token, as it does
unless detokenizing held text back).
"""

from __future__ import annotations

from services.gateway.openai.request import ParsedRequest
from services.gateway.reasoning import make_parser


class Thinking:
    def __init__(self, parser_name: str | None, chat: ParsedRequest):
        free = chat.params.structured is None
        self.parser = make_parser(parser_name) if free else None
        self.text = ""  # all the reasoning so far
        self.num_tokens = 0
        self._seen_tokens = 0

    @property
    def ended(self) -> bool:
        """The thinking is over (`</think>` seen): the reasoning item is complete."""
        return self.parser is not None and not self.parser.thinking

    def split(self, msg) -> tuple[str, str]:
        """A TextDelta's (reasoning, content); call once per delta, in order."""
        new_tokens, self._seen_tokens = msg.num_output_tokens - self._seen_tokens, msg.num_output_tokens
        if self.parser is None:
            return "", msg.text
        was_thinking = self.parser.thinking
        reasoning, content = self.parser.feed(msg.text)
        if msg.finish_reason is not None:
            more_reasoning, more_content = self.parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if was_thinking and (self.parser.thinking or not content):
            self.num_tokens += new_tokens
        self.text += reasoning
        return reasoning, content

"""One request's output as text: the engine's token deltas in, the client's TextDeltas out.

The gateway detokenizes: a RequestText holds, per choice, a Detokenizer (incremental, with
stop strings) and every token id the choice has received, so a request resumed on another
engine (or a restarted scheduler) continues from exactly what the client has: the new run
is sent those tokens as its output so far, and its tokens go on through the same
Detokenizer, with nothing repeated or skipped. A choice ends with its last delta, or here,
when its detokenizer finds a stop string (`TextDelta.finish_reason` "stop"; the caller tells
the engine). The prompt comes with a choice's first delta when the client asked to see it
(echo, prompt_logprobs); the prompt's logprob entries (prompt length x top candidates, each
with its text and bytes) are filled once and given to the first choice that arrives only:
the response builder shares them among the request's choices. Token ids outside the
vocabulary (a broken peer) end the request with a 500.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from msgspec import Struct

from services.gateway.detokenizer import Detokenizer
from services.gateway.token_text import TokenTexts
from shared.messages import SamplingParams, TokenDelta, TokenizedRequest, TokenLogprob


class TextDelta(Struct):
    """New text of one choice of a request (seq_index: which of its n choices);
    finish_reason set means this is that choice's last delta."""

    request_id: str
    text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    token_ids: list[int] = []  # the output tokens this delta covers, shown in text or not
    seq_index: int = 0
    logprobs: list[TokenLogprob] = []  # one per token_ids entry, when asked
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    # on a choice's first delta, when asked (echo, prompt_logprobs): the prompt itself
    prompt_text: str | None = None
    prompt_token_ids: list[int] = []
    # one per prompt token, when asked (echo with logprobs, prompt_logprobs); the first has
    # rank 0: nothing predicts it, so it has no logprob
    prompt_logprobs: list[TokenLogprob] = []


class BadTokens(Exception):
    """The engine sent token ids outside the vocabulary."""


@dataclass
class ChoiceText:
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)  # every output token received
    finished: bool = False
    num_cached_tokens: int = 0


class RequestText:
    def __init__(self, texts: TokenTexts, request: TokenizedRequest, prompt_text: str | None, vocab_size: int):
        self._texts = texts
        self.request_id = request.request_id
        self.params: SamplingParams = request.params
        self.prompt_ids = request.prompt_token_ids
        self.prompt_text = prompt_text  # echo: the prompt as given (or decoded from its ids)
        self.vocab_size = vocab_size
        self.choices: dict[int, ChoiceText] = {}
        self.prompt_logprobs: list[TokenLogprob] | None = None  # filled with token texts once
        self.prompt_logprobs_sent = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def choice(self, index: int) -> ChoiceText:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = ChoiceText(Detokenizer(
                self._texts.tokenizer, self.params, self.prompt_ids, skip_special_tokens=self.params.skip_special_tokens,
                spaces_between_special_tokens=self.params.spaces_between_special_tokens))
        return c

    def unfinished(self) -> list[int]:
        return [i for i in range(self.params.n) if not (i in self.choices and self.choices[i].finished)]

    @property
    def done(self) -> bool:
        return not self.unfinished()

    def received(self, index: int) -> list[int]:
        c = self.choices.get(index)
        return list(c.token_ids) if c is not None else []

    def on_delta(self, delta: TokenDelta, index: int) -> TextDelta | None:
        """The client's TextDelta for the engine's delta of choice index (None: that choice
        ended here already); raises BadTokens."""
        if any(not 0 <= t < self.vocab_size for t in delta.token_ids):
            raise BadTokens(delta.token_ids)
        first = index not in self.choices
        c = self.choice(index)
        if c.finished:
            return None
        finish = delta.finish_reason
        text, used = self._step_text(c.detok, delta.token_ids, final=finish is not None)
        token_ids = delta.token_ids[:used]
        c.token_ids += token_ids
        if first:
            c.num_cached_tokens = delta.num_cached_tokens
        stop_reason = delta.stop_token_id if delta.stop_token_id in self.params.stop_token_ids else None
        if c.detok.stopped:
            finish, stop_reason = "stop", c.detok.stop_reason
        c.finished = finish is not None
        # Sent even with no text to show yet: the response counts tokens and times them.
        out = TextDelta(
            request_id=self.request_id, text=text, num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=c.detok.num_output_tokens, finish_reason=finish, token_ids=token_ids,
            seq_index=index, logprobs=self._texts.fill(delta.logprobs[:used]),
            stop_reason=stop_reason if finish == "stop" else None, num_cached_tokens=c.num_cached_tokens)
        if first:
            self._add_prompt(delta, out)
        return out

    def _step_text(self, detok: Detokenizer, token_ids: list[int], final: bool) -> tuple[str, int]:
        """The text of new tokens and how many of them the output keeps. A delta of several
        tokens (speculative decoding accepts several a step) goes through one token at a time
        while stop strings are watched, so that one ends the output at the token completing it."""
        if not self.params.stop or len(token_ids) <= 1:
            return detok.step(token_ids, final=final), len(token_ids)
        parts = []
        for n, token in enumerate(token_ids, 1):
            parts.append(detok.step([token], final=final and n == len(token_ids)))
            if detok.stopped:
                return "".join(parts), n
        return "".join(parts), len(token_ids)

    def stopped_here(self, index: int) -> bool:
        """The choice's detokenizer ended it (a stop string): the engine does not know yet."""
        c = self.choices.get(index)
        return c is not None and c.detok.stopped

    def _add_prompt(self, delta: TokenDelta, out: TextDelta) -> None:
        params = self.params
        if params.echo:
            out.prompt_text = self.prompt_text
        if params.prompt_logprobs is not None:
            if self.prompt_logprobs is None and delta.prompt_logprobs:
                first = TokenLogprob(self.prompt_ids[0], 0.0, 0)  # rank 0: not scored
                self.prompt_logprobs = self._texts.fill([first, *delta.prompt_logprobs])
            if self.prompt_logprobs and not self.prompt_logprobs_sent:
                out.prompt_logprobs = self.prompt_logprobs
                self.prompt_logprobs_sent = True
        if params.echo or params.prompt_logprobs is not None:
            out.prompt_token_ids = self.prompt_ids

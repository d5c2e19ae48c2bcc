"""Incremental detokenization of one request's output, with stop strings.

Tokens arrive a few at a time. Decoding each token alone breaks characters whose
UTF-8 bytes span several tokens (emoji, CJK) and drops leading spaces in some
tokenizers, so each step decodes a short window: the tokens from `prefix_offset`
(already shown, kept as context) plus the new ones, and emits only the text past the
decoded prefix. While the window's text ends in U+FFFD the character is incomplete,
so nothing is emitted and the offsets stay, until a later token completes it (or the
request ends and whatever is there is flushed). The wait is bounded: a character is at
most 4 bytes, so once MAX_PENDING_TOKENS tokens have come without completing one (a
stream of stray UTF-8 bytes, or of skipped special tokens), the window's text is emitted
as it decodes (its U+FFFD included) and the offsets move on. Each step then decodes a
window of a bounded number of tokens, never one that grows with the output; normal text
streams exactly as its whole decode.

Stop strings are matched on the stable text. Text that could still grow into a stop
string is held back until the next tokens decide it, so a client never sees part of
a stop string, nor anything after one.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.messages import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so that it is decoded in
# context (SentencePiece tokenizers drop the leading space of a window's first token).
PROMPT_CONTEXT_TOKENS = 6
# Tokens a window may wait for a character to complete: 4 (UTF-8's longest) plus slack.
MAX_PENDING_TOKENS = 8


def backend_decode(tokenizer):
    """The Rust tokenizer's own `decode(ids, skip_special_tokens=)` where transformers' decode
    only wraps it (a fast tokenizer with the stock `_decode`, called without clean-up), else
    None: 1.7 µs a call against 7 µs, and every streamed token decodes twice."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if type(tokenizer)._decode is not PreTrainedTokenizerFast._decode or backend is None:
        return None
    return backend.decode


class Detokenizer:
    def __init__(
        self,
        tokenizer,
        params: SamplingParams,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # only slow (Python) tokenizers put spaces around special tokens; fast ones never do
        self._extra = ({} if getattr(tokenizer, "is_fast", True)
                       else {"spaces_between_special_tokens": spaces_between_special_tokens})
        self._backend = backend_decode(tokenizer)
        self._stops = [s for s in params.stop if s]
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # an unfinished character would make the prefix text unstable
        self._tokens = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # decoded, complete output text
        self._sent = 0  # how much of _text step() has returned
        self.num_output_tokens = 0
        self.stop_reason: str | None = None  # the stop string that ended the output

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Take new tokens; return the text that is now safe to show.

        final: the request ends with these tokens, so held-back text is flushed.
        Once a stop string matched, later calls return "".
        """
        if self.stopped:
            return ""
        self.num_output_tokens += len(token_ids)
        self._tokens.extend(token_ids)
        self._decode_new(final)
        return self._release(final)

    def _decode(self, tokens: list[int]) -> str:
        if not tokens:
            return ""
        if self._backend is not None:
            return self._backend(tokens, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(
            tokens, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False, **self._extra
        )

    def _decode_new(self, final: bool) -> None:
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._tokens[self._prefix_offset :])
        give_up = len(self._tokens) - self._read_offset >= MAX_PENDING_TOKENS
        if len(window_text) <= len(prefix_text) and not give_up:
            return  # special tokens skipped, or nothing decodable yet
        if window_text.endswith(REPLACEMENT_CHAR) and not (final or give_up):
            return  # an incomplete character: wait for the rest of its bytes
        self._text += window_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)

    def _release(self, final: bool) -> str:
        start = self._sent
        end = len(self._text)
        if self._stops and self.num_output_tokens >= self._min_tokens:  # (as vLLM: none before min_tokens)
            match = self._find_stop(start)
            if match is not None:
                index, stop = match
                self.stop_reason = stop
                end = index + len(stop) if self._include_stop else index
            elif not final:
                end -= self._partial_stop_len(start)
        out = self._text[start:end]
        self._sent = max(self._sent, end)
        return out

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """The stop string that completes first in the unsent text, if any.

        Nothing already sent can be part of a match: sent text never ends with the
        beginning of a stop string.
        """
        best = None
        for stop in self._stops:
            index = self._text.find(stop, start)
            if index < 0:
                continue
            key = (index + len(stop), index)
            if best is None or key < best[0]:
                best = (key, index, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, start: int) -> int:
        """Length of the longest unsent suffix that begins some stop string."""
        tail = self._text[start:]
        hold = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(tail)), hold, -1):
                if tail.endswith(stop[:n]):
                    hold = n
                    break
        return hold

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._text[: self._sent]

"""What a client has already received of a request, so a restarted request does not repeat it.

When a tokenizer replica dies, the gateway sends the request again under a new id. A
greedy or seeded request regenerates the same tokens, so the start of the new run is
checked against the tokens already sent and swallowed; the client sees one seamless
answer. A request sampled without a seed can restart only before anything was sent.
"""

from __future__ import annotations

import msgspec

from shared.messages import SamplingParams, TextDelta


class ReplayDiverged(Exception):
    """The restarted request produced other tokens than the ones the client already has."""


class Replay:
    def __init__(self, params: SamplingParams):
        # several choices interleave their deltas: only a single one can be skipped ahead
        self.deterministic = params.n == 1 and (params.temperature == 0 or params.seed is not None)
        self.sent_ids: list[int] = []
        self.sent_chars = 0
        self._skip_ids: list[int] = []
        self._skip_chars = 0

    def can_restart(self) -> bool:
        return self.deterministic or not (self.sent_ids or self.sent_chars)

    def restart(self) -> None:
        self._skip_ids = list(self.sent_ids)
        self._skip_chars = self.sent_chars

    def filter(self, delta: TextDelta) -> TextDelta | None:
        """The part of delta the client has not seen yet; None when it has seen all of it."""
        if not (self._skip_ids or self._skip_chars):
            self.sent_ids += delta.token_ids
            self.sent_chars += len(delta.text)
            return delta
        ids, text = delta.token_ids, delta.text
        n = min(len(ids), len(self._skip_ids))
        if ids[:n] != self._skip_ids[:n]:
            raise ReplayDiverged
        ids, self._skip_ids = ids[n:], self._skip_ids[n:]
        c = min(len(text), self._skip_chars)
        text, self._skip_chars = text[c:], self._skip_chars - c
        self.sent_ids += ids
        self.sent_chars += len(text)
        if not ids and not text and delta.finish_reason is None:
            return None
        # the first delta's prompt fields were sent already too
        return msgspec.structs.replace(delta, text=text, token_ids=ids, logprobs=delta.logprobs[n:],
                                       prompt_text=None, prompt_logprobs=[])

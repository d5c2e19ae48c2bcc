"""What a client has already received of a request, so a restarted request does not repeat it.

When a tokenizer replica or the scheduler dies, the gateway sends the request again
under a new id. A greedy, seeded or beam-search request regenerates the same tokens for
each of its choices, so the start of each choice in the new run is checked against the
tokens already sent for it and swallowed, and a choice that had finished stays finished;
the client sees one seamless answer. A request sampled without a seed can restart only
before anything was sent.
"""

from __future__ import annotations

import msgspec

from shared.messages import SamplingParams, TextDelta


class ReplayDiverged(Exception):
    """The restarted request produced other tokens than the ones the client already has."""


class _Choice:
    """One choice (seq_index): what was sent of it, and what a restarted run must skip."""

    def __init__(self):
        self.sent_ids: list[int] = []
        self.sent_chars = 0
        self.finished = False
        self.skip_ids: list[int] = []
        self.skip_chars = 0

    @property
    def skipping(self) -> bool:
        return bool(self.skip_ids or self.skip_chars)


class Replay:
    def __init__(self, params: SamplingParams):
        # each sample of a seeded request has its own seed (seed + its index): per choice,
        # a rerun is the same run
        self.deterministic = params.temperature == 0 or params.seed is not None or params.use_beam_search
        self._choices: dict[int, _Choice] = {}

    def can_restart(self) -> bool:
        return self.deterministic or not any(c.sent_ids or c.sent_chars for c in self._choices.values())

    def restart(self) -> None:
        for c in self._choices.values():
            c.skip_ids, c.skip_chars = list(c.sent_ids), c.sent_chars

    def filter(self, delta: TextDelta) -> TextDelta | None:
        """The part of delta the client has not seen yet; None when it has seen all of it."""
        c = self._choices.setdefault(delta.seq_index, _Choice())
        if not c.skipping:
            if c.finished:
                return None  # finished before the restart: the client has all of it
            c.sent_ids += delta.token_ids
            c.sent_chars += len(delta.text)
            c.finished = delta.finish_reason is not None
            return delta
        ids, text = delta.token_ids, delta.text
        n = min(len(ids), len(c.skip_ids))
        if ids[:n] != c.skip_ids[:n]:
            raise ReplayDiverged
        ids, c.skip_ids = ids[n:], c.skip_ids[n:]
        k = min(len(text), c.skip_chars)
        text, c.skip_chars = text[k:], c.skip_chars - k
        if c.finished:
            return None
        c.sent_ids += ids
        c.sent_chars += len(text)
        c.finished = delta.finish_reason is not None
        if not ids and not text and delta.finish_reason is None:
            return None
        # the first delta's prompt fields were sent already too
        return msgspec.structs.replace(delta, text=text, token_ids=ids, logprobs=delta.logprobs[n:],
                                       prompt_text=None, prompt_logprobs=[])

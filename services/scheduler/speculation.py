"""Speculative decoding, scheduler side: which sequences speculate, their proposals, the counts.

The scheduler holds every sequence's tokens, so ngram proposals are made here (`propose_ngram`)
and travel in the step (`ScheduledSeq.draft_token_ids`); the executor samples every
proposed position and accepts the longest prefix it agrees with (`StepResult.num_accepted`),
and the scheduler rolls the rejected tokens' slots back (`BlockManager.trim`). Nothing per
sequence is kept: a proposal is made from the sequence's verified tokens each step.
A draft model's proposals (method "draft") are made by the executor, which holds the model:
here they are only placeholders (`PLACEHOLDER`, as many as may be proposed) that take their
slots like any proposal; the step asks for that many (`ScheduledSeq.num_proposals`) and the
result says which tokens they were (`StepResult.proposed`), before anything reads them.

A sequence speculates only where that is exact and cheap to verify (`Sequence.can_speculate`):
not under penalties, grammars or bad words (they read the output the executor would have to
replay token by token), not a beam or an embedding request, not after `"speculative": false`.
Nothing is proposed while more than `disable_batch_size` sequences run (a step is then no
longer bound by reading the weights), past max_tokens or the context, or beyond the step's
token budget; a proposal never preempts anyone (the caller drops it when its slots do not fit).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.ngram_proposer import propose_ngram

if TYPE_CHECKING:
    from services.scheduler.sequence import Sequence

log = logging.getLogger(__name__)

PLACEHOLDER = -1  # a token the executor's draft model proposes (method "draft"): known from the step's result


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "off"  # or "ngram", "draft"
    num_tokens: int = 3  # the most proposed per sequence per step (SpeculativeOptions' default)
    ngram_min: int = 2
    ngram_max: int = 8
    disable_batch_size: int = 2  # no proposals while more sequences than this run (SpeculativeOptions')
    ngram_per_match: int = 1  # a match of n tokens proposes at most this x n (0: num_tokens whatever n)

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.num_tokens > 0

    def describe(self) -> str:
        if not self.enabled:
            return "speculative decoding off"
        if self.method == "draft":
            return (f"speculative decoding: draft model (the executor's), up to {self.num_tokens} tokens a step, "
                    f"while at most {self.disable_batch_size} sequences run")
        scaled = f", at most {self.ngram_per_match} x the matched length" if self.ngram_per_match else ""
        return (f"speculative decoding: {self.method} (suffixes of {self.ngram_max} down to {self.ngram_min} tokens), "
                f"up to {self.num_tokens} tokens a step{scaled}, while at most {self.disable_batch_size} "
                f"sequences run")


class Speculator:
    """Proposals for the sequences of a step, and the totals of what became of them."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.num_drafts = 0  # sequence-steps with a proposal
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def active(self, num_running: int) -> bool:
        """Whether sequences may speculate at this batch size."""
        return self.config.enabled and num_running <= self.config.disable_batch_size

    def propose(self, req: Sequence, num_running: int, budget: int, max_model_len: int) -> list[int]:
        """Draft tokens for req's next step (a decode step: its last token is the one to compute),
        at most budget of them; [] when it does not speculate now."""
        if not self.active(num_running) or not req.can_speculate:
            return []
        c = self.config
        # the step samples 1 + len(draft) tokens: none past max_tokens or the context
        room = min(c.num_tokens, budget, req.params.max_tokens - req.num_output_tokens - 1,
                   max_model_len - req.num_tokens - 1)
        if room <= 0:
            return []
        if c.method == "draft":
            return [PLACEHOLDER] * room
        return propose_ngram(req.token_ids(0, req.num_tokens), room, c.ngram_min, c.ngram_max, c.ngram_per_match)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted

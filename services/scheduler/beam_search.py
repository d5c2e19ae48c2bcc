"""Beam search over sequences that share KV blocks: the choice of the next beams.

The scheduler runs every live beam of a request one token further, the executor
returns each beam's top candidates (token, logprob), and `select` keeps the
beam_width best continuations by cumulative logprob. Continuations that end in an
end-of-sequence token become finished hypotheses, scored with a length penalty
(cumulative logprob / generated length ** length_penalty). A parent chosen more than
once is forked (its blocks shared, the partial one copied on its first write); a
beam nobody continues is dropped and frees its blocks.

Nothing here grows with the output length: beams' outputs are `TokenHistory`s, so a
fork or a hypothesis shares its parent's tokens instead of copying them, and a
hypothesis is only made when it is among the width best kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.scheduler.token_history import TokenHistory

_MAX_EXP = 700.0  # math.exp overflows a little past 709


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """cum_logprob / length ** length_penalty, finite for any finite penalty."""
    log_denominator = length_penalty * math.log(max(length, 1))
    if abs(log_denominator) <= _MAX_EXP:
        return cum_logprob / max(length, 1) ** length_penalty
    if cum_logprob == 0 or not math.isfinite(cum_logprob):
        return cum_logprob
    # Past float range the quotient saturates: in log space, clamped.
    log_score = min(max(math.log(abs(cum_logprob)) - log_denominator, -_MAX_EXP), _MAX_EXP)
    return math.copysign(math.exp(log_score), cum_logprob)


@dataclass
class Hypothesis:
    score: float
    token_ids: TokenHistory
    finish_reason: str


@dataclass
class BeamState:
    """A beam search request's finished hypotheses (best first, at most width kept)."""

    width: int
    length_penalty: float
    finished: list[Hypothesis] = field(default_factory=list)
    next_seq_index: int = 1  # for the next forked beam

    def would_keep(self, score: float) -> bool:
        return len(self.finished) < self.width or score > self.finished[-1].score

    def add_finished(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width :]

    def is_done(self, best_live_cum_logprob: float, length: int) -> bool:
        """No live beam can beat the worst kept hypothesis any more (scored at its
        current length, as transformers' early_stopping=False does)."""
        if len(self.finished) < self.width:
            return False
        best = beam_score(best_live_cum_logprob, length, self.length_penalty)
        return self.finished[-1].score >= best


@dataclass(frozen=True)
class Continuation:
    parent: object  # the beam (a Sequence) being continued
    token: int
    cum_logprob: float


def select(
    state: BeamState,
    beams: list,  # live beams: objects with .candidates, .cum_logprob, .output_token_ids (a TokenHistory)
    is_end: callable,
) -> list[Continuation]:
    """The next beams; end-of-sequence continuations go to state.finished instead."""
    ranked = sorted(
        ((b.cum_logprob + lp, i, tok) for i, b in enumerate(beams) for tok, lp in b.candidates),
        key=lambda c: (-c[0], c[1], c[2]),
    )
    chosen: list[Continuation] = []
    for total, i, tok in ranked:
        if len(chosen) == state.width:
            break
        parent = beams[i]
        if is_end(tok):
            score = beam_score(total, len(parent.output_token_ids) + 1, state.length_penalty)
            if state.would_keep(score):
                tokens = parent.output_token_ids.fork()
                tokens.append(tok)
                state.add_finished(Hypothesis(score, tokens, "stop"))
        else:
            chosen.append(Continuation(parent, tok, total))
    return chosen

"""Beam search over sequences that share KV blocks: the choice of the next beams.

The scheduler runs every live beam of a request (a `SequenceGroup`) one token further,
the executor returns each beam's top candidates (token, logprob), and `advance` steps
the search once all are in: `select` keeps the
beam_width best continuations by cumulative logprob. Continuations that end in an
end-of-sequence token become finished hypotheses, scored with a length penalty
(cumulative logprob / generated length ** length_penalty). A parent chosen more than
once is forked (by the scheduler's callback: its blocks shared, the partial one copied on
its first write); a beam nobody continues is dropped (the scheduler frees its blocks).
The search is done when no live beam can beat the worst kept hypothesis, or the beams
are out of room (max_tokens or the context); the live beams then become hypotheses.

Nothing here grows with the output length: beams' outputs are `TokenHistory`s, so a
fork or a hypothesis shares its parent's tokens instead of copying them, and a
hypothesis is only made when it is among the width best kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def advance(state: BeamState, live: list, fork: Callable, max_model_len: int) -> tuple[list, list, bool]:
    """One step of a search whose live beams (`Sequence`s) all have their candidates:
    the beams that go on (each with its chosen token appended; a parent chosen twice is
    continued by `fork(parent, seq_index)` too), the beams dropped, and whether the
    search is done (then the beams that went on are scored into state.finished)."""
    first = live[0]
    params = first.params

    def is_end(tok: int) -> bool:
        return (tok in first.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids

    chosen = select(state, live, is_end)
    continued: list = []
    for c in chosen:  # fork first: a child copies its parent's state before the parent moves
        beam = c.parent
        if beam in continued:
            beam = fork(c.parent, state.next_seq_index)
            state.next_seq_index += 1
        continued.append(beam)
    for beam, c in zip(continued, chosen, strict=True):
        beam.output_token_ids.append(c.token)
        beam.cum_logprob = c.cum_logprob
        beam.candidates = None
    dropped = [beam for beam in live if beam not in continued]
    length = len(continued[0].output_token_ids) if continued else 0
    out_of_room = continued and continued[0].stop_reason(max_model_len) == "length"
    best = max((b.cum_logprob for b in continued), default=float("-inf"))
    if continued and not out_of_room and not state.is_done(best, length):
        return continued, dropped, False
    for beam in continued:
        score = beam_score(beam.cum_logprob, length, state.length_penalty)
        if state.would_keep(score):
            state.add_finished(Hypothesis(score, beam.output_token_ids, "length"))
    return continued, dropped, True

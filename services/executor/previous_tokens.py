"""Async scheduling, executor side: the tokens the last step sampled, for the next step's placeholders.

The scheduler builds step N+1 while the executor runs step N (see
`Scheduler.schedule_ahead`), so it cannot know the tokens step N samples: a sequence
that goes on with one sends `[PREVIOUS_TOKEN]` as its token ids. Steps run in the
order they are sent, so the token is the one that sequence sampled in the step this
executor ran just before. A step whose placeholder has no such token (the step before
failed, or did not sample that sequence) is refused whole: running it would compute
on a wrong token. A sequence that failed alone in the step before (`StepResult.failed`)
runs on with a stand-in token: its request has ended and its result is dropped.
"""

from __future__ import annotations

from shared.messages import PREVIOUS_TOKEN, ExecuteStep, StepResult


class PreviousTokens:
    def __init__(self) -> None:
        self._sampled: dict[tuple[str, int], int] = {}  # (request id, seq index) -> token of the last step

    def fill(self, step: ExecuteStep) -> str | None:
        """Put the previous step's tokens in for step's placeholders, in place; why not, if it cannot."""
        missing = []
        for seq in step.seqs:
            if PREVIOUS_TOKEN in seq.token_ids:
                token = self._sampled.get((seq.request_id, seq.seq_index))
                if token is None or seq.token_ids != [PREVIOUS_TOKEN]:
                    missing.append(seq.request_id)
                else:
                    seq.token_ids = [token]
        if missing:
            return (f"step {step.step_id} continues {len(missing)} sequences (first: {missing[0]!r}) with tokens "
                    "the step before did not sample")
        return None

    def record(self, step: ExecuteStep, result: StepResult) -> None:
        """The tokens step sampled: the only ones the next step's placeholders may stand for."""
        self._sampled = {(seq.request_id, seq.seq_index): token
                         for seq, token in zip(step.seqs, result.sampled, strict=False) if seq.sample and token >= 0}
        # a sequence that failed alone: the scheduler ends its request and drops what a step sent
        # ahead computes for it, so any token stands in (refusing that step would fail the others)
        for row in result.failed:
            seq = step.seqs[row.index]
            self._sampled[(seq.request_id, seq.seq_index)] = 0

    def clear(self) -> None:
        """The last step failed: it sampled nothing."""
        self._sampled = {}

"""Speculative decoding, executor side: verifying a sequence's proposed tokens in its one step.

A sequence whose step carries draft tokens d_1..d_k (`ScheduledSeq.draft_token_ids`, the last
k of its token_ids; the scheduler proposes them) has logits at its last k + 1 positions: row j
predicts the token after d_j (row 0 the token after its real last token). Every row is
processed and sampled exactly as a lone decode step at output index output_index + j would be
(`sampled_rows`, `row_output_indices`: the same processors, the same seeded draw). d_{j+1} is
accepted while the token sampled at row j equals it; the token of the first row that disagrees
follows the accepted ones (all accepted: the last row's, the bonus token). `settle` turns the
rows' tokens into each sequence's result: its last token, its accepted count, the rows whose
tokens it emits (their logprobs are the ones returned).

This is the rejection sampling of speculative decoding (Leviathan et al., Chen et al., 2023) for
a draft that is a point mass q = δ_d, as an ngram proposal is: accept d with probability
min(1, p(d) / q(d)) = p(d), else draw from max(0, p - q) renormalised, which is p with d removed
and renormalised. Drawing x ~ p and accepting iff x = d accepts with probability p(d), and on
rejection x is distributed as p given x ≠ d: the same, in one draw. So every emitted token has
the distribution non-speculative decoding gives it; greedy rows (argmax) accept exactly the
tokens greedy decoding produces; and a seeded row draws from the generator of (seed, output
index), so a seeded request gives the same tokens with or without speculation (up to the
numerics of a multi-token forward pass against a one-token one).
"""

from __future__ import annotations

from shared.messages import ScheduledSeq, StepResult


def sampled_rows(seqs: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """The sequence of each logits row sampled in a step, in row order (BatchMetadata's
    sampled_seqs): one row per sampled sequence, 1 + its drafts for a speculating one."""
    return [s for s in seqs if s.sample for _ in range(1 + len(s.draft_token_ids))]


def row_output_indices(seqs: list[ScheduledSeq]) -> list[int]:
    """The output index each sampled row produces (its seeded draw and min_tokens read it)."""
    return [s.output_index + j for s in seqs if s.sample for j in range(1 + len(s.draft_token_ids))]


def accepted_prefix(draft: list[int], row_tokens: list[int]) -> int:
    """How many leading drafts the rows' sampled tokens agree with."""
    n = 0
    while n < len(draft) and row_tokens[n] == draft[n]:
        n += 1
    return n


def settle(seqs: list[ScheduledSeq], row_seqs: list[int], tokens: list[int], result: StepResult,
           failed: dict[int, tuple[int, str]]) -> list[int]:
    """Each sampled sequence's token into result.sampled (its index in seqs), and the accepted
    count of each speculating one into result.num_accepted; returns the rows whose tokens are
    emitted. A failure of a row past the accepted ones is dropped from failed: that row's token
    is never used (a failed row's token, -1, agrees with no draft, so acceptance stops there)."""
    emitted: list[int] = []
    row = 0
    while row < len(row_seqs):
        i = row_seqs[row]
        draft = seqs[i].draft_token_ids
        n = 1 + len(draft)
        accepted = accepted_prefix(draft, tokens[row : row + n])
        if draft:
            result.num_accepted.append(accepted)
            for later in range(row + accepted + 1, row + n):
                failed.pop(later, None)
        result.sampled[i] = tokens[row + accepted]
        emitted += range(row, row + accepted + 1)
        row += n
    return emitted

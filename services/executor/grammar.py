"""Token masks of the constrained sequences of a step (structured output), with xgrammar.

Each constrained sequence has a grammar matcher, kept between steps under (request id,
seq_index). The step carries the sequence's output tokens so far, so a matcher is
advanced by the tokens it has not seen (one per step normally) and rebuilt from the
start when its history does not match (a preemption, an executor restart, an evicted
entry): the executor stays free of state it cannot rebuild. `masks` fills one bitmask
row per constrained row (run beside the forward pass: it needs only the step), the
sampler's logits get -inf outside it, and `accept` moves each matcher past its
sampled token. A finished grammar allows only the stop tokens (EOS). Grammars are not
compiled here: each request carries the one the tokenizer stage compiled (in its worker
pool, under a time limit), deserialized once per spec; only a request built without that
stage (no compiled form), or whose form was made for another vocabulary, is compiled
(logged), in the thread that fills the masks.

A sequence whose matcher fails (its grammar does not compile here, its history breaks
it, its sampled token is refused) fails alone: `masks` and `accept` name its row and
its entry is dropped; its mask row allows nothing, so it is never sampled; the other
rows go on.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from torch import Tensor

from shared.messages import ScheduledSeq
from shared.model_files import load_tokenizer
from shared.structured_output import GrammarCompilerCache

MAX_MATCHERS = 4096  # sequences remembered; the least recently used are dropped (and rebuilt if seen again)


class _Entry:
    __slots__ = ("matcher", "seen")

    def __init__(self, matcher):
        self.matcher, self.seen = matcher, []


class GrammarMasks:
    def __init__(self, model_dir: str | Path, vocab_size: int):
        tokenizer = load_tokenizer(model_dir)
        self.compilers = GrammarCompilerCache(tokenizer, vocab_size)
        self.xgr = self.compilers.xgr
        self.vocab_size = vocab_size
        self._matchers: OrderedDict[tuple[str, int], _Entry] = OrderedDict()

    def _matcher(self, seq: ScheduledSeq):
        key = (seq.request_id, seq.seq_index)
        out = list(seq.output_token_ids)
        entry = self._matchers.get(key)
        if entry is None or entry.seen != out[: len(entry.seen)]:
            sampling = seq.sampling  # the tokenizer's compiled form, deserialized once per spec
            entry = _Entry(self.xgr.GrammarMatcher(self.compilers.get(sampling.structured, sampling.compiled_grammar)))
            self._matchers[key] = entry
        self._matchers.move_to_end(key)
        for token in out[len(entry.seen):]:
            if not entry.matcher.accept_token(token):
                raise ValueError(f"{seq.request_id}: token {token} breaks its grammar")
            entry.seen.append(token)
        while len(self._matchers) > MAX_MATCHERS:
            self._matchers.popitem(last=False)
        return entry

    def masks(self, seqs: list[ScheduledSeq]) -> tuple[Tensor | None, dict[int, str]]:
        """[len(seqs), ceil(vocab / 32)] int32 bitmask for the sampled seqs given (rows of
        unconstrained ones allow everything), or None when none is constrained; and the rows
        whose grammar failed, with why (their mask rows allow nothing)."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.structured is not None]
        if not rows:
            return None, {}
        bitmask = self.xgr.allocate_token_bitmask(len(seqs), self.vocab_size)  # all allowed
        failed: dict[int, str] = {}
        for i in rows:
            try:
                self._matcher(seqs[i]).matcher.fill_next_token_bitmask(bitmask, i)
            except Exception as exc:
                self._matchers.pop((seqs[i].request_id, seqs[i].seq_index), None)
                bitmask[i] = 0
                failed[i] = f"grammar: {type(exc).__name__}: {exc}"
        return bitmask, failed

    def apply(self, logits: Tensor, bitmask: Tensor) -> Tensor:
        logits = logits.clone()
        self.xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
        return logits

    def accept(self, seqs: list[ScheduledSeq], tokens: list[int]) -> dict[int, str]:
        """Move each constrained row's matcher past its token (rows sampled -1 failed before);
        the rows whose token the grammar refuses, with why."""
        failed: dict[int, str] = {}
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            if seq.sampling.structured is None or token < 0:
                continue
            key = (seq.request_id, seq.seq_index)
            entry = self._matchers.get(key)
            if entry is None:
                continue  # evicted: rebuilt from the history next step
            if entry.matcher.accept_token(token):
                entry.seen.append(token)
            else:
                self._matchers.pop(key, None)
                failed[i] = f"grammar: token {token} breaks its grammar"
        return failed

"""The scheduler's words for a request, as the PagedAttention paper names them.

A `Sequence` is one token stream (prompt plus its own output) with its block table; a
`SequenceGroup` is the n parallel samples or the beams of one request, with the
request's sampling parameters and beam state. The group is the single source of truth
for what a request is: which sequences it has, its beam search, whether its first delta
went out. Counts the scheduler needs (tokens to compute, blocks needed, live sequences)
are derived from the token lists, `num_computed_tokens` and the group's sequences,
never stored twice.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

import msgspec

from services.scheduler.beam_search import BeamState
from services.scheduler.token_history import TokenHistory
from shared.messages import SamplingParams, SeqSampling, TokenLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One token stream: the prompt, its own output, and the blocks that hold its KV."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float
    reply_to: bytes = b""  # the gateway (its DEALER identity) that sent the request and reads its deltas
    output_token_ids: list[int] = field(default_factory=list)  # a TokenHistory for beams (forks share it)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # digests of full blocks, for the prefix cache
    swapped_blocks: list[int] = field(default_factory=list)  # host blocks while swapped out
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    seq_index: int = 0  # which of the request's n parallel samples this sequence is
    pending_forks: int = 0  # samples still to fork from this sequence once its prompt is in
    cum_logprob: float = 0.0  # beam search: the beam's score so far
    candidates: list[tuple[int, float]] | None = None  # beam search: next (token, logprob)s
    # prompt_logprobs: the entries of prompt tokens 1.. scored so far (samples share their parent's)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied when it was first admitted
    compiled_grammar: str = ""  # params.structured as the tokenizer compiled it, passed on to the executor
    # a resumed request (TokenizedRequest.output_token_ids): the output it came with, which its
    # gateway has; recomputed with the prompt, as after a preemption, and never sent again
    num_resumed_tokens: int = 0
    priority: int = 0  # the request's (TokenizedRequest.priority): lower first under the priority policy

    @property
    def fork_at(self) -> int:
        """Tokens computed before forking: all but the last prompt token, so every sample
        computes that token itself (and copies the shared partial block on write)."""
        return self.num_prompt_tokens - 1

    def spawn(self, seq_index: int) -> Sequence:
        """A sibling sample: same prompt, its own seed, no blocks (fork shares them)."""
        seed = None if self.params.seed is None else self.params.seed + seq_index
        return Sequence(
            self.request_id, self.prompt_token_ids, msgspec.structs.replace(self.params, seed=seed),
            self.eos_token_ids, self.arrival_time, reply_to=self.reply_to,
            block_hashes=list(self.block_hashes), seq_index=seq_index, prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens, compiled_grammar=self.compiled_grammar, priority=self.priority,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet: the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def speculation_allowed(self) -> bool:
        """Its decode steps may carry proposed tokens (services/scheduler/speculation.py): their
        verification is exact position by position, so not under penalties, a grammar or bad
        words (they read the output), nor for a beam or an embedding; not when it opted out."""
        p = self.params
        return p.speculative and not p.use_beam_search and p.pooling is None and not self.sampling.needs_output

    @property
    def can_speculate(self) -> bool:
        """Its next step may carry proposed tokens: a decode step (only its last token to compute)."""
        return self.speculation_allowed and not self.pending_forks and self.num_uncomputed_tokens == 1

    @property
    def max_total_tokens(self) -> int:
        if self.params.pooling is not None:  # an embedding request: its prompt alone, nothing sampled
            return self.num_prompt_tokens
        return self.num_prompt_tokens + self.params.max_tokens

    @cached_property
    def sampling(self) -> SeqSampling:
        p = self.params
        mask = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids)))
        return SeqSampling(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed, min_p=p.min_p,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty, logit_bias=p.logit_bias, allowed_token_ids=p.allowed_token_ids,
            min_tokens=p.min_tokens, min_tokens_mask=mask if p.min_tokens else [], logprobs=p.logprobs,
            structured=p.structured, bad_words_ids=p.bad_words_ids, compiled_grammar=self.compiled_grammar,
        )

    @cached_property
    def sampling_bytes(self) -> int:
        """The size of `sampling` encoded: the executor is sent it once (see executor_states)."""
        return len(msgspec.msgpack.encode(self.sampling))

    @property
    def cache_salt(self) -> str | None:
        """Sequences with different salts never share prefix-cache blocks."""
        return self.params.cache_salt

    @property
    def lora_digest(self) -> str | None:
        """The LoRA adapter's digest: the same tokens under another adapter are other KV."""
        return None if self.params.lora is None else self.params.lora.digest

    @property
    def asks_prompt_logprobs(self) -> bool:
        """prompt_logprobs, unless resumed: a resumed request's gateway has them (its first delta)."""
        return self.params.prompt_logprobs is not None and not self.num_resumed_tokens

    @property
    def no_cache_hits(self) -> bool:
        """Its prompt is still to be scored: every position must be computed, none taken
        from the prefix cache."""
        if self.params.pooling in ("mean", "cls"):  # pooled over hidden states the cache does not hold
            return True
        return self.asks_prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def score_targets(self, start: int, num_tokens: int) -> list[int]:
        """The next tokens of the prompt positions [start, start + num_tokens) still to score:
        position p is scored against prompt token p + 1 (the last prompt position predicts
        the first output token, which is sampled, not scored)."""
        if not self.asks_prompt_logprobs or self.seq_index != 0:
            return []
        end = min(start + num_tokens, self.num_prompt_tokens - 1)
        if end <= max(start, len(self.prompt_logprobs)):
            return []  # none, or scored already (a recompute after preemption)
        return self.prompt_token_ids[start + 1 : end + 1]

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """The scored positions from start on; those scored before are kept as they were."""
        have = len(self.prompt_logprobs)
        if start > have:
            raise ValueError(f"prompt positions scored out of order ({start} after {have})")
        self.prompt_logprobs.extend(entries[have - start :])

    def token_ids(self, start: int, stop: int) -> list[int]:
        n = self.num_prompt_tokens
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    def stop_reason(self, max_model_len: int) -> str | None:
        """Why the request ends after its latest token, or None to go on."""
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in self.params.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None


@dataclass(eq=False)
class SequenceGroup:
    """The n parallel samples or the beams of one request.

    `params` are the request's (each sample's own differ only by its seed); `seqs` are its
    sequences still known to the scheduler (a dropped beam leaves), `beam` its beam
    search, if it is one."""

    request_id: str
    params: SamplingParams
    reply_to: bytes
    seqs: list[Sequence]
    beam: BeamState | None = None
    first_delta_sent: bool = False  # n > 1: the request's first delta (with prompt logprobs) went out

    @classmethod
    def start(cls, seq: Sequence) -> SequenceGroup:
        """The group of a new request from its first sequence: beams share one output
        history (forks fork it); parallel samples fork off the first once its prompt is in,
        or start out on their own when there is nothing to share."""
        p = seq.params
        group = cls(seq.request_id, p, seq.reply_to, [seq])
        if p.use_beam_search:
            group.beam = BeamState(p.beam_width, p.length_penalty)
            seq.output_token_ids = TokenHistory(seq.output_token_ids)
        elif p.n > 1:
            if seq.fork_at > 0:
                seq.pending_forks = p.n - 1
            else:
                group.seqs += [seq.spawn(i) for i in range(1, p.n)]
        return group

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

"""Speculative decoding in the scheduler, with a model-free executor that verifies proposals.

The stand-in model mostly repeats the sequence's tokens from PERIOD positions back (so prompt
lookup proposals are often right) and sometimes does not (so some are rejected); it reads every
token back through the slots it is given, so a wrong slot, a block freed too early or a rolled
back token that survives shows up as a wrong output. Outputs must equal decoding without
speculation token for token, with the pool's and the scheduler's invariants checked after
every step, including preemption by recompute and swap while sequences speculate. Under the
draft method the stand-in executor proposes too (`draft_model`: the stand-in model, wrong more often),
as a draft model does, and the scheduler learns its proposals from the result.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager
from services.scheduler.host_block_pool import HostBlockPool
from services.scheduler.ngram_proposer import propose_ngram
from services.scheduler.options import SpeculativeOptions, speculative_config
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from services.scheduler.speculation import SpeculativeConfig
from shared.messages import SamplingParams, TokenLogprob
from tests.scheduler.test_scheduler import move_blocks

EOS = 2
PERIOD = 5


def model(seen: list[int]) -> int:
    """The stand-in's next token: the one PERIOD back, except at some positions."""
    h = (sum(seen) * 31 + len(seen)) % 97
    if len(seen) < PERIOD or h % 4 == 0:
        return h + 3
    return seen[-PERIOD]


def draft_model(seen: list[int]) -> int:
    """The stand-in draft model: the stand-in model's token, except at some other positions."""
    return 1 if (sum(seen) + 5 * len(seen)) % 3 == 0 else model(seen)


class SpeculatingFakeExecutor:
    """Writes every token of a step (proposals too) into the slots given, then samples each
    proposed position from the tokens read back, accepting while they agree."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.pool: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.sampling: dict[str, object] = {}  # as the executor keeps it (sent once per request)

    def execute(self, step):
        bs = self.bs
        move_blocks(step, self.pool, self.host, bs)
        sampled, accepted, logprobs, proposed = [], [], [], []
        for seq in step.seqs:
            if seq.sampling is not None:
                self.sampling[seq.request_id] = seq.sampling
            if seq.num_proposals:  # as the executor's draft model: proposals from the tokens read back
                seen = [self.pool[seq.block_table[p // bs] * bs + p % bs] for p in range(seq.start_pos)]
                seen += seq.token_ids
                for _ in range(seq.num_proposals):
                    seq.draft_token_ids.append(draft_model(seen))
                    seen.append(seq.draft_token_ids[-1])
                seq.token_ids = seq.token_ids + seq.draft_token_ids
                proposed.append(seq.draft_token_ids)
            assert len(seq.slot_mapping) == len(seq.token_ids)
            for slot, tok in zip(seq.slot_mapping, seq.token_ids, strict=True):
                self.pool[slot] = tok
            end = seq.start_pos + len(seq.token_ids)
            seen = [self.pool[seq.block_table[p // bs] * bs + p % bs] for p in range(end)]
            if not seq.sample:
                sampled.append(-1)
                continue
            draft = seq.draft_token_ids
            rows = [model(seen[: end - len(draft) + j]) for j in range(len(draft) + 1)]
            n = 0
            while n < len(draft) and rows[n] == draft[n]:
                n += 1
            if draft:
                accepted.append(n)
            sampled.append(rows[n])
            if self.sampling[seq.request_id].logprobs is not None:
                logprobs += [TokenLogprob(t, -0.5) for t in rows[: n + 1]]
        self.proposed = proposed
        return sampled, accepted, logprobs


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    seen, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(model(seen))
        seen.append(out[-1])
        if out[-1] == EOS:
            break
    return out


def request(rid: str, prompt_len: int, max_tokens: int, **params) -> Sequence:
    rng = random.Random(rid)
    prompt = [rng.randrange(3, 40) for _ in range(prompt_len)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), frozenset({EOS}), 0.0)


def run(sched: Scheduler, max_steps: int = 5000) -> tuple[dict, dict]:
    executor = SpeculatingFakeExecutor(sched.blocks.block_size)
    outputs, logprobs = {}, {}
    for _ in range(max_steps):
        scheduled = sched.schedule()
        if scheduled is None:
            break
        step, chunks = scheduled
        for seq, chunk in zip(step.seqs, chunks, strict=True):  # the slots of proposals are the chunk's
            if chunk.proposed_by_executor:
                assert seq.num_proposals == len(chunk.draft) and not seq.draft_token_ids
            else:
                assert seq.draft_token_ids == list(chunk.draft) and not seq.num_proposals
            assert len(seq.slot_mapping) == chunk.num_slots
        sampled, accepted, lps = executor.execute(step)
        for req, delta in sched.process_results(chunks, sampled, logprobs=lps, num_accepted=accepted,
                                                proposed=executor.proposed):
            outputs.setdefault(req.request_id, []).extend(delta.token_ids)
            logprobs.setdefault(req.request_id, []).extend(lp.token_id for lp in delta.logprobs)
        sched.check_invariants(at_rest=True)
    else:
        raise AssertionError("no end")
    assert not sched.has_work
    return outputs, logprobs


def scheduler(num_blocks: int, block_size: int, k: int, mode: str = "recompute", swap_blocks: int = 0,
              max_num_seqs: int = 8, prefix_caching: bool = True, method: str = "ngram",
              per_match: int = 0) -> Scheduler:
    """per_match 0 (default): every ngram proposal as long as k allows, the longest rollbacks."""
    spec = (SpeculativeConfig(method, k, 1, 3, disable_batch_size=max_num_seqs, ngram_per_match=per_match) if k
            else SpeculativeConfig())
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, preemption_mode=mode,
                             speculative=spec)
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching), HostBlockPool(swap_blocks))


def test_ngram_proposals_take_the_latest_match_longest_suffix_first():
    assert propose_ngram([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, 1, 3) == [7, 2]
    assert propose_ngram([1, 2, 3, 4, 5], 3, 1, 3) == []
    assert propose_ngram([4, 1, 2, 8, 1, 2], 4, 2, 2) == [8, 1, 2]
    assert propose_ngram([4, 1, 2, 8, 5, 2], 4, 2, 2) == []
    assert propose_ngram([4, 1, 2, 8, 5, 2], 4, 1, 2) == [8, 5, 2]


def test_ngram_proposals_are_at_most_per_match_times_the_matched_length():
    tokens = [1, 2, 3, 4, 5, 6, 9, 3, 4]  # the suffix 3 4 matched 2 tokens long
    assert propose_ngram(tokens, 5, 1, 4, per_match=1) == [5, 6]
    assert propose_ngram(tokens, 5, 1, 4, per_match=2) == [5, 6, 9, 3]
    assert propose_ngram(tokens, 3, 1, 4, per_match=2) == [5, 6, 9]  # never more than k
    assert propose_ngram(tokens, 5, 1, 4, per_match=0) == [5, 6, 9, 3, 4]
    assert propose_ngram([1, 2, 3, 9, 2], 3, 1, 3, per_match=1) == [3]  # a 1-token match: 1 token
    long_match = [1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4]
    assert propose_ngram(long_match, 8, 2, 8, per_match=1) == [5, 6, 7, 8]
    assert propose_ngram(long_match, 8, 2, 3, per_match=1) == [5, 6, 7]  # the match counts up to max_n


def test_speculative_config_defaults_scale_ngram_proposals():
    config = speculative_config(SpeculativeOptions(speculative="ngram"))
    assert (config.ngram_min, config.ngram_max, config.ngram_per_match) == (2, 8, 1)
    assert "at most 1 x the matched length" in config.describe()
    with pytest.raises(ValueError, match="ngram-tokens-per-match"):
        speculative_config(SpeculativeOptions(speculative="ngram", ngram_tokens_per_match=-1))


@pytest.mark.parametrize("per_match", [0, 1])
def test_speculation_gives_the_same_tokens_and_accepts_some(per_match):
    reqs = [request(f"r{i}", 7 + 5 * i, 30 + 3 * i) for i in range(4)]
    plain, _ = run(scheduler(64, 4, 0))
    sched = scheduler(64, 4, 4, per_match=per_match)
    for r in reqs:
        sched.add_request(r)
    spec, _ = run(sched)
    assert spec == {r.request_id: reference(r.prompt_token_ids, r.params.max_tokens) for r in reqs}
    stats = sched.stats()
    assert stats.spec_decode_num_draft_tokens_total > stats.spec_decode_num_accepted_tokens_total > 0
    assert sched.blocks.num_used_blocks == 0
    del plain


def test_draft_proposals_come_from_the_result_and_give_the_same_tokens():
    reqs = [request(f"r{i}", 7 + 5 * i, 30 + 3 * i) for i in range(4)]
    sched = scheduler(64, 4, 3, method="draft")
    for r in reqs:
        sched.add_request(r)
    outputs, _ = run(sched)
    assert outputs == {r.request_id: reference(r.prompt_token_ids, r.params.max_tokens) for r in reqs}
    stats = sched.stats()
    assert stats.spec_decode_num_draft_tokens_total > stats.spec_decode_num_accepted_tokens_total > 0


def test_a_result_without_the_proposals_fails_only_its_request():
    sched = scheduler(64, 4, 3, method="draft")
    for rid in ("a", "b"):
        sched.add_request(request(rid, 9, 12))
    step, chunks = sched.schedule()
    sched.process_results(chunks, [5] * len(chunks))
    step, chunks = sched.schedule()
    assert [s.num_proposals for s in step.seqs] == [3, 3]
    out = sched.process_results(chunks, [5, 6], num_accepted=[0, 0], proposed=[[7, 8, 9], [7, 8]])
    assert [req.request_id for req, _ in out] == ["a"]
    assert [r.request_id for r in sched.take_failed()] == ["b"]
    sched.check_invariants()


def test_logprobs_max_tokens_and_opt_out_see_exactly_the_accepted_tokens():
    sched = scheduler(64, 4, 4)
    a = request("a", 9, 23, logprobs=0)
    b = request("b", 9, 17, speculative=False)
    for r in (a, b):
        sched.add_request(r)
    outputs, logprobs = run(sched)
    assert outputs["a"] == reference(a.prompt_token_ids, 23) and len(outputs["a"]) == 23
    assert logprobs["a"] == outputs["a"]  # one logprob per token, for that token
    assert outputs["b"] == reference(b.prompt_token_ids, 17)
    assert sched.stats().spec_decode_num_accepted_tokens_total > 0


def test_no_proposals_above_the_disable_batch_size_or_under_penalties():
    sched = scheduler(64, 4, 4)
    sched.speculator.config = SpeculativeConfig("ngram", 4, 1, 3, disable_batch_size=1)
    for i in range(2):
        sched.add_request(request(f"r{i}", 9, 12))
    sched.add_request(request("p", 9, 12, presence_penalty=0.5))
    step, chunks = sched.schedule()
    sched.process_results(chunks, [5] * len(chunks))
    step, chunks = sched.schedule()
    assert not any(s.draft_token_ids for s in step.seqs)


def test_a_step_ahead_never_follows_a_speculating_step():
    sched = scheduler(64, 4, 4)
    sched.add_request(request("r", 12, 40))
    executor = SpeculatingFakeExecutor(4)
    steps_with_drafts = 0
    for _ in range(60):
        scheduled = sched.schedule()
        if scheduled is None:
            break
        step, chunks = scheduled
        if any(c.draft for c in chunks):
            steps_with_drafts += 1
        # a sequence that may speculate is not stepped ahead (its next step may propose)
        assert sched.schedule_ahead(chunks) is None
        sampled, accepted, _ = executor.execute(step)
        sched.process_results(chunks, sampled, num_accepted=accepted)
    assert steps_with_drafts > 0


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(12, 40),
    k=st.integers(1, 6),
    mode=st.sampled_from(["recompute", "swap"]),
    prefix_caching=st.booleans(),
    lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 30)), min_size=1, max_size=5),
    method=st.sampled_from(["ngram", "draft"]),
)
def test_rollback_across_block_boundaries_keeps_outputs_and_invariants(block_size, num_blocks, k, mode,
                                                                       prefix_caching, lens, method):
    sched = scheduler(num_blocks, block_size, k, mode, swap_blocks=64, max_num_seqs=4,
                      prefix_caching=prefix_caching, method=method)
    reqs = []
    for i, (prompt_len, max_tokens) in enumerate(lens):
        r = request(f"r{i}", prompt_len, max_tokens)
        if sched.check_fits(r) is None:
            sched.add_request(r)
            reqs.append(r)
    outputs, _ = run(sched)
    assert outputs == {r.request_id: reference(r.prompt_token_ids, r.params.max_tokens) for r in reqs}
    assert sched.blocks.num_used_blocks == 0

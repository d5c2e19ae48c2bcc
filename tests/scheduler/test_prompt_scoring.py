"""Prompt scoring in the scheduler (issue 11): every prompt position is scored once and in
order, through chunked prefill, preemption by recompute, forks (n > 1) and a warm prefix
cache, and the entries reach the request's first delta, once however many samples it has
(the tokenizer stage hands them to every sample)."""

from __future__ import annotations

import random

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import SamplingParams, TokenLogprob
from tests.scheduler.test_scheduler import FakeExecutor

EOS = 2


def score(prefix: list[int], target: int) -> float:
    """A model stand-in's logprob of target after prefix."""
    return -((sum(prefix) * 7 + target) % 101) / 10


class ScoringExecutor(FakeExecutor):
    def execute(self, step) -> list[int]:
        sampled = super().execute(step)
        self.prompt_logprobs = []
        for seq in step.seqs:
            if seq.score_targets:
                bs = self.bs
                seen = [self.pool[seq.block_table[p // bs] * bs + p % bs] for p in range(seq.start_pos + len(
                    seq.token_ids))]
                self.prompt_logprobs.append([
                    TokenLogprob(t, score(seen[: seq.start_pos + j + 1], t), 1)
                    for j, t in enumerate(seq.score_targets)])
        return sampled


def request(rid: str, prompt: list[int], **params) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True, **params),
                   frozenset({EOS}), 0.0)


def run(sched: Scheduler) -> dict:
    executor = ScoringExecutor(sched.blocks.block_size)
    firsts: dict = {}
    seen: set = set()  # requests that had a delta
    for _ in range(500):
        scheduled = sched.schedule()
        if scheduled is None:
            break
        step, chunks = scheduled
        sampled = executor.execute(step)
        beams, logprobs, scored = sched.expected_outputs(chunks)
        assert scored == len(executor.prompt_logprobs)
        for req, delta in sched.process_results(chunks, sampled, [], [], executor.prompt_logprobs):
            if delta.prompt_logprobs:  # once a request, on its first delta (the tokenizer fans them out)
                assert req.request_id not in firsts and req.request_id not in seen
                firsts[req.request_id] = delta.prompt_logprobs
            seen.add(req.request_id)
        sched.check_invariants()
    return firsts


def expected(prompt: list[int]) -> list[float]:
    return [score(prompt[:p], prompt[p]) for p in range(1, len(prompt))]


def test_every_position_once_through_chunks_preemption_forks_and_cache():
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 100) for _ in range(rng.choice([2, 17, 40, 75]))] for i in range(6)}
    # a small pool and budget: prompts are prefilled in chunks and requests get preempted
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_model_len=256), BlockManager(12, 8))
    warm = Sequence("warm", prompts["r3"], SamplingParams(max_tokens=1), frozenset({EOS}), 0.0)
    sched.add_request(warm)  # r3's prompt will sit in the prefix cache
    run(sched)
    for rid, prompt in prompts.items():
        sched.add_request(request(rid, prompt, n=2 if rid == "r1" else 1, seed=1))
    firsts = run(sched)
    for rid, prompt in prompts.items():
        got = firsts[rid]
        assert [e.token_id for e in got] == prompt[1:]
        assert [e.logprob for e in got] == expected(prompt)
    assert sched.num_preemptions_total > 0


def test_a_scoring_request_takes_no_cache_hits_until_scored():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 8))
    prompt = list(range(3, 40))
    sched.add_request(Sequence("a", prompt, SamplingParams(max_tokens=1), frozenset({EOS}), 0.0))
    run(sched)
    scoring = request("b", prompt)
    assert scoring.no_cache_hits and sched.blocks.get_computed_blocks(scoring) == []
    plain = Sequence("c", prompt, SamplingParams(max_tokens=1), frozenset({EOS}), 0.0)
    assert sched.blocks.get_computed_blocks(plain) != []
    sched.add_request(scoring)
    firsts = run(sched)
    assert [e.logprob for e in firsts["b"]] == expected(prompt)
    assert scoring.num_cached_tokens == 0

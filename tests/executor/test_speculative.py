"""Speculative decoding through the real scheduler and ModelRunner on a tiny random Llama, in
one process: greedy output with ngram proposals equals greedy output without them token for
token (and some proposals are accepted), a seeded sampled request gives the same tokens with and
without speculation, and verification by sampling keeps the target distribution (a chi-square
test over many seeded draws)."""

from __future__ import annotations

import math

import pytest
import torch

from services.executor.model_runner import ModelRunner
from services.executor.sampler import Sampler
from services.executor.seq_states import SequenceStates
from services.executor.speculative import row_output_indices, sampled_rows, settle
from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from services.scheduler.speculation import SpeculativeConfig
from shared.messages import SamplingParams, ScheduledSeq, SeqSampling, StepResult
from tests.executor.test_model_runner import make_model

BLOCK = 8


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    make_model(path, "tied")
    return ModelRunner(path, dtype="float32", block_size=BLOCK, num_kv_blocks=96, quantization="none")


def generate(runner: ModelRunner, prompts: list[list[int]], params: SamplingParams, k: int,
             logprobs: dict | None = None) -> tuple[dict, Scheduler]:
    """Every prompt's output, scheduled and run as the two stages do (sampling state sent once);
    each delta's logprobs go to `logprobs` by request when given."""
    spec = SpeculativeConfig("ngram", k, 1, 4, disable_batch_size=8, ngram_per_match=0) if k else SpeculativeConfig()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_model_len=256, vocab_size=runner.vocab_size,
                                      speculative=spec), BlockManager(runner.num_kv_blocks, BLOCK))
    states = SequenceStates()
    for i, prompt in enumerate(prompts):
        sched.add_request(Sequence(f"r{i}", prompt, params, frozenset(), 0.0))
    outputs: dict[str, list[int]] = {}
    while (scheduled := sched.schedule()) is not None:
        step, chunks = scheduled
        states.receive(step)
        assert not states.fill(step)
        result = runner.run(step)
        assert not result.failed
        for req, delta in sched.process_results(chunks, result.sampled, result.top_logprobs, result.logprobs,
                                                result.prompt_logprobs, result.embeddings, result.num_accepted):
            outputs.setdefault(req.request_id, []).extend(delta.token_ids)
            if logprobs is not None:
                logprobs.setdefault(req.request_id, []).extend(delta.logprobs)
        sched.check_invariants(at_rest=True)
    return outputs, sched


PROMPTS = [
    [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12, 13],  # repetition: proposals from the prompt
    [5, 900, 7, 300, 5, 900, 7, 300, 5, 900, 7],
    list(range(40, 70)),
]


def test_greedy_with_ngram_speculation_equals_greedy_without(runner):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain, _ = generate(runner, PROMPTS, params, 0)
    spec, sched = generate(runner, PROMPTS, params, 4)
    assert spec == plain
    stats = sched.stats()
    assert stats.spec_decode_num_accepted_tokens_total > 0
    assert sched.blocks.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_with_speculation(runner):
    params = SamplingParams(max_tokens=50, temperature=0.7, seed=1234, ignore_eos=True, logprobs=1)
    first, sched = generate(runner, PROMPTS[:2], params, 4)
    again, _ = generate(runner, PROMPTS[:2], params, 4)
    plain, _ = generate(runner, PROMPTS[:2], params, 0)
    assert first == again
    assert first == plain  # the same seeded draw per output index, with or without proposals
    assert sched.stats().spec_decode_num_drafts_total > 0


def test_verification_keeps_the_target_distribution():
    """One speculating row of a small vocabulary: the first emitted token must follow p, and the
    draft must be accepted with probability p(d). Chi-square over 4,000 seeded draws, at a
    significance of 0.001 (critical value of chi-square with 5 degrees of freedom: 20.52);
    acceptance within 4.5 standard errors."""
    p = torch.tensor([0.30, 0.05, 0.25, 0.15, 0.20, 0.05])
    logits = p.log()[None].repeat(2, 1)  # row 0: after the real token; row 1: after the draft
    draft = 2
    sampler = Sampler(seed=0)
    trials = 4000
    counts = [0] * len(p)
    accepted = 0
    for seed in range(trials):
        sampling = SeqSampling(temperature=1.0, top_p=1.0, top_k=0, seed=seed)
        seq = ScheduledSeq("r", [7, draft], 10, [0, 1], [10, 11], True, 0, sampling=sampling, draft_token_ids=[draft])
        rows = sampled_rows([seq])
        tokens = sampler.sample(logits, [s.sampling for s in rows], row_output_indices([seq]))
        result = StepResult(0, [-1], 0.0)
        emitted = settle([seq], [0, 0], tokens, result, {})
        first = draft if result.num_accepted[0] else result.sampled[0]
        counts[first] += 1
        accepted += result.num_accepted[0]
        assert len(emitted) == 1 + result.num_accepted[0]
    expected = [float(x) * trials for x in p]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected, strict=True))
    assert chi2 < 20.52, (counts, expected)
    rate, p_d = accepted / trials, float(p[draft])
    assert abs(rate - p_d) < 4.5 * math.sqrt(p_d * (1 - p_d) / trials)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_under_deterministic_speculation_changes_no_bit_of_tokens_or_logprobs(tmp_path, quantization):
    """--deterministic makes a step's rows batch- and chunk-invariant, so verifying 1 + k positions
    in one step computes each exactly as a lone decode step: speculative greedy output equals
    plain greedy output token for token, and so do the logprobs, bit for bit."""
    make_model(tmp_path, "tied")
    runner = ModelRunner(tmp_path, dtype="float32", block_size=BLOCK, num_kv_blocks=96, quantization=quantization,
                         deterministic=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
    plain_lp: dict = {}
    spec_lp: dict = {}
    plain, _ = generate(runner, PROMPTS, params, 0, plain_lp)
    spec, sched = generate(runner, PROMPTS, params, 4, spec_lp)
    assert spec == plain and sched.stats().spec_decode_num_accepted_tokens_total > 0
    assert spec_lp == plain_lp and all(len(spec_lp[r]) == len(plain[r]) for r in plain)

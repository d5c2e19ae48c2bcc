"""Speculative decoding with a draft model (`--speculative draft`) through the real scheduler and
ModelRunner on tiny random Llamas, in one process: under --deterministic, greedy output and its
logprobs with a draft's proposals are bit for bit those without (another random model as draft,
and the target as its own draft, which then has every proposal accepted), also when a small pool
preempts speculating sequences (recompute and swap), with the scheduler's and pool's invariants
checked after every step; a draft of another vocabulary is refused at load."""

from __future__ import annotations

import pytest

from services.executor.model_runner import ModelRunner
from services.executor.seq_states import SequenceStates
from services.scheduler.block_manager import BlockManager
from services.scheduler.host_block_pool import HostBlockPool
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from services.scheduler.speculation import SpeculativeConfig
from shared.messages import SamplingParams
from tests.executor.test_model_runner import make_model
from tests.helpers import make_tiny_llama

BLOCK = 4
PROMPTS = [
    [11, 12, 13, 14, 15, 16, 11, 12, 13, 14, 15, 16, 11, 12, 13],
    [5, 900, 7, 300, 5, 900, 7, 300, 5, 900, 7],
    list(range(40, 70)),
]
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    return make_tiny_llama(root / "target"), make_tiny_llama(root / "draft", seed=1, num_layers=1)


def runner(target, draft, num_blocks: int = 96, swap_space: int = 0) -> ModelRunner:
    return ModelRunner(target, dtype="float32", block_size=BLOCK, num_kv_blocks=num_blocks, quantization="none",
                       deterministic=True, swap_space=swap_space, draft_model=draft)


def generate(run: ModelRunner, k: int, prompts=PROMPTS, mode: str = "recompute") -> tuple[dict, dict, Scheduler]:
    """Each prompt's greedy tokens and logprobs, scheduled and run as the two stages do, with the
    scheduler's invariants checked after every step."""
    spec = SpeculativeConfig("draft", k, disable_batch_size=8) if k else SpeculativeConfig()
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, vocab_size=run.vocab_size,
                             preemption_mode=mode, speculative=spec)
    sched = Scheduler(config, BlockManager(run.num_kv_blocks, BLOCK), HostBlockPool(run.swap.num_blocks))
    states = SequenceStates()
    for i, prompt in enumerate(prompts):
        sched.add_request(Sequence(f"r{i}", prompt, GREEDY, frozenset(), 0.0))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    while (scheduled := sched.schedule()) is not None:
        step, chunks = scheduled
        states.receive(step)
        assert not states.fill(step)
        result = run.run(step)
        assert not result.failed
        sched.confirm_swaps(step.step_id)
        for req, delta in sched.process_results(chunks, result.sampled, result.top_logprobs, result.logprobs,
                                                result.prompt_logprobs, result.embeddings, result.num_accepted,
                                                result.proposed):
            tokens.setdefault(req.request_id, []).extend(delta.token_ids)
            logprobs.setdefault(req.request_id, []).extend(delta.logprobs)
        sched.check_invariants(at_rest=True)
    assert not sched.has_work and sched.blocks.num_used_blocks == 0
    return tokens, logprobs, sched


def test_greedy_with_a_draft_model_is_bitwise_greedy_without(models):
    target, draft = models
    run = runner(target, draft)
    plain = generate(run, 0)[:2]
    tokens, logprobs, sched = generate(run, 4)
    assert (tokens, logprobs) == plain
    stats = sched.stats()
    assert stats.spec_decode_num_drafts_total > 0
    assert stats.spec_decode_num_draft_tokens_total >= stats.spec_decode_num_accepted_tokens_total


def test_the_target_as_its_own_draft_has_every_proposal_accepted(models):
    target, _ = models
    run = runner(target, target)
    plain = generate(run, 0)[:2]
    tokens, logprobs, sched = generate(run, 3)
    assert (tokens, logprobs) == plain
    stats = sched.stats()
    assert stats.spec_decode_num_draft_tokens_total > 20
    assert stats.spec_decode_num_accepted_tokens_total == stats.spec_decode_num_draft_tokens_total


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_of_speculating_sequences_keeps_outputs_and_invariants(models, mode):
    target, draft = models
    prompts = [p + p[:5] for p in PROMPTS] + [list(range(300, 322))]
    run = runner(target, target if mode == "swap" else draft, num_blocks=36, swap_space=1 << 20)
    plain = generate(runner(target, None), 0, prompts)[:2]
    tokens, logprobs, sched = generate(run, 4, prompts, mode)
    assert (tokens, logprobs) == plain
    stats = sched.stats()
    assert stats.num_preemptions_total > 0 and stats.spec_decode_num_accepted_tokens_total > 0


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path):
    target, _ = models
    make_model(tmp_path, "tied")
    with pytest.raises(ValueError, match="vocabulary"):
        runner(target, tmp_path)

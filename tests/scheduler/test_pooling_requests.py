"""Embedding requests (SamplingParams.pooling) in the scheduler: prefill only, chunked like any
prompt, beside generations; they end with a PooledOutput and free their blocks; mean pooling
takes no prefix-cache hits but leaves its blocks cached for others; last pooling takes hits."""

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import PooledOutput, SamplingParams, TokenDelta
from tests.scheduler.test_scheduler import EOS, make

POOLED = b"\x00\x00\x80\x3f"  # the executor's vector: one float32 1.0


def embedding(rid, prompt, pooling="mean"):
    return Sequence(rid, list(prompt), SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling),
                    frozenset({EOS}), 0.0)


def step_and_apply(sched):
    """One step with the executor's part faked: a token for each sampled row, a vector for each
    pooling row that ends its prompt. Returns the step and what it sent."""
    step, chunks = sched.schedule()
    ends = [i for i, _, end in step.pooling if end]
    sampled = [7 if s.sample else -1 for s in step.seqs]
    return step, sched.process_results(chunks, sampled, embeddings=[POOLED] * len(ends))


def test_a_chunked_embedding_runs_beside_a_generation_and_frees_its_blocks():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(64, 4))
    prompt = list(range(3, 33))  # 30 tokens: two chunks, the generation's prompt beside the second
    sched.add_request(embedding("e", prompt))
    sched.add_request(make("g", 2, 4))
    sent, steps = [], []
    while sched.has_work:
        step, out = step_and_apply(sched)
        steps.append(step)
        sent += out
        sched.check_invariants()
    emb_rows = [(s.seqs[i], kind, end) for s in steps for i, kind, end in s.pooling]
    assert [(seq.start_pos, len(seq.token_ids), kind, end) for seq, kind, end in emb_rows] == [
        (0, 16, "mean", False), (16, 14, "mean", True)]
    assert any(s.seqs[-1].request_id == "g" for s in steps if s.pooling)  # the generation shared a step
    assert all(not seq.sample for seq, _, _ in emb_rows)  # never sampled
    assert sum(1 for _, _, end in emb_rows if end) == 1
    pooled = [d for _, d in sent if isinstance(d, PooledOutput)]
    assert pooled == [PooledOutput("e", POOLED, 30, 0)]
    tokens = [d for _, d in sent if isinstance(d, TokenDelta)]
    assert {d.request_id for d in tokens} == {"g"} and tokens[-1].finish_reason == "length"
    assert sched.blocks.num_free_blocks == 64 and not sched.groups


def test_prefix_cache_mean_contributes_only_and_last_takes_hits():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(64, 4))
    prompt = list(range(3, 23))
    sched.add_request(embedding("a", prompt, "mean"))
    step_and_apply(sched)
    sched.add_request(embedding("b", prompt, "mean"))  # cached blocks there, not taken
    step, _ = step_and_apply(sched)
    assert step.seqs[0].start_pos == 0 and len(step.seqs[0].token_ids) == 20
    sched.add_request(embedding("c", prompt, "last"))  # the last token's state alone: hits taken
    step, out = step_and_apply(sched)
    assert step.seqs[0].start_pos == 16 and step.pooling == [(0, "last", True)]
    assert out[0][1].num_cached_tokens == 16
    sched.add_request(Sequence("g", prompt + [50], SamplingParams(max_tokens=2), frozenset({EOS}), 0.0))
    step, _ = step_and_apply(sched)  # a generation shares the embeddings' cached prompt
    assert step.seqs[0].start_pos == 20


def test_embedding_prompt_may_fill_the_context_and_not_more():
    sched = Scheduler(SchedulerConfig(max_model_len=32), BlockManager(64, 4))
    assert sched.check_fits(embedding("a", range(3, 35))) is None  # 32 tokens: nothing is generated
    assert "exceeds the maximum context length" in sched.check_fits(embedding("b", range(3, 36)))
    bad = Sequence("c", [3, 4], SamplingParams(max_tokens=1, pooling="max"), frozenset({EOS}), 0.0)
    assert "pooling must be one of" in sched.check_fits(bad)
    two = Sequence("d", [3, 4], SamplingParams(max_tokens=1, n=2, pooling="mean"), frozenset({EOS}), 0.0)
    assert "one sequence" in sched.check_fits(two)


def test_a_preempted_embedding_is_recomputed_not_swapped():
    from services.scheduler.host_block_pool import HostBlockPool

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8, preemption_mode="swap"), BlockManager(8, 4),
                      HostBlockPool(16))
    sched.add_request(embedding("e", range(3, 27)))  # 24 tokens, 6 blocks, in chunks of 8
    step_and_apply(sched)
    req = sched.running[0]
    swap_out = []
    sched.running.remove(req)
    sched._preempt(req, swap_out)
    assert swap_out == [] and req.num_computed_tokens == 0 and not req.swapped_blocks

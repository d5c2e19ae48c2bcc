"""Bounded steps (issue 19): sampling parameters and token histories go to the executor once,
each ExecuteStep stays under the scheduler's byte budget, and what the executor rebuilds from
its cached state is exactly what a step carrying everything would have said, through
preemption, executor restarts, lost steps, parallel samples and beam search."""

from __future__ import annotations

import random

import msgspec
import pytest

from services.executor.seq_states import SequenceStates
from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import PREVIOUS_TOKEN, ExecuteStep, SamplingParams, SchedulerToExecutor
from tests.scheduler.test_scheduler import EOS, FakeExecutor, reference_beam_search, reference_output

ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(SchedulerToExecutor)


def hostile_params(n: int, allowed: int, bias: int, words: int, **extra) -> SamplingParams:
    """The finding's request, scaled: n samples, a long allowed list, many biases, long bad words."""
    rng = random.Random(allowed)
    return SamplingParams(
        max_tokens=6, n=n, ignore_eos=True, seed=7, allowed_token_ids=list(range(3, 3 + allowed)),
        logit_bias=[(rng.randrange(3, 100), 0.5) for _ in range(bias)],
        bad_words_ids=[[rng.randrange(60_000, 65_000) for _ in range(8)] for _ in range(words)], **extra)


def request(rid: str, prompt_len: int, params: SamplingParams) -> Sequence:
    prompt = [random.Random(rid).randrange(3, 100) for _ in range(prompt_len)]
    return Sequence(rid, prompt, params, frozenset({EOS}), 0.0)


class StatefulExecutor(FakeExecutor):
    """FakeExecutor behind the wire and the executor's cached request state: each step is
    encoded and decoded as the socket would, its state taken in and filled back, and every
    sampled row must then read exactly what the scheduler's own request says (its sampling,
    its whole output and, for repetition_penalty, its prompt)."""

    def __init__(self, sched: Scheduler):
        super().__init__(sched.blocks.block_size)
        self.sched = sched
        self.states = SequenceStates()
        self.sizes: list[int] = []
        self.chunks = []  # of the step executed next; None: look its requests up

    def execute(self, step) -> list[int]:
        frame = ENCODER.encode(step)
        self.sizes.append(len(frame))
        wire = DECODER.decode(frame)
        self.states.receive(wire)
        if self.chunks is not None:  # (with a step built ahead, the scheduler is one step further)
            # both sides agree on what the executor holds, once the step is in
            assert self.states.held_seqs() == self.sched.executor_states.held_seqs()
        assert self.states.fill(wire) == []
        for seq, req in zip(wire.seqs, self._requests(wire), strict=True):
            if req is None:
                continue  # ended while its step was in flight
            assert seq.sampling == req.sampling
            if seq.sample and req.sampling.needs_output:
                assert list(seq.output_token_ids) == list(req.output_token_ids)
                want_prompt = req.prompt_token_ids if req.sampling.repetition_penalty != 1 else []
                assert list(seq.prompt_token_ids) == want_prompt
        return super().execute(wire)

    def _requests(self, step):
        if self.chunks is not None:
            return [c.sequence for c in self.chunks]
        groups = self.sched.groups
        return [next((r for r in (groups[s.request_id].seqs if s.request_id in groups else [])
                      if r.seq_index == s.seq_index), None)
                for s in step.seqs]


def assert_reference_outputs(reqs, outputs) -> None:
    """Every sample of every request produced the stand-in model's output for its prompt."""
    for r in reqs:
        want = reference_output(r.prompt_token_ids, r.params.max_tokens)
        for s in range(r.params.n):
            assert outputs[r.request_id if r.params.n == 1 else (r.request_id, s)] == want


def assert_all_released(sched: Scheduler, executor: StatefulExecutor) -> None:
    """Once everything ended, the next step (here an empty one) leaves the executor holding nothing."""
    assert len(sched.executor_states) == 0
    step = ExecuteStep(0, [])
    sched.executor_states.stamp(step)
    executor.states.receive(step)
    assert len(executor.states) == 0


def run(sched: Scheduler, executor: StatefulExecutor, between=None, max_steps=2000):
    outputs: dict = {}
    for number in range(max_steps):
        if between:
            between(number)
        scheduled = sched.schedule()
        if scheduled is None:
            return outputs
        step, chunks = scheduled
        executor.chunks = chunks
        sampled = executor.execute(step)
        for req, delta in sched.process_results(chunks, sampled, executor.top_logprobs):
            key = req.request_id if req.params.n == 1 else (req.request_id, delta.seq_index)
            outputs.setdefault(key, []).extend(delta.token_ids)
        sched.check_invariants()
    raise AssertionError("no end")


def test_the_second_step_of_a_request_with_huge_sampling_is_small():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096), BlockManager(512, 16))
    for i in range(4):
        sched.add_request(request(f"h{i}", 20, hostile_params(n=4, allowed=8192, bias=256, words=64)))
    executor = StatefulExecutor(sched)
    huge = len(msgspec.msgpack.encode(sched.groups["h0"].seqs[0].sampling))
    assert huge > 25_000
    outputs = run(sched, executor)
    # the first step carries each request's sampling once; after it, a few hundred bytes a sequence
    assert executor.sizes[0] < 4 * huge + 20_000
    for size in executor.sizes[1:]:
        assert size < 16 * 1_000  # 16 sequences
    for i in range(4):
        prompt = request(f"h{i}", 20, SamplingParams()).prompt_token_ids
        for s in range(4):
            assert outputs[(f"h{i}", s)] == reference_output(prompt, 6)


@pytest.mark.parametrize("mode", ["restart", "lost"])
def test_state_is_sent_again_after_an_executor_restart_or_lost_steps(mode):
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(256, 8))
    params = hostile_params(n=2, allowed=500, bias=8, words=4, repetition_penalty=1.2, presence_penalty=0.5)
    reqs = [request(f"r{i}", 9 + i, msgspec.structs.replace(params, max_tokens=12)) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    executor = StatefulExecutor(sched)

    def restart(number):
        if number in (4, 9):
            sched.preempt_all()  # what the service does when the executor restarts or stops answering
            if mode == "restart":
                executor.states = SequenceStates()  # a new process holds nothing
            executor.pool.clear()

    outputs = run(sched, executor, between=restart)
    for r in reqs:
        for s in range(2):
            assert outputs[(r.request_id, s)] == reference_output(r.prompt_token_ids, 12)
    assert_all_released(sched, executor)


def test_preemption_parallel_samples_and_penalties_keep_outputs_and_states_in_step():
    # a small pool: requests are preempted and recomputed, with histories that must follow
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48), BlockManager(20, 4))
    params = [SamplingParams(max_tokens=10, ignore_eos=True, n=3, seed=1, frequency_penalty=0.3),
              SamplingParams(max_tokens=14, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=8, ignore_eos=True, bad_words_ids=[[5, 6]]),
              SamplingParams(max_tokens=9, ignore_eos=True)]
    reqs = [request(f"p{i}", 6 + 3 * i, params[i % 4]) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    executor = StatefulExecutor(sched)
    outputs = run(sched, executor)
    assert sched.num_preemptions_total > 0
    assert_reference_outputs(reqs, outputs)
    assert_all_released(sched, executor)


def test_beam_search_with_penalties_sends_each_new_beam_its_history():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(128, 4))
    req = request("beam", 9, SamplingParams(max_tokens=8, use_beam_search=True, beam_width=3, n=3,
                                            temperature=0.0, presence_penalty=0.2))
    sched.add_request(req)
    executor = StatefulExecutor(sched)
    outputs = run(sched, executor)
    want = reference_beam_search(req.prompt_token_ids, 3, 8, EOS)
    assert [outputs[("beam", i)] for i in range(3)] == want
    assert_all_released(sched, executor)


def test_every_step_stays_under_the_byte_budget_and_the_rest_spills_over():
    budget = 60_000
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_step_bytes=budget), BlockManager(1024, 16))
    params = hostile_params(n=2, allowed=4000, bias=64, words=16)  # ~25 KB once per request
    reqs = [request(f"b{i}", 30, params) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    executor = StatefulExecutor(sched)
    outputs = run(sched, executor)
    assert max(executor.sizes) <= budget
    assert executor.sizes[0] > budget // 3  # it did fill steps up, not send one request at a time
    for r in reqs:
        for s in range(2):
            assert outputs[(r.request_id, s)] == reference_output(r.prompt_token_ids, 6)


def test_a_request_whose_sampling_alone_cannot_fit_a_step_is_refused():
    sched = Scheduler(SchedulerConfig(max_step_bytes=50_000), BlockManager(64, 16))
    big = request("big", 10, hostile_params(n=1, allowed=20_000, bias=0, words=0))
    problem = sched.check_fits(big)
    assert problem is not None and "allowed_token_ids" in problem and "50000" in problem
    assert sched.check_fits(request("small", 10, hostile_params(n=1, allowed=100, bias=0, words=0))) is None


def test_a_step_naming_a_sequence_the_executor_does_not_hold_fails_that_row_alone():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 8))
    for rid in ("a", "b"):
        sched.add_request(request(rid, 5, SamplingParams(max_tokens=4, presence_penalty=0.5)))
    step, _ = sched.schedule()
    states = SequenceStates()
    wire = DECODER.decode(ENCODER.encode(step))
    wire.seqs[0].sampling = None  # as if its first step had been lost
    states.receive(wire)
    failed = states.fill(wire)
    assert [row.index for row in failed] == [0] and failed[0].status == 500
    assert "holds no sampling state" in failed[0].message
    assert wire.seqs[1].sampling == sched.groups["b"].seqs[0].sampling


def test_steps_built_ahead_carry_no_state_twice():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 8))
    sched.add_request(request("a", 5, hostile_params(n=1, allowed=3000, bias=0, words=0)))
    first, chunks = sched.schedule()
    ahead, _ = sched.schedule_ahead(chunks)
    assert first.seqs[0].sampling is not None and first.reset_states
    assert ahead.seqs[0].token_ids == [PREVIOUS_TOKEN] and ahead.seqs[0].sampling is None
    assert len(ENCODER.encode(ahead)) < 1_000


def test_steps_built_ahead_keep_the_executor_state_right():
    from tests.scheduler.test_async_scheduling import run_pipelined

    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64), BlockManager(48, 4))
    params = [SamplingParams(max_tokens=9, ignore_eos=True, n=2, seed=4, allowed_token_ids=list(range(3, 200))),
              SamplingParams(max_tokens=7, ignore_eos=True, logit_bias=[(5, 1.0)] * 50),
              SamplingParams(max_tokens=11, ignore_eos=True)]  # (sampling that reads the output never runs ahead)
    reqs = [request(f"a{i}", 5 + 4 * i, params[i % 3]) for i in range(6)]
    for r in reqs:
        sched.add_request(r)
    executor = StatefulExecutor(sched)
    executor.chunks = None
    outputs, _, ahead = run_pipelined(sched, executor=executor)
    assert ahead > 0
    assert_reference_outputs(reqs, outputs)
    assert_all_released(sched, executor)


def test_the_estimate_covers_a_prefix_cache_hit_and_a_swapped_sequence():
    """A sequence admitted on a cached prefix or swapped back in computes few tokens but sends
    its whole block table: the budget still holds."""
    prompt = [random.Random(1).randrange(3, 100) for _ in range(1600)]
    budget = 4_000
    sched = Scheduler(SchedulerConfig(max_step_bytes=budget, max_num_batched_tokens=2048), BlockManager(1000, 4))
    sched.add_request(Sequence("warm", prompt, SamplingParams(max_tokens=1), frozenset({EOS}), 0.0))
    executor = StatefulExecutor(sched)
    run(sched, executor)
    for i in range(6):  # each computes a token or two, on a 401-block table
        sched.add_request(Sequence(f"hit{i}", prompt + [i + 3], SamplingParams(max_tokens=2, ignore_eos=True),
                                  frozenset({EOS}), 0.0))
    executor.sizes.clear()
    outputs = run(sched, executor)
    assert len(outputs) == 6 and max(executor.sizes) <= budget

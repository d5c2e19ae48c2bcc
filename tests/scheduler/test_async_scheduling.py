"""Async scheduling: a step built while the one before is in flight gives the outputs a
step-by-step run gives, keeps the pool consistent, and goes ahead only where it can.

The driver below does what the scheduler stage does (two steps in flight at most,
results applied in order) against the model-free executor of test_scheduler, which
reads every token back through the slots it is given, with the executor's own
`PreviousTokens` filling in the placeholders.
"""

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.previous_tokens import PreviousTokens
from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import PREVIOUS_TOKEN, ExecuteStep, ScheduledSeq, SeqSampling, StepResult
from tests.scheduler.test_scheduler import (
    FakeExecutor,
    apply_result,
    check_random_run,
    make,
    random_run_setup,
    reference_output,
    run_until_done,
)


def run_pipelined(sched: Scheduler, max_steps=3_000, between=None, executor=None):
    """Run to the end as the scheduler stage does with async scheduling: a step is built
    ahead whenever exactly one is in flight. `between(sched, step_no)` runs after each
    result (aborts, holds). Returns outputs, finish reasons and how many steps were
    built ahead."""
    executor = executor or FakeExecutor(sched.blocks.block_size)
    previous = PreviousTokens()
    in_flight: deque = deque()
    outputs: dict = {}
    finish: dict = {}
    ahead = 0
    for step_no in range(max_steps):
        if not in_flight:
            scheduled = sched.schedule()
            if scheduled is None:
                break
            in_flight.append(scheduled)
        if len(in_flight) == 1:
            built = sched.schedule_ahead(in_flight[0][1])
            if built is not None:
                in_flight.append(built)
                ahead += 1
                flying = {id(c.sequence) for c in in_flight[0][1]}
                for s, c in zip(built[0].seqs, built[1], strict=True):  # placeholders: only those going on
                    assert (s.token_ids == [PREVIOUS_TOKEN]) == (id(c.sequence) in flying)
        step, chunks = in_flight.popleft()
        assert previous.fill(step) is None
        sampled = executor.execute(step)
        previous.record(step, StepResult(step.step_id, sampled, 0.0))
        beams, _, _ = sched.expected_outputs(chunks)
        assert beams == len(executor.top_logprobs)
        apply_result(sched, chunks, sampled, executor.top_logprobs, outputs, finish)
        sched.check_invariants()
        if between:
            between(sched, step_no)
    else:
        raise AssertionError("no end")
    return outputs, finish, ahead


def test_decoding_runs_ahead_and_gives_the_step_by_step_outputs():
    reqs = [make(f"r{i}", 5 + 7 * i, 3 + 2 * i) for i in range(6)]
    sync = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 4))
    pipe = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 4))
    for sched in (sync, pipe):
        for r in reqs:
            sched.add_request(make(r.request_id, r.num_prompt_tokens, r.params.max_tokens))
    expected, _ = run_until_done(sync)
    got, finish, ahead = run_pipelined(pipe)
    assert got == expected
    for r in reqs:
        assert got[r.request_id] == reference_output(r.prompt_token_ids, r.params.max_tokens)
    assert set(finish.values()) == {"length"}
    assert ahead >= pipe.num_steps_total // 2  # most steps were built ahead
    assert pipe.blocks.num_free_blocks == 64 and not pipe.has_work


def test_a_single_stream_is_built_ahead_every_step_after_its_prompt():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("one", 9, 12))
    got, _, ahead = run_pipelined(sched)
    assert got["one"] == reference_output(make("one", 9, 12).prompt_token_ids, 12)
    # the prompt step, then 11 decode steps, all built ahead (the last token needs none after it)
    assert sched.num_steps_total == 12 and ahead == 11


def test_the_step_ahead_carries_the_placeholder_one_position_on():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("a", 6, 5))
    first, chunks = sched.schedule()
    ahead, ahead_chunks = sched.schedule_ahead(chunks)
    (seq,) = ahead.seqs
    assert seq.token_ids == [PREVIOUS_TOKEN] and seq.start_pos == 6 and seq.output_index == 1 and seq.sample
    assert seq.slot_mapping == sched.blocks.slot_mapping(chunks[0].sequence, 6, 1)
    # never two ahead: until the result before it applies, the step ahead's chunk is no sampling one
    assert sched.schedule_ahead(ahead_chunks) is None


def test_a_sequence_that_stops_early_wastes_one_step_and_sends_nothing_after_its_stop():
    sync = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    pipe = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    for sched in (sync, pipe):
        for i in range(4):
            req = make(f"e{i}", 7 + i, 20)
            ref = reference_output(req.prompt_token_ids, 20)
            req.eos_token_ids = frozenset({ref[3 + 2 * i]})  # stops after 4, 6, 8, 10 tokens (or sooner)
            sched.add_request(req)
    expected, want_finish = run_until_done(sync)
    got, finish, _ = run_pipelined(pipe)
    assert got == expected and finish == want_finish and set(finish.values()) == {"stop"}
    assert pipe.blocks.num_used_blocks == 0 and not pipe.groups


def test_no_step_ahead_of_a_prompt_chunk_a_fork_penalties_or_beams():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), BlockManager(64, 4))
    sched.add_request(make("long", 20, 4))
    _, chunks = sched.schedule()
    assert not chunks[0].samples and sched.schedule_ahead(chunks) is None
    for kind, params in (("pen", {"presence_penalty": 0.5}), ("beam", {"use_beam_search": True, "beam_width": 2}),
                         ("n", {"n": 2}), ("rep", {"repetition_penalty": 1.2})):
        s = Scheduler(SchedulerConfig(), BlockManager(64, 4))
        s.add_request(make(kind, 6, 4, **params))
        built = s.schedule()
        if kind == "n":  # the parent stops at its fork point; the samples start after it
            assert s.schedule_ahead(built[1]) is None
            continue
        assert s.schedule_ahead(built[1]) is None, kind


def test_the_last_token_is_not_followed_and_nothing_that_does_not_fit_is_preempted():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("short", 4, 1))
    _, chunks = sched.schedule()
    assert sched.schedule_ahead(chunks) is None  # max_tokens 1: its one token ends it
    tight = Scheduler(SchedulerConfig(), BlockManager(2, 4))  # 8 slots: a prompt of 8 fills them
    tight.add_request(make("full", 8, 4))
    tight.add_request(make("late", 3, 1))
    step, chunks = tight.schedule()
    assert [c.sequence.request_id for c in chunks] == ["full"]
    assert tight.schedule_ahead(chunks) is None  # no room for its next token, nothing admitted
    assert tight.num_preemptions_total == 0


def test_requests_that_arrive_while_a_step_is_in_flight_are_admitted_in_the_step_ahead():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("first", 5, 6))
    _, chunks = sched.schedule()
    sched.add_request(make("second", 7, 6))
    ahead, _ = sched.schedule_ahead(chunks)
    assert [(s.request_id, len(s.token_ids)) for s in ahead.seqs] == [("first", 1), ("second", 7)]
    assert ahead.seqs[1].token_ids[0] != PREVIOUS_TOKEN


def test_aborts_and_holds_between_results_keep_outputs_and_the_pool_right():
    reqs = [make(f"h{i}", 4 + 3 * i, 10) for i in range(5)]
    sync = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    for r in reqs:
        sync.add_request(make(r.request_id, r.num_prompt_tokens, 10))
    expected, _ = run_until_done(sync)
    pipe = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    for i, r in enumerate(reqs):
        req = make(r.request_id, r.num_prompt_tokens, 10)
        req.reply_to = b"slow" if i == 1 else b"fast"
        pipe.add_request(req)

    def between(s, step_no):
        if step_no == 3:
            s.finish_request("h2", "abort")
        s.held = {b"slow"} if 2 <= step_no < 6 else set()

    got, finish, ahead = run_pipelined(pipe, between=between)
    assert "h2" not in finish and ahead > 0
    for rid in ("h0", "h1", "h3", "h4"):
        assert got[rid] == expected[rid] and finish[rid] == "length"
    assert pipe.blocks.num_used_blocks == 0 and not pipe.groups


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(1, 3), st.sampled_from(["", "beam", "pen"]),
                       st.integers(0, 40), st.integers(0, 15)), min_size=1, max_size=8),
    st.sampled_from(["recompute", "swap"]),
    st.integers(8, 40),
    st.booleans(),
)
def test_random_workloads_pipelined_match_step_by_step(specs, mode, num_blocks, shared_prompts):
    """Random mixes (shared prefixes, parallel samples, beams, penalties, early stops, aborts)
    on a small pool with preemption: the pipelined run gives every request that is not
    aborted the outputs of an unconstrained step-by-step run, and frees everything."""
    def build(sched) -> set[str]:
        admitted = set()
        for i, (plen, out, k, kind, _abort_at, stop_at) in enumerate(specs):
            rid = f"q{i}"
            extra = ({"use_beam_search": True, "beam_width": k} if kind == "beam"
                     else {"presence_penalty": 0.5} if kind == "pen" else {})
            req = make("shared" if shared_prompts else rid, plen, out, n=k, **extra)
            req.request_id = rid
            if kind != "beam" and stop_at < out:
                req.eos_token_ids = frozenset({reference_output(req.prompt_token_ids, out)[stop_at]})
            if sched.check_fits(req) is None:
                sched.add_request(req)
                admitted.add(rid)
        return admitted

    expected, small, admitted = random_run_setup(build, mode, num_blocks)
    aborts = {f"q{i}": at for i, (_, _, _, _, at, _) in enumerate(specs) if at % 5 == 0}

    def abort_some(s, step_no):
        for rid, at in aborts.items():
            if at == step_no:
                s.finish_request(rid, "abort")

    got, _, _ = run_pipelined(small, between=abort_some)
    check_random_run(small, expected, got, aborts, {f"q{i}" for i in range(len(specs))} - admitted)


# --- the executor's side -------------------------------------------------------------


def seq(rid, tokens, sample=True, seq_index=0):
    return ScheduledSeq(rid, tokens, 0, [0], list(range(len(tokens))), sample, 0, SeqSampling(1.0, 1.0, 0, None),
                        seq_index=seq_index)


def test_previous_tokens_fills_placeholders_from_the_step_just_before():
    prev = PreviousTokens()
    first = ExecuteStep(1, [seq("a", [5, 6]), seq("b", [7], seq_index=1), seq("c", [8, 9], sample=False)])
    assert prev.fill(first) is None and first.seqs[0].token_ids == [5, 6]
    prev.record(first, StepResult(1, [11, 12, -1], 0.0))
    nxt = ExecuteStep(2, [seq("a", [PREVIOUS_TOKEN]), seq("b", [PREVIOUS_TOKEN], seq_index=1), seq("d", [4])])
    assert prev.fill(nxt) is None
    assert [s.token_ids for s in nxt.seqs] == [[11], [12], [4]]
    prev.record(nxt, StepResult(2, [13, 14, 15], 0.0))
    # only the step just before counts: "c" sampled nothing, and "a" of step 1 is gone
    for bad in ([seq("c", [PREVIOUS_TOKEN])], [seq("b", [PREVIOUS_TOKEN], seq_index=0)],
                [seq("a", [3, PREVIOUS_TOKEN])]):
        assert "did not sample" in PreviousTokens.fill(prev, ExecuteStep(3, bad))
    prev.clear()
    assert prev.fill(ExecuteStep(4, [seq("a", [PREVIOUS_TOKEN])])) is not None


@pytest.mark.parametrize("seed", range(3))
def test_placeholders_never_reach_the_executor_unfilled(seed):
    """Every token the executor reads in a pipelined run is a real one (the fake writes
    token ids into its pool and reads them back)."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(40, 4))
    for i in range(6):
        sched.add_request(make(f"p{seed}-{i}", rng.randint(1, 20), rng.randint(1, 15)))

    class Strict(FakeExecutor):
        def execute(self, step):
            assert all(t >= 0 for s in step.seqs for t in s.token_ids)
            return super().execute(step)

    got, finish, ahead = run_pipelined(sched, executor=Strict(4))
    assert ahead > 0 and len(finish) == 6

"""The priority policy (--scheduling-policy priority): order by (priority, arrival), preemption
of strictly lower priorities only for a waiting request that finds no room, and fcfs unchanged."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager
from services.scheduler.host_block_pool import HostBlockPool
from services.scheduler.priority_queue import PriorityWaiting
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import SequenceStatus
from tests.scheduler.test_scheduler import (
    FakeExecutor,
    apply_result,
    check_random_run,
    make,
    reference_output,
    run_until_done,
)


def req(rid, prompt_len, max_tokens, priority=0, arrival=0.0, **params):
    r = make(rid, prompt_len, max_tokens, **params)
    r.priority, r.arrival_time = priority, arrival
    return r


def priority_scheduler(num_blocks=64, block_size=4, **config):
    return Scheduler(SchedulerConfig(scheduling_policy="priority", **config), BlockManager(num_blocks, block_size))


def step_once(sched, executor, outputs=None, finish=None):
    step, chunks = sched.schedule()
    apply_result(sched, chunks, executor.execute(step), executor.top_logprobs,
                 {} if outputs is None else outputs, {} if finish is None else finish)
    sched.check_invariants()
    return step


def test_the_waiting_queue_orders_by_priority_then_arrival_and_keeps_deque_ties():
    q = PriorityWaiting()
    a, b, c, d = req("a", 1, 1, 2, 1.0), req("b", 1, 1, 0, 3.0), req("c", 1, 1, 2, 0.5), req("d", 1, 1, 0, 3.0)
    q.extend([a, b, c])
    q.append(d)  # same rank as b: behind it
    assert [s.request_id for s in q] == ["b", "d", "c", "a"]
    e = req("e", 1, 1, 0, 3.0)
    q.appendleft(e)  # same rank again: ahead of both, as a preempted sequence goes back
    assert [s.request_id for s in q] == ["e", "b", "d", "c", "a"] and q[0] is e
    q.remove(b)
    assert b not in q and d in q and len(q) == 4
    assert [s.request_id for s in q] == ["e", "d", "c", "a"]
    q.check_invariants()


def test_requests_are_admitted_by_priority_then_arrival():
    sched = priority_scheduler(max_num_seqs=1)
    for rid, prio, arrival in [("late-low", 5, 1.0), ("high", -1, 4.0), ("mid", 2, 3.0), ("early-low", 5, 0.5)]:
        sched.add_request(req(rid, 3, 2, prio, arrival))
    order = []
    executor = FakeExecutor(4)
    while sched.has_work:
        step = step_once(sched, executor)
        order += [s.request_id for s in step.seqs if s.request_id not in order]
    assert order == ["high", "mid", "early-low", "late-low"]


def test_fcfs_refuses_a_priority_and_orders_by_arrival():
    fcfs = Scheduler(SchedulerConfig(max_num_seqs=1), BlockManager(64, 4))
    assert "--scheduling-policy priority" in fcfs.check_fits(req("p", 3, 2, priority=1))
    assert fcfs.check_fits(req("z", 3, 2, priority=0)) is None
    assert priority_scheduler().check_fits(req("p", 3, 2, priority=-7)) is None


def test_a_waiting_request_preempts_the_lowest_priority_latest_arrival_only():
    # 14 blocks of 4 tokens; three requests of 15 prompt tokens take 4 blocks each (their first
    # sampled token still fits the fourth)
    sched = priority_scheduler(num_blocks=14, max_num_batched_tokens=64)
    low_early, mid, low_late = req("low-early", 15, 8, 5, 0.0), req("mid", 15, 8, 3, 1.0), req("low-late", 15, 8, 5, 2.0)
    for r in (low_early, mid, low_late):
        sched.add_request(r)
    executor = FakeExecutor(4)
    step_once(sched, executor)
    assert [r.request_id for r in sched.running] == ["mid", "low-early", "low-late"]
    high = req("high", 10, 4, 1, 3.0)  # needs 3 blocks, 2 are free
    sched.add_request(high)
    step = step_once(sched, executor)
    assert "high" in [s.request_id for s in step.seqs]
    assert low_late.num_preemptions == 1  # the lowest priority, the latest arrival among equals
    assert low_early.num_preemptions == 0 and mid.num_preemptions == 0
    assert sched.num_preemptions_total == 1


def test_equal_or_higher_priorities_are_never_preempted_for_a_waiting_request():
    sched = priority_scheduler(num_blocks=10, max_num_batched_tokens=64)
    for i in range(2):
        sched.add_request(req(f"run{i}", 15, 8, 3, float(i)))
    executor = FakeExecutor(4)
    step_once(sched, executor)
    equal = req("equal", 10, 4, 3, 5.0)  # same priority, later: waits
    sched.add_request(equal)
    for _ in range(3):
        step_once(sched, executor)
        assert equal.status is SequenceStatus.WAITING and sched.num_preemptions_total == 0


def test_a_full_running_list_gives_its_slot_to_a_higher_priority():
    sched = priority_scheduler(max_num_seqs=2)
    a, b = req("a", 4, 10, 4, 0.0), req("b", 4, 10, 4, 1.0)
    sched.add_request(a)
    sched.add_request(b)
    executor = FakeExecutor(4)
    step_once(sched, executor)
    sched.add_request(req("urgent", 4, 3, 0, 2.0))
    step = step_once(sched, executor)
    assert {s.request_id for s in step.seqs} == {"a", "urgent"}
    assert b.num_preemptions == 1 and a.num_preemptions == 0


def test_high_priorities_finish_first_under_load_with_unchanged_outputs():
    """Long low-priority requests fill the pool, then short high-priority ones come: they
    finish first, and every output (greedy on the stand-in model) is the one a request
    alone gives, whether preempted requests recompute or swap."""
    for mode in ("recompute", "swap"):
        swap = HostBlockPool(64) if mode == "swap" else None
        sched = Scheduler(SchedulerConfig(scheduling_policy="priority", preemption_mode=mode,
                                          max_num_batched_tokens=32), BlockManager(24, 4), swap)
        lows = [req(f"low{i}", 8, 24, 10, float(i)) for i in range(4)]
        for r in lows:
            sched.add_request(r)
        executor = FakeExecutor(4)
        outputs, finish, done = {}, {}, []
        for _ in range(4):
            step_once(sched, executor, outputs, finish)
        highs = [req(f"high{i}", 6, 4, 0, 10.0 + i) for i in range(3)]
        for r in highs:
            sched.add_request(r)
        while sched.has_work:
            before = set(finish)
            step_once(sched, executor, outputs, finish)
            done += sorted(set(finish) - before)
        assert set(done[: len(highs)]) == {r.request_id for r in highs}, done
        assert sched.num_preemptions_total > 0
        for r in lows + highs:
            assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.params.max_tokens), (mode, r)
        assert sched.blocks.num_used_blocks == 0


def test_all_zero_priorities_admit_in_arrival_order_with_fcfs_outputs():
    """The priority policy with every priority 0 admits in arrival order, as fcfs does, and
    gives the same outputs (the running order may differ: re-admitted and forked sequences
    take their rank's place instead of the end)."""
    rng = random.Random(7)
    specs = [(rng.randint(1, 30), rng.randint(1, 12), rng.randint(1, 3)) for _ in range(10)]
    runs = []
    for policy in ("fcfs", "priority"):
        sched = Scheduler(SchedulerConfig(scheduling_policy=policy, max_num_batched_tokens=24), BlockManager(16, 4))
        for i, (plen, out, n) in enumerate(specs):
            r = req(f"q{i}", plen, out, 0, float(i), n=n)
            if sched.check_fits(r) is None:
                sched.add_request(r)
        first_seen = []
        outputs, _ = run_until_done(sched, on_step=lambda _s, step, seen=first_seen: seen.extend(
            s.request_id for s in step.seqs if s.request_id not in seen))
        assert sched.num_preemptions_total > 0
        runs.append((first_seen, outputs))
    assert runs[0] == runs[1]
    assert runs[0][0] == sorted(runs[0][0], key=lambda rid: int(rid[1:]))


def test_schedule_ahead_leaves_a_preemption_for_priority_to_schedule():
    sched = priority_scheduler(num_blocks=10, max_num_batched_tokens=64, max_num_seqs=2)
    low, low2 = req("low", 4, 20, 5, 0.0), req("low2", 4, 20, 5, 1.0)
    sched.add_request(low)
    sched.add_request(low2)
    executor = FakeExecutor(4)
    step_once(sched, executor)
    step, chunks = sched.schedule()
    sched.add_request(req("high", 4, 2, 0, 2.0))  # no slot: one low must give way
    ahead = sched.schedule_ahead(chunks)
    assert ahead is not None and sched.num_preemptions_total == 0  # the step ahead never preempts
    sched.process_results(chunks, executor.execute(step))
    assert sched.schedule_ahead(ahead[1]) is None  # the next step is left to schedule
    sched.process_results(ahead[1], executor.execute(ahead[0]))
    step = step_once(sched, executor)
    assert "high" in [s.request_id for s in step.seqs] and low2.num_preemptions == 1


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(1, 3), st.booleans(), st.integers(-2, 2),
                       st.integers(0, 8)), min_size=1, max_size=8),
    st.sampled_from(["recompute", "swap"]),
    st.integers(8, 40),
)
def test_random_priority_workloads_keep_invariants_and_outputs(specs, mode, num_blocks):
    """Random mixes of priorities, arrivals mid-run, parallel samples and beams on a small
    pool: invariants hold every step (queues in rank order), every request finishes with
    the outputs an unconstrained run gives."""
    def build(sched, arriving: int | None) -> set[str]:
        admitted = set()
        for i, (plen, out, k, beam, prio, at) in enumerate(specs):
            if arriving is not None and at != arriving:
                continue
            r = req(f"q{i}", plen, out, prio, float(at * 100 + i), n=k,
                    **({"use_beam_search": True, "beam_width": k} if beam else {}))
            if sched.check_fits(r) is None:
                sched.add_request(r)
                admitted.add(r.request_id)
        return admitted

    big = Scheduler(SchedulerConfig(scheduling_policy="priority"), BlockManager(10_000, 4))
    build(big, None)
    expected, _ = run_until_done(big)
    swap = HostBlockPool(num_blocks * 2) if mode == "swap" else None
    small = Scheduler(SchedulerConfig(scheduling_policy="priority", preemption_mode=mode, max_num_batched_tokens=24,
                                      max_num_seqs=4), BlockManager(num_blocks, 4), swap)
    admitted = build(small, 0)
    steps = [0]

    def arrive(s, _step):
        steps[0] += 1
        admitted.update(build(s, steps[0]))

    got, _ = run_until_done(small, on_step=arrive)
    while steps[0] < 8:  # those due after the run went idle
        arrive(small, None)
        more, _ = run_until_done(small, on_step=arrive)
        got.update(more)
    check_random_run(small, expected, got, set(), {f"q{i}" for i in range(len(specs))} - admitted)

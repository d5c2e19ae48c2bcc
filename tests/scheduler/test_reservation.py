"""Reservation baselines: sizes per policy, first fit with external fragmentation, the
buddy placement's chunks, the scheduler running on them, and invariants under random
operations (hypothesis; the address spaces alone are in test_address_space)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager
from services.scheduler.reservation import ReservingAllocator, make_allocator, next_pow2
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import SamplingParams
from tests.scheduler.test_scheduler import make, reference_beam_search, reference_output, run_until_done


def req(rid, prompt_len, max_tokens, n=1):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
    return Sequence(rid, [5] * prompt_len, params, frozenset({2}), 0.0)


def admit(alloc, seq):
    assert alloc.allocate_slots(seq, seq.num_prompt_tokens, alloc.get_computed_blocks(seq)) is not None
    seq.num_computed_tokens = seq.num_prompt_tokens


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 338, 512, 513)] == [1, 2, 4, 4, 8, 512, 512, 1024]


def test_reservation_size_per_policy():
    r = req("a", 100, 300)
    sizes = {p: ReservingAllocator(p, 4096, 1, 2048).reservation_tokens(r)
             for p in ("reserve-max", "reserve-pow2", "reserve-oracle")}
    assert sizes == {"reserve-max": 2048, "reserve-pow2": 100 + 512, "reserve-oracle": 400}
    long = req("b", 1500, 540)  # 1500 + 1024 capped at max_model_len
    assert ReservingAllocator("reserve-pow2", 4096, 1, 2048).reservation_tokens(long) == 2048
    whole_pool = ReservingAllocator("reserve-max", 1000, 1, 2048, placement="first-fit")
    assert whole_pool.reservation_tokens(r) == 1000
    assert ReservingAllocator("reserve-max", 1000, 1, 2048).reservation_tokens(r) == 512  # the largest buddy block
    rounded = ReservingAllocator("reserve-oracle", 100, 16, 2048)
    assert rounded.reservation_blocks(r) == 25  # 400 slots = 25 blocks exactly
    assert rounded.reservation_blocks(req("c", 100, 301)) == 26


def test_first_fit_leaves_gaps_a_larger_request_cannot_use():
    alloc = ReservingAllocator("reserve-oracle", 10, 4, 64, placement="first-fit")
    a, b, c = req("a", 8, 4), req("b", 4, 4), req("c", 10, 2)  # 3, 2, 3 blocks
    for s in (a, b, c):
        admit(alloc, s)
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4], [5, 6, 7])
    alloc.free(b)
    assert alloc.gaps() == [(3, 2), (8, 2)] and alloc.num_free_blocks == 4
    big = req("d", 9, 3)  # 3 blocks: 4 are free but no gap holds 3
    assert alloc.allocate_slots(big, 9, []) is None and big.block_table == [] and alloc.num_free_blocks == 4
    small = req("e", 5, 2)  # 2 blocks: the first gap, not the one at the end
    admit(alloc, small)
    assert small.block_table == [3, 4]
    alloc.free(a)
    admit(alloc, big)
    assert big.block_table == [0, 1, 2]
    alloc.check_invariants([big.block_table, small.block_table, c.block_table])


def test_buddy_chunks_are_powers_of_two_and_merge_back():
    alloc = ReservingAllocator("reserve-oracle", 12, 4, 64)  # top blocks of 8 (at 0) and 4 (at 8)
    a, b, c = req("a", 8, 4), req("b", 4, 4), req("c", 17, 3)  # 3, 2, 5 blocks -> chunks of 4, 2, 8
    admit(alloc, a)
    assert a.block_table == [8, 9, 10]  # the smallest free block that fits: no split
    admit(alloc, b)
    assert b.block_table == [0, 1]  # 8 split into 4 + 4, then 2 + 2
    assert alloc.runs() == [(0, 2), (8, 4)] and alloc.gaps() == [(2, 2), (4, 4)]
    alloc.free(a)
    assert alloc.gaps() == [(2, 2), (4, 4), (8, 4)]  # 10 blocks free, no hole of 8
    assert alloc.allocate_slots(c, 17, []) is None and alloc.num_free_blocks == 10
    alloc.free(b)
    assert alloc.gaps() == [(0, 8), (8, 4)]  # 0+2, then 0+4 were buddies; 8's buddy is past the pool
    admit(alloc, c)
    assert c.block_table == [0, 1, 2, 3, 4] and alloc.num_used_blocks == 8
    alloc.check_invariants([c.block_table])


def test_a_request_no_buddy_block_can_hold_never_fits():
    # 12 blocks of 4: the largest buddy block is 8 blocks, 32 slots
    sched = Scheduler(SchedulerConfig(max_model_len=64), ReservingAllocator("reserve-oracle", 12, 4, 64))
    assert sched.check_fits(req("ok", 20, 12)) is None
    problem = sched.check_fits(req("big", 30, 10))
    assert problem is not None and "largest contiguous reservation holds 8" in problem
    first_fit = Scheduler(SchedulerConfig(max_model_len=64),
                          ReservingAllocator("reserve-oracle", 12, 4, 64, placement="first-fit"))
    assert first_fit.check_fits(req("big", 30, 10)) is None


def test_growth_stays_inside_the_reservation():
    alloc = ReservingAllocator("reserve-pow2", 64, 4, 256)
    s = req("a", 6, 3)  # 6 + 4 slots -> 3 blocks, a chunk of 4
    admit(alloc, s)
    assert len(s.block_table) == 3 and alloc.num_used_blocks == 4
    assert alloc.slot_mapping(s, 4, 3) == [s.block_table[0] * 4 + p for p in (4, 5, 6)]
    assert alloc.can_append(s, 6) and not alloc.can_append(s, 7)
    assert alloc.append_slots(s, 6) == [] and alloc.num_used_blocks == 4
    with pytest.raises(RuntimeError):
        alloc.append_slots(s, 7)
    alloc.free(s)
    assert alloc.num_free_blocks == 64 and s.block_table == []


def test_fork_takes_a_run_held_since_admission_and_recomputes():
    alloc = ReservingAllocator("reserve-oracle", 16, 4, 64, placement="first-fit")
    parent = req("p", 8, 4, n=3)
    parent.pending_forks = 2
    admit(alloc, parent)
    assert alloc.num_used_blocks == 9 and alloc.fork_runs(parent) == [3, 3]
    assert alloc.allocate_slots(req("x", 25, 4), 25, []) is None  # 8 blocks; only 7 left
    child = parent.spawn(1)
    alloc.fork(parent, child)
    assert len(child.block_table) == 3 and not set(child.block_table) & set(parent.block_table)
    assert child.num_computed_tokens == 0 and alloc.fork_runs(parent) == [3]
    alloc.check_invariants([parent.block_table, child.block_table])
    alloc.free(parent)  # the run held for the fork that never happened goes too
    assert alloc.num_used_blocks == 3
    alloc.check_invariants([child.block_table])


def test_a_fork_without_room_reserves_at_its_first_step_or_waits():
    alloc = ReservingAllocator("reserve-oracle", 6, 4, 64, placement="first-fit")
    parent = req("p", 8, 4)  # 3 blocks
    admit(alloc, parent)
    other = req("o", 8, 4)
    admit(alloc, other)
    child = parent.spawn(1)
    alloc.fork(parent, child)
    assert child.block_table == [] and child.num_computed_tokens == 0
    assert not alloc.can_append(child, 8)  # the scheduler preempts it back to the queue
    alloc.free(other)
    assert alloc.can_append(child, 8) and alloc.append_slots(child, 8) == []
    assert child.block_table == [3, 4, 5]
    alloc.check_invariants([parent.block_table, child.block_table])


def test_make_allocator():
    assert isinstance(make_allocator("paged", 8, 4, 64), BlockManager)
    assert make_allocator("paged", 8, 4, 64, enable_prefix_caching=False).enable_prefix_caching is False
    assert make_allocator("reserve-max", 8, 4, 64).policy == "reserve-max"
    assert make_allocator("reserve-max", 8, 4, 64).placement == "buddy"
    assert make_allocator("reserve-max", 8, 4, 64, placement="first-fit").placement == "first-fit"
    with pytest.raises(ValueError):
        make_allocator("reserve-half", 8, 4, 64)


@pytest.mark.parametrize("policy", ["reserve-max", "reserve-pow2", "reserve-oracle"])
def test_scheduler_runs_every_request_to_its_length_and_growth_never_preempts(policy):
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_model_len=64),
                      make_allocator(policy, 40, 4, 64))
    reqs = [req(f"r{i}", 3 + 5 * i % 17, 2 + 7 * i % 23) for i in range(12)]
    reqs.append(req("par", 9, 5, n=2))
    for r in reqs:
        assert sched.check_fits(r) is None
        sched.add_request(r)
    outputs: dict[str, int] = {}
    for _ in range(2000):
        scheduled = sched.schedule()
        if scheduled is None:
            break
        _, chunks = scheduled
        for r, _ in sched.process_results(chunks, [7] * len(chunks)):
            outputs[(r.request_id, r.seq_index)] = outputs.get((r.request_id, r.seq_index), 0) + 1
        sched.check_invariants()
    assert not sched.has_work
    # only a forked sample that found no room goes back to the queue
    assert all(r.num_preemptions == 0 for r in reqs[:-1])
    assert outputs == {**{(r.request_id, 0): r.params.max_tokens for r in reqs}, ("par", 1): 5}
    assert sched.blocks.num_free_blocks == 40


@pytest.mark.parametrize("policy", ["reserve-max", "reserve-pow2", "reserve-oracle"])
def test_outputs_read_back_through_reservations_match_the_reference(policy):
    """The fake executor reads every token's KV back through the slots it was given:
    plain requests, parallel samples and beams (which recompute into their own runs)."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_model_len=48),
                      make_allocator(policy, 30, 4, 48))
    plain = [make(f"r{i}", 2 + 5 * i % 13, 3 + 3 * i % 11, ignore_eos=True) for i in range(6)]
    for r in plain:
        sched.add_request(r)
    sched.add_request(make("par", 9, 6, n=3, temperature=0.0, ignore_eos=True))
    beam = make("beam", 9, 8, use_beam_search=True, beam_width=3, n=3)
    beam.eos_token_ids = frozenset({77})
    sched.add_request(beam)
    outputs, _ = run_until_done(sched)
    for r in plain:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.params.max_tokens)
    par = reference_output(make("par", 9, 6).prompt_token_ids, 6)
    assert [outputs[("par", i)] for i in range(3)] == [par] * 3  # the fake model is greedy
    assert [outputs[("beam", i)] for i in range(3)] == reference_beam_search(beam.prompt_token_ids, 3, 8, 77)
    assert sched.blocks.num_used_blocks == 0


# --- invariants under random operations ------------------------------------------------

new_op = st.tuples(st.just("new"), st.integers(1, 30), st.integers(1, 30), st.sampled_from([0, 0, 0, 1, 2]))
ops = st.lists(
    st.one_of(
        new_op,
        new_op,  # twice as likely: a pool that stays busy has gaps to choose between
        st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 8)),
        st.tuples(st.just("fork"), st.integers(0, 50)),
        st.tuples(st.just("free"), st.integers(0, 50)),
    ),
    min_size=10,
    max_size=80,
)


def occupancy(alloc, tables):
    """Which blocks are taken, rebuilt from block tables and held fork runs alone."""
    taken = [False] * alloc.num_blocks
    held = [list(range(s, s + n)) for s, n in alloc.runs() if all(s not in t[:1] for t in tables)]
    for blocks in [*tables, *held]:
        for b in blocks:
            assert not taken[b], f"block {b} is in two reservations"
            taken[b] = True
    return taken


def first_free_run(taken, n):
    run = 0
    for i, t in enumerate(taken):
        run = 0 if t else run + 1
        if run == n:
            return i - n + 1
    return None


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(["reserve-max", "reserve-pow2", "reserve-oracle"]),
       block_size=st.sampled_from([1, 4, 16]), ops=ops)
def test_reservations_never_overlap_and_first_fit_takes_the_lowest_gap(policy, block_size, ops):
    alloc = ReservingAllocator(policy, 256 // block_size, block_size, 96, placement="first-fit")
    live: list[Sequence] = []
    for op in ops:
        tables = [s.block_table for s in live]
        if op[0] == "new":
            _, p, m, forks = op
            s = req(f"s{len(live)}", p, m, n=forks + 1)
            s.pending_forks = forks
            size = alloc.reservation_blocks(s)
            before = occupancy(alloc, tables)
            if alloc.allocate_slots(s, p, []) is not None:
                assert s.block_table[0] == first_free_run(before, size)
                live.append(s)
                held = alloc.fork_runs(s)
                assert held == [size] * len(held) and len(held) <= forks
                if len(held) < forks:  # as many as fitted
                    assert first_free_run(occupancy(alloc, [*tables, s.block_table]), size) is None
            else:
                assert first_free_run(before, size) is None  # refused only when no gap fits
        elif live and op[0] == "grow":
            s = live[op[1] % len(live)]
            n = op[2]
            if s.block_table:
                fits = n <= len(s.block_table) * block_size - s.num_computed_tokens
            else:  # forked without room: reserves now if a gap fits
                size = alloc.reservation_blocks(s)
                fits = n <= size * block_size and first_free_run(occupancy(alloc, tables), size) is not None
            assert alloc.can_append(s, n) == fits
            if fits:
                assert alloc.append_slots(s, n) == []
                s.num_computed_tokens += n
        elif live and op[0] == "fork":
            parent = live[op[1] % len(live)]
            held = alloc.fork_runs(parent)
            child = parent.spawn(1)
            room = first_free_run(occupancy(alloc, tables), alloc.reservation_blocks(parent)) is not None
            alloc.fork(parent, child)
            assert bool(child.block_table) == bool(parent.block_table and (held or room))
            live.append(child)
        elif live and op[0] == "free":
            alloc.free(live.pop(op[1] % len(live)))
        tables = [s.block_table for s in live]
        alloc.check_invariants(tables)
        taken = occupancy(alloc, tables)
        assert sum(taken) == alloc.num_used_blocks
        assert alloc.num_used_blocks + alloc.num_free_blocks == alloc.num_blocks
        assert sum(n for _, n in alloc.gaps()) == alloc.num_free_blocks
        for s in filter(lambda s: s.block_table, live):
            assert s.block_table == list(range(s.block_table[0], s.block_table[0] + len(s.block_table)))
    for s in live:
        alloc.free(s)
    assert alloc.num_free_blocks == alloc.num_blocks and alloc.gaps() == [(0, alloc.num_blocks)]

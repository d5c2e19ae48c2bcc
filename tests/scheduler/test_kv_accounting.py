"""KV pool accounting: hand-checked splits for the paged pool and for first-fit and buddy
reservations, and every slot in exactly one category while a scheduler runs."""

import random

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_accounting import KVUsage, kv_usage
from services.scheduler.reservation import ReservingAllocator, make_allocator
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import SamplingParams


def req(rid, prompt, max_tokens, n=1):
    prompt = [5] * prompt if isinstance(prompt, int) else prompt
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n), frozenset({2}), 0.0)


def step(sched):
    _, chunks = sched.schedule()
    return sched.process_results(chunks, [7] * len(chunks))


def split(u: KVUsage):
    return (u.token_states, u.reserved, u.internal_frag, u.external_frag, u.free)


def test_paged_split_follows_a_sequence_block_by_block():
    sched = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(10, 4, enable_prefix_caching=False))
    sched.add_request(req("a", 6, 5))  # final length 11: positions 0..10, last block holds 8..11
    seen = []
    for _ in range(4):
        step(sched)
        seen.append(split(kv_usage(sched)))
    assert seen == [
        (6, 2, 0, 0, 32),  # 2 blocks: positions 6, 7 will be filled
        (7, 1, 0, 0, 32),
        (8, 0, 0, 0, 32),
        (9, 2, 1, 0, 28),  # third block: 9, 10 to come, 11 never used
    ]
    step(sched)
    assert split(kv_usage(sched)) == (0, 0, 0, 0, 40)


def test_paged_blocks_shared_by_forks_count_once():
    sched = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(10, 4, enable_prefix_caching=False))
    sched.add_request(req("p", 9, 3, n=2))  # the parent computes 8 tokens, then both share 2 blocks
    step(sched)
    assert len(sched.running) == 2
    assert split(kv_usage(sched)) == (8, 0, 0, 0, 32)
    assert sched.blocks.num_free_blocks == 8


def test_reservation_gaps_too_small_for_the_head_of_the_queue_are_external_fragmentation():
    sched = Scheduler(SchedulerConfig(max_model_len=64),
                      ReservingAllocator("reserve-oracle", 10, 4, 64, placement="first-fit"))
    a, b, c, d = req("a", 8, 4), req("b", 6, 2), req("c", 8, 4), req("d", 9, 3)  # 3, 2, 3, 3 blocks
    for r in (a, b, c, d):
        sched.add_request(r)
    step(sched)
    assert [r.request_id for r in sched.running] == ["a", "b", "c"] and list(sched.waiting) == [d]
    # only the 2-block tail is free; d needs 3
    assert split(kv_usage(sched)) == (8 + 6 + 8, 4 + 2 + 4, 0, 8, 0)
    step(sched)  # b finishes: gaps of 2 blocks at 3 and at 8, 4 blocks free, none holds d
    assert b.is_finished and sched.blocks.num_free_blocks == 4
    assert split(kv_usage(sched)) == (9 + 9, 3 + 3, 0, 16, 0)
    sched.waiting.appendleft(req("e", 3, 1))  # a 1-block head fits either gap
    assert split(kv_usage(sched)) == (18, 6, 0, 0, 16)


@pytest.mark.parametrize("policy, internal", [("reserve-max", 32 - 12), ("reserve-pow2", 8 + 4 - 11)])
def test_over_reservation_is_internal_fragmentation(policy, internal):
    alloc = ReservingAllocator(policy, 8, 4, 32, placement="first-fit")
    sched = Scheduler(SchedulerConfig(max_model_len=32), alloc)
    sched.add_request(req("a", 8, 4 if policy == "reserve-max" else 3))
    step(sched)
    u = kv_usage(sched)
    assert (u.token_states, u.internal_frag, u.external_frag) == (8, internal, 0)
    assert u.token_states + u.reserved + u.internal_frag == sched.blocks.num_used_blocks * 4


def test_buddy_rounding_is_external_and_over_reservation_internal():
    # pow2: 9 + next_pow2(3) = 13 slots -> 4 blocks of 4 (3 slots of block rounding), and
    # the buddy chunk of 4 blocks is already a power of two; oracle: 12 slots -> 3 blocks -> 4
    for policy, internal, rounding in (("reserve-pow2", 13 - 12, 16 - 13), ("reserve-oracle", 0, 16 - 12)):
        sched = Scheduler(SchedulerConfig(max_model_len=32), ReservingAllocator(policy, 8, 4, 32))
        sched.add_request(req("a", 9, 3))
        step(sched)
        u = kv_usage(sched)
        assert split(u) == (9, 3, internal, rounding, 16), policy
    # the waiting head's chunk is 8 blocks: the free block of 4 is too small, all of it external
    sched = Scheduler(SchedulerConfig(max_model_len=32), ReservingAllocator("reserve-oracle", 8, 4, 32))
    sched.add_request(req("a", 9, 3))
    step(sched)
    sched.waiting.append(req("b", 20, 8))
    assert split(kv_usage(sched)) == (9, 3, 0, 4 + 16, 0)


def test_shares_are_of_the_memory_in_use():
    u = KVUsage(token_states=30, reserved=10, internal_frag=5, external_frag=5, free=50)
    assert (u.token_state_share, u.reserved_share, u.internal_frag_share, u.external_frag_share) == (
        0.6, 0.2, 0.1, 0.1)
    assert u.free_share == 0.5 and u.total == 100 and u.in_use == 50
    empty = KVUsage(0, 0, 0, 0, 64)
    assert empty.token_state_share == 0.0 and empty.free_share == 1.0


@pytest.mark.parametrize("policy", ["paged", "reserve-max", "reserve-pow2", "reserve-oracle"])
def test_every_slot_is_in_one_category_at_every_step(policy):
    rng = random.Random(policy)
    bs, num_blocks, max_len = 4, 48, 96
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=40, max_model_len=max_len),
                      make_allocator(policy, num_blocks, bs, max_len))  # prefix caching on for paged
    shared_prefix = [rng.randrange(3, 50) for _ in range(12)]
    for i in range(30):
        prompt = [rng.randrange(3, 50) for _ in range(rng.randint(1, 40))]
        if i % 3 == 0:
            prompt = shared_prefix + prompt
        sched.add_request(req(f"r{i}", prompt, rng.randint(1, 40), n=rng.choice([1, 1, 2])))
    steps = 0
    while sched.has_work:
        step(sched)
        steps += 1
        u = kv_usage(sched)
        assert min(split(u)) >= 0 and u.total == num_blocks * bs
        held = sched.blocks.num_used_blocks * bs
        if policy == "paged":
            assert u.token_states + u.reserved + u.internal_frag == held
            assert u.external_frag == 0
        else:  # the allocator's rounding of held chunks is external
            assert u.token_states + u.reserved + u.internal_frag <= held
            assert u.free <= num_blocks * bs - held
        assert u.total == num_blocks * bs
        assert u.token_states <= sum(r.num_computed_tokens for r in sched.running)
    assert steps > 30 and kv_usage(sched).free == num_blocks * bs

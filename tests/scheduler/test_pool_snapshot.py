"""The dashboard's pool snapshot: packed block states, owners, reference counts and fill
match real BlockManager / ReservingAllocator / HostBlockPool objects driven by the real
Scheduler (shared, cached-unreferenced, swapped, free, reserved), and a subscription
lapses unless renewed."""

from __future__ import annotations

import msgspec

from services.scheduler.block_manager import BlockManager
from services.scheduler.host_block_pool import HostBlockPool
from services.scheduler.kv_accounting import kv_usage
from services.scheduler.pool_snapshot import pool_snapshot, unpack
from services.scheduler.pool_watch import MAX_TTL_S, MIN_INTERVAL_S, PoolWatch
from services.scheduler.reservation import ReservingAllocator
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.messages import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_OWNED,
    BLOCK_RESERVED,
    BLOCK_SHARED,
    BLOCK_STATES,
    BLOCK_SWAPPED,
    PoolSnapshot,
    StatusToGateway,
    WatchPool,
)
from tests.scheduler.test_scheduler import FakeExecutor, make, run_until_done


def decoded(snap: PoolSnapshot) -> dict[str, list[int]]:
    return {"states": list(snap.states), "owners": unpack("I", snap.owners), "refs": unpack("H", snap.ref_counts),
            "fill": unpack("H", snap.fill), "swap_states": list(snap.swap_states),
            "swap_owners": unpack("I", snap.swap_owners)}


def check_matches(snap: PoolSnapshot, sched: Scheduler) -> dict[str, list[int]]:
    """Every packed entry against the scheduler's own objects; returns the decoded arrays."""
    d = decoded(snap)
    bm, bs, n = sched.blocks, sched.blocks.block_size, sched.blocks.num_blocks
    assert len(d["states"]) == len(d["owners"]) == len(d["refs"]) == len(d["fill"]) == n == snap.num_blocks
    seqs = [*sched.running, *sched.waiting]
    assert [(r.request_id, r.seq_index, r.block_table) for r in snap.rows] == [
        (s.request_id, s.seq_index, s.block_table) for s in seqs]
    holders: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        for b in s.block_table:
            holders.setdefault(b, []).append(i)
    cached = set(bm.cached_unreferenced()) if isinstance(bm, BlockManager) else set()
    for b in range(n):
        refs = bm.ref_counts[b] if isinstance(bm, BlockManager) else len(holders.get(b, []))
        assert d["refs"][b] == refs == len(holders.get(b, [])), b
        if refs > 1:
            want = BLOCK_SHARED
        elif refs == 1:
            want = BLOCK_OWNED
        elif b in cached:
            want = BLOCK_CACHED
        else:
            want = d["states"][b] if d["states"][b] == BLOCK_RESERVED else BLOCK_FREE
        assert d["states"][b] == want, (b, BLOCK_STATES[d["states"][b]], BLOCK_STATES[want])
        assert d["owners"][b] == (holders[b][0] + 1 if b in holders else 0), b
        if b in holders:
            assert d["fill"][b] == max(min(max(seqs[i].num_computed_tokens - seqs[i].block_table.index(b) * bs, 0), bs)
                                       for i in holders[b])
    swapped = {h: i for i, s in enumerate(seqs) for h in s.swapped_blocks}
    num_swap = sched.swap.num_blocks if sched.swap else 0
    assert len(d["swap_states"]) == len(d["swap_owners"]) == num_swap == snap.num_swap_blocks
    for h in range(num_swap):
        assert d["swap_states"][h] == (BLOCK_SWAPPED if h in swapped else BLOCK_FREE), h
        assert d["swap_owners"][h] == (swapped[h] + 1 if h in swapped else 0), h
    usage = kv_usage(sched)
    assert (snap.kv_slots_token_states, snap.kv_slots_reserved, snap.kv_slots_internal_frag,
            snap.kv_slots_external_frag, snap.kv_slots_free) == (
        usage.token_states, usage.reserved, usage.internal_frag, usage.external_frag, usage.free)
    assert sum((snap.kv_slots_token_states, snap.kv_slots_reserved, snap.kv_slots_internal_frag,
                snap.kv_slots_external_frag, snap.kv_slots_free)) == n * bs
    # what goes over the socket comes back whole
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=StatusToGateway) == snap
    return d


def snapshot(sched: Scheduler, policy: str = "paged") -> PoolSnapshot:
    return pool_snapshot(sched, "scheduler", "test", policy)


def test_a_fresh_pool_is_free():
    sched = Scheduler(SchedulerConfig(), BlockManager(32, 4))
    d = check_matches(snapshot(sched), sched)
    assert set(d["states"]) == {BLOCK_FREE} and not any(d["owners"]) and not any(d["fill"])


def test_parallel_samples_share_their_prompt_blocks_then_leave_them_cached():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("par", 10, 12, n=3, temperature=1.0, seed=1, ignore_eos=True))
    sched.add_request(make("solo", 6, 12, ignore_eos=True))
    seen = []
    executor = FakeExecutor(4)

    def on_step(s, _step):
        d = check_matches(snapshot(s), s)
        seen.append(d["states"].count(BLOCK_SHARED))

    run_until_done(sched, until=lambda s: s.num_steps_total > 0 and len(s.running) == 4 and seen and seen[-1] >= 2
                   and all(r.num_output_tokens >= 2 for r in s.running), on_step=on_step, executor=executor)
    snap = snapshot(sched)
    d = check_matches(snap, sched)
    par_rows = [i for i, r in enumerate(snap.rows) if r.request_id == "par"]
    assert len(par_rows) == 3 and all(snap.rows[i].status == "running" for i in par_rows)
    shared = [b for b, s in enumerate(d["states"]) if s == BLOCK_SHARED]
    # the 10-token prompt's two full blocks, held by all three samples, named by the first
    assert len(shared) >= 2 and all(d["refs"][b] == 3 and d["fill"][b] == 4 for b in shared)
    assert {d["owners"][b] - 1 for b in shared} == {par_rows[0]}

    run_until_done(sched, on_step=on_step, executor=executor)
    d = check_matches(snapshot(sched), sched)
    assert BLOCK_OWNED not in d["states"] and BLOCK_SHARED not in d["states"]
    assert d["states"].count(BLOCK_CACHED) == sched.blocks.num_cached_blocks > 0
    assert snapshot(sched).rows == []


def test_swapped_out_sequences_fill_the_swap_space():
    sched = Scheduler(SchedulerConfig(preemption_mode="swap"), BlockManager(12, 4, enable_prefix_caching=False),
                      HostBlockPool(40))
    for i in range(4):
        sched.add_request(make(f"s{i}", 8, 12))
    found = []

    def on_step(s, _step):
        snap = snapshot(s)
        check_matches(snap, s)
        if any(r.status == "swapped" for r in snap.rows):
            found.append(snap)

    run_until_done(sched, on_step=on_step)
    assert found, "no sequence was ever swapped out"
    snap = found[0]
    d = decoded(snap)
    row = next(i for i, r in enumerate(snap.rows) if r.status == "swapped")
    assert snap.num_swapped >= 1 and snap.rows[row].block_table == []
    assert [h for h, o in enumerate(d["swap_owners"]) if o == row + 1] == snap.rows[row].swapped_blocks
    assert all(d["swap_states"][h] == BLOCK_SWAPPED for h in snap.rows[row].swapped_blocks)
    assert snap.num_preemptions_total >= 1 and snap.num_swapped_out_total >= 1


def test_reservation_baseline_shows_whole_runs_and_runs_held_for_forks():
    alloc = ReservingAllocator("reserve-max", 64, 4, 32)
    sched = Scheduler(SchedulerConfig(max_model_len=32), alloc)
    sched.add_request(make("a", 6, 8, ignore_eos=True))
    sched.add_request(make("b", 5, 8, n=2, seed=3, ignore_eos=True))
    step, chunks = sched.schedule()  # admits both: b's fork has a run held, not started
    snap = snapshot(sched, "reserve-max")
    d = check_matches(snap, sched)
    assert d["states"].count(BLOCK_OWNED) == 16 and d["states"].count(BLOCK_RESERVED) == 8
    assert snap.kv_policy == "reserve-max" and snap.kv_slots_internal_frag > 0


def test_ten_thousand_blocks_pack_small():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=1 << 16), BlockManager(10_000, 16))
    for i in range(200):
        sched.add_request(make(f"r{i}", 200, 16))
    sched.schedule()
    snap = snapshot(sched)
    check_matches(snap, sched)
    per_block = len(snap.states) + len(snap.owners) + len(snap.ref_counts) + len(snap.fill)
    assert per_block == 9 * 10_000
    assert len(msgspec.msgpack.encode(snap)) < per_block + 200 * 250  # a row: 13 blocks, named fields


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_subscription_lapses_unless_renewed():
    clock = Clock()
    watch = PoolWatch(clock)
    assert not watch.due() and not watch.active  # nobody asked: nothing is sent
    watch.renew(WatchPool(interval_s=0.25, ttl_s=1.0))
    sent = 0
    for _ in range(40):  # 2 s in steps of 50 ms
        sent += watch.due()
        clock.t += 0.05
    assert sent == 4 and not watch.active  # every 0.25 s for 1 s, then silence
    watch.renew(WatchPool(interval_s=0.25, ttl_s=1.0))
    assert watch.due() and not watch.due()


def test_a_hostile_subscription_is_clamped():
    clock = Clock()
    watch = PoolWatch(clock)
    watch.renew(WatchPool(interval_s=0.0, ttl_s=1e12))
    assert watch.interval_s == MIN_INTERVAL_S and watch.until == clock.t + MAX_TTL_S
    watch.renew(WatchPool(interval_s=float("nan"), ttl_s=float("inf")))
    assert watch.interval_s == WatchPool().interval_s and not watch.active

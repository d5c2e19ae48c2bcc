"""LoRA adapters in the scheduler: at most max_loras distinct adapters a step, a request whose
adapter finds no slot waits without holding up those behind it, slots are named to the
executor every step, and the prefix cache keys blocks by adapter."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager
from services.scheduler.lora_slots import LoraSlotTable
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import LoraAdapter, SamplingParams

EOS = 2


def adapter(i: int) -> LoraAdapter:
    return LoraAdapter(f"lora{i}", f"/adapters/{i}", f"{i:064x}")


def make(rid: str, prompt: list[int], max_tokens: int, lora: LoraAdapter | None) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, lora=lora), frozenset({EOS}), 0.0)


def run_step(sched: Scheduler):
    built = sched.schedule()
    assert built is not None
    step, chunks = built
    adapters = {c.sequence.params.lora.digest for c in chunks if c.sequence.params.lora is not None}
    assert len(adapters) <= len(sched.loras.slots)
    named = dict(step.lora_slots)
    for seq, chunk in zip(step.seqs, chunks, strict=True):
        lora = chunk.sequence.params.lora
        assert (seq.lora_slot == -1) == (lora is None)
        if lora is not None:
            assert named[seq.lora_slot] == lora
    sched.process_results(chunks, [7 if c.samples else -1 for c in chunks])
    sched.check_invariants()
    return step, chunks


def test_an_adapter_without_a_slot_waits_without_blocking_others():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_loras=2), BlockManager(64, 4))
    for rid, lora in [("a", adapter(0)), ("b", adapter(1)), ("c", adapter(2)), ("d", None), ("e", adapter(0))]:
        sched.add_request(make(rid, [5, 6, 7], 3, lora))
    _, chunks = run_step(sched)
    assert sorted(c.sequence.request_id for c in chunks) == ["a", "b", "d", "e"]
    assert sched.stats().lora_waiting == {"lora2": 1}
    assert sched.stats().lora_running == {"lora0": 2, "lora1": 1}
    while sched.has_work:
        run_step(sched)
    assert not sched.waiting


def test_prefix_cache_keys_blocks_by_adapter():
    sched = Scheduler(SchedulerConfig(max_loras=2), BlockManager(64, 4))
    prompt = list(range(10, 30))
    sched.add_request(make("base", prompt, 1, None))
    while sched.has_work:
        run_step(sched)
    for rid, lora in [("x", adapter(0)), ("y", adapter(0)), ("z", None)]:
        sched.add_request(make(rid, prompt, 1, lora))
        while sched.has_work:
            run_step(sched)
    # x misses (other KV than the base's), y hits x's blocks, z hits the base's
    assert sched.blocks.prefix_cache_hits == 2 * 16


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 5), st.integers(1, 12), st.integers(1, 6)), min_size=1, max_size=20),
       st.integers(1, 4))
def test_any_mix_finishes_within_the_slot_bound(requests, max_loras):
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, max_loras=max_loras),
                      BlockManager(96, 4))
    rng = random.Random(len(requests))
    for i, (lora, prompt_len, max_tokens) in enumerate(requests):
        prompt = [rng.randrange(3, 50) for _ in range(prompt_len)]
        sched.add_request(make(f"r{i}", prompt, max_tokens, None if lora < 0 else adapter(lora)))
    for _ in range(500):
        if not sched.has_work:
            break
        run_step(sched)
    assert not sched.has_work


def test_slot_table_evicts_the_least_recently_used_unpinned():
    table = LoraSlotTable(2)
    assert table.assign(adapter(0), set()) == 0
    assert table.assign(adapter(1), set()) == 1
    assert table.assign(adapter(0), set()) == 0  # 0 used last: 1 is the LRU
    assert table.assign(adapter(2), {adapter(0).digest, adapter(1).digest}) is None
    assert table.assign(adapter(2), {adapter(0).digest}) == 1
    table.check_invariants([adapter(0), adapter(2)])

"""The scheduler stage when the executor's pool changes under it or a step fails before its
swaps run: a real `SchedulerService` loop (tests/scheduler/test_scheduler_service.py's `Stage`) against
an executor stand-in that keeps, per KV slot, the token whose KV it holds. Its sampled token
depends on every token before the position, read back through the slots, so KV that was never
written (a swap-in of host blocks a failed step never filled) shows as an error; a step naming
a block past its pool fails, as the real executor's would."""

from __future__ import annotations

import pytest

from shared.messages import (
    PREVIOUS_TOKEN,
    ExecuteStep,
    ExecutorReady,
    RequestError,
    SamplingParams,
    StepFailed,
    StepResult,
    TokenizedRequest,
)
from tests.scheduler.test_scheduler import move_blocks
from tests.scheduler.test_scheduler_service import Stage, ended, steps_sent


def next_token(seen: list[int]) -> int:
    return (sum(seen) * 31 + len(seen)) % 97 + 3  # never the EOS (2)


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    seen, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(seen))
        seen.append(out[-1])
    return out


class KVExecutor:
    """Answers a stage's steps from the KV it holds: device slots and host slots -> token."""

    def __init__(self, stage: Stage, num_blocks: int, block_size: int = 4, num_host_blocks: int = 0):
        self.stage = stage
        self.resize(num_blocks, block_size, num_host_blocks)
        self.fail_swapping_steps = 0  # this many steps that swap out fail, before their swaps run
        self.failed_swaps = 0
        self.failed_swap_rids: set[str] = set()  # the requests of the steps failed so
        self.garbage_reads: set[str] = set()  # requests whose step read KV never written

    def resize(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        """A new executor instance: its pool is empty."""
        self.num_blocks, self.bs, self.num_host = num_blocks, block_size, num_host_blocks
        self.pool: dict[int, int] = {}
        self.host: dict[int, int] = {}
        self.last: dict[tuple[str, int], int] = {}  # (request, seq) -> token sampled last

    def _problem(self, step: ExecuteStep) -> str | None:
        device = [b for s in step.seqs for b in s.block_table] + [b for pair in step.block_copies for b in pair]
        device += [d for d, _ in step.swap_out] + [d for _, d in step.swap_in]
        host = [h for _, h in step.swap_out] + [h for h, _ in step.swap_in]
        if any(not 0 <= b < self.num_blocks for b in device) or any(not 0 <= h < self.num_host for h in host):
            return "block index out of range"
        if step.swap_out and self.fail_swapping_steps:
            self.fail_swapping_steps -= 1
            self.failed_swaps += 1
            self.failed_swap_rids |= {s.request_id for s in step.seqs}
            return "failed before its swaps"
        return None

    def answer(self, step: ExecuteStep):
        problem = self._problem(step)
        if problem is not None:
            return StepFailed(step.step_id, problem)
        bs = self.bs
        move_blocks(step, self.pool, self.host, bs)
        sampled = []
        for seq in step.seqs:
            key = (seq.request_id, seq.seq_index)
            if PREVIOUS_TOKEN in seq.token_ids and key not in self.last:
                return StepFailed(step.step_id, "no previous token")  # a step of the instance before
            tokens = [self.last[key] if t == PREVIOUS_TOKEN else t for t in seq.token_ids]
            for slot, gw in zip(seq.slot_mapping, tokens, strict=True):
                self.pool[slot] = gw
            end = seq.start_pos + len(tokens)
            slots = [seq.block_table[p // bs] * bs + p % bs for p in range(end)]
            if any(slot not in self.pool for slot in slots):
                self.garbage_reads.add(seq.request_id)
                return StepFailed(step.step_id, "read KV that was never written")
            sampled.append(next_token([self.pool[slot] for slot in slots]) if seq.sample else -1)
            if seq.sample:
                self.last[key] = sampled[-1]
        return StepResult(step.step_id, sampled, 0.001)

    def serve(self) -> None:
        for step in self.stage.executor_in.recv_nowait():
            if isinstance(step, ExecuteStep):
                self.stage.executor_out.send(self.answer(step))


def request(rid: str, prompt_len: int, max_tokens: int) -> TokenizedRequest:
    prompt = [(sum(map(ord, rid)) + 7 * i) % 90 + 3 for i in range(prompt_len)]
    return TokenizedRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), [2], 0.0)


def play(stage: Stage, executor: KVExecutor, gw, rids, until=None, timeout_s: float = 20.0) -> dict:
    """Run the executor until every request in rids ended (or until(replies))."""
    stage.execute = executor.serve
    return stage.run_until(until or (lambda r: all(ended(r.get(rid, [])) for rid in rids)), gw,
                           timeout_s=timeout_s)


def tokens_of(msgs: list) -> list[int]:
    return [t for m in msgs if not isinstance(m, RequestError) for t in m.token_ids]


@pytest.mark.parametrize("new_pool", [(12, 4), (24, 8), (200, 4)], ids=["fewer-blocks", "larger-blocks", "more"])
def test_an_executor_back_with_another_pool_serves_every_request_on_it(new_pool):
    """The executor restarts mid-generation with another pool: the block manager is rebuilt
    for it, no later step names a block past it, every request that fits it completes with
    the output it would have had, and one that can never fit it ends with a clear 503."""
    stage = Stage(num_kv_blocks=64)
    try:
        executor = KVExecutor(stage, 64)
        gw = stage.gateway("t0")
        reqs = {f"r{i}": request(f"r{i}", 6 + i, 10) for i in range(4)}
        reqs["long"] = request("long", 8, 60)  # 68 tokens: 17 blocks of 4, 9 of 8
        for r in reqs.values():
            gw.send(r)
        play(stage, executor, gw, [], until=lambda r: sum(len(tokens_of(m)) for m in r.values()) >= 8)
        steps_sent(stage, 0.3)  # the executor dies with the steps in flight unanswered
        blocks, block_size = new_pool
        executor.resize(blocks, block_size)
        stage.executor_out.send(ExecutorReady("test-executor", blocks, block_size, 256, instance="second"))
        replies = play(stage, executor, gw, list(reqs))
        fits = blocks * block_size >= 68
        for rid, r in reqs.items():
            if rid == "long" and not fits:
                err = replies[rid][-1]
                assert isinstance(err, RequestError) and err.status == 503, replies[rid]
                assert "KV" in err.message and str(blocks) in err.message, err.message
            else:
                assert tokens_of(replies[rid]) == reference(list(r.prompt_token_ids), r.params.max_tokens), rid
                assert replies[rid][-1].finish_reason == "length"
        sched = stage.service.scheduler
        assert (sched.blocks.num_blocks, sched.blocks.block_size) == new_pool
        assert not executor.garbage_reads
        assert not sched.groups and sched.blocks.num_used_blocks == 0
    finally:
        stage.close()


def test_an_executor_reporting_no_pool_is_refused_and_its_successor_serves():
    stage = Stage(num_kv_blocks=64)
    try:
        executor = KVExecutor(stage, 64)
        gw = stage.gateway("t0")
        stage.executor_out.send(ExecutorReady("broken", 0, 4, 256, instance="broken"))
        gw.send(request("a", 6, 5))
        play(stage, executor, gw, [], until=lambda r: stage.service.executor_lost is not None)
        assert stage.thread.is_alive() and stage.service.scheduler.blocks.num_blocks == 64
        executor.resize(32, 4)
        stage.executor_out.send(ExecutorReady("fixed", 32, 4, 256, instance="fixed"))
        replies = play(stage, executor, gw, ["a"])
        assert tokens_of(replies["a"]) == reference(list(request("a", 6, 5).prompt_token_ids), 5)
    finally:
        stage.close()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_the_swap_outs_of_a_failed_step_are_recomputed_not_swapped_in(async_scheduling):
    """A step that swaps a request out fails before its swaps run: the host blocks it was
    to fill stay empty. That request is recomputed (never swapped back in from them) and
    ends with its true output; only the step's own requests get the error."""
    argv = ("--preemption-mode", "swap", "--no-prefix-caching", *(() if async_scheduling else ("--no-async-scheduling",)))
    stage = Stage(num_kv_blocks=10, num_swap_blocks=40, argv=argv)
    try:
        executor = KVExecutor(stage, 10, num_host_blocks=40)
        executor.fail_swapping_steps = 1
        gw = stage.gateway("t0")
        reqs = {f"s{i}": request(f"s{i}", 6, 16) for i in range(3)}  # 22 tokens, 6 blocks each; 10 in the pool
        for r in reqs.values():
            gw.send(r)
        replies = play(stage, executor, gw, list(reqs))
        sched = stage.service.scheduler
        assert sched.num_swapped_out_total > 0, (sched.num_preemptions_total, sched.swap)
        assert executor.failed_swaps == 1
        # the failed step's requests end with an error (a step sent ahead of its result reads the KV
        # it did not write: they are over by then), not the request it swapped out
        errors = {rid for rid, msgs in replies.items() if isinstance(msgs[-1], RequestError)}
        assert errors == executor.failed_swap_rids and len(errors) < len(reqs), errors
        assert executor.garbage_reads <= errors
        for rid in set(reqs) - errors:
            assert tokens_of(replies[rid]) == reference(list(reqs[rid].prompt_token_ids), 16), rid
        sched = stage.service.scheduler
        assert sched.swap.num_free_blocks == 40 and not sched.groups
    finally:
        stage.close()


def test_replace_pool_keeps_the_scheduler_consistent_and_outputs_unchanged():
    """Scheduler level: halfway through, the pool becomes another (fewer blocks, another block
    size, swap space); invariants hold every step and every request that fits gives the output
    of an undisturbed run."""
    from services.scheduler.block_manager import BlockManager
    from services.scheduler.host_block_pool import HostBlockPool
    from services.scheduler.scheduler import Scheduler, SchedulerConfig
    from tests.scheduler.test_scheduler import FakeExecutor, make, run_until_done

    def build(sched):
        for i in range(6):
            sched.add_request(make(f"q{i}", 5 + 3 * i, 40 if i == 5 else 12, n=2 if i == 2 else 1))

    big = Scheduler(SchedulerConfig(), BlockManager(1000, 4))
    build(big)
    expected, _ = run_until_done(big)
    sched = Scheduler(SchedulerConfig(preemption_mode="swap"), BlockManager(64, 4), HostBlockPool(64))
    build(sched)
    got, _ = run_until_done(sched, until=lambda s: s.num_steps_total == 6)
    ended = sched.replace_pool(BlockManager(7, 8), HostBlockPool(20), SchedulerConfig(preemption_mode="swap"))
    sched.check_invariants()
    assert {r.request_id for r, _ in ended} == {"q5"}  # 20 + 40 tokens: 8 blocks of 8; the pool holds 7
    more, _ = run_until_done(sched, executor=FakeExecutor(8))
    for key, tokens in more.items():
        got.setdefault(key, []).extend(tokens)
    assert {k: v for k, v in got.items() if k != "q5"} == {k: v for k, v in expected.items() if k != "q5"}
    assert sched.num_swapped_out_total > 0  # the new pool was tight: it swapped, and back
    assert not sched.groups and sched.blocks.num_used_blocks == 0 and sched.swap.num_free_blocks == 20

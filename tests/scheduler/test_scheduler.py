"""Scheduler logic with a model-free executor: batching, chunking, preemption, stops."""

import math
import random
import statistics
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.beam_search import beam_score
from services.scheduler.block_manager import BlockManager
from services.scheduler.host_block_pool import HostBlockPool
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import FailedRow, SamplingParams

EOS = 2


def make(rid, prompt_len, max_tokens, **params):
    prompt = [random.Random(rid).randrange(3, 100) for _ in range(prompt_len)]
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), frozenset({EOS}), 0.0)



def move_blocks(step, pool: dict, host: dict, bs: int) -> None:
    """A step's swaps and copy-on-write copies on slot -> token maps of the device pool and
    the host, as the executor moves KV (swap-outs first, then swap-ins, then copies)."""
    for pairs, src_pool, dst_pool in ((step.swap_out, pool, host), (step.swap_in, host, pool)):
        for src, dst in pairs:
            for off in range(bs):
                dst_pool.pop(dst * bs + off, None)
                if src * bs + off in src_pool:
                    dst_pool[dst * bs + off] = src_pool[src * bs + off]
    for src, dst in step.block_copies:
        for off in range(bs):
            if src * bs + off in pool:
                pool[dst * bs + off] = pool[src * bs + off]

class FakeExecutor:
    """A model stand-in that reads tokens back through the slots it is given, so a wrong
    block table, slot mapping or missing block copy shows up as a wrong output."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.pool: dict[int, int] = {}  # slot -> token whose KV it holds
        self.host: dict[int, int] = {}  # host swap slot -> token
        self.top_logprobs: list = []  # of the last step

    def execute(self, step) -> list[int]:
        bs = self.bs
        self.top_logprobs = []
        move_blocks(step, self.pool, self.host, bs)
        sampled = []
        for seq in step.seqs:
            assert len(seq.slot_mapping) == len(seq.token_ids)
            for slot, tok in zip(seq.slot_mapping, seq.token_ids, strict=True):
                self.pool[slot] = tok
            end = seq.start_pos + len(seq.token_ids)
            seen = [self.pool[seq.block_table[p // bs] * bs + p % bs] for p in range(end)]
            sampled.append(next_token_from(seen) if seq.sample else -1)
            if seq.sample and seq.num_logprobs:
                self.top_logprobs.append(candidates_from(seen, seq.num_logprobs))
        return sampled


def run_until_done(sched: Scheduler, max_steps=3_000, on_step=None, executor=None, until=None):
    """Run steps until nothing is left (or `until(sched)`); outputs are keyed by request
    id, or (id, seq_index) for n > 1."""
    executor = executor or FakeExecutor(sched.blocks.block_size)
    outputs: dict = {}
    finish: dict = {}
    for _ in range(max_steps):
        if until and until(sched):
            break
        scheduled = sched.schedule()
        if scheduled is None:
            break
        step, chunks = scheduled
        apply_result(sched, chunks, executor.execute(step), executor.top_logprobs, outputs, finish)
        sched.check_invariants()
        if on_step:
            on_step(sched, step)
    else:
        raise AssertionError(f"no end after {max_steps} steps: {len(sched.running)} running, {len(sched.waiting)} waiting")
    return outputs, finish


def apply_result(sched: Scheduler, chunks, sampled: list[int], top_logprobs, outputs: dict, finish: dict) -> None:
    """Apply a step's result; its deltas' tokens and finish reasons go into outputs and finish,
    keyed by request id, or (id, seq_index) for n > 1. No sequence gets tokens after its end."""
    for req, delta in sched.process_results(chunks, sampled, top_logprobs):
        key = req.request_id if req.params.n == 1 else (req.request_id, delta.seq_index)
        assert key not in finish, f"{key} got tokens after it finished"
        outputs.setdefault(key, []).extend(delta.token_ids)
        if delta.finish_reason:
            finish[key] = delta.finish_reason


def next_token_from(seen: list[int]) -> int:
    """A model stand-in: the next token depends only on the sequence's tokens so far."""
    return (sum(seen) * 31 + len(seen)) % 97 + 3


def candidates_from(seen: list[int], k: int) -> list[tuple[int, float]]:
    """A model stand-in's top-k (token, logprob), best first, from the tokens so far."""
    h = sum(seen) * 31 + len(seen)
    spread = 0.5 + (h * 2654435761 % 10007) / 10007  # no ties between beams
    return [((h + 13 * j) % 97 + 3, -spread * (j + 1)) for j in range(k)]


def reference_beam_search(prompt, width, max_tokens, eos, penalty=1.0):
    """Plain beam search over the stand-in model, no KV cache at all."""
    from services.scheduler.beam_search import beam_score

    beams, finished = [([], 0.0)], []
    for step in range(max_tokens):
        ranked = sorted(((cum + lp, i, tok) for i, (out, cum) in enumerate(beams)
                         for tok, lp in candidates_from(prompt + out, 2 * width)), key=lambda c: (-c[0], c[1], c[2]))
        nxt = []
        for total, i, tok in ranked:
            if len(nxt) == width:
                break
            if tok == eos:
                finished.append((beam_score(total, len(beams[i][0]) + 1, penalty), beams[i][0] + [tok]))
            else:
                nxt.append((beams[i][0] + [tok], total))
        finished = sorted(finished, key=lambda f: -f[0])[:width]
        beams = nxt
        best = max(cum for _, cum in beams)
        if step + 1 == max_tokens or (len(finished) == width and finished[-1][0] >= beam_score(best, step + 1, penalty)):
            break
    for out, cum in beams:
        finished.append((beam_score(cum, len(out), penalty), out))
    return [out for _, out in sorted(finished, key=lambda f: -f[0])[:width]]


def reference_output(prompt, max_tokens):
    seen, out = list(prompt), []
    for _ in range(max_tokens):
        tok = next_token_from(seen)
        out.append(tok)
        seen.append(tok)
    return out


def test_continuous_batching_finishes_everything_and_frees_all_blocks():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), BlockManager(64, 4))
    reqs = [make(f"r{i}", 5 + 7 * i, 3 + i) for i in range(8)]
    for r in reqs:
        sched.add_request(r)
    max_running = []
    outputs, finish = run_until_done(sched, on_step=lambda s, _: max_running.append(len(s.running)))
    assert max(max_running) == 4
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.params.max_tokens)
        assert finish[r.request_id] == "length"
    assert sched.blocks.num_free_blocks == 64 and not sched.has_work


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(32, 4))
    r = make("long", 50, 2)
    sched.add_request(r)
    sizes = []
    while (scheduled := sched.schedule()) is not None:
        step, chunks = scheduled
        sizes.append(sum(len(s.token_ids) for s in step.seqs))
        assert [s.sample for s in step.seqs] == [c.samples for c in chunks]
        sched.process_results(chunks, [7 if s.sample else -1 for s in step.seqs])
    assert sizes == [16, 16, 16, 2, 1]


def test_preemption_recomputes_and_gives_the_same_outputs():
    big = Scheduler(SchedulerConfig(), BlockManager(1000, 4))
    small = Scheduler(SchedulerConfig(), BlockManager(12, 4))  # 48 slots for 4 requests of 20
    reqs = [(f"p{i}", 8, 12) for i in range(4)]
    for sched in (big, small):
        for rid, n, m in reqs:
            sched.add_request(make(rid, n, m))
    expected, _ = run_until_done(big)
    got, finish = run_until_done(small)
    assert small.num_preemptions_total > 0
    assert got == expected and set(finish.values()) == {"length"}
    assert small.blocks.num_free_blocks == 12


def test_swap_mode_moves_kv_to_host_and_back_with_the_same_outputs():
    big = Scheduler(SchedulerConfig(), BlockManager(1000, 4))
    small = Scheduler(SchedulerConfig(preemption_mode="swap"), BlockManager(12, 4, enable_prefix_caching=False),
                      HostBlockPool(40))
    for sched in (big, small):
        for i in range(4):
            sched.add_request(make(f"s{i}", 8, 12))
    expected, _ = run_until_done(big)
    got, finish = run_until_done(small)
    assert small.num_swapped_out_total > 0 and small.num_swapped_in_total == small.num_swapped_out_total
    assert got == expected and set(finish.values()) == {"length"}
    assert small.swap.num_free_blocks == 40 and small.blocks.num_used_blocks == 0


def test_stop_conditions():
    sched = Scheduler(SchedulerConfig(max_model_len=64), BlockManager(64, 4))
    eos = make("eos", 4, 10)
    sched.add_request(eos)
    scheduled = sched.schedule()
    (_, delta), = sched.process_results(scheduled[1], [EOS])
    assert delta.finish_reason == "stop" and delta.token_ids == [EOS]

    ignore = make("ignore", 4, 2, ignore_eos=True, stop_token_ids=[9])
    sched.add_request(ignore)
    _, chunks = sched.schedule()
    assert sched.process_results(chunks, [EOS])[0][1].finish_reason is None
    _, chunks = sched.schedule()
    assert sched.process_results(chunks, [9])[0][1].finish_reason == "stop"
    assert sched.blocks.num_free_blocks == 64


def test_abort_frees_blocks_even_while_its_step_is_in_flight():
    sched = Scheduler(SchedulerConfig(), BlockManager(16, 4))
    sched.add_request(make("a", 10, 5))
    sched.add_request(make("b", 10, 5))
    _, chunks = sched.schedule()
    sched.finish_request("a", "abort")
    deltas = sched.process_results(chunks, [5, 6])
    assert [req.request_id for req, _ in deltas] == ["b"]
    sched.check_invariants()
    sched.finish_request("b", "abort")
    assert sched.blocks.num_free_blocks == 16 and not sched.has_work


def test_requests_that_can_never_fit_are_refused():
    sched = Scheduler(SchedulerConfig(max_model_len=100), BlockManager(4, 4))
    assert "context length" in sched.check_fits(make("x", 90, 20))
    assert "KV blocks" in sched.check_fits(make("y", 10, 10))
    assert sched.check_fits(make("z", 8, 8)) is None


def test_parallel_samples_share_the_prompt_and_copy_the_partial_block_on_write():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("par", 10, 6, n=3))  # blocks [4][4][2 + room]: the last one is shared
    used, copies = [], []

    def watch(s, step):
        used.append(s.blocks.num_used_blocks)
        copies.extend(step.block_copies)

    outputs, finish = run_until_done(sched, on_step=watch)
    want = reference_output(make("par", 10, 6).prompt_token_ids, 6)
    assert outputs == {("par", i): want for i in range(3)}
    assert len(finish) == 3 and set(finish.values()) == {"length"}
    assert len(copies) == 2  # two of the three samples copy the shared partial block
    assert max(used) < 3 * 4  # three unshared sequences of 16 tokens would hold 12 blocks
    assert sched.blocks.num_used_blocks == 0 and not sched.groups


def test_stopping_one_sample_leaves_the_others_running():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("par", 6, 4, n=2))
    executor = FakeExecutor(4)
    run_until_done(sched, executor=executor, until=lambda s: any(r.num_output_tokens for r in s.running))
    sched.finish_request("par", "stop", seq_index=1)
    assert [r.seq_index for r in sched.groups["par"].seqs if not r.is_finished] == [0]
    sched.check_invariants()
    outputs, finish = run_until_done(sched, executor=executor)
    assert finish == {("par", 0): "length"}
    assert not sched.groups and sched.blocks.num_used_blocks == 0


def test_prefix_cache_skips_computed_blocks_and_keeps_outputs():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    first = make("first", 21, 5)
    sched.add_request(first)
    executor = FakeExecutor(4)
    expected, _ = run_until_done(sched, executor=executor)
    assert sched.blocks.num_cached_blocks > 0
    again = make("first", 21, 5)
    again.request_id = "again"
    sched.add_request(again)
    sizes = []
    got, _ = run_until_done(sched, executor=executor,
                            on_step=lambda s, step: sizes.append(len(step.seqs[0].token_ids)))
    assert sizes[0] == 1  # 20 prompt tokens were cached: only the last one is computed
    assert got["again"] == expected["first"]
    assert sched.blocks.prefix_cache_hits == 20


def test_beam_search_shares_blocks_and_matches_plain_beam_search():
    for width, eos in ((2, 2), (3, 40), (4, 77)):
        sched = Scheduler(SchedulerConfig(), BlockManager(200, 4))
        req = make("beam", 9, 10, use_beam_search=True, beam_width=width, n=width)
        req.eos_token_ids = frozenset({eos})
        sched.add_request(req)
        shared, copies = [], []

        def watch(s, step, shared=shared, copies=copies):
            shared.append(s.stats().kv_blocks_saved_by_sharing)
            copies.extend(step.block_copies)

        outputs, finish = run_until_done(sched, on_step=watch)
        want = reference_beam_search(req.prompt_token_ids, width, 10, eos)
        assert [outputs[("beam", i)] for i in range(width)] == want
        assert max(shared) > 0 and copies  # beams shared blocks and copied on write
        assert not sched.groups and sched.blocks.num_used_blocks == 0


def test_beam_search_survives_preemption_by_recompute_and_by_swap():
    want = reference_beam_search(make("beam", 9, 12).prompt_token_ids, 4, 12, 77)
    for mode, swap in (("recompute", None), ("swap", HostBlockPool(64))):
        sched = Scheduler(SchedulerConfig(preemption_mode=mode), BlockManager(9, 4), swap)
        req = make("beam", 9, 12, use_beam_search=True, beam_width=4, n=4)
        req.eos_token_ids = frozenset({77})
        sched.add_request(req)
        outputs, _ = run_until_done(sched)
        assert sched.num_preemptions_total > 0
        assert [outputs[("beam", i)] for i in range(4)] == want, mode
        assert sched.blocks.num_used_blocks == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(1, 3), st.booleans(),
                       st.integers(0, 40)), min_size=1, max_size=8),
    st.sampled_from(["recompute", "swap"]),
    st.integers(8, 40),
    st.booleans(),
)
def test_random_workloads_keep_invariants_and_finish(specs, mode, num_blocks, shared_prompts):
    """Random mixes of prompts (some sharing prefixes), parallel samples, beams and aborts
    on a small pool, with preemption by recompute or swap: the pool stays consistent
    every step, and every request that is not aborted finishes with the outputs an
    unconstrained run gives."""
    def build(sched) -> set[str]:
        admitted = set()
        for i, (plen, out, k, beam, _abort_at) in enumerate(specs):
            rid = f"q{i}"
            req = make("shared" if shared_prompts else rid, plen, out, n=k,
                       **({"use_beam_search": True, "beam_width": k} if beam else {}))
            req.request_id = rid
            if sched.check_fits(req) is None:
                sched.add_request(req)
                admitted.add(rid)
        return admitted

    expected, small, admitted = random_run_setup(build, mode, num_blocks)
    aborts = {f"q{i}": at for i, (*_, at) in enumerate(specs) if at % 5 == 0}
    steps = [0]

    def abort_some(s, _step):
        steps[0] += 1
        for rid, at in aborts.items():
            if at == steps[0]:
                s.finish_request(rid, "abort")

    got, _ = run_until_done(small, on_step=abort_some)
    check_random_run(small, expected, got, aborts, {f"q{i}" for i in range(len(specs))} - admitted)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(1, 3), st.booleans(), st.booleans()),
             min_size=1, max_size=8),
    st.sampled_from(["recompute", "swap"]),
    st.integers(8, 40),
    st.integers(0, 2**32),
)
def test_rows_the_executor_fails_end_their_requests_alone(specs, mode, num_blocks, seed):
    """Random workloads where the executor fails some rows of some steps (StepResult.failed):
    each such request ends whole (all its samples or beams), the pool stays consistent every
    step, and every other request finishes with the outputs an undisturbed run gives."""
    def build(sched) -> set[str]:
        admitted = set()
        for i, (plen, out, k, beam, _doomed) in enumerate(specs):
            req = make(f"q{i}", plen, out, n=k, **({"use_beam_search": True, "beam_width": k} if beam else {}))
            if sched.check_fits(req) is None:
                sched.add_request(req)
                admitted.add(req.request_id)
        return admitted

    expected, small, admitted = random_run_setup(build, mode, num_blocks)
    doomed = {f"q{i}" for i, (*_, d) in enumerate(specs) if d}
    rng, executor = random.Random(seed), FakeExecutor(4)
    got, finish, ended = {}, {}, set()
    for _ in range(3_000):
        scheduled = small.schedule()
        if scheduled is None:
            break
        step, chunks = scheduled
        sampled = executor.execute(step)
        failed = [FailedRow(i, 400, "no token") for i, c in enumerate(chunks)
                  if c.samples and c.sequence.request_id in doomed and rng.random() < 0.3]
        for f in failed:
            sampled[f.index] = -1
        for req, row in small.fail_rows(chunks, failed):
            assert req.request_id not in ended and row in failed
            ended.add(req.request_id)
            assert req.request_id not in small.groups  # every sample of it ended
        apply_result(small, chunks, sampled, executor.top_logprobs, got, finish)
        small.check_invariants()
    check_random_run(small, expected, got, ended, {f"q{i}" for i in range(len(specs))} - admitted)
    assert ended <= doomed


def random_run_setup(build, mode: str, num_blocks: int) -> tuple[dict, Scheduler, set[str]]:
    """The outputs `build`'s requests give on an unconstrained pool, and a small pool (preempting
    by `mode`) with the same requests added: (expected, that scheduler, the ids it admitted)."""
    big = Scheduler(SchedulerConfig(), BlockManager(10_000, 4))
    build(big)
    expected, _ = run_until_done(big)
    swap = HostBlockPool(num_blocks * 2) if mode == "swap" else None
    small = Scheduler(SchedulerConfig(preemption_mode=mode, max_num_batched_tokens=24), BlockManager(num_blocks, 4),
                      swap)
    return expected, small, build(small)


def check_random_run(sched: Scheduler, expected: dict, got: dict, aborted, refused: set[str]) -> None:
    """Every request not aborted gave the unconstrained run's outputs; only aborted or refused
    ones gave none; nothing is left in the pool."""
    for key, tokens in got.items():
        rid = key if isinstance(key, str) else key[0]
        if rid not in aborted:
            assert tokens == expected[key], key
    assert {k if isinstance(k, str) else k[0] for k in set(expected) - set(got)} <= set(aborted) | refused
    assert not sched.groups and sched.blocks.num_used_blocks == 0


def test_a_failed_step_leaves_no_uncomputed_block_in_the_prefix_cache():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("first", 21, 5))
    sched.schedule()  # handed to an executor that then fails the step: nothing was written
    sched.finish_request("first", "error")  # what the service does on StepFailed
    assert sched.blocks.num_cached_blocks == 0
    again = make("first", 21, 5)
    again.request_id = "again"
    sched.add_request(again)
    starts = []
    got, _ = run_until_done(sched, on_step=lambda s, step: starts.append(step.seqs[0].start_pos))
    assert starts[0] == 0  # the whole prompt is computed, none read from the cache
    assert got["again"] == reference_output(again.prompt_token_ids, 5)
    assert sched.blocks.num_cached_blocks > 0  # its own computed blocks are cached now


class Faulty(Sequence):
    """A request whose handling raises where `fails_in` says, as a bug tied to one
    request's input would."""

    fails_in = ""

    @property
    def sampling(self):  # read when its step is built
        if self.fails_in == "schedule":
            raise RuntimeError("boom while scheduling")
        return super().sampling

    def stop_reason(self, max_model_len):  # read when its sampled token comes back
        if self.fails_in == "results":
            raise RuntimeError("boom while applying a result")
        return super().stop_reason(max_model_len)


def faulty(rid, prompt_len, max_tokens, fails_in, **params):
    base = make(rid, prompt_len, max_tokens, **params)
    req = Faulty(rid, base.prompt_token_ids, base.params, base.eos_token_ids, 0.0)
    req.fails_in = fails_in
    return req


class FaultyBlocks(BlockManager):
    """Raises when request "bad" grows past its prompt (a running sequence's turn)."""

    def append_slots(self, seq, num_new_tokens):
        if seq.request_id == "bad" and seq.num_output_tokens:
            raise RuntimeError("boom while growing")
        return super().append_slots(seq, num_new_tokens)


@pytest.mark.parametrize("fails_in", ["schedule", "running", "results"])
def test_a_request_that_raises_fails_alone_and_frees_its_blocks(fails_in):
    sched = Scheduler(SchedulerConfig(), (FaultyBlocks if fails_in == "running" else BlockManager)(64, 4))
    honest = [make("a", 10, 6), make("b", 7, 4, n=2)]
    sched.add_request(honest[0])
    sched.add_request(faulty("bad", 9, 5, fails_in, n=2))
    sched.add_request(honest[1])
    outputs, finish = run_until_done(sched)  # checks the pool's invariants every step
    assert outputs["a"] == reference_output(honest[0].prompt_token_ids, 6)
    assert outputs[("b", 0)] == outputs[("b", 1)] == reference_output(honest[1].prompt_token_ids, 4)
    assert [(r.request_id, r.finish_reason) for r in sched.take_failed()] == [("bad", "error")]
    assert not sched.groups and sched.blocks.num_used_blocks == 0
    assert sched.take_failed() == []  # each failure is reported once


class NanExecutor(FakeExecutor):
    """Returns NaN logprobs to the beams of one request (a broken result for it alone)."""

    def execute(self, step):
        sampled = super().execute(step)
        beams = [s for s in step.seqs if s.sample and s.num_logprobs]
        self.top_logprobs = [[(t, math.nan) for t, _ in c] if s.request_id == "bad" else c
                             for s, c in zip(beams, self.top_logprobs, strict=True)]
        return sampled


def test_a_beam_request_with_a_broken_result_fails_alone():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("bad", 9, 5, use_beam_search=True, beam_width=2, n=2))
    good = make("good", 9, 5, use_beam_search=True, beam_width=2, n=2)
    sched.add_request(good)
    outputs, _ = run_until_done(sched, executor=NanExecutor(4))
    want = reference_beam_search(good.prompt_token_ids, 2, 5, EOS)
    assert [outputs[("good", i)] for i in range(2)] == want
    assert [r.request_id for r in sched.take_failed()] == ["bad"]
    assert sched.blocks.num_used_blocks == 0


def test_beam_score_is_finite_for_any_penalty_and_plain_for_sane_ones():
    assert beam_score(-6.0, 4, 1.0) == -1.5 and beam_score(-6.0, 4, 0.0) == -6.0
    for penalty in (-2000.0, -50.0, 50.0, 2000.0, 1e300):
        for length in (1, 2, 8000):
            score = beam_score(-6.0, length, penalty)
            assert math.isfinite(score) and score <= 0, (penalty, length)
    assert beam_score(0.0, 10, 2000.0) == 0.0


@pytest.mark.parametrize("penalty", [2000.0, -2000.0])
def test_beam_search_with_an_extreme_length_penalty_finishes(penalty):
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("beam", 9, 6, use_beam_search=True, beam_width=2, n=2, length_penalty=penalty,
                           ignore_eos=True))
    outputs, finish = run_until_done(sched)
    assert [len(outputs[("beam", i)]) for i in range(2)] == [6, 6]
    assert finish == {("beam", 0): "length", ("beam", 1): "length"}
    assert sched.blocks.num_used_blocks == 0


def test_a_beam_request_with_a_non_finite_penalty_is_refused():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    for penalty in (math.nan, math.inf):
        req = make("beam", 9, 6, use_beam_search=True, beam_width=2, n=2, length_penalty=penalty)
        assert "length_penalty" in sched.check_fits(req)


def test_beam_search_per_step_work_and_state_do_not_grow_with_the_output():
    """Forking a beam must not copy its output, and a dropped beam must not be kept:
    the bytes allocated applying one step's result grow by less than 2 per output token
    from around step 40 to around step 260 (block tables, 2 words per 16 tokens, must
    grow; copying the output at each fork costs a word per token)."""
    width, steps = 4, 300
    sched = Scheduler(SchedulerConfig(max_model_len=1024), BlockManager(1000, 16))
    sched.add_request(make("beam", 9, steps, use_beam_search=True, beam_width=width, n=width, ignore_eos=True))
    executor = FakeExecutor(16)
    allocated, held, forks = [], [], 0  # forks: the highest sequence index given out
    tracemalloc.start()
    try:
        while (scheduled := sched.schedule()) is not None:
            step, chunks = scheduled
            sampled = executor.execute(step)
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            sched.process_results(chunks, sampled, executor.top_logprobs)
            allocated.append(tracemalloc.get_traced_memory()[1] - before)
            if "beam" in sched.groups:
                held.append(len(sched.groups["beam"].seqs))
                forks = max(forks, *(r.seq_index for r in sched.groups["beam"].seqs))
    finally:
        tracemalloc.stop()
    assert forks > steps // 4  # beams did fork all along
    assert max(held) <= width  # dropped beams are let go at once
    early, late = statistics.mean(allocated[20:60]), statistics.mean(allocated[-60:-20])
    tokens_later = statistics.mean(range(steps - 60, steps - 20)) - statistics.mean(range(20, 60))
    assert late - early < 2 * tokens_later, (early, late)


def test_requests_of_a_held_owner_wait_while_the_others_run():
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    waiting, running, other = make("w", 6, 3), make("r", 6, 3), make("o", 6, 3)
    waiting.reply_to = running.reply_to = b"slow"
    other.reply_to = b"fast"
    executor = FakeExecutor(4)
    sched.add_request(running)
    first, _ = run_until_done(sched, executor=executor, until=lambda s: running.num_output_tokens)
    sched.add_request(waiting)  # then the owner's queue fills
    sched.add_request(other)
    sched.held = {b"slow"}
    outputs, _ = run_until_done(sched, executor=executor)
    assert set(outputs) == {"o"} and running.num_output_tokens == 1 and list(sched.waiting) == [waiting]
    sched.held = set()
    outputs, _ = run_until_done(sched, executor=executor)
    assert outputs["w"] == reference_output(waiting.prompt_token_ids, 3)
    assert first["r"] + outputs["r"] == reference_output(running.prompt_token_ids, 3)


def test_samples_forked_at_admission_from_the_cache_run_in_that_very_step():
    """n=2 over a prompt the cache holds up to the fork point: admission forks it with no chunk
    of its own. schedule() once returned None there (the stage then slept until a message came)
    and the pipelined random-workload test lost the request."""
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4))
    sched.add_request(make("shared", 13, 1))
    run_until_done(sched)  # its 3 full blocks are cached now
    twice = make("shared", 13, 1, n=2)
    twice.request_id = "twice"
    sched.add_request(twice)
    step, chunks = sched.schedule()
    assert sorted(c.sequence.seq_index for c in chunks) == [0, 1] and sched.num_forked_at_admission == 1
    assert all(s.start_pos == 12 and len(s.token_ids) == 1 for s in step.seqs)  # only the last prompt token
    sched.check_invariants()


def tokens_per_step(sched: Scheduler) -> list[dict[str, int]]:
    """Runs sched to the end with a token for each sampled row; each step's tokens per request."""
    steps = []
    while (scheduled := sched.schedule()) is not None:
        step, chunks = scheduled
        steps.append({s.request_id: len(s.token_ids) for s in step.seqs})
        sched.process_results(chunks, [7 if s.sample else -1 for s in step.seqs])
    return steps


def test_a_prompt_the_budget_would_cut_waits_for_a_step_without_another_prompt():
    # budget 16, all waiting: "b" (12) would be cut to 6 beside "a" (10) and finish only in the
    # next step, so it starts there, whole, beside a's decode; "c" (4) would be cut to 3 beside
    # "b" and starts in the step after, beside b's decode alone
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(64, 4))
    for rid, n in (("a", 10), ("b", 12), ("c", 4)):
        sched.add_request(make(rid, n, 2))
    assert tokens_per_step(sched) == [{"a": 10}, {"a": 1, "b": 12}, {"b": 1, "c": 4}, {"c": 1}]


def test_a_prompt_longer_than_the_budget_still_starts_beside_decodes():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), BlockManager(64, 4))
    sched.add_request(make("short", 4, 6))
    first = sched.schedule()
    sched.process_results(first[1], [7])
    sched.add_request(make("long", 40, 2))
    sizes = tokens_per_step(sched)
    assert sizes[0] == {"short": 1, "long": 15}  # decodes only so far: the long prompt starts, cut
    assert sizes[1] == {"short": 1, "long": 15} and sizes[2] == {"short": 1, "long": 10}

"""The scheduler stage's socket loop, run in a thread against a stand-in executor and
stand-in gateways (DEALERs that send GatewayToScheduler and read SchedulerToGateway) over
inproc sockets: hostile requests and broken results fail one request, never the stage; a
gateway that goes silent loses its requests, one that is slow holds them; resumed requests
go on from the output they bring."""

from __future__ import annotations

import argparse
import math
import threading
import time

import pytest
import zmq

from services.scheduler.service import SchedulerService
from services.stage_options import add_stage_args
from shared import transport
from shared.config import ADDRESS_NAMES, Addresses
from shared.messages import (
    PREVIOUS_TOKEN,
    AbortRequest,
    ExecuteStep,
    ExecutorReady,
    ExecutorToScheduler,
    FailedRow,
    GatewayBeat,
    RequestError,
    SamplingParams,
    SchedulerToExecutor,
    SchedulerToGateway,
    StepDeltas,
    StepResult,
    TokenDelta,
    TokenizedRequest,
)
from shared.transport import DealerSocket, PullSocket, PushSocket, _Typed


class Stage:
    """A scheduler service in a thread, with the test as its executor."""

    def __init__(self, num_kv_blocks: int = 64, vocab_size: int = 0, argv: tuple[str, ...] = (),
                 num_swap_blocks: int = 0, sized_for: tuple[int, int] = (0, 0), ready: bool = True,
                 step_delay_s: float = 0.0):
        self.ctx = zmq.Context()
        self.addrs = Addresses(**{name: f"inproc://{name}" for name in ADDRESS_NAMES})
        parser = argparse.ArgumentParser()
        add_stage_args(parser, "scheduler")
        self.service = SchedulerService(parser.parse_args([*self.addrs.as_argv(), *argv]), self.ctx)
        self.executor_in = PullSocket(self.ctx, self.addrs.executor_in, SchedulerToExecutor, bind=False)
        self.executor_out = PushSocket(self.ctx, self.addrs.executor_out, ExecutorToScheduler, bind=False)
        self.nan_for: set[str] = set()  # requests whose beams get NaN logprobs
        self.forged_for: set[str] = set()  # requests sampled a token id outside any vocabulary
        self.fail_at: dict[tuple[str, int], int] = {}  # (request, seq index) -> output index its row fails at
        self.beating: dict[str, DealerSocket] = {}  # the stand-in gateways that beat
        self.beat_at = 0.0
        self.step_delay_s = step_delay_s  # the stand-in executor answers no faster than this
        self.answered_at = 0.0
        self.steps = 0
        self.widest = 0  # the most sequences in one step
        self.thread = threading.Thread(target=self.service.serve, daemon=True)
        self.thread.start()
        self.ready_msg = ExecutorReady("test-executor", num_kv_blocks, 4, 256, instance="test",
                                       vocab_size=vocab_size, num_swap_blocks=num_swap_blocks,
                                       max_num_seqs=sized_for[0], max_num_batched_tokens=sized_for[1])
        if ready:
            self.executor_out.send(self.ready_msg)

    def gateway(self, name: str, beats: bool = True) -> DealerSocket:
        """A stand-in gateway ("gateway-<name>"); it beats (GatewayBeat) while `run_until` runs,
        as a live one does, unless told not to."""
        sock = DealerSocket(self.ctx, self.addrs.scheduler_in, SchedulerToGateway, f"gateway-{name}")
        if beats:
            self.beating[name] = sock
        return sock

    def beat(self) -> None:
        if time.monotonic() - self.beat_at >= 0.5:
            self.beat_at = time.monotonic()
            for name, sock in self.beating.items():
                sock.send(GatewayBeat(name))

    def execute(self) -> None:
        """Answer every step the scheduler sent: token 7, or beam candidates."""
        if time.monotonic() - self.answered_at < self.step_delay_s:
            return
        self.answered_at = time.monotonic()
        for step in self.executor_in.recv_nowait():
            if not isinstance(step, ExecuteStep):
                continue
            self.steps += 1
            self.widest = max(self.widest, len(step.seqs))
            top = []
            for seq in step.seqs:
                if seq.sample and seq.num_logprobs:
                    lp = math.nan if seq.request_id in self.nan_for else -0.5
                    top.append([(10 + j, lp * (j + 1)) for j in range(seq.num_logprobs)])
            sampled = [(10**6 if seq.request_id in self.forged_for else 7) if seq.sample else -1
                       for seq in step.seqs]
            failed = [FailedRow(i, 400, "no token satisfies this request's constraints") for i, seq in
                      enumerate(step.seqs) if seq.sample and self.fail_at.get((seq.request_id, seq.seq_index),
                                                                             -1) == seq.output_index]
            for f in failed:
                sampled[f.index] = -1
            self.executor_out.send(StepResult(step.step_id, sampled, 0.001, top, failed=failed))

    def run_until(self, done, *gateways: DealerSocket, timeout_s: float = 20.0, execute=True) -> dict:
        """Play the executor until done(replies) holds; replies by request id, in order."""
        replies: dict[str, list] = getattr(self, "_replies", {})
        self._replies = replies
        deadline = time.monotonic() + timeout_s
        while not done(replies):
            assert time.monotonic() < deadline, f"no end: {replies}"
            assert self.thread.is_alive(), "the scheduler loop died"
            if execute:
                self.execute()
            self.beat()
            for gw in gateways:
                for frame in gw.recv_nowait():
                    for msg in frame.deltas if isinstance(frame, StepDeltas) else [frame]:
                        replies.setdefault(msg.request_id, []).append(msg)
            time.sleep(0.001)
        return replies

    def close(self) -> None:
        self.service.running = False
        self.thread.join(5)
        self.ctx.destroy(linger=0)


@pytest.fixture
def stage():
    s = Stage()
    yield s
    s.close()


def ended(msgs: list) -> bool:
    last = msgs[-1] if msgs else None
    return isinstance(last, RequestError) or (isinstance(last, TokenDelta) and last.finish_reason is not None)


def honest(rid: str, max_tokens: int = 5) -> TokenizedRequest:
    return TokenizedRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, ignore_eos=True), [2], 0.0)


HOSTILE = {
    "penalty": SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2, n=2, length_penalty=2000.0),
    "nan-penalty": SamplingParams(use_beam_search=True, beam_width=2, length_penalty=math.nan),
    "inf-temperature": SamplingParams(temperature=math.inf),
    "nan-top-p": SamplingParams(top_p=math.nan),
    "no-tokens": SamplingParams(max_tokens=0),
    "wide-beam": SamplingParams(use_beam_search=True, beam_width=10_000),
    "huge-seed": SamplingParams(seed=2**64 - 1),
}


def test_hostile_numbers_are_refused_and_the_stage_goes_on(stage):
    gw = stage.gateway("gw-0")
    gw.send(honest("first"))
    for rid, params in HOSTILE.items():
        gw.send(TokenizedRequest(rid, [5, 6, 7], params, [2], 0.0))
    gw.send(TokenizedRequest("empty-prompt", [], SamplingParams(), [2], 0.0))
    gw.send(TokenizedRequest("bad-token", [5, -1], SamplingParams(), [2], 0.0))
    gw.send(TokenizedRequest("bad-time", [5], SamplingParams(), [2], math.nan))
    gw.send(honest("last"))
    bad = [*HOSTILE, "empty-prompt", "bad-token", "bad-time"]
    replies = stage.run_until(lambda r: all(ended(r.get(k, [])) for k in ["first", "last", *bad]), gw)
    for rid in bad:
        (err,) = replies[rid]
        assert isinstance(err, RequestError) and err.status == 400, (rid, err)
    for rid in ("first", "last"):
        assert [t for m in replies[rid] for t in m.token_ids] == [7] * 5
    assert stage.service.scheduler.blocks.num_used_blocks == 0


def test_a_broken_result_for_one_beam_request_fails_it_alone(stage):
    gw = stage.gateway("gw-0")
    stage.nan_for.add("bad")
    beams = SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2, n=2, ignore_eos=True)
    gw.send(TokenizedRequest("bad", [5, 6, 7], beams, [2], 0.0))
    gw.send(TokenizedRequest("good", [5, 6, 7], beams, [2], 0.0))
    gw.send(honest("plain"))
    replies = stage.run_until(lambda r: all(len(r.get(k, [])) >= n for k, n in
                                            (("bad", 1), ("good", 2), ("plain", 5))), gw)
    (err,) = replies["bad"]
    assert isinstance(err, RequestError) and err.status == 500 and err.error_type == "internal_error"
    assert [len(m.token_ids) for m in replies["good"]] == [4, 4]
    assert replies["plain"][-1].finish_reason == "length"
    assert stage.service.scheduler.blocks.num_used_blocks == 0


@pytest.mark.parametrize("argv", [(), ("--no-async-scheduling",)])
def test_a_row_the_executor_fails_ends_its_request_alone(argv):
    """StepResult.failed: the request of that row ends (all its samples: output or an error,
    not half) with the executor's status and message, its blocks are freed, and the other
    rows of the step, and the steps after, go on as before."""
    stage = Stage(argv=argv)
    try:
        gw = stage.gateway("gw-0")
        stage.fail_at[("one", 0)] = 2
        stage.fail_at[("pair", 1)] = 3
        gw.send(honest("before", 8))
        gw.send(TokenizedRequest("one", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True), [2], 0.0))
        gw.send(TokenizedRequest("pair", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8, n=2, ignore_eos=True),
                                  [2], 0.0))
        gw.send(honest("after", 8))
        replies = stage.run_until(lambda r: all(ended(r.get(k, [])) for k in ("before", "one", "pair", "after")), gw)
        for rid, n_tokens in (("one", 2), ("pair", None)):
            err = replies[rid][-1]
            assert isinstance(err, RequestError) and err.status == 400, err
            assert err.error_type == "invalid_request_error" and "constraints" in err.message
            assert sum(isinstance(m, RequestError) for m in replies[rid]) == 1
            if n_tokens is not None:
                assert tokens(replies[rid]) == [7] * n_tokens
        for rid in ("before", "after"):
            assert tokens(replies[rid]) == [7] * 8 and replies[rid][-1].finish_reason == "length"
        sched = stage.service.scheduler
        assert "one" not in sched.groups and "pair" not in sched.groups  # both samples of pair ended
        time.sleep(0.05)
        sched.check_invariants()
        assert sched.blocks.num_used_blocks == 0 and not sched.running and not sched.waiting
        assert stage.thread.is_alive()
    finally:
        stage.close()


class SmallQueueGateway(DealerSocket):
    def __init__(self, ctx, address: str, name: str):  # RCVHWM must be set before connecting
        _Typed.__init__(self, ctx, zmq.DEALER, address, SchedulerToGateway, bind=False,
                        opts={zmq.IDENTITY: name.encode(), zmq.RCVHWM: 2})


def slow_gateway(stage: Stage, name: str) -> DealerSocket:
    """A gateway whose queue holds about 4 messages (with `small_queues`); it beats."""
    sock = stage.beating[name] = SmallQueueGateway(stage.ctx, stage.addrs.scheduler_in, f"gateway-{name}")
    return sock


@pytest.fixture
def small_queues(monkeypatch):
    """The scheduler's ROUTER queues 2 messages per peer (set before it binds)."""
    real_open = transport._open

    def small_hwm_open(ctx, kind, address, bind, opts=None):
        if kind == zmq.ROUTER:
            opts = {**(opts or {}), zmq.SNDHWM: 2}
        return real_open(ctx, kind, address, bind, opts)

    monkeypatch.setattr(transport, "_open", small_hwm_open)


def tokens(msgs: list) -> list[int]:
    return [t for m in msgs if isinstance(m, TokenDelta) for t in m.token_ids]


def test_a_gateway_that_does_not_read_holds_its_requests_and_loses_no_token(small_queues, stage):
    slow = slow_gateway(stage, "slow")
    fast = stage.gateway("fast")
    slow.send(honest("s", 40))
    fast.send(honest("f", 40))
    replies = stage.run_until(lambda r: ended(r.get("f", [])), fast)  # others go on meanwhile
    assert tokens(replies["f"]) == [7] * 40
    assert stage.service.scheduler.groups["s"].seqs[0].num_output_tokens < 20  # held, not run on
    replies = stage.run_until(lambda r: ended(r.get("s", [])), slow)
    assert tokens(replies["s"]) == [7] * 40 and replies["s"][-1].finish_reason == "length"


def test_a_gateway_stuck_past_the_timeout_has_its_requests_failed_loudly(small_queues, monkeypatch):
    monkeypatch.setattr("services.scheduler.service.STALL_TIMEOUT_S", 0.3)
    stage = Stage()
    try:
        stuck = slow_gateway(stage, "stuck")
        stuck.send(honest("x", 40))
        stage.run_until(lambda r: stage.service.scheduler is not None and "x" in stage.service.scheduler.groups)
        stage.run_until(lambda r: "x" not in stage.service.scheduler.groups)
        assert stage.service.scheduler.blocks.num_used_blocks == 0  # its blocks went back
        replies = stage.run_until(lambda r: ended(r.get("x", [])), stuck)
        assert 0 < len(tokens(replies["x"])) < 40
        err = replies["x"][-1]
        assert isinstance(err, RequestError) and err.status == 503
    finally:
        stage.close()


def test_token_ids_outside_the_vocabulary_fail_only_their_request():
    stage = Stage(vocab_size=100)
    try:
        gw = stage.gateway("gw-0")
        stage.forged_for.add("forged-result")
        gw.send(honest("before"))
        gw.send(TokenizedRequest("forged-prompt", [5, 100], SamplingParams(), [2], 0.0))  # 100: one past the end
        gw.send(honest("forged-result"))
        gw.send(honest("after"))
        replies = stage.run_until(lambda r: all(ended(r.get(k, [])) for k in
                                                ("before", "forged-prompt", "forged-result", "after")), gw)
        (err,) = replies["forged-prompt"]
        assert isinstance(err, RequestError) and err.status == 400 and "vocabulary (0 to 99)" in err.message
        (err,) = replies["forged-result"]
        assert isinstance(err, RequestError) and err.status == 500, err
        for rid in ("before", "after"):
            assert [t for m in replies[rid] for t in m.token_ids] == [7] * 5
        assert stage.thread.is_alive()
        assert stage.service.scheduler.blocks.num_used_blocks == 0
    finally:
        stage.close()


def test_a_step_s_tokens_reach_a_gateway_as_one_frame(stage):
    gw = stage.gateway("t0")
    for i in range(4):
        gw.send(honest(f"r{i}", 3))
    frames = []
    deadline = time.monotonic() + 20
    while sum(len(f.deltas) if isinstance(f, StepDeltas) else 1 for f in frames) < 12:
        assert time.monotonic() < deadline, frames
        stage.execute()
        frames += gw.recv_nowait()
        time.sleep(0.001)
    batched = [f for f in frames if isinstance(f, StepDeltas)]
    assert batched and all(len(f.deltas) > 1 for f in batched)  # one frame per step, not one per sequence
    got: dict[str, list[int]] = {}
    for f in frames:
        for d in f.deltas if isinstance(f, StepDeltas) else [f]:
            got.setdefault(d.request_id, []).extend(d.token_ids)
    assert sorted(got) == [f"r{i}" for i in range(4)] and all(len(t) == 3 for t in got.values())


def steps_sent(stage: Stage, wait_s: float) -> list[ExecuteStep]:
    """The steps the scheduler sends within wait_s, unanswered."""
    steps, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        steps += [m for m in stage.executor_in.recv_nowait() if isinstance(m, ExecuteStep)]
        time.sleep(0.005)
    return steps


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_next_step_goes_out_before_the_result_of_the_one_in_flight(async_scheduling):
    """Async scheduling: a second step, continuing with the token the first samples, is sent
    before the first is answered; never a third. Without it, one step at a time."""
    stage = Stage(argv=() if async_scheduling else ("--no-async-scheduling",))
    try:
        gw = stage.gateway("t0")
        gw.send(honest("one", 4))
        sent = steps_sent(stage, 1.0)
        assert [len(s.seqs[0].token_ids) for s in sent] == ([5, 1] if async_scheduling else [5])
        if async_scheduling:
            ahead = sent[1].seqs[0]
            assert ahead.token_ids == [PREVIOUS_TOKEN] and ahead.start_pos == 5 and ahead.output_index == 1
        tokens = []
        while len(tokens) < 4:
            for step in sent:  # the executor answers in order, with the placeholder's token being 7 too
                stage.executor_out.send(StepResult(step.step_id, [7], 0.001))
            sent = steps_sent(stage, 0.2)
            assert len(sent) <= (2 if async_scheduling else 1)
            for frame in gw.recv_nowait():
                for d in frame.deltas if isinstance(frame, StepDeltas) else [frame]:
                    tokens += d.token_ids
        assert tokens == [7, 7, 7, 7] and not sent
        stats = stage.service.scheduler.stats()
        assert stats.num_steps_total == 4 and stats.decode_steps_total == 3
    finally:
        stage.close()


def test_steps_stay_within_the_limits_the_executor_was_sized_for(caplog):
    """An executor sized for smaller steps than the scheduler's own limits (stages started apart,
    with different --max-num-seqs): the scheduler schedules within the executor's, and says so."""
    stage = Stage(argv=("--max-num-seqs", "8"), sized_for=(2, 64))
    try:
        gw = stage.gateway("gw-0")
        for i in range(5):
            gw.send(honest(f"r{i}"))
        replies = stage.run_until(lambda r: all(ended(r.get(f"r{i}", [])) for i in range(5)), gw)
        assert all([t for m in replies[f"r{i}"] for t in m.token_ids] == [7] * 5 for i in range(5))
        assert stage.widest == 2
        assert (stage.service.scheduler.config.max_num_seqs, stage.service.scheduler.config.max_num_batched_tokens) \
            == (2, 64)
        assert "sized for steps of --max-num-seqs 2 and --max-num-batched-tokens 64" in caplog.text
    finally:
        stage.close()


def test_a_gateway_that_stops_beating_loses_its_requests_while_another_goes_on(monkeypatch, caplog):
    """GatewayBeat: a gateway silent for GATEWAY_LOST_AFTER_S (here 1 s) has its requests
    aborted, blocks freed, no reply, logged once; a gateway that beats is untouched."""
    monkeypatch.setattr("services.scheduler.service.GATEWAY_LOST_AFTER_S", 1.0)
    stage = Stage(step_delay_s=0.02)  # ~50 tokens a second: the requests outlast the timeout
    try:
        dead = stage.gateway("dead", beats=False)
        live = stage.gateway("live")
        dead.send(honest("d1", 120))
        dead.send(TokenizedRequest("d2", [5, 6, 7, 8, 9], SamplingParams(max_tokens=120, n=2, ignore_eos=True),
                                   [2], 0.0))
        sent_at = time.monotonic()
        live.send(honest("l1", 120))
        sched = lambda: stage.service.scheduler  # noqa: E731
        stage.run_until(lambda r: sched() is not None and not {"d1", "d2"} & set(sched().groups)
                        and "d1" in r, dead, live)
        lost_after = time.monotonic() - sent_at
        assert 1.0 <= lost_after < 3.0, lost_after
        assert "l1" in sched().groups  # the live gateway's request goes on
        replies = stage.run_until(lambda r: ended(r.get("l1", [])), dead, live)
        assert tokens(replies["l1"]) == [7] * 120 and replies["l1"][-1].finish_reason == "length"
        for rid in ("d1", "d2"):  # tokens until it was lost, then nothing: no error, no final delta
            assert 0 < len(tokens(replies[rid])) < 120 * (1 if rid == "d1" else 2) and not ended(replies[rid])
        assert sched().blocks.num_used_blocks == 0 and not sched().running and not sched().waiting
        assert b"gateway-dead" not in stage.service.gateways and b"gateway-live" in stage.service.gateways
        assert caplog.text.count("silent for over") == 1
    finally:
        stage.close()


def test_an_abort_ends_its_request_without_a_reply_and_a_pending_one_is_dropped():
    stage = Stage(ready=False)
    try:
        gw = stage.gateway("g")
        gw.send(honest("pending", 5))
        gw.send(AbortRequest("pending"))  # before the executor is up
        gw.send(honest("kept", 5))
        stage.run_until(lambda r: len(stage.service.pending) == 1, execute=False)
        stage.executor_out.send(stage.ready_msg)
        gw.send(honest("running", 40))
        replies = stage.run_until(lambda r: "running" in r, gw)
        gw.send(AbortRequest("running"))
        gw.send(AbortRequest("never-seen"))  # ended long ago: nothing to do, nothing said
        replies = stage.run_until(lambda r: "running" not in stage.service.scheduler.groups and ended(r.get("kept", [])),
                                  gw)
        time.sleep(0.1)
        replies = stage.run_until(lambda r: True, gw)
        assert "pending" not in replies and "never-seen" not in replies
        assert tokens(replies["kept"]) == [7] * 5
        assert not ended(replies["running"]) and len(tokens(replies["running"])) < 40  # no "abort" ack
        assert stage.service.scheduler.blocks.num_used_blocks == 0
    finally:
        stage.close()


def test_a_resumed_request_goes_on_after_its_output():
    """TokenizedRequest.output_token_ids: max_tokens counts them, the first delta tells the
    prefix cache's share, the first step recomputes prompt and output and samples index k."""
    stage = Stage()
    try:
        gw = stage.gateway("g")
        gw.send(TokenizedRequest("first", [5, 6, 7, 8, 9, 10, 11, 12, 13], SamplingParams(max_tokens=6, ignore_eos=True),
                                 [2], 0.0))
        replies = stage.run_until(lambda r: ended(r.get("first", [])), gw)
        assert tokens(replies["first"]) == [7] * 6 and replies["first"][0].num_cached_tokens == 0
        resumed = TokenizedRequest("again", [5, 6, 7, 8, 9, 10, 11, 12, 13],
                                   SamplingParams(max_tokens=6, ignore_eos=True, presence_penalty=1.0), [2], 0.0,
                                   output_token_ids=[7, 7, 7, 7])
        gw.send(resumed)
        time.sleep(0.2)
        (step,) = [m for m in stage.executor_in.recv_nowait() if isinstance(m, ExecuteStep)]
        (row,) = step.seqs
        # blocks of 4: the first run left [5..8], [9..12] and [13, 7, 7, 7] in the cache, so
        # all but the last token (always computed) come from it
        assert row.start_pos == 12 and row.token_ids == [7] and row.output_index == 4 and row.sample
        assert row.output_start == 0 and row.output_token_ids == [7, 7, 7, 7]
        stage.executor_out.send(StepResult(step.step_id, [7], 0.001))
        replies = stage.run_until(lambda r: ended(r.get("again", [])), gw)
        assert tokens(replies["again"]) == [7] * 2 and replies["again"][-1].finish_reason == "length"
        assert replies["again"][0].num_cached_tokens == 9  # the whole prompt
    finally:
        stage.close()


RESUME_REFUSALS = {
    "n": (SamplingParams(max_tokens=8, n=2), [7], "n == 1"),
    "beam": (SamplingParams(max_tokens=8, use_beam_search=True, beam_width=2), [7], "beam search"),
    "vocab": (SamplingParams(max_tokens=8), [7, 100], "vocabulary (0 to 99)"),
    "negative": (SamplingParams(max_tokens=8), [-1], "vocabulary"),
    "max-tokens": (SamplingParams(max_tokens=3), [7, 7, 7], "max_tokens (3)"),
    "context": (SamplingParams(max_tokens=252), [7] * 251, "maximum context length of 256"),
}


def test_bad_resumes_are_refused_with_a_400_naming_the_problem():
    stage = Stage(vocab_size=100)
    try:
        gw = stage.gateway("g")
        for rid, (params, output, _) in RESUME_REFUSALS.items():
            gw.send(TokenizedRequest(rid, [5, 6, 7, 8, 9], params, [2], 0.0, output_token_ids=output))
        gw.send(TokenizedRequest("fine", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True), [2], 0.0,
                                 output_token_ids=[7, 7, 7]))
        replies = stage.run_until(lambda r: all(ended(r.get(k, [])) for k in [*RESUME_REFUSALS, "fine"]), gw)
        for rid, (_, _, words) in RESUME_REFUSALS.items():
            (err,) = replies[rid]
            assert isinstance(err, RequestError) and err.status == 400 and words in err.message, (rid, err)
        assert tokens(replies["fine"]) == [7] and replies["fine"][-1].finish_reason == "length"
        assert stage.service.scheduler.blocks.num_used_blocks == 0
    finally:
        stage.close()

"""The scheduler stage's socket loop, run in a thread against a stand-in executor and
tokenizer replicas over inproc sockets: hostile requests and broken results fail one
request, never the stage."""

from __future__ import annotations

import argparse
import math
import threading
import time

import pytest
import zmq

from services.scheduler.service import SchedulerService, add_args
from shared.config import ADDRESS_NAMES, Addresses
from shared.messages import (
    ExecuteStep,
    ExecutorReady,
    ExecutorToScheduler,
    RequestError,
    SamplingParams,
    SchedulerToExecutor,
    SchedulerToTokenizer,
    StepResult,
    TokenDelta,
    TokenizedRequest,
)
from shared.transport import DealerSocket, PullSocket, PushSocket


class Stage:
    """A scheduler service in a thread, with the test as its executor."""

    def __init__(self, num_kv_blocks: int = 64):
        self.ctx = zmq.Context()
        self.addrs = Addresses(**{name: f"inproc://{name}" for name in ADDRESS_NAMES})
        parser = argparse.ArgumentParser()
        add_args(parser)
        self.service = SchedulerService(parser.parse_args(self.addrs.as_argv()), self.ctx)
        self.executor_in = PullSocket(self.ctx, self.addrs.executor_in, SchedulerToExecutor, bind=False)
        self.executor_out = PushSocket(self.ctx, self.addrs.executor_out, ExecutorToScheduler, bind=False)
        self.nan_for: set[str] = set()  # requests whose beams get NaN logprobs
        self.steps = 0
        self.thread = threading.Thread(target=self.service.serve, daemon=True)
        self.thread.start()
        self.executor_out.send(ExecutorReady("test-executor", num_kv_blocks, 4, 256, instance="test"))

    def tokenizer(self, name: str, rcvhwm: int | None = None) -> DealerSocket:
        opts_sock = DealerSocket(self.ctx, self.addrs.scheduler_in, SchedulerToTokenizer, name)
        if rcvhwm is not None:
            opts_sock.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        return opts_sock

    def execute(self) -> None:
        """Answer every step the scheduler sent: token 7, or beam candidates."""
        for step in self.executor_in.recv_nowait():
            if not isinstance(step, ExecuteStep):
                continue
            self.steps += 1
            top = []
            for seq in step.seqs:
                if seq.sample and seq.num_logprobs:
                    lp = math.nan if seq.request_id in self.nan_for else -0.5
                    top.append([(10 + j, lp * (j + 1)) for j in range(seq.num_logprobs)])
            sampled = [7 if seq.sample else -1 for seq in step.seqs]
            self.executor_out.send(StepResult(step.step_id, sampled, 0.001, top))

    def run_until(self, done, *tokenizers: DealerSocket, timeout_s: float = 20.0, execute=True) -> dict:
        """Play the executor until done(replies) holds; replies by request id, in order."""
        replies: dict[str, list] = getattr(self, "_replies", {})
        self._replies = replies
        deadline = time.monotonic() + timeout_s
        while not done(replies):
            assert time.monotonic() < deadline, f"no end: {replies}"
            assert self.thread.is_alive(), "the scheduler loop died"
            if execute:
                self.execute()
            for tok in tokenizers:
                for msg in tok.recv_nowait():
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
    tok = stage.tokenizer("tok-0")
    tok.send(honest("first"))
    for rid, params in HOSTILE.items():
        tok.send(TokenizedRequest(rid, [5, 6, 7], params, [2], 0.0))
    tok.send(TokenizedRequest("empty-prompt", [], SamplingParams(), [2], 0.0))
    tok.send(TokenizedRequest("bad-token", [5, -1], SamplingParams(), [2], 0.0))
    tok.send(TokenizedRequest("bad-time", [5], SamplingParams(), [2], math.nan))
    tok.send(honest("last"))
    bad = [*HOSTILE, "empty-prompt", "bad-token", "bad-time"]
    replies = stage.run_until(lambda r: all(ended(r.get(k, [])) for k in ["first", "last", *bad]), tok)
    for rid in bad:
        (err,) = replies[rid]
        assert isinstance(err, RequestError) and err.status == 400, (rid, err)
    for rid in ("first", "last"):
        assert [t for m in replies[rid] for t in m.token_ids] == [7] * 5
    assert stage.service.scheduler.blocks.num_used_blocks == 0


def test_a_broken_result_for_one_beam_request_fails_it_alone(stage):
    tok = stage.tokenizer("tok-0")
    stage.nan_for.add("bad")
    beams = SamplingParams(max_tokens=4, use_beam_search=True, beam_width=2, n=2, ignore_eos=True)
    tok.send(TokenizedRequest("bad", [5, 6, 7], beams, [2], 0.0))
    tok.send(TokenizedRequest("good", [5, 6, 7], beams, [2], 0.0))
    tok.send(honest("plain"))
    replies = stage.run_until(lambda r: all(len(r.get(k, [])) >= n for k, n in
                                            (("bad", 1), ("good", 2), ("plain", 5))), tok)
    (err,) = replies["bad"]
    assert isinstance(err, RequestError) and err.status == 500 and err.error_type == "internal_error"
    assert [len(m.token_ids) for m in replies["good"]] == [4, 4]
    assert replies["plain"][-1].finish_reason == "length"
    assert stage.service.scheduler.blocks.num_used_blocks == 0

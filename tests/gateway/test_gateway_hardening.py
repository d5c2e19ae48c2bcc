"""The gateway against its own clients and a missing stage, over real (in-process) ZeroMQ
sockets: a request with n > 1 ends with its last choice, a reader that falls behind is
cut off, and admission refuses at once while any stage is down."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import Admission
from services.gateway.engine_client import EngineError
from services.gateway.watchdog import StageWatchdog
from shared.messages import AbortRequest, GenerateRequest, Heartbeat, SamplingParams, TokenDelta
from tests.gateway.engine_stand_ins import started, stopped

TWO = SamplingParams(max_tokens=8, temperature=0, n=2)
X = 87  # a token id of SmolLM2's vocabulary


def delta(rid, seq, finish=None):
    return TokenDelta(rid, [X], 3, finish, seq)


def run(tmp_path, contexts, smollm2_tokenizer, body, **kw):
    async def go():
        client, reader, (t,), sched, _ = await started(tmp_path, contexts, smollm2_tokenizer, **kw)
        try:
            return await body(client, t, sched)
        finally:
            await stopped(reader)

    return asyncio.run(go())


# --- n > 1: done with the last choice (item 3) -------------------------------------------


def test_leaving_after_the_first_of_two_choices_finished_aborts_the_request(tmp_path, contexts, smollm2_tokenizer):
    async def body(client, t, sched):
        async with client.open(GenerateRequest("cmpl-n", TWO, prompt="hi"), 10) as stream:
            await t.answer()
            await sched.take()
            sched.send(delta("cmpl-n", 0, "stop"), delta("cmpl-n", 1))
            assert (await stream.next()).finish_reason == "stop"
            assert (await stream.next()).seq_index == 1
        # the client left while choice 1 still ran: its sample must be aborted
        return await sched.take(AbortRequest)

    assert run(tmp_path, contexts, smollm2_tokenizer, body).request_id == "cmpl-n"


def test_a_lost_scheduler_still_ends_a_request_whose_first_choice_finished(tmp_path, contexts, smollm2_tokenizer):
    async def body(client, t, sched):
        async with client.open(GenerateRequest("cmpl-l", TWO, prompt="hi"), 5) as stream:
            await t.answer()
            await sched.take()
            sched.send(delta("cmpl-l", 0, "stop"))
            await stream.next()
            assert client.scheduler_lost("gone") == 1
            with pytest.raises(EngineError) as info:  # not a hang until the deadline
                await stream.next()
            return info.value.err

    err = run(tmp_path, contexts, smollm2_tokenizer, body)
    assert err.status == 503 and err.message == "gone"


def test_a_request_is_done_only_when_every_choice_finished(tmp_path, contexts, smollm2_tokenizer):
    async def body(client, t, sched):
        async with client.open(GenerateRequest("cmpl-d", TWO, prompt="hi"), 10) as stream:
            await t.answer()
            await sched.take()
            sched.send(delta("cmpl-d", 1, "length"), delta("cmpl-d", 0, "length"))
            await stream.next()
            assert not stream.done
            await stream.next()
            assert stream.done
        await sched.take(AbortRequest)  # nothing to abort: this must not come

    with pytest.raises(AssertionError, match="no AbortRequest"):
        run(tmp_path, contexts, smollm2_tokenizer, body)


# --- a reader that falls behind (item 5) ------------------------------------------------


def test_a_request_whose_reader_falls_behind_is_aborted_and_its_buffer_bounded(tmp_path, contexts, smollm2_tokenizer):
    async def body(client, t, sched):
        client.max_buffered = 8
        req = GenerateRequest("cmpl-s", SamplingParams(max_tokens=100, temperature=0), prompt="hi")
        async with client.open(req, 10) as stream:
            await t.answer()
            await sched.take()
            for _ in range(40):  # nobody reads meanwhile
                sched.send(delta("cmpl-s", 0))
            abort = await sched.take(AbortRequest)  # sent at once, not when the handler wakes up
            assert stream.queue.qsize() <= 9  # the bound, and the error that ends the stream
            got = 0
            with pytest.raises(EngineError) as info:
                while True:
                    await stream.next()
                    got += 1
            return abort, got, info.value.err, client

    abort, got, err, client = run(tmp_path, contexts, smollm2_tokenizer, body)
    assert abort.request_id == "cmpl-s" and got <= 8
    assert "fast enough" in err.message
    assert client.num_in_flight == 0


# --- admission counts every stage (item 10) ----------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def beat(stage, instance):
    return Heartbeat(stage, stage, 1, "ready", 0.0, None, instance)


def test_a_silent_executor_or_no_tokenizer_makes_admission_refuse_at_once():
    clock = Clock()
    dog = StageWatchdog(lambda i: 0, lambda m: 0, lost_after_s=3.0, clock=clock)
    adm = Admission(None, None, lambda: 0, lambda: dog.missing_stage)
    all_up = [beat("tokenizer", "T"), beat("scheduler", "S"), beat("executor", "E")]
    assert adm.check_capacity().status == 503  # nothing seen yet
    for b in all_up:
        dog.record(b)
    assert dog.missing_stage is None and adm.check_capacity() is None
    for _ in range(16):  # 4 s of checks; the executor is silent
        clock.now += 0.25
        dog.record(all_up[0])
        dog.record(all_up[1])
        dog.check()
    err = adm.check_capacity()
    assert err.status == 503 and "executor" in err.message and err.headers["Retry-After"]
    dog.record(beat("executor", "E2"))  # a restarted executor
    assert adm.check_capacity() is None
    for _ in range(16):  # now every tokenizer replica is silent
        clock.now += 0.25
        dog.record(all_up[1])
        dog.record(beat("executor", "E2"))
        dog.check()
    assert "tokenizer" in adm.check_capacity().message


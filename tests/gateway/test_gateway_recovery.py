"""The gateway's recovery and admission logic without processes: StageWatchdog, Admission, and
the EngineClient over real (in-process) ZeroMQ sockets, with stand-in tokenizer replicas and
a stand-in scheduler: a lost replica's unanswered requests are asked again, a restarted
scheduler's requests resume from what their clients have (sampled ones included, n samples
choice by choice), stop strings found here and aborts reach the engine."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.gateway.admission import Admission, api_key_from
from services.gateway.engine_client import EngineError, RequestTimeout
from services.gateway.watchdog import StageWatchdog
from shared.messages import (
    AbortRequest,
    FinishRequest,
    GenerateRequest,
    Heartbeat,
    SamplingParams,
    TokenDelta,
)
from tests.gateway.engine_stand_ins import EOS, started, stopped

GREEDY = SamplingParams(max_tokens=4, temperature=0)


# --- StageWatchdog ----------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def beat(stage, replica, instance, state="ready"):
    return Heartbeat(stage, replica, 1, state, 0.0, None, instance)


def make_watchdog():
    clock, lost = Clock(), {"tokenizer": [], "scheduler": [], "restarted": []}
    dog = StageWatchdog(lambda i: lost["tokenizer"].append(i) or 0,
                        lambda m: lost["scheduler"].append(m) or 0, lost_after_s=3.0, clock=clock,
                        on_scheduler_restarted=lambda *_: lost["restarted"].append(1) or 0, scheduler_give_up_s=20.0)
    return dog, clock, lost


def tick(dog, clock, seconds, step=0.25, keep=()):
    """Advance time in watchdog-sized steps, with the stages in keep still beating."""
    for _ in range(int(seconds / step)):
        clock.now += step
        for b in keep:
            dog.record(b)
        dog.check()


def test_watchdog_finds_a_silent_tokenizer_and_a_restarted_one():
    dog, clock, lost = make_watchdog()
    t0, t1, sched = beat("tokenizer", "t0", "A"), beat("tokenizer", "t1", "B"), beat("scheduler", "s", "S")
    for b in (t0, t1, sched):
        dog.record(b)
    tick(dog, clock, 2.0, keep=(t1, sched))
    assert lost["tokenizer"] == []
    tick(dog, clock, 1.5, keep=(t1, sched))
    assert lost["tokenizer"] == ["t0"]  # silent past 3 s (the callback gets the replica's name)
    dog.record(beat("tokenizer", "t1", "C"))  # t1 restarted faster than that
    assert lost["tokenizer"] == ["t0", "t1"]
    assert lost["scheduler"] == [] and dog.scheduler_available


def test_watchdog_resends_after_a_scheduler_restart_and_fails_requests_only_when_it_is_gone_for_good():
    dog, clock, lost = make_watchdog()
    assert not dog.scheduler_available  # none seen yet
    dog.record(beat("scheduler", "s", "S1"))
    tick(dog, clock, 4.0)
    assert not dog.scheduler_available  # silent: new requests are refused...
    assert lost["scheduler"] == [] and lost["restarted"] == []  # ...those in flight wait
    dog.record(beat("scheduler", "s", "S1"))  # it was only frozen: they go on
    assert dog.scheduler_available and lost["restarted"] == []
    tick(dog, clock, 4.0)
    dog.record(beat("scheduler", "s", "S2", "waiting for executor"))  # restarted: it knows none of them
    assert dog.scheduler_available and lost["restarted"] == [1] and lost["scheduler"] == []
    dog.record(beat("scheduler", "s", "S3"))  # a restart quicker than the silence timeout
    assert lost["restarted"] == [1, 1]
    tick(dog, clock, 21.0)  # gone for good: the requests in flight end with an error, once
    assert len(lost["scheduler"]) == 1 and "gone" in lost["scheduler"][0]
    tick(dog, clock, 5.0)
    dog.record(beat("scheduler", "s", "S4"))
    assert len(lost["scheduler"]) == 1 and lost["restarted"] == [1, 1]  # nothing left to resend
    assert dog.scheduler_available


def test_a_late_check_declares_nothing():
    dog, clock, lost = make_watchdog()
    dog.record(beat("tokenizer", "t0", "A"))
    dog.check()
    clock.now += 10  # the event loop stalled: beats may be waiting unread
    dog.check()
    assert lost["tokenizer"] == []
    clock.now += 0.25
    dog.check()
    assert lost["tokenizer"] == ["t0"]


# --- Admission --------------------------------------------------------------------------


class FakeRequest:
    def __init__(self, path, auth=None):
        self.path = path
        self.headers = {"Authorization": auth} if auth else {}


def test_api_key_guards_every_route_but_the_openapi_description(monkeypatch):
    adm = Admission("s3cret", None, lambda: 0, lambda: None)
    assert adm.check_key(FakeRequest("/v1/completions")).status == 401
    assert adm.check_key(FakeRequest("/v1/models", "Bearer wrong")).status == 401
    assert adm.check_key(FakeRequest("/v1/models", "Bearer s3cret")) is None
    for path in ("/health", "/metrics"):
        assert adm.check_key(FakeRequest(path)).status == 401
        assert adm.check_key(FakeRequest(path, "Bearer s3cret")) is None
    assert adm.check_key(FakeRequest("/openapi.json")) is None
    public = Admission("s3cret", None, lambda: 0, lambda: None, metrics_public=True)
    assert public.check_key(FakeRequest("/health")) is None and public.check_key(FakeRequest("/metrics")) is None
    assert public.check_key(FakeRequest("/v1/models")).status == 401
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert api_key_from(None) == "from-env" and api_key_from("flag") == "flag"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "")
    assert api_key_from(None) is None


def test_capacity_refusals_in_order():
    waiting, scheduler = [0], [True]
    adm = Admission(None, 2, lambda: waiting[0], lambda: None if scheduler[0] else "scheduler")
    assert adm.check_capacity() is None
    waiting[0] = 2
    err = adm.check_capacity()
    assert err.status == 429 and err.headers["Retry-After"] == "1"
    scheduler[0] = False
    assert adm.check_capacity().status == 503
    adm.draining = True
    err = adm.check_capacity()
    assert err.status == 503 and "shutting down" in err.message


# --- EngineClient recovery, over real sockets ----------------------------------------------


SAMPLED = SamplingParams(max_tokens=6)  # temperature 1, no seed: the API's default request


def test_a_replica_lost_before_it_answered_is_replaced_and_one_lost_after_changes_nothing(tmp_path, contexts, smollm2_tokenizer):
    async def go():
        client, reader, (a, b), sched, retries = await started(tmp_path, contexts, smollm2_tokenizer, ("a", "b"))
        async with client.open(GenerateRequest("cmpl-1", SAMPLED, prompt="hi"), 10) as stream:
            first, other = (a, b) if stream.asked == "a" else (b, a)
            await first.take()  # ... and dies before it answers
            assert client.tokenizer_lost("nobody") == 0
            assert client.tokenizer_lost(stream.asked) == 1
            waiting = asyncio.get_running_loop().create_task(stream.next())
            await other.answer()
            forwarded = await sched.take()
            assert forwarded.request_id == "cmpl-1" and forwarded.prompt_token_ids == [5, 6, 7]
            assert client.tokenizer_lost("a") == client.tokenizer_lost("b") == 0  # nothing pinned to a replica
            sched.send(TokenDelta("cmpl-1", smollm2_tokenizer.encode(" Hello"), 3))
            assert (await waiting).text == " Hello"
            sched.send(TokenDelta("cmpl-1", smollm2_tokenizer.encode(" there"), 3, "length"))
            assert (await stream.next()).finish_reason == "length"
        assert retries == [1] and client.num_in_flight == 0
        assert not [m for m in sched.sock.recv_nowait() if isinstance(m[1], AbortRequest)]  # finished: no abort
        await stopped(reader)

    asyncio.run(go())


def test_a_restarted_scheduler_resumes_a_sampled_stream_from_what_the_client_has(tmp_path, contexts, smollm2_tokenizer):
    async def go():
        client, reader, (t,), sched, retries = await started(tmp_path, contexts, smollm2_tokenizer)
        async with client.open(GenerateRequest("cmpl-2", SAMPLED, prompt="hi"), 10) as stream:
            await t.answer()
            await sched.take()
            hello, there, friend = smollm2_tokenizer.encode(" Hello"), smollm2_tokenizer.encode(" there"), smollm2_tokenizer.encode(" friend")
            sched.send(TokenDelta("cmpl-2", hello, 3))
            assert (await stream.next()).text == " Hello"
            assert client.scheduler_restarted("engine-1") == 0
            assert client.scheduler_restarted("engine-0") == 1
            resumed = asyncio.get_running_loop().create_task(stream.next())
            again = await sched.take()
            assert again.request_id == "cmpl-2-r1" and again.output_token_ids == hello
            assert again.prompt_token_ids == [5, 6, 7] and again.params == msgspec.structs.replace(SAMPLED, n=1)
            assert (await sched.take(AbortRequest)).request_id == "cmpl-2"  # the old run, if anything runs it
            sched.send(TokenDelta("cmpl-2", there, 3))  # a late delta of the old run: not shown
            sched.send(TokenDelta("cmpl-2-r1", friend, 3), TokenDelta("cmpl-2-r1", [EOS], 3, "stop"))
            text = [(await resumed).text, (await stream.next()).text]
            assert text == [" friend", ""] and stream.done
        assert retries == [1]
        await stopped(reader)

    asyncio.run(go())


def test_each_unfinished_choice_of_n_samples_resumes_on_its_own_with_its_seed(tmp_path, contexts, smollm2_tokenizer):
    async def go():
        client, reader, (t,), sched, _ = await started(tmp_path, contexts, smollm2_tokenizer)
        params = SamplingParams(max_tokens=6, n=3, seed=40)
        async with client.open(GenerateRequest("cmpl-3", params, prompt="hi"), 10) as stream:
            await t.answer()
            await sched.take()
            a, b = smollm2_tokenizer.encode(" A"), smollm2_tokenizer.encode(" B")
            sched.send(TokenDelta("cmpl-3", a, 3, seq_index=0), TokenDelta("cmpl-3", b, 3, "length", seq_index=1))
            got = [await stream.next(), await stream.next()]
            assert [(d.seq_index, d.text, d.finish_reason) for d in got] == [(0, " A", None), (1, " B", "length")]
            assert client.scheduler_restarted("engine-0") == 1
            resumed = asyncio.get_running_loop().create_task(stream.next())
            runs = {m.request_id: m for m in [await sched.take(), await sched.take()]}
            assert sorted(runs) == ["cmpl-3-r1-0", "cmpl-3-r1-2"]  # choice 1 had finished
            assert runs["cmpl-3-r1-0"].output_token_ids == a and runs["cmpl-3-r1-0"].params.seed == 40
            assert runs["cmpl-3-r1-2"].output_token_ids == [] and runs["cmpl-3-r1-2"].params.seed == 42
            assert all(m.params.n == 1 for m in runs.values())
            sched.send(TokenDelta("cmpl-3-r1-2", b, 3, "length"))  # each run's seq_index is 0
            sched.send(TokenDelta("cmpl-3-r1-0", a, 3, "length"))
            got = [await resumed, await stream.next()]
            assert [(d.seq_index, d.text, d.finish_reason) for d in got] == [(2, " B", "length"), (0, " A", "length")]
            assert stream.done and got[-1].num_output_tokens == 2
        await stopped(reader)

    asyncio.run(go())


def test_a_stop_string_found_here_ends_the_sequence_at_its_engine(tmp_path, contexts, smollm2_tokenizer):
    async def go():
        client, reader, (t,), sched, _ = await started(tmp_path, contexts, smollm2_tokenizer)
        async with client.open(GenerateRequest("cmpl-4", SamplingParams(max_tokens=30, stop=["STOP"]),
                                               prompt="hi"), 10) as stream:
            await t.answer()
            await sched.take()
            sched.send(*(TokenDelta("cmpl-4", [i], 3) for i in smollm2_tokenizer.encode("go STOP more")))
            texts = []
            while not stream.done:
                texts.append((await stream.next()).text)
            assert "".join(texts) == "go "
            assert (await sched.take(FinishRequest)) == FinishRequest("cmpl-4", "stop", 0)
        await stopped(reader)

    asyncio.run(go())


def test_deltas_nobody_reads_are_aborted_once_and_an_abort_follows_its_request(tmp_path, contexts, smollm2_tokenizer):
    async def go():
        client, reader, (t,), sched, _ = await started(tmp_path, contexts, smollm2_tokenizer)
        async with client.open(GenerateRequest("cmpl-5", SAMPLED, prompt="hi"), 10):
            await t.answer()
            await sched.take()
        # left before its end: the abort goes to its engine after the request, on the same pipe
        assert (await sched.take(AbortRequest)).request_id == "cmpl-5"
        sched.sock.send(sched.peer, TokenDelta("zombie", [5], 3))
        sched.sock.send(sched.peer, TokenDelta("zombie", [6], 3))
        assert (await sched.take(AbortRequest)).request_id == "zombie"
        await asyncio.sleep(0.2)
        assert not [m for _, m in sched.sock.recv_nowait() if isinstance(m, AbortRequest)]  # once
        await stopped(reader)

    asyncio.run(go())


def test_scheduler_loss_ends_every_request_with_503(tmp_path, contexts, smollm2_tokenizer):
    async def go():
        client, reader, (t,), sched, _ = await started(tmp_path, contexts, smollm2_tokenizer)
        async with client.open(GenerateRequest("cmpl-6", SAMPLED, prompt="hi"), 10) as stream:
            await t.answer()
            await sched.take()
            assert client.num_waiting == 1
            assert client.scheduler_lost("gone") == 1
            with pytest.raises(EngineError) as info:
                await stream.next()
            assert info.value.err.status == 503 and info.value.err.message == "gone"
        assert (await sched.take(AbortRequest)).request_id == "cmpl-6"
        await stopped(reader)

    asyncio.run(go())


# --- hung replicas: found out, routed around --------------------------


def test_a_stuck_or_silent_tokenizer_is_no_longer_live():
    dog, clock, lost = make_watchdog()
    t0, t1, sched = beat("tokenizer", "t0", "A"), beat("tokenizer", "t1", "B"), beat("scheduler", "s", "S")
    dog.record(beat("tokenizer", "t2", "L", state="loading tokenizer"))
    for b in (t0, t1, sched):
        dog.record(b)
    assert dog.live_tokenizers() == ["t0", "t1"]  # a loading replica takes nothing yet
    dog.record(beat("tokenizer", "t0", "A", state="stuck: no progress for 5 s"))  # its loop hangs
    assert lost["tokenizer"] == ["t0"] and dog.live_tokenizers() == ["t1"]
    dog.record(beat("tokenizer", "t0", "A", state="stuck: no progress for 6 s"))
    assert lost["tokenizer"] == ["t0"]  # lost once
    tick(dog, clock, 3.5, keep=(sched, beat("tokenizer", "t2", "L", state="loading tokenizer")))
    assert lost["tokenizer"] == ["t0", "t1"] and dog.live_tokenizers() == []  # t1 silent (SIGSTOP)
    dog.record(t1)  # thawed: beats again, takes work again
    assert dog.live_tokenizers() == ["t1"]


def test_requests_go_only_to_live_replicas(tmp_path, contexts, smollm2_tokenizer):
    async def go():
        live = ["a", "b"]
        client, reader, (a, b), sched, _ = await started(tmp_path, contexts, smollm2_tokenizer, live)
        asked = []
        for i in range(4):  # round robin over both
            async with client.open(GenerateRequest(f"r{i}", GREEDY, prompt="hi"), 10) as stream:
                asked.append(stream.asked)
                assert (await (a if stream.asked == "a" else b).take()).request_id == f"r{i}"
        assert sorted(asked) == ["a", "a", "b", "b"]
        live.remove("a")  # a hangs: nothing more goes to it
        for i in range(3):
            async with client.open(GenerateRequest(f"s{i}", GREEDY, prompt="hi"), 10) as stream:
                assert stream.asked == "b"
                await b.take()
        assert [m for m in a.inbox.recv_nowait() if isinstance(m, GenerateRequest)] == []
        live.clear()  # none left: a request waits for one, within its deadline
        with pytest.raises(RequestTimeout):
            async with client.open(GenerateRequest("late", GREEDY, prompt="hi"), 0.3):
                pass
        await stopped(reader)

    asyncio.run(go())

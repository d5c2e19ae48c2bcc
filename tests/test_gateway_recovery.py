"""The gateway's recovery and admission logic without processes: Replay, StageWatchdog,
Admission, and the EngineClient's retry of a lost replica's requests over real
(in-process) ZeroMQ sockets."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from services.gateway.admission import Admission, api_key_from
from services.gateway.engine_client import EngineClient, EngineError, RequestTimeout
from services.gateway.replay import Replay, ReplayDiverged
from services.gateway.watchdog import StageWatchdog
from shared.config import Addresses
from shared.messages import (
    AbortRequest,
    GatewayToTokenizer,
    GenerateRequest,
    Heartbeat,
    RequestAccepted,
    SamplingParams,
    TextDelta,
    TokenizerToGateway,
)
from shared.transport import DealerSocket, PushSocket

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def delta(text, ids, n_out, finish=None, rid="r"):
    return TextDelta(rid, text, 3, n_out, finish, ids)


# --- Replay -----------------------------------------------------------------------------


def test_replay_swallows_what_the_client_already_has():
    replay = Replay(GREEDY)
    assert replay.filter(delta("Hel", [1], 1)) is not None
    assert replay.filter(delta("lo", [2], 2)) is not None
    replay.restart()
    assert replay.filter(delta("Hel", [1], 1)) is None
    # a delta straddling the boundary passes only its new part
    out = replay.filter(delta("lo wo", [2, 3], 3))
    assert (out.text, out.token_ids, out.num_output_tokens) == (" wo", [3], 3)
    out = replay.filter(delta("rld", [4], 4, "length"))
    assert (out.text, out.finish_reason) == ("rld", "length")


def test_replay_detects_divergence_and_refuses_unseeded_samples_already_sent():
    replay = Replay(GREEDY)
    replay.filter(delta("a", [1], 1))
    replay.restart()
    with pytest.raises(ReplayDiverged):
        replay.filter(delta("b", [9], 1))

    sampled = Replay(SamplingParams(temperature=0.8))
    assert sampled.can_restart()  # nothing sent yet: any run is as good
    sampled.filter(delta("x", [5], 1))
    assert not sampled.can_restart()
    assert Replay(SamplingParams(temperature=0.8, seed=3)).can_restart()


def test_replay_skips_each_choice_of_a_seeded_n2_request_on_its_own():
    replay = Replay(SamplingParams(temperature=0.8, seed=5, n=2))
    assert replay.can_restart()

    def d(seq, text, ids, finish=None):
        return TextDelta("r", text, 3, len(ids), finish, ids, seq)

    assert replay.filter(d(0, "a", [1])) is not None
    assert replay.filter(d(1, "x", [7], "length")) is not None  # choice 1 finished
    assert replay.filter(d(0, "b", [2])) is not None
    replay.restart()
    assert replay.can_restart()
    assert replay.filter(d(1, "x", [7], "length")) is None  # finished already: not again
    assert replay.filter(d(0, "a", [1])) is None
    out = replay.filter(d(0, "bc", [2, 3]))
    assert (out.seq_index, out.text, out.token_ids) == (0, "c", [3])
    with pytest.raises(ReplayDiverged):
        replay.restart()
        replay.filter(d(0, "z", [9]))
    unseeded = Replay(SamplingParams(temperature=0.8, n=2))
    unseeded.filter(d(1, "x", [7]))
    assert not unseeded.can_restart()


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
    assert lost["tokenizer"] == ["A"]  # silent past 3 s
    dog.record(beat("tokenizer", "t1", "C"))  # t1 restarted faster than that
    assert lost["tokenizer"] == ["A", "B"]
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
    assert lost["tokenizer"] == ["A"]


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


# --- EngineClient retry, over real sockets ------------------------------------------------


class FakeTokenizer:
    """Plays a tokenizer replica with the test's own sockets: takes requests, answers."""

    def __init__(self, ctx, addrs, instance):
        self.inbox = DealerSocket(ctx, addrs.tokenizer_in, GatewayToTokenizer, identity=instance)
        self.out = PushSocket(ctx, addrs.gateway_in, TokenizerToGateway, bind=False)
        self.instance = instance
        self.received: list = []

    async def take(self, kind=GenerateRequest):
        for _ in range(200):
            self.received += self.inbox.recv_nowait()
            for msg in self.received:
                if isinstance(msg, kind):
                    self.received.remove(msg)
                    return msg
            await asyncio.sleep(0.01)
        raise AssertionError(f"no {kind.__name__}")


@pytest.fixture()
def contexts():
    ctx, sync = zmq.asyncio.Context(), zmq.Context()
    yield ctx, sync
    # destroy closes every socket first: a context left to the garbage collector would
    # block in term() on its open sockets, wherever the collection happens to run
    ctx.destroy(linger=0)
    sync.destroy(linger=0)


def test_a_lost_replicas_stream_is_resent_and_resumes_without_repeating(tmp_path, contexts):
    async def go():
        ctx, sync = contexts
        addrs = Addresses.ipc(str(tmp_path))
        retries = []
        client = EngineClient(ctx, addrs, on_retry=lambda: retries.append(1), replicas=lambda: ["dead"])
        reader = asyncio.get_running_loop().create_task(client.run_reader())
        tok = FakeTokenizer(sync, addrs, "dead")
        req = GenerateRequest("cmpl-1", GREEDY, prompt="hi")
        async with client.open(req, 10) as stream:
            got = await tok.take()
            tok.out.send(RequestAccepted(got.request_id, "t0", "dead"))
            tok.out.send(delta("Hel", [1], 1, rid=got.request_id))
            assert (await stream.next()).text == "Hel"
            assert client.replica_lost("other") == 0
            assert client.replica_lost("dead") == 1
            retry_task = asyncio.get_running_loop().create_task(stream.next())
            abort = await tok.take(AbortRequest)
            again = await tok.take()
            assert abort.request_id == "cmpl-1" and again.request_id == "cmpl-1-retry1"
            assert again.params == GREEDY and again.prompt == "hi"
            for msg in (delta("Hel", [1], 1, rid=again.request_id), delta("lo", [2], 2, "length", again.request_id)):
                tok.out.send(msg)
            last = await retry_task
            assert (last.text, last.token_ids, last.finish_reason) == ("lo", [2], "length")
        assert retries == [1] and client.num_in_flight == 0
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)

    asyncio.run(go())


def test_scheduler_loss_ends_every_request_with_503(tmp_path, contexts):
    async def go():
        ctx, sync = contexts
        addrs = Addresses.ipc(str(tmp_path))
        client = EngineClient(ctx, addrs, replicas=lambda: ["t"])
        tok = FakeTokenizer(sync, addrs, "t")
        async with client.open(GenerateRequest("cmpl-2", GREEDY, prompt="hi"), 10) as stream:
            await tok.take()
            assert client.num_waiting == 1
            assert client.scheduler_lost("gone") == 1
            with pytest.raises(EngineError) as info:
                await stream.next()
            assert info.value.err.status == 503 and info.value.err.message == "gone"
        assert (await tok.take(AbortRequest)).request_id == "cmpl-2"  # the tokenizer forgets it

    asyncio.run(go())


def test_a_restarted_scheduler_gets_every_request_again_and_streams_resume(tmp_path, contexts):
    async def go():
        ctx, sync = contexts
        addrs = Addresses.ipc(str(tmp_path))
        client = EngineClient(ctx, addrs, replicas=lambda: ["t"])
        reader = asyncio.get_running_loop().create_task(client.run_reader())
        tok = FakeTokenizer(sync, addrs, "t")
        async with client.open(GenerateRequest("cmpl-3", GREEDY, prompt="hi"), 10) as stream:
            got = await tok.take()
            tok.out.send(RequestAccepted(got.request_id, "t", "t"))
            tok.out.send(delta("Hel", [1], 1, rid=got.request_id))
            assert (await stream.next()).text == "Hel"
            assert client.scheduler_restarted() == 1
            resumed = asyncio.get_running_loop().create_task(stream.next())
            assert (await tok.take(AbortRequest)).request_id == "cmpl-3"
            again = await tok.take()
            assert again.request_id == "cmpl-3-retry1" and again.prompt == "hi"
            tok.out.send(delta("Hel", [1], 1, rid=again.request_id))  # regenerated: not shown twice
            tok.out.send(delta("lo", [2], 2, "length", again.request_id))
            last = await resumed
            assert (last.text, last.token_ids, last.finish_reason) == ("lo", [2], "length")
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)

    asyncio.run(go())


# --- hung replicas: found out, routed around; aborts to the owner --------------------------


def test_a_stuck_or_silent_tokenizer_is_no_longer_live():
    dog, clock, lost = make_watchdog()
    t0, t1, sched = beat("tokenizer", "t0", "A"), beat("tokenizer", "t1", "B"), beat("scheduler", "s", "S")
    dog.record(beat("tokenizer", "t2", "L", state="loading tokenizer"))
    for b in (t0, t1, sched):
        dog.record(b)
    assert dog.live_tokenizers() == ["t0", "t1"]  # a loading replica takes nothing yet
    dog.record(beat("tokenizer", "t0", "A", state="stuck: no progress for 5 s"))  # its loop hangs
    assert lost["tokenizer"] == ["A"] and dog.live_tokenizers() == ["t1"]
    dog.record(beat("tokenizer", "t0", "A", state="stuck: no progress for 6 s"))
    assert lost["tokenizer"] == ["A"]  # lost once
    tick(dog, clock, 3.5, keep=(sched, beat("tokenizer", "t2", "L", state="loading tokenizer")))
    assert lost["tokenizer"] == ["A", "B"] and dog.live_tokenizers() == []  # t1 silent (SIGSTOP)
    dog.record(t1)  # thawed: beats again, takes work again
    assert dog.live_tokenizers() == ["t1"]


def test_requests_go_only_to_live_replicas_and_aborts_to_their_owner(tmp_path, contexts):
    async def go():
        ctx, sync = contexts
        addrs = Addresses.ipc(str(tmp_path))
        live = ["a", "b"]
        client = EngineClient(ctx, addrs, replicas=lambda: list(live))
        a, b = FakeTokenizer(sync, addrs, "a"), FakeTokenizer(sync, addrs, "b")
        await asyncio.sleep(0.3)  # both connected (a replica not yet connected is skipped)
        owners = {}
        for i in range(4):  # round robin over both
            async with client.open(GenerateRequest(f"r{i}", GREEDY, prompt="hi"), 10) as stream:
                owners[stream.request_id] = stream.sent_to
            # left before the end: the abort goes to the replica that has the request
            owner, other = (a, b) if stream.sent_to == "a" else (b, a)
            assert (await owner.take()).request_id == f"r{i}"
            assert (await owner.take(AbortRequest)).request_id == f"r{i}"
            assert not [m for m in other.inbox.recv_nowait() if isinstance(m, AbortRequest)]
        assert sorted(owners.values()) == ["a", "a", "b", "b"]
        live.remove("a")  # a hangs: nothing more goes to it
        for i in range(3):
            async with client.open(GenerateRequest(f"s{i}", GREEDY, prompt="hi"), 10) as stream:
                assert stream.sent_to == "b"
                await b.take()
        assert [m for m in a.inbox.recv_nowait() if isinstance(m, GenerateRequest)] == []
        live.clear()  # none left: a request waits for one, within its deadline
        with pytest.raises(RequestTimeout):
            async with client.open(GenerateRequest("late", GREEDY, prompt="hi"), 0.3):
                pass

    asyncio.run(go())

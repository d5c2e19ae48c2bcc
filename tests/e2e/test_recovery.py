"""Recovery under `pagedserve serve` on the tiny model, with real processes and kill -9.

- Garbage frames on every socket the gateway and the scheduler bind: logged, dropped,
  and the server keeps serving.
- The executor dies under load: the launcher restarts it, the scheduler recomputes, and
  every request completes with the output of an undisturbed run.
- The scheduler dies under 32 streams: the gateway sends every request in flight again
  to the restarted scheduler and each stream completes as an undisturbed run would.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import msgspec
import pytest
import zmq

from shared.messages import Heartbeat, TokenDelta
from tests.e2e.load import dumps, greedy, prompts, run_load
from tests.helpers import ServerProcess, get

ERROR_BOUND_S = 30.0  # the load hit by a scheduler death ends within this


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama"]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("recovery"), extra) as srv:
        yield srv


def ready_pid(server, stage: str) -> int | None:
    try:
        return server.stage_pid(stage)
    except AssertionError:  # no ready replica of it yet
        return None


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def serves(server) -> bool:
    results = asyncio.run(run_load(server.url, [greedy([5, 6, 7], 3)], []))
    return results[0][0] == 200 and len(results[0][1]) == 3


GARBAGE = [b"", b"\x00garbage\xff", os.urandom(64), msgspec.msgpack.encode({"type": "Nope", "x": 1}),
           msgspec.msgpack.encode([1, 2, 3])]


def test_garbage_frames_on_every_bound_socket_are_dropped(server):
    ctx = zmq.Context()
    wrong = {  # well-formed messages of a type the socket does not carry
        "gateway-in": msgspec.msgpack.encode(Heartbeat("x", "x", 1, "ready", 0.0)),
        "status": msgspec.msgpack.encode(TokenDelta("x", [1], 1)),
        "executor-out": msgspec.msgpack.encode(Heartbeat("x", "x", 1, "ready", 0.0)),
        "scheduler-in": msgspec.msgpack.encode(TokenDelta("x", [1], 1)),
    }
    try:
        for name, frame in wrong.items():
            address = f"ipc://{server.run_dir}/{name}.ipc"
            kind = zmq.DEALER if name == "scheduler-in" else zmq.PUSH
            sock = ctx.socket(kind)
            sock.connect(address)
            for junk in [*GARBAGE, frame]:
                sock.send(junk)
            if kind == zmq.DEALER:
                sock.send_multipart([b"two", b"parts"])  # the router sees three frames
    finally:
        ctx.destroy(linger=1000)  # closes what an assertion may have left open, then waits for the sends
    wait_until(lambda: server.log().count("dropped") >= 4 * len(GARBAGE), 10, "the drops to be logged")
    for name in wrong:
        assert f"{name}.ipc" in server.log(), name
    assert serves(server)
    assert get(server.url + "/health")[0] == 200


def test_executor_killed_under_load_recomputes_every_request(server):
    bodies = [greedy(p, 96) for p in prompts(10, seed=11)]
    stream_bodies = [greedy(p, 96, stream=True) for p in prompts(2, seed=12)]
    reference = asyncio.run(run_load(server.url, bodies, stream_bodies))
    assert all(r[0] == 200 for r in reference), dumps(reference)
    old_pid = server.stage_pid("executor")
    preemptions = server.metrics()["pagedserve_num_preemptions_total"]

    killed = []

    def kill_on_first_chunk():
        # Killed from the chunk callback itself: waking another task first can let a fast
        # machine finish every request before the executor dies.
        if not killed:
            os.kill(old_pid, signal.SIGKILL)
            killed.append(time.monotonic())

    results = asyncio.run(run_load(server.url, bodies, stream_bodies, on_chunk=kill_on_first_chunk))
    assert killed
    assert results == reference, server.log()
    new_pid = wait_until(lambda: server.stage_pid("executor"), 30, "a new executor")
    assert new_pid != old_pid
    # recomputed, not restarted; the gateway mirrors the count from the scheduler's next heartbeat
    wait_until(lambda: server.metrics()["pagedserve_num_preemptions_total"] > preemptions, 15,
               "the preemptions counted")
    server.wait_blocks_free()


def test_scheduler_killed_under_32_streams_loses_nothing(server):
    stream_bodies = [greedy(p, 40, stream=True) for p in prompts(32, seed=21)]
    reference = asyncio.run(run_load(server.url, [], stream_bodies))
    assert all(r[0] == 200 and r[3] is None and r[4] for r in reference), dumps(reference)
    old_pid = server.stage_pid("scheduler")
    before = server.metrics()
    chunks, killed = [0], []

    def kill_mid_stream():
        chunks[0] += 1
        if chunks[0] == 200 and not killed:  # every stream has started, none has finished
            os.kill(old_pid, signal.SIGKILL)
            killed.append(time.monotonic())

    results = asyncio.run(run_load(server.url, [], stream_bodies, on_chunk=kill_mid_stream))
    assert killed
    assert results == reference, server.log()  # same tokens, no repeats, no error events, [DONE]
    assert time.monotonic() - killed[0] < ERROR_BOUND_S
    # /health shows a stage as of its last heartbeat: on a quiet host the resumed streams can end
    # within one beat of the new scheduler's readiness, while /health still says "waiting for executor"
    assert wait_until(lambda: ready_pid(server, "scheduler"), 15, "a ready scheduler") != old_pid
    after = server.metrics()
    assert after["pagedserve_request_retries_total"] > before["pagedserve_request_retries_total"]
    assert after.get("pagedserve_requests_lost_total", 0) == before.get("pagedserve_requests_lost_total", 0)
    assert json.loads(get(server.url + "/health")[1])["requests_in_flight"] == 0
    server.wait_blocks_free()

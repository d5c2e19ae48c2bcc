"""Stages that hang instead of dying (SIGSTOP), under `pagedserve serve` on the tiny model
with two tokenizer replicas and a short step deadline:

- a frozen executor misses the step deadline: the scheduler treats it as lost (its
  requests preempted), /health says so, and once thawed it recomputes them to the
  output of an undisturbed run;
- a frozen tokenizer replica is found by its missing heartbeats and routed around: new
  requests go to the other replica, those it had not answered are asked of that one, and
  those already on the engine never notice: every output unchanged.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from tests.e2e.load import dumps, greedy, prompts, run_load
from tests.helpers import ServerProcess, get

STEP_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama", "--tokenizer-replicas", "2",
             "--step-timeout", str(STEP_TIMEOUT_S)]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("stalls"), extra) as srv:
        yield srv


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def health(server) -> tuple[int, dict]:
    status, body = get(server.url + "/health")
    return status, json.loads(body)


def scheduler_state(server) -> str:
    return health(server)[1]["stages"]["scheduler"][0]["state"]


def test_a_frozen_executor_misses_the_step_deadline_and_its_requests_are_recomputed(server):
    bodies = [greedy(p, 24) for p in prompts(4, seed=31)]
    stream_bodies = [greedy(p, 24, stream=True) for p in prompts(2, seed=32)]
    reference = asyncio.run(run_load(server.url, bodies, stream_bodies))
    assert all(r[0] == 200 for r in reference), dumps(reference)
    pid = server.stage_pid("executor")
    preemptions = server.metrics()["pagedserve_num_preemptions_total"]

    async def disturbed():
        frozen = []

        def freeze_on_first_chunk():
            if not frozen:
                os.kill(pid, signal.SIGSTOP)
                frozen.append(time.monotonic())

        task = asyncio.create_task(run_load(server.url, bodies, stream_bodies, on_chunk=freeze_on_first_chunk))
        try:
            await asyncio.to_thread(wait_until, lambda: frozen, 60, "the first chunk")
            state = await asyncio.to_thread(
                wait_until, lambda: scheduler_state(server).startswith("executor lost") and scheduler_state(server),
                10 + STEP_TIMEOUT_S, "the scheduler to give the executor up")
            status, body = await asyncio.to_thread(health, server)
        finally:
            os.kill(pid, signal.SIGCONT)
        return await task, state, status, body

    results, state, status, body = asyncio.run(disturbed())
    assert "unanswered" in state
    assert status == 503 and "scheduler" in body["not_ready"], body
    assert results == reference, server.log()
    assert server.stage_pid("executor") == pid  # thawed, not restarted
    wait_until(lambda: server.metrics()["pagedserve_num_preemptions_total"] > preemptions, 5,
               "the preemptions in the scheduler's next heartbeat")
    wait_until(lambda: health(server)[0] == 200, 10, "healthy again")
    server.wait_blocks_free()


def tokenizer_pids(server) -> dict[str, int]:
    return {r["replica"]: r["pid"] for r in health(server)[1]["stages"]["tokenizer"] if r["ready"]}


def test_a_frozen_tokenizer_replica_is_routed_around_and_its_requests_replayed(server):
    bodies = [greedy(p, 32) for p in prompts(8, seed=41)]
    stream_bodies = [greedy(p, 32, stream=True) for p in prompts(8, seed=42)]
    reference = asyncio.run(run_load(server.url, bodies, stream_bodies))
    assert all(r[0] == 200 for r in reference), dumps(reference)
    replicas = wait_until(lambda: len(tokenizer_pids(server)) == 2 and tokenizer_pids(server), 10, "two replicas")
    frozen_name, frozen_pid = sorted(replicas.items())[0]
    retries = server.metrics()["pagedserve_request_retries_total"]

    async def disturbed():
        frozen = []

        def freeze_on_first_chunk():
            if not frozen:
                os.kill(frozen_pid, signal.SIGSTOP)
                frozen.append(time.monotonic())

        try:
            results = await run_load(server.url, bodies, stream_bodies, on_chunk=freeze_on_first_chunk)
            # still frozen: new requests go to the other replica only, and complete at once
            started = time.monotonic()
            later = await run_load(server.url, bodies[:4], stream_bodies[:4])
            return results, later, time.monotonic() - started, time.monotonic() - frozen[0]
        finally:
            os.kill(frozen_pid, signal.SIGCONT)

    results, later, later_s, frozen_s = asyncio.run(disturbed())
    assert results == reference, server.log()
    assert later == reference[:4] + reference[8:12]
    assert later_s < 10, later_s
    assert all(r[3] is None and r[4] for r in results[len(bodies):])  # streams: no error, [DONE]
    assert server.metrics()["pagedserve_request_retries_total"] >= retries  # only unanswered requests are asked again
    assert frozen_s < 30
    # thawed, it beats again and serves again; what it held was aborted and freed
    wait_until(lambda: frozen_name in tokenizer_pids(server), 10, "the thawed replica")
    assert tokenizer_pids(server) == replicas  # nothing restarted
    server.wait_blocks_free()

"""Data parallelism on the tiny model: `pagedserve serve --data-parallel-size 2`.

64 greedy requests sharing 4 system prompts (3 full blocks each), sent as a first wave of
one request per system prompt, then the other 60 at once, to two engines with prefix-aware
routing and to one engine: neither engine gets more than 70% of the requests, every output
equals the single engine's, and the two engines' prefix-cache hit rate is at least the
single engine's, less one cold prefill per request the load cap spilled (at most 2) (read once the engines' heartbeats have counted every prompt: /metrics
lags the last requests by a heartbeat). A cold system prompt sent 48 times at once spills
to the second engine under the load cap, at the cost of one cold prefill there (the
requests after the first on each engine wait for its prefill, so they hit). Then one
engine's scheduler is frozen (SIGSTOP) under load, and later its scheduler and executor
are killed (-9) under load: every request completes, with the single engine's output.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.load import dumps, greedy, run_load
from tests.helpers import ServerProcess, get

SYSTEM_TOKENS = 48  # 3 blocks of 16
PROMPT_TOKENS = SYSTEM_TOKENS + 3


def bodies(max_tokens: int) -> list[dict]:
    out = []
    for i in range(64):
        system = [100 + 1000 * (i % 4) + k for k in range(SYSTEM_TOKENS)]
        out.append(greedy(system + [5000 + i, 7 + i % 3, 8], max_tokens))
    return out


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama", "--executor-threads", "1",
             "--num-kv-blocks", "1024"]
    dp = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("dp2"), [*extra, "--data-parallel-size", "2"])
    single = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("dp1"), extra)
    with ThreadPoolExecutor(2) as pool:  # both start at once
        started = [pool.submit(srv.__enter__) for srv in (dp, single)]
    try:
        for future in started:
            future.result()
        wait_engines_serving(dp, 2)
        yield single, dp
    finally:
        for srv in (dp, single):
            if srv.proc is not None:
                srv.__exit__(None, None, None)


def wait_engines_serving(server, n: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = json.loads(get(server.url + "/health")[1]).get("engines", {})
        if sum(e["serving"] for e in engines.values()) >= n:
            return engines
        time.sleep(0.2)
    raise AssertionError(f"not {n} engines serving: {engines}\n{server.log()}")


def in_waves(url: str, load: list[dict], **kw) -> list[tuple]:
    first = asyncio.run(run_load(url, load[:4], []))
    return first + asyncio.run(run_load(url, load[4:], [], **kw))


def hit_rate(server, before: dict, prompt_tokens: int, timeout: float = 20.0) -> float:
    """Prefix-cache hits per prompt token looked up since `before`, once the engines'
    heartbeats have counted all prompt_tokens (the figures lag the last steps)."""
    deadline = time.monotonic() + timeout
    while True:
        after = server.metrics()
        queries = after["pagedserve_prefix_cache_queries_total"] - before.get("pagedserve_prefix_cache_queries_total", 0)
        hits = after["pagedserve_prefix_cache_hits_total"] - before.get("pagedserve_prefix_cache_hits_total", 0)
        if queries >= prompt_tokens:
            assert queries == prompt_tokens, (queries, prompt_tokens)
            return hits / queries
        assert time.monotonic() < deadline, (queries, prompt_tokens)
        time.sleep(0.2)


def routing_log(server) -> str:
    """The router's spills and forgotten engines, from the server's log (for a failure's message)."""
    return "\n".join(line for line in server.log_path.read_text(errors="replace").splitlines()
                     if "spills" in line or "forgetting" in line)


def routed(server) -> dict[str, float]:
    m = server.metrics()
    return {k: v for k, v in m.items() if k.startswith("pagedserve_engine_requests_routed_total{")}


def test_prefix_routing_keeps_the_hit_rate_spreads_the_load_and_changes_no_output(servers):
    single, dp = servers
    load = bodies(8)
    before = (single.metrics(), dp.metrics())
    want = in_waves(single.url, load)
    got = in_waves(dp.url, load)
    assert all(r[0] == 200 for r in want), dumps(want)
    assert got == want, dumps(got)
    single_rate = hit_rate(single, before[0], 64 * PROMPT_TOKENS)
    dp_rate = hit_rate(dp, before[1], 64 * PROMPT_TOKENS)
    assert single_rate > 0.5  # the waves make 60 of 64 requests find their system prompt cached
    # The load cap may spill a request when one engine drains faster than the other (the CPU
    # is shared with the gateway and both executors): each spill costs one cold prefill of
    # its system prompt on the other engine, and no more.
    spills = routing_log(dp).count("spills")
    assert spills <= 2, routing_log(dp)
    assert dp_rate >= single_rate - spills * SYSTEM_TOKENS / (64 * PROMPT_TOKENS), (dp_rate, single_rate,
                                                                                   routing_log(dp))
    counts = routed(dp)
    assert len(counts) == 2 and sum(counts.values()) == 64, counts
    assert max(counts.values()) <= 0.7 * 64, counts
    health = json.loads(get(dp.url + "/health")[1])
    assert sorted(health["engines"]) == ["engine-0", "engine-1"]
    assert all(e["serving"] for e in health["engines"].values())
    text = get(dp.url + "/metrics")[1]
    assert 'pagedserve_engine_prefix_cache_hits_total{engine="engine-1"}' in text


def test_a_cold_prefix_burst_spills_at_the_cost_of_one_cold_prefill_per_engine(servers):
    single, dp = servers
    system = [30_000 + k for k in range(SYSTEM_TOKENS)]  # not cached anywhere yet
    load = [greedy(system + [6000 + i, 9, 10], 16) for i in range(48)]
    before = (single.metrics(), dp.metrics(), routed(dp))
    want = asyncio.run(run_load(single.url, load, []))
    got = asyncio.run(run_load(dp.url, load, []))
    assert got == want, dumps(got)
    tokens = 48 * PROMPT_TOKENS
    single_hits = hit_rate(single, before[0], tokens) * tokens
    dp_hits = hit_rate(dp, before[1], tokens) * tokens
    counts = {k: v - before[2].get(k, 0) for k, v in routed(dp).items()}
    assert all(n > 0 for n in counts.values()) and len(counts) == 2, counts  # it spilled
    assert max(counts.values()) <= 0.7 * 48, counts
    # the requests after the first on each engine waited for its prefill: one cold system prompt per engine
    assert round(dp_hits) >= round(single_hits) - SYSTEM_TOKENS, (dp_hits, single_hits, counts)


def engine_pids(server, engine: str, stages=("scheduler", "executor")) -> list[int]:
    found = json.loads(get(server.url + "/health")[1])["stages"]
    pids = [r["pid"] for stage in stages for r in found[stage] if r.get("engine") == engine and r["ready"]]
    assert len(pids) == len(stages), found
    return pids


def test_a_hung_engine_is_routed_around(servers):
    single, dp = servers
    load = bodies(12)
    want = asyncio.run(run_load(single.url, load, []))
    wait_engines_serving(dp, 2)
    frozen = engine_pids(dp, "engine-1", ("scheduler",))
    chunks = [0]

    def freeze_midway() -> None:
        chunks[0] += 1
        if chunks[0] == 60:
            os.kill(frozen[0], signal.SIGSTOP)

    try:
        streamed = asyncio.run(run_load(dp.url, [], load, on_chunk=freeze_midway))
        assert [(s, ids) for s, ids, *_ in streamed] == [(s, ids) for s, ids, _text in want], dumps(streamed)
        # the load may end before the silence is noticed: the frozen engine is still seen as such
        deadline = time.monotonic() + 20
        # the watchdog's line when it moved requests, else the router's when it forgot the engine's prefixes
        while not re.search(r"engine-1 (is )?not serving", dp.log()):
            assert time.monotonic() < deadline, dp.log()
            time.sleep(0.1)
    finally:
        os.kill(frozen[0], signal.SIGCONT)


def test_an_engine_killed_under_load_loses_no_request(servers):
    single, dp = servers
    load = bodies(16)
    want = asyncio.run(run_load(single.url, load, []))
    wait_engines_serving(dp, 2)
    victims = engine_pids(dp, "engine-1")
    chunks = [0]

    def kill_midway() -> None:
        chunks[0] += 1
        if chunks[0] == 100:  # requests are running on both engines by now
            for pid in victims:
                os.kill(pid, signal.SIGKILL)

    streamed = asyncio.run(run_load(dp.url, [], load, on_chunk=kill_midway))
    assert chunks[0] > 100
    assert [(s, ids) for s, ids, _text, error, done in streamed] == [(s, ids) for s, ids, _text in want], \
        dumps(streamed) + dp.log()
    assert all(error is None and done for *_, error, done in streamed), dumps(streamed)
    assert "lost; resuming" in dp.log()

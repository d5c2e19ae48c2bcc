"""compose.yaml's topology as plain processes on tcp:// loopback, two tokenizer replicas,
the API key from the environment as compose passes it; then one replica is killed
(kill -9) under load and every request still completes with the undisturbed output.
Last, compose.yaml + compose.dp.yaml (two engines as numbered services) as processes:
both engines serve, requests spread over them, outputs equal the one engine's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from tests.e2e.load import greedy, prompts, run_load, whole
from tests.e2e.topology import ComposeTopology
from tests.helpers import ROOT, get, parse_metrics

KEY = "topology-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def topology(tiny_model_dir, tmp_path_factory):
    env = {"PAGEDSERVE_API_KEY": KEY, "PAGEDSERVE_DTYPE": "float32"}
    with ComposeTopology(tiny_model_dir, tmp_path_factory.mktemp("topology"), tokenizers=2, env=env) as topo:
        yield topo


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "probe", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})})


def test_every_stage_serves_over_tcp_with_two_tokenizer_replicas(topology):
    assert get(topology.url + "/health")[0] == 401  # the key guards /health too (no --metrics-public)
    status, body = get(topology.url + "/health", headers=AUTH)
    health = json.loads(body)
    assert status == 200, health
    replicas = {r["replica"] for r in health["stages"]["tokenizer"] if r["ready"]}
    assert len(replicas) == 2, health
    for name, path in topology.health_files.items():  # the compose health checks, against these stages
        result = probe("--file", str(path))
        assert result.returncode == 0, (name, result.stderr)
    assert probe("--url", topology.url + "/health").returncode == 1
    assert probe("--url", topology.url + "/health", env={"PAGEDSERVE_API_KEY": KEY}).returncode == 0

    async def go():
        import aiohttp

        async with aiohttp.ClientSession() as s:
            refused = await whole(s, topology.url, greedy([5, 6, 7], 4))
            ok = [await whole(s, topology.url, greedy([5, 6, 7 + i], 4), AUTH) for i in range(4)]
            return refused, ok

    refused, ok = asyncio.run(go())
    assert refused[0] == 401 and refused[1] == "authentication_error"
    assert all(r[0] == 200 and len(r[1]) == 4 for r in ok), ok


def test_a_killed_tokenizer_replica_loses_no_request(topology):
    bodies = [greedy(p, 40) for p in prompts(10, seed=3)]
    stream_bodies = [greedy(p, 40, stream=True) for p in prompts(4, seed=4)]
    reference = asyncio.run(run_load(topology.url, bodies, stream_bodies, AUTH))
    assert all(r[0] == 200 for r in reference), reference
    retries_before = parse_metrics(get(topology.url + "/metrics", headers=AUTH)[1])["pagedserve_request_retries_total"]

    async def disturbed():
        chunks = asyncio.Event()
        task = asyncio.create_task(run_load(topology.url, bodies, stream_bodies, AUTH, on_chunk=chunks.set))
        await asyncio.wait_for(chunks.wait(), 60)
        topology.kill("tokenizer-0")
        killed_at = time.monotonic()
        results = await task
        return results, time.monotonic() - killed_at

    results, after_kill_s = asyncio.run(disturbed())
    assert results == reference, topology.log("gateway")
    assert all(r[3] is None and r[4] for r in results[len(bodies):])  # streams: no error, ended with [DONE]
    retries = parse_metrics(get(topology.url + "/metrics", headers=AUTH)[1])["pagedserve_request_retries_total"]
    # those it had answered never notice; only one it had not answered yet is asked again
    assert retries >= retries_before, topology.log("gateway")
    assert after_kill_s < 60
    status, body = get(topology.url + "/health", headers=AUTH)
    assert status == 200, body  # one replica is enough


def test_two_engines_from_compose_dp_yaml_serve_with_one_engines_outputs(topology, tiny_model_dir, tmp_path):
    load = [greedy([300 + 1000 * (i % 4) + k for k in range(32)] + [7000 + i, 5], 8) for i in range(16)]
    want = asyncio.run(run_load(topology.url, load, [], AUTH))
    assert all(r[0] == 200 for r in want), want
    env = {"PAGEDSERVE_API_KEY": KEY, "PAGEDSERVE_DTYPE": "float32"}
    with ComposeTopology(tiny_model_dir, tmp_path, tokenizers=1, env=env, layers=("compose.dp.yaml",)) as dp:
        assert {"scheduler-1", "executor-1"} <= set(dp.procs)
        deadline = time.monotonic() + 120
        while True:
            engines = json.loads(get(dp.url + "/health", headers=AUTH)[1]).get("engines", {})
            if sum(e["serving"] for e in engines.values()) == 2:
                break
            assert time.monotonic() < deadline, (engines, dp.log("gateway"))
            time.sleep(0.5)
        assert sorted(engines) == ["engine-0", "engine-1"]
        got = asyncio.run(run_load(dp.url, load, [], AUTH))
        assert got == want, dp.log("tokenizer-0")
        metrics = parse_metrics(get(dp.url + "/metrics", headers=AUTH)[1])
        routed = [metrics[f'pagedserve_engine_requests_routed_total{{engine="engine-{i}"}}'] for i in range(2)]
        assert sum(routed) == len(load) and min(routed) > 0, routed

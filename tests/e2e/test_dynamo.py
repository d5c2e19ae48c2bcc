"""NVIDIA Dynamo in front of pagedserve engines, on loopback with file discovery: Dynamo's
frontend with its KV router (`--router-mode kv`) and two `pagedserve serve --dynamo`
workers on the tiny random Llama, each relaying its scheduler's KV events.

- requests over 4 system prompts concentrate per prompt on one worker (the router knew
  where each prefix is cached: our events), hit the prefix cache there (the workers'
  counters), and greedy outputs equal those of a plain `pagedserve serve`;
- a client that leaves mid-stream has its request aborted at the engine;
- `kill -9` of a worker under load: every request ends with output or a clean error,
  and the frontend routes later requests to the survivor.

Skipped without Dynamo (the `dynamo` extra: README, Dynamo).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.dynamo_cluster import DynamoCluster, has_dynamo

pytestmark = pytest.mark.skipif(not has_dynamo(), reason="NVIDIA Dynamo is not installed (pip install "
                                "'pagedserve[dynamo]' && pip install --no-deps ai-dynamo; see README, Dynamo)")

PROMPTS = [" ".join(f"rule{k}-{j}" for j in range(40)) for k in range(4)]  # ~4 system prompts of 200+ tokens
QUESTIONS = [f" Question {q}: what follows?" for q in range(4)]


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            return err.code, json.loads(text)
        except ValueError:
            return err.code, {"raw": text}


def completion(url: str, prompt: str, max_tokens: int = 8, **extra) -> tuple[int, dict]:
    return post(url + "/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                                          "temperature": 0, **extra})


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with DynamoCluster(tiny_model_dir, tmp_path_factory.mktemp("dynamo")) as c:
        yield c


def test_kv_router_concentrates_prefixes_on_workers_and_matches_serve(cluster, tiny_server):
    """One at a time (no load to weigh against the cache), each prompt's requests all go where
    its first one went: the router knows from our KV events where each prefix is cached (with
    events on, it never guesses). Then the same prompts at once: every answer is the greedy
    answer of a plain `pagedserve serve`."""
    ids = {cluster.worker_id(i): i for i in range(2)}
    before = [cluster.metrics(i) for i in range(2)]
    work = [(k, PROMPTS[k] + q) for q in QUESTIONS for k in range(4)]  # interleaved over the prompts
    nvext = {"nvext": {"extra_fields": ["worker_id"]}}
    answers = []
    for _, prompt in work:
        answers.append(completion(cluster.url, prompt, **nvext))
        time.sleep(0.2)  # the events of its blocks reach the router
    assert all(status == 200 for status, _ in answers), answers
    placed: dict[int, list[int]] = {k: [] for k in range(4)}
    for (k, _), (_, body) in zip(work, answers, strict=True):
        placed[k].append(ids[body["nvext"]["worker_id"]["decode_worker_id"]])
    for k, workers in placed.items():
        assert workers.count(workers[0]) == len(workers), f"prompt {k}'s requests went to workers {workers}"
    later = [body for (_, body) in answers[4:]]
    assert all(b["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 10 for b in later), later
    # the workers' own counters: every request counted once, where it ran, with the prefix-cache hits there
    time.sleep(1.0)  # a few heartbeats
    after = [cluster.metrics(i) for i in range(2)]
    delta = [{k: after[i].get(k, 0) - before[i].get(k, 0) for k in after[i]} for i in range(2)]
    for i in range(2):
        served = sum(ws.count(i) for ws in placed.values())
        prompts_here = sum(1 for ws in placed.values() if ws[0] == i)
        assert delta[i]["pagedserve_dynamo_requests_total"] == served, delta[i]
        assert delta[i]["pagedserve_prefix_cache_hits_total"] >= 16 * 10 * (served - prompts_here), delta[i]
    # greedy, all at once: the text pagedserve's own server gives for the same prompts
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda kp: completion(cluster.url, kp[1]), work))
    for (_, prompt), (status, body) in zip(work, together, strict=True):
        assert status == 200, body
        ours_status, ours = completion(tiny_server.url, prompt)
        assert ours_status == 200
        assert body["choices"][0]["text"] == ours["choices"][0]["text"], prompt
        assert body["usage"]["prompt_tokens"] == ours["usage"]["prompt_tokens"]


def test_streamed_chat_with_usage(cluster):
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    raw = conn.getresponse().read().decode()
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["length"], raw[-2000:]
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_client_gone_mid_stream_aborts_at_the_engine(cluster):
    before = [cluster.metrics(i) for i in range(2)]
    body = {"model": "tiny-llama", "prompt": "Tell me a long story", "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.fp.readline()  # the first event: it runs
    conn.sock.close()  # the client leaves
    conn.close()
    deadline = time.monotonic() + 20
    while True:
        now = [cluster.metrics(i) for i in range(2)]
        aborted = sum(now[i]["pagedserve_dynamo_requests_aborted_total"]
                      - before[i]["pagedserve_dynamo_requests_aborted_total"] for i in range(2))
        running = sum(m.get("pagedserve_num_requests_running", 0) for m in now)
        if aborted == 1 and running == 0:
            break
        assert time.monotonic() < deadline, (aborted, running, now)
        time.sleep(0.2)


@pytest.mark.parametrize("migration_limit", [0, 3])
def test_kill_9_of_a_worker_under_load(tiny_model_dir, tmp_path, migration_limit):
    """Worker 1 (its launcher and every stage) is killed with SIGKILL while it runs requests:
    every request ends with its whole output or a clean error (Dynamo's frontend, without
    --migration-limit, answers those the dead worker had with a 503 "Service temporarily
    unavailable"; with it, it sends them on to the other worker with the tokens they had),
    and then the survivor takes them all."""
    with DynamoCluster(tiny_model_dir, tmp_path, frontend_extra=["--migration-limit", str(migration_limit)]) as c:
        def one(i: int) -> tuple[int, dict]:
            return completion(c.url, PROMPTS[i % 4] + f" load {i}", max_tokens=200, ignore_eos=True)

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one, i) for i in range(32)]
            deadline = time.monotonic() + 60
            while c.metrics(1).get("pagedserve_num_requests_running", 0) < 2:  # it is busy: kill it now
                assert time.monotonic() < deadline, "worker 1 never ran two requests"
                time.sleep(0.05)
            os.killpg(c.workers[1].proc.pid, signal.SIGKILL)
            results = [f.result(timeout=300) for f in futures]
        outcomes = Counter(status for status, _ in results)
        for status, body in results:
            if status == 200:
                assert body["usage"]["completion_tokens"] == 200, body
            else:
                assert status in (500, 502, 503) and body.get("message"), (status, body)
        errors = [body for status, body in results if status != 200]
        print(f"\noutcomes under kill -9: {dict(outcomes)}; first error: {errors[:1]}")
        assert outcomes[200] >= 1
        if migration_limit:
            assert outcomes[200] == len(results), errors
        deadline = time.monotonic() + 90
        while True:  # the frontend drops the dead worker; then everything succeeds on the other
            after = [completion(c.url, PROMPTS[i % 4] + f" after {i}") for i in range(8)]
            if all(s == 200 for s, _ in after):
                break
            assert time.monotonic() < deadline, after
            time.sleep(1.0)


@pytest.mark.skipif(not (shutil.which("etcd") and shutil.which("nats-server")),
                    reason="Debian's etcd-server and nats-server are not installed")
def test_etcd_discovery_and_nats_events(tiny_model_dir, tmp_path):
    """The production path: workers found through etcd, KV events and load over NATS; the KV
    router still keeps each prompt on one worker, and it answers."""
    with DynamoCluster(tiny_model_dir, tmp_path, discovery="etcd") as c:
        ids = {c.worker_id(i): i for i in range(2)}
        placed: dict[int, list[int]] = {k: [] for k in range(4)}
        for q in QUESTIONS[:3]:
            for k in range(4):
                status, body = completion(c.url, PROMPTS[k] + q, nvext={"extra_fields": ["worker_id"]})
                assert status == 200, body
                placed[k].append(ids[body["nvext"]["worker_id"]["decode_worker_id"]])
                time.sleep(0.2)
        assert all(ws.count(ws[0]) == len(ws) for ws in placed.values()), placed

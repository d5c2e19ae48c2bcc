"""KV events and vLLM's gauges from a real `pagedserve serve` on the tiny model: a SUB socket
on loopback, decoding with vLLM's schema (tests/scheduler/test_kv_events.py), receives the
BlockStored chain of a completion's prompt (2 full blocks and more) with increasing sequence
numbers, hashes that are its SHA-256 chain digests' first 8 bytes; /metrics carries
vllm:num_requests_running, vllm:num_requests_waiting and vllm:kv_cache_usage_perc labelled
with the served model's name and engine "0"."""

from __future__ import annotations

import json
import time
import urllib.request
from itertools import pairwise

import pytest
import zmq

from shared.block_digest import block_digests
from shared.ports import free_port
from tests.helpers import ServerProcess
from tests.scheduler.test_kv_events import DECODER, VBlockStored, h

LABELS = '{engine="0",model_name="tiny-llama"}'
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


@pytest.fixture(scope="module")
def server_and_sub(tiny_model_dir, tmp_path_factory):
    port = free_port()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")  # before the scheduler binds: no batch is missed
    try:
        with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("kv-events"),
                           ["--dtype", "float32", "--served-model-name", "tiny-llama",
                            "--kv-events-endpoint", f"tcp://127.0.0.1:{port}"]) as server:
            yield server, sub
    finally:
        ctx.destroy(linger=0)


def vllm_gauges(server, timeout: float = 15.0) -> dict[str, float]:
    """The three gauges of engine 0, once the scheduler's heartbeat reported them."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if all(name + LABELS in m for name in VLLM_GAUGES):
            return {name: m[name + LABELS] for name in VLLM_GAUGES}
        assert time.monotonic() < deadline, f"no vllm: gauges on /metrics: {sorted(m)}"
        time.sleep(0.2)


def complete(url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny-llama", "prompt": prompt, "max_tokens": 3, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_idle_gauges(server_and_sub):
    server, _ = server_and_sub
    gauges = vllm_gauges(server)
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:num_requests_waiting"] == 0
    assert gauges["vllm:kv_cache_usage_perc"] == 0.0  # no block held (cached ones are free, as in vLLM)


def test_a_prompt_of_two_blocks_is_published_as_a_stored_chain(server_and_sub):
    server, sub = server_and_sub
    prompt = list(range(200, 240))  # 2 full blocks of 16, and 8 tokens
    assert complete(server.url, prompt)["choices"][0]["finish_reason"] == "length"
    seqs, stored = [], []
    deadline = time.monotonic() + 15
    while sum(len(e.block_hashes) for e in stored) < 2:
        assert time.monotonic() < deadline, f"stored events so far: {stored}"
        if not sub.poll(200):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and len(seq) == 8
        seqs.append(int.from_bytes(seq, "big"))
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 60
        stored += [e for e in batch.events if isinstance(e, VBlockStored)]
    assert seqs == sorted(set(seqs)), "sequence numbers increase"
    block_size = stored[0].block_size
    expected = [h(d) for d in block_digests(prompt, block_size)]
    hashes = [x for e in stored for x in e.block_hashes]
    assert hashes[:2] == expected[:2]
    assert stored[0].parent_block_hash is None
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens[: 2 * block_size] == prompt[: 2 * block_size]
    for before, after in pairwise(stored):  # later events chain to the blocks before
        assert after.parent_block_hash == before.block_hashes[-1]

    server.wait_blocks_free()
    gauges = vllm_gauges(server)
    assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:num_requests_waiting"] == 0
    assert 0.0 <= gauges["vllm:kv_cache_usage_perc"] <= 1.0

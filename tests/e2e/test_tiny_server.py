"""The whole stack on a tiny random Llama: real processes, sockets and HTTP.

Greedy outputs of concurrent requests equal transformers' generate; streaming and
non-streaming agree; every KV block is free afterwards, also after clients hang up.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.e2e.reference import hf_greedy
from tests.helpers import ServerProcess, get, sse_events

MAX_TOKENS = 12


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.choice([1, 5, 16, 17, 40, 70]))] for _ in range(n)]


async def complete(session, url, body) -> tuple[int, dict]:
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def complete_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(complete(session, url, b) for b in bodies))


def greedy_body(prompt, max_tokens=MAX_TOKENS, **extra):
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}


def check_equal_to_hf(model_dir, batch, results, max_tokens=MAX_TOKENS):
    expected = hf_greedy(model_dir, batch, max_tokens)
    tok = AutoTokenizer.from_pretrained(model_dir)
    for want, (status, body) in zip(expected, results, strict=True):
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == want
        assert choice["text"] == tok.decode(want, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == max_tokens


def test_concurrent_greedy_equals_transformers_generate(tiny_server, tiny_model_dir):
    batch = prompts(8)
    results = asyncio.run(complete_all(tiny_server.url, [greedy_body(p) for p in batch]))
    check_equal_to_hf(tiny_model_dir, batch, results)
    metrics = tiny_server.wait_blocks_free()
    assert metrics["pagedserve_kv_blocks_total"] > 0
    assert metrics["pagedserve_generation_tokens_total"] >= 8 * MAX_TOKENS


async def stream_text(session, url, path, body) -> tuple[str, list[dict], str]:
    async with session.post(url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.text()
    events = sse_events(raw)
    key = "text" if path.endswith("/completions") and "chat" not in path else None
    pieces = [(c["text"] if key else c["delta"].get("content") or "") for e in events for c in e["choices"]]
    return "".join(pieces), events, raw


def test_streaming_equals_non_streaming_for_both_endpoints(tiny_server):
    async def go():
        async with aiohttp.ClientSession() as s:
            body = {"model": "tiny-llama", "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0,
                    "ignore_eos": True}
            async with s.post(tiny_server.url + "/v1/completions", json=body) as resp:
                whole = await resp.json()
            text, events, raw = await stream_text(s, tiny_server.url, "/v1/completions", body)
            assert raw.rstrip().endswith("data: [DONE]")
            assert text == whole["choices"][0]["text"]
            assert events[-1]["choices"][-1]["finish_reason"] == "length" or any(
                c.get("finish_reason") == "length" for e in events for c in e["choices"])

            chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi there!"}],
                    "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            async with s.post(tiny_server.url + "/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200
                chat_whole = await resp.json()
            assert chat_whole["object"] == "chat.completion"
            assert chat_whole["usage"]["completion_tokens"] == 10
            ctext, cevents, craw = await stream_text(s, tiny_server.url, "/v1/chat/completions", chat)
            assert craw.rstrip().endswith("data: [DONE]")
            assert ctext == chat_whole["choices"][0]["message"]["content"]
            assert cevents[0]["object"] == "chat.completion.chunk"
    asyncio.run(go())
    tiny_server.wait_blocks_free()


def test_client_disconnect_mid_stream_frees_blocks(tiny_server):
    async def go():
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                body = greedy_body(prompts(1, seed=100 + i)[0], max_tokens=400, stream=True)
                async with s.post(tiny_server.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    got = 0
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            got += 1
                            if got == 3:
                                break
                # leaving the block closes the connection mid-stream
    asyncio.run(go())
    before = tiny_server.metrics()
    assert before["pagedserve_generation_tokens_total"] >= 9
    tiny_server.wait_blocks_free(timeout=15)


@pytest.mark.parametrize(
    "payload, fragment",
    [
        (b"{not json", "JSON"),
        (json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"model": "tiny-llama", "prompt": 5}).encode(), "prompt"),
        (json.dumps({"model": "tiny-llama", "prompt": "hi", "temperature": "hot"}).encode(), "temperature"),
        (json.dumps({"model": "nope", "prompt": "hi"}).encode(), "model"),
        (json.dumps({"model": "tiny-llama", "prompt": "hi " * 600, "max_tokens": 10}).encode(), "context"),
        (json.dumps({"model": "tiny-llama", "prompt": [1, 2, 10**9]}).encode(), "token"),
    ],
)
def test_bad_input_gets_400_and_the_server_keeps_serving(tiny_server, payload, fragment):
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(tiny_server.url + "/v1/completions", data=payload,
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == (404 if fragment == "model" else 400)  # an unknown model is a 404
                body = await resp.json()
            assert body["error"]["type"] == "invalid_request_error"
            assert fragment.lower() in body["error"]["message"].lower()
            status, ok = await complete(s, tiny_server.url, greedy_body([5, 6, 7], max_tokens=2))
            assert status == 200 and ok["usage"]["completion_tokens"] == 2
    asyncio.run(go())


def test_models_health_and_metrics(tiny_server):
    status, body = get(tiny_server.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-llama"
    status, body = get(tiny_server.url + "/health")
    stages = json.loads(body)
    assert status == 200, stages
    text = get(tiny_server.url + "/metrics")[1]
    for name in ["pagedserve_num_requests_running", "pagedserve_num_requests_waiting", "pagedserve_kv_blocks_total",
                 "pagedserve_kv_blocks_used", "pagedserve_kv_cache_usage_ratio", "pagedserve_prompt_tokens_total",
                 "pagedserve_generation_tokens_total", "pagedserve_time_to_first_token_seconds_bucket",
                 "pagedserve_inter_token_latency_seconds_bucket"]:
        assert name in text


def test_small_pool_preempts_and_still_matches(tiny_model_dir, tmp_path):
    # 12 blocks of 16 slots for 6 requests of up to 70 + 100 tokens: each needs at least 7 blocks
    # by its end, so any two that run at once preempt (with 40 output tokens, short prompts that
    # arrived apart on a loaded machine could all fit, and once no preemption came).
    extra = ["--dtype", "float32", "--num-kv-blocks", "12", "--served-model-name", "tiny-llama"]
    batch = prompts(6, seed=7)
    with ServerProcess(tiny_model_dir, tmp_path, extra) as server:
        results = asyncio.run(complete_all(server.url, [greedy_body(p, max_tokens=100) for p in batch]))
        deadline = time.monotonic() + 10
        while server.wait_blocks_free()["pagedserve_num_preemptions_total"] == 0:
            assert time.monotonic() < deadline, server.log()  # heartbeats carry the stats: give them a moment
            time.sleep(0.1)
    check_equal_to_hf(tiny_model_dir, batch, results, max_tokens=100)


def test_prefix_cache_hits_keep_greedy_output_and_show_in_metrics(tiny_server):
    prompt = prompts(1, seed=42)[0] * 3  # long enough for several full blocks
    before = tiny_server.metrics()
    first = asyncio.run(complete_all(tiny_server.url, [greedy_body(prompt)]))[0]
    second = asyncio.run(complete_all(tiny_server.url, [greedy_body(prompt)]))[0]
    assert first[1]["choices"][0]["token_ids"] == second[1]["choices"][0]["token_ids"]
    want_hits = before.get("pagedserve_prefix_cache_hits_total", 0) + (len(prompt) - 1) // 16 * 16
    deadline = time.monotonic() + 10
    while (after := tiny_server.wait_blocks_free())["pagedserve_prefix_cache_hits_total"] < want_hits:
        assert time.monotonic() < deadline, after  # heartbeats carry the stats: give them a moment
        time.sleep(0.1)
    assert after["pagedserve_kv_blocks_cached"] > 0
    assert after['pagedserve_kv_slots{category="free"}'] == after["pagedserve_kv_blocks_total"] * 16


def test_parallel_samples_and_beam_search_through_the_api(tiny_server):
    prompt = prompts(1, seed=9)[0]

    async def go():
        async with aiohttp.ClientSession() as s:
            greedy = await complete(s, tiny_server.url, greedy_body(prompt, max_tokens=10))
            par = await complete(s, tiny_server.url, greedy_body(prompt, max_tokens=10, n=3))
            seeded = await complete(s, tiny_server.url, greedy_body(prompt, max_tokens=10, n=2, temperature=50.0,
                                                                    seed=5))
            beam = await complete(s, tiny_server.url, greedy_body(prompt, max_tokens=10, n=2,
                                                                  use_beam_search=True, beam_width=3))
            chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                    "n": 2, "temperature": 0, "ignore_eos": True, "stream": True}
            async with s.post(tiny_server.url + "/v1/chat/completions", json=chat) as resp:
                events = sse_events(await resp.text())
            return greedy, par, seeded, beam, events

    greedy, par, seeded, beam, events = asyncio.run(go())
    want = greedy[1]["choices"][0]["token_ids"]
    assert par[0] == 200 and [c["index"] for c in par[1]["choices"]] == [0, 1, 2]
    assert all(c["token_ids"] == want for c in par[1]["choices"])  # greedy samples agree
    assert par[1]["usage"]["completion_tokens"] == 30
    a, b = (c["token_ids"] for c in seeded[1]["choices"])
    assert a != b  # each sample draws with its own seed
    assert beam[0] == 200 and len(beam[1]["choices"]) == 2 and beam[1]["choices"][0]["token_ids"] != \
        beam[1]["choices"][1]["token_ids"]
    assert {c["index"] for e in events for c in e["choices"]} == {0, 1}
    metrics = tiny_server.wait_blocks_free()
    assert metrics["pagedserve_kv_blocks_used"] == 0


def test_the_executor_main_thread_keeps_a_core_and_the_other_stages_share_the_rest(tiny_server):
    import os

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores allowed")
    executor = tiny_server.stage_pid("executor")
    assert sorted(os.sched_getaffinity(executor)) == allowed[:1]  # its main thread (the pid's own task)
    workers = [int(t) for t in os.listdir(f"/proc/{executor}/task") if int(t) != executor]
    assert workers and all(sorted(os.sched_getaffinity(t)) == allowed[1:] for t in workers)
    for stage in ("gateway", "scheduler", "tokenizer"):
        assert sorted(os.sched_getaffinity(tiny_server.stage_pid(stage))) == allowed[1:], stage
    assert "the main thread keeps core" in tiny_server.log()

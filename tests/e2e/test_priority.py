"""Priority scheduling end to end: a server started with --scheduling-policy priority and a small
KV pool, loaded with long low-priority streams, serves later high-priority requests first and
every output stays the one a request gets alone; under fcfs (the shared tiny server) a
non-zero priority is a 400 naming the flag, through the openai SDK."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import openai
import pytest

from tests.helpers import ServerProcess

LOW, HIGH = 10, 0


@pytest.fixture(scope="module")
def priority_server(tiny_model_dir, tmp_path_factory):
    # 16 blocks of 16 slots: each low request grows to 13 blocks, so they preempt each other
    extra = ["--dtype", "float32", "--num-kv-blocks", "16", "--served-model-name", "tiny-llama",
             "--scheduling-policy", "priority"]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("priority"), extra) as server:
        yield server


def body(prompt: list[int], max_tokens: int, priority: int, stream: bool = False) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "priority": priority, "stream": stream}


async def stream(session, url: str, req: dict, started: asyncio.Event | None = None) -> tuple[list[int], float]:
    """The token ids a streamed completion gives, and when it ended (monotonic)."""
    ids = []
    async with session.post(url + "/v1/completions", json=req) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
                if started is not None:
                    started.set()
    return ids, time.monotonic()


def test_high_priorities_finish_first_and_outputs_are_unchanged(priority_server):
    rng = random.Random(3)
    lows = [[rng.randrange(3, 49152) for _ in range(17)] for _ in range(5)]
    highs = [[rng.randrange(3, 49152) for _ in range(5)] for _ in range(3)]
    url = priority_server.url

    async def go():
        async with aiohttp.ClientSession() as s:
            started = asyncio.Event()
            low_tasks = [asyncio.create_task(stream(s, url, body(p, 180, LOW, stream=True), started)) for p in lows]
            await asyncio.wait_for(started.wait(), 60)  # the low streams run and fill the pool
            high_tasks = [asyncio.create_task(stream(s, url, body(p, 8, HIGH, stream=True))) for p in highs]
            loaded = await asyncio.gather(*low_tasks, *high_tasks)
            alone = [await stream(s, url, body(p, n, 0, stream=True)) for p, n in [*((p, 180) for p in lows),
                                                                       *((p, 8) for p in highs)]]
            return loaded, alone

    loaded, alone = asyncio.run(go())
    low_done = sorted(t for _, t in loaded[: len(lows)])
    high_done = [t for _, t in loaded[len(lows):]]
    # every high-priority request ended before all but at most one of the low ones
    assert max(high_done) < low_done[1], (high_done, low_done)
    assert [ids for ids, _ in loaded] == [ids for ids, _ in alone]  # preemption changed no output
    metrics = priority_server.wait_blocks_free()
    assert metrics["pagedserve_num_preemptions_total"] > 0


def test_priority_is_accepted_through_the_sdk_under_the_priority_policy(priority_server):
    client = openai.OpenAI(base_url=priority_server.url + "/v1", api_key="none")
    out = client.completions.create(model="tiny-llama", prompt="hello", max_tokens=2, extra_body={"priority": -3})
    assert out.choices[0].finish_reason == "length"


def test_fcfs_refuses_a_priority_naming_the_flag(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="none")
    for call in (lambda **kw: client.completions.create(prompt="hello", **kw),
                 lambda **kw: client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)):
        with pytest.raises(openai.BadRequestError) as err:
            call(model="tiny-llama", max_tokens=2, extra_body={"priority": 1})
        assert "--scheduling-policy priority" in err.value.message and err.value.body["param"] == "priority"
        assert call(model="tiny-llama", max_tokens=2, extra_body={"priority": 0}).choices  # 0 is fcfs's own

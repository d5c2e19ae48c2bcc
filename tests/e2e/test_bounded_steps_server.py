"""Issue 19's stall against a real tiny-model server: prompts x n with huge sampling parameters
(allowed_token_ids, logit_bias, long bad_words) beside honest streams.

Sent with every sequence of every step, those parameters made each ExecuteStep larger than
the sockets' message limit (scaled down here with PAGEDSERVE_MAX_MESSAGE_BYTES), the frame was
dropped and the scheduler waited for an answer that never came ("executor lost"). Sent once per
request, and each step bounded, everything completes: the hostile request with all its
choices, the honest streams with the output they have alone.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.e2e.load import greedy, prompts, streamed, whole
from tests.helpers import ServerProcess

LIMIT = 1 << 20  # every socket's message limit: the step budget is a quarter of it
PROMPTS, N = 4, 4


def hostile() -> dict:
    words = ["lorem ipsum dolor sit amet consectetur adipiscing " * 2] * 32  # within the gateway's 4096 chars
    return {"prompt": [[5 + i, 6, 7, 8, 9] for i in range(PROMPTS)], "n": N, "max_tokens": 6, "ignore_eos": True,
            "allowed_token_ids": list(range(3, 40_003)),  # ~120 KB a SeqSampling: 16 of them > LIMIT
            "logit_bias": {str(i): 0.5 for i in range(100, 1124)}, "bad_words": words, "seed": 3}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("run"), ["--dtype", "float32", "--max-request-bytes", str(LIMIT // 3)],
                       env={"PAGEDSERVE_MAX_MESSAGE_BYTES": str(LIMIT)}) as srv:
        yield srv


async def _load(url: str, honest: list[dict]) -> tuple[tuple, list[tuple]]:
    timeout = aiohttp.ClientTimeout(total=100)  # the executor-lost path would take 120 s a step
    async with aiohttp.ClientSession(timeout=timeout) as session:
        hostile_task = asyncio.ensure_future(_hostile(session, url))
        streams = [asyncio.ensure_future(streamed(session, url, body)) for body in honest]
        return await hostile_task, await asyncio.gather(*streams)


async def _hostile(session: aiohttp.ClientSession, url: str) -> tuple:
    async with session.post(url + "/v1/completions", json=hostile()) as resp:
        return resp.status, await resp.json()


async def _alone(url: str, honest: list[dict]) -> list[tuple]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return [await whole(session, url, body) for body in honest]


def test_huge_sampling_parameters_beside_honest_streams_complete(server):
    honest = [greedy(p, 12) for p in prompts(4, seed=19)]
    started = time.monotonic()
    (status, body), streams = asyncio.run(_load(server.url, honest))
    elapsed = time.monotonic() - started
    assert status == 200, body
    choices = body["choices"]
    assert len(choices) == PROMPTS * N and all(c["finish_reason"] == "length" for c in choices)
    assert body["usage"]["completion_tokens"] == PROMPTS * N * 6
    alone = asyncio.run(_alone(server.url, honest))
    for got, want in zip(streams, alone, strict=True):
        assert got[0] == 200 and got[3] is None and got[4], got
        assert got[1] == want[1]
    log = server.log()
    assert "executor lost" not in log
    assert elapsed < 100
    server.wait_blocks_free()


async def _complete(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


def test_prompt_logprobs_scored_once_reach_every_sample(server):
    """With n > 1 the prompt is scored once and sent once; every choice still shows it whole."""
    prompt = prompts(1, seed=5)[0] + [11, 12, 13]
    body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "prompt_logprobs": 2, "seed": 1}
    alone = asyncio.run(_complete(server.url, {**body, "n": 1}))["choices"][0]["prompt_logprobs"]
    assert len(alone) == len(prompt) and alone[0] is None
    for choice in asyncio.run(_complete(server.url, {**body, "n": 3}))["choices"]:
        assert choice["prompt_logprobs"] == alone
    echoed = asyncio.run(_complete(server.url, {**body, "n": 3, "echo": True, "logprobs": 1}))["choices"]
    heads = [c["logprobs"]["token_logprobs"][: len(prompt)] for c in echoed]
    assert heads[0][0] is None and all(h == heads[0] for h in heads)

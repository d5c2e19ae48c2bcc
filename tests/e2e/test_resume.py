"""Sampled streams without a seed survive the death of any stage but the gateway (issue 20).

`pagedserve serve` on the tiny model, driven with the openai SDK: requests as the API's
default makes them (temperature 1, no seed), n = 2, whole and streamed, while one stage is
killed (kill -9) mid-generation: the tokenizer replica (the requests already tokenized go on
without it; new ones are served once it is back), the scheduler (the gateway
resumes every choice from the tokens its client has) or the executor (the scheduler
recomputes). Every choice must end as an undisturbed one would: exactly max_tokens tokens,
finish_reason "length", no error, and text that is exactly the decoding of its token ids (the
tokens are drawn from plain-word tokens, so each id is its own text): nothing repeated,
skipped or lost at the seam.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.helpers import ServerProcess, get

openai = pytest.importorskip("openai")

MAX_TOKENS = 48
KILL_AFTER_CHUNKS = 40  # streamed chunks seen before the kill: every stream has started, none ended


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama"]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("resume"), extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def words(smollm2_tokenizer) -> list[int]:
    """Token ids that are a plain lowercase word after a space each: their texts join unambiguously."""
    vocab = smollm2_tokenizer.get_vocab()
    ids = sorted(i for piece, i in vocab.items() if piece.startswith("Ġ") and piece[1:].isalpha()
                 and piece[1:].islower() and 3 <= len(piece) <= 8)
    return ids[:400]


def sampled(words: list[int], prompt: str) -> dict:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "n": 2,
            "extra_body": {"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": words}}


async def whole(client, body: dict) -> list[tuple]:
    out = await client.completions.create(**body)
    return [(c.index, c.text, c.model_extra["token_ids"], c.finish_reason) for c in out.choices]


async def streamed(client, body: dict, on_chunk) -> list[tuple]:
    texts, ids, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    async for chunk in await client.completions.create(**body, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            ids[c.index] += (c.model_extra or {}).get("token_ids") or []
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        on_chunk()
    return [(i, texts[i], ids[i], finish.get(i)) for i in (0, 1)]


def check(choices: list[tuple], tokenizer) -> None:
    assert [c[0] for c in choices] == [0, 1]
    for _, text, ids, finish in choices:
        assert finish == "length" and len(ids) == MAX_TOKENS
        assert text == tokenizer.decode(ids)  # each token shown once, in order


def stage_pid(server, stage: str, not_pid: int | None = None) -> int:
    """The ready stage's pid, once there is one (other than not_pid) and /health is 200."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            pid = server.stage_pid(stage)
            if pid != not_pid and get(server.url + "/health")[0] == 200:
                return pid
        except (AssertionError, OSError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no ready {stage} other than {not_pid}")


@pytest.mark.parametrize("stage", ["tokenizer", "scheduler", "executor"])
def test_a_sampled_unseeded_request_continues_across_kill_9(server, stage, words, smollm2_tokenizer):
    victim = stage_pid(server, stage)
    before = server.metrics()
    killed: list[float] = []
    chunks = [0]

    def kill_mid_generation():
        chunks[0] += 1
        if chunks[0] == KILL_AFTER_CHUNKS and not killed:
            os.kill(victim, signal.SIGKILL)
            killed.append(time.monotonic())

    async def load():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            jobs = [streamed(client, sampled(words, f"stream {i}"), kill_mid_generation) for i in range(3)]
            jobs += [whole(client, sampled(words, f"whole {i}")) for i in range(3)]
            first = await asyncio.gather(*jobs)
            # new requests get a 503 while a stage is down (admission): once it is back, they are served
            await asyncio.to_thread(stage_pid, server, stage, victim)
            later = await asyncio.gather(*(whole(client, sampled(words, f"later {i}")) for i in range(2)))
            return first + later
        finally:
            await client.close()

    results = asyncio.run(load())
    assert killed, "the stage was not killed mid-generation"
    for choices in results:
        check(choices, smollm2_tokenizer)
    assert stage_pid(server, stage, victim) != victim  # restarted by the launcher
    after = server.metrics()
    if stage == "scheduler":  # the gateway resumed the requests the dead scheduler had
        assert after["pagedserve_request_retries_total"] > before["pagedserve_request_retries_total"]
    assert after.get("pagedserve_requests_lost_total", 0) == before.get("pagedserve_requests_lost_total", 0)
    server.wait_blocks_free(timeout=30)

"""`pagedserve serve --deterministic` on the tiny Llama, through the openai SDK: a greedy completion's
tokens and logprobs are bitwise the same alone, amid 40 concurrent requests (its prompt chunked by a
64-token step budget beside theirs), on either of two data-parallel engines, and when sent again."""

from __future__ import annotations

import asyncio
import random

import openai
import pytest

from tests.helpers import ServerProcess

MODEL = "tiny-llama"
WORDS = ["alpha", "river", "stone", "light", "green", "cloud", "north", "seven", "paper", "glass"]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", MODEL, "--deterministic", "--data-parallel-size", "2",
             "--max-num-batched-tokens", "64", "--max-num-seqs", "32"]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("det"), extra) as s:
        yield s


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def complete(c: openai.AsyncOpenAI, prompt: str, max_tokens: int = 8):
    out = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=5,
                                     extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    return lp.tokens, lp.token_logprobs, lp.top_logprobs


def test_a_greedy_completion_is_bitwise_the_same_alone_under_load_and_again(server):
    target = text(random.Random(0), 90)

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            alone = await complete(c, target)
            rng = random.Random(1)
            load = [complete(c, text(rng, rng.randrange(5, 120)), rng.randrange(4, 24)) for _ in range(40)]
            for i in (3, 17, 30):  # the target among the others, more than once so that both engines serve it
                load.insert(i, complete(c, target))
            loaded = await asyncio.gather(*load)
            again = await complete(c, target)
            return alone, [loaded[i] for i in (3, 17, 30)], again

    alone, under_load, again = asyncio.run(run())
    assert len(alone[0]) == 8
    for result in [*under_load, again]:
        assert result == alone
    assert "deterministic: " in server.log()

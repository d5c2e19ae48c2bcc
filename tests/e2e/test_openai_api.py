"""Issue 11 against a real server on the tiny Llama, through the official `openai` client
(sync, async, streaming): the fields real clients send, answered as OpenAI answers them."""

from __future__ import annotations

import asyncio

import openai
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(tiny_server):
    with openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def max_model_len(tiny_model_dir) -> int:
    import json

    return json.loads((tiny_model_dir / "config.json").read_text())["max_position_embeddings"]


def test_unknown_model_is_404_with_an_openai_body(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=1)
    err = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4" in err["message"]


def test_refused_field_is_named(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, extra_body={"typical_p": 0.5})
    assert info.value.body["param"] == "typical_p"


def test_chat_default_max_tokens_is_the_rest_of_the_context(client, max_model_len):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == max_model_len


def test_empty_stream_options_give_usage(tiny_server):
    async def run():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0) as c:
            stream = await c.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                                stream=True, stream_options={}, extra_body={"ignore_eos": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3

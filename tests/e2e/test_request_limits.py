"""Issue 19's gateway bounds against a real server on the tiny Llama: limit flags given to
`pagedserve serve` reach the gateway stage and answer 400s naming their field (through the
official `openai` client); a foreign Host header is refused with a 403 on every route;
`cache_salt` is accepted on both endpoints."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.helpers import ServerProcess

MODEL = "tiny-llama"
GOOD_HOST = "api.example"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", MODEL, "--max-model-len", "128",
             "--max-n", "2", "--max-tools", "2", "--allowed-hosts", GOOD_HOST]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("limits"), extra) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def param_of(call) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body["param"]


def test_limit_flags_and_defaults_answer_400s_naming_the_field(client):
    chat = [{"role": "user", "content": "hi"}]
    tool = lambda name: {"type": "function", "function": {"name": name}}  # noqa: E731
    assert param_of(lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=3)) == "n"
    assert param_of(lambda: client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=1, tools=[tool("a"), tool("b"), tool("c")])) == "tools"
    assert param_of(lambda: client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=1, logprobs=True, top_logprobs=21)) == "top_logprobs"
    assert param_of(lambda: client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=1,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": deep(70)}})) == "response_format"
    assert param_of(lambda: client.completions.create(
        model=MODEL, prompt=[[5] * 4096] * 64, max_tokens=1, echo=True, logprobs=5)) == "logprobs"
    assert param_of(lambda: client.completions.create(
        model=MODEL, prompt="hi", max_tokens=1, extra_body={"bad_words": ["w"] * 65})) == "bad_words"
    assert param_of(lambda: client.completions.create(
        model=MODEL, prompt="hi", max_tokens=1, extra_body={"cache_salt": ""})) == "cache_salt"
    # within the limits the same server answers
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2, extra_body={"cache_salt": "t1"})
    assert len(out.choices) == 2
    assert client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2,
                                          extra_body={"cache_salt": "t2"}).choices[0].finish_reason


def test_only_the_allowed_hosts_and_loopback_are_served(server):
    async def status(path: str, host: str) -> tuple[int, dict | None]:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + path, headers={"Host": host}) as resp:
                body = await resp.json() if resp.content_type == "application/json" else None
                return resp.status, body

    async def body():
        return {(path, host): await status(path, host) for path in ("/v1/models", "/health")
                for host in (f"{GOOD_HOST}:{server.port}", f"127.0.0.1:{server.port}", "rebound.attacker.example",
                             f"localhost:{server.port}")}

    answers = asyncio.run(body())
    for path in ("/v1/models", "/health"):
        assert answers[path, f"{GOOD_HOST}:{server.port}"][0] == 200
        assert answers[path, f"127.0.0.1:{server.port}"][0] == 200  # loopback addresses always
        assert answers[path, f"localhost:{server.port}"][0] == 403  # --allowed-hosts replaced the default names
        refused, err = answers[path, "rebound.attacker.example"]
        assert refused == 403 and err["error"]["code"] == "host_not_allowed"

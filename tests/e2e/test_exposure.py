"""A server exposed with limits: API key, bounded queue (429), body size, the OpenAPI
description fuzzed with schemathesis, and the graceful drain on SIGTERM (last: it ends
the server). One running sequence and a 64-token context keep every answer short."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from tests.e2e.load import greedy, run_load, whole
from tests.helpers import ServerProcess, get

KEY = "exposure-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT_S = 20
MAX_QUEUED = 2


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama", "--api-key", KEY,
             "--max-num-seqs", "1", "--max-queued-requests", str(MAX_QUEUED), "--max-model-len", "64",
             "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--max-request-bytes", "65536"]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("exposure"), extra, api_key=KEY) as srv:
        yield srv


async def post(url: str, data: bytes, headers: dict) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", data=data,
                          headers={"Content-Type": "application/json", **headers}) as resp:
            return resp.status, dict(resp.headers), await resp.json()


def test_api_key_is_required_on_every_route_but_the_openapi_description(server):
    body = json.dumps(greedy([5, 6, 7], 2)).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, resp_headers, err = asyncio.run(post(server.url, body, headers))
        assert status == 401 and err["error"]["code"] == "invalid_api_key", headers
        assert resp_headers["WWW-Authenticate"] == "Bearer"
    assert get(server.url + "/v1/models")[0] == 401
    for path in ("/health", "/metrics"):  # no --metrics-public: they need the key too
        status, page = get(server.url + path)
        assert status == 401 and json.loads(page)["error"]["code"] == "invalid_api_key"
        assert get(server.url + path, headers=AUTH)[0] == 200
    assert get(server.url + "/openapi.json")[0] == 200
    status, _, ok = asyncio.run(post(server.url, body, AUTH))
    assert status == 200 and ok["usage"]["completion_tokens"] == 2
    assert KEY not in server.log()  # the key reaches the gateway in its environment, not on a command line


def test_anthropics_x_api_key_is_accepted_like_the_bearer_key(server):
    anthropic = pytest.importorskip("anthropic")
    ask = {"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as client:  # sends x-api-key
        assert client.messages.create(**ask).usage.output_tokens <= 2
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as client:
        with pytest.raises(anthropic.AuthenticationError) as info:
            client.messages.create(**ask)
        assert info.value.body["error"]["type"] == "authentication_error"  # Anthropic's shape on its routes
    assert get(server.url + "/v1/models", headers={"x-api-key": KEY})[0] == 200  # on every route


def test_errors_and_descriptions_do_not_reveal_file_paths(server, tiny_model_dir):
    status, _, err = asyncio.run(post(server.url, json.dumps({"model": "nope", "prompt": "hi"}).encode(), AUTH))
    assert status == 404 and "tiny-llama" in err["error"]["message"]
    models = get(server.url + "/v1/models", headers=AUTH)[1]
    spec = get(server.url + "/openapi.json")[1]
    for text in (err["error"]["message"], models, spec):
        assert str(tiny_model_dir) not in text and "/tmp" not in text, text[:300]


def test_oversized_and_invalid_bodies_get_clear_errors(server):
    huge = json.dumps({"prompt": "x" * 70000}).encode()
    status, _, err = asyncio.run(post(server.url, huge, AUTH))
    assert status == 413 and err["error"]["code"] == "body_too_large"
    for raw, fragment in [(b'{"prompt": "\xff\xfe"}', "UTF-8"), (b'{"prompt": "\\ud800"}', "surrogate"),
                          (b"[" * 30000, "JSON"), (json.dumps({"prompt": "hi", "top_p": 0}).encode(), "top_p"),
                          (json.dumps({"prompt": "hi", "stop": ["x"] * 17}).encode(), "stop")]:
        status, _, err = asyncio.run(post(server.url, raw, AUTH))
        assert status == 400 and fragment.lower() in err["error"]["message"].lower(), (raw[:40], err)


def test_a_full_queue_answers_429_with_retry_after(server):
    async def burst():
        async with aiohttp.ClientSession() as s:
            async def one(i):
                async with s.post(server.url + "/v1/completions", json=greedy([5, 6, 7 + i], 40),
                                  headers=AUTH) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json(), time.monotonic()
            return await asyncio.gather(*(one(i) for i in range(12)))

    results = asyncio.run(burst())
    refused = [r[:3] for r in results if r[0] == 429]
    served = [r[:3] for r in results if r[0] == 200]
    assert len(refused) + len(served) == len(results), results
    # One running and MAX_QUEUED waiting; a request that finished while the burst still arrived
    # (seen before the last refusal, plus one seen just after it) let one more in.
    last_refusal = max(r[3] for r in results if r[0] == 429) if refused else 0.0
    finished_early = sum(1 for r in results if r[0] == 200 and r[3] < last_refusal) + 1
    assert refused and served, [r[0] for r in results]
    assert len(served) <= MAX_QUEUED + 1 + finished_early, [r[0] for r in results]
    for _, retry_after, body in refused:
        assert int(retry_after) >= 1 and body["error"]["type"] == "rate_limit_error"
    assert all(body["usage"]["completion_tokens"] == 40 for _, _, body in served)
    assert server.metrics()['pagedserve_requests_rejected_total{reason="queue_full"}'] >= len(refused)
    status, _, ok = asyncio.run(post(server.url, json.dumps(greedy([5, 6], 2)).encode(), AUTH))
    assert status == 200  # the queue drained


def test_openapi_description_fuzzed_with_schemathesis(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    ran = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        generating = operation.method.upper() == "POST"  # GETs have nothing to make invalid
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if generating else (GenerationMode.POSITIVE,):

            @settings(max_examples=25 if generating else 5, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                nonlocal ran
                ran += 1
                case.call_and_validate(base_url=server.url, headers=AUTH, checks=checks, timeout=60)

            fuzz()
    assert ran >= 80, ran
    assert get(server.url + "/health", headers=AUTH)[0] == 200


def test_sigterm_drains_requests_in_flight_then_exits(server):
    async def drain():
        chunks = asyncio.Event()
        bodies = [greedy([5, 6, 7 + i], 24, stream=True) for i in range(2)]  # the second one queues
        task = asyncio.create_task(run_load(server.url, [], bodies, AUTH, on_chunk=chunks.set))
        await asyncio.wait_for(chunks.wait(), 60)
        os.kill(server.proc.pid, signal.SIGTERM)  # the launcher alone, as `docker stop` would
        signalled = time.monotonic()
        refused = None
        async with aiohttp.ClientSession() as s:
            while time.monotonic() - signalled < 5 and refused is None:
                try:
                    status = (await whole(s, server.url, greedy([9], 2), AUTH))[0]
                    refused = status if status == 503 else None
                except aiohttp.ClientError:
                    refused = "connection refused"
                await asyncio.sleep(0.05)
        return await task, refused, signalled

    results, refused, signalled = asyncio.run(drain())
    assert refused is not None
    for status, ids, _text, error, done in results:
        assert status == 200 and error is None and done and len(ids) == 24, results
    assert server.proc.wait(SHUTDOWN_TIMEOUT_S + 15) == 0, server.log()
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 15
    assert "draining" in server.log()

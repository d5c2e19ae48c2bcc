"""A tiny-model server against misbehaving clients and a stalled stage (issue 10): POST
bodies must be JSON, slow headers, slow bodies and unread streams are cut off after
--client-timeout, n > 1 ends with the last choice (checked with the `openai` SDK) and a
disconnect aborts every sample, and a silent executor gets new requests a 503 at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import aiohttp
import pytest

from tests.helpers import ServerProcess, get

CLIENT_TIMEOUT_S = 2
# Seeded samples at a high temperature, stopped by "Q": choice i draws with seed + i, and
# with this seed the three choices stop after 7, 267 and 280 tokens (found by trying).
N_BODY = {"model": "tiny-llama", "prompt": [5, 6, 7], "max_tokens": 400, "n": 3, "temperature": 100.0,
          "seed": 4, "stop": ["Q"]}
N_LENGTHS = [7, 267, 280]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    extra = ["--dtype", "float32", "--served-model-name", "tiny-llama", "--client-timeout", str(CLIENT_TIMEOUT_S)]
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("hardening"), extra) as srv:
        yield srv


def health(server) -> dict:
    return json.loads(get(server.url + "/health")[1])


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)
    return value


def connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: a small window
    sock.connect(("127.0.0.1", server.port))
    return sock


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed the connection: what it sent is read up to the end."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def ok_request(url: str) -> int:
    async with aiohttp.ClientSession() as s:
        body = {"prompt": [5, 6], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        async with s.post(url + "/v1/completions", json=body) as resp:
            return resp.status


# --- item 11 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_post_body_that_is_not_declared_json_gets_415(server, path, content_type):
    body = json.dumps({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()

    async def go():
        headers = {"Content-Type": content_type} if content_type else {}
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + path, data=body, headers=headers, skip_auto_headers=["Content-Type"]) as r:
                return r.status, await r.json()

    status, err = asyncio.run(go())
    assert status == 415 and err["error"]["code"] == "unsupported_media_type", err
    assert asyncio.run(ok_request(server.url)) == 200


def test_a_client_that_sends_its_headers_slowly_is_disconnected(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    closed = False
    for i in range(60):  # one header line every 0.5 s: far slower than the timeout allows
        try:
            sock.sendall(f"X-Slow-{i}: y\r\n".encode())
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        if closed_by_server(sock, 0.5):
            closed = True
            break
    sock.close()
    assert closed
    assert asyncio.run(ok_request(server.url)) == 200


def test_a_client_that_sends_its_body_slowly_gets_408(server):
    sock = connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    sock.settimeout(30)
    answer = sock.recv(65536)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"body_timeout" in answer


# --- item 5 ----------------------------------------------------------------------------------


def test_a_client_that_stops_reading_its_stream_is_cut_off_and_its_request_freed(server):
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 400, "n": 8, "temperature": 0, "ignore_eos": True,
                       "return_token_ids": True, "stream": True}).encode()
    sock = connect(server, rcvbuf=4096)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:  # never read: the answer (8 x 400 chunks) is far more than the socket buffers hold
        # the handler gives up when one write stalls (or its buffer fills first), and aborts the request
        wait_for(lambda: "stopped reading" in server.log_path.read_text(), "the stalled handler to give up")
        assert health(server)["requests_in_flight"] == 0
        server.wait_blocks_free(timeout=30)
        assert closed_by_server(sock, 10)  # its connection is gone, not left half-open
    finally:
        sock.close()
    assert asyncio.run(ok_request(server.url)) == 200


# --- item 3 ----------------------------------------------------------------------------------


def test_n_choices_all_finish_whole_and_streamed_with_the_openai_sdk(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.completions.create(**N_BODY)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.finish_reason for c in whole.choices] == ["stop"] * 3
    assert whole.usage.completion_tokens == sum(N_LENGTHS)

    texts, finished = ["", "", ""], []
    for chunk in client.completions.create(**N_BODY, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished.append(c.index)
    assert finished == [0, 1, 2]  # the first finish did not end the stream
    assert texts == [c.text for c in whole.choices]

    chat = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, n=2, temperature=0)
    assert len(chat.choices) == 2 and all(c.finish_reason for c in chat.choices)
    server.wait_blocks_free()


def test_leaving_after_the_first_choice_finished_aborts_the_other_samples(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    steps_before = server.wait_blocks_free()["pagedserve_decode_steps_total"]
    stream = client.completions.create(**N_BODY, stream=True)
    for chunk in stream:
        if any(c.finish_reason is not None for c in chunk.choices):
            break  # choice 0 is done after 7 tokens; the others have 260 more to go
    stream.close()
    wait_for(lambda: health(server)["requests_in_flight"] == 0, "the request to end")
    after = server.wait_blocks_free(timeout=30)
    # every sample was aborted: far fewer decode steps than running the others to their end
    assert after["pagedserve_decode_steps_total"] - steps_before < N_LENGTHS[1] - 60, after


# --- item 10 (last: it stops the executor for a while) -----------------------------------------


def test_with_the_executor_silent_new_requests_get_503_at_once(server):
    executor = server.stage_pid("executor")
    os.kill(executor, signal.SIGSTOP)
    try:
        wait_for(lambda: not health(server)["admitting"], "the gateway to notice", timeout=30)

        async def go():
            timeout = aiohttp.ClientTimeout(total=30)  # a hang (the old behaviour) fails here
            async with aiohttp.ClientSession(timeout=timeout) as s:
                body = {"prompt": [5, 6], "max_tokens": 2}
                async with s.post(server.url + "/v1/completions", json=body) as resp:
                    return resp.status, resp.headers.get("Retry-After"), await resp.json()

        status, retry_after, err = asyncio.run(go())
        assert status == 503 and retry_after and "executor" in err["error"]["message"], err
    finally:
        os.kill(executor, signal.SIGCONT)
    wait_for(lambda: health(server)["admitting"], "the executor to be back")
    assert asyncio.run(ok_request(server.url)) == 200
    assert server.stage_pid("executor") == executor

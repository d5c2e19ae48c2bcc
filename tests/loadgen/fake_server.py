"""A small OpenAI-compatible streaming server with known delays, run on its own thread.

Each request waits for one of `slots` (so at most `slots` run at once: a known capacity
of slots / service time), then sends its first token after `ttft` seconds and every
further token `itl` seconds later, `max_tokens` tokens in all. Knobs make it fail: every
`fail_every`-th request gets HTTP 500, every `disconnect_every`-th is cut after two
tokens, `hang_after_finish` keeps the connection open after the last chunk without
`[DONE]`, and `reject_fields` answers 422 to requests carrying those fields.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeConfig:
    ttft: float = 0.05
    itl: float = 0.01
    slots: int = 1000
    fail_every: int = 0
    disconnect_every: int = 0
    hang_after_finish: bool = False
    usage_in_finish_chunk: bool = False
    reject_fields: set[str] = field(default_factory=set)
    model: str = "fake-model"


class FakeServer:
    def __init__(self, config: FakeConfig | None = None) -> None:
        self.config = config or FakeConfig()
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []  # time.perf_counter() at each completion request
        # prompt -> perf_counter() when the request came in and just before each text chunk went out
        self.timings: dict[str, dict[str, list[float] | float]] = {}
        self.running = 0
        self.max_running = 0
        self._count = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def __enter__(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        self._slots = asyncio.Semaphore(self.config.slots)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        body = await request.json()
        if cfg.reject_fields & set(body):
            return web.json_response({"detail": f"Unexpected fields {cfg.reject_fields & set(body)}"}, status=422)
        self.arrivals.append(time.perf_counter())
        self.bodies.append(body)
        self._count += 1
        n = self._count
        if cfg.fail_every and n % cfg.fail_every == 0:
            return web.json_response({"error": "injected failure"}, status=500)
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt", "")
        self.timings[prompt] = {"recv": self.arrivals[-1], "chunks": []}
        tokens = int(body.get("max_tokens", 16))
        async with self._slots:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            try:
                return await self._stream(request, chat, tokens, self.timings[prompt]["chunks"],
                                          cut=cfg.disconnect_every and n % cfg.disconnect_every == 0)
            finally:
                self.running -= 1

    async def _stream(self, request: web.Request, chat: bool, tokens: int, sent: list[float],
                      cut: bool) -> web.StreamResponse:
        cfg = self.config
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        usage = {"prompt_tokens": 7, "completion_tokens": tokens, "total_tokens": 7 + tokens}

        def chunk(text: str, finish: str | None = None, with_usage: bool = False) -> bytes:
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            event = {"object": "chunk", "choices": [choice], **({"usage": usage} if with_usage else {})}
            return b"data: " + json.dumps(event).encode() + b"\n\n"

        await asyncio.sleep(cfg.ttft)
        for i in range(tokens):
            if i:
                await asyncio.sleep(cfg.itl)
            if cut and i == 2:
                request.transport.close()
                return resp
            sent.append(time.perf_counter())
            await resp.write(chunk(f" t{i}", "length" if i == tokens - 1 and not chat else None,
                                   with_usage=cfg.usage_in_finish_chunk and i == tokens - 1 and not chat))
        if chat:
            await resp.write(chunk("", "length", with_usage=cfg.usage_in_finish_chunk))
        if cfg.hang_after_finish:
            await asyncio.sleep(30)
            return resp
        if not cfg.usage_in_finish_chunk:
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

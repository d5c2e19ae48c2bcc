"""The dashboard's routes over a real HTTP server and client (aiohttp): the page and its
assets are open, the stream needs the API key; the stream says hello, then sends each
engine's snapshot (one panel per engine), tells when an engine goes silent, and ends
when the gateway drains."""

from __future__ import annotations

import asyncio
import base64
import json

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.gateway import dashboard
from services.gateway.admission import Admission
from services.gateway.dashboard import DashboardHub
from services.gateway.dashboard_http import DashboardRoutes
from services.gateway.metrics import Metrics
from shared.messages import BLOCK_STATES, PoolSnapshot, WatchPool

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}


def snap(engine: str, states: bytes) -> PoolSnapshot:
    n = len(states)
    return PoolSnapshot(engine, "i0", 0.0, "paged", 16, n, states, bytes(4 * n), bytes(2 * n), bytes(2 * n), [], 0)


async def next_event(resp) -> tuple[str, dict]:
    name, data = None, b""
    async for line in resp.content:
        if line.startswith(b"event: "):
            name = line[7:].strip().decode()
        elif line.startswith(b"data: "):
            data += line[6:].strip()
        elif line == b"\n" and name:
            return name, json.loads(data)
    raise EOFError


async def with_client(check):
    now = [0.0]
    subscriptions: list[WatchPool] = []

    async def subscribe(msg: WatchPool) -> None:
        subscriptions.append(msg)

    hub = DashboardHub(Metrics(), subscribe, clock=lambda: now[0])
    app = web.Application(middlewares=[Admission(KEY, None, lambda: 0, lambda: None).middleware()])
    DashboardRoutes(hub, client_timeout_s=5.0).add_to(app)
    async with TestClient(TestServer(app)) as client:
        task = asyncio.get_running_loop().create_task(hub.run())
        try:
            await check(client, hub, now, subscriptions)
        finally:
            task.cancel()


def test_page_and_assets_are_open_and_the_stream_needs_the_key():
    async def check(client, hub, now, subscriptions):
        for path, kind in (("/dashboard", "text/html"), ("/dashboard/dashboard.js", "text/javascript"),
                           ("/dashboard/dashboard.css", "text/css")):
            resp = await client.get(path)
            assert resp.status == 200 and resp.content_type == kind, path
            assert b"https://" not in await resp.read()  # nothing from elsewhere
        page = await (await client.get("/dashboard")).text()
        assert 'src="dashboard/dashboard.js"' in page and 'href="dashboard/dashboard.css"' in page
        resp = await client.get("/dashboard/stream")
        assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await client.get("/dashboard/stream", headers={"Authorization": "Bearer wrong"})
        assert resp.status == 401
        assert subscriptions == []  # nobody was let in: nothing subscribed

    asyncio.run(with_client(check))


def test_the_stream_sends_each_engine_then_tells_which_went_silent_and_ends_on_drain():
    async def check(client, hub, now, subscriptions):
        resp = await client.get("/dashboard/stream", headers=AUTH)
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        name, hello = await next_event(resp)
        assert name == "hello" and hello["block_states"] == list(BLOCK_STATES)
        await asyncio.sleep(0.05)
        assert len(subscriptions) == 1  # the first page subscribed at once

        hub.record(snap("scheduler-a", bytes([0, 1, 2, 3])))
        hub.record(snap("scheduler-b", bytes([2, 2])))
        seen: dict[str, bytes] = {}
        while len(seen) < 2:
            name, update = await next_event(resp)
            assert name == "update"
            for engine in update["engines"]:
                seen[engine["engine"]] = base64.b64decode(engine["states"])
        assert seen == {"scheduler-a": bytes([0, 1, 2, 3]), "scheduler-b": bytes([2, 2])}

        now[0] += dashboard.STALE_S + 1  # a goes silent; b speaks again
        hub.record(snap("scheduler-b", bytes([3, 0])))
        gone: list[str] = []
        while "scheduler-a/i0" not in gone:
            name, update = await next_event(resp)
            gone += update["gone"]
            assert all(e["engine"] == "scheduler-b" for e in update["engines"])

        hub.close()  # the gateway drains: the stream ends instead of holding it up
        await asyncio.wait_for(resp.content.read(), 2.0)  # to the end of the stream
        assert resp.content.at_eof()
        assert hub.watchers == 0

    asyncio.run(with_client(check))

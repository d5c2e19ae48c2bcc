"""The dashboard's HTTP routes: the page, its script and style, and its live data stream.

GET /dashboard serves one self-contained page (services/gateway/static/, shipped as
package data; nothing from a CDN). It holds no data, so it is open even with --api-key;
the page takes the key from its URL fragment (/dashboard#key=...) or asks for it, and
sends it to GET /dashboard/stream, which the API-key check guards like every other route.

The stream is Server-Sent Events, read with fetch() so it can carry the Authorization
header: a "hello" event (block state names, the history so far), then an "update"
event whenever something changed, at most every MIN_UPDATE_S: the engines' latest
snapshots that changed since the last event, the engines gone, and the new history
points. A comment line keeps an idle stream open. A page that stops reading is cut off
after the client timeout, like any stream; every stream ends when the gateway drains. The page closes its stream while hidden,
so a background tab costs nothing.
"""

from __future__ import annotations

import asyncio
import json
from importlib import resources

from aiohttp import web

from services.gateway.dashboard import SNAPSHOT_INTERVAL_S, DashboardHub
from shared.messages import BLOCK_STATES

STATIC = resources.files("services.gateway") / "static"
PAGE_PATH = "/dashboard"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
OPEN_PATHS = (PAGE_PATH, *(f"{PAGE_PATH}/{name}" for name in ASSETS))  # no data: no API key needed
MIN_UPDATE_S = SNAPSHOT_INTERVAL_S / 2
KEEPALIVE_S = 10.0


def _read(name: str) -> bytes:
    return (STATIC / name).read_bytes()


def _event(name: str, data: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


class DashboardRoutes:
    def __init__(self, hub: DashboardHub, client_timeout_s: float):
        self.hub = hub
        self.client_timeout_s = client_timeout_s
        self._files = {name: _read(name) for name in ("dashboard.html", *ASSETS)}  # read once, at start

    def add_to(self, app: web.Application) -> None:
        app.add_routes([
            web.get(PAGE_PATH, self.page),
            *(web.get(f"{PAGE_PATH}/{name}", self._asset(name)) for name in ASSETS),
            web.get(f"{PAGE_PATH}/stream", self.stream),
        ])

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=self._files["dashboard.html"], content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})

    def _asset(self, name: str):
        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=self._files[name], content_type=ASSETS[name], charset="utf-8",
                                headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})
        return handler

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        hub = self.hub

        async def write(data: bytes) -> None:
            await asyncio.wait_for(resp.write(data), self.client_timeout_s)

        with hub.watching():
            try:
                hello = {"block_states": BLOCK_STATES, "history": list(hub.history),
                         "interval_s": SNAPSHOT_INTERVAL_S}
                await write(_event("hello", json.dumps(hello).encode()))
                sent: dict[str, bytes] = {}
                newest = hub.history[-1]["t"] if hub.history else 0.0
                version = -1
                while not hub.closed:
                    version = await hub.next_change(version, KEEPALIVE_S)
                    if hub.closed:
                        break
                    engines = hub.live_engines()
                    changed = [data for key, data in engines.items() if sent.get(key) is not data]
                    gone = [key for key in sent if key not in engines]
                    fresh = [p for p in hub.history if p["t"] > newest]
                    if not (changed or gone or fresh):
                        await write(b": idle\n\n")
                        continue
                    sent = engines
                    if fresh:
                        newest = fresh[-1]["t"]
                    body = (b'{"engines":[' + b",".join(changed) + b'],"gone":' + json.dumps(gone).encode()
                            + b',"points":' + json.dumps(fresh).encode() + b"}")
                    await write(_event("update", body))
                    await asyncio.sleep(MIN_UPDATE_S)
                await asyncio.wait_for(resp.write_eof(), self.client_timeout_s)
            except (TimeoutError, ConnectionResetError):
                if request.transport is not None:
                    request.transport.abort()
        return resp

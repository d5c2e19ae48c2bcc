"""Writing a Responses stream: typed server-sent events (`event: <type>` then its JSON), each write
held to the client timeout so a client that stops reading cannot hold the handler (the chat
stream's rule, services/gateway/app.py)."""

from __future__ import annotations

import asyncio
import socket

import msgspec
from aiohttp import web

SEND_BUFFER = 128 * 1024  # the kernel's send buffer of a stream, as the chat path's (app.STREAM_SEND_BUFFER)
_json = msgspec.json.Encoder()


class ClientStalled(Exception):
    """A write to the client did not complete within the client timeout."""


class EventWriter:
    def __init__(self, request: web.Request, timeout_s: float):
        self.request, self.timeout_s = request, timeout_s
        self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def prepare(self) -> None:
        transport = self.request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        await self.resp.prepare(self.request)

    async def send(self, events: list[dict]) -> None:
        if not events:
            return
        data = b"".join(b"event: " + e["type"].encode() + b"\ndata: " + _json.encode(e) + b"\n\n" for e in events)
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.resp.write(data)
        except TimeoutError as exc:
            raise ClientStalled from exc

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.resp.write_eof(), self.timeout_s)
        except TimeoutError as exc:
            raise ClientStalled from exc

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()

"""The aiohttp handlers of POST /v1/messages and POST /v1/messages/count_tokens.

/v1/messages runs as a chat completion does (services/gateway/app.py): the body parsed (415 unless
JSON, 408 / 413 from the body read), admission (503 / 429), the request sent down the pipeline
and its TextDeltas shaped (message.py; the thinking split off first with `--reasoning-parser`) into one message or an SSE stream of Anthropic's events. A
stream waits for the first delta before it sends headers, so an early error (a prompt too long)
is still a plain HTTP error; a later one is an `error` event. A client that stops reading is cut
off after one write stalls client_timeout_s; leaving early aborts the request (the stream's exit).
count_tokens is a TokenizeRequest of the same messages, tools and template options, so its
count is the input_tokens a message of that body would report. Every error is Anthropic-shaped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import uuid

import msgspec
from aiohttp import web

from services.gateway.anthropic.errors import error_body, error_response
from services.gateway.anthropic.message import EventStream, MessageShape, new_message_id
from services.gateway.anthropic.translate import MessagesRequest, parse_messages_request
from services.gateway.engine_client import EngineError, RequestStream, RequestTimeout
from services.gateway.openai.errors import ApiError
from services.gateway.openai.request import parse_json
from shared.messages import TokenizeRequest

log = logging.getLogger(__name__)

COUNT_TIMEOUT_S = 10.0  # as /tokenize
STREAM_SEND_BUFFER = 128 * 1024  # as the chat path's streams (app.py)
_json = msgspec.json.Encoder()


class MessagesRoutes:
    def __init__(self, gateway, engine_error):
        """gateway: the Gateway (its client, limits, admission, metrics, timeouts, body reader);
        engine_error: EngineError -> ApiError, as the chat path renders it."""
        self.gw, self._engine_error = gateway, engine_error

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self.messages), web.post("/v1/messages/count_tokens", self.count_tokens)]

    async def _parse(self, request: web.Request, count_only: bool) -> MessagesRequest:
        if request.content_type != "application/json":
            raise ApiError("The request body must be JSON, sent with 'Content-Type: application/json'.", 415)
        body = parse_json(await self.gw._read_body(request))
        loras = self.gw.loras
        req = parse_messages_request(body, loras.names(self.gw.model_names), self.gw.limits, count_only=count_only,
                                     reasoning_parser=self.gw.reasoning_parser)
        return dataclasses.replace(req, parsed=loras.under(body.get("model"), req.parsed))

    async def count_tokens(self, request: web.Request) -> web.Response:
        try:
            parsed = (await self._parse(request, count_only=True)).parsed
            reply = await self.gw.client.call(TokenizeRequest(
                f"count-{uuid.uuid4().hex}", messages=parsed.messages, chat=parsed.chat,
                add_special_tokens=parsed.add_special_tokens), COUNT_TIMEOUT_S)
        except ApiError as exc:
            return error_response(exc)
        except EngineError as exc:
            return error_response(self._engine_error(exc))
        except RequestTimeout:
            return error_response(ApiError(f"No tokenizer answered within {COUNT_TIMEOUT_S:g} s.", 503))
        return web.json_response({"input_tokens": len(reply.token_ids)})

    async def messages(self, request: web.Request) -> web.StreamResponse:
        gw = self.gw
        try:
            req = await self._parse(request, count_only=False)
        except ApiError as exc:
            return error_response(exc)
        refused = gw.admission.check_capacity()
        if refused is not None:
            gw.metrics.rejected.labels(reason=refused.code or refused.error_type).inc()
            return error_response(refused)
        message_id = new_message_id()
        lora = req.parsed.params.lora
        shape = MessageShape(message_id, lora.name if lora else gw.served_model_name, req.parsed.tool_mode, req.stop_sequences,
                             req.single_call,
                             # a grammar-constrained answer (a forced tool call, a format) has no thinking to split
                             gw.reasoning_parser if req.parsed.params.structured is None else None,
                             req.show_thinking)
        timer = gw.metrics.track(1)
        try:
            async with gw.client.open(req.parsed.to_generate(message_id), gw.timeout_s) as stream:
                first = await stream.next()
                if req.parsed.stream:
                    return await self._stream(request, stream, first, shape, timer)
                return await self._collect(stream, first, shape, timer)
        except EngineError as exc:
            return error_response(self._engine_error(exc))
        except RequestTimeout:
            return error_response(gw._timeout_error())

    async def _collect(self, stream: RequestStream, msg, shape: MessageShape, timer) -> web.Response:
        texts, thoughts = [], []
        while True:
            timer.on_delta(msg)
            done = shape.record(msg)
            thinking, text = shape.split(msg)
            thoughts.append(thinking)
            texts.append(text)
            if done:
                break
            msg = await stream.next()
        body = await shape.full("".join(texts), "".join(thoughts))
        return web.json_response(body, dumps=lambda obj: _json.encode(obj).decode())

    async def _stream(self, request: web.Request, stream: RequestStream, msg, shape: MessageShape,
                      timer) -> web.StreamResponse:
        timeout_s = self.gw.client_timeout_s
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        await resp.prepare(request)

        async def send(events: list[tuple[str, dict]]) -> None:
            if events:  # a client that stopped reading must not hold this handler forever
                data = b"".join(b"event: " + name.encode() + b"\ndata: " + _json.encode(obj) + b"\n\n"
                                for name, obj in events)
                async with asyncio.timeout(timeout_s):
                    await resp.write(data)

        events = EventStream(shape)
        try:
            shape.record(msg)  # the input tokens, for message_start
            await send(shape.start())
            try:
                while True:
                    timer.on_delta(msg)
                    done = shape.record(msg)
                    await send(events.on_delta(*shape.split(msg)))
                    if done:
                        break
                    msg = await stream.next()
                await send(await events.end())
            except EngineError as exc:
                await send([("error", error_body(self._engine_error(exc)))])
            except RequestTimeout:
                await send([("error", error_body(self.gw._timeout_error()))])
            await asyncio.wait_for(resp.write_eof(), timeout_s)
        except ConnectionResetError:
            log.info("client left %s mid-stream", stream.request_id)  # the stream's exit aborts it
        except TimeoutError:
            log.warning("client of %s stopped reading for %g s; closing it", stream.request_id, timeout_s)
            if request.transport is not None:
                request.transport.abort()
        return resp

"""The HTTP handlers of the Responses API: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`.

A create is parsed into the chat path's request (request.py), admitted like any generation
(the gateway's API key, capacity and limits), sent down the pipeline under the response's id,
and answered whole (output.py) or as typed events (events.py), its thinking split off as a
reasoning item with a reasoning parser (thinking.py). With `store` (the default) the
finished response, and the conversation it ends, go into the gateway's ResponseStore; an error
before the first output is a plain HTTP error, one after it an `error` event that ends the stream.
"""

from __future__ import annotations

import dataclasses
import logging

from aiohttp import web

from services.gateway.engine_client import EngineError, RequestTimeout
from services.gateway.openai.errors import ApiError
from services.gateway.openai.request import parse_json
from services.gateway.responses_api.events import ResponseEvents
from services.gateway.responses_api.items import output_messages
from services.gateway.responses_api.output import ResponseObject, new_id, output_items, status_of, usage
from services.gateway.responses_api.request import ResponsesRequest, parse_responses
from services.gateway.responses_api.sse import ClientStalled, EventWriter
from services.gateway.responses_api.store import ResponseStore
from services.gateway.responses_api.thinking import Thinking

log = logging.getLogger(__name__)


class ResponsesRoutes:
    def __init__(self, gateway, error_response, engine_error, store: ResponseStore | None = None):
        self.gw, self.error_response, self.engine_error = gateway, error_response, engine_error
        self.store = store if store is not None else ResponseStore()

    def routes(self) -> list:
        return [web.post("/v1/responses", self.create), web.get("/v1/responses/{response_id}", self.retrieve),
                web.delete("/v1/responses/{response_id}", self.delete)]

    async def retrieve(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        entry = self.store.get(response_id)
        if entry is None:
            return self.error_response(_not_found(response_id))
        return web.json_response(entry.body)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            return self.error_response(_not_found(response_id))
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: web.Request) -> web.StreamResponse:
        gw = self.gw
        if request.content_type != "application/json":
            return self.error_response(ApiError(
                "The request body must be JSON, sent with 'Content-Type: application/json'.", 415,
                code="unsupported_media_type"))
        try:
            body = parse_json(await gw._read_body(request))
            parsed = parse_responses(body, gw.loras.names(gw.model_names), gw.limits, self.store)
            parsed = dataclasses.replace(parsed, chat=gw.loras.under(body.get("model"), parsed.chat))
        except ApiError as exc:
            return self.error_response(exc)
        refused = gw.admission.check_capacity()
        if refused is not None:
            gw.metrics.rejected.labels(reason=refused.code or refused.error_type).inc()
            return self.error_response(refused)
        lora = parsed.chat.params.lora
        obj = ResponseObject(lora.name if lora else gw.served_model_name, parsed.echo)
        timer = gw.metrics.track(1)
        try:
            async with gw.client.open(parsed.chat.to_generate(obj.id), gw.timeout_s) as stream:
                first = await stream.next()
                if parsed.stream:
                    return await self._stream(request, stream, first, parsed, obj, timer)
                return await self._collect(stream, first, parsed, obj, timer)
        except EngineError as exc:
            return self.error_response(self.engine_error(exc))
        except RequestTimeout:
            return self.error_response(gw._timeout_error())

    async def _collect(self, stream, msg, parsed: ResponsesRequest, obj: ResponseObject, timer) -> web.Response:
        thinking = Thinking(self.gw.reasoning_parser, parsed.chat)
        texts, cached = [], 0
        while True:
            timer.on_delta(msg)
            texts.append(thinking.split(msg)[1])  # the reasoning stays in thinking
            cached = max(cached, msg.num_cached_tokens)
            if msg.finish_reason is not None:
                break
            msg = await stream.next()
        status = status_of(msg.finish_reason)
        items = await output_items(parsed.chat.tool_mode, "".join(texts), status, thinking.text,
                                   _reasoning_status(thinking, status))
        body = obj.body(status, items, _usage(msg, cached, thinking))
        self._keep(parsed, body)
        return web.json_response(body)

    async def _stream(self, request, stream, msg, parsed: ResponsesRequest, obj: ResponseObject, timer):
        writer, events = EventWriter(request, self.gw.client_timeout_s), ResponseEvents(obj)
        thinking = Thinking(self.gw.reasoning_parser, parsed.chat)
        mode = parsed.chat.tool_mode
        live = mode is None or mode.choice in ("none", "named")  # else parsed for calls at the end
        await writer.prepare()
        try:
            try:
                await writer.send(events.start())
                if mode is not None and mode.choice == "named":
                    await writer.send(events.open_call(new_id("call"), mode.named))
                elif live and thinking.parser is None:
                    await writer.send(events.open_message())  # else opened at the answer's first text
                texts, cached = [], 0
                while True:
                    timer.on_delta(msg)
                    reasoning, text = thinking.split(msg)
                    texts.append(text)
                    cached = max(cached, msg.num_cached_tokens)
                    await writer.send(events.reasoning(reasoning) + (events.text(text) if live else []))
                    if msg.finish_reason is not None:
                        break
                    msg = await stream.next()
                status = status_of(msg.finish_reason)
                if events.reasoning_open:
                    await writer.send(events.close(_reasoning_status(thinking, status)))
                if live:
                    await writer.send(events.end_live(status))
                else:
                    items = await output_items(mode, "".join(texts), status, thinking.text)
                    await writer.send(events.replay([i for i in items if i["type"] != "reasoning"], status))
                final = events.finish(status, _usage(msg, cached, thinking))
                await writer.send([final])
                self._keep(parsed, final["response"])
            except EngineError as exc:
                await writer.send([_error_event(events, self.engine_error(exc))])
            except RequestTimeout:
                await writer.send([_error_event(events, self.gw._timeout_error())])
            await writer.close()
        except ConnectionResetError:
            log.info("client left %s mid-stream", obj.id)  # the stream's exit aborts it
        except ClientStalled:
            log.warning("client of %s stopped reading for %g s; closing it", obj.id, self.gw.client_timeout_s)
            writer.abort()
        return writer.resp

    def _keep(self, parsed: ResponsesRequest, body: dict) -> None:
        if parsed.store:
            self.store.put(body["id"], body, parsed.messages + output_messages(body["output"]))


def _not_found(response_id: str) -> ApiError:
    return ApiError(f"Response with id '{response_id[:128]}' not found.", 404, param="response_id",
                    code="response_not_found")


def _reasoning_status(thinking: Thinking, status: str) -> str:
    """A reasoning item is complete once the thinking ended, whatever cut the answer after it."""
    return "completed" if thinking.ended else status


def _usage(msg, cached: int, thinking: Thinking) -> dict:
    return usage(msg.num_prompt_tokens, msg.num_output_tokens, cached, thinking.num_tokens)


def _error_event(events: ResponseEvents, err: ApiError) -> dict:
    return events.error(err.code or err.error_type, err.message, err.param)

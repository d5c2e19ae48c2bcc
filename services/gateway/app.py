"""The gateway's HTTP routes: OpenAI completions and chat, models, health, metrics.

A generation handler validates the body, sends the request down the pipeline and turns
the TextDeltas that come back into one JSON object or an SSE stream. A stream waits
for the first message before it sends headers, so an error the pipeline finds early
(prompt too long) is still a plain HTTP error; an error after that is an SSE error
event followed by [DONE]. A handler that leaves early (client gone, timeout) aborts
its request through the EngineClient. `Admission` decides first whether a request may
enter at all (API key, draining, scheduler alive, queue bound).
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from services.gateway.admission import RETRY_AFTER_S, Admission
from services.gateway.engine_client import EngineClient, EngineError, RequestStream, RequestTimeout
from services.gateway.health import StageTracker
from services.gateway.metrics import Metrics, RequestTimer
from services.gateway.openai_schema import (
    ApiError,
    ResponseBuilder,
    new_request_id,
    parse_chat,
    parse_completion,
    parse_json,
    usage,
)
from services.gateway.openapi import openapi_spec
from services.gateway.options import DEFAULT_MAX_REQUEST_BYTES
from shared.messages import TextDelta

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, dumps=_dumps, headers=err.headers)


def _engine_api_error(exc: EngineError) -> ApiError:
    e = exc.err
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return ApiError(e.message, e.status, e.param, e.error_type, headers=headers)


class Gateway:
    def __init__(
        self,
        client: EngineClient,
        tracker: StageTracker,
        metrics: Metrics,
        served_model_name: str,
        model_names: set[str],
        request_timeout_s: float,
        model_root: str | None = None,
        admission: Admission | None = None,
        max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ):
        self.client, self.tracker, self.metrics = client, tracker, metrics
        self.admission = admission or Admission(None, None, lambda: 0, lambda: True)
        self.max_body_bytes = max_body_bytes
        self.served_model_name = served_model_name
        self.model_names = model_names | {served_model_name}
        self.timeout_s = request_timeout_s
        self.model_root = model_root or served_model_name
        self.created = int(time.time())

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self.admission.middleware()])
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.get("/v1/models", self.models),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_page),
            web.get("/openapi.json", self.openapi),
        ])
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        spec = openapi_spec(sorted(self.model_names), secured=self.admission.api_key is not None)
        return web.json_response(spec, dumps=_dumps)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model_name, "object": "model", "created": self.created,
            "owned_by": "pagedserve", "root": self.model_root, "parent": None,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        healthy, body = self.tracker.report()
        body["requests_in_flight"] = self.client.num_in_flight
        return web.json_response(body, status=200 if healthy else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        data, content_type = self.metrics.render()
        return web.Response(body=data, headers={"Content-Type": content_type})

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        try:
            parsed = parse(parse_json(await self._read_body(request)), self.model_names)
        except ApiError as exc:
            return error_response(exc)
        refused = self.admission.check_capacity()
        if refused is not None:
            self.metrics.rejected.labels(reason=refused.code or refused.error_type).inc()
            return error_response(refused)
        request_id = new_request_id(parsed.kind)
        out = ResponseBuilder(
            parsed.kind, request_id, self.served_model_name, parsed.include_usage, parsed.return_token_ids,
            num_choices=parsed.params.n,
        )
        timer = self.metrics.track(parsed.params.n)
        try:
            async with self.client.open(parsed.to_generate(request_id), self.timeout_s) as stream:
                first = await stream.next()
                if parsed.stream:
                    return await self._stream(request, stream, first, out, timer)
                return await self._collect(stream, first, out, timer)
        except EngineError as exc:
            return error_response(_engine_api_error(exc))
        except RequestTimeout:
            return error_response(self._timeout_error())

    async def _read_body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(f"The request body is larger than {self.max_body_bytes} bytes.", 413,
                           error_type="invalid_request_error", code="body_too_large") from exc

    def _timeout_error(self) -> ApiError:
        return ApiError(f"The request timed out after {self.timeout_s:g} s.", 504, error_type="timeout_error")

    async def _collect(
        self, stream: RequestStream, msg: TextDelta, out: ResponseBuilder, timer: RequestTimer
    ) -> web.Response:
        n = len(out.choices)
        texts: list[list[str]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        while True:
            timer.on_delta(msg)
            texts[msg.seq_index].append(msg.text)
            token_ids[msg.seq_index] += msg.token_ids
            if out.record(msg):
                break
            msg = await stream.next()
        choices = [("".join(t), c.finish_reason, ids) for t, c, ids in zip(texts, out.choices, token_ids, strict=True)]
        body = out.full(choices, usage(msg.num_prompt_tokens, out.num_output_tokens))
        return web.json_response(body, dumps=_dumps)

    async def _stream(
        self,
        request: web.Request,
        stream: RequestStream,
        msg: TextDelta,
        out: ResponseBuilder,
        timer: RequestTimer,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)

        async def send(obj) -> None:
            await resp.write(f"data: {_dumps(obj)}\n\n".encode())

        try:
            try:
                if out.kind == "chat":
                    for index in range(len(out.choices)):
                        await send(out.chunk("", role=True, index=index))
                while True:
                    timer.on_delta(msg)
                    done = out.record(msg)
                    if msg.text or msg.finish_reason is not None or (out.return_token_ids and msg.token_ids):
                        await send(out.chunk(msg.text, msg.finish_reason, token_ids=msg.token_ids,
                                             index=msg.seq_index))
                    if done:
                        break
                    msg = await stream.next()
                if out.include_usage:
                    await send(out.usage_chunk(usage(msg.num_prompt_tokens, out.num_output_tokens)))
            except EngineError as exc:
                await send(_engine_api_error(exc).body())
            except RequestTimeout:
                await send(self._timeout_error().body())
            await resp.write(SSE_DONE)
            await resp.write_eof()
        except ConnectionResetError:
            log.info("client left %s mid-stream", stream.request_id)  # the stream's exit aborts it
        return resp

"""The gateway's HTTP routes: OpenAI completions and chat, models, health, metrics; Anthropic
messages (anthropic/routes.py), embeddings (embedding_routes.py) and the Responses API
(responses_api/) plug in here.

A generation handler validates the body, sends the request down the pipeline and turns
the TextDeltas that come back into one JSON object or an SSE stream (a chat answer's
thinking split off as reasoning_content with `--reasoning-parser`). A stream waits
for the first message before it sends headers, so an error the pipeline finds early
(prompt too long) is still a plain HTTP error; an error after that is an SSE error
event followed by [DONE]. A handler that leaves early (client gone, timeout) aborts
its request through the EngineClient. `Admission` decides first whether a request may
enter at all (API key, draining, every stage alive, queue bound), after `HostCheck` (the
Host names served); the parser holds each request to the gateway's `RequestLimits`. A
non-zero `priority` is a 400 unless the engines schedule by it (`--scheduling-policy priority`).
A completion or chat whose `model` names a LoRA adapter (`lora_registry`) runs under it (its
answer names the adapter); /v1/models lists the adapters with the base model as `parent`.

Clients are held to `client_timeout_s`: a body must be application/json (415 otherwise,
so a web page cannot post one from a browser without a CORS preflight) and arrive in
time (408), and a streamed answer the client stops reading is cut off when one write
stalls that long. Slow headers are the server's keep-alive timeout (service.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time

import msgspec
from aiohttp import web

from services.gateway.admission import RETRY_AFTER_S, Admission
from services.gateway.anthropic.routes import MessagesRoutes
from services.gateway.batch_stream import BatchStream
from services.gateway.embedding_routes import EmbeddingRoutes
from services.gateway.engine_client import EngineClient, EngineError, RequestStream, RequestTimeout
from services.gateway.health import StageTracker
from services.gateway.host_check import HostCheck
from services.gateway.limits import DEFAULT_LIMITS, RequestLimits
from services.gateway.lora_registry import LoraRegistry
from services.gateway.lora_routes import LoraRoutes
from services.gateway.metrics import Metrics, RequestTimer
from services.gateway.openai.chat import parse_chat
from services.gateway.openai.completions import parse_completion
from services.gateway.openai.errors import ApiError
from services.gateway.openai.openapi import openapi_spec
from services.gateway.openai.request import parse_json, public_model_names
from services.gateway.openai.responses import ResponseBuilder, new_request_id
from services.gateway.options import DEFAULT_CLIENT_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from services.gateway.output_text import TextDelta
from services.gateway.responses_api.routes import ResponsesRoutes
from services.gateway.tokenize_routes import TokenizeRoutes

log = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
# The kernel's send buffer of a streamed answer: fixed (no autotuning up to megabytes),
# so a client that stops reading stalls the writes soon, and holds little memory.
STREAM_SEND_BUFFER = 128 * 1024
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.@~+-]+){2,}[\\/]?")  # /a/b or C:\a\b


def hide_paths(text: str) -> str:
    """A message for a client, with the server's file paths taken out."""
    return _PATH.sub("<path>", text)


class _ClientStalled(Exception):
    """A write to the client did not complete within the client timeout."""


# msgspec writes the same compact UTF-8 JSON as json.dumps(ensure_ascii=False) at a tenth of
# its cost (1 µs against 10 µs a stream chunk; json was a third of the gateway's streaming time)
_json = msgspec.json.Encoder()


def _dumps(obj) -> str:
    return _json.encode(obj).decode()


def error_response(err: ApiError) -> web.Response:
    return web.json_response(err.body(), status=err.status, dumps=_dumps, headers=err.headers)


def _engine_api_error(exc: EngineError) -> ApiError:
    e = exc.err
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return ApiError(hide_paths(e.message), e.status, e.param, e.error_type, headers=headers)


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
        client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S,
        limits: RequestLimits = DEFAULT_LIMITS,
        host_check: HostCheck | None = None,
        pooling: str = "mean",
        hidden_size: int = 0,
        reasoning_parser: str | None = None,
        scheduling_policy: str = "fcfs",
        loras: LoraRegistry | None = None,
    ):
        self.limits, self.host_check = limits, host_check
        self.reasoning_parser = reasoning_parser  # reasoning.py: a chat answer's thinking as reasoning_content
        self.scheduling_policy = scheduling_policy  # the engines' (--scheduling-policy): fcfs refuses a priority
        self.client, self.tracker, self.metrics = client, tracker, metrics
        self.admission = admission or Admission(None, None, lambda: 0, lambda: None)
        self.max_body_bytes = max_body_bytes
        self.client_timeout_s = client_timeout_s
        self.served_model_name = served_model_name
        self.model_names = model_names | {served_model_name}
        self.timeout_s = request_timeout_s
        root = model_root or served_model_name
        self.model_root = os.path.basename(root.rstrip("/\\")) if os.path.isabs(root) else root
        self.created = int(time.time())
        self.tokens = TokenizeRoutes(client, self.model_names, self._read_body, error_response)
        self.embedding_routes = EmbeddingRoutes(self, pooling, hidden_size)
        self.error, self.engine_error, self.dumps = error_response, _engine_api_error, _dumps
        self.anthropic = MessagesRoutes(self, _engine_api_error)
        self.responses = ResponsesRoutes(self, error_response, _engine_api_error)
        self.loras = loras or LoraRegistry(None, 0, served_model_name)
        self.lora_routes = LoraRoutes(self.loras, self.model_names, self._read_body, error_response)

    def make_app(self) -> web.Application:
        checks = [self.admission.middleware()]
        if self.host_check is not None and self.host_check.names is not None:
            checks.insert(0, self.host_check.middleware())
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=checks)
        app.add_routes([
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/embeddings", self.embedding_routes.embeddings),
            web.get("/v1/models", self.models),
            web.post("/tokenize", self.tokens.tokenize),
            web.post("/detokenize", self.tokens.detokenize),
            web.get("/version", self.tokens.version),
            web.get("/health", self.health),
            web.get("/metrics", self.metrics_page),
            web.get("/openapi.json", self.openapi),
            *self.anthropic.routes(),
            *self.responses.routes(),
            *self.lora_routes.routes(),
        ])
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        spec = openapi_spec(public_model_names(self.model_names), secured=self.admission.api_key is not None,
                            metrics_public="/health" in self.admission.open_paths, lim=self.limits)
        return web.json_response(spec, dumps=_dumps)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model_name, "object": "model", "created": self.created,
            "owned_by": "pagedserve", "root": self.model_root, "parent": None,
            "max_model_len": await self.tokens.context_length(),
        }
        adapters = [{**card, "id": name, "root": name, "parent": self.served_model_name}
                    for name in self.loras.adapters]
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def health(self, request: web.Request) -> web.Response:
        healthy, body = self.tracker.report()
        body["requests_in_flight"] = self.client.num_in_flight
        refused = self.admission.check_capacity()
        body["admitting"] = refused is None
        return web.json_response(body, status=200 if healthy else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        data, content_type = self.metrics.render()
        return web.Response(body=data, headers={"Content-Type": content_type})

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        if request.content_type != "application/json":
            return error_response(ApiError(
                "The request body must be JSON, sent with 'Content-Type: application/json'.", 415,
                code="unsupported_media_type"))
        try:
            body = parse_json(await self._read_body(request))
            parsed = self.loras.under(body.get("model"), parse(body, self.loras.names(self.model_names), self.limits))
        except ApiError as exc:
            return error_response(exc)
        lora = parsed.params.lora
        if parsed.priority and self.scheduling_policy != "priority":
            return error_response(ApiError(
                f"'priority' needs a server started with --scheduling-policy priority; this one schedules "
                f"{self.scheduling_policy} (first come, first served), so only priority 0 is accepted.",
                param="priority"))
        refused = self.admission.check_capacity()
        if refused is not None:
            self.metrics.rejected.labels(reason=refused.code or refused.error_type).inc()
            return error_response(refused)
        request_id = new_request_id(parsed.kind)
        out = ResponseBuilder(
            parsed.kind, request_id, lora.name if lora else self.served_model_name, parsed.include_usage, parsed.return_token_ids,
            num_choices=parsed.params.n * parsed.num_prompts, params=parsed.params, echo_only=parsed.echo_only,
            tool_mode=parsed.tool_mode,
            # a grammar-constrained answer (response_format, a forced tool call) has no thinking to split
            reasoning_parser=self.reasoning_parser if parsed.params.structured is None else None,
            include_reasoning=parsed.include_reasoning,
        )
        timer = self.metrics.track(parsed.params.n * parsed.num_prompts)
        if parsed.batch:
            opened = BatchStream(self.client, parsed.to_generates(request_id), self.timeout_s, request_id)
        else:
            opened = self.client.open(parsed.to_generate(request_id), self.timeout_s)
        try:
            async with opened as stream:
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
            return await asyncio.wait_for(request.read(), self.client_timeout_s)
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(f"The request body is larger than {self.max_body_bytes} bytes.", 413,
                           error_type="invalid_request_error", code="body_too_large") from exc
        except TimeoutError as exc:
            raise ApiError(f"The request body did not arrive within {self.client_timeout_s:g} s.", 408,
                           error_type="timeout_error", code="body_timeout", headers={"Connection": "close"}) from exc

    def _timeout_error(self) -> ApiError:
        return ApiError(f"The request timed out after {self.timeout_s:g} s.", 504, error_type="timeout_error")

    async def _collect(
        self, stream: RequestStream | BatchStream, msg: TextDelta, out: ResponseBuilder, timer: RequestTimer
    ) -> web.Response:
        n = len(out.choices)
        texts: list[list[str]] = [[] for _ in range(n)]
        token_ids: list[list[int]] = [[] for _ in range(n)]
        while True:
            timer.on_delta(msg)
            texts[msg.seq_index].append(out.split(msg)[1])  # the reasoning stays in out
            token_ids[msg.seq_index] += msg.token_ids
            if out.record(msg):
                break
            msg = await stream.next()
        choices = [("".join(t), c.finish_reason, ids) for t, c, ids in zip(texts, out.choices, token_ids, strict=True)]
        if out.tool_mode is not None:
            for index, (text, _, _) in enumerate(choices):
                await out.parse_calls(index, text)
        body = out.full(choices, out.usage())
        return web.json_response(body, dumps=_dumps)

    async def _stream(
        self,
        request: web.Request,
        stream: RequestStream | BatchStream,
        msg: TextDelta,
        out: ResponseBuilder,
        timer: RequestTimer,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        await resp.prepare(request)

        async def write(data: bytes) -> None:
            try:  # a client that stopped reading must not hold this handler forever
                async with asyncio.timeout(self.client_timeout_s):  # (wait_for would make a task per chunk)
                    await resp.write(data)
            except TimeoutError as exc:
                raise _ClientStalled from exc

        async def send(obj) -> None:
            await write(b"data: " + _json.encode(obj) + b"\n\n")

        try:
            try:
                if out.kind == "chat":
                    for index in range(len(out.choices)):
                        await send(out.chunk("", role=True, index=index))
                while True:
                    timer.on_delta(msg)
                    done = out.record(msg)
                    reasoning, text = out.split(msg)
                    if out.tool_mode is not None and msg.finish_reason is not None:
                        await out.parse_calls(msg.seq_index, out.choices[msg.seq_index].held + text)
                    if (text or reasoning or msg.finish_reason is not None or (out.return_token_ids and msg.token_ids)
                            or (out.logprobs and msg.logprobs)):
                        chunk = out.chunk(text, msg.finish_reason, token_ids=msg.token_ids,
                                          index=msg.seq_index, logprobs=msg.logprobs, reasoning=reasoning)
                        if chunk is not None:
                            await send(chunk)
                    if done:
                        break
                    msg = await stream.next()
                if out.include_usage:
                    await send(out.usage_chunk(out.usage()))
            except EngineError as exc:
                await send(_engine_api_error(exc).body())
            except RequestTimeout:
                await send(self._timeout_error().body())
            await write(SSE_DONE)
            await asyncio.wait_for(resp.write_eof(), self.client_timeout_s)
        except ConnectionResetError:
            log.info("client left %s mid-stream", stream.request_id)  # the stream's exit aborts it
        except (TimeoutError, _ClientStalled):
            log.warning("client of %s stopped reading for %g s; closing it", stream.request_id, self.client_timeout_s)
            if request.transport is not None:
                request.transport.abort()  # drops what is buffered for it; the stream's exit aborts the request
        return resp

"""vLLM's /tokenize and /detokenize, /version, and the context length /v1/models reports.

The gateway holds no tokenizer: each call is a one-shot TokenizeRequest or
DetokenizeRequest to a tokenizer replica, answered with a TokenizeResult (see
`EngineClient.call`), so the token ids are exactly those a generation request of the
same prompt or messages would run. Shapes as vLLM's:
- POST /tokenize {"prompt": str} or {"messages": [...], "add_generation_prompt", "continue_final_message",
  "chat_template_kwargs"}, with "add_special_tokens", "return_token_strs"
  -> {"count", "max_model_len", "tokens", "token_strs"}
- POST /detokenize {"tokens": [...]} -> {"prompt": text}
- GET /version -> {"version": ...}
The model's context length is learnt from any answer and kept (it is the tokenizer
stage's --max-model-len or the model's own).
"""

from __future__ import annotations

import uuid
from importlib.metadata import PackageNotFoundError, version

from aiohttp import web

from services.gateway.engine_client import EngineClient, EngineError, RequestTimeout
from services.gateway.openai.errors import ApiError
from services.gateway.openai.request import parse_json
from services.gateway.openai.tokenize_bodies import parse_detokenize, parse_tokenize
from shared.messages import TokenizeRequest

CALL_TIMEOUT_S = 10.0
MODELS_TIMEOUT_S = 2.0  # /v1/models answers without max_model_len rather than wait longer


def package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:
        return "0.1.0"


class TokenizeRoutes:
    def __init__(self, client: EngineClient, model_names: set[str], read_body, error_response):
        self.client, self.model_names = client, model_names
        self._read_body, self._error = read_body, error_response
        self.max_model_len: int | None = None

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._call(request, parse_tokenize, lambda r: {
            "count": len(r.token_ids), "max_model_len": r.max_model_len, "tokens": r.token_ids,
            "token_strs": r.token_strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._call(request, parse_detokenize, lambda r: {"prompt": r.text})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": package_version()})

    async def context_length(self) -> int | None:
        """The model's context length, asked of a tokenizer replica once."""
        if self.max_model_len is None:
            try:
                reply = await self.client.call(TokenizeRequest(f"info-{uuid.uuid4().hex}", prompt=""),
                                               MODELS_TIMEOUT_S)
                self.max_model_len = reply.max_model_len
            except (EngineError, RequestTimeout):
                pass
        return self.max_model_len

    async def _call(self, request: web.Request, parse, render) -> web.Response:
        if request.content_type != "application/json":
            return self._error(ApiError("The request body must be JSON, sent with 'Content-Type: application/json'.",
                                        415, code="unsupported_media_type"))
        try:
            msg = parse(parse_json(await self._read_body(request)), self.model_names, f"tok-{uuid.uuid4().hex}")
            reply = await self.client.call(msg, CALL_TIMEOUT_S)
        except ApiError as exc:
            return self._error(exc)
        except EngineError as exc:
            e = exc.err
            return self._error(ApiError(e.message, e.status, e.param, e.error_type))
        except RequestTimeout:
            return self._error(ApiError(f"No tokenizer answered within {CALL_TIMEOUT_S:g} s.", 503,
                                        error_type="service_unavailable"))
        self.max_model_len = reply.max_model_len
        return web.json_response(render(reply))

"""Who may send a generation request now: API key, draining, scheduler presence, queue bound.

Checks run before a request enters the pipeline and answer with an OpenAI-style error (an
Anthropic-shaped one on the /v1/messages routes):
401 without the API key, sent as `Authorization: Bearer <key>` or as Anthropic's `x-api-key: <key>`
(on every route but /openapi.json and the dashboard page; /health and /metrics are
open only with --metrics-public, since they tell who is using the server how much), 503 while draining at shutdown or while a stage (tokenizer, scheduler,
executor) has no live instance, 429
with Retry-After once max_queued requests already wait for their first token.
"""

from __future__ import annotations

import hmac
import os

from aiohttp import web

from services.gateway.anthropic import errors as anthropic_errors
from services.gateway.dashboard_http import OPEN_PATHS as DASHBOARD_PAGES
from services.gateway.openai.errors import ApiError
from services.gateway.options import API_KEY_ENV

RETRY_AFTER_S = 1
ALWAYS_OPEN = ("/openapi.json", *DASHBOARD_PAGES)  # the dashboard's data stream needs the key
METRICS_PATHS = ("/health", "/metrics")


def api_key_from(arg: str | None) -> str | None:
    """The key from --api-key, else from $PAGEDSERVE_API_KEY; an empty one means none."""
    return arg or os.environ.get(API_KEY_ENV) or None


class Admission:
    def __init__(self, api_key: str | None, max_queued: int | None, num_waiting, missing_stage,
                 metrics_public: bool = False):
        self.api_key = api_key
        self.open_paths = ALWAYS_OPEN + (METRICS_PATHS if metrics_public else ())
        self.max_queued = max_queued
        self._num_waiting = num_waiting  # () -> int
        self._missing_stage = missing_stage  # () -> the name of a stage that is down, or None
        self.draining = False

    def check_key(self, request: web.Request) -> ApiError | None:
        if self.api_key is None or request.path in self.open_paths:
            return None
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        x_api_key = request.headers.get("x-api-key")
        if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), self.api_key.encode()):
            return None
        return ApiError(
            "Missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.", 401,
            error_type="authentication_error", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def check_capacity(self) -> ApiError | None:
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if self.draining:
            return ApiError("The server is shutting down.", 503, error_type="service_unavailable",
                            headers={**retry, "Connection": "close"})
        missing = self._missing_stage()
        if missing is not None:
            return ApiError(f"The {missing} is not available; please retry shortly.", 503,
                            error_type="service_unavailable", headers=retry)
        if self.max_queued is not None and self._num_waiting() >= self.max_queued:
            return ApiError(
                f"Too many requests are waiting ({self.max_queued}); please retry shortly.", 429,
                error_type="rate_limit_error", code="queue_full", headers=retry,
            )
        return None

    def middleware(self):
        @web.middleware
        async def check_api_key(request: web.Request, handler):
            err = self.check_key(request)
            if err is not None:
                if anthropic_errors.is_anthropic_path(request.path):
                    return anthropic_errors.error_response(err)
                return web.json_response(err.body(), status=err.status, headers=err.headers)
            return await handler(request)

        return check_api_key

"""Who may send a generation request now: API key, draining, scheduler presence, queue bound.

Checks run before a request enters the pipeline and answer with an OpenAI-style error:
401 without the API key (on /v1 routes; /health, /metrics and /openapi.json stay
open for probes), 503 while draining at shutdown or while no scheduler is alive, 429
with Retry-After once max_queued requests already wait for their first token.
"""

from __future__ import annotations

import hmac
import os

from aiohttp import web

from services.gateway.openai_schema import ApiError
from services.gateway.options import API_KEY_ENV

RETRY_AFTER_S = 1


def api_key_from(arg: str | None) -> str | None:
    """The key from --api-key, else from $PAGEDSERVE_API_KEY; an empty one means none."""
    return arg or os.environ.get(API_KEY_ENV) or None


class Admission:
    def __init__(self, api_key: str | None, max_queued: int | None, num_waiting, scheduler_available):
        self.api_key = api_key
        self.max_queued = max_queued
        self._num_waiting = num_waiting  # () -> int
        self._scheduler_available = scheduler_available  # () -> bool
        self.draining = False

    def check_key(self, request: web.Request) -> ApiError | None:
        if self.api_key is None or not request.path.startswith("/v1/"):
            return None
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            return None
        return ApiError(
            "Missing or invalid API key: send 'Authorization: Bearer <key>'.", 401,
            error_type="authentication_error", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def check_capacity(self) -> ApiError | None:
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        if self.draining:
            return ApiError("The server is shutting down.", 503, error_type="service_unavailable",
                            headers={**retry, "Connection": "close"})
        if not self._scheduler_available():
            return ApiError("The scheduler is not available; please retry shortly.", 503,
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
                return web.json_response(err.body(), status=err.status, headers=err.headers)
            return await handler(request)

        return check_api_key

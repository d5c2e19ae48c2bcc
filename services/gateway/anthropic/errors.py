"""Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`, with the HTTP status
of the ApiError it renders (the gateway raises ApiErrors everywhere; only their body changes).

Error types as Anthropic names them: 400 invalid_request_error, 401 authentication_error, 404
not_found_error, 413 request_too_large, 429 rate_limit_error, 503 overloaded_error (as Anthropic's
529, with Retry-After kept), any other 5xx api_error; 408, 415 and other 4xx are invalid requests.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from services.gateway.openai.errors import ApiError

PATH_PREFIX = "/v1/messages"  # every route of this dialect: its errors have this shape

_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_json = msgspec.json.Encoder()


def is_anthropic_path(path: str) -> bool:
    return path == PATH_PREFIX or path.startswith(PATH_PREFIX + "/")


def error_type(status: int) -> str:
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}


def error_response(err: ApiError) -> web.Response:
    return web.json_response(error_body(err), status=err.status, headers=err.headers,
                             dumps=lambda obj: _json.encode(obj).decode())

"""The gateway's options (shared.options), which the launcher forwards whole: where it
listens, the model name clients use, the API key, queue and body bounds, client
timeouts, the Host names served (host_check) and the bounds on each request's work
(limits.RequestLimits). The API key never goes on a command line (`ps` shows those): the
launcher hands it over in the environment.

Kept apart from the gateway's service module so that the launcher (imported by every
`pagedserve` command) does not pull in aiohttp and uvloop.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.engine_router import POLICIES
from services.gateway.limits import RequestLimits
from services.gateway.reasoning import REASONING_PARSERS
from shared.messages import POOLING_KINDS
from shared.options import group, option

API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_CLIENT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class GatewayOptions:
    """gateway (HTTP, the OpenAI API)"""

    host: str = option("127.0.0.1", "address the HTTP server binds")
    port: int = option(8000, "HTTP port")
    served_model_name: str | None = option(None, "model name clients use (default: from --model)")
    request_timeout: float = option(600.0, "seconds a request may take before it is aborted with a 504")
    api_key: str | None = option(None, f"require 'Authorization: Bearer KEY' on /v1 routes (default ${API_KEY_ENV})",
                                 forward=False)
    max_queued_requests: int = option(1024, "requests that may wait for their first token; beyond, 429 with "
                                            "Retry-After")
    shutdown_timeout: float = option(20.0, "seconds in-flight requests get to finish after SIGTERM")
    max_request_bytes: int = option(DEFAULT_MAX_REQUEST_BYTES, "largest request body accepted (413 beyond)")
    client_timeout: float = option(DEFAULT_CLIENT_TIMEOUT_S, "seconds a client may take to send its headers or its "
                                                             "body, or leave a streamed answer unread, before its "
                                                             "connection is closed (and its request aborted)")
    metrics_public: bool = option(False, "serve /health and /metrics without the API key (default: they need it "
                                         "too)")
    allowed_hosts: str | None = option(None, "comma-separated Host names served (any port), '*' for all; others get "
                                             "a 403, against DNS rebinding (default: bound to a loopback address, "
                                             "localhost and loopback addresses and the --host given; bound to any "
                                             "other address, every host)")
    routing: str = option("prefix", "with several engines: prefix-aware (with a load cap), least-loaded or "
                                    "round-robin", choices=POLICIES)
    reasoning_parser: str | None = option(None, "split a chat answer's thinking into reasoning_content: "
                                                "deepseek_r1 (<think>...</think>, the opening tag optional)",
                                          choices=REASONING_PARSERS)
    pooling: str | None = option(None, "how /v1/embeddings pools the last hidden states (default: the model's "
                                       "sentence-transformers pooling config, else mean)", choices=POOLING_KINDS)
    limits: RequestLimits = group(RequestLimits)

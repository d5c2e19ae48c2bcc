"""The gateway's exposure options, shared with the launcher that passes them through:
the API key, queue and body bounds, client timeouts, the Host names served (host_check)
and the bounds on each request's work (limits).

Kept apart from the gateway's service module so that the launcher (imported by every
`pagedserve` command) does not pull in aiohttp and uvloop.
"""

from __future__ import annotations

import argparse

from services.gateway.limits import add_limit_args, limits_argv

API_KEY_ENV = "PAGEDSERVE_API_KEY"
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
DEFAULT_MAX_QUEUED = 1024
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_CLIENT_TIMEOUT_S = 30.0


def add_exposure_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default ${API_KEY_ENV})")
    parser.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED,
                        help="requests that may wait for their first token; beyond, 429 with Retry-After")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest request body accepted (413 beyond)")
    parser.add_argument("--client-timeout", type=float, default=DEFAULT_CLIENT_TIMEOUT_S,
                        help="seconds a client may take to send its headers or its body, or leave a streamed "
                             "answer unread, before its connection is closed (and its request aborted)")
    parser.add_argument("--metrics-public", action="store_true",
                        help="serve /health and /metrics without the API key (default: they need it too)")
    parser.add_argument("--allowed-hosts", default=None,
                        help="comma-separated Host names served (any port), '*' for all; others get a 403, against "
                             "DNS rebinding (default: bound to a loopback address, localhost and loopback "
                             "addresses and the --host given; bound to any other address, every host)")
    add_limit_args(parser)


def exposure_argv(args: argparse.Namespace) -> list[str]:
    """The options for the gateway's command line; the API key travels in its environment."""
    return ["--max-queued-requests", str(args.max_queued_requests), "--shutdown-timeout", str(args.shutdown_timeout),
            "--max-request-bytes", str(args.max_request_bytes), "--client-timeout", str(args.client_timeout)] + (
                ["--metrics-public"] if args.metrics_public else []) + (
                ["--allowed-hosts", args.allowed_hosts] if getattr(args, "allowed_hosts", None) is not None else []) + limits_argv(args)

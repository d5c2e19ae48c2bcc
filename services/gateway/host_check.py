"""Serve only the Host names the server answers to, against DNS rebinding.

After DNS rebinding a web page of attacker.example is same-origin with a server on the
loopback address, and its requests carry `Host: attacker.example`. So, as Jupyter and
Ollama do, a gateway bound to a loopback address serves by default only `localhost`
(and `*.localhost`, which browsers never resolve through DNS), loopback addresses and the
`--host` it was given; bound to any other address (0.0.0.0 in a container, a LAN address)
it is meant to be reached under names it cannot know, so every host is served.
`--allowed-hosts a,b` names the hosts instead (`*`: all). Ports are ignored, and a loopback
address is always served (the container probes ask http://127.0.0.1/health), as is a
request with no Host name at all (no browser sends one; Ollama's rule too). Every path is checked,
/health and the dashboard too; any other host gets a 403 with an OpenAI-style error body.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from aiohttp import web

from services.gateway.openai.errors import ApiError

log = logging.getLogger(__name__)

LOCAL_NAMES = ("localhost",)
MAX_SHOWN = 100  # characters of a refused Host repeated in the error


def host_name(header: str) -> str:
    """The name or address of a Host header, lowercased, without port, brackets or trailing dot."""
    host = header.strip().lower()
    if host.startswith("["):  # [v6] or [v6]:port
        host = host[1:host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def is_loopback_address(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def binds_loopback(bound: str) -> bool:
    """Whether --host is a loopback address, or a name every address of which is one."""
    name = host_name(bound)
    if name in LOCAL_NAMES or is_loopback_address(name):
        return True
    try:
        ipaddress.ip_address(name)
        return False  # 0.0.0.0, ::, a LAN address
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    return bool(infos) and all(is_loopback_address(info[4][0]) for info in infos)


class HostCheck:
    def __init__(self, allowed_hosts: str | None, bound_host: str):
        if allowed_hosts is None:
            names = {*LOCAL_NAMES, host_name(bound_host)} if binds_loopback(bound_host) else None
        else:
            entries = {host_name(h) for h in allowed_hosts.split(",") if h.strip()}
            names = None if "*" in entries else entries
        self.names = names  # None: every host
        self.subdomains = tuple("." + n for n in (names or ()) if n in LOCAL_NAMES)

    def allows(self, header: str | None) -> bool:
        if self.names is None or not header:
            return True
        host = host_name(header)
        return host in self.names or host.endswith(self.subdomains) or is_loopback_address(host)

    def middleware(self):
        @web.middleware
        async def check_host(request: web.Request, handler):
            header = request.headers.get("Host")
            if self.allows(header):
                return await handler(request)
            err = ApiError(f"This server does not answer to the host {header[:MAX_SHOWN]!r}; start it with "
                           f"--allowed-hosts naming it.", 403, param="Host", code="host_not_allowed")
            return web.json_response(err.body(), status=err.status)

        return check_host

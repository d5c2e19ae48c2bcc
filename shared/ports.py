"""A free TCP port on the loopback interface, for the launcher, tests, benchmarks and loadgen.

The port is free when this returns; another process may take it before the caller binds it.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

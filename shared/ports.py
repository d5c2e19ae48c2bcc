"""Free TCP ports on the loopback interface, for the launcher, tests, benchmarks and loadgen.

A port is handed out before the service that binds it starts, so something else may take it in
between. Two things did, and both are kept out here:
- the kernel, which gives ports of its ephemeral range (`ip_local_port_range`) to every outgoing
  connection as its source port: ports come from below that range, where it never looks;
- another process of ours (a launcher, a pytest worker) picking the same port: each port handed
  out is recorded, under a file lock, in a ledger in the temp folder that every process on the
  host reads, and is not handed out again for `HOLD_S` seconds.
Where the ephemeral range leaves no room below or above it, the kernel picks the port (bind to 0),
as before: nothing keeps an outgoing connection off it there.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import random
import socket
import tempfile
import time
from pathlib import Path

HOLD_S = 600  # longer than any stage takes to start and bind its ports
LOWEST = 20000  # above most fixed service ports; one that something listens on fails `bindable` anyway
LEDGER = Path(tempfile.gettempdir()) / "pagedserve-ports.json"


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def candidate_range() -> tuple[int, int] | None:
    """The half-open range ports are drawn from: under the ephemeral range, or above it when too
    little room is left below; None when the ephemeral range leaves no room on either side."""
    low, high = ephemeral_range()
    if low - LOWEST >= 2000:
        return LOWEST, low
    if 65535 - high >= 2000:
        return high + 1, 65536
    return None


def _os_assigned() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _ledger():
    """The ports handed out in the last HOLD_S seconds (port -> time), locked while open."""
    with open(LEDGER, "a+") as f:  # closing it releases the lock
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:
            held = {int(p): t for p, t in json.loads(f.read() or "{}").items()}
        except (ValueError, AttributeError):
            held = {}
        now = time.time()
        held = {p: t for p, t in held.items() if now - t < HOLD_S}
        yield held
        f.seek(0)
        f.truncate()
        f.write(json.dumps(held))


def _draw(low: int, high: int, held: dict[int, float]) -> int:
    """A bindable port of [low, high) not in `held`, recorded there."""
    for _ in range(1000):
        port = random.randrange(low, high)
        if port not in held and bindable(port):
            held[port] = time.time()
            return port
    raise RuntimeError(f"no free TCP port in {low}-{high - 1}")


def free_port() -> int:
    span = candidate_range()
    if span is None:  # e.g. ip_local_port_range 1024-65535: only the kernel's own choice is left
        return _os_assigned()
    try:
        with _ledger() as held:
            return _draw(*span, held)
    except OSError:  # no writable temp folder: no ledger, the range still keeps the kernel out
        return _draw(*span, {})

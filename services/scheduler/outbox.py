"""Replies to gateways that are never dropped because a gateway is slow.

A ROUTER send to a gateway whose queue is full fails (EAGAIN). The message then
waits here, and so does everything later for that gateway, in order; `flush` retries
every loop turn. While a gateway has a backlog it is `held`: the scheduler runs none
of its requests, so they produce nothing more until it reads again (backpressure).
A gateway whose backlog has not moved for stall_timeout_s is `stalled`: the caller
fails its requests, loudly, so their blocks go to others. Messages to a gateway that
is gone (not connected) are dropped, and so is the backlog of one the caller found
lost (`drop`): its requests were aborted, nobody will read their replies.
"""

from __future__ import annotations

import time
from collections import deque

from shared.transport import BUSY, RouterSocket


class Outbox:
    def __init__(self, sock: RouterSocket, stall_timeout_s: float):
        self.sock = sock
        self.stall_timeout_s = stall_timeout_s
        self._backlog: dict[bytes, deque] = {}
        self._moved_at: dict[bytes, float] = {}  # when a backlogged peer last took a message

    @property
    def held(self) -> set[bytes]:
        """Peers with a backlog."""
        return set(self._backlog)

    def backlog(self, peer: bytes) -> int:
        return len(self._backlog.get(peer, ()))

    def send(self, peer: bytes, msg) -> None:
        queue = self._backlog.get(peer)
        if queue is not None:
            queue.append(msg)
        elif self.sock.try_send(peer, msg) == BUSY:
            self._backlog[peer] = deque([msg])
            self._moved_at[peer] = time.monotonic()

    def flush(self) -> None:
        """Send what the backlogged peers can take now."""
        for peer, queue in list(self._backlog.items()):
            while queue and self.sock.try_send(peer, queue[0]) != BUSY:
                queue.popleft()
                self._moved_at[peer] = time.monotonic()
            if not queue:
                del self._backlog[peer], self._moved_at[peer]

    def drop(self, peer: bytes) -> None:
        """Forget what waits for peer (it is lost)."""
        self._backlog.pop(peer, None)
        self._moved_at.pop(peer, None)

    def stalled(self) -> list[bytes]:
        """Peers whose backlog has not moved for stall_timeout_s (each reported once a
        timeout)."""
        now = time.monotonic()
        out = [peer for peer, at in self._moved_at.items() if now - at >= self.stall_timeout_s]
        for peer in out:
            self._moved_at[peer] = now
        return out

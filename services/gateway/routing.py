"""Which tokenizer replica gets each message the gateway sends it.

The gateway's tokenizer_in is a ROUTER and each replica a DEALER named after itself, so
the gateway chooses: requests go round robin over the replicas the watchdog counts as
live (heartbeating, ready, making progress), so a replica that hangs stops receiving work
as soon as it is found out, instead of collecting requests that hang with it. Replicas
hold nothing per request once they answered, so any live replica takes any request; only
the cancel of a grammar still compiling (AbortRequest) goes to the replica asked. A replica
whose queue is full or that is not connected yet is skipped; with none to take a message,
`send` waits and tries again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared.transport import SENT, AsyncRouterSocket

RETRY_S = 0.02  # how soon a message no replica could take is tried again


class TokenizerRouter:
    def __init__(self, sock: AsyncRouterSocket, replicas: Callable[[], list[str]]):
        self._sock = sock
        self._replicas = replicas  # the live replicas' names, e.g. from StageWatchdog.live_tokenizers
        self._next = 0

    def send_nowait(self, msg, to: str | None = None) -> str | None:
        """The replica that took msg (to: that one only), or None when none could."""
        if to is not None:
            return to if self._sock.try_send(to.encode(), msg) == SENT else None
        live = list(self._replicas())
        if not live:
            return None
        self._next = (self._next + 1) % len(live)
        for name in live[self._next:] + live[:self._next]:
            if self._sock.try_send(name.encode(), msg) == SENT:
                return name
        return None

    async def send(self, msg) -> str:
        """Like send_nowait, but waits for a replica to take it (bound it with wait_for)."""
        while True:
            name = self.send_nowait(msg)
            if name is not None:
                return name
            await asyncio.sleep(RETRY_S)

    def close(self) -> None:
        self._sock.close()

"""Which tokenizer replica gets each message the gateway sends down the pipeline.

The gateway's tokenizer_in is a ROUTER and each replica a DEALER named after itself, so
the gateway chooses: new requests go round robin over the replicas the watchdog
counts as live (heartbeating, ready, making progress), so a replica that hangs stops
receiving work as soon as it is found out, instead of collecting requests that hang
with it. An abort goes to the replica that owns its request while that one is live (it
holds the request's text state and forwards the abort to the scheduler), else through
any live replica (the scheduler frees the blocks whichever replica an abort comes by).
A replica whose queue is full or that is not connected yet is skipped; with none to
take a message, `send` waits and tries again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shared.transport import SENT, AsyncRouterSocket

log = logging.getLogger(__name__)

RETRY_S = 0.02  # how soon a message no replica could take is tried again


class TokenizerRouter:
    def __init__(self, sock: AsyncRouterSocket, replicas: Callable[[], list[str]]):
        self._sock = sock
        self._replicas = replicas  # the live replicas' names, e.g. from StageWatchdog.live_tokenizers
        self._next = 0

    def _candidates(self, prefer: str | None) -> list[str]:
        live = list(self._replicas())
        if not live:
            return []
        if prefer is None:  # only new requests take turns
            self._next = (self._next + 1) % len(live)
        start = self._next % len(live)
        order = live[start:] + live[:start]
        if prefer in order:
            order.remove(prefer)
            order.insert(0, prefer)
        return order

    def send_nowait(self, msg, prefer: str | None = None) -> str | None:
        """The replica that took msg (prefer first, if live), or None when none could."""
        for name in self._candidates(prefer):
            if self._sock.try_send(name.encode(), msg) == SENT:
                return name
        return None

    def broadcast(self, msg) -> int:
        """msg to every live replica that can take it now; how many took it."""
        return sum(self._sock.try_send(name.encode(), msg) == SENT for name in self._replicas())

    async def send(self, msg, prefer: str | None = None) -> str:
        """Like send_nowait, but waits for a replica to take it (bound it with wait_for)."""
        while True:
            name = self.send_nowait(msg, prefer)
            if name is not None:
                return name
            await asyncio.sleep(RETRY_S)

    def close(self) -> None:
        self._sock.close()

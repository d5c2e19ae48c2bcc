"""Which gateways are alive, as the scheduler sees them.

Every gateway connects a DEALER to the scheduler (identity "gateway-<instance>") and
sends a GatewayBeat on it every 0.5 s besides its requests, aborts and stops. The
scheduler records, per peer identity, when anything last came from it (`heard`); a peer
is known from its first message, beat or not. A peer silent for longer than
GATEWAY_LOST_AFTER_S is lost (`expired`, checked every CHECK_EVERY_S, not every step):
the scheduler aborts the requests it owns, since nobody reads them any more and
without this they would generate to their end. A restarted gateway is a new instance,
so a new identity: the old one just goes silent. Bounded: one entry per peer heard
from, dropped once it is lost (heard from again, it is timed anew).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

GATEWAY_LOST_AFTER_S = 5.0  # a gateway beats every 0.5 s; this is generous for a busy loop
CHECK_EVERY_S = 0.25


class GatewayWatch:
    def __init__(self, lost_after_s: float = GATEWAY_LOST_AFTER_S, check_every_s: float = CHECK_EVERY_S,
                 clock=time.monotonic):
        self.lost_after_s = lost_after_s
        self.check_every_s = check_every_s
        self._clock = clock
        self._seen: dict[bytes, float] = {}  # peer identity -> when last heard from
        self._next_check = 0.0

    def __contains__(self, peer: bytes) -> bool:
        return peer in self._seen

    def heard(self, peers: Iterable[bytes]) -> None:
        """Messages just came from these peers (one clock read for the lot)."""
        now = self._clock()
        for peer in peers:
            self._seen[peer] = now

    def due(self) -> bool:
        """Whether it is time to look for lost peers (at most every check_every_s)."""
        now = self._clock()
        if now < self._next_check:
            return False
        self._next_check = now + self.check_every_s
        return True

    def expired(self) -> list[bytes]:
        """The peers silent for longer than lost_after_s, each once (forgotten from now on)."""
        now = self._clock()
        gone = [peer for peer, seen in self._seen.items() if now - seen > self.lost_after_s]
        for peer in gone:
            del self._seen[peer]
        return gone

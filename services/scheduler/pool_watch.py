"""When the scheduler sends its next pool snapshot: a dashboard's subscription.

A `WatchPool` message opens or renews the subscription for its ttl_s; while it holds,
`due()` says yes once every interval_s. Nobody renewing means nothing is sent after
the ttl. Values out of range (or not finite) are clamped, never refused: a bad
subscription costs at most one snapshot every MIN_INTERVAL_S for MAX_TTL_S.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from shared.messages import WatchPool

MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 5.0
MAX_TTL_S = 30.0


def _clamp(value: float, low: float, high: float, default: float) -> float:
    return min(max(value, low), high) if math.isfinite(value) else default


class PoolWatch:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.until = -math.inf
        self.interval_s = WatchPool().interval_s
        self._sent_at = -math.inf

    def renew(self, msg: WatchPool) -> None:
        self.interval_s = _clamp(msg.interval_s, MIN_INTERVAL_S, MAX_INTERVAL_S, WatchPool().interval_s)
        self.until = self._clock() + _clamp(msg.ttl_s, 0.0, MAX_TTL_S, 0.0)

    @property
    def active(self) -> bool:
        return self._clock() < self.until

    def due(self) -> bool:
        """True (and counted as sent) when a snapshot should go out now."""
        now = self._clock()
        if now >= self.until or now - self._sent_at < self.interval_s:
            return False
        self._sent_at = now
        return True

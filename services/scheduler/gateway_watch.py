"""Which gateway processes are alive, as a tokenizer replica sees them.

The gateway names itself (its INSTANCE_ID) in every GenerateRequest and in a GatewayBeat
it sends each replica every 0.5 s. A gateway instance is gone when a new one shows up
(one gateway binds the pipeline's addresses at a time: a new instance is a restart) or
when nothing came from it for GATEWAY_LOST_AFTER_S. The replica then aborts that
instance's requests: nobody reads them any more, and without this they would generate
to their end. Requests naming no instance (an older gateway) are never aborted here.
Bounded: one entry per gateway instance heard from, dropped once it is gone.
"""

from __future__ import annotations

import time

GATEWAY_LOST_AFTER_S = 5.0  # a gateway beats every 0.5 s; this is generous for a busy loop


class GatewayWatch:
    def __init__(self, lost_after_s: float = GATEWAY_LOST_AFTER_S, clock=time.monotonic):
        self.lost_after_s = lost_after_s
        self._clock = clock
        self._seen: dict[str, float] = {}  # instance -> when last heard from

    def heard(self, instance: str) -> set[str]:
        """A message from instance; the instances it replaces (gone now)."""
        if not instance:
            return set()
        gone = set(self._seen) - {instance} if instance not in self._seen else set()
        for old in gone:
            del self._seen[old]
        self._seen[instance] = self._clock()
        return gone

    def expired(self) -> set[str]:
        """The instances silent for longer than lost_after_s (forgotten from now on)."""
        now = self._clock()
        gone = {i for i, seen in self._seen.items() if now - seen > self.lost_after_s}
        for old in gone:
            del self._seen[old]
        return gone

"""The gateway's store of finished Responses: what `GET /v1/responses/{id}` returns and what
`previous_response_id` continues from.

In memory, in this gateway process only (a restarted gateway, or another replica behind a load
balancer, does not know the id: 404). Bounded three ways so no client can grow it without end:
at most `max_entries` responses and `max_bytes` of their JSON together (the oldest go first),
and each expires `ttl_s` after it was stored. A response larger than `max_bytes` alone is not
kept (a later retrieve is a 404, like an expired one).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
DEFAULT_TTL_S = 3600.0

_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as GET returns it
    messages: list[dict]  # the conversation so far as chat messages: its input, then its output
    size: int  # bytes of both as JSON
    expires: float


class ResponseStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 ttl_s: float = DEFAULT_TTL_S, clock=time.monotonic):
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, body: dict, messages: list[dict]) -> bool:
        """Keep a finished response; False when it alone is larger than the store."""
        size = len(_json.encode(body)) + len(_json.encode(messages))
        self.delete(response_id)
        if size > self.max_bytes:
            return False
        self._expire()
        while self._entries and (len(self._entries) >= self.max_entries or self.num_bytes + size > self.max_bytes):
            self._pop_oldest()
        self._entries[response_id] = StoredResponse(body, messages, size, self.clock() + self.ttl_s)
        self.num_bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None and entry.expires <= self.clock():
            self.delete(response_id)
            return None
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.size
        return entry is not None

    def check_invariants(self) -> None:
        assert len(self._entries) <= self.max_entries
        assert self.num_bytes == sum(e.size for e in self._entries.values()) <= self.max_bytes
        expiries = [e.expires for e in self._entries.values()]
        assert expiries == sorted(expiries)  # stored in order, so the oldest expire first

    def _expire(self) -> None:
        now = self.clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.size

"""Data parallelism: which engine (scheduler + executor) each new request goes to, and when.

The gateway routes: it receives each request's prompt tokens from a tokenizer replica and
passes the request on to the engine chosen here. Policies:

- `prefix` (default), after SGLang's cache-aware router and llm-d's prefix scorer: the
  router keeps an approximate map from the chained digest of each full prompt block (the
  block manager's own key, `shared/block_digest.py`: SHA-256 over the parent's digest and the
  block's tokens, seeded by the request's cache salt) to the engines it sent
  that block to (a bounded LRU). The deepest block of the prompt that some live engine
  holds picks the engine: the least loaded of its holders, unless even that one is much
  busier than the least loaded engine (more than LOAD_RATIO times its load plus
  LOAD_SLACK). Only then does the request spill to the least loaded engine, which becomes
  a further holder, so a hot prefix spreads over a few engines instead of piling onto one,
  and each engine that holds it keeps being preferred. A prompt with no block held
  anywhere goes to the least loaded engine, ties to the one holding the fewest blocks (so
  distinct system prompts split evenly), then in turn.
- `least-loaded`: the engine with the lowest load.
- `round-robin`: each live engine in turn.

Warming (prefix policy): a block sent to an engine that did not hold it is "warming" there
until the request that carries it has been prefilled (its first output comes back,
`prefilled`). A request whose deepest matching block on its chosen engine is still warming
is held (`held`) rather than sent: sent now it would be prefilled in the same step as the
first and miss the cache (SGLang's scheduler defers such in-batch duplicates the same way).
It is let go (`ready`) once the warming request is prefilled or released (the first request
held behind a released one warms its blocks in its place), once that
engine leaves the live set, or after HOLD_MAX_S at most. So a spill costs one cold prefill
of the prefix on the new engine, not one per request spilled with it.

Load is running + waiting requests plus KV_WEIGHT times the fraction of KV blocks in
use. The gateway knows its own requests in flight exactly, held ones included, at every
moment (so a burst does not all land on the engine that looked idle a moment ago); each
live engine's figures (EngineLoads, from the schedulers' heartbeats) come a few times a
second, and what they count beyond this gateway's requests (another gateway's work) is
added as it was at the latest report (less this gateway's requests that ended in the last
REPORT_LAG_S, which a report may still count). One prefix map serves every tokenizer replica.

Only engines in the latest report are live (one that dies or hangs is left out by the
gateway); before any report every configured engine is. A request's later messages go to
the engine that owns it (`owner`), until `release`.

Restarts: the map is forgotten for an engine (`forget`) whose scheduler instance in the
report differs from the one before (a restarted scheduler, or a scheduler that reset its
cache when its executor restarted, has an empty prefix cache) and for an engine that left
the live set (it may come back restarted, or with its cache reset; if it was only frozen,
forgetting costs one cold prefill per prefix). The requests that engine warmed stop
warming: they stay owned by it (the gateway sends them again, aborting these), what they
would have prefilled is not counted as held anywhere, and the requests held behind them
are let go at once (to that engine: the gateway's resend covers them too).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable

import msgspec

from shared.block_digest import block_digests

log = logging.getLogger(__name__)

POLICIES = ("prefix", "least-loaded", "round-robin")
MAX_PREFIXES = 65536  # block digests remembered (LRU)
LOAD_RATIO = 1.5
LOAD_SLACK = 8.0  # requests: below this imbalance a spill's cold prefill costs more than it saves
KV_WEIGHT = 4.0  # a full KV pool weighs as much as this many requests
HOLD_MAX_S = 10.0  # the longest a request waits for the prefill of a prefix it shares
REPORT_LAG_S = 0.5  # how old an engine's load report may be (two heartbeats)


class EngineLoad(msgspec.Struct):
    """One engine that takes new requests, and its load from its scheduler's heartbeat."""

    engine: str
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of its KV blocks in use
    block_size: int = 16
    instance: str = ""  # its scheduler's instance: a new one (a restart) starts with an empty prefix cache


class EngineLoads(msgspec.Struct):
    """The engines new requests may go to (live ones only), from the gateway's watchdog."""

    engines: list[EngineLoad]


def prefix_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                  lora_digest: str | None = None) -> list[bytes]:
    """Chained digests of the full blocks of token_ids, as the block manager computes them."""
    return block_digests(token_ids, block_size, cache_salt, lora_digest)


class EngineRouter:
    def __init__(self, engines: list[str], policy: str = "prefix", block_size: int = 16,
                 max_prefixes: int = MAX_PREFIXES, clock: Callable[[], float] = time.monotonic):
        if not engines:
            raise ValueError("at least one engine")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.engines = list(engines)  # configured, in order
        self.policy = policy
        self.block_size = block_size
        self.max_prefixes = max_prefixes
        self.clock = clock
        self.live: list[str] = list(engines)
        self._others: dict[str, float] = {}  # engine -> its requests not from this gateway, at the latest report
        self._kv_usage: dict[str, float] = {}
        self._in_flight: Counter[str] = Counter()  # this gateway's requests, by engine
        self._released: dict[str, deque[float]] = {}  # engine -> when this gateway's requests there ended lately
        self._owner: dict[str, str] = {}  # request id -> engine
        # block hash -> {engine holding it: the request warming it there, or None once prefilled}
        self._prefixes: OrderedDict[bytes, dict[str, str | None]] = OrderedDict()
        self._blocks: Counter[str] = Counter()  # engine -> blocks of the map it holds
        self._warming: dict[str, list[bytes]] = {}  # request id -> the blocks it warms on its engine
        self._held: dict[str, tuple[str, float]] = {}  # request id -> (the warming request it waits for, since)
        self._instances: dict[str, str] = {}  # engine -> its scheduler instance at the latest report naming one
        self._next = 0
        self.prefix_routed = 0  # requests the prefix map placed (for logs and tests)
        self.spilled = 0  # requests the load cap sent away from every engine holding their prefix
        self.held_total = 0
        self.forgotten = 0  # times an engine's part of the map was dropped (restarted or not live)

    def update(self, loads: EngineLoads) -> None:
        known = set(self.engines)
        live = [e for e in loads.engines if e.engine in known]
        self.live = [e.engine for e in live]
        for e in live:
            old = self._instances.get(e.engine)
            if e.instance and old and e.instance != old:
                self.forget(e.engine, "restarted")
            if e.instance:  # "" (an older gateway, or no heartbeat yet): nothing to compare
                self._instances[e.engine] = e.instance
        for engine in known - set(self.live):
            self.forget(engine, "not serving")
        # A report is up to a heartbeat old: it may still count requests this gateway has
        # released since, which are not another gateway's load.
        now = self.clock()
        for released in self._released.values():
            while released and now - released[0] > REPORT_LAG_S:
                released.popleft()
        self._others = {e.engine: max(0.0, e.num_running + e.num_waiting - self._in_flight[e.engine]
                                      - len(self._released.get(e.engine, ()))) for e in live}
        self._kv_usage = {e.engine: e.kv_usage for e in live}
        if live:
            self.block_size = live[0].block_size

    def forget(self, engine: str, why: str = "") -> None:
        """Drop every block the map has on engine, and stop its requests warming any."""
        warmers = [rid for rid in self._warming if self._owner.get(rid) == engine]
        for rid in warmers:
            del self._warming[rid]  # ready() lets the requests held behind them go
        if not self._blocks[engine]:
            self._blocks.pop(engine, None)
            return
        dropped = self._blocks.pop(engine)
        for h in [h for h, holders in self._prefixes.items() if engine in holders]:
            holders = self._prefixes[h]
            del holders[engine]
            if not holders:
                del self._prefixes[h]
        self.forgotten += 1
        log.info("engine %s %s: forgetting the %d prefix blocks routed to it", engine, why, dropped)

    def load(self, engine: str) -> float:
        requests = self._in_flight[engine] + self._others.get(engine, 0.0)
        return requests + KV_WEIGHT * self._kv_usage.get(engine, 0.0)

    def route(self, request_id: str, token_ids: list[int], cache_salt: str | None = None,
              lora_digest: str | None = None) -> str:
        """The engine for a new request; it owns the request until `release`. When `held`
        says so afterwards, the request is not to be sent before `ready` lets it go."""
        candidates = self.live or self.engines  # none live: still queue somewhere
        hashes = prefix_hashes(token_ids, self.block_size, cache_salt, lora_digest) if self.policy == "prefix" else []
        if self.policy == "round-robin":
            engine = candidates[self._next % len(candidates)]
            self._next += 1
        else:
            least = self._least_loaded(candidates)
            engine = self._by_prefix(hashes, candidates, least)
        self._owner[request_id] = engine
        self._in_flight[engine] += 1
        if hashes:
            self._place(request_id, engine, hashes)
        return engine

    def _least_loaded(self, candidates: list[str]) -> str:
        # ties go to the engine holding fewer blocks, then rotate, so idle engines take turns
        start = self._next % len(candidates)
        self._next += 1
        order = candidates[start:] + candidates[:start]
        return min(order, key=lambda e: (self.load(e), self._blocks[e]))

    def _by_prefix(self, hashes: list[bytes], candidates: list[str], least: str) -> str:
        for h in reversed(hashes):  # the deepest block some live engine holds
            holders = [e for e in candidates if e in self._prefixes.get(h, ())]
            if not holders:
                continue
            best = min(holders, key=self.load)
            if self.load(best) <= LOAD_RATIO * self.load(least) + LOAD_SLACK:
                self.prefix_routed += 1
                return best
            self.spilled += 1
            log.info("request spills from %s (load %.1f) to %s (load %.1f)", best, self.load(best), least,
                     self.load(least))
            return least
        return least

    def _place(self, request_id: str, engine: str, hashes: list[bytes]) -> None:
        """Note the blocks as held by engine; hold the request if the deepest of them that the
        engine held already is still warming there (the blocks after it it warms itself)."""
        waits_for = None
        warming: list[int] = []
        for h in hashes:
            holders = self._prefixes.get(h)
            if holders is None:
                holders = self._prefixes[h] = {}
            if engine not in holders:
                holders[engine] = request_id
                self._blocks[engine] += 1
                warming.append(h)
            elif not warming:
                waits_for = holders[engine]  # None once prefilled
            self._prefixes.move_to_end(h)
        if warming:
            self._warming[request_id] = warming
        if waits_for is not None:
            self._held[request_id] = (waits_for, self.clock())
            self.held_total += 1
        while len(self._prefixes) > self.max_prefixes:
            _, holders = self._prefixes.popitem(last=False)
            for e in holders:
                self._blocks[e] -= 1
                if not self._blocks[e]:
                    del self._blocks[e]

    def held(self, request_id: str) -> bool:
        return request_id in self._held

    def prefilled(self, request_id: str) -> None:
        """The request's first output came back: the blocks it warmed are cached on its engine."""
        engine = self._owner.get(request_id)
        for h in self._warming.pop(request_id, []):
            holders = self._prefixes.get(h)
            if holders is not None and engine is not None and holders.get(engine) == request_id:
                holders[engine] = None

    def ready(self) -> list[str]:
        """Held requests that may be sent now, in the order they were routed."""
        now = self.clock()
        live = set(self.live)
        out = [rid for rid, (first, since) in self._held.items()
               if first not in self._warming or self._owner.get(rid) not in live or now - since >= HOLD_MAX_S]
        for rid in out:
            del self._held[rid]
        return out

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def release(self, request_id: str) -> None:
        engine = self._owner.pop(request_id, None)
        self._held.pop(request_id, None)
        # Released before its first output (aborted, failed): what it warmed may never have been
        # cached. The first request held behind it warms it instead (it is sent now, the others
        # wait for it); with none, the engine no longer counts as holding those blocks.
        followers = [rid for rid, (first, _since) in self._held.items() if first == request_id]  # ready() lets the heir go
        heir = followers[0] if followers else None
        for rid in followers[1:]:
            self._held[rid] = (heir, self._held[rid][1])
        for h in self._warming.pop(request_id, []):
            holders = self._prefixes.get(h)
            if holders is None or engine is None or holders.get(engine) != request_id:
                continue
            if heir is not None:
                holders[engine] = heir
                self._warming.setdefault(heir, []).append(h)
            else:
                del holders[engine]
                self._blocks[engine] -= 1
                if not self._blocks[engine]:
                    del self._blocks[engine]
        if engine is not None:
            self._in_flight[engine] -= 1
            if not self._in_flight[engine]:
                del self._in_flight[engine]
            self._released.setdefault(engine, deque()).append(self.clock())

    def owned(self) -> list[str]:
        return list(self._owner)

    def check_invariants(self) -> None:
        assert set(self.live) <= set(self.engines), (self.live, self.engines)
        counts = Counter(self._owner.values())
        assert counts == +self._in_flight, (counts, self._in_flight)
        assert all(n > 0 for n in self._in_flight.values())
        assert len(self._prefixes) <= self.max_prefixes
        held = Counter(e for holders in self._prefixes.values() for e in holders)
        assert held == +self._blocks, (held, self._blocks)
        assert set(held) <= set(self.engines)
        # a block warming on an engine is warmed by a request that engine owns and that is not yet prefilled
        for h, holders in self._prefixes.items():
            for e, rid in holders.items():
                if rid is not None:
                    assert self._owner.get(rid) == e and h in self._warming.get(rid, ()), (h, e, rid)
        assert set(self._warming) <= set(self._owner)
        if self.live:  # what an engine that left the live set held or warmed is forgotten
            assert set(held) <= set(self.live), (held, self.live)
            assert all(self._owner[rid] in self.live for rid in self._warming), self._warming
        for rid, (first, _since) in self._held.items():
            assert rid in self._owner and first != rid, rid

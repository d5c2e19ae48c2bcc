"""Data parallelism: which engine (scheduler + executor) each new request goes to.

A tokenizer replica is where a prompt's tokens are first known, so it routes. Policies:

- `prefix` (default): the engine most likely to hold the request's leading full blocks in
  its prefix cache. The router keeps an approximate map from the chained hash of each
  full prompt block (the block manager's own scheme: hash of (parent hash, block tokens))
  to the engine it last sent that prefix to, a bounded LRU. The deepest block found picks
  the engine, unless that engine is much busier than the least loaded one (more than
  LOAD_RATIO times its load plus LOAD_SLACK): then, as for a prefix never seen, the least
  loaded engine takes it, so a hot prefix spreads instead of piling onto one engine.
- `least-loaded`: the engine with the lowest load.
- `round-robin`: each live engine in turn.

Load is running + waiting requests plus KV_WEIGHT times the fraction of KV blocks in
use. This replica knows its own requests in flight exactly, at every moment (so a burst
does not all land on the engine that looked idle a moment ago); the gateway reports each
live engine's figures (EngineLoads, from the schedulers' heartbeats) a few times a
second, and what they count beyond this replica's requests (other replicas' work) is
added as it was at the latest report.

Only engines in the latest report are live (one that dies or hangs is left out by the
gateway); before any report every configured engine is. A request's later messages go to
the engine that owns it (`owner`), until `release`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from shared.messages import EngineLoads

POLICIES = ("prefix", "least-loaded", "round-robin")
MAX_PREFIXES = 65536  # block hashes remembered (LRU)
LOAD_RATIO = 1.5
LOAD_SLACK = 4.0
KV_WEIGHT = 4.0  # a full KV pool weighs as much as this many requests


def prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of token_ids, as the block manager computes them."""
    hashes: list[int] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(hash((hashes[-1] if hashes else None, tuple(token_ids[i * block_size:(i + 1) * block_size]))))
    return hashes


class EngineRouter:
    def __init__(self, engines: list[str], policy: str = "prefix", block_size: int = 16,
                 max_prefixes: int = MAX_PREFIXES):
        if not engines:
            raise ValueError("at least one engine")
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.engines = list(engines)  # configured, in order
        self.policy = policy
        self.block_size = block_size
        self.max_prefixes = max_prefixes
        self.live: list[str] = list(engines)
        self._others: dict[str, float] = {}  # engine -> its requests not from this replica, at the latest report
        self._kv_usage: dict[str, float] = {}
        self._in_flight: Counter[str] = Counter()  # this replica's requests, by engine
        self._owner: dict[str, str] = {}  # request id -> engine
        self._prefixes: OrderedDict[int, str] = OrderedDict()  # block hash -> engine
        self._next = 0
        self.prefix_routed = 0  # requests the prefix map placed (for logs and tests)

    def update(self, loads: EngineLoads) -> None:
        known = set(self.engines)
        live = [e for e in loads.engines if e.engine in known]
        self.live = [e.engine for e in live]
        self._others = {e.engine: max(0.0, e.num_running + e.num_waiting - self._in_flight[e.engine]) for e in live}
        self._kv_usage = {e.engine: e.kv_usage for e in live}
        if live:
            self.block_size = live[0].block_size

    def load(self, engine: str) -> float:
        requests = self._in_flight[engine] + self._others.get(engine, 0.0)
        return requests + KV_WEIGHT * self._kv_usage.get(engine, 0.0)

    def route(self, request_id: str, token_ids: list[int]) -> str:
        """The engine for a new request; it owns the request until `release`."""
        candidates = self.live or self.engines  # none live: still queue somewhere
        hashes = prefix_hashes(token_ids, self.block_size) if self.policy == "prefix" else []
        engine = None
        if self.policy == "round-robin":
            engine = candidates[self._next % len(candidates)]
            self._next += 1
        else:
            least = self._least_loaded(candidates)
            engine = self._by_prefix(hashes, candidates, self.load(least))
            if engine is None:
                engine = least
            else:
                self.prefix_routed += 1
        for h in hashes:
            self._prefixes[h] = engine
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > self.max_prefixes:
            self._prefixes.popitem(last=False)
        self._owner[request_id] = engine
        self._in_flight[engine] += 1
        return engine

    def _least_loaded(self, candidates: list[str]) -> str:
        # ties rotate, so idle engines take turns instead of the first taking everything
        start = self._next % len(candidates)
        self._next += 1
        order = candidates[start:] + candidates[:start]
        return min(order, key=self.load)

    def _by_prefix(self, hashes: list[int], candidates: list[str], least_load: float) -> str | None:
        for h in reversed(hashes):  # the deepest block this router placed
            engine = self._prefixes.get(h)
            if engine is None or engine not in candidates:
                continue
            if self.load(engine) <= LOAD_RATIO * least_load + LOAD_SLACK:
                return engine
            return None  # too busy: the least loaded engine takes it
        return None

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def release(self, request_id: str) -> None:
        engine = self._owner.pop(request_id, None)
        if engine is not None:
            self._in_flight[engine] -= 1
            if not self._in_flight[engine]:
                del self._in_flight[engine]

    def owned(self) -> list[str]:
        return list(self._owner)

    def check_invariants(self) -> None:
        assert set(self.live) <= set(self.engines), (self.live, self.engines)
        counts = Counter(self._owner.values())
        assert counts == +self._in_flight, (counts, self._in_flight)
        assert all(n > 0 for n in self._in_flight.values())
        assert len(self._prefixes) <= self.max_prefixes
        assert set(self._prefixes.values()) <= set(self.engines)

"""Data parallelism in the gateway: what its engine router and /health learn of the engines.

The watchdog tracks each engine (its scheduler and executor, by the engine named in their
heartbeats). Several times a second, at once when the set of serving engines changes (so
no request is routed by a stale set after /health shows the change), and at once before an
engine's requests resume elsewhere, the gateway's EngineRouter gets EngineLoads: the
engines serving now with their running and waiting requests and KV usage (from their
schedulers' heartbeats) and their schedulers' instance ids (a new one has an empty prefix
cache). With a single engine there is nothing to choose.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from services.gateway.engine_router import EngineLoad, EngineLoads
from services.gateway.watchdog import EngineState, StageWatchdog

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.25


def engine_loads(watchdog: StageWatchdog) -> EngineLoads:
    return EngineLoads([_load(name, e) for name, e in watchdog.serving_engines().items()])


def _load(name: str, e: EngineState) -> EngineLoad:
    st = e.stats
    instance = e.scheduler or ""
    if st is None:
        return EngineLoad(name, instance=instance)
    usage = st.kv_blocks_used / st.kv_blocks_total if st.kv_blocks_total else 0.0
    return EngineLoad(name, st.num_running, st.num_waiting, usage, st.block_size, instance)


class EnginePublisher:
    def __init__(self, watchdog: StageWatchdog | None, broadcast: Callable[[EngineLoads], object]):
        self.watchdog = watchdog  # set once made: the watchdog's callbacks come from here
        self._broadcast = broadcast
        self._serving: list[str] = []  # the engines serving at the latest publish

    def publish(self) -> None:
        if self.watchdog is not None and len(self.watchdog.engines) > 1:
            loads = engine_loads(self.watchdog)
            self._serving = [e.engine for e in loads.engines]
            self._broadcast(loads)

    def publish_if_changed(self) -> None:
        """Publish now if an engine started or stopped serving since the latest publish."""
        if self.watchdog is not None and list(self.watchdog.serving_engines()) != self._serving:
            self.publish()

    def then(self, action: Callable[[str], int]) -> Callable[[str], int]:
        """action (resuming an engine's requests), after the router learns which engines serve."""
        def run(engine: str) -> int:
            self.publish()
            return action(engine)
        return run

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            try:
                self.publish()
            except Exception:
                log.exception("publishing engine loads failed")


def engines_report(watchdog: StageWatchdog, routed: Callable[[str], int]) -> dict[str, dict]:
    """/health's "engines": every engine seen, whether it takes requests, and its load."""
    out = {}
    for name, e in sorted(watchdog.engines.items()):
        st = e.stats
        out[name] = {
            "serving": e.serving,
            "scheduler": "down" if e.scheduler_down else ("ready" if e.scheduler_ready else "starting"),
            "executor": "down" if not e.executor_up else ("ready" if e.executor_ready else "starting"),
            "num_running": st.num_running if st else 0,
            "num_waiting": st.num_waiting if st else 0,
            "kv_usage": round(st.kv_blocks_used / st.kv_blocks_total, 4) if st and st.kv_blocks_total else 0.0,
            "requests_routed": routed(name),
        }
    return out

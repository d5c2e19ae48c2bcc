"""What the worker knows of its engine, from the heartbeats its scheduler and executor
push to the status address this stage binds (as the gateway does in `pagedserve serve`):
whether both are up and ready, the scheduler's latest SchedulerStats (the pool's size and
use, the prefix cache's counters: the load the worker reports to Dynamo), and when the
scheduler restarted (a new instance lost the requests it had).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq.asyncio

from shared.messages import Heartbeat, SchedulerStats, StatusToGateway
from shared.transport import AsyncPullSocket

log = logging.getLogger("pagedserve.dynamo_worker")

STALE_AFTER_S = 3.0  # heartbeats come every 0.25 s


class EngineStatus:
    def __init__(self, ctx: zmq.asyncio.Context, status_address: str,
                 on_scheduler_restart: Callable[[], None] = lambda: None):
        self._sock = AsyncPullSocket(ctx, status_address, StatusToGateway, bind=True)
        self.on_scheduler_restart = on_scheduler_restart
        self.stats: SchedulerStats | None = None
        self._beats: dict[str, tuple[Heartbeat, float]] = {}  # by stage: the latest, and when it came
        self._ready = asyncio.Event()
        self.updates = 0  # heartbeats with stats taken

    def _fresh(self, stage: str) -> Heartbeat | None:
        entry = self._beats.get(stage)
        if entry is None or time.monotonic() - entry[1] > STALE_AFTER_S:
            return None
        return entry[0]

    @property
    def ready(self) -> bool:
        scheduler, executor = self._fresh("scheduler"), self._fresh("executor")
        return (scheduler is not None and scheduler.state == "ready" and scheduler.scheduler is not None
                and executor is not None and executor.state == "ready")

    async def wait_ready(self, timeout_s: float) -> SchedulerStats:
        """The scheduler's stats once the engine serves; TimeoutError past timeout_s."""
        async with asyncio.timeout(timeout_s):
            while not self.ready:
                self._ready.clear()
                await self._ready.wait()
        return self.stats

    async def run(self) -> None:
        while True:
            msg = await self._sock.recv()
            if isinstance(msg, Heartbeat):
                self._on_beat(msg)

    def _on_beat(self, beat: Heartbeat) -> None:
        previous = self._beats.get(beat.stage)
        self._beats[beat.stage] = (beat, time.monotonic())
        if beat.stage == "scheduler":
            if previous is not None and previous[0].instance != beat.instance:
                log.warning("the scheduler restarted (instance %s, was %s): its requests are lost",
                            beat.instance, previous[0].instance)
                self.on_scheduler_restart()
            if beat.scheduler is not None:
                self.stats = beat.scheduler
                self.updates += 1
        self._ready.set()

    def close(self) -> None:
        self._sock.close()

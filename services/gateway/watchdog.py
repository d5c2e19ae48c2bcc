"""Turns the stages' heartbeats into recovery: which tokenizer replica and which scheduler died.

A stage instance is lost when it sends no heartbeat for LOST_AFTER_S, or at once when a
new instance shows up under the same name (a restart faster than that); a tokenizer
replica also when it says it is stuck (its loop made no progress, though its heartbeat
thread still beats). New requests go only to `live_tokenizers`. The requests a lost
tokenizer replica had not answered yet are asked of the others (`on_tokenizer_lost`, with its
name). A scheduler that goes silent
makes new requests get a 503 while those in flight wait: when a new scheduler instance
beats (a restart), it knows none of them, so they all resume from what their clients
have (`on_scheduler_restarted`); if the old one beats again (it was frozen), they simply go
on; only one gone for SCHEDULER_GIVE_UP_S ends them with a 503 (`on_scheduler_lost`). The executor needs nothing here: the scheduler
recomputes what a restarted executor lost. Admission asks `missing_stage`: while no
tokenizer replica, no scheduler or no executor is alive, new requests get a 503 at once
instead of waiting for a stage that may not come back.

Data parallelism: every scheduler and executor beats with the name of its engine, and
each engine is watched on its own. A request runs on the engine the gateway routed it to. When several engines run, one whose scheduler or executor goes
silent, or whose executor stops answering steps, is routed around: its requests resume
at once (`on_engine_lost`), to the engines still serving (`serving_engines`); a
restarted scheduler resends its own engine's requests only. New requests are refused
only while no engine can take them.

A check that itself runs late (the event loop was stalled, so beats may sit unread in
the socket) declares nothing, so a busy gateway does not mistake itself for a dead stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.messages import Heartbeat, SchedulerStats

log = logging.getLogger(__name__)

LOST_AFTER_S = 3.0
SCHEDULER_GIVE_UP_S = 60.0  # requests wait this long for a scheduler to come back
CHECK_INTERVAL_S = 0.25


@dataclass
class EngineState:
    """What the heartbeats say of one engine's scheduler and executor."""

    scheduler: str | None = None  # instance
    scheduler_seen: float = 0.0
    scheduler_down: bool = False
    scheduler_ready: bool = False  # its last beat said "ready" (it has an executor)
    given_up: bool = False  # its requests were failed: nothing left to resend
    stats: SchedulerStats | None = None
    executor_seen: float | None = None
    executor_ready: bool = False
    executor_down: bool = False
    executor_lost: bool = False  # the scheduler says the executor stopped answering steps
    routed_around: bool = False  # its requests were sent elsewhere since it stopped serving

    @property
    def available(self) -> bool:
        return self.scheduler is not None and not self.scheduler_down

    @property
    def executor_up(self) -> bool:
        return self.executor_seen is not None and not self.executor_down and not self.executor_lost

    @property
    def serving(self) -> bool:
        """It can take new requests now."""
        return self.available and self.scheduler_ready and self.executor_up and self.executor_ready


class StageWatchdog:
    def __init__(
        self,
        on_tokenizer_lost: Callable[[str], int],
        on_scheduler_lost: Callable[[str], int],
        lost_after_s: float = LOST_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        on_scheduler_restarted: Callable[[str], int] = lambda engine: 0,
        scheduler_give_up_s: float = SCHEDULER_GIVE_UP_S,
        on_engine_lost: Callable[[str], int] = lambda engine: 0,
    ):
        self._on_tokenizer_lost = on_tokenizer_lost
        self._on_scheduler_lost = on_scheduler_lost
        self._on_scheduler_restarted = on_scheduler_restarted  # called with the engine's name
        self._on_engine_lost = on_engine_lost
        self.scheduler_give_up_s = scheduler_give_up_s
        self.lost_after_s = lost_after_s
        self._clock = clock
        self._tokenizers: dict[str, float] = {}  # instance -> last beat
        self._tokenizer_ready: dict[str, bool] = {}  # instance -> its last beat said ready
        self._tokenizer_names: dict[str, str] = {}  # replica name -> instance
        self.engines: dict[str, EngineState] = {}  # by engine name
        self._last_check: float | None = None

    @property
    def scheduler_available(self) -> bool:
        return any(e.available for e in self.engines.values())

    @property
    def missing_stage(self) -> str | None:
        """The first stage with no live instance, or None when every one is up."""
        if not self._tokenizers:
            return "tokenizer"
        if not self.scheduler_available:
            return "scheduler"
        if not any(e.available and e.executor_up for e in self.engines.values()):
            return "executor"
        return None

    def serving_engines(self) -> dict[str, EngineState]:
        """The engines that can take new requests, by name."""
        return {name: e for name, e in sorted(self.engines.items()) if e.serving}

    def live_tokenizers(self) -> list[str]:
        """The names of the tokenizer replicas that beat lately and are ready."""
        return [name for name, instance in self._tokenizer_names.items()
                if instance in self._tokenizers and self._tokenizer_ready.get(instance)]

    def record(self, beat: Heartbeat) -> None:
        now = self._clock()
        if beat.stage == "executor":
            e = self.engines.setdefault(beat.engine, EngineState())
            if e.executor_down:
                log.info("executor %s is back", beat.replica)
            e.executor_seen, e.executor_down, e.executor_ready = now, False, beat.state == "ready"
            self._serving_again(e)
        if beat.stage == "tokenizer":
            old = self._tokenizer_names.get(beat.replica)
            if old is not None and old != beat.instance:
                self._tokenizer_lost(old, "restarted")
            self._tokenizer_names[beat.replica] = beat.instance
            if beat.state.startswith("stuck"):
                if beat.instance in self._tokenizers:
                    self._tokenizer_lost(beat.instance, beat.state)
                return
            self._tokenizers[beat.instance] = now
            self._tokenizer_ready[beat.instance] = beat.state == "ready"
        elif beat.stage == "scheduler":
            e = self.engines.setdefault(beat.engine, EngineState())
            restarted = e.scheduler is not None and beat.instance != e.scheduler and not e.given_up
            if not restarted and e.scheduler_down:
                log.info("scheduler %s is back", beat.replica)
            e.executor_lost = beat.state.startswith("executor lost")
            e.scheduler, e.scheduler_seen, e.scheduler_down = beat.instance, now, False
            e.scheduler_ready, e.stats, e.given_up = beat.state == "ready", beat.scheduler, False
            if restarted:  # after the state is updated: the callback may route by it
                n = self._on_scheduler_restarted(beat.engine)
                log.warning("scheduler restarted (%s): sending the %d requests in flight again", beat.replica, n)
            self._serving_again(e)

    def check(self) -> None:
        now = self._clock()
        late = self._last_check is not None and now - self._last_check > self.lost_after_s / 2
        self._last_check = now
        if late:
            return
        for instance, seen in list(self._tokenizers.items()):
            if now - seen > self.lost_after_s:
                self._tokenizer_lost(instance, f"silent for {now - seen:.1f} s")
        for name, e in list(self.engines.items()):
            if e.executor_seen is not None and not e.executor_down and now - e.executor_seen > self.lost_after_s:
                e.executor_down = True
                log.warning("executor of %s silent for %.1f s: no new requests for it until it is back",
                            name, now - e.executor_seen)
            if e.scheduler is not None and not e.scheduler_down and now - e.scheduler_seen > self.lost_after_s:
                e.scheduler_down = True
                log.warning("scheduler of %s silent for %.1f s: no new requests for it; those in flight wait "
                            "for it or another engine", name, now - e.scheduler_seen)
            if not e.serving and (e.scheduler_down or e.executor_down or e.executor_lost):
                self._route_around(name, e, "silent or lost")
            if (e.scheduler_down and not e.given_up and not e.routed_around
                    and now - e.scheduler_seen > self.scheduler_give_up_s):
                e.given_up = True
                self._scheduler_lost(f"The scheduler has been gone for {self.scheduler_give_up_s:.0f} s; the "
                                     "request was lost. Please retry.")

    def _route_around(self, name: str, e: EngineState, why: str) -> None:
        """An engine that stopped serving while another serves: its requests go elsewhere, once."""
        if e.routed_around or e.scheduler is None or not any(
                other.serving for n, other in self.engines.items() if n != name):
            return
        e.routed_around = True
        n = self._on_engine_lost(name)
        if n:
            log.warning("engine %s is not serving (%s): sending its %d requests to the others", name, why, n)

    @staticmethod
    def _serving_again(e: EngineState) -> None:
        if e.serving:
            e.routed_around = False

    def _tokenizer_lost(self, instance: str, why: str) -> None:
        self._tokenizers.pop(instance, None)
        self._tokenizer_ready.pop(instance, None)
        name = next((n for n, i in self._tokenizer_names.items() if i == instance), instance)
        n = self._on_tokenizer_lost(name)
        log.warning("tokenizer %s (instance %s) lost (%s): asking another replica for its %d requests", name,
                    instance, why, n)

    def _scheduler_lost(self, message: str) -> None:
        n = self._on_scheduler_lost(message)
        log.warning("scheduler lost: failing %d requests in flight", n)

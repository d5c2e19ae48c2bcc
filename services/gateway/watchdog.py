"""Turns the stages' heartbeats into recovery: which tokenizer replica and which scheduler died.

A stage instance is lost when it sends no heartbeat for LOST_AFTER_S, or at once when a
new instance shows up under the same name (a restart faster than that); a tokenizer
replica also when it says it is stuck (its loop made no progress, though its heartbeat
thread still beats). New requests go only to `live_tokenizers`. A lost
tokenizer replica's requests are retried on the others. A scheduler that goes silent
makes new requests get a 503 while those in flight wait: when a new scheduler instance
beats (a restart), it knows none of them, so they are all sent again
(`on_scheduler_restarted`); if the old one beats again (it was frozen), they simply go
on; only one gone for SCHEDULER_GIVE_UP_S ends them with a 503 (`on_scheduler_lost`). The executor needs nothing here: the scheduler
recomputes what a restarted executor lost. Admission asks `missing_stage`: while no
tokenizer replica, no scheduler or no executor is alive, new requests get a 503 at once
instead of waiting for a stage that may not come back.

A check that itself runs late (the event loop was stalled, so beats may sit unread in
the socket) declares nothing, so a busy gateway does not mistake itself for a dead stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from shared.messages import Heartbeat

log = logging.getLogger(__name__)

LOST_AFTER_S = 3.0
SCHEDULER_GIVE_UP_S = 60.0  # requests wait this long for a scheduler to come back
CHECK_INTERVAL_S = 0.25


class StageWatchdog:
    def __init__(
        self,
        on_tokenizer_lost: Callable[[str], int],
        on_scheduler_lost: Callable[[str], int],
        lost_after_s: float = LOST_AFTER_S,
        clock: Callable[[], float] = time.monotonic,
        on_scheduler_restarted: Callable[[], int] = lambda: 0,
        scheduler_give_up_s: float = SCHEDULER_GIVE_UP_S,
    ):
        self._on_tokenizer_lost = on_tokenizer_lost
        self._on_scheduler_lost = on_scheduler_lost
        self._on_scheduler_restarted = on_scheduler_restarted
        self.scheduler_give_up_s = scheduler_give_up_s
        self._scheduler_given_up = False  # its requests were failed: nothing left to resend
        self.lost_after_s = lost_after_s
        self._clock = clock
        self._tokenizers: dict[str, float] = {}  # instance -> last beat
        self._tokenizer_ready: dict[str, bool] = {}  # instance -> its last beat said ready
        self._tokenizer_names: dict[str, str] = {}  # replica name -> instance
        self._scheduler: str | None = None  # instance
        self._scheduler_seen = 0.0
        self._scheduler_down = False
        self._executor_seen: float | None = None
        self._executor_down = False
        self._executor_lost = False  # the scheduler says the executor stopped answering steps
        self._last_check: float | None = None

    @property
    def scheduler_available(self) -> bool:
        return self._scheduler is not None and not self._scheduler_down

    @property
    def missing_stage(self) -> str | None:
        """The first stage with no live instance, or None when every one is up."""
        if not self._tokenizers:
            return "tokenizer"
        if not self.scheduler_available:
            return "scheduler"
        if self._executor_seen is None or self._executor_down or self._executor_lost:
            return "executor"
        return None

    def live_tokenizers(self) -> list[str]:
        """The names of the tokenizer replicas that beat lately and are ready."""
        return [name for name, instance in self._tokenizer_names.items()
                if instance in self._tokenizers and self._tokenizer_ready.get(instance)]

    def record(self, beat: Heartbeat) -> None:
        now = self._clock()
        if beat.stage == "executor":
            if self._executor_down:
                log.info("executor %s is back", beat.replica)
            self._executor_seen, self._executor_down = now, False
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
            self._executor_lost = beat.state.startswith("executor lost")
            if self._scheduler is not None and beat.instance != self._scheduler and not self._scheduler_given_up:
                n = self._on_scheduler_restarted()
                log.warning("scheduler restarted (%s): sending the %d requests in flight again", beat.replica, n)
            elif self._scheduler_down:
                log.info("scheduler %s is back", beat.replica)
            self._scheduler, self._scheduler_seen, self._scheduler_down = beat.instance, now, False
            self._scheduler_given_up = False

    def check(self) -> None:
        now = self._clock()
        late = self._last_check is not None and now - self._last_check > self.lost_after_s / 2
        self._last_check = now
        if late:
            return
        for instance, seen in list(self._tokenizers.items()):
            if now - seen > self.lost_after_s:
                self._tokenizer_lost(instance, f"silent for {now - seen:.1f} s")
        if self._executor_seen is not None and not self._executor_down and now - self._executor_seen > self.lost_after_s:
            self._executor_down = True
            log.warning("executor silent for %.1f s: refusing new requests until it is back", now - self._executor_seen)
        if self._scheduler is not None and not self._scheduler_down and now - self._scheduler_seen > self.lost_after_s:
            self._scheduler_down = True
            log.warning("scheduler silent for %.1f s: refusing new requests; those in flight wait for it",
                        now - self._scheduler_seen)
        if self._scheduler_down and not self._scheduler_given_up and now - self._scheduler_seen > self.scheduler_give_up_s:
            self._scheduler_given_up = True
            self._scheduler_lost(f"The scheduler has been gone for {self.scheduler_give_up_s:.0f} s; the request "
                                 "was lost. Please retry.")

    def _tokenizer_lost(self, instance: str, why: str) -> None:
        self._tokenizers.pop(instance, None)
        self._tokenizer_ready.pop(instance, None)
        n = self._on_tokenizer_lost(instance)
        log.warning("tokenizer instance %s lost (%s): retrying %d requests", instance, why, n)

    def _scheduler_lost(self, message: str) -> None:
        n = self._on_scheduler_lost(message)
        log.warning("scheduler lost: failing %d requests in flight", n)

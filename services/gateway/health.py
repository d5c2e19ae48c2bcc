"""Which stages are alive, from the heartbeats every stage pushes to the status socket.

The server is healthy when each required stage (at least one replica of it) sent a
heartbeat within FRESH_S and reports "ready". Replicas silent for FORGET_S are dropped
from the report, so a restarted replica (a new name) does not leave a ghost behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.gateway.supervision import SupervisionState
from shared.messages import Heartbeat

REQUIRED_STAGES = ("gateway", "tokenizer", "scheduler", "executor")
FRESH_S = 2.0
FORGET_S = 60.0


class StageTracker:
    def __init__(
        self,
        on_scheduler_stats: Callable | None = None,
        clock: Callable[[], float] = time.monotonic,
        supervision: SupervisionState | None = None,
    ):
        self._supervision = supervision
        self._beats: dict[tuple[str, str], tuple[Heartbeat, float]] = {}
        self._on_stats = on_scheduler_stats
        self._clock = clock
        self.engines: Callable[[], dict] | None = None  # data parallelism: /health's "engines"

    def record(self, beat: Heartbeat) -> None:
        self._beats[(beat.stage, beat.replica)] = (beat, self._clock())
        if beat.scheduler is not None and self._on_stats is not None:
            self._on_stats(beat.replica, beat.scheduler, beat.engine)

    def report(self) -> tuple[bool, dict]:
        """(healthy, a JSON-able body listing every replica with its state and age)."""
        now = self._clock()
        stages: dict[str, list[dict]] = {name: [] for name in REQUIRED_STAGES}
        for key, (beat, seen) in list(self._beats.items()):
            age = now - seen
            if age > FORGET_S:
                del self._beats[key]
                continue
            stages.setdefault(beat.stage, []).append({
                "replica": beat.replica,
                "pid": beat.pid,
                "state": beat.state,
                "age_s": round(age, 3),
                "ready": beat.state == "ready" and age <= FRESH_S,
                **({"engine": beat.engine} if beat.stage in ("scheduler", "executor") else {}),
            })
        missing = [name for name in REQUIRED_STAGES if not any(r["ready"] for r in stages[name])]
        restarting = self._supervision.restarting() if self._supervision else {}
        for name in restarting:  # launcher names: gateway, scheduler, executor, tokenizer-0, ...
            stage = name.rsplit("-", 1)[0] if name.startswith(("tokenizer-", "scheduler-", "executor-")) else name
            if stage not in missing:
                missing.append(stage)
        body = {"status": "ok" if not missing else "unavailable", "not_ready": missing, "stages": stages}
        if restarting:
            body["restarting"] = restarting
        if self.engines is not None:
            body["engines"] = self.engines()
        return not missing, body

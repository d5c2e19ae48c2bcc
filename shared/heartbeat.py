"""A daemon thread that tells the gateway, every interval, that this stage is alive.

It owns its own socket (zmq sockets are not thread-safe) and asks the stage for its
current state through a callback, so a stage busy in a long computation still
answers: the callback only reads fields the stage keeps up to date. Every beat names
this process's INSTANCE_ID, so the gateway tells a restarted stage from the old one
even when both have the same name (as containers of one service, all pid 1, do).

When $PAGEDSERVE_HEALTH_FILE is set, each beat is also written there, for
`pagedserve probe` (a container health check) to read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import zmq

from shared.messages import Heartbeat, SchedulerStats, StatusToGateway
from shared.transport import PushSocket

log = logging.getLogger(__name__)

INSTANCE_ID = uuid.uuid4().hex[:16]  # one per process
HEALTH_FILE_ENV = "PAGEDSERVE_HEALTH_FILE"


class HeartbeatThread(threading.Thread):
    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        stage: str,
        replica: str,
        state: Callable[[], str],
        stats: Callable[[], SchedulerStats | None] = lambda: None,
        interval_s: float = 0.25,
        engine: str = "engine-0",
    ):
        super().__init__(name=f"heartbeat-{stage}", daemon=True)
        self._sock = PushSocket(ctx, address, StatusToGateway)
        self._sock.sock.setsockopt(zmq.SNDHWM, 4)  # stale heartbeats are worthless
        self.stage, self.replica, self.state, self.stats = stage, replica, state, stats
        self.interval_s = interval_s
        self.engine = engine
        self.health_file = os.environ.get(HEALTH_FILE_ENV) or None
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                beat = Heartbeat(
                    stage=self.stage, replica=self.replica, pid=os.getpid(), state=self.state(),
                    sent_at=time.time(), scheduler=self.stats(), instance=INSTANCE_ID,
                    engine=self.engine,
                )
                self._sock.send_nowait(beat)
                if self.health_file:
                    write_health_file(self.health_file, beat)
            except Exception:  # a heartbeat must never take its stage down
                log.exception("heartbeat failed")
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()


def write_health_file(path: str, beat: Heartbeat) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"stage": beat.stage, "replica": beat.replica, "state": beat.state, "sent_at": beat.sent_at}, f)
    os.replace(tmp, path)  # a reader never sees half a file

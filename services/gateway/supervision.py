"""What the launcher says about the stages it supervises, for /health and /metrics.

The launcher (services/launcher.py) writes a small JSON file after every start and
every death: per stage, its restarts so far, its pid (null while it is down) and, while
down, the wall-clock time of its next start (its backoff). The gateway learns the path from
$PAGEDSERVE_SUPERVISOR_STATE; without a launcher (compose) there is no file and
nothing to report.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger(__name__)

STATE_ENV = "PAGEDSERVE_SUPERVISOR_STATE"


class SupervisionState:
    def __init__(self, path: str | None):
        self.path = path
        self._stages: dict[str, dict] = {}  # the last good read

    @classmethod
    def from_env(cls) -> SupervisionState:
        return cls(os.environ.get(STATE_ENV) or None)

    def stages(self) -> dict[str, dict]:
        """{stage: {"restarts": int, "pid": int | None, "restart_at": float | None}}, read anew
        (a small file, asked for by /health and /metrics only)."""
        if self.path is None:
            return {}
        try:
            with open(self.path) as f:
                self._stages = dict(json.load(f)["stages"])
        except FileNotFoundError:
            self._stages = {}
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("unreadable supervisor state %s", self.path, exc_info=True)
        return self._stages

    def restarting(self) -> dict[str, float]:
        """The stages down and waiting to be started again, with the seconds left."""
        now = time.time()
        return {name: round(max(0.0, (s.get("restart_at") or now) - now), 3)
                for name, s in self.stages().items() if s.get("pid") is None}

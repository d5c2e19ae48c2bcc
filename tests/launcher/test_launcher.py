"""The launcher's Supervisor over real child processes: a stage that keeps dying is
restarted forever with a capped exponential backoff while the others keep running, the
restarts are published for the gateway (/health, /metrics), and only a stop ends it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from services.gateway.health import StageTracker
from services.gateway.metrics import Metrics
from services.gateway.supervision import SupervisionState
from services.launcher import Supervisor
from shared.messages import Heartbeat
from tests.helpers import parse_metrics

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
CRASHER = [sys.executable, "-c", "import sys; sys.exit(3)"]
BASE_S, CAP_S = 0.05, 0.4


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_a_stage_that_keeps_dying_is_restarted_forever_with_a_capped_backoff(tmp_path):
    state_path = tmp_path / "supervisor.json"
    sup = Supervisor({"steady": SLEEPER, "crasher": CRASHER}, backoff_base_s=BASE_S, backoff_cap_s=CAP_S,
                     state_path=str(state_path))
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: all(s.proc is not None for s in sup.stages), "the stages to start")
        steady, crasher = sup.stages
        steady_pid = steady.proc.pid
        wait_for(lambda: crasher.restarts_total >= 9, "nine restarts")  # the old launcher gave up after five
        assert thread.is_alive() and not result
        assert steady.proc.pid == steady_pid and steady.proc.poll() is None  # the others are untouched
        delays = crasher.delays[:9]
        assert delays == [min(BASE_S * 2**k, CAP_S) for k in range(9)]  # doubled up to the cap, no further
        assert delays[-1] == CAP_S
        gaps = [b - a for a, b in zip(crasher.starts, crasher.starts[1:], strict=False)]
        assert all(gap >= delay for gap, delay in zip(gaps, crasher.delays, strict=False))  # each restart waited its delay
        def written() -> dict | None:  # the file is rewritten as stages change: it may lag a restart
            try:
                return json.loads(state_path.read_text())["stages"]
            except (OSError, ValueError, KeyError):
                return None

        wait_for(lambda: (w := written()) is not None and w["crasher"]["restarts"] >= 9, "the state file's restarts")
        state = written()
        assert state["crasher"]["restarts"] >= 9 and state["steady"]["restarts"] == 0
        assert state["steady"]["pid"] == steady_pid
    finally:
        sup.stopping = True
        thread.join(30)
    assert result == [0]  # told to stop: a clean exit
    assert steady.proc.poll() is not None


def test_the_gateway_reports_restarts_and_is_unhealthy_while_a_stage_waits_to_restart(tmp_path):
    path = tmp_path / "supervisor.json"
    supervision = SupervisionState(str(path))
    tracker = StageTracker(supervision=supervision)
    for stage in ("gateway", "tokenizer", "scheduler", "executor"):
        tracker.record(Heartbeat(stage, stage, 1, "ready", 0.0, None, stage))
    assert tracker.report()[0]  # no file yet: nothing is restarting

    path.write_text(json.dumps({"stages": {
        "executor": {"restarts": 7, "pid": None, "restart_at": time.time() + 30},
        "scheduler": {"restarts": 0, "pid": 11, "restart_at": None},
    }}))
    healthy, body = tracker.report()
    assert not healthy and body["not_ready"] == ["executor"]
    assert list(body["restarting"]) == ["executor"] and 0 < body["restarting"]["executor"] <= 30

    metrics = Metrics(supervision=supervision)
    values = parse_metrics(metrics.render()[0].decode())
    assert values['pagedserve_stage_restarts_total{stage="executor"}'] == 7
    assert values['pagedserve_stage_restarts_total{stage="scheduler"}'] == 0
    assert values['pagedserve_stage_restarting{stage="executor"}'] == 1

    path.write_text(json.dumps({"stages": {"executor": {"restarts": 8, "pid": 12, "restart_at": None}}}))
    assert tracker.report()[0]
    values = parse_metrics(metrics.render()[0].decode())
    assert values['pagedserve_stage_restarts_total{stage="executor"}'] == 8

def _niceness(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])


def test_frontend_stages_start_with_the_added_niceness():
    sup = Supervisor({"gateway": SLEEPER, "executor": SLEEPER}, nice={"gateway": 7})
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: all(s.proc is not None for s in sup.stages), "the stages to start")
        gateway, executor = sup.stages
        own = _niceness(os.getpid())
        assert _niceness(gateway.proc.pid) == min(own + 7, 19)
        assert _niceness(executor.proc.pid) == own
    finally:
        sup.stopping = True
        thread.join(30)

"""`pagedserve probe`: the container health check reads the heartbeat file or a URL."""

from __future__ import annotations

import subprocess
import sys
import time

from services.probe import check_file, check_url
from shared.heartbeat import write_health_file
from shared.messages import Heartbeat
from shared.ports import free_port
from tests.helpers import ROOT


def write(path, state="ready", sent_at=None):
    write_health_file(str(path), Heartbeat("executor", "executor-1", 1, state, sent_at or time.time()))


def test_file_probe_wants_a_recent_ready_beat(tmp_path):
    path = tmp_path / "health"
    assert check_file(str(path), 5.0)[0] is False  # none written yet
    write(path)
    assert check_file(str(path), 5.0) == (True, "executor executor-1: ready")
    write(path, state="loading model")
    healthy, why = check_file(str(path), 5.0)
    assert not healthy and "loading model" in why
    write(path, sent_at=time.time() - 60)
    healthy, why = check_file(str(path), 5.0)
    assert not healthy and "60" in why
    path.write_text("{not json")
    assert check_file(str(path), 5.0)[0] is False
    assert check_file(None, 5.0)[0] is False


def test_url_probe_and_the_command_line(tmp_path):
    assert check_url(f"http://127.0.0.1:{free_port()}/health", 1.0)[0] is False  # nothing listens
    path = tmp_path / "health"
    write(path)
    cmd = [sys.executable, "-m", "services.cli", "probe"]
    ok = subprocess.run(cmd, cwd=ROOT, env={"PAGEDSERVE_HEALTH_FILE": str(path), "PATH": "/usr/bin:/bin"},
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    write(path, state="waiting for executor")
    bad = subprocess.run(cmd + ["--file", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "waiting for executor" in bad.stderr

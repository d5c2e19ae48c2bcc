"""benchmarks.placement as a user runs it: one real process serving the tiny model with two
placement variants, one round of two small closed-loop points each; real figures come out
(no timing asserts), with every request completed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_placement_serves_each_variant_and_prints_its_figures(tiny_model_dir, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.placement", "--model", str(tiny_model_dir), "--variants", "default,sync",
           "--concurrency", "1", "3", "--rounds", "1", "--dataset", "sharegpt-paper", "--output-len", "8",
           "--waves", "1", "--min-requests", "3", "--warmup", "1", "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {(m[1], int(m[2])): float(m[3]) for m in re.finditer(r"^\s*(default|sync)\s+(\d+)\s+([\d.]+)\s",
                                                                 proc.stdout, re.M)}
    assert set(rows) == {("default", 1), ("default", 3), ("sync", 1), ("sync", 3)}, proc.stdout
    assert all(tok_s > 0 for tok_s in rows.values())
    logged = proc.stderr + proc.stdout
    assert logged.count(", 0 failed") == 4 and not re.search(r"\b[1-9]\d* failed", logged)

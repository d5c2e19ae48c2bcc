"""Every kernel variant compiles for an H100/H200 (sm_90): Triton's compiler and ptxas, no GPU needed.

The interpreter checks what the kernels compute, not that they compile; this does, in a
process of its own since the kernels here are imported interpreted.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90():
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "--arch", "90", "--quick"],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = re.search(r"(\d+) kernels compiled for sm_90, (\d+) launches failed", proc.stdout)
    assert summary and int(summary[1]) >= 12 and summary[2] == "0", proc.stdout[-2000:]

"""The C++ kernels' AVX2 paths, on a machine whose native build takes the AVX-512 ones.

Our users' CPUs are often AVX2-only (AMD EPYC without AVX-512): this builds the
extension for `haswell` (AVX2 + FMA + F16C) in a child process and runs the kernel
tests against that build, so both instruction sets are checked wherever the suite runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu.build import MARCH_ENV, cpu_flags

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the native build already takes the AVX2 paths here")
@pytest.mark.skipif("avx2" not in cpu_flags(), reason="this CPU cannot run an AVX2 build")
def test_kernels_built_for_avx2_match_the_reference():
    env = {**os.environ, MARCH_ENV: "haswell"}
    # less the AMX tile kernel's tests, which an AVX2 build skips (q4_linear_tiles_rows() is 0 there)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/kernels/test_cpu_kernels.py", "-k",
                           "not q4_linear_tiles_matches and not q4_linear_tiles_gives and not q8_linear_tiles_matches"
                               " and not bf16_linear_tiles and not gate_up_silu_tiles"],
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-1000:]

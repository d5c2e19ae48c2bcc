"""Triton kernels run in Triton's CPU interpreter here unless TRITON_INTERPRET=0 (a GPU run, kernels/bench.py).

Triton reads the variable when a kernel module is imported, so it is set before any test
module of this folder imports one.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

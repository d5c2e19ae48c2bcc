"""Test and benchmark helpers: NVIDIA Dynamo's frontend and pagedserve Dynamo workers
(`pagedserve serve --dynamo`) as real processes on loopback, with file discovery (no etcd,
no NATS) or Debian's etcd and NATS. Every Dynamo address is pinned to 127.0.0.1."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shared.ports import free_port
from tests.helpers import ROOT, get, parse_metrics


def has_dynamo() -> bool:
    try:
        return importlib.util.find_spec("dynamo.llm") is not None
    except ModuleNotFoundError:
        return False


def low_free_port() -> int:
    """A free TCP port below 32768 (Dynamo reads $DYN_SYSTEM_PORT as a signed 16-bit number)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def loopback_env(store: Path) -> dict[str, str]:
    """Dynamo on this host only: file discovery under `store`, every plane on 127.0.0.1."""
    return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store), "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_LOG": "warn"}


class Proc:
    """A process group with its log, killed on close."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str]):
        self.cmd, self.log_path = cmd, log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, tail: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def close(self, timeout_s: float = 20.0) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        else:
            try:  # the stages of a worker whose launcher was killed
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


def etcd_and_nats(tmp: Path) -> tuple[list[Proc], dict[str, str]]:
    """Debian's etcd and NATS (JetStream) on loopback, and the environment that points Dynamo
    at them (etcd discovery, NATS event plane)."""
    etcd_port, peer_port, nats_port = free_port(), free_port(), free_port()
    etcd = Proc([shutil.which("etcd") or "etcd", "--data-dir", str(tmp / "etcd"), "--listen-client-urls",
                 f"http://127.0.0.1:{etcd_port}", "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer_port}", "--initial-advertise-peer-urls",
                 f"http://127.0.0.1:{peer_port}", "--initial-cluster", f"default=http://127.0.0.1:{peer_port}"],
                tmp / "etcd.log", {})
    nats = Proc([shutil.which("nats-server") or "nats-server", "-js", "-a", "127.0.0.1", "-p", str(nats_port),
                 "-sd", str(tmp / "nats")], tmp / "nats.log", {})
    deadline = time.monotonic() + 30
    while True:
        try:
            if get(f"http://127.0.0.1:{etcd_port}/health", timeout=1)[0] == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or not etcd.alive():
            raise RuntimeError(f"etcd did not start:\n{etcd.log()}")
        time.sleep(0.2)
    env = {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}",
           "NATS_SERVER": f"nats://127.0.0.1:{nats_port}", "DYN_EVENT_PLANE": "nats"}
    return [etcd, nats], env


class DynamoCluster:
    """Dynamo's frontend (--router-mode) and `workers` pagedserve Dynamo workers, each its own
    engine publishing KV events on its own port; `with` waits until the frontend sees them all.
    discovery "file" (a directory) or "etcd" (Debian's etcd and NATS, started here)."""

    def __init__(self, model: Path | str, tmp: Path, workers: int = 2, router_mode: str = "kv",
                 served_name: str = "tiny-llama", extra: list[str] | None = None, executor_threads: int = 1,
                 startup_timeout_s: float = 300.0, frontend_extra: list[str] | None = None,
                 discovery: str = "file"):
        self.model, self.tmp, self.n = model, tmp, workers
        self.router_mode, self.served_name = router_mode, served_name
        self.extra = extra or ["--dtype", "float32"]
        self.executor_threads = executor_threads
        self.startup_timeout_s = startup_timeout_s
        self.frontend_extra = frontend_extra or []
        self.discovery = discovery
        self.services: list[Proc] = []  # etcd and NATS
        self.env = loopback_env(tmp / "dynamo-store")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers: list[Proc] = []
        self.system_ports: list[int] = []  # each worker's Dynamo status server (our counters on /metrics)
        self.frontend: Proc | None = None

    def start_worker(self, i: int) -> Proc:
        run_dir = self.tmp / f"worker-{i}"
        run_dir.mkdir(exist_ok=True)
        port = low_free_port()
        if i < len(self.system_ports):
            self.system_ports[i] = port
        else:
            self.system_ports.append(port)
        cmd = [sys.executable, "-m", "services.cli", "serve", "--dynamo", "--model", str(self.model),
               "--served-model-name", self.served_name, "--executor-threads", str(self.executor_threads),
               "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}", *self.extra]
        return Proc(cmd, self.tmp / f"worker-{i}.log", {**self.env, "PAGEDSERVE_RUN_DIR": str(run_dir),
                                                          "DYN_SYSTEM_PORT": str(port)})

    def __enter__(self) -> DynamoCluster:
        try:
            if self.discovery == "etcd":
                self.services, env = etcd_and_nats(self.tmp)
                self.env.update(env)
            self.workers = [self.start_worker(i) for i in range(self.n)]
            self.frontend = Proc([sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                  "--http-port", str(self.port), "--router-mode", self.router_mode,
                                  "--discovery-backend", self.discovery, "--kv-cache-block-size", "16",
                                  *self.frontend_extra],
                                 self.tmp / "frontend.log", self.env)
            self.wait_workers(self.n)
        except BaseException:
            self.__exit__()
            raise
        return self

    def registered(self) -> int:
        """Workers that logged their registration."""
        return sum("serving " in w.log(10**7) and "to Dynamo on" in w.log(10**7) for w in self.workers)

    def wait_workers(self, n: int) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            for p in [*self.workers, self.frontend]:
                if not p.alive() or p.log(10**7).count(" exited with ") >= 2:
                    raise RuntimeError(f"{p.cmd[:4]} exited at start-up:\n{p.log()}")
            if self.registered() >= n and self.model_listed():
                time.sleep(3.0)  # the frontend's watcher adds each instance as it sees it
                return
            time.sleep(0.5)
        raise RuntimeError(f"{n} Dynamo workers not up after {self.startup_timeout_s}s:\n"
                           + "\n".join(w.log(3000) for w in self.workers) + (self.frontend.log(3000)))

    def worker_id(self, i: int) -> int | None:
        """Worker i's Dynamo instance id (the worker_id Dynamo's responses name), from its log."""
        m = re.search(r"to Dynamo on \S+ as worker (\d+)", self.workers[i].log(10**7))
        return int(m.group(1)) if m else None

    def metrics(self, i: int) -> dict[str, float]:
        """Worker i's counters (services/dynamo_worker/metrics.py) from its Dynamo status server."""
        return parse_metrics(get(f"http://127.0.0.1:{self.system_ports[i]}/metrics", timeout=5)[1])

    def model_listed(self) -> bool:
        try:
            status, body = get(self.url + "/v1/models", timeout=2)
        except OSError:
            return False
        return status == 200 and any(m["id"] == self.served_name for m in json.loads(body)["data"])

    def __exit__(self, *exc) -> None:
        for p in [self.frontend, *self.workers, *self.services]:
            if p is not None:
                p.close()

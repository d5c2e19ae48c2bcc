"""compose.yaml's services run as plain processes on tcp:// loopback addresses.

Each service's command and environment are taken from compose.yaml as written (with
layers such as compose.dp.yaml over it, merged as compose does: a layer's command
replaces, its environment adds, `extends` copies a service of compose.yaml); only what
the compose network provides is mapped: service names and `*` to 127.0.0.1, each
service's fixed ports to free ones (a port bound as `*` by one service and reached as
`service:port` by others is the same), /cache to the user's cache, the CURVE key secret
to a key pair made by `pagedserve keygen` for this run, and the health file to one per
process. The tokenizer service is started as many times as asked, as `--scale` would.
No supervisor: a killed process stays dead.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from shared.ports import free_port
from tests.helpers import ROOT, get

_VAR = re.compile(r"\$\{(\w+):-([^}]*)\}")
_TCP = re.compile(r"tcp://(\*|gateway|scheduler(?:-\d+)?):(\d+)")
STAGES = ("scheduler", "executor", "gateway", "tokenizer")


def merged(*layers: str) -> dict:
    """compose.yaml with the given layer files over it, for the keys these services use."""
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = base["services"]
    for layer in layers:
        for name, over in yaml.safe_load((ROOT / layer).read_text())["services"].items():
            extends = over.get("extends")
            svc = copy.deepcopy(base["services"][extends["service"]] if extends else services[name])
            for key, value in over.items():
                if key == "environment":
                    svc[key] = {**svc.get(key, {}), **value}
                elif key != "extends":
                    svc[key] = value
            services[name] = svc
    return base


class ComposeTopology:
    def __init__(self, model_dir: Path, run_dir: Path, tokenizers: int = 2, env: dict[str, str] | None = None,
                 startup_timeout: float = 180, layers: tuple[str, ...] = ()):
        self.compose = merged(*layers)
        self.run_dir = run_dir
        self.tokenizers = tokenizers
        self.vars = {"PAGEDSERVE_MODEL": str(model_dir), **(env or {})}
        self.ports: dict[str, int] = {}
        self.http_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.startup_timeout = startup_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.health_files: dict[str, Path] = {}
        key = self.vars.get("PAGEDSERVE_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}  # /health needs it too

    def _map(self, value: str, service: str) -> str:
        value = _VAR.sub(lambda m: self.vars.get(m.group(1), m.group(2)), value)

        def port(m: re.Match) -> str:
            host = service if m.group(1) == "*" else m.group(1)
            return f"tcp://127.0.0.1:{self.ports.setdefault(f'{host}:{m.group(2)}', free_port())}"

        return _TCP.sub(port, value)

    def command(self, service: str) -> list[str]:
        args = [self._map(str(a), service) for a in self.compose["services"][service]["command"]]
        for flag, value in (("--host", "127.0.0.1"), ("--port", str(self.http_port))):
            if flag in args:
                args[args.index(flag) + 1] = value
        return [sys.executable, "-m", "services.cli", *args]

    def environment(self, service: str, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        for key, value in self.compose["services"][service]["environment"].items():
            env[key] = self._map(str(value), service)
        env.pop("PAGEDSERVE_CACHE")  # /cache is a compose volume; here the user's cache
        env["PAGEDSERVE_CURVE_KEY_FILE"] = str(self.key_file)  # a compose secret
        self.health_files[name] = self.run_dir / f"{name}.health"
        env["PAGEDSERVE_HEALTH_FILE"] = str(self.health_files[name])
        return env

    def start(self, service: str, name: str) -> None:
        log = open(self.run_dir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(self.command(service), cwd=ROOT, env=self.environment(service, name),
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def __enter__(self) -> ComposeTopology:
        subprocess.run([sys.executable, "-m", "services.cli", "keygen", str(self.run_dir / "secrets")], cwd=ROOT,
                       check=True, capture_output=True)
        self.key_file = self.run_dir / "secrets" / "pagedserve.key_secret"
        for service, svc in self.compose["services"].items():  # every engine's stages (compose.dp.yaml)
            if service != "tokenizer" and svc.get("command", [])[1:2] in ([s] for s in STAGES):
                self.start(service, service)
        for i in range(self.tokenizers):
            self.start("tokenizer", f"tokenizer-{i}")
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                self.__exit__()
                raise RuntimeError(f"{dead} exited at start-up:\n{self.log(dead[0])}")
            try:
                status, body = get(self.url + "/health", timeout=2, headers=self.headers)
                ready = [r for r in json.loads(body)["stages"]["tokenizer"] if r["ready"]]
                if status == 200 and len(ready) == self.tokenizers:
                    return self
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"not healthy after {self.startup_timeout} s:\n{self.log('gateway')}")

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")[-6000:]

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(10)

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

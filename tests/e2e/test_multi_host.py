"""Data parallelism across hosts: each engine in its own network namespace, reached over tcp.

Two network namespaces stand for two engine hosts. Each is joined to the root namespace
(the front-end host: gateway and tokenizer) by a veth pair, 10.N.i.1 on the root side and
10.N.i.2 inside, with a default route back through it; the gateway binds its sockets on
10.N.1.1, so engine 1's heartbeats and replies cross the host boundary twice over. Every
stage runs the command line the launcher would give it for `--data-parallel-size 2`
(`services.launcher.stage_commands`) with tcp:// addresses and a CURVE key, as on real
hosts: the engines' stages under `ip netns exec`. Greedy outputs equal a single engine's
(`pagedserve serve` on one host), the requests spread over both engines, and each veth
carried the traffic (its byte counters grew by more than the prompts sent through it).

Skipped, with the reason, where namespaces cannot be made: not root, no `ip`, or
`ip netns add` refused (an unprivileged container). The namespaces, and with them the
veth pairs, are deleted on teardown whatever happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time

import pytest

from services import launcher
from shared.config import Addresses
from shared.ports import free_port
from tests.e2e.load import dumps, greedy, run_load
from tests.helpers import ROOT, ServerProcess, get, parse_metrics

ENGINES = 2
OPTIONS = ["--dtype", "float32", "--served-model-name", "tiny-llama", "--executor-threads", "1",
           "--num-kv-blocks", "256"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Hosts:
    """ENGINES network namespaces, each linked to the root namespace by a veth pair."""

    def __init__(self):
        tag = f"{os.getpid() % 10000}{random.randrange(100):02d}"
        self.net = random.randrange(100, 250)  # 10.net.i.0/24 per engine host
        self.names = [f"psx{tag}e{i}" for i in range(ENGINES)]
        self.root_ifs = [f"psx{tag}r{i}" for i in range(ENGINES)]  # at most 15 characters

    def front(self, i: int) -> str:
        return f"10.{self.net}.{i + 1}.1"

    def engine(self, i: int) -> str:
        return f"10.{self.net}.{i + 1}.2"

    def create(self) -> None:
        for i, (ns, root_if) in enumerate(zip(self.names, self.root_ifs, strict=True)):
            _ip("netns", "add", ns)
            _ip("link", "add", root_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("addr", "add", f"{self.front(i)}/24", "dev", root_if)
            _ip("link", "set", root_if, "up")
            for cmd in (["addr", "add", f"{self.engine(i)}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                        ["link", "set", "lo", "up"], ["route", "add", "default", "via", self.front(i)]):
                _ip("-n", ns, *cmd)

    def bytes_through(self, i: int) -> int:
        stats = f"/sys/class/net/{self.root_ifs[i]}/statistics"
        return sum(int(open(f"{stats}/{d}_bytes").read()) for d in ("rx", "tx"))

    def delete(self) -> None:
        for ns, root_if in zip(self.names, self.root_ifs, strict=True):
            _ip("netns", "del", ns, check=False)  # takes its end of the veth pair, and so the pair
            _ip("link", "del", root_if, check=False)


def namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"psxprobe{os.getpid() % 100000}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def stage_commands(model_dir, key_file: str, http_port: int, hosts: Hosts) -> dict[str, list[str]]:
    """What the launcher runs for --data-parallel-size 2, with each engine's addresses on its host."""
    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    front = hosts.front(0)

    def tcp(host: str) -> str:
        return f"tcp://{host}:{free_port()}"

    per_engine = {name: ",".join(tcp(hosts.engine(i)) for i in range(ENGINES))
                  for name in ("scheduler_in", "executor_in", "executor_out")}
    addresses = Addresses(tokenizer_in=tcp(front), gateway_in=tcp(front), status=tcp(front), **per_engine)
    args = parser.parse_args(["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(http_port),
                              "--data-parallel-size", str(ENGINES), "--routing", "prefix",
                              "--curve-key-file", key_file, *OPTIONS, *addresses.as_argv()])
    return launcher.stage_commands(args, addresses)


class Deployment:
    def __init__(self, model_dir, run_dir, hosts: Hosts):
        self.run_dir = run_dir
        self.hosts = hosts
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        subprocess.run([sys.executable, "-m", "services.cli", "keygen", str(run_dir / "secrets")], cwd=ROOT,
                       check=True, capture_output=True)
        key = str(run_dir / "secrets" / "pagedserve.key_secret")
        self.commands = stage_commands(model_dir, key, self.port, hosts)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        for name, cmd in self.commands.items():
            engine = name.rsplit("-", 1)[1] if name.startswith(("scheduler-", "executor-")) else None
            if engine is not None:
                cmd = ["ip", "netns", "exec", self.hosts.names[int(engine)], *cmd]
            with open(self.run_dir / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)

    def wait_serving(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            assert not dead, f"{dead} exited:\n{self.log(dead[0])}"
            try:
                status, body = get(self.url + "/health", timeout=2)
                engines = json.loads(body).get("engines", {})
                if status == 200 and sum(e["serving"] for e in engines.values()) == ENGINES:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"not {ENGINES} engines serving after {timeout} s:\n{self.log('gateway')}")

    def log(self, name: str) -> str:
        return (self.run_dir / f"{name}.log").read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def hosts():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(f"multi-host test needs network namespaces: {reason}")
    made = Hosts()
    try:
        made.create()
        yield made
    finally:
        made.delete()


def bodies() -> list[dict]:
    out = []
    for i in range(24):
        system = [200 + 1000 * (i % 4) + k for k in range(32)]
        out.append(greedy(system + [4000 + i, 11, 12], 8))
    return out


def test_engines_on_other_hosts_serve_over_tcp_with_a_single_engines_outputs(hosts, tiny_model_dir, tmp_path):
    assert all(_ip("-n", ns, "addr", "show", "eth0").stdout.count(hosts.engine(i)) == 1
               for i, ns in enumerate(hosts.names))
    load = bodies()
    (tmp_path / "single").mkdir()
    with ServerProcess(tiny_model_dir, tmp_path / "single", OPTIONS) as single:
        want = asyncio.run(run_load(single.url, load, []))
    assert all(r[0] == 200 for r in want), dumps(want)

    deployment = Deployment(tiny_model_dir, tmp_path, hosts)
    try:
        deployment.start()
        deployment.wait_serving()
        for i, ns in enumerate(hosts.names):  # the engine's stages run on its host, the others not
            inside = {int(p) for p in _ip("netns", "pids", ns).stdout.split()}
            assert inside == {deployment.procs[f"{stage}-{i}"].pid for stage in ("scheduler", "executor")}, inside
        before = [hosts.bytes_through(i) for i in range(ENGINES)]
        got = asyncio.run(run_load(deployment.url, load, []))
        assert got == want, dumps(got) + deployment.log("gateway")
        through = [hosts.bytes_through(i) - before[i] for i in range(ENGINES)]
        metrics = parse_metrics(get(deployment.url + "/metrics")[1])
        routed = {e: metrics[f'pagedserve_engine_requests_routed_total{{engine="{e}"}}'] for e in ("engine-0", "engine-1")}
        assert sum(routed.values()) == len(load) and all(n > 0 for n in routed.values()), routed
        for i, engine in enumerate(("engine-0", "engine-1")):
            # each request routed there crossed that host's veth: its prompt in, its tokens out
            assert through[i] > routed[engine] * 35 * 2, (through, routed)
        health = json.loads(get(deployment.url + "/health")[1])
        assert sorted(health["engines"]) == ["engine-0", "engine-1"], health
        assert all(e["serving"] for e in health["engines"].values()), health
    finally:
        deployment.stop()

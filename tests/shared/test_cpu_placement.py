"""CPU placement of a one-host CPU deployment: the executor's main thread keeps one core,
every other thread and stage runs on the rest.

Real affinities, read back from /proc: a child process pins itself as the executor does
(its OpenMP team already up, a helper thread running, a thread started afterwards that
joins the shared cores); the launcher's stages start on the shared cores and the executor
gets `--keep-main-core` only where one engine of one rank has the CPU; and a real served
tiny model answers with its stages placed that way."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from services import launcher
from shared import cpu_placement
from shared.config import Addresses
from tests.helpers import ROOT

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two cores allowed")

CHILD = r"""
import json, os, threading, time, torch
from shared import cpu_placement
torch.set_num_threads(2)
torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # the OpenMP team starts its workers
stop = threading.Event()
helper = threading.Thread(target=stop.wait, daemon=True)  # daemon: a failure below never hangs the exit
helper.start()
kept = cpu_placement.keep_core_for_main_thread()
late = {}
def later():
    cpu_placement.join_shared_cores()
    late["cpus"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=later); t.start(); t.join()
main = threading.get_native_id()
others = {}
for tid in os.listdir("/proc/self/task"):
    try:
        if int(tid) != main:
            others[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
    except ProcessLookupError:
        pass  # a thread that ended while listed (the joined one above may linger a moment)
torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # the team still runs
stop.set(); helper.join()
print(json.dumps({"kept": [kept[0], sorted(kept[1]), kept[2]], "main": sorted(os.sched_getaffinity(0)),
                  "others": others, "late": late["cpus"]}))
"""


def test_split_keeps_the_lowest_core_and_shares_the_rest():
    assert cpu_placement.split({3, 1, 2}) == (1, {2, 3})
    assert cpu_placement.split({5}) is None


@needs_two_cores
def test_the_main_thread_keeps_its_core_and_every_other_thread_moves_to_the_rest():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    first, rest = ALLOWED[0], ALLOWED[1:]
    assert got["kept"][:2] == [first, rest] and got["main"] == [first]
    assert got["kept"][2] >= 2  # the OpenMP worker and the helper thread at least
    assert got["others"] and all(cpus == rest for cpus in got["others"].values())
    assert got["late"] == rest  # a thread started later joins the shared cores


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_args(parser)
    return parser.parse_args(["--model", "tiny", *argv])


@needs_two_cores
def test_serve_places_only_one_engine_of_one_rank_on_the_cpu():
    assert launcher.shared_cores(_args()) == set(ALLOWED[1:])
    for argv in (["--cpu-placement", "off"], ["--data-parallel-size", "2"], ["--tensor-parallel-size", "2"],
                 ["--device", "cuda"]):
        assert launcher.shared_cores(_args(*argv)) is None, argv
    cmds = launcher.stage_commands(_args(), Addresses.ipc("/tmp/run"))
    assert "--keep-main-core" in cmds["executor"]
    off = launcher.stage_commands(_args("--cpu-placement", "off"), Addresses.ipc("/tmp/run"))
    assert "--keep-main-core" not in off["executor"]


@needs_two_cores
def test_stages_given_cores_move_there_once_ready():
    # A stage loads on every core, then settles (as the gateway, tokenizer and scheduler do
    # once ready); the sleeper is "ready" once it has started a thread of its own.
    ready = ("import threading, time; from shared import cpu_placement; "
             "threading.Thread(target=time.sleep, args=(600,), daemon=True).start(); "
             "cpu_placement.settle(); time.sleep(600)")
    sleeper = [sys.executable, "-c", ready]
    sup = launcher.Supervisor({"gateway": sleeper, "executor": sleeper}, cpus={"gateway": set(ALLOWED[1:])})
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not all(s.proc is not None for s in sup.stages):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        gateway, executor = sup.stages

        def cores(pid: int) -> list[list[int]]:  # of each of its threads
            return [sorted(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")]

        while not (len(cores(gateway.proc.pid)) == 2 and cores(gateway.proc.pid) == [ALLOWED[1:]] * 2):
            assert time.monotonic() < deadline, cores(gateway.proc.pid)
            time.sleep(0.02)
        assert cores(executor.proc.pid) == [ALLOWED] * len(cores(executor.proc.pid))  # no cores named: left alone
    finally:
        sup.stopping = True
        thread.join(30)

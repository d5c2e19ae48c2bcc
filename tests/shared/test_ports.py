"""free_port: ports outside the kernel's ephemeral range, never handed out twice across processes."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from shared import ports
from tests.helpers import ROOT


def test_ports_come_from_outside_the_ephemeral_range_and_bind():
    low, high = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_two_processes_never_get_the_same_port(tmp_path):
    ledger = tmp_path / "ports.json"
    take = ("import sys; from pathlib import Path; from shared import ports; ports.LEDGER = Path(sys.argv[1]); "
            "print(' '.join(str(ports.free_port()) for _ in range(300)))")
    procs = [subprocess.Popen([sys.executable, "-c", take, str(ledger)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    taken = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    flat = [int(x) for t in taken for x in t]
    assert len(flat) == 900 and len(set(flat)) == 900


def test_a_port_held_by_a_listener_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "LEDGER", tmp_path / "ports.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        monkeypatch.setattr(ports, "candidate_range", lambda: (busy, busy + 1))
        with pytest.raises(RuntimeError, match="no free TCP port"):
            ports.free_port()


def test_expired_claims_are_released(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "LEDGER", tmp_path / "ports.json")
    monkeypatch.setattr(ports, "candidate_range", lambda: (40000 - 1, 40000))
    monkeypatch.setattr(ports, "bindable", lambda port: True)
    assert ports.free_port() == 39999
    with pytest.raises(RuntimeError):
        ports.free_port()  # claimed by the first call
    monkeypatch.setattr(ports, "HOLD_S", 0)
    assert ports.free_port() == 39999  # the first claim has expired


def test_a_host_whose_ephemeral_range_covers_every_port_gets_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    assert ports.candidate_range() is None
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (10000, 40000))
    assert ports.candidate_range() == (40001, 65536)

"""The internal sockets against hostile peers, over real tcp:// loopback sockets: CURVE
keeps out every peer without the deployment's key (it can neither inject nor take
messages), an oversized frame is dropped while the socket serves the others, and a
stage refuses to start on a network address without a key."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import time

import msgspec
import pytest
import zmq
import zmq.auth

from shared.config import Addresses
from shared.curve import SECRET_KEY_ENV, CurveKeyError, CurveKeys, is_exposed, keygen, load_keys
from shared.messages import Heartbeat, StatusToGateway
from shared.ports import free_port
from shared.transport import PullSocket, PushSocket, configure
from tests.helpers import ROOT


def pagedserve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[CurveKeys, CurveKeys]:
    """The deployment's key pair, written by `pagedserve keygen`, and a stranger's."""
    out = tmp_path_factory.mktemp("keys")
    result = pagedserve("keygen", str(out / "ours"))
    assert result.returncode == 0, result.stderr
    assert oct((out / "ours" / "pagedserve.key_secret").stat().st_mode & 0o777) == "0o600"
    assert pagedserve("keygen", str(out / "theirs")).returncode == 0
    return (CurveKeys.from_file(str(out / "ours" / "pagedserve.key_secret")),
            CurveKeys.from_file(str(out / "theirs" / "pagedserve.key_secret")))


@pytest.fixture
def contexts():
    made = []

    def make(curve=None, **kw):
        made.append(configure(zmq.Context(), curve, **kw))
        return made[-1]

    yield make
    for ctx in made:
        ctx.destroy(linger=0)


def beat(name: str, size: int = 0) -> Heartbeat:
    return Heartbeat("tokenizer", name + "x" * size, 1, "ready", 0.0)


def knows_our_public_key(ctx: zmq.Context, kind: int, address: str, own: CurveKeys, server_public: bytes):
    """A raw socket of a peer that knows the server's public key but holds another secret."""
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = own.secret, own.public, server_public
    sock.connect(address)
    return sock


def received(sock: PullSocket, within_s: float) -> list[str]:
    out, deadline = [], time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        msg = sock.recv(timeout_ms=int(left * 1000) + 1)
        if msg is not None:
            out.append(msg.replica[:16])
    return out


def test_a_peer_without_the_key_can_neither_inject_nor_connect(keys, contexts):
    ours, theirs = keys
    address = f"tcp://127.0.0.1:{free_port()}"
    server = PullSocket(contexts(ours), address, StatusToGateway, bind=True)
    stranger = PushSocket(contexts(theirs), address, StatusToGateway)  # CURVE, but another key
    plain = PushSocket(contexts(), address, StatusToGateway)  # no CURVE at all
    insider = knows_our_public_key(contexts(), zmq.PUSH, address, theirs, ours.public)
    honest = PushSocket(contexts(ours), address, StatusToGateway)
    for _ in range(3):
        stranger.send_nowait(beat("forged"))
        plain.send_nowait(beat("plain"))
        try:
            insider.send(msgspec.msgpack.encode(beat("insider")), zmq.NOBLOCK)
        except zmq.Again:
            pass
    honest.send(beat("honest"))
    assert received(server, 1.5) == ["honest"]


def test_a_destroyed_contexts_keys_do_not_pass_to_the_next_context(keys, tmp_path):
    """libzmq often gives a new context the address of the one last destroyed: the settings
    configured for a destroyed CURVE context must not reach a plain context made after it (its
    sockets would be CURVE servers no plain peer connects to: a stand-in tokenizer in the gateway
    tests never became reachable after this file's contexts on the same worker)."""
    ours, _ = keys
    curved = configure(zmq.Context(), ours)
    stale = curved.underlying
    curved.destroy(linger=0)
    del curved  # as a test's context fixture lets go of it
    made = []
    try:
        for _ in range(50):  # the next contexts, until one lands where the CURVE one was
            made.append(zmq.Context())
            if made[-1].underlying == stale:
                break
        for i, plain in enumerate(made[-3:]):
            server = PullSocket(plain, f"ipc://{tmp_path}/plain{i}.ipc", StatusToGateway, bind=True)
            assert server.sock.getsockopt(zmq.MECHANISM) == zmq.NULL
            client = PushSocket(plain, f"ipc://{tmp_path}/plain{i}.ipc", StatusToGateway)
            client.send(beat("plain"))
            assert received(server, 2.0) == ["plain"]
    finally:
        for ctx in made:
            ctx.destroy(linger=0)


def test_a_peer_without_the_key_cannot_take_messages(keys, contexts):
    ours, theirs = keys
    address = f"tcp://127.0.0.1:{free_port()}"
    server = PushSocket(contexts(ours), address, StatusToGateway, bind=True)
    thief = PullSocket(contexts(theirs), address, StatusToGateway, bind=False)
    insider = knows_our_public_key(contexts(), zmq.PULL, address, theirs, ours.public)
    honest = PullSocket(contexts(ours), address, StatusToGateway, bind=False)
    time.sleep(0.3)  # both had time to knock; only the honest one got in
    for i in range(10):
        server.send(beat(f"step-{i}"))
    assert received(honest, 1.0) == [f"step-{i}" for i in range(10)]
    assert received(thief, 0.2) == []
    assert not insider.poll(200)


def test_an_oversized_frame_is_dropped_and_the_socket_keeps_serving(keys, contexts):
    ours, _ = keys
    address = f"tcp://127.0.0.1:{free_port()}"
    server = PullSocket(contexts(ours, max_message_bytes=4096), address, StatusToGateway, bind=True)
    big = PushSocket(contexts(ours), address, StatusToGateway)
    other = PushSocket(contexts(ours), address, StatusToGateway)
    other.send(beat("before"))
    assert received(server, 1.0) == ["before"]
    big.send(beat("huge", size=64 * 1024))  # the server drops the connection, never the process
    time.sleep(0.2)
    other.send(beat("after"))
    assert received(server, 1.0) == ["after"]
    big.send(beat("reconnected"))  # the big sender's connection is made again
    assert received(server, 3.0) == ["reconnected"]


def test_keys_are_required_on_network_addresses_only(keys, tmp_path, monkeypatch):
    ours, _ = keys
    monkeypatch.delenv("PAGEDSERVE_CURVE_KEY_FILE", raising=False)
    monkeypatch.delenv(SECRET_KEY_ENV, raising=False)
    assert load_keys(None, ["ipc:///tmp/x.ipc", "tcp://127.0.0.1:5555", "tcp://localhost:1", None]) is None
    for exposed in ("tcp://*:5551", "tcp://0.0.0.0:5551", "tcp://scheduler:5554", "tcp://10.0.0.2:1"):
        with pytest.raises(SystemExit, match="refusing to start.*pagedserve keygen"):
            load_keys(None, ["ipc:///tmp/x.ipc", exposed])
    monkeypatch.setenv(SECRET_KEY_ENV, ours.secret.decode())
    assert load_keys(None, ["tcp://*:5551"]) == ours  # the public key derived from the secret
    monkeypatch.setenv(SECRET_KEY_ENV, "not a key")
    with pytest.raises(SystemExit, match="not a Z85 CURVE secret key"):
        load_keys(None, ["tcp://*:5551"])
    (tmp_path / "public.key").write_text(f'curve\n    public-key = "{ours.public.decode()}"\n')
    with pytest.raises(SystemExit, match="holds only a public key"):
        load_keys(str(tmp_path / "public.key"), [])
    with pytest.raises(SystemExit, match="cannot read the CURVE key file"):
        load_keys(str(tmp_path / "missing"), [])


def fake_dns(monkeypatch, names: dict[str, list[str]]) -> None:
    """getaddrinfo answers these names as a resolver would; others resolve as usual."""
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        if host not in names:
            return real(host, *args, **kw)
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in names[host]]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_every_endpoint_is_parsed_and_resolved_before_it_counts_as_loopback(monkeypatch):
    fake_dns(monkeypatch, {"127.0.0.1.evil.com": ["10.0.0.2"], "half.example": ["127.0.0.1", "10.0.0.3"],
                           "lo-only.example": ["127.0.0.1", "::1"]})
    local = ["ipc:///tmp/x.ipc", "inproc://steps", "tcp://127.0.0.1:1", "tcp://127.0.0.2:1", "tcp://127.1:1",
             "tcp://localhost:1", "tcp://[::1]:1", "tcp://[::ffff:127.0.0.1]:1", "tcp://127.0.0.1:*",
             "tcp://lo-only.example:1", "tcp://127.0.0.1:1,tcp://[::1]:2", "ipc:///a.ipc, tcp://127.0.0.1:2",
             "tcp://10.0.0.9:0;127.0.0.1:5"]  # source;destination: only the destination is reached
    exposed = ["tcp://127.0.0.1:1,tcp://10.0.0.2:2", "tcp://[::1]:1,tcp://*:2", "tcp://127.0.0.1.evil.com:1",
               "tcp://half.example:1", "tcp://0.0.0.0:1", "tcp://[::]:1", "tcp://*:1", "tcp://[2001:db8::1]:1",
               "tcp://127.0.0.1;10.0.0.2:5", "tcp://no-such-host.invalid:1", "tcp://127.0.0.1", "tcp://:1",
               "udp://127.0.0.1:1", "ws://127.0.0.1:1", "127.0.0.1:1", "tcp://10.0.0.2@127.0.0.1:1"]
    assert [a for a in local if is_exposed(a)] == []
    assert [a for a in exposed if not is_exposed(a)] == []
    monkeypatch.delenv("PAGEDSERVE_CURVE_KEY_FILE", raising=False)
    monkeypatch.delenv(SECRET_KEY_ENV, raising=False)
    with pytest.raises(SystemExit, match="refusing to start.*10.0.0.2"):
        load_keys(None, ["tcp://127.0.0.1:1,tcp://10.0.0.2:2"])


def test_a_plain_socket_refuses_a_network_address(contexts):
    ctx = contexts()  # no keys
    with pytest.raises(CurveKeyError, match="refusing a plain socket on tcp://0.0.0.0"):
        PullSocket(ctx, f"tcp://0.0.0.0:{free_port()}", StatusToGateway)
    PullSocket(ctx, f"tcp://127.0.0.1:{free_port()}", StatusToGateway)  # loopback stays plain


def test_keygen_creates_the_secret_0600_with_no_window(tmp_path, monkeypatch):
    """The secret file is never readable by others, even for an instant: created 0600 (under
    a umask that would leave it world-readable), its directory 0700, and never chmod-ed after."""
    chmods = []
    monkeypatch.setattr(os, "chmod", lambda *a, **kw: chmods.append(a))
    real_open = os.open
    modes_at_creation = {}

    def watching_open(path, flags, mode=0o777, *a, **kw):
        fd = real_open(path, flags, mode, *a, **kw)
        modes_at_creation[os.path.basename(path)] = stat.S_IMODE(os.fstat(fd).st_mode)
        return fd

    monkeypatch.setattr(os, "open", watching_open)
    old_umask = os.umask(0)
    try:
        public, secret = keygen(str(tmp_path / "new" / "keys"))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert modes_at_creation.get("pagedserve.key_secret") == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "new" / "keys").st_mode) == 0o700
    assert chmods == []
    assert CurveKeys.from_file(secret).public == zmq.auth.load_certificate(public)[0]
    with pytest.raises(SystemExit, match="exists: keygen never overwrites"):
        keygen(str(tmp_path / "new" / "keys"))
    assert CurveKeys.from_file(secret).public == zmq.auth.load_certificate(public)[0]  # the pair is untouched


def test_a_stage_on_a_network_address_without_a_key_refuses_to_start():
    env = {k: "" for k in ("PAGEDSERVE_CURVE_KEY_FILE", SECRET_KEY_ENV)}
    port = free_port()
    result = pagedserve("stage", "scheduler", "--scheduler-in", f"tcp://0.0.0.0:{port}", "--executor-in",
                        f"tcp://0.0.0.0:{port + 1}", "--executor-out", f"tcp://0.0.0.0:{port + 2}",
                        "--status", "ipc:///tmp/nowhere.ipc", "--tokenizer-in", "ipc:///tmp/a.ipc",
                        "--gateway-in", "ipc:///tmp/b.ipc", env=env)
    assert result.returncode != 0
    assert "refusing to start" in result.stderr and "pagedserve keygen" in result.stderr


def test_a_gateway_whose_requests_could_exceed_the_message_bound_refuses_to_start(tmp_path):
    result = pagedserve("stage", "gateway", "--max-request-bytes", str(1 << 30),
                        *Addresses.ipc(str(tmp_path)).as_argv())
    assert result.returncode != 0
    assert "--max-request-bytes" in result.stderr and "PAGEDSERVE_MAX_MESSAGE_BYTES" in result.stderr

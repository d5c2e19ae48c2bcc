"""Typed ZeroMQ sockets: the only place that touches zmq or encodes a frame.

Each wrapper is built with the message type (usually a channel's tagged union) it
carries; `send` encodes with msgpack and `recv` decodes only into that type. A frame
that fails to decode is logged and dropped, so garbage on a socket never kills a
stage. Sockets bind or connect by address (ipc:// or tcp://).

Every socket is made by `_open` with the settings of its context (`configure`):
ZMQ_MAXMSGSIZE, so a peer that sends a frame larger than any legal message is
disconnected (the frame never reaches memory) while the socket serves the others; and,
when the context has CURVE keys (`shared.curve`), CURVE on every socket: binders are
servers whose ZAP handler admits only clients holding the deployment's key, connecters
are clients of the same key. Without keys sockets are plain, and only on addresses
`shared.curve.is_exposed` proves local (ipc://, inproc://, tcp:// resolving to loopback).

`KVEventPublisher` is the one socket for readers outside the deployment (KV-aware routers
that speak vLLM's KV events, `shared.kv_events`): never CURVE, since they do not hold the key,
and so only on a local address unless the operator allows the network explicitly.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils import z85

from shared.curve import CurveKeyError, CurveKeys, is_exposed

T = TypeVar("T")
log = logging.getLogger(__name__)

# The largest legal messages are an ExecuteStep (max batched tokens plus, for each of up
# to 256 sequences, a block table of max_model_len / block_size ints: about 10 MiB at a
# 128k context) and a GenerateRequest within the gateway's 4 MiB body limit (msgpack is
# no larger than the JSON it came from). 64 MiB leaves room above both.
MAX_MESSAGE_BYTES = int(os.environ.get("PAGEDSERVE_MAX_MESSAGE_BYTES", 64 << 20))
ZAP_DOMAIN = b"pagedserve"


@dataclass(frozen=True)
class SocketSettings:
    curve: CurveKeys | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES


# by the context's underlying pointer, each with the context it was made for (see _current)
_settings: dict[int, tuple[weakref.ref, SocketSettings]] = {}
_zap: dict[int, tuple[weakref.ref, _ZapHandler]] = {}
_zap_lock = threading.Lock()


def configure(ctx: zmq.Context, curve: CurveKeys | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES):
    """Every socket later opened on ctx gets these settings; returns ctx."""
    _settings[ctx.underlying] = (weakref.ref(ctx), SocketSettings(curve, max_message_bytes))
    return ctx


def _current(table: dict, ctx: zmq.Context):
    """table's entry for ctx, or None. libzmq gives the next context it makes the address of the
    last one destroyed, so an entry made for a context since closed is dropped here: a plain
    context must not inherit a destroyed one's CURVE settings (its ROUTER would then wait for a
    handshake its plain peers never make: a test run saw a stand-in tokenizer never connect)."""
    entry = table.get(ctx.underlying)
    if entry is None:
        return None
    owner, value = entry
    configured = owner()
    if configured is None or configured.closed:
        del table[ctx.underlying]
        return None
    return value


class _ZapHandler(threading.Thread):
    """Answers the ZAP requests of one context: a CURVE client is let in only when its
    public key is the deployment's (so it holds the secret key). Ends with its context."""

    def __init__(self, ctx: zmq.Context, allowed_public: bytes):
        super().__init__(name="zap", daemon=True)
        self._allowed = z85.decode(allowed_public)
        self._sock = zmq.Context.shadow(ctx.underlying).socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("inproc://zeromq.zap.01")
        self.denied = 0

    def run(self) -> None:
        try:
            while True:
                frames = self._sock.recv_multipart()
                version, request_id, _domain, address, _identity, mechanism = frames[:6]
                ok = mechanism == b"CURVE" and frames[6:7] == [self._allowed]
                if not ok:
                    self.denied += 1
                    log.warning("refused a peer from %s without the deployment's CURVE key",
                                address.decode(errors="replace"))
                self._sock.send_multipart([version, request_id, b"200" if ok else b"400",
                                           b"OK" if ok else b"unknown key", b"", b""])
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(linger=0)


def _zap_handler(ctx: zmq.Context, keys: CurveKeys) -> _ZapHandler:
    with _zap_lock:
        handler = _current(_zap, ctx)
        if handler is None or not handler.is_alive():
            handler = _ZapHandler(ctx, keys.public)
            _zap[ctx.underlying] = (weakref.ref(ctx), handler)
            handler.start()
        return handler

SENT, BUSY, GONE = "sent", "busy", "gone"  # what RouterSocket.try_send did

_encoder = msgspec.msgpack.Encoder()


class FrameDecoder(Generic[T]):
    """Decodes frames into one declared type; anything else is counted, logged and dropped."""

    def __init__(self, msg_type: type[T], where: str):
        self._decoder = msgspec.msgpack.Decoder(msg_type)
        self.where = where
        self.dropped = 0

    def decode(self, frame: bytes) -> T | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.dropped += 1
            log.warning("dropped malformed frame on %s: %s", self.where, exc)
            return None


def _open(ctx: zmq.Context, kind: int, address: str, bind: bool, opts: dict | None = None) -> zmq.Socket:
    settings = _current(_settings, ctx) or SocketSettings()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
    keys = settings.curve
    if keys is None and is_exposed(address):  # stages refuse at start; this keeps any other socket honest
        raise CurveKeyError(f"refusing a plain socket on {address}: it can be reached from the network; "
                            "configure the context with the deployment's CURVE keys")
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        if bind:
            _zap_handler(ctx, keys)  # before the first peer can knock
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    for opt, value in (opts or {}).items():
        sock.setsockopt(opt, value)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class _Typed(Generic[T]):
    def __init__(
        self, ctx: zmq.Context, kind: int, address: str, msg_type: type[T], *, bind: bool, opts=None
    ):
        self.address = address
        self.sock = _open(ctx, kind, address, bind, opts)
        self.decoder = FrameDecoder(msg_type, address)

    @property
    def dropped(self) -> int:
        return self.decoder.dropped

    def _decode(self, frame: bytes) -> T | None:
        return self.decoder.decode(frame)

    def close(self) -> None:
        self.sock.close(linger=0)


class PushSocket(_Typed[T]):
    def __init__(self, ctx: zmq.Context, address: str, msg_type: type[T], *, bind: bool = False):
        super().__init__(ctx, zmq.PUSH, address, msg_type, bind=bind)

    def send(self, msg: T) -> None:
        self.sock.send(_encoder.encode(msg), copy=False)

    def send_nowait(self, msg: T) -> bool:
        """False when no peer can take the message now (it is dropped)."""
        try:
            self.sock.send(_encoder.encode(msg), zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False


class PullSocket(_Typed[T]):
    def __init__(self, ctx: zmq.Context, address: str, msg_type: type[T], *, bind: bool = True):
        super().__init__(ctx, zmq.PULL, address, msg_type, bind=bind)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Next well-formed message, or None when timeout_ms passes without one."""
        while True:
            if timeout_ms is not None and not self.sock.poll(timeout_ms):
                return None
            msg = self._decode(self.sock.recv(copy=True))
            if msg is not None:
                return msg

    def recv_nowait(self) -> list[T]:
        """Every message already queued, without blocking."""
        out = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self._decode(frame)
            if msg is not None:
                out.append(msg)


# HANDOVER: a peer that restarts under the same identity takes its name back at once.
_ROUTER_OPTS = {zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1}


class RouterSocket(_Typed[T]):
    """Bound end of a two-way channel with many peers; replies go to a named peer."""

    def __init__(
        self, ctx: zmq.Context, address: str, recv_type: type[T], send_type: type, *, bind: bool = True
    ):
        super().__init__(ctx, zmq.ROUTER, address, recv_type, bind=bind, opts=_ROUTER_OPTS)
        self._unreachable: set[bytes] = set()  # warned about once, until they answer again

    def send(self, peer: bytes, msg) -> bool:
        """False when the peer is gone or its queue is full (the message is dropped, the
        caller decides)."""
        result = self.try_send(peer, msg)
        if result == BUSY and peer not in self._unreachable:
            self._unreachable.add(peer)
            log.warning("peer %r queue full on %s; dropping what is sent to it", peer, self.address)
        return result == SENT

    def try_send(self, peer: bytes, msg) -> str:
        """SENT; BUSY when the peer's queue is full (nothing sent: retry later); GONE when
        no such peer is connected (the message is dropped)."""
        try:
            self.sock.send_multipart([peer, _encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.Again:
            return BUSY
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            if peer not in self._unreachable:
                self._unreachable.add(peer)
                log.warning("peer %r unreachable on %s; dropping what is sent to it", peer, self.address)
            return GONE
        self._unreachable.discard(peer)
        return SENT

    def recv_nowait(self) -> list[tuple[bytes, T]]:
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 2:
                self.decoder.dropped += 1
                log.warning("dropped frame with %d parts on %s", len(frames), self.address)
                continue
            msg = self._decode(frames[1])
            if msg is not None:
                out.append((frames[0], msg))


class DealerSocket(_Typed[T]):
    """Connecting end of a two-way channel; identity names this peer to the router."""

    def __init__(
        self, ctx: zmq.Context, address: str, recv_type: type[T], identity: str, *, bind: bool = False
    ):
        super().__init__(
            ctx, zmq.DEALER, address, recv_type, bind=bind, opts={zmq.IDENTITY: identity.encode()}
        )

    def send(self, msg) -> None:
        self.sock.send(_encoder.encode(msg), copy=False)

    def recv(self, timeout_ms: int | None = None) -> T | None:
        return PullSocket.recv(self, timeout_ms)  # type: ignore[arg-type]

    def recv_nowait(self) -> list[T]:
        return PullSocket.recv_nowait(self)  # type: ignore[arg-type]


class AsyncRouterSocket(RouterSocket):
    """A RouterSocket on an asyncio context, for sending to named peers only: its sends
    never wait (a full or missing peer is reported), so it needs no awaiting."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, send_type: type, *, bind: bool = True):
        self.address = address
        self._owner = _open(ctx, zmq.ROUTER, address, bind, _ROUTER_OPTS)  # the context closes it
        self.sock = zmq.Socket.shadow(self._owner.underlying)  # plain calls on the same socket
        self.decoder = FrameDecoder(send_type, address)
        self._unreachable: set[bytes] = set()

    def close(self) -> None:
        self._owner.close(linger=0)


class AsyncPullSocket(Generic[T]):
    """A PULL socket read from an asyncio loop.

    The loop watches the socket's file descriptor (`add_reader`) and each wake-up drains
    every queued frame with plain non-blocking calls into a local queue, which `recv`
    pops. zmq.asyncio's own `recv` makes a future and re-arms its poller per message:
    ~125 µs of CPU a message against ~45 µs this way, measured one message at a time on
    the 2-core host, and the gateway reads one message per step of every engine.
    """

    DRAIN_BATCH = 256  # frames per wake-up before the loop serves other callbacks
    KIND = zmq.PULL

    def __init__(self, ctx: zmq.asyncio.Context, address: str, msg_type: type[T], *, bind: bool = True,
                 opts: dict | None = None):
        self.address = address
        self._owner = _open(ctx, self.KIND, address, bind, opts)  # the context closes it
        self.sock = zmq.Socket.shadow(self._owner.underlying)  # plain calls on the same socket
        self.decoder = FrameDecoder(msg_type, address)
        self._queue: deque[T] = deque()
        self._waiter: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = self.sock.getsockopt(zmq.FD)
        self._closed = False

    async def recv(self) -> T:
        while not self._queue:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._loop.add_reader(self._fd, self._drain)
                self._drain()  # frames that came before the reader was added
                continue
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._queue.popleft()

    def _drain(self) -> None:
        # The descriptor only says the socket's state changed (edge-triggered): read until
        # EAGAIN, or come back at once when a batch was cut short.
        if self._closed:
            return
        for _ in range(self.DRAIN_BATCH):
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self.decoder.decode(frame)
            if msg is not None:
                self._queue.append(msg)
        else:
            self._loop.call_soon(self._drain)
        if self._queue and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._owner.close(linger=0)


class AsyncDealerSocket(AsyncPullSocket[T]):
    """The connecting end of a two-way channel, on an asyncio loop: read as AsyncPullSocket
    reads, and sends that never wait. identity names this peer to the router."""

    KIND = zmq.DEALER
    SEND_HWM = 100_000  # messages queued for the peer (a restarting scheduler) before sends fail

    def __init__(self, ctx: zmq.asyncio.Context, address: str, recv_type: type[T], identity: str):
        super().__init__(ctx, address, recv_type, bind=False,
                         opts={zmq.IDENTITY: identity.encode(), zmq.SNDHWM: self.SEND_HWM})

    def send_nowait(self, msg) -> bool:
        """False when the peer's queue is full (the message is dropped: the caller decides)."""
        try:
            self.sock.send(_encoder.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        # The descriptor is edge-triggered and a send may take the edge that said frames
        # came in: look, and drain them now, or they would wait for the next frame.
        if self._loop is not None and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._loop.call_soon(self._drain)
        return True


class KVEventPublisher:
    """KV cache event batches on a PUB socket, framed as vLLM frames them: [topic, sequence
    number (8 bytes big-endian, from 0), msgpack payload]. Sends never wait: a subscriber
    that falls more than `hwm` messages behind loses batches, and sees the gap in the numbers.

    With replay_endpoint, a ROUTER socket there answers a request for the batches from a
    sequence number on (a REQ or DEALER peer sends the number as 8 bytes big-endian): each
    of the last `buffer_batches` batches from it as [sequence number, payload], then
    [-1 as 8 bytes, b""] to mark the end. `serve_replay` answers the requests waiting.

    connect: the PUB socket connects to endpoint (a subscriber that binds, as llm-d's
    indexer does) instead of binding it. An address reachable from the network is refused
    (CurveKeyError) unless allow_network: the events carry the prompts' token ids in clear.
    """

    REPLAY_END = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, ctx: zmq.Context, endpoint: str, *, replay_endpoint: str = "", topic: str = "",
                 connect: bool = False, allow_network: bool = False, buffer_batches: int = 10_000,
                 hwm: int = 100_000):
        for address in (endpoint, replay_endpoint):
            if address and not allow_network and is_exposed(address):
                raise CurveKeyError(f"refusing KV events on {address}: it can be reached from the network and "
                                    "the events carry prompts' token ids in clear (--kv-events-allow-network "
                                    "to publish there anyway)")
        self.endpoint, self.topic = endpoint, topic.encode()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, hwm)
        self.replay: zmq.Socket | None = None
        try:
            (self.pub.connect if connect else self.pub.bind)(endpoint)
            if replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.setsockopt(zmq.MAXMSGSIZE, 256)  # a request is one 8-byte number
                self.replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.next_seq = 0
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)  # for replay

    def publish(self, batch) -> int:
        """Send one batch (a `shared.kv_events.KVEventBatch`); returns its sequence number."""
        seq, payload = self.next_seq, _encoder.encode(batch)
        self.next_seq += 1
        try:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            pass  # a PUB socket drops for slow subscribers itself; this never waits either
        self._sent.append((seq, payload))
        return seq

    def serve_replay(self) -> int:
        """Answer every replay request waiting, without blocking; returns how many."""
        answered = 0
        while self.replay is not None:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("dropped a malformed KV events replay request (%d frames)", len(frames))
                continue
            peer, start = frames[0], int.from_bytes(frames[2], "big")
            try:
                for seq, payload in self._sent:
                    if seq >= start:
                        self.replay.send_multipart([peer, b"", seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
                self.replay.send_multipart([peer, b"", self.REPLAY_END, b""], zmq.NOBLOCK)
            except zmq.Again:
                log.warning("KV events replay: the peer's queue is full; the rest of its replay is dropped")
            answered += 1
        return answered

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def wait_readable(sockets: list[_Typed], timeout_ms: int) -> list[_Typed]:
    """The sockets among `sockets` that have a message waiting, after at most timeout_ms."""
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s.sock, zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    return [s for s in sockets if s.sock in ready]

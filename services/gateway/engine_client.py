"""The gateway's side of the pipeline: send requests down, route the replies to their waiters.

Each request in flight is a RequestStream with its own asyncio.Queue. One reader task
takes every message from gateway_in and puts it on its request's queue; messages for a
request nobody waits for any more are dropped. A request left before its last message
(client gone, timeout, handler cancelled, a stage lost) sends an AbortRequest, so the
stages free what they hold for it; with n > 1 choices, the last message is the one that
finishes the last choice. A queue holds at most `max_buffered` messages: a handler that
falls that far behind (its client stopped reading) has its request aborted at once.

Routing (`routing.TokenizerRouter`): each request goes to a live tokenizer replica the
gateway picks, its aborts to that same replica (or, when it is lost, through another).
An abort no replica can take (all of them down or restarting) waits in a bounded queue
(MAX_PENDING_ABORTS, oldest dropped first) and goes out as soon as one is live
(`run_upkeep`), so the scheduler never keeps generating for a request nobody reads.
Every request names this gateway's INSTANCE_ID, and `run_upkeep` sends a GatewayBeat
to every live replica each GATEWAY_BEAT_S: when this process dies, the replicas abort
its requests (`services.scheduler.gateway_watch`).

Recovery: a tokenizer replica acknowledges each request it takes (RequestAccepted, with
its instance id). When the watchdog finds a replica dead, its requests, and those no
replica has acknowledged yet, are sent again under a new pipeline id (the old one is
aborted); `Replay` hides what the client already has. A restarted scheduler lost every
request it had: all the requests in flight are sent again the same way. Only a
scheduler gone for good (see the watchdog) ends them with a 503 error. With several
engines (data parallelism) the tokenizer replica says which engine took each request
(RequestRouted); when one engine restarts or is lost, only its requests are sent again,
and the tokenizer replicas route them to the engines still serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq.asyncio

from services.gateway.replay import Replay, ReplayDiverged
from services.gateway.routing import TokenizerRouter
from shared.config import Addresses
from shared.heartbeat import INSTANCE_ID
from shared.messages import (
    AbortRequest,
    DetokenizeRequest,
    EngineLoads,
    GatewayBeat,
    GatewayToTokenizer,
    GenerateRequest,
    RequestAccepted,
    RequestError,
    RequestRouted,
    TextDelta,
    TokenizeRequest,
    TokenizeResult,
    TokenizerToGateway,
    WatchPool,
)
from shared.transport import AsyncPullSocket, AsyncRouterSocket

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 5  # a request is sent at most this many times
DEFAULT_MAX_BUFFERED = 1024  # messages waiting for one request's handler
MAX_PENDING_ABORTS = 10_000  # aborts waiting for a live tokenizer replica
UPKEEP_S = 0.05  # how often pending aborts are tried again
GATEWAY_BEAT_S = 0.5  # well inside the replicas' GATEWAY_LOST_AFTER_S


class EngineError(Exception):
    """The request ended with a RequestError (from the pipeline or from the gateway)."""

    def __init__(self, err: RequestError):
        super().__init__(err.message)
        self.err = err


class RequestTimeout(Exception):
    pass


class _Retry:
    """Queued to a stream whose tokenizer replica, or the scheduler, died."""

    def __init__(self, stage: str):
        self.stage = stage


class _Lost:
    """Queued to a stream whose request a lost stage took with it."""

    def __init__(self, message: str):
        self.message = message


_RETRY = _Retry("tokenizer replica")


def unavailable(request_id: str, message: str) -> RequestError:
    return RequestError(request_id, 503, message, error_type="service_unavailable")


class EngineClient:
    def __init__(self, ctx: zmq.asyncio.Context, addrs: Addresses, *, replicas: Callable[[], list[str]],
                 on_retry: Callable[[], None] = lambda: None, max_buffered: int = DEFAULT_MAX_BUFFERED,
                 on_routed: Callable[[str], None] = lambda engine: None):
        """replicas: the names of the live tokenizer replicas, asked before each send."""
        self.max_buffered = max_buffered
        self._to_tokenizer = TokenizerRouter(AsyncRouterSocket(ctx, addrs.tokenizer_in, GatewayToTokenizer), replicas)
        self._from_tokenizer = AsyncPullSocket(ctx, addrs.gateway_in, TokenizerToGateway, bind=True)
        self._streams: dict[str, RequestStream] = {}  # by pipeline id
        self._calls: dict[str, asyncio.Future] = {}  # one-shot requests (/tokenize, /detokenize) by id
        self.on_retry = on_retry
        self.on_routed = on_routed
        self.instance = INSTANCE_ID
        self._pending_aborts: deque[tuple[str, str | None]] = deque()  # (pipeline id, replica)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests admitted that have not produced a token yet: the waiting queue."""
        return sum(1 for s in self._streams.values() if not s.started)

    async def run_reader(self) -> None:
        while True:
            try:
                msg = await self._from_tokenizer.recv()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading gateway_in failed")
                await asyncio.sleep(0.1)
                continue
            call = self._calls.pop(msg.request_id, None)
            if call is not None:
                if not call.done():
                    call.set_result(msg)
                continue
            stream = self._streams.get(msg.request_id)
            if stream is None:
                continue
            if isinstance(msg, RequestAccepted):
                stream.owner = msg.instance
            elif isinstance(msg, RequestRouted):
                stream.engine = msg.engine
                self.on_routed(msg.engine)
            elif stream.queue.qsize() >= self.max_buffered:
                self._overflow(stream)
            else:
                stream.queue.put_nowait(msg)

    def _overflow(self, stream: RequestStream) -> None:
        log.warning("%s: the client does not read fast enough; aborting it", stream.request_id)
        self._streams.pop(stream.pipeline_id, None)
        self.abort(stream.pipeline_id, stream.sent_to)
        stream.done = True  # aborted here: nothing left to abort on exit
        stream.queue.put_nowait(RequestError(
            stream.request_id, 408, "The client did not read the response fast enough; the request was aborted.",
            error_type="timeout_error"))

    async def call(self, msg: TokenizeRequest | DetokenizeRequest, timeout_s: float) -> TokenizeResult:
        """A one-shot request to any tokenizer replica and its answer (EngineError for a
        RequestError, RequestTimeout past timeout_s)."""
        answer = asyncio.get_running_loop().create_future()
        self._calls[msg.request_id] = answer
        try:
            await asyncio.wait_for(self._to_tokenizer.send(msg), timeout_s)
            reply = await asyncio.wait_for(answer, timeout_s)
        except TimeoutError as exc:
            raise RequestTimeout from exc
        finally:
            self._calls.pop(msg.request_id, None)
        if isinstance(reply, RequestError):
            raise EngineError(reply)
        return reply

    def open(self, request: GenerateRequest, timeout_s: float) -> RequestStream:
        request = msgspec.structs.replace(request, gateway_instance=self.instance)
        return RequestStream(self, request, time.monotonic() + timeout_s)

    def abort(self, request_id: str, replica: str | None = None) -> None:
        """To the replica that has the request (else any live one); never waits, so it
        works from a handler that is being cancelled. With no replica to take it, it waits
        for one (`run_upkeep`)."""
        if self._to_tokenizer.send_nowait(AbortRequest(request_id), prefer=replica) is None:
            if len(self._pending_aborts) >= MAX_PENDING_ABORTS:
                dropped, _ = self._pending_aborts.popleft()
                log.error("%s: %d aborts wait for a tokenizer replica; dropping the oldest", dropped,
                          MAX_PENDING_ABORTS)
            elif not self._pending_aborts:
                log.warning("%s: no tokenizer replica can take its abort now; it waits for one", request_id)
            self._pending_aborts.append((request_id, replica))

    @property
    def num_pending_aborts(self) -> int:
        return len(self._pending_aborts)

    def flush_aborts(self) -> int:
        """Send the waiting aborts, oldest first, while a replica takes them; how many went."""
        sent = 0
        while self._pending_aborts:
            request_id, replica = self._pending_aborts[0]
            if self._to_tokenizer.send_nowait(AbortRequest(request_id), prefer=replica) is None:
                break
            self._pending_aborts.popleft()
            sent += 1
        if sent:
            log.info("%d waiting aborts sent (%d still wait)", sent, len(self._pending_aborts))
        return sent

    async def run_upkeep(self) -> None:
        """Pending aborts out as soon as a replica is live; a GatewayBeat every GATEWAY_BEAT_S."""
        beat = GatewayBeat(self.instance)
        next_beat = 0.0
        while True:
            if self._pending_aborts:
                self.flush_aborts()
            now = time.monotonic()
            if now >= next_beat:
                self._to_tokenizer.broadcast(beat)
                next_beat = now + GATEWAY_BEAT_S
            await asyncio.sleep(UPKEEP_S)

    async def watch_pool(self, msg: WatchPool) -> None:
        """A dashboard's subscription, down the pipeline to the scheduler (blocks while no
        tokenizer replica is connected)."""
        await self._to_tokenizer.send(msg)

    def replica_lost(self, instance: str) -> int:
        """Retry the requests of a dead tokenizer replica, and the unacknowledged ones."""
        hit = [s for s in self._streams.values() if s.sent and s.owner in (instance, None)]
        for stream in hit:
            stream.interrupt(_RETRY)
        return len(hit)

    def scheduler_restarted(self, engine: str | None = None) -> int:
        """A new scheduler instance knows none of the requests in flight: send them again
        (with several engines, those of its engine and those not routed yet)."""
        hit = [s for s in self._streams.values() if s.sent and s.engine in (engine, None)]
        for stream in hit:
            stream.interrupt(_Retry("scheduler"))
        return len(hit)

    def engine_lost(self, engine: str) -> int:
        """An engine stopped serving while others serve: its requests go to them."""
        hit = [s for s in self._streams.values() if s.sent and s.engine == engine and not s.interrupted]
        for stream in hit:
            stream.interrupt(_Retry(f"engine {engine}"))
        return len(hit)

    def broadcast(self, msg: EngineLoads) -> None:
        """To every live tokenizer replica, without waiting (a full one misses this one)."""
        self._to_tokenizer.broadcast(msg)

    def scheduler_lost(self, message: str) -> int:
        streams = list(self._streams.values())
        for stream in streams:
            stream.interrupt(_Lost(message))
        return len(streams)

    def close(self) -> None:
        self._to_tokenizer.close()
        self._from_tokenizer.close()


class RequestStream:
    """`async with client.open(req, timeout) as stream`: then `await stream.next()`."""

    def __init__(self, client: EngineClient, request: GenerateRequest, deadline: float):
        self._client = client
        self._request = request
        self._deadline = deadline
        self.request_id = request.request_id  # the client's; pipeline_id changes per attempt
        self.pipeline_id = request.request_id
        self.attempt = 0
        self.queue: asyncio.Queue = asyncio.Queue()
        self.owner: str | None = None  # instance of the tokenizer replica that took it
        self.sent_to: str | None = None  # the name of the replica it was sent to
        self.engine: str | None = None  # the engine it runs on, once a replica routed it
        self.sent = False
        self.started = False  # a token came back
        self.done = False  # the last message arrived: nothing to abort
        self._unfinished = set(range(request.params.n))  # choices still running
        self._interrupted = False  # this attempt already has a retry or a loss queued
        self._replay = Replay(request.params)

    async def __aenter__(self) -> RequestStream:
        self._client._streams[self.pipeline_id] = self
        try:
            await self._send()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self._client._streams.pop(self.pipeline_id, None)
        if not self.done:
            self._client.abort(self.pipeline_id, self.sent_to)

    async def _send(self) -> None:
        request = self._request
        if self.attempt:
            request = msgspec.structs.replace(request, request_id=self.pipeline_id)
        try:
            # Waits while no tokenizer replica can take it; the deadline still holds.
            self.sent_to = await asyncio.wait_for(self._client._to_tokenizer.send(request), self._remaining())
        except TimeoutError as exc:
            raise RequestTimeout from exc
        self.sent = True

    @property
    def interrupted(self) -> bool:
        return self._interrupted

    def interrupt(self, item: _Retry | _Lost) -> None:
        if not self._interrupted and not self.done:
            self._interrupted = True
            self.queue.put_nowait(item)

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout
        return remaining

    async def next(self) -> TextDelta:
        """The next TextDelta; raises EngineError for an error, RequestTimeout past the deadline."""
        while True:
            remaining = self._remaining()
            try:  # no task per token (as wait_for makes) when the delta is already queued
                msg = self.queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(remaining):
                        msg = await self.queue.get()
                except TimeoutError as exc:
                    raise RequestTimeout from exc
            if isinstance(msg, _Retry):
                await self._retry(msg.stage)
                continue
            if isinstance(msg, _Lost):
                raise EngineError(unavailable(self.request_id, msg.message))  # not done: aborted on exit
            if isinstance(msg, RequestError):
                self.done = True
                raise EngineError(msg)
            self.started = True
            try:
                delta = self._replay.filter(msg)
            except ReplayDiverged as exc:
                raise EngineError(unavailable(
                    self.request_id, "The request was restarted after a tokenizer replica failed, and the "
                    "restarted run diverged from the output already sent; please retry.")) from exc
            if delta is None:
                continue
            if delta.finish_reason is not None:
                self._unfinished.discard(delta.seq_index)
                self.done = not self._unfinished
            return delta

    async def _retry(self, stage: str) -> None:
        if self.attempt + 1 >= MAX_ATTEMPTS or not self._replay.can_restart():
            why = ("it failed too often" if self._replay.can_restart()
                   else "part of a sampled answer without a seed was already sent")
            raise EngineError(unavailable(
                self.request_id, f"The {stage} serving this request failed and the request "
                f"cannot be restarted: {why}. Please retry."))
        log.warning("%s: %s lost; sending the request again", self.request_id,
                    f"tokenizer replica {self.owner}" if stage == "tokenizer replica" else stage)
        self._client._streams.pop(self.pipeline_id, None)
        self._client.abort(self.pipeline_id, self.sent_to)
        self.attempt += 1
        self.pipeline_id = f"{self.request_id}-retry{self.attempt}"
        self.queue = asyncio.Queue()
        self.owner, self.engine, self.sent, self._interrupted = None, None, False, False
        self._replay.restart()
        self._client._streams[self.pipeline_id] = self
        self._client.on_retry()
        await self._send()

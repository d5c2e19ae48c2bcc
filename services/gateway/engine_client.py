"""The gateway's side of the pipeline: send requests down, route the replies to their waiters.

Each request in flight owns an asyncio.Queue. One reader task takes every message from
gateway_in and puts it on its request's queue; messages for a request nobody waits for
any more are dropped. A request left before its last message (client gone, timeout,
handler cancelled) sends an AbortRequest, so the scheduler frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq.asyncio

from shared.config import Addresses
from shared.messages import (
    AbortRequest,
    GatewayToTokenizer,
    GenerateRequest,
    RequestError,
    TextDelta,
    TokenizerToGateway,
)
from shared.transport import AsyncPullSocket, AsyncPushSocket

log = logging.getLogger(__name__)

ABORT_SEND_TIMEOUT_S = 5.0


class EngineError(Exception):
    """The pipeline ended the request with a RequestError."""

    def __init__(self, err: RequestError):
        super().__init__(err.message)
        self.err = err


class RequestTimeout(Exception):
    pass


class EngineClient:
    def __init__(self, ctx: zmq.asyncio.Context, addrs: Addresses):
        self._to_tokenizer = AsyncPushSocket(ctx, addrs.tokenizer_in, GatewayToTokenizer, bind=True)
        self._from_tokenizer = AsyncPullSocket(ctx, addrs.gateway_in, TokenizerToGateway, bind=True)
        self._waiting: dict[str, asyncio.Queue] = {}
        self._aborts: set[asyncio.Task] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._waiting)

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
            queue = self._waiting.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)

    def open(self, request: GenerateRequest, timeout_s: float) -> RequestStream:
        return RequestStream(self, request, time.monotonic() + timeout_s)

    def abort(self, request_id: str) -> None:
        """Fire and forget: must work from a handler that is being cancelled."""
        send = self._to_tokenizer.send(AbortRequest(request_id))
        task = asyncio.get_running_loop().create_task(asyncio.wait_for(send, ABORT_SEND_TIMEOUT_S))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def close(self) -> None:
        self._to_tokenizer.close()
        self._from_tokenizer.close()


class RequestStream:
    """`async with client.open(req, timeout) as stream`: then `await stream.next()`."""

    def __init__(self, client: EngineClient, request: GenerateRequest, deadline: float):
        self._client = client
        self._request = request
        self._deadline = deadline
        self._queue: asyncio.Queue = asyncio.Queue()
        self.request_id = request.request_id
        self.done = False  # the last message arrived: nothing to abort

    async def __aenter__(self) -> RequestStream:
        self._client._waiting[self.request_id] = self._queue
        try:
            # Blocks while no tokenizer replica is connected; the deadline still holds.
            await asyncio.wait_for(self._client._to_tokenizer.send(self._request), self._remaining())
        except asyncio.TimeoutError as exc:
            await self.__aexit__()  # harmless if it never left
            raise RequestTimeout from exc
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc) -> None:
        self._client._waiting.pop(self.request_id, None)
        if not self.done:
            self._client.abort(self.request_id)

    def _remaining(self) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise RequestTimeout
        return remaining

    async def next(self) -> TextDelta:
        """The next TextDelta; raises EngineError for a RequestError, RequestTimeout past the deadline."""
        try:
            msg = await asyncio.wait_for(self._queue.get(), self._remaining())
        except asyncio.TimeoutError as exc:
            raise RequestTimeout from exc
        if isinstance(msg, RequestError):
            self.done = True
            raise EngineError(msg)
        if msg.finish_reason is not None:
            self.done = True
        return msg

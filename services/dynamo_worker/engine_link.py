"""The worker's pipe to its engine's scheduler, as a gateway's: one DEALER (identity
"gateway-dynamo-<INSTANCE_ID>") that carries requests, aborts and a GatewayBeat every
GATEWAY_BEAT_S (so the scheduler aborts our requests if this process dies), and brings
each step's deltas back, which go to the queue of their request.

A request's queue gets its TokenDeltas and a RequestError if it fails; `fail_all` puts a
RequestError in every queue (the scheduler restarted and lost them). Deltas of a request
nobody waits for any more that are not final get one abort back.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

import zmq.asyncio

from shared.heartbeat import INSTANCE_ID
from shared.messages import (
    AbortRequest,
    GatewayBeat,
    RequestError,
    SchedulerToGateway,
    StepDeltas,
    TokenDelta,
    TokenizedRequest,
)
from shared.transport import AsyncDealerSocket

log = logging.getLogger("pagedserve.dynamo_worker")

GATEWAY_BEAT_S = 0.5  # well inside the scheduler's GATEWAY_LOST_AFTER_S
MAX_ORPHANS = 4096


class EngineUnreachable(Exception):
    """The scheduler's queue is full: it has read nothing for a long while."""


class EngineLink:
    def __init__(self, ctx: zmq.asyncio.Context, scheduler_address: str):
        self.instance = f"dynamo-{INSTANCE_ID}"
        self._sock = AsyncDealerSocket(ctx, scheduler_address, SchedulerToGateway, f"gateway-{self.instance}")
        self._queues: dict[str, asyncio.Queue] = {}
        self._orphans: OrderedDict[str, None] = OrderedDict()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def submit(self, msg: TokenizedRequest) -> asyncio.Queue:
        """Send the request; its deltas come to the queue returned (until `release`)."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[msg.request_id] = queue
        if not self._sock.send_nowait(msg):
            del self._queues[msg.request_id]
            raise EngineUnreachable("the engine's scheduler takes no requests (its queue is full)")
        return queue

    def abort(self, request_id: str) -> None:
        """Stop the request at the scheduler and forget it."""
        self._queues.pop(request_id, None)
        self._sock.send_nowait(AbortRequest(request_id))

    def release(self, request_id: str) -> None:
        """The request ended: forget it."""
        self._queues.pop(request_id, None)

    def fail_all(self, message: str) -> int:
        queues = list(self._queues.items())
        for request_id, queue in queues:
            queue.put_nowait(RequestError(request_id, 503, message, error_type="service_unavailable"))
        return len(queues)

    async def run_reader(self) -> None:
        while True:
            try:
                msg = await self._sock.recv()
                for item in msg.deltas if isinstance(msg, StepDeltas) else [msg]:
                    self._on_message(item)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reading the scheduler's deltas failed")
                await asyncio.sleep(0.1)

    def _on_message(self, msg) -> None:
        queue = self._queues.get(msg.request_id)
        if queue is not None:
            queue.put_nowait(msg)
        elif isinstance(msg, TokenDelta) and msg.finish_reason is None and msg.request_id not in self._orphans:
            self._orphans[msg.request_id] = None
            if len(self._orphans) > MAX_ORPHANS:
                self._orphans.popitem(last=False)
            self._sock.send_nowait(AbortRequest(msg.request_id))

    async def run_beats(self) -> None:
        beat = GatewayBeat(self.instance)
        while True:
            self._sock.send_nowait(beat)
            await asyncio.sleep(GATEWAY_BEAT_S)

    def close(self) -> None:
        self._sock.close()

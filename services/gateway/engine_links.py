"""A tokenizer replica's links to the engines (data parallelism): one DEALER per scheduler.

`send` is the TokenizerStage's way to the scheduler: a new TokenizedRequest goes to the
engine the EngineRouter picks (and the gateway is told which, RequestRouted, so it can
send the request again if that engine is lost), at once or, when the router holds it
until a request sharing its prefix has been prefilled there, once `ready` lets it go (the
first output of each request is reported to the router as it passes through
`recv_nowait`; held requests are looked at on every send, receive, load report and
release). An aborted held request is dropped unsent. A FinishRequest or an AbortRequest goes
to the engine that owns its request, or to every engine when none is known (the request
finished here already: an engine that does not know it ignores it); a dashboard's
WatchPool goes to every engine. With one engine everything goes to it, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from services.gateway.engine_router import EngineRouter
from shared.messages import (
    AbortRequest,
    EngineLoads,
    FinishRequest,
    RequestRouted,
    SchedulerToTokenizer,
    StepDeltas,
    TokenizedRequest,
    TokenizerToScheduler,
)
from shared.transport import DealerSocket

log = logging.getLogger(__name__)


def engine_names(n: int) -> list[str]:
    return [f"engine-{i}" for i in range(n)]


class EngineLinks:
    def __init__(self, ctx: zmq.Context, scheduler_addresses: list[str], identity: str, policy: str,
                 to_gateway: Callable[[RequestRouted], None]):
        names = engine_names(len(scheduler_addresses))
        self.sockets = {name: DealerSocket(ctx, address, SchedulerToTokenizer, identity=identity)
                        for name, address in zip(names, scheduler_addresses, strict=True)}
        self.router = EngineRouter(names, policy)
        self._to_gateway = to_gateway
        self._held: dict[str, TokenizedRequest] = {}  # routed, not yet sent (see EngineRouter.held)

    @property
    def many(self) -> bool:
        return len(self.sockets) > 1

    def send(self, msg: TokenizerToScheduler) -> None:
        if not self.many:
            next(iter(self.sockets.values())).send(msg)
        elif isinstance(msg, TokenizedRequest):
            engine = self.router.route(msg.request_id, msg.prompt_token_ids, msg.params.cache_salt)
            self._to_gateway(RequestRouted(msg.request_id, engine))
            if self.router.held(msg.request_id):
                self._held[msg.request_id] = msg
            else:
                self.sockets[engine].send(msg)
            self._send_ready()
        elif isinstance(msg, FinishRequest | AbortRequest):
            engine = self.router.owner(msg.request_id)
            unsent = isinstance(msg, AbortRequest) and self._held.pop(msg.request_id, None) is not None
            if isinstance(msg, AbortRequest):
                self.router.release(msg.request_id)
            if not unsent:
                for name in [engine] if engine is not None else self.sockets:
                    self.sockets[name].send(msg)
            self._send_ready()
        else:  # WatchPool
            for sock in self.sockets.values():
                sock.send(msg)

    def update(self, loads: EngineLoads) -> None:
        self.router.update(loads)
        self._send_ready()

    def forget_finished(self, active: dict) -> None:
        """Release the requests the stage no longer holds (finished, failed, aborted)."""
        if self.many:
            for request_id in self.router.owned():
                if request_id not in active:
                    self._held.pop(request_id, None)
                    self.router.release(request_id)
            self._send_ready()

    def recv_nowait(self) -> list:
        """What the schedulers sent, a step's StepDeltas unpacked into its TokenDeltas."""
        out = []
        for sock in self.sockets.values():
            for msg in sock.recv_nowait():
                if isinstance(msg, StepDeltas):
                    out += msg.deltas
                else:
                    out.append(msg)
        if self.many:
            for msg in out:  # a first output: that request's prefill has run
                self.router.prefilled(msg.request_id)
            self._send_ready()
        return out

    def _send_ready(self) -> None:
        for request_id in self.router.ready():
            msg = self._held.pop(request_id, None)
            if msg is not None:
                self.sockets[self.router.owner(request_id)].send(msg)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()

"""The gateway's links to the engines: one DEALER per scheduler, and the choice of engine.

Every request the gateway passes on (a tokenizer replica's TokenizedRequest, or a resumed
one) goes to one engine: with one engine, that one; with several (data parallelism) the
one the EngineRouter picks, at once or, when the router holds it until a request sharing
its prefix has been prefilled there, once `ready` lets it go (the first output of each
request is reported, `prefilled`; held requests are looked at on every send, load report
and release). An aborted held request is dropped unsent. A request's abort and its stop
(FinishRequest) go to the engine that has it on the same pipe as the request itself, so
they never overtake it. GatewayBeat and WatchPool go to every engine.

Each DEALER's identity is "gateway-<INSTANCE_ID>": the schedulers send the tokens of this
gateway's requests back on it, one frame per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq.asyncio

from services.gateway.engine_router import EngineLoads, EngineRouter
from shared.messages import (
    AbortRequest,
    FinishRequest,
    GatewayBeat,
    SchedulerToGateway,
    TokenizedRequest,
    WatchPool,
)
from shared.transport import AsyncDealerSocket

log = logging.getLogger(__name__)


def engine_names(n: int) -> list[str]:
    return [f"engine-{i}" for i in range(n)]


class EngineUnreachable(Exception):
    """The engine's queue is full: its scheduler has read nothing for a long while."""


class EngineLinks:
    def __init__(self, ctx: zmq.asyncio.Context, scheduler_addresses: list[str], identity: str, policy: str,
                 on_routed: Callable[[str], None] = lambda engine: None):
        names = engine_names(len(scheduler_addresses))
        self.sockets = {name: AsyncDealerSocket(ctx, address, SchedulerToGateway, identity)
                        for name, address in zip(names, scheduler_addresses, strict=True)}
        self.router = EngineRouter(names, policy) if len(names) > 1 else None
        self.on_routed = on_routed
        self._owner: dict[str, str] = {}  # request id -> its engine, held requests included
        self._held: dict[str, TokenizedRequest] = {}  # routed, not sent yet (see EngineRouter.held)

    @property
    def engines(self) -> list[str]:
        return list(self.sockets)

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def submit(self, msg: TokenizedRequest) -> str:
        """Send msg to the engine chosen for it (or hold it there); that engine's name."""
        if self.router is None:
            engine = next(iter(self.sockets))
        else:
            engine = self.router.route(msg.request_id, msg.prompt_token_ids, msg.params.cache_salt,
                                       msg.params.lora and msg.params.lora.digest)
        self._owner[msg.request_id] = engine
        self.on_routed(engine)
        if self.router is not None and self.router.held(msg.request_id):
            self._held[msg.request_id] = msg
        else:
            self._send(engine, msg)
        self._send_ready()
        return engine

    def finish(self, msg: FinishRequest) -> None:
        """A stop string ended a choice: its engine ends that sequence."""
        engine = self._owner.get(msg.request_id)
        if engine is not None and msg.request_id not in self._held:
            self._send(engine, msg)

    def abort(self, request_id: str) -> None:
        """Stop the request wherever it is (a held one is dropped unsent) and forget it."""
        engine = self._owner.get(request_id)
        if engine is None:
            return
        if self._held.pop(request_id, None) is None:
            self.send_to(engine, AbortRequest(request_id))
        self.release(request_id)

    def release(self, request_id: str) -> None:
        """The request ended (or moved): its engine counts it no more."""
        if self._owner.pop(request_id, None) is not None and self.router is not None:
            self._held.pop(request_id, None)
            self.router.release(request_id)
            self._send_ready()

    def prefilled(self, request_id: str) -> None:
        """The request's first output came: requests held behind its prefix may go."""
        if self.router is not None:
            self.router.prefilled(request_id)
            self._send_ready()

    def update(self, loads: EngineLoads) -> None:
        if self.router is not None:
            self.router.update(loads)
            self._send_ready()

    def broadcast(self, msg: GatewayBeat | WatchPool) -> None:
        for sock in self.sockets.values():
            sock.send_nowait(msg)

    def send_to(self, engine: str, msg) -> bool:
        """msg to one engine's scheduler, never waiting; False when its queue is full."""
        sent = self.sockets[engine].send_nowait(msg)
        if not sent:
            log.error("engine %s takes nothing (its queue is full): dropped %s", engine, type(msg).__name__)
        return sent

    def _send(self, engine: str, msg: TokenizedRequest | FinishRequest) -> None:
        if not self.send_to(engine, msg) and isinstance(msg, TokenizedRequest):
            raise EngineUnreachable(engine)

    def _send_ready(self) -> None:
        for request_id in self.router.ready() if self.router is not None else ():
            msg = self._held.pop(request_id, None)
            if msg is not None:
                self.send_to(self._owner[request_id], msg)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()

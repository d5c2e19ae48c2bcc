"""Stand-ins for a tokenizer replica and an engine's scheduler, over real ZeroMQ sockets, and an
EngineClient started against them: the gateway's socket tests drive the client through these."""

from __future__ import annotations

import asyncio

from services.gateway.engine_client import EngineClient
from shared.config import Addresses
from shared.messages import (
    AbortRequest,
    GatewayBeat,
    GatewayToScheduler,
    GatewayToTokenizer,
    GenerateRequest,
    SchedulerToGateway,
    StepDeltas,
    TokenDelta,
    TokenizedRequest,
    TokenizerToGateway,
)
from shared.transport import SENT, DealerSocket, PushSocket, RouterSocket

EOS = 2


class FakeTokenizer:
    """Plays a tokenizer replica with the test's own sockets: takes requests, answers."""

    def __init__(self, ctx, addrs, name):
        self.inbox = DealerSocket(ctx, addrs.tokenizer_in, GatewayToTokenizer, identity=name)
        self.out = PushSocket(ctx, addrs.gateway_in, TokenizerToGateway, bind=False)
        self.received: list = []

    async def take(self, kind=GenerateRequest):
        for _ in range(200):
            self.received += self.inbox.recv_nowait()
            for msg in self.received:
                if isinstance(msg, kind):
                    self.received.remove(msg)
                    return msg
            await asyncio.sleep(0.01)
        raise AssertionError(f"no {kind.__name__}")

    async def answer(self, prompt_ids=(5, 6, 7)) -> GenerateRequest:
        """Take the next request and answer it as a replica would."""
        got = await self.take()
        self.out.send(TokenizedRequest(got.request_id, list(prompt_ids), got.params, [EOS], 0.0))
        return got


class FakeScheduler:
    """Plays an engine's scheduler: the ROUTER the gateway's DEALER connects to."""

    def __init__(self, ctx, addrs):
        self.sock = RouterSocket(ctx, addrs.scheduler_in, GatewayToScheduler, SchedulerToGateway)
        self.peer: bytes | None = None
        self.received: list = []

    async def take(self, kind=TokenizedRequest, request_id=None):
        for _ in range(300):
            for peer, msg in self.sock.recv_nowait():
                if not isinstance(msg, GatewayBeat):
                    self.peer = peer
                    self.received.append(msg)
            for msg in self.received:
                if isinstance(msg, kind) and request_id in (None, msg.request_id):
                    self.received.remove(msg)
                    return msg
            await asyncio.sleep(0.01)
        raise AssertionError(f"no {kind.__name__} {request_id or ''}: {self.received}")

    def send(self, *deltas: TokenDelta) -> None:
        self.sock.send(self.peer, StepDeltas(list(deltas)))


async def started(tmp_path, contexts, tok, replicas=("t",)):
    ctx, sync = contexts
    addrs = Addresses.ipc(str(tmp_path))
    retries = []
    client = EngineClient(ctx, addrs, tok, len(tok), on_retry=lambda: retries.append(1),
                          replicas=lambda: list(replicas))
    reader = asyncio.get_running_loop().create_task(client.run_reader())
    tokenizers = [FakeTokenizer(sync, addrs, name) for name in replicas]
    scheduler = FakeScheduler(sync, addrs)
    for name, tokenizer in zip(replicas, tokenizers, strict=True):
        await _connected(client, name, tokenizer)
    return client, reader, tokenizers, scheduler, retries


async def _connected(client: EngineClient, name: str, tokenizer: FakeTokenizer, timeout_s: float = 10.0) -> None:
    """Wait until the gateway's ROUTER can reach the replica (a frame to a peer not yet connected
    is dropped: a fixed pause lost requests on a loaded host), then drop the probe it received.
    Past the timeout it goes on as before: a test that sends nothing to the replica still runs,
    and one that does fails on its own request."""
    probe = AbortRequest("connect-probe")
    for _ in range(int(timeout_s / 0.02)):
        if client._to_tokenizer._sock.try_send(name.encode(), probe) == SENT:
            await tokenizer.take(AbortRequest)
            return
        await asyncio.sleep(0.02)


async def stopped(reader):
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)


def answering_gateway(tmp_path, contexts, tok, answer: str, client, call, reasoning_parser: str | None = "deepseek_r1"):
    """call(client(url_of)) against a real gateway on a port whose engine answers every request
    with answer's tokens, one per delta (the text's markers split across deltas)."""
    import asyncio

    from aiohttp.test_utils import TestServer

    from services.gateway.app import Gateway
    from services.gateway.health import StageTracker
    from services.gateway.metrics import Metrics
    from shared.messages import TokenDelta

    ids = tok.encode(answer, add_special_tokens=False)
    assert len(ids) > 8  # the markers come in several tokens, split across deltas

    async def go():
        engine, reader, (t,), sched, _ = await started(tmp_path, contexts, tok)
        gateway = Gateway(engine, StageTracker(), Metrics(), "m", set(), 10.0, reasoning_parser=reasoning_parser)
        server = TestServer(gateway.make_app())
        await server.start_server()

        async def play():
            while True:
                got = await t.answer()
                await sched.take()
                for i, tid in enumerate(ids):
                    sched.send(TokenDelta(got.request_id, [tid], 3, "stop" if i == len(ids) - 1 else None))
                    await asyncio.sleep(0)

        player = asyncio.get_running_loop().create_task(play())
        try:
            return await call(client(lambda path: str(server.make_url(path))))
        finally:
            player.cancel()
            await server.close()
            await stopped(reader)

    return asyncio.run(go())

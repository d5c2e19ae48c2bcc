"""The worker's generate handler against a stand-in scheduler (a ROUTER socket, as the
scheduler's): deltas stream back as Dynamo outputs, and a request Dynamo stops, or stops
reading, is aborted at the scheduler; a scheduler restart ends requests with an error."""

from __future__ import annotations

import asyncio

from services.dynamo_worker.engine_link import EngineLink
from services.dynamo_worker.handler import GenerateHandler
from shared.messages import (
    AbortRequest,
    GatewayBeat,
    GatewayToScheduler,
    SchedulerToGateway,
    StepDeltas,
    TokenDelta,
    TokenizedRequest,
)
from shared.transport import RouterSocket


class Context:
    """Dynamo's request context, as far as the handler uses it."""

    def __init__(self, name: str):
        self.name = name
        self.stopped = asyncio.get_running_loop().create_future()

    def id(self) -> str:
        return self.name

    def async_killed_or_stopped(self):
        return self.stopped

    def stop(self) -> None:
        self.stopped.set_result(True)


async def receive(scheduler: RouterSocket, kind: type, timeout_s: float = 5.0):
    """The next message of `kind` the stand-in scheduler gets (beats skipped), and its sender."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        for peer, msg in scheduler.recv_nowait():
            if isinstance(msg, kind):
                return peer, msg
            assert isinstance(msg, GatewayBeat | TokenizedRequest | AbortRequest), msg
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {kind.__name__} came")


def run(contexts, tmp_path, body) -> None:
    ctx, sync = contexts
    address = f"ipc://{tmp_path}/scheduler.ipc"
    scheduler = RouterSocket(sync, address, GatewayToScheduler, SchedulerToGateway)

    async def main():
        link = EngineLink(ctx, address)
        tasks = [asyncio.create_task(link.run_reader()), asyncio.create_task(link.run_beats())]
        try:
            await body(GenerateHandler(link, max_model_len=64, eos_token_ids=[2]), link, scheduler)
        finally:
            for t in tasks:
                t.cancel()
            link.close()

    asyncio.run(main())
    scheduler.close()


def test_deltas_stream_back_and_a_finished_request_is_not_aborted(contexts, tmp_path):
    async def body(handler, link, scheduler):
        gen = handler.generate({"token_ids": [3, 4], "stop_conditions": {"max_tokens": 3}}, Context("a"))
        first = asyncio.ensure_future(gen.__anext__())
        peer, msg = await receive(scheduler, TokenizedRequest)
        assert msg.prompt_token_ids == [3, 4] and msg.params.max_tokens == 3 and peer.startswith(b"gateway-dynamo-")
        scheduler.send(peer, StepDeltas([TokenDelta(msg.request_id, [7], 2)]))
        assert (await first) == {"token_ids": [7], "index": 0}
        scheduler.send(peer, StepDeltas([TokenDelta(msg.request_id, [8, 9], 2, finish_reason="length")]))
        last = await gen.__anext__()
        assert last["finish_reason"] == "length" and last["completion_usage"]["completion_tokens"] == 3
        assert [o async for o in gen] == []
        assert link.num_in_flight == 0 and handler.aborted_total == 0
        await asyncio.sleep(0.1)
        assert not [m for _, m in scheduler.recv_nowait() if isinstance(m, AbortRequest)]

    run(contexts, tmp_path, body)


def test_a_request_dynamo_stops_is_aborted_at_the_scheduler(contexts, tmp_path):
    async def body(handler, link, scheduler):
        context = Context("b")
        gen = handler.generate({"token_ids": [3]}, context)
        first = asyncio.ensure_future(gen.__anext__())
        peer, msg = await receive(scheduler, TokenizedRequest)
        scheduler.send(peer, TokenDelta(msg.request_id, [7], 1))
        await first
        context.stop()
        assert [o async for o in gen] == []
        _, abort = await receive(scheduler, AbortRequest)
        assert abort.request_id == msg.request_id and handler.aborted_total == 1 and link.num_in_flight == 0

    run(contexts, tmp_path, body)


def test_a_closed_generator_aborts_and_a_restart_fails_the_rest(contexts, tmp_path):
    async def body(handler, link, scheduler):
        gen = handler.generate({"token_ids": [3]}, None)
        first = asyncio.ensure_future(gen.__anext__())
        peer, msg = await receive(scheduler, TokenizedRequest)
        scheduler.send(peer, TokenDelta(msg.request_id, [7], 1))
        await first
        await gen.aclose()  # Dynamo stopped reading
        _, abort = await receive(scheduler, AbortRequest)
        assert abort.request_id == msg.request_id

        other = handler.generate({"token_ids": [5]}, None)
        pending = asyncio.ensure_future(other.__anext__())
        await receive(scheduler, TokenizedRequest)
        assert link.fail_all("the scheduler restarted") == 1
        assert (await pending)["finish_reason"].startswith("error: the scheduler restarted")

        refused = [o async for o in handler.generate({"token_ids": [1] * 64}, None)]
        assert refused[0]["finish_reason"].startswith("error: the prompt has 64 tokens")

    run(contexts, tmp_path, body)

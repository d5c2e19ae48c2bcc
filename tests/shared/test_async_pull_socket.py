"""AsyncPullSocket: the gateway's reader of typed messages, over real ipc sockets and a
real uvloop loop. Frames sent before the first `recv`, bursts longer than one drain
batch, garbage between good frames, a cancelled `recv` and a reader that waits long
before the next frame must all come out in order, with nothing lost."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
import zmq
import zmq.asyncio

from shared.messages import AbortRequest, RequestError, TokenizerToGateway
from shared.transport import AsyncPullSocket, PushSocket


@pytest.fixture
def addr(tmp_path):
    return f"ipc://{tmp_path}/pull"


def _accepted(i: int) -> RequestError:
    return RequestError(f"r{i}", 500, "x")


def _run(coro):
    return uvloop.run(coro)


def test_frames_sent_before_the_first_recv_and_a_burst_past_one_batch_arrive_in_order(addr):
    async def main():
        actx, ctx = zmq.asyncio.Context(), zmq.Context()
        pull = AsyncPullSocket(actx, addr, TokenizerToGateway)
        push = PushSocket(ctx, addr, TokenizerToGateway, bind=False)
        n = AsyncPullSocket.DRAIN_BATCH * 2 + 7
        for i in range(n):
            push.send(_accepted(i))
        await asyncio.sleep(0.2)  # every frame is queued before the reader is registered
        got = [await asyncio.wait_for(pull.recv(), 5) for _ in range(n)]
        push.close()
        pull.close()
        actx.destroy(linger=0)
        ctx.destroy(linger=0)
        return got

    got = _run(main())
    assert [m.request_id for m in got] == [f"r{i}" for i in range(AsyncPullSocket.DRAIN_BATCH * 2 + 7)]


def test_garbage_is_dropped_and_a_waiting_reader_wakes_for_each_later_frame(addr):
    async def main():
        actx, ctx = zmq.asyncio.Context(), zmq.Context()
        pull = AsyncPullSocket(actx, addr, TokenizerToGateway)
        raw = ctx.socket(zmq.PUSH)
        raw.connect(addr)
        push = PushSocket(ctx, addr, TokenizerToGateway, bind=False)
        got = []

        async def reader():
            while True:
                got.append(await pull.recv())

        task = asyncio.create_task(reader())
        for i in range(5):
            await asyncio.sleep(0.05)  # the reader is parked on its waiter each time
            raw.send(b"\x93not a message")
            push.send(_accepted(i))
        for _ in range(100):
            if len(got) == 5:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        dropped = pull.decoder.dropped
        raw.close(linger=0)
        push.close()
        pull.close()
        actx.destroy(linger=0)
        ctx.destroy(linger=0)
        return got, dropped

    got, dropped = _run(main())
    assert [m.request_id for m in got] == [f"r{i}" for i in range(5)]
    assert dropped == 5


def test_a_cancelled_recv_loses_nothing(addr):
    async def main():
        actx, ctx = zmq.asyncio.Context(), zmq.Context()
        pull = AsyncPullSocket(actx, addr, TokenizerToGateway)
        push = PushSocket(ctx, addr, TokenizerToGateway, bind=False)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(pull.recv(), 0.1)
        push.send(_accepted(1))
        push.send(_accepted(2))
        got = [await asyncio.wait_for(pull.recv(), 5) for _ in range(2)]
        push.close()
        pull.close()
        actx.destroy(linger=0)
        ctx.destroy(linger=0)
        return got

    assert [m.request_id for m in _run(main())] == ["r1", "r2"]


def test_a_dealer_that_sends_while_frames_wait_still_reads_them(addr):
    """The descriptor is edge-triggered: a send that takes the edge of frames already queued
    must not leave them unread until another frame comes (the gateway's link to a scheduler
    sends requests and aborts while that scheduler's deltas arrive)."""
    import time

    from shared.messages import GatewayToScheduler, SchedulerToGateway, TokenDelta
    from shared.transport import AsyncDealerSocket, RouterSocket

    async def main():
        actx, ctx = zmq.asyncio.Context(), zmq.Context()
        router = RouterSocket(ctx, addr, GatewayToScheduler, SchedulerToGateway)
        dealer = AsyncDealerSocket(actx, addr, SchedulerToGateway, identity="gateway-x")
        got = []
        for i in range(20):
            dealer.send_nowait(AbortRequest(f"hello-{i}"))
            for _ in range(100):
                peers = router.recv_nowait()
                if peers:
                    break
                await asyncio.sleep(0.01)
            router.send(peers[0][0], TokenDelta(f"r{i}", [i], 1))
            time.sleep(0.02)  # the frame is queued while the loop is busy...
            dealer.send_nowait(AbortRequest(f"after-{i}"))  # ... and a send takes its edge
            got.append(await asyncio.wait_for(dealer.recv(), 2))
        router.recv_nowait()
        for s in (dealer, router):
            s.close()
        actx.destroy(linger=0)
        ctx.destroy(linger=0)
        return got

    assert [m.request_id for m in _run(main())] == [f"r{i}" for i in range(20)]

"""The scheduler stage sends pool snapshots on the status channel only while a dashboard's
subscription (WatchPool, from a gateway's DEALER) holds, over real sockets
(inproc), with the test as executor and as the gateway's status socket."""

from __future__ import annotations

import time

from shared.messages import Heartbeat, PoolSnapshot, StatusToGateway, WatchPool
from shared.transport import PullSocket
from tests.scheduler.test_scheduler_service import Stage, honest


def collect(status: PullSocket, stage: Stage, seconds: float) -> list[PoolSnapshot]:
    """Snapshots that arrive within `seconds` (heartbeats are dropped), playing the executor."""
    out = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stage.execute()
        stage.beat()
        msg = status.recv(timeout_ms=10)
        if isinstance(msg, PoolSnapshot):
            out.append(msg)
        else:
            assert msg is None or isinstance(msg, Heartbeat)
    return out


def test_snapshots_flow_only_while_a_subscription_is_renewed():
    stage = Stage(num_kv_blocks=64)
    status = PullSocket(stage.ctx, stage.addrs.status, StatusToGateway, bind=True)
    try:
        gw = stage.gateway("gw-0")
        gw.send(honest("busy", max_tokens=240))
        stage.run_until(lambda r: stage.service.scheduler is not None and "busy" in stage.service.scheduler.groups,
                        execute=False)
        assert collect(status, stage, 0.6) == []  # nobody watches: nothing is built or sent

        gw.send(WatchPool(interval_s=0.1, ttl_s=0.6))
        got = collect(status, stage, 0.5)
        assert 3 <= len(got) <= 6, len(got)
        snap = got[-1]
        assert snap.num_blocks == 64 and snap.block_size == 4 and snap.kv_policy == "paged"
        assert [r.request_id for r in snap.rows] == ["busy"] and snap.rows[0].status == "running"
        assert snap.states[snap.rows[0].block_table[0]] == 1  # owned

        time.sleep(0.3)  # the subscription lapses
        collect(status, stage, 0.1)
        assert collect(status, stage, 0.5) == []

        for _ in range(4):  # renewed, as the gateway does while a page is open
            gw.send(WatchPool(interval_s=0.1, ttl_s=0.3))
            assert collect(status, stage, 0.2)
        assert stage.thread.is_alive()
    finally:
        status.close()
        stage.close()

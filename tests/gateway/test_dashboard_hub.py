"""The gateway's dashboard hub: the subscription goes down only while a page watches (at once
when the first opens, renewed after), history points come from the real Metrics, and
snapshots are kept per engine until the engine goes silent."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway import dashboard
from services.gateway.dashboard import DashboardHub
from services.gateway.metrics import Metrics
from services.gateway.output_text import TextDelta
from shared.messages import PoolSnapshot, WatchPool


def snap(engine: str, instance: str = "i0") -> PoolSnapshot:
    return PoolSnapshot(engine, instance, 0.0, "paged", 16, 4, bytes(4), bytes(16), bytes(8), bytes(8), [], 0)


def test_subscribes_only_while_a_page_watches(monkeypatch):
    monkeypatch.setattr(dashboard, "RENEW_S", 0.2)
    monkeypatch.setattr(dashboard, "SAMPLE_S", 0.1)
    sent: list[tuple[float, WatchPool]] = []

    async def scenario():
        loop = asyncio.get_running_loop()

        async def subscribe(msg: WatchPool) -> None:
            sent.append((loop.time(), msg))

        hub = DashboardHub(Metrics(), subscribe)
        task = loop.create_task(hub.run())
        await asyncio.sleep(0.5)
        assert sent == []  # nobody watches
        opened = loop.time()
        with hub.watching():
            await asyncio.sleep(0.05)
            assert sent and sent[0][0] - opened < 0.05  # the first page subscribes at once
            await asyncio.sleep(0.6)
            with hub.watching():  # a second page adds nothing
                await asyncio.sleep(0.1)
        watched = len(sent)
        await asyncio.sleep(0.5)
        task.cancel()
        return hub, watched

    hub, watched = asyncio.run(scenario())
    assert 3 <= watched <= 6 and len(sent) == watched  # renewed every 0.2 s, then nothing
    assert all(msg.ttl_s > dashboard.RENEW_S and msg.interval_s == dashboard.SNAPSHOT_INTERVAL_S for _, msg in sent)
    assert hub.watchers == 0 and len(hub.history) >= 8


def test_history_points_rate_the_metrics():
    metrics = Metrics()
    now = [10.0]
    hub = DashboardHub(metrics, None, clock=lambda: now[0])

    async def run():
        hub.sample()  # the baseline
        timer = metrics.track(1)
        for i in range(1, 6):
            timer.on_delta(TextDelta("r", "x", 7, i))
        now[0] += 2.0
        hub.sample()

    asyncio.run(run())
    (point,) = hub.history
    assert point["gen_tps"] == 2.5 and point["prompt_tps"] == 3.5  # 5 tokens, 7 prompt tokens, in 2 s
    assert point["ttft_ms"] is not None and point["itl_ms"] is not None and point["preemptions"] == 0


def test_engines_are_kept_until_silent(monkeypatch):
    now = [0.0]
    hub = DashboardHub(Metrics(), None, clock=lambda: now[0])

    async def run():
        hub.record(snap("scheduler", "a"))
        hub.record(snap("scheduler-2"))
        v = hub.version
        now[0] += dashboard.STALE_S / 2
        hub.record(snap("scheduler", "a"))
        assert hub.version > v and set(hub.live_engines()) == {"scheduler/a", "scheduler-2/i0"}
        now[0] += dashboard.STALE_S * 0.75
        assert set(hub.live_engines()) == {"scheduler/a"}  # the other went silent
        got = await hub.next_change(hub.version, 0.05)
        assert got == hub.version  # nothing new: waited, came back unchanged

    asyncio.run(run())


@pytest.mark.parametrize("field", ["states", "owners"])
def test_snapshot_json_carries_the_packed_arrays_as_base64(field):
    import base64
    import json

    hub = DashboardHub(Metrics(), None)
    s = snap("scheduler")

    async def run():
        hub.record(s)
        return hub.live_engines()["scheduler/i0"]

    data = json.loads(asyncio.run(run()))
    assert base64.b64decode(data[field]) == getattr(s, field)

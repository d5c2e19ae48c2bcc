"""The gateway's view of several engines (data parallelism), without processes: the
watchdog routes around an engine that goes silent or restarts, and what the gateway's engine
router is told (EngineLoads) follows which engines serve."""

from __future__ import annotations

from services.gateway.engine_loads import EnginePublisher, engine_loads, engines_report
from services.gateway.watchdog import StageWatchdog
from shared.messages import Heartbeat, SchedulerStats


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def beat(stage, engine, instance, state="ready", running=0):
    stats = SchedulerStats(num_running=running, kv_blocks_total=100, kv_blocks_used=25) if stage == "scheduler" else None
    return Heartbeat(stage, f"{stage}-{engine}", 1, state, 0.0, stats, instance, engine=engine)


def make():
    clock, calls = Clock(), {"restarted": [], "lost": [], "failed": [], "published": []}
    publisher = EnginePublisher(None, calls["published"].append)
    dog = StageWatchdog(lambda i: 0, lambda m: calls["failed"].append(m) or 0, lost_after_s=3.0, clock=clock,
                        on_scheduler_restarted=publisher.then(lambda e: calls["restarted"].append(e) or 0),
                        on_engine_lost=publisher.then(lambda e: calls["lost"].append(e) or 0),
                        scheduler_give_up_s=20.0)
    publisher.watchdog = dog
    return dog, clock, calls, publisher


def everyone(engines=("engine-0", "engine-1"), instance="A", running=0):
    out = [Heartbeat("tokenizer", "t0", 1, "ready", 0.0, None, "T")]
    for e in engines:
        out += [beat("scheduler", e, f"{instance}-{e}", running=running), beat("executor", e, f"X-{e}")]
    return out


def tick(dog, clock, seconds, keep):
    for _ in range(int(seconds / 0.25)):
        clock.now += 0.25
        for b in keep:
            dog.record(b)
        dog.check()


def test_a_silent_engine_is_routed_around_and_comes_back():
    dog, clock, calls, publisher = make()
    for b in everyone(running=3):
        dog.record(b)
    assert list(dog.serving_engines()) == ["engine-0", "engine-1"]
    loads = engine_loads(dog)
    assert [(x.engine, x.num_running, x.kv_usage) for x in loads.engines] == [
        ("engine-0", 3, 0.25), ("engine-1", 3, 0.25)]
    only_0 = [b for b in everyone(running=3) if b.engine != "engine-1"]
    tick(dog, clock, 2.5, only_0)
    assert calls["lost"] == []  # not silent long enough
    tick(dog, clock, 1.0, only_0)
    assert calls["lost"] == ["engine-1"]  # its requests go to engine-0, once
    assert [x.engine for x in calls["published"][-1].engines] == ["engine-0"]  # told before the resend
    assert dog.missing_stage is None  # new requests still admitted
    tick(dog, clock, 30.0, only_0)
    assert calls["lost"] == ["engine-1"] and calls["failed"] == []  # nothing to give up on: routed around
    for b in everyone(running=3):  # it was only frozen
        dog.record(b)
    assert list(dog.serving_engines()) == ["engine-0", "engine-1"]
    report = engines_report(dog, lambda e: 7)
    assert report["engine-1"]["serving"] and report["engine-1"]["requests_routed"] == 7
    publisher.publish()
    assert len(calls["published"][-1].engines) == 2


def test_a_restarted_engine_resends_only_its_own_requests_and_takes_none_until_ready():
    dog, clock, calls, _ = make()
    for b in everyone():
        dog.record(b)
    dog.record(beat("scheduler", "engine-1", "B-engine-1", "waiting for executor"))  # restarted
    assert calls["restarted"] == ["engine-1"]
    assert list(dog.serving_engines()) == ["engine-0"]
    assert [x.engine for x in calls["published"][-1].engines] == ["engine-0"]
    dog.record(beat("scheduler", "engine-1", "B-engine-1"))
    assert list(dog.serving_engines()) == ["engine-0", "engine-1"]
    # the replicas learn the new instance: their prefix maps forget what engine-1 held
    assert [(x.engine, x.instance) for x in engine_loads(dog).engines] == [
        ("engine-0", "A-engine-0"), ("engine-1", "B-engine-1")]


def test_one_engine_alone_keeps_the_single_scheduler_rules():
    dog, clock, calls, publisher = make()
    for b in everyone(("engine-0",)):
        dog.record(b)
    publisher.publish()
    assert calls["published"] == []  # nothing to choose between
    tick(dog, clock, 4.0, [everyone(("engine-0",))[0]])
    assert dog.missing_stage == "scheduler" and calls["lost"] == []  # waits for it...
    tick(dog, clock, 20.0, [everyone(("engine-0",))[0]])
    assert len(calls["failed"]) == 1  # ...and gives up once


def test_the_router_is_told_at_once_when_an_engine_starts_or_stops_serving():
    dog, clock, calls, publisher = make()
    for b in everyone(engines=("engine-0",)) + [beat("scheduler", "engine-1", "A-engine-1"),
                                                beat("executor", "engine-1", "X-engine-1", state="loading")]:
        dog.record(b)
        publisher.publish_if_changed()
    assert [[x.engine for x in p.engines] for p in calls["published"]] == [["engine-0"]]
    publisher.publish_if_changed()
    assert len(calls["published"]) == 1  # nothing changed: nothing sent
    dog.record(beat("executor", "engine-1", "X-engine-1"))  # engine-1 ready: serving
    publisher.publish_if_changed()
    assert [x.engine for x in calls["published"][-1].engines] == ["engine-0", "engine-1"]
    tick(dog, clock, 3.5, [b for b in everyone() if b.engine != "engine-0"])
    publisher.publish_if_changed()
    assert [x.engine for x in calls["published"][-1].engines] == ["engine-1"]

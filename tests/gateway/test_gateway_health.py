"""/health's verdict from heartbeats (with a fake clock), and the metrics they feed."""

from __future__ import annotations

from services.gateway.health import FORGET_S, FRESH_S, StageTracker
from services.gateway.metrics import Metrics
from services.gateway.output_text import TextDelta
from shared.messages import Heartbeat, SchedulerStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(stage, replica=None, state="ready", stats=None) -> Heartbeat:
    return Heartbeat(stage, replica or stage, 1, state, 0.0, stats)


def all_ready(tracker: StageTracker) -> None:
    for stage in ("gateway", "tokenizer", "scheduler", "executor"):
        tracker.record(beat(stage))


def test_healthy_only_when_every_stage_is_fresh_and_ready():
    clock = Clock()
    tracker = StageTracker(clock=clock)
    assert tracker.report()[0] is False
    all_ready(tracker)
    healthy, body = tracker.report()
    assert healthy and body["status"] == "ok" and body["not_ready"] == []
    clock.now += FRESH_S + 0.1
    tracker.record(beat("gateway"))
    tracker.record(beat("tokenizer"))
    tracker.record(beat("scheduler"))
    healthy, body = tracker.report()
    assert not healthy and body["not_ready"] == ["executor"]
    assert body["stages"]["executor"][0]["age_s"] > FRESH_S


def test_a_stage_that_is_not_ready_makes_it_unhealthy():
    tracker = StageTracker(clock=Clock())
    all_ready(tracker)
    tracker.record(beat("scheduler", state="waiting for executor"))
    healthy, body = tracker.report()
    assert not healthy and body["not_ready"] == ["scheduler"]
    assert body["stages"]["scheduler"][0]["state"] == "waiting for executor"


def test_one_ready_tokenizer_replica_is_enough_and_silent_ones_are_forgotten():
    clock = Clock()
    tracker = StageTracker(clock=clock)
    all_ready(tracker)
    tracker.record(beat("tokenizer", "tokenizer-old"))
    clock.now += FRESH_S + 1
    all_ready(tracker)
    healthy, body = tracker.report()
    assert healthy
    assert {r["replica"]: r["ready"] for r in body["stages"]["tokenizer"]} == {
        "tokenizer": True, "tokenizer-old": False,
    }
    clock.now += FORGET_S
    all_ready(tracker)
    assert [r["replica"] for r in tracker.report()[1]["stages"]["tokenizer"]] == ["tokenizer"]


def _values(metrics: Metrics) -> dict[str, float]:
    out = {}
    for line in metrics.render()[0].decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_scheduler_stats_become_gauges_and_preemptions_a_counter():
    metrics = Metrics()
    tracker = StageTracker(metrics.observe_scheduler)
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_blocks_total=10, kv_blocks_used=4, num_preemptions_total=5)
    tracker.record(beat("scheduler", stats=stats))
    tracker.record(beat("scheduler", stats=SchedulerStats(kv_blocks_total=10, num_preemptions_total=7)))
    v = _values(metrics)
    assert v["pagedserve_num_preemptions_total"] == 7 and v["pagedserve_kv_blocks_total"] == 10
    assert v["pagedserve_kv_cache_usage_ratio"] == 0.0 and v["pagedserve_num_requests_running"] == 0
    tracker.record(beat("scheduler", stats=SchedulerStats(num_preemptions_total=1)))  # it restarted
    assert _values(metrics)["pagedserve_num_preemptions_total"] == 8


def test_request_timer_counts_tokens_and_latencies():
    metrics = Metrics()
    timer = metrics.track()
    timer.on_delta(TextDelta("r", "a", 4, 1))
    timer.on_delta(TextDelta("r", "", 4, 3))
    timer.on_delta(TextDelta("r", "b", 4, 4, finish_reason="length"))
    v = _values(metrics)
    assert v["pagedserve_prompt_tokens_total"] == 4 and v["pagedserve_generation_tokens_total"] == 4
    assert v["pagedserve_time_to_first_token_seconds_count"] == 1
    assert v["pagedserve_inter_token_latency_seconds_count"] == 3
    assert v['pagedserve_request_success_total{finish_reason="length"}'] == 1
    assert v["pagedserve_e2e_request_latency_seconds_count"] == 1

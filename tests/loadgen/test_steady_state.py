"""Capacity probes judged in steady state, on synthetic runs (no server): a queueing model of
a server with `slots` parallel slots and a fixed service time, so its capacity is known
(slots / service), fed open-loop arrivals as the runner sends them."""

from __future__ import annotations

import random

import pytest

from loadgen import steady
from loadgen.capacity import CapacitySlo, probe_summary
from loadgen.metrics import RequestResult, summarize

SLOTS, TTFT, ITL, TOKENS = 8, 0.05, 0.01, 16
SERVICE = TTFT + (TOKENS - 1) * ITL  # 0.2 s
CAPACITY = SLOTS / SERVICE  # 40 req/s


def synthetic_run(rate: float, n: int, poisson: bool = False, seed: int = 0) -> tuple[list[RequestResult], float]:
    """FIFO onto the first free slot; returns the results and the run's end."""
    rng = random.Random(seed)
    free = [0.0] * SLOTS
    results, t = [], 0.0
    for i in range(n):
        begin = max(t, min(free))
        free[free.index(min(free))] = begin + SERVICE
        wait = begin - t
        results.append(RequestResult(index=i, ok=True, prompt_len=8, expected_output_len=TOKENS,
                                     output_tokens=TOKENS, start=t, ttft=wait + TTFT, itl=[ITL] * (TOKENS - 1),
                                     e2e=wait + SERVICE))
        t += rng.expovariate(rate) if poisson else 1 / rate
    return results, max(r.start + r.e2e for r in results)


SLO = CapacitySlo.parse("e2e=1")  # p99 end-to-end within 5 service times


def test_a_burst_passes_the_old_check_and_fails_in_steady_state():
    rate = 1.5 * CAPACITY
    # The old probe: 10 requests, every one judged. The server is empty when they come: all within the SLO.
    burst, burst_end = synthetic_run(rate, 10)
    assert SLO.violations(summarize(burst, burst_end)) == []
    # The same rate for 30 s of arrivals: the queue grows by ~20 requests a second.
    results, end = synthetic_run(rate, int(rate * 30))
    summary = probe_summary(results, end)
    state = summary["steady_state"]
    assert not state["settled"] and state["queue_late"] > state["queue_early"] + 100
    assert state["backlog_share"] == pytest.approx((rate - CAPACITY) / rate, rel=0.15)
    why = SLO.violations(summary)
    assert any(v.startswith("queue grows") for v in why), why
    assert summary["warmup_requests"] == pytest.approx(0.25 * len(results), abs=2)


def test_a_growing_queue_fails_even_while_latencies_meet_the_slo():
    """5% over capacity for 20 s: the latest requests wait about a second more than the first, still
    within a generous SLO, but the queue never stops growing."""
    rate = 1.05 * CAPACITY
    results, end = synthetic_run(rate, int(rate * 20))
    summary = probe_summary(results, end, max_backlog=0.02)
    lenient = CapacitySlo.parse("e2e=10")
    why = lenient.violations(summary)
    assert why and all(v.startswith("queue grows") for v in why), why


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sustainable_rate_passes(seed):
    rate = 0.75 * CAPACITY
    results, end = synthetic_run(rate, int(rate * 30), poisson=True, seed=seed)
    summary = probe_summary(results, end)
    assert summary["steady_state"]["settled"], summary["steady_state"]
    assert SLO.violations(summary) == []
    assert summary["completed"] == len(results) - summary["warmup_requests"]


def test_requests_left_in_flight_count_as_queued_and_failed():
    results, end = synthetic_run(CAPACITY / 2, 200)
    cut_off = results[-20:]
    for r in cut_off:  # the run's deadline cancelled them before they ended
        r.ok, r.e2e, r.ttft, r.itl, r.error = False, None, None, [], "cancelled: run deadline of 5s"
    summary = probe_summary(results, end)
    assert summary["failed"] == 20
    assert "20 of" in SLO.violations(summary)[0]


def test_closed_loop_window_drops_the_first_wave():
    # 4 clients back to back on a server that takes 0.2 s a request: 20 tok/s per client.
    results, clients = [], [0.0] * 4
    for i in range(24):
        c = clients.index(min(clients))
        start = clients[c]
        results.append(RequestResult(index=i, ok=True, prompt_len=8, expected_output_len=TOKENS,
                                     output_tokens=TOKENS, start=start, ttft=TTFT, e2e=SERVICE))
        clients[c] = start + SERVICE
    window = steady.closed_loop(results, 4)
    assert len(window.measured) == 20 and window.start_s == pytest.approx(SERVICE)
    assert window.output_throughput == pytest.approx(4 * TOKENS / SERVICE)
    assert steady.closed_loop(results[:6], 4).output_throughput is None  # less than a wave inside the window
    with pytest.raises(ValueError, match="first wave"):
        steady.closed_loop(results[:4], 4)

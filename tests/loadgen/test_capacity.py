"""`capacity` brackets the highest sustainable rate: on a synthetic probe, then on a server
with a known limit (slots / service time)."""

from __future__ import annotations

import pytest

from loadgen import runner
from loadgen.capacity import CapacitySlo, search
from loadgen.metrics import summarize
from loadgen.targets import Target
from tests.loadgen.conftest import requests
from tests.loadgen.fake_server import FakeConfig, FakeServer


def fake_summary(e2e_p99: float, failed: int = 0) -> dict:
    stat = {"mean": e2e_p99, "median": e2e_p99, "p90": e2e_p99, "p99": e2e_p99}
    return {"completed": 10 - failed, "failed": failed, "e2e_s": stat, "ttft_s": stat, "tpot_s": stat,
            "itl_s": stat, "normalized_latency_s": stat}


def test_search_brackets_a_known_limit():
    limit = 37.0
    seen = []

    def probe(rate: float) -> dict:
        seen.append(rate)
        return fake_summary(1.0 if rate <= limit else 5.0)

    out = search(probe, CapacitySlo.parse("e2e=2"), start_rate=1.0, tolerance=0.05)
    assert out["capacity"] <= limit < out["lowest_failing_rate"] <= out["capacity"] * 1.05
    assert seen[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert out["stopped"] == "tolerance reached" and len(out["probes"]) == len(seen) <= 12


def test_search_stops_at_its_bounds():
    always_fail = search(lambda r: fake_summary(9.0), CapacitySlo.parse("e2e=1"), start_rate=4.0, max_probes=50)
    assert always_fail["capacity"] == 0.0 and always_fail["stopped"] == "no rate passed"
    capped = search(lambda r: fake_summary(0.1), CapacitySlo.parse("e2e=1"), start_rate=4.0, max_rate=20.0)
    assert capped["capacity"] == 20.0 and capped["stopped"] == "max rate passed"
    few = search(lambda r: fake_summary(0.1), CapacitySlo.parse("e2e=1"), max_probes=3)
    assert len(few["probes"]) == 3 and few["stopped"] == "probe limit"
    failures = search(lambda r: fake_summary(0.1, failed=1), CapacitySlo.parse("e2e=1"), start_rate=4.0,
                      max_probes=3)
    assert failures["capacity"] == 0.0  # a failed request fails the probe by default


def test_capacity_slo_parsing():
    slo = CapacitySlo.parse("normalized=0.1,ttft=1s,p90_tpot=50ms")
    assert slo.limits == (("mean", "normalized", 0.1), ("p99", "ttft", 1.0), ("p90", "tpot", 0.05))
    assert slo.violations(fake_summary(0.04)) == []
    assert len(slo.violations(fake_summary(0.5))) == 2  # normalized and tpot
    for bad in ("", "p42_ttft=1", "speed=3", "ttft"):
        with pytest.raises(ValueError):
            CapacitySlo.parse(bad)


def test_capacity_converges_on_the_fake_servers_limit():
    """8 slots / 0.2 s per request = 40 req/s. Near-regular arrivals (burstiness 50) queue only
    past that rate, and p90 e2e <= 0.26 s (1.3 x service) fails just above it; p90 rather than
    p99 so that one request held up by a busy machine does not fail a probe."""
    slots, ttft, itl, tokens = 8, 0.1, 0.1, 2
    limit = slots / (ttft + (tokens - 1) * itl)
    trace = requests(40, tokens)
    with FakeServer(FakeConfig(ttft=ttft, itl=itl, slots=slots)) as server:
        target = Target("fake", server.url, length_control="ignore_eos")

        def probe(rate: float) -> dict:
            config = runner.LoadConfig(request_rate=rate, burstiness=50.0, num_requests=len(trace), seed=1,
                                       progress=False, deadline=10.0)
            out = runner.run(target, iter(trace), config)
            return summarize(out.results, out.duration_s)

        result = search(probe, CapacitySlo.parse("p90_e2e=0.26"), start_rate=limit / 2, tolerance=0.1,
                        max_probes=8, time_budget=30)
    assert 0.75 * limit <= result["capacity"] <= 1.15 * limit, result["probes"]
    assert result["lowest_failing_rate"] <= 1.6 * limit

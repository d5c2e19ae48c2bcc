"""Summary statistics, TPOT and normalized latency, SLO parsing and goodput, on known results."""

from __future__ import annotations

import pytest

from loadgen.metrics import RequestResult, Slo, parse_seconds, stats, summarize


def ok(index: int, ttft: float, e2e: float, tokens: int, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(index=index, ok=True, prompt_len=10, expected_output_len=tokens, output_tokens=tokens,
                         ttft=ttft, e2e=e2e, itl=itl or [])


def test_tpot_and_normalized_latency():
    r = ok(0, ttft=0.5, e2e=2.5, tokens=5)
    assert r.tpot == pytest.approx(0.5)  # (2.5 - 0.5) / (5 - 1)
    assert r.normalized == pytest.approx(0.5)  # 2.5 / 5
    assert ok(1, ttft=0.3, e2e=0.3, tokens=1).tpot is None  # undefined for one token
    failed = RequestResult(index=2, ok=False, prompt_len=10, expected_output_len=5, error="HTTP 500")
    assert failed.tpot is None and failed.normalized is None


def test_stats_match_numpy_linear_percentiles():
    s = stats([float(v) for v in range(1, 101)])
    assert s == pytest.approx({"mean": 50.5, "median": 50.5, "p90": 90.1, "p99": 99.01})
    assert stats([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_summary_counts_throughput_and_latencies():
    results = [ok(0, 0.1, 1.1, 11, itl=[0.1] * 10), ok(1, 0.3, 2.3, 21, itl=[0.1] * 20),
               RequestResult(index=2, ok=False, prompt_len=10, expected_output_len=8, status=500, error="HTTP 500: x"),
               RequestResult(index=3, ok=False, prompt_len=10, expected_output_len=8, error="disconnected: Payload")]
    s = summarize(results, duration_s=4.0)
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["errors"] == {"HTTP 500": 1, "disconnected": 1}
    assert s["request_throughput"] == pytest.approx(0.5)
    assert s["output_throughput"] == pytest.approx(32 / 4)
    assert s["input_throughput"] == pytest.approx(20 / 4)
    assert s["ttft_s"]["mean"] == pytest.approx(0.2)
    assert s["tpot_s"]["mean"] == pytest.approx(0.1)
    assert s["itl_s"]["median"] == pytest.approx(0.1)
    assert s["e2e_s"]["median"] == pytest.approx(1.7)
    assert s["normalized_latency_s"]["mean"] == pytest.approx((1.1 / 11 + 2.3 / 21) / 2)
    assert s["short_outputs"] == 0
    assert "goodput" not in s


def test_goodput_counts_requests_within_every_limit():
    results = [ok(0, ttft=0.2, e2e=1.0, tokens=9),   # tpot 0.1: meets both
               ok(1, ttft=0.6, e2e=1.0, tokens=9),   # ttft too slow
               ok(2, ttft=0.2, e2e=2.2, tokens=11),  # tpot 0.2: too slow
               ok(3, ttft=0.1, e2e=0.1, tokens=1),   # no tpot: only ttft applies
               RequestResult(index=4, ok=False, prompt_len=1, expected_output_len=1, error="timeout")]
    s = summarize(results, duration_s=2.0, slo=Slo.parse("ttft=500ms, tpot=0.15"))
    assert s["goodput"] == pytest.approx(2 / 2.0)
    assert s["slo_attainment"] == pytest.approx(2 / 5)
    assert s["slo"] == {"ttft": 0.5, "tpot": 0.15}


def test_slo_and_duration_parsing():
    assert parse_seconds("250ms") == pytest.approx(0.25)
    assert parse_seconds("2s") == 2.0 and parse_seconds("1.5") == 1.5
    assert Slo.parse("e2e=10,normalized=0.2") == Slo(e2e=10.0, normalized=0.2)
    for bad in ("", "ttft", "latency=1", "ttft=fast"):
        with pytest.raises(ValueError):
            Slo.parse(bad)

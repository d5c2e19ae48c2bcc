"""Capacity: the highest request rate a target sustains under a latency SLO, in bounded time.

Each probe is an open-loop run of the same seeded trace at one rate (the arrival
times scale with 1/rate, so probes differ only in rate). The rate doubles from
`start_rate` until a probe fails, then bisects (geometrically) between the highest
passing and the lowest failing rate until they are within `tolerance`, or the probe
count or time budget runs out. The SLO limits aggregate statistics: `normalized=0.1`
bounds the mean normalized latency (the paper's criterion), `ttft=1,tpot=0.05` the p99
TTFT and TPOT; a `STAT_` prefix (mean, median, p90, p99) picks another statistic, e.g.
`p90_e2e=5`.

A probe is judged in steady state only (`probe_summary`, steady.py): it must last long
enough for the queue to settle or grow (the command sizes it: `--probe-seconds` of
arrivals and at least `--probe-min-requests`), its warm-up share is dropped, and the SLO
statistics cover the rest. It fails when any request fails, when its queue keeps growing
(even if every latency is within the SLO so far: a burst is not a capacity), or when
any limit of the SLO is exceeded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from loadgen import steady
from loadgen.metrics import RequestResult, parse_seconds, summarize

STATS = ("mean", "median", "p90", "p99")
METRICS = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s", "normalized": "normalized_latency_s"}
DEFAULT_STAT = {"normalized": "mean"}


@dataclass(frozen=True)
class CapacitySlo:
    limits: tuple[tuple[str, str, float], ...]  # (stat, metric, seconds)

    @classmethod
    def parse(cls, text: str) -> CapacitySlo:
        limits = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            stat, _, metric = key.strip().rpartition("_")
            stat = stat or DEFAULT_STAT.get(metric, "p99")
            if not sep or metric not in METRICS or stat not in STATS:
                raise ValueError(f"SLO part {part!r}: expected [STAT_]METRIC=SECONDS, METRIC in "
                                 f"{', '.join(METRICS)}, STAT in {', '.join(STATS)}")
            limits.append((stat, metric, parse_seconds(value)))
        if not limits:
            raise ValueError("empty SLO")
        return cls(tuple(limits))

    def violations(self, summary: dict, max_failed_frac: float = 0.0) -> list[str]:
        out = []
        total = summary["completed"] + summary["failed"]
        if total == 0 or summary["failed"] > max_failed_frac * total:
            out.append(f"{summary['failed']} of {total} requests failed")
        state = summary.get("steady_state")
        if state is not None and not state["settled"]:
            out.append(state["reason"])
        for stat, metric, limit in self.limits:
            value = summary[METRICS[metric]][stat]
            if value is None or value > limit:
                out.append(f"{stat} {metric} {value if value is None else round(value, 4)} > {limit:g}s")
        return out

    def describe(self) -> str:
        return ", ".join(f"{stat} {metric} <= {limit:g}s" for stat, metric, limit in self.limits)


def probe_summary(results: list[RequestResult], duration_s: float, warmup_frac: float = 0.25,
                  max_backlog: float = 0.05) -> dict:
    """The summary of an open-loop probe's steady part, with its `steady_state` verdict."""
    verdict = steady.open_loop(results, duration_s, warmup_frac=warmup_frac, max_backlog=max_backlog)
    warmup = [r for r in results if r.start < verdict.warmup_s]
    # Latencies from the steady part only; a request that failed during the warm-up still fails the probe.
    summary = summarize(verdict.measured + [r for r in warmup if not r.ok], duration_s - verdict.warmup_s)
    summary["steady_state"] = verdict.to_dict()
    summary["warmup_requests"] = len(warmup)
    return summary


def search(probe: Callable[[float], dict], slo: CapacitySlo, *, start_rate: float = 1.0, max_rate: float = 1000.0,
           tolerance: float = 0.1, max_probes: int = 12, time_budget: float = 600.0,
           max_failed_frac: float = 0.0, log: Callable[[str], None] = lambda _: None) -> dict:
    """Run probes; `capacity` is the highest passing rate (0 when none passed)."""
    passed: float | None = None
    failed: float | None = None
    probes = []
    stop = "tolerance reached"
    began = time.monotonic()
    rate = start_rate
    while True:
        if len(probes) >= max_probes:
            stop = "probe limit"
            break
        if time.monotonic() - began >= time_budget:
            stop = "time budget"
            break
        summary = probe(rate)
        why = slo.violations(summary, max_failed_frac)
        probes.append({"rate": rate, "passed": not why, "violations": why, "summary": summary})
        log(f"probe {len(probes)}: {rate:.4g} req/s {'PASS' if not why else 'FAIL: ' + '; '.join(why)}")
        if why:
            failed = rate if failed is None else min(failed, rate)
        else:
            passed = rate if passed is None else max(passed, rate)
        if passed is not None and failed is not None:
            if failed / passed <= 1 + tolerance:
                break
            rate = math.sqrt(passed * failed)
        elif failed is None:
            if rate >= max_rate:
                stop = "max rate passed"
                break
            rate = min(rate * 2, max_rate)
        else:
            rate = rate / 2
            if rate < start_rate / 1024:
                stop = "no rate passed"
                break
    return {"capacity": passed or 0.0, "lowest_failing_rate": failed, "slo": slo.describe(), "stopped": stop,
            "elapsed_s": time.monotonic() - began, "probes": probes}

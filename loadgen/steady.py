"""Steady state of a run: drop the warm-up, then tell a queue that settles from one that grows.

The requests in flight (sent, not yet finished) are the server's queue, whatever it does
with them inside. In an open loop below capacity that count fluctuates around a level
(Little's law: rate x latency); above capacity it grows for as long as arrivals last,
by (rate - capacity) requests a second. A short probe cannot tell the two apart: its
first requests find an empty server and meet any SLO, which is how a 10-request probe
reports a burst as a capacity.

`open_loop` judges a probe: the first `warmup_frac` of the arrival window (the queue
filling from empty) is dropped, the rest is cut into an early and a late half, and the
mean number in flight of each half is compared. The growth divided by the arrivals
between the halves' midpoints is the share of arrivals the server left queued, about
(rate - capacity) / rate above capacity and about 0 below it, whatever the probe's
length; more than `max_backlog` of it (and more than `min_growth` requests, so that a
queue of a few requests fluctuating does not count) means the queue keeps growing.
Requests in flight when the run was cancelled stay in the queue to its end.

`closed_loop` picks the steady window of a closed loop at concurrency C: it drops the
first C requests (the first wave, which all start together on an idle server) and
counts output tokens of requests finishing between the end of that wave and the start
of the last request (after which fewer than C clients remain); a window holding less
than a wave of completions gives no figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadgen.metrics import RequestResult


def end_time(r: RequestResult, run_end: float) -> float:
    """When a request left the server's queue, seconds after the run started."""
    if r.e2e is not None:
        return r.start + r.e2e
    if r.error and r.error.startswith(("cancelled", "timeout")):
        return run_end  # still held by the server when the run gave up on it
    return r.start  # refused or dropped at once: never queued


def in_flight(results: list[RequestResult], times: np.ndarray, run_end: float) -> np.ndarray:
    starts = np.sort([r.start for r in results])
    ends = np.sort([end_time(r, run_end) for r in results])
    return np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="right")


@dataclass(frozen=True)
class OpenLoopVerdict:
    warmup_s: float  # requests sent before this are not judged
    window_s: tuple[float, float]  # the judged arrival window
    queue_early: float  # mean requests in flight, early half of the window
    queue_late: float  # the same, late half
    backlog_share: float  # growth / arrivals between the halves' midpoints
    settled: bool
    measured: list[RequestResult]  # requests sent inside the window

    @property
    def reason(self) -> str | None:
        if self.settled:
            return None
        return (f"queue grows: {self.queue_early:.1f} -> {self.queue_late:.1f} in flight, "
                f"{100 * self.backlog_share:.0f}% of arrivals left queued")

    def to_dict(self) -> dict:
        return {"warmup_s": self.warmup_s, "window_s": list(self.window_s), "queue_early": self.queue_early,
                "queue_late": self.queue_late, "backlog_share": self.backlog_share, "settled": self.settled,
                "measured_requests": len(self.measured), "reason": self.reason}


def open_loop(results: list[RequestResult], run_end: float, warmup_frac: float = 0.25,
              max_backlog: float = 0.05, min_growth: float = 2.0, samples: int = 400) -> OpenLoopVerdict:
    if not results:
        raise ValueError("no requests to judge")
    last_arrival = max(r.start for r in results)
    cut = warmup_frac * last_arrival
    mid = (cut + last_arrival) / 2
    times = np.linspace(cut, last_arrival, samples)
    queue = in_flight(results, times, run_end)
    early, late = float(queue[times <= mid].mean()), float(queue[times >= mid].mean())
    starts = np.array([r.start for r in results])
    q1, q3 = (cut + mid) / 2, (mid + last_arrival) / 2
    arrivals = max(1, int(((starts > q1) & (starts <= q3)).sum()))
    share = (late - early) / arrivals
    settled = not (late - early > min_growth and share > max_backlog)
    measured = [r for r in results if r.start >= cut]
    return OpenLoopVerdict(warmup_s=cut, window_s=(cut, last_arrival), queue_early=early, queue_late=late,
                           backlog_share=share, settled=settled, measured=measured)


@dataclass(frozen=True)
class ClosedLoopWindow:
    start_s: float
    end_s: float
    output_tokens: int  # of requests that finished inside the window
    completions: int  # requests that finished inside the window
    concurrency: int
    measured: list[RequestResult]  # every request after the first wave

    @property
    def output_throughput(self) -> float | None:
        """None when the window holds less than a wave of completions (too short to mean anything)."""
        span = self.end_s - self.start_s
        return self.output_tokens / span if span > 0 and self.completions >= self.concurrency else None


def closed_loop(results: list[RequestResult], concurrency: int) -> ClosedLoopWindow:
    """Needs more than `concurrency` requests; with fewer, every request is the first wave."""
    ordered = sorted(results, key=lambda r: r.index)
    first_wave, rest = ordered[:concurrency], ordered[concurrency:]
    if not rest:
        raise ValueError(f"{len(results)} requests at concurrency {concurrency}: no steady state after the first wave")
    first_done = [r.start + r.e2e for r in first_wave if r.e2e is not None]
    start = max(first_done) if first_done else min(r.start for r in rest)
    end = max(r.start for r in rest)
    inside = [r for r in ordered if r.ok and start < r.start + r.e2e <= end]
    return ClosedLoopWindow(start_s=start, end_s=end, output_tokens=sum(r.output_tokens for r in inside),
                            completions=len(inside), concurrency=concurrency, measured=rest)

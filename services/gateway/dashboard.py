"""What the dashboard pages show, kept by the gateway: pool snapshots and a rolling history.

`DashboardHub` holds the latest `PoolSnapshot` of each engine (scheduler) that sent one
recently, each encoded to JSON once for every page (packed byte arrays become base64
strings), and samples the gateway's own metrics once a second into a HISTORY_S window:
tokens per second, mean time to first token and inter-token latency of the second,
preemptions, running and waiting requests.

While at least one page watches (`watching()`), `run()` sends a `WatchPool`
subscription down the pipeline every RENEW_S, at once when the first page opens; the
scheduler lets it lapse TTL_S after the last renewal, so with no page open no snapshot
is built or sent. Pages wait on `next_change()`. `close()` (the gateway is draining)
ends every page's stream, so an open dashboard never holds up a shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec

from services.gateway.metrics import Metrics
from shared.messages import PoolSnapshot, WatchPool

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 0.25  # what pages are sent: four updates a second
TTL_S = 3.0  # the scheduler stops this long after the last renewal
RENEW_S = 1.0
SAMPLE_S = 1.0
HISTORY_S = 300
STALE_S = 3.0  # an engine silent this long (gone, restarted) leaves the page
SEND_TIMEOUT_S = 1.0  # no tokenizer replica connected: skip this renewal

_SAMPLES = {
    "gen": "pagedserve_generation_tokens_total",
    "prompt": "pagedserve_prompt_tokens_total",
    "ttft_sum": "pagedserve_time_to_first_token_seconds_sum",
    "ttft_count": "pagedserve_time_to_first_token_seconds_count",
    "itl_sum": "pagedserve_inter_token_latency_seconds_sum",
    "itl_count": "pagedserve_inter_token_latency_seconds_count",
    "preemptions": "pagedserve_num_preemptions_total",
    "running": "pagedserve_num_requests_running",
    "waiting": "pagedserve_num_requests_waiting",
}
_NAMES = {v: k for k, v in _SAMPLES.items()}


def _mean_ms(sum_now: float, sum_before: float, count_now: float, count_before: float) -> float | None:
    n = count_now - count_before
    return round((sum_now - sum_before) / n * 1000, 3) if n > 0 else None


class DashboardHub:
    def __init__(self, metrics: Metrics, subscribe: Callable[[WatchPool], Awaitable[None]],
                 clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self._subscribe = subscribe
        self._clock = clock
        self.engines: dict[str, tuple[bytes, float]] = {}  # engine key -> (its snapshot as JSON, received)
        self.history: deque[dict] = deque(maxlen=int(HISTORY_S / SAMPLE_S))
        self.watchers = 0
        self.version = 0  # bumped on every change a page shows
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()  # the first page opened: subscribe now
        self._last: dict[str, float] | None = None
        self._last_at = 0.0
        self.closed = False

    # --- what the scheduler sends --------------------------------------------------

    def record(self, snap: PoolSnapshot) -> None:
        self.engines[f"{snap.engine}/{snap.instance}"] = (msgspec.json.encode(snap), self._clock())
        self._bump()

    def live_engines(self) -> dict[str, bytes]:
        now = self._clock()
        for key in [k for k, (_, seen) in self.engines.items() if now - seen > STALE_S]:
            del self.engines[key]
            self._bump()
        return {key: data for key, (data, _) in self.engines.items()}

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def next_change(self, version: int, timeout_s: float) -> int:
        """The version after `version`, waiting up to timeout_s for one."""
        if self.version == version:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout_s)
        return self.version

    def close(self) -> None:
        """Streams end at their next turn (now: this wakes them)."""
        self.closed = True
        self._bump()

    # --- pages ----------------------------------------------------------------------

    @contextlib.contextmanager
    def watching(self):
        self.watchers += 1
        if self.watchers == 1:
            self._wake.set()
        try:
            yield self
        finally:
            self.watchers -= 1

    # --- the history ----------------------------------------------------------------

    def _read_metrics(self) -> dict[str, float]:
        out = dict.fromkeys(_SAMPLES, 0.0)
        for family in self.metrics.registry.collect():
            for sample in family.samples:
                key = _NAMES.get(sample.name)
                if key is not None and not sample.labels:
                    out[key] = sample.value
        return out

    def sample(self) -> None:
        """Add one history point: the rates and means since the previous call."""
        now, values = self._clock(), self._read_metrics()
        last, dt = self._last, now - self._last_at
        self._last, self._last_at = values, now
        if last is None or dt <= 0:
            return
        self.history.append({
            "t": round(time.time(), 3),
            "gen_tps": round(max(values["gen"] - last["gen"], 0) / dt, 2),
            "prompt_tps": round(max(values["prompt"] - last["prompt"], 0) / dt, 2),
            "ttft_ms": _mean_ms(values["ttft_sum"], last["ttft_sum"], values["ttft_count"], last["ttft_count"]),
            "itl_ms": _mean_ms(values["itl_sum"], last["itl_sum"], values["itl_count"], last["itl_count"]),
            "preemptions": max(values["preemptions"] - last["preemptions"], 0),
            "preemptions_total": values["preemptions"],
            "running": values["running"],
            "waiting": values["waiting"],
        })
        self._bump()

    # --- the loop -------------------------------------------------------------------

    async def run(self) -> None:
        """Sample every SAMPLE_S; renew the subscription every RENEW_S while pages watch."""
        next_sample = next_renew = self._clock()
        while True:
            now = self._clock()
            if now >= next_sample:
                self.sample()
                next_sample = now + SAMPLE_S
            if self.watchers and (now >= next_renew or self._wake.is_set()):
                self._wake.clear()
                next_renew = now + RENEW_S
                try:
                    await asyncio.wait_for(self._subscribe(WatchPool(SNAPSHOT_INTERVAL_S, TTL_S)), SEND_TIMEOUT_S)
                except TimeoutError:
                    log.debug("no tokenizer replica took the dashboard subscription")
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("dashboard subscription failed")
            self.live_engines()  # forget engines that went silent
            wait = max(0.0, min(next_sample, next_renew if self.watchers else next_sample) - self._clock())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

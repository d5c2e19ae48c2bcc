"""Per-request measurements and the run summary: latencies, throughput, goodput under an SLO.

Definitions (all in seconds, measured at the client from the SSE stream):
- TTFT: request sent to the first chunk that carries text;
- ITL: every gap between consecutive text-carrying chunks;
- TPOT: (e2e - TTFT) / (output tokens - 1), for requests of 2 tokens or more;
- e2e: request sent to the chunk with `finish_reason` (or the stream's end);
- normalized latency: e2e / output tokens (the PagedAttention paper's metric; its
  summary `mean` is the paper's number).
Goodput is the rate of completed requests that meet every limit of the SLO.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2e", "normalized")


@dataclass
class RequestResult:
    index: int
    ok: bool
    prompt_len: int
    expected_output_len: int
    output_tokens: int = 0
    start: float = 0.0  # seconds after the run started
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    error: str | None = None
    status: int | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.e2e is None or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def normalized(self) -> float | None:
        if not self.ok or self.e2e is None or self.output_tokens < 1:
            return None
        return self.e2e / self.output_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "tpot": self.tpot, "normalized": self.normalized}


def parse_seconds(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(ms|s)?\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (e.g. 0.5, 500ms, 2s)")
    value = float(m.group(1))
    return value / 1000 if m.group(2) == "ms" else value


@dataclass(frozen=True)
class Slo:
    """Per-request limits; a request meets the SLO when it is within every given one."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    normalized: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        limits = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in SLO_KEYS:
                raise ValueError(f"SLO part {part!r}: expected one of {', '.join(SLO_KEYS)}=SECONDS")
            limits[key.strip()] = parse_seconds(value)
        if not limits:
            raise ValueError("empty SLO")
        return cls(**limits)

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        for key in SLO_KEYS:
            limit, value = getattr(self, key), getattr(r, key)
            # TPOT is undefined for 1-token outputs: nothing to violate.
            if limit is not None and value is not None and value > limit:
                return False
        return True

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration_s: float, slo: Slo | None = None) -> dict:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    duration = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    summary = {
        "completed": len(done),
        "failed": len(failed),
        "errors": dict(Counter(_error_kind(r) for r in failed)),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "short_outputs": sum(r.output_tokens < r.expected_output_len for r in done),
        "request_throughput": len(done) / duration,
        "input_throughput": in_tokens / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": stats([r.ttft for r in done if r.ttft is not None]),
        "tpot_s": stats([r.tpot for r in done if r.tpot is not None]),
        "itl_s": stats([gap for r in done for gap in r.itl]),
        "e2e_s": stats([r.e2e for r in done if r.e2e is not None]),
        "normalized_latency_s": stats([r.normalized for r in done if r.normalized is not None]),
    }
    if slo is not None:
        good = sum(slo.met(r) for r in results)
        summary["slo"] = slo.to_dict()
        summary["goodput"] = good / duration
        summary["slo_attainment"] = good / len(results) if results else None
    return summary


def _error_kind(r: RequestResult) -> str:
    if r.status is not None:
        return f"HTTP {r.status}"
    return (r.error or "unknown").split(":", 1)[0]

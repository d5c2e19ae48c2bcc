"""Data parallelism on a shared-prefix workload: 1 engine, 2 engines round-robin, 2 engines prefix-aware.

    .venv/bin/python -m benchmarks.scale_out [--model smollm2] [--requests 256] [--concurrency 32]
    .venv/bin/python -m benchmarks.scale_out --quick      # a smoke run on the tiny random Llama

The workload is loadgen's `prefix` dataset (a long common prefix, then a distinct suffix),
drawn from --prefixes seeds so that several system prompts interleave (each seed has its
own prefix), closed loop at --concurrency, greedy, ignore_eos. For each setup a fresh
`pagedserve serve` runs the same requests; printed: requests/s (completed requests over
the run's wall time, after a warm-up on unrelated prompts), the prefix-cache hit rate
(prompt tokens found cached over prompt tokens looked up, from /metrics; a prompt prefilled
in the same step as another with its prefix finds nothing cached yet) and how the
requests spread over the engines (loadgen's 1-token probe included). The
machine's cores are split between the engines' executors (--executor-threads), so on a
CPU two engines share the cores one engine had: the comparison is of routing, not of
added hardware. `--model` serves another model (default: the tests' tiny random Llama).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from loadgen import runner
from loadgen.datasets import WorkloadSpec, workload
from loadgen.metrics import summarize
from loadgen.targets import Target
from loadgen.tokenizer import load_tokenizer
from tests.helpers import ServerProcess, get, make_tiny_llama

SETUPS = (("1 engine", 1, "prefix"), ("2 engines round-robin", 2, "round-robin"),
          ("2 engines prefix-aware", 2, "prefix"))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model to serve (default: a tiny random Llama)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prefixes", type=int, default=4, help="system prompts (prefix dataset seeds) interleaved")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32, help="tokens after the prefix")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--quick", action="store_true", help="32 requests of 8 tokens, concurrency 8: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.output_len, args.prefix_len = 32, 8, 8, 64
    return args


def requests(args, tokenizer) -> list:
    """--requests from --prefixes prefix-dataset streams, interleaved at random (seeded)."""
    streams = [workload(WorkloadSpec("prefix", seed=args.seed + k, input_len=args.input_len,
                                     output_len=args.output_len, prefix_len=args.prefix_len), tokenizer)
               for k in range(args.prefixes)]
    rng = random.Random(args.seed)
    return [next(streams[rng.randrange(len(streams))]) for _ in range(args.requests)]


def wait_engines(url: str, n: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engines = json.loads(get(url + "/health")[1]).get("engines", {})
        if n == 1 or sum(e["serving"] for e in engines.values()) >= n:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{n} engines not serving after {timeout_s} s")


def measure(name: str, engines: int, routing: str, model, work: list, args, tmp: Path, tokenizer) -> dict:
    threads = max(1, (os.cpu_count() or 2) // engines)
    extra = ["--dtype", args.dtype, "--data-parallel-size", str(engines), "--routing", routing,
             "--executor-threads", str(threads)]  # after ServerProcess's own: this one counts
    run_dir = tmp / name.replace(" ", "-")
    run_dir.mkdir()
    with ServerProcess(model, run_dir, extra, startup_timeout=600) as server:
        wait_engines(server.url, engines)
        target = Target(name=name, url=server.url)
        # warm every engine up (first steps are slow) on prompts that share nothing with the run's
        warm = workload(WorkloadSpec("random", seed=args.seed + 1000, input_len=args.input_len, output_len=4),
                        tokenizer)
        runner.run(target, warm, runner.LoadConfig(concurrency=4, num_requests=8 * engines, progress=False))
        before = server.metrics()
        config = runner.LoadConfig(concurrency=args.concurrency, num_requests=len(work), seed=args.seed,
                                   progress=False)
        outcome = runner.run(target, iter(work), config, tokenizer=tokenizer)
        after = server.metrics()
    summary = summarize(outcome.results, outcome.duration_s)
    queries = after.get("pagedserve_prefix_cache_queries_total", 0) - before.get("pagedserve_prefix_cache_queries_total", 0)
    hits = after.get("pagedserve_prefix_cache_hits_total", 0) - before.get("pagedserve_prefix_cache_hits_total", 0)
    spread = {k.split('"')[1]: int(v - before.get(k, 0)) for k, v in after.items()
              if k.startswith("pagedserve_engine_requests_routed_total{")}
    return {"setup": name, "engines": engines, "routing": routing if engines > 1 else None,
            "executor_threads": threads, "completed": summary["completed"], "failed": summary["failed"],
            "duration_s": round(outcome.duration_s, 2), "requests_per_s": round(summary["request_throughput"], 3),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "requests_per_engine": spread or {"engine-0": summary["completed"]}}


def main() -> int:
    args = parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or make_tiny_llama(tmp / "tiny-llama")
        tokenizer = load_tokenizer(str(model))
        work = requests(args, tokenizer)
        for name, engines, routing in SETUPS:
            results.append(measure(name, engines, routing, model, work, args, tmp, tokenizer))
            r = results[-1]
            print(f"{name:24s} {r['requests_per_s']:8.2f} req/s   prefix-cache hit rate "
                  f"{r['prefix_cache_hit_rate']}   completed {r['completed']}/{len(work)}   "
                  f"per engine {r['requests_per_engine']}", flush=True)
    info = {"model": str(args.model or "tiny random Llama"), "requests": args.requests,
            "concurrency": args.concurrency, "prefixes": args.prefixes, "prefix_len": args.prefix_len,
            "input_len": args.input_len, "output_len": args.output_len, "cores": os.cpu_count(),
            "results": results}
    print(json.dumps(info, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

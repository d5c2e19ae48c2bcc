"""Scaling out: data parallelism on a shared-prefix workload (1 engine, 2 engines round-robin,
2 engines prefix-aware), and tensor parallelism's decode step time (TP 1 vs 2).

    .venv/bin/python -m benchmarks.scale_out [--model smollm2] [--requests 256] [--concurrency 32]
    .venv/bin/python -m benchmarks.scale_out --quick      # a smoke run on the tiny random Llama
    .venv/bin/python -m benchmarks.scale_out --parts tp --model smollm2   # only TP 1 vs 2
    python -m benchmarks.scale_out --dynamo --parts dp    # also 2 engines behind Dynamo's KV router

The workload is loadgen's `prefix` dataset (a long common prefix, then a distinct suffix),
drawn from --prefixes seeds so that several system prompts interleave (each seed has its
own prefix), closed loop at --concurrency, greedy, ignore_eos. For each setup a fresh
`pagedserve serve` runs the same requests; printed: requests/s (completed requests over
the run's wall time, after a warm-up on unrelated prompts), the prefix-cache hit rate
(prompt tokens found cached over prompt tokens looked up, from /metrics once the engines'
heartbeats have counted the last steps; a prompt prefilled in the same step as another
with its prefix finds nothing cached yet, which prefix-aware routing avoids by holding
such a request until the first one's prefill has run) and how the
requests spread over the engines (loadgen's 1-token probe included). The
machine's cores are split between the engines' executors (--executor-threads), so on a
CPU two engines share the cores one engine had: the comparison is of routing, not of
added hardware. `--model` serves another model (default: the tests' tiny random Llama).

With `--dynamo` (the `dynamo` extra installed: README, Dynamo) a fourth setup runs the same
requests through NVIDIA Dynamo's frontend with its KV router (`--router-mode kv`, file
discovery, loopback) in front of two `pagedserve serve --dynamo` workers, each relaying its
scheduler's KV events; its hit rate and spread come from the workers' own counters (their
Dynamo status servers' /metrics). Dynamo's frontend tokenizes and detokenizes in its own
process, so on a 2-core host it competes with the engines for the cores.

Tensor parallelism (`--parts tp`): for each of --tp-sizes a fresh server with
`--tensor-parallel-size N` (gloo ranks on the CPU, the cores split between the ranks as
above) serves --tp-requests greedy requests of random prompts at --tp-concurrency;
printed: the mean decode-only step time and its forward-pass part (the scheduler's
counters on /metrics) and output tokens/s. On a CPU the ranks share the cores one
process had and add an all-reduce per layer and a gather of the logits, so expect TP 2
to be *slower* (on 2 cores much slower): TP is for a model too big for one device, not
for speed on one CPU. With a single GPU, TP 1 vs 2 cannot be measured (NCCL wants one
GPU per rank); it needs a machine with two.
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
from loadgen.tokenizer import tokenizer_for
from tests.helpers import ServerProcess, get, make_tiny_llama

SETUPS = (("1 engine", 1, "prefix"), ("2 engines round-robin", 2, "round-robin"),
          ("2 engines prefix-aware", 2, "prefix"))
PARTS = ("dp", "tp")


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
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="dp: 1 vs 2 engines (routing); tp: tensor-parallel sizes' step time")
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tp-requests", type=int, default=64)
    p.add_argument("--tp-concurrency", type=int, default=8, help="the decode batch")
    p.add_argument("--quantization", default=None, choices=["auto", "int4", "none"],
                   help="passed to every server (default: serve's own)")
    p.add_argument("--dynamo", action="store_true",
                   help="also 2 engines behind NVIDIA Dynamo's KV router (pagedserve serve --dynamo workers)")
    p.add_argument("--quick", action="store_true", help="32 requests of 8 tokens, concurrency 8: a smoke run")
    args = p.parse_args()
    if args.quick:
        args.requests, args.concurrency, args.output_len, args.prefix_len = 32, 8, 8, 64
        args.tp_requests, args.tp_concurrency = 8, 4
    return args


def quantization(args) -> list[str]:
    return [] if args.quantization is None else ["--quantization", args.quantization]


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


def settled_metrics(server, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics once nothing runs and the prefix-cache counters stopped moving: the figures
    come from heartbeats (every 0.25 s), so a read right after the last answer misses its steps."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        m = server.metrics()
        now = (m.get("pagedserve_num_requests_running"), m.get("pagedserve_prefix_cache_queries_total"))
        if now == last and not now[0] or time.monotonic() > deadline:
            return m
        last = now
        time.sleep(0.6)


def measure(name: str, engines: int, routing: str, model, work: list, args, tmp: Path, tokenizer) -> dict:
    threads = max(1, (os.cpu_count() or 2) // engines)
    extra = ["--dtype", args.dtype, "--data-parallel-size", str(engines), "--routing", routing,
             "--executor-threads", str(threads), *quantization(args)]  # after ServerProcess's own: this one counts
    run_dir = tmp / name.replace(" ", "-")
    run_dir.mkdir()
    with ServerProcess(model, run_dir, extra, startup_timeout=600) as server:
        wait_engines(server.url, engines)
        target = Target(name=name, url=server.url)
        # warm every engine up (first steps are slow) on prompts that share nothing with the run's
        warm = workload(WorkloadSpec("random", seed=args.seed + 1000, input_len=args.input_len, output_len=4),
                        tokenizer)
        runner.run(target, warm, runner.LoadConfig(concurrency=4, num_requests=8 * engines, progress=False))
        before = settled_metrics(server)
        config = runner.LoadConfig(concurrency=args.concurrency, num_requests=len(work), seed=args.seed,
                                   progress=False)
        outcome = runner.run(target, iter(work), config, tokenizer=tokenizer)
        after = settled_metrics(server)
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


def measure_dynamo(model, work: list, args, tmp: Path, tokenizer) -> dict:
    """Two `pagedserve serve --dynamo` workers behind Dynamo's frontend and KV router."""
    from tests.dynamo_cluster import DynamoCluster

    name, engines = "2 engines Dynamo KV router", 2
    threads = max(1, (os.cpu_count() or 2) // engines)
    run_dir = tmp / "dynamo"
    run_dir.mkdir()
    extra = ["--dtype", args.dtype, *quantization(args)]
    with DynamoCluster(model, run_dir, workers=engines, extra=extra, executor_threads=threads,
                       startup_timeout_s=600) as cluster:
        target = Target(name=name, url=cluster.url)
        warm = workload(WorkloadSpec("random", seed=args.seed + 1000, input_len=args.input_len, output_len=4),
                        tokenizer)
        runner.run(target, warm, runner.LoadConfig(concurrency=4, num_requests=8 * engines, progress=False))
        time.sleep(1.0)  # the workers' counters come from heartbeats (every 0.25 s)
        before = [cluster.metrics(i) for i in range(engines)]
        config = runner.LoadConfig(concurrency=args.concurrency, num_requests=len(work), seed=args.seed,
                                   progress=False)
        outcome = runner.run(target, iter(work), config, tokenizer=tokenizer)
        time.sleep(1.0)
        after = [cluster.metrics(i) for i in range(engines)]
    summary = summarize(outcome.results, outcome.duration_s)

    def delta(i: int, key: str) -> float:
        return after[i].get(key, 0.0) - before[i].get(key, 0.0)

    queries = sum(delta(i, "pagedserve_prefix_cache_queries_total") for i in range(engines))
    hits = sum(delta(i, "pagedserve_prefix_cache_hits_total") for i in range(engines))
    return {"setup": name, "engines": engines, "routing": "dynamo-kv", "executor_threads": threads,
            "completed": summary["completed"], "failed": summary["failed"],
            "duration_s": round(outcome.duration_s, 2), "requests_per_s": round(summary["request_throughput"], 3),
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
            "requests_per_engine": {f"engine-{i}": int(delta(i, "pagedserve_dynamo_requests_total"))
                                    for i in range(engines)}}


def measure_tp(size: int, model, args, tmp: Path, tokenizer) -> dict:
    """Decode step time with the executor split over `size` ranks, the cores split between them."""
    threads = max(1, (os.cpu_count() or 2) // size)
    extra = ["--dtype", args.dtype, "--tensor-parallel-size", str(size), "--executor-threads", str(threads),
             *quantization(args)]
    run_dir = tmp / f"tp-{size}"
    run_dir.mkdir()
    spec = WorkloadSpec("random", seed=args.seed, input_len=args.input_len, output_len=args.output_len)
    with ServerProcess(model, run_dir, extra, startup_timeout=600) as server:
        target = Target(name=f"TP {size}", url=server.url)
        warm = workload(WorkloadSpec("random", seed=args.seed + 1000, input_len=args.input_len, output_len=4),
                        tokenizer)
        runner.run(target, warm, runner.LoadConfig(concurrency=4, num_requests=8, progress=False))
        before = server.metrics()
        config = runner.LoadConfig(concurrency=args.tp_concurrency, num_requests=args.tp_requests, seed=args.seed,
                                   progress=False)
        outcome = runner.run(target, workload(spec, tokenizer), config, tokenizer=tokenizer)
        after = server.metrics()
    summary = summarize(outcome.results, outcome.duration_s)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    steps = delta("pagedserve_decode_steps_total")
    return {"setup": f"TP {size}", "tensor_parallel_size": size, "executor_threads_per_rank": threads,
            "completed": summary["completed"], "failed": summary["failed"], "decode_steps": int(steps),
            "decode_step_ms": round(1e3 * delta("pagedserve_decode_step_seconds_total") / steps, 3) if steps else None,
            "decode_forward_ms": round(1e3 * delta("pagedserve_decode_forward_seconds_total") / steps, 3)
            if steps else None,
            "output_tokens_per_s": round(summary.get("output_throughput", 0.0), 2)}


def main() -> int:
    args = parse_args()
    results, tp_results = [], []
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp_name:
        tmp = Path(tmp_name)
        model = args.model or make_tiny_llama(tmp / "tiny-llama")
        tokenizer = tokenizer_for(str(model))
        work = requests(args, tokenizer)
        setups = [*SETUPS, ("dynamo", 2, "dynamo-kv")] if args.dynamo else SETUPS
        for name, engines, routing in setups if "dp" in args.parts else ():
            if routing == "dynamo-kv":
                results.append(measure_dynamo(model, work, args, tmp, tokenizer))
            else:
                results.append(measure(name, engines, routing, model, work, args, tmp, tokenizer))
            r = results[-1]
            name = r["setup"]
            print(f"{name:24s} {r['requests_per_s']:8.2f} req/s   prefix-cache hit rate "
                  f"{r['prefix_cache_hit_rate']}   completed {r['completed']}/{len(work)}   "
                  f"per engine {r['requests_per_engine']}", flush=True)
        for size in args.tp_sizes if "tp" in args.parts else ():
            tp_results.append(measure_tp(size, model, args, tmp, tokenizer))
            r = tp_results[-1]
            print(f"TP {size:<21d} decode step {r['decode_step_ms']} ms (forward {r['decode_forward_ms']} ms)   "
                  f"{r['output_tokens_per_s']} output tok/s   completed {r['completed']}/{args.tp_requests}",
                  flush=True)
    info = {"model": str(args.model or "tiny random Llama"), "requests": args.requests,
            "concurrency": args.concurrency, "prefixes": args.prefixes, "prefix_len": args.prefix_len,
            "input_len": args.input_len, "output_len": args.output_len, "cores": os.cpu_count(),
            "results": results, "tp_requests": args.tp_requests, "tp_concurrency": args.tp_concurrency,
            "tp_results": tp_results}
    print(json.dumps(info, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=2))
    return 0 if all(r["failed"] == 0 for r in results + tp_results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

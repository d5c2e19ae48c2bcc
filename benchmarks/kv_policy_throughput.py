"""Served SmolLM2 with a small KV pool: `--kv-policy paged` against `reserve-max`.

The same requests (ignore_eos, fixed output length, greedy) go to a server with each
policy in turn, alternating and repeated; it prints output tokens/s per run, the
medians and their ratio, and the mean number of running requests the scheduler
reported. reserve-max reserves max_model_len slots per request up front, as Orca
(Max) and FasterTransformer do, so a small pool holds few requests at a time.

    python -m benchmarks.kv_policy_throughput [--kv-cache-memory 200MiB] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time

from benchmarks.bench_generate import (
    make_prompts,
    read_metrics,
    run_engine,
    start_server,
    stop_server,
)
from shared.ports import free_port


def sample_running(url: str, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        try:
            out.append(read_metrics(url)["pagedserve_num_requests_running"])
        except (OSError, KeyError):
            pass
        stop.wait(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-memory", default="200MiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    prompts = make_prompts(args.num_prompts, args.input_len, seed=1)
    results: dict[str, list[float]] = {"paged": [], "reserve-max": []}
    running: dict[str, list[float]] = {"paged": [], "reserve-max": []}
    for r in range(args.repeats):
        for policy in results:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start_server(port, args.threads, ["--kv-policy", policy, "--kv-cache-memory", args.kv_cache_memory,
                                                     "--max-model-len", str(args.max_model_len), "--dtype", args.dtype])
            try:
                asyncio.run(run_engine(url, "SmolLM2-135M-Instruct", prompts[:2], 2, 2))  # warm-up
                stop, samples = threading.Event(), []
                watcher = threading.Thread(target=sample_running, args=(url, stop, samples), daemon=True)
                watcher.start()
                secs, toks = asyncio.run(run_engine(url, "SmolLM2-135M-Instruct", prompts, args.output_len,
                                                    args.concurrency))
                stop.set()
                watcher.join()
                blocks = read_metrics(url)["pagedserve_kv_blocks_total"]
            finally:
                stop_server(proc)
            results[policy].append(toks / secs)
            busy = [s for s in samples if s > 0]
            running[policy].append(statistics.mean(busy) if busy else 0.0)
            print(f"run {r + 1} {policy:12} {toks / secs:7.1f} output tok/s ({toks} tokens in {secs:.1f}s), "
                  f"mean running {running[policy][-1]:.1f}, pool {blocks:.0f} blocks", flush=True)
            time.sleep(1)
    paged, reserve = statistics.median(results["paged"]), statistics.median(results["reserve-max"])
    print(f"\nSmolLM2, {args.dtype}, KV pool {args.kv_cache_memory}, max_model_len {args.max_model_len}, "
          f"{args.num_prompts} requests x {args.input_len} in / {args.output_len} out at concurrency "
          f"{args.concurrency}, {args.repeats} alternating runs (medians)")
    print(f"  paged        {paged:8.1f} output tok/s, mean running {statistics.median(running['paged']):.1f}")
    print(f"  reserve-max  {reserve:8.1f} output tok/s, mean running {statistics.median(running['reserve-max']):.1f}")
    print(f"  ratio paged / reserve-max  {paged / reserve:.2f}x")


if __name__ == "__main__":
    main()

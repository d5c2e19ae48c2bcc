"""Throughput of the served engine against transformers' generate, side by side.

The same 64 prompts (100 tokens in, 128 out, greedy, ignore_eos) go to a pagedserve
server at concurrency 32, and through `generate` in batches of 32, both in bfloat16.
Runs alternate and repeat; it prints the median output tokens/s of each, their ratio,
and the share of a decode step's wall time spent outside the model's forward pass.

    python -m benchmarks.bench_generate [--url http://127.0.0.1:8000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

import aiohttp

from shared.ports import free_port


def make_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 49000) for _ in range(length)] for _ in range(n)]


def read_metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


async def run_engine(url: str, model: str, prompts, max_tokens: int, concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    produced = 0

    async def one(session, prompt):
        nonlocal produced
        async with sem:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(data)
                produced += data["usage"]["completion_tokens"]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        return time.perf_counter() - t0, produced


def run_hf(model, prompts, max_tokens: int, batch_size: int) -> tuple[float, int]:
    import torch

    produced = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            ids = torch.tensor(prompts[i : i + batch_size])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return time.perf_counter() - t0, produced


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(30)


def start_server(port: int, threads: int, extra: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", "smollm2", "--dtype", "bfloat16",
           "--port", str(port), "--executor-threads", str(threads), "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(cmd, start_new_session=True)
    for _ in range(600):
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    raise RuntimeError("server did not become healthy")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server; default: start one")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from shared.model_files import resolve_model

    torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts, args.input_len, seed=0)
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        proc = start_server(port, args.threads)
        url = f"http://127.0.0.1:{port}"
    try:
        hf = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=torch.bfloat16)
        asyncio.run(run_engine(url, args.model_name, prompts[:4], 4, 4))  # warm-up
        run_hf(hf, prompts[:2], 2, 2)
        engine_tps, hf_tps, outside = [], [], []
        for r in range(args.repeats):
            before = read_metrics(url)
            secs, toks = asyncio.run(run_engine(url, args.model_name, prompts, args.output_len, args.concurrency))
            after = read_metrics(url)
            engine_tps.append(toks / secs)
            wall = after["pagedserve_decode_step_seconds_total"] - before["pagedserve_decode_step_seconds_total"]
            fwd = after["pagedserve_decode_forward_seconds_total"] - before["pagedserve_decode_forward_seconds_total"]
            outside.append(1 - fwd / wall if wall > 0 else float("nan"))
            secs_hf, toks_hf = run_hf(hf, prompts, args.output_len, args.concurrency)
            hf_tps.append(toks_hf / secs_hf)
            print(f"run {r + 1}: pagedserve {engine_tps[-1]:.1f} tok/s ({toks} tokens in {secs:.1f}s), "
                  f"generate {hf_tps[-1]:.1f} tok/s ({toks_hf} tokens in {secs_hf:.1f}s), "
                  f"decode step outside forward {outside[-1]:.1%}", flush=True)
        e, h = statistics.median(engine_tps), statistics.median(hf_tps)
        print(f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, greedy, bfloat16, "
              f"batch/concurrency {args.concurrency}, {args.repeats} alternating runs (medians)")
        print(f"  pagedserve (HTTP, 4 processes)   {e:8.1f} output tok/s")
        print(f"  transformers generate            {h:8.1f} output tok/s")
        print(f"  ratio pagedserve / generate      {e / h:8.2f}x")
        print(f"  decode step wall time outside the forward pass: {statistics.median(outside):.1%}")
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    main()

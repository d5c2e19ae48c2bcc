"""Serving throughput through the whole stack: `pagedserve serve` as real processes, a short load over HTTP.

Random token-id prompts (greedy, ignore_eos, so every request makes exactly
max_tokens) go to /v1/completions at a fixed concurrency; the figure is output
tokens over the load's wall time.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from shared.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "bench"


@dataclass
class Load:
    prompts: int
    input_len: int
    output_len: int
    concurrency: int


def start_server(port: int, extra: list[str], timeout_s: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "services.cli", "serve", "--model", "smollm2", "--port", str(port),
           "--served-model-name", SERVED_NAME, "--log-level", "WARNING", *extra]
    print("  $ python " + " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} at start-up")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f}s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def run_load(url: str, load: Load, seed: int = 0) -> tuple[float, int]:
    """(seconds, output tokens) for the whole load."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(200, 49000) for _ in range(load.input_len)] for _ in range(load.prompts)]
    sem = asyncio.Semaphore(load.concurrency)
    produced = 0

    async def one(session: aiohttp.ClientSession, prompt: list[int]) -> None:
        nonlocal produced
        async with sem:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": load.output_len, "temperature": 0,
                    "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=body) as resp:
                data = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {data}")
                produced += data["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(one(session, p) for p in prompts))
        return time.perf_counter() - start, produced


def serve_and_measure(server_args: list[str], load: Load, startup_timeout_s: float = 900) -> float:
    """Output tokens/s of `load` against a fresh server started with server_args."""
    port = free_port()
    proc = start_server(port, server_args, startup_timeout_s)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run_load(url, Load(min(load.concurrency, 4), 8, 4, 4), seed=1))  # warm-up
        seconds, tokens = asyncio.run(run_load(url, load))
    finally:
        stop_server(proc)
    rate = tokens / seconds
    print(f"  {load.prompts} prompts x {load.input_len} tokens in, {load.output_len} out, concurrency "
          f"{load.concurrency}: {tokens} output tokens in {seconds:.1f}s = {rate:.1f} output tokens/s", flush=True)
    return rate

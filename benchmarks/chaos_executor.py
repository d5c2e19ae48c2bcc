"""Chaos run: greedy load against `pagedserve serve` with the executor killed (kill -9) in
the middle, compared with an undisturbed run of the same requests on the same server.

    .venv/bin/python -m benchmarks.chaos_executor --tiny --requests 200 --kills 2

Prints requests sent, completed, failed, and how many completed outputs (token ids)
equal the undisturbed run's, then the same as JSON. `--tiny` builds the tests' 2-layer
random Llama (SmolLM2's tokenizer) in a temporary directory; `--model` serves any
other. The k-th kill comes once k/(kills+1) of the requests are done, each on the
executor that the launcher started after the previous kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import aiohttp

from tests.helpers import ServerProcess, make_tiny_llama, stage_pid


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to serve (default: --tiny)")
    parser.add_argument("--tiny", action="store_true", help="serve a tiny random Llama built for the run")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args()


def make_bodies(n: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(3, 49152) for _ in range(rng.randrange(4, 48))], "max_tokens": max_tokens,
             "temperature": 0, "ignore_eos": True, "return_token_ids": True} for _ in range(n)]


class Load:
    """Sends every body with bounded concurrency; records each outcome as it lands."""

    def __init__(self, url: str, bodies: list[dict], concurrency: int):
        self.url, self.bodies = url, bodies
        self.semaphore = asyncio.Semaphore(concurrency)
        self.outcomes: list[tuple[int, object] | None] = [None] * len(bodies)
        self.done = 0

    async def _one(self, session: aiohttp.ClientSession, i: int) -> None:
        async with self.semaphore:
            try:
                async with session.post(self.url + "/v1/completions", json=self.bodies[i]) as resp:
                    data = await resp.json()
                    ok = resp.status == 200
                    self.outcomes[i] = (resp.status, data["choices"][0]["token_ids"] if ok else data["error"])
            except (TimeoutError, aiohttp.ClientError) as exc:
                self.outcomes[i] = (0, repr(exc))
            self.done += 1

    async def run(self) -> list[tuple[int, object]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await asyncio.gather(*(self._one(session, i) for i in range(len(self.bodies))))
        return self.outcomes


async def wait_new_executor(url: str, old_pid: int | None, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = await asyncio.to_thread(stage_pid, url, "executor")
            if pid != old_pid:
                return pid
        except (AssertionError, OSError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("no new executor came up")


async def chaos(url: str, bodies: list[dict], concurrency: int, kills: int) -> tuple[list, list[dict]]:
    load = Load(url, bodies, concurrency)
    task = asyncio.create_task(load.run())
    events, pid = [], await wait_new_executor(url, None)
    for k in range(1, kills + 1):
        while load.done < len(bodies) * k / (kills + 1):
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        killed_at, done_at_kill = time.monotonic(), load.done
        pid = await wait_new_executor(url, pid)
        events.append({"kill": k, "completed_before": done_at_kill,
                       "executor_back_after_s": round(time.monotonic() - killed_at, 2)})
    return await task, events


def report(reference: list, disturbed: list, events: list[dict], wall_s: float, preemptions: float) -> dict:
    completed = [i for i, (status, _) in enumerate(disturbed) if status == 200]
    matched = sum(1 for i in completed if disturbed[i][1] == reference[i][1])
    return {
        "requests_sent": len(disturbed),
        "completed": len(completed),
        "failed": len(disturbed) - len(completed),
        "failures": [d for d in disturbed if d[0] != 200][:5],
        "outputs_equal_to_undisturbed_run": matched,
        "all_outputs_match": matched == len(completed) == len(disturbed),
        "reference_all_ok": all(status == 200 for status, _ in reference),
        "kills": events,
        "preemptions_during_chaos": preemptions,
        "chaos_wall_s": round(wall_s, 1),
    }


def main() -> int:
    args = parse_args()
    bodies = make_bodies(args.requests, args.max_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        model = args.model or make_tiny_llama(Path(tmp) / "tiny-llama")
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        with ServerProcess(model, run_dir, ["--dtype", args.dtype]) as server:
            reference = asyncio.run(Load(server.url, bodies, args.concurrency).run())
            before = server.metrics()["pagedserve_num_preemptions_total"]
            started = time.monotonic()
            disturbed, events = asyncio.run(chaos(server.url, bodies, args.concurrency, args.kills))
            wall_s = time.monotonic() - started
            preemptions = server.metrics()["pagedserve_num_preemptions_total"] - before
    result = report(reference, disturbed, events, wall_s, preemptions)
    print(f"sent {result['requests_sent']}, completed {result['completed']}, failed {result['failed']}, "
          f"outputs equal to the undisturbed run: {result['outputs_equal_to_undisturbed_run']}"
          f"/{result['completed']} (executor killed {len(events)} times)")
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["all_outputs_match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

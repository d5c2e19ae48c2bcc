"""Drive one run: warm-up, then open-loop arrivals or a closed loop, bounded in count and time.

Open loop (`request_rate`): requests leave at the arrival times of arrivals.py whatever
the server's state, as users would send them; `max_concurrency` optionally caps how many
are in flight. Closed loop (`concurrency`): C clients each send their next request when
the previous one ends. Either stops after `num_requests`, or when `duration` seconds of
arrivals have passed; `deadline` cancels whatever is still in flight and counts it failed.
Warm-up requests come from their own seeded stream and are not counted.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import aiohttp

from loadgen import client
from loadgen.arrivals import arrival_times
from loadgen.datasets import Request
from loadgen.metrics import RequestResult
from loadgen.targets import Target, prepare
from loadgen.tokenizer import Tokenizer


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration: float | None = None
    warmup: int = 0
    seed: int = 0
    temperature: float = 0.0
    timeout: float = 600.0
    deadline: float | None = None
    progress: bool = True

    def check(self) -> None:
        if (self.request_rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of request rate and concurrency")
        if self.num_requests is None and self.duration is None:
            raise ValueError("give a number of requests, a duration, or both")
        if self.request_rate is not None and math.isinf(self.request_rate) and self.num_requests is None:
            raise ValueError("an infinite request rate needs a number of requests")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")


@dataclass
class RunOutcome:
    target: Target
    results: list[RequestResult]
    duration_s: float


class _Run:
    def __init__(self, session: aiohttp.ClientSession, target: Target, config: LoadConfig,
                 tokenizer: Tokenizer | None) -> None:
        self.session, self.target, self.config, self.tokenizer = session, target, config, tokenizer
        self.results: list[RequestResult] = []
        self.inflight: dict[int, tuple[Request, float]] = {}
        self.t0 = 0.0
        self.bar = None

    async def one(self, index: int, req: Request) -> RequestResult:
        cfg = self.config
        self.inflight[index] = (req, time.perf_counter() - self.t0)
        seed = cfg.seed * 1_000_003 + index if cfg.temperature > 0 else None
        result = await client.send(self.session, self.target, req, index, self.t0, temperature=cfg.temperature,
                                   seed=seed, timeout=cfg.timeout, tokenizer=self.tokenizer)
        del self.inflight[index]  # a cancelled request stays here, for measured() to count
        self.results.append(result)
        if self.bar is not None:
            self.bar.update(1)
            if not result.ok:
                self.bar.set_postfix(failed=sum(not r.ok for r in self.results))
        return result

    async def open_loop(self, requests: Iterator[Request]) -> None:
        cfg = self.config
        limit = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        tasks = []

        async def limited(i: int, req: Request) -> None:
            self.inflight[i] = (req, time.perf_counter() - self.t0)  # counted if cancelled while queued
            if limit is None:
                await self.one(i, req)
                return
            async with limit:
                await self.one(i, req)

        times = arrival_times(cfg.request_rate, cfg.burstiness, cfg.seed)  # infinite
        try:
            for i, (req, at) in enumerate(zip(requests, times, strict=False)):
                if cfg.num_requests is not None and i >= cfg.num_requests:
                    break
                if cfg.duration is not None and at > cfg.duration:
                    break
                delay = self.t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(limited(i, req)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def closed_loop(self, requests: Iterator[Request]) -> None:
        cfg = self.config
        numbered = iter(enumerate(requests))

        async def user() -> None:
            while True:
                if cfg.duration is not None and time.perf_counter() - self.t0 >= cfg.duration:
                    return
                item = next(numbered, None)
                if item is None or (cfg.num_requests is not None and item[0] >= cfg.num_requests):
                    return
                await self.one(*item)

        await asyncio.gather(*(user() for _ in range(cfg.concurrency)))

    async def measured(self, requests: Iterator[Request]) -> float:
        cfg = self.config
        self.t0 = time.perf_counter()
        body = self.closed_loop(requests) if cfg.concurrency else self.open_loop(requests)
        try:
            await asyncio.wait_for(body, cfg.deadline)
        except TimeoutError:
            for index, (req, started) in sorted(self.inflight.items()):
                self.results.append(RequestResult(index=index, ok=False, prompt_len=req.prompt_len,
                                                  expected_output_len=req.output_len, start=started,
                                                  error=f"cancelled: run deadline of {cfg.deadline:g}s"))
        return time.perf_counter() - self.t0


async def run_async(target: Target, requests: Iterable[Request], config: LoadConfig,
                    warmup: Iterable[Request] = (), tokenizer: Tokenizer | None = None) -> RunOutcome:
    config.check()
    # No client-side cap (the load shape decides), and a fresh connection per request, as vLLM's
    # benchmark has: llama.cpp's HTTP server closes a kept-alive connection after a few requests,
    # and a request written to one it just closed would fail through no fault of the server.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        target = await prepare(target, session)
        await _warmup(session, target, list(itertools.islice(warmup, config.warmup)), config)
        run = _Run(session, target, config, tokenizer)
        if config.progress:
            from tqdm import tqdm

            run.bar = tqdm(total=config.num_requests, desc=target.name, unit="req", leave=False)
        try:
            duration = await run.measured(iter(requests))
        finally:
            if run.bar is not None:
                run.bar.close()
    results = sorted(run.results, key=lambda r: r.index)
    return RunOutcome(target=target, results=results, duration_s=duration)


async def _warmup(session: aiohttp.ClientSession, target: Target, requests: list[Request], config: LoadConfig) -> None:
    gate = asyncio.Semaphore(min(4, config.concurrency or 4))

    async def one(i: int, req: Request) -> None:
        async with gate:
            await client.send(session, target, req, -1 - i, time.perf_counter(), temperature=config.temperature,
                              timeout=config.timeout)

    await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))


def run(target: Target, requests: Iterable[Request], config: LoadConfig, warmup: Iterable[Request] = (),
        tokenizer: Tokenizer | None = None) -> RunOutcome:
    return asyncio.run(run_async(target, requests, config, warmup, tokenizer))

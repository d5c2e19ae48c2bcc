"""Chaos run: a mixed load against `pagedserve serve` while the stages fail under it, compared
with an undisturbed run of the same requests on the same server.

    .venv/bin/python -m benchmarks.chaos --requests 300

The load (seeded): greedy requests whole and streamed, seeded sampled streams, n = 2
seeded samples, beam search, clients that disconnect after a few chunks and clients
that read slowly, all with ignore_eos so every answer's length is known. While it runs,
one at a time once the server is healthy again: the executor is killed (kill -9), a
tokenizer replica is frozen (SIGSTOP) for --freeze-s seconds, the other replica is
killed, and the scheduler is killed. Beside the load, both runs send issue 19's attacks
(`tests.e2e.attacks`: constraints that leave no token, a 256-sample step-size attack,
schemas too deep, big or slow, the request limits, a rebound Host, tenant salts) round
after round. Prints requests sent, completed, failed with an error, disconnected on
purpose, hung (no end within --hang-s: must be 0), lost tokens (tokens missing from
completed answers: must be 0) and whether the deterministic outputs (greedy, beams,
seeded, n = 2 seeded) equal the undisturbed run's; then the attacks sent, answered as
expected, hung, and (during the chaos run) answered otherwise while a stage was down;
then the same as JSON. Exits 1 when a request or attack hung, a token was lost, a
deterministic output differs, or an attack of the undisturbed run got another answer.
`--model` serves another model (default: the tests' tiny random Llama, built for the run).
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

from tests.e2e.attacks import attacks, problem, send
from tests.helpers import ServerProcess, get, make_tiny_llama, sse_events

KINDS = {  # share of the load
    "greedy": 0.25, "greedy_stream": 0.2, "seeded_stream": 0.1, "n2_seeded": 0.1, "beam": 0.1,
    "disconnect": 0.1, "slow_reader": 0.15,
}
DETERMINISTIC = {"greedy", "greedy_stream", "seeded_stream", "n2_seeded", "beam", "slow_reader"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model to serve (default: a tiny random Llama)")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--freeze-s", type=float, default=10.0)
    parser.add_argument("--hang-s", type=float, default=180.0, help="a request with no end after this has hung")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args()


def make_requests(n: int, max_tokens: int, seed: int) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=n)
    out = []
    for i, kind in enumerate(kinds):
        body = {"prompt": [rng.randrange(3, 49152) for _ in range(rng.randrange(4, 40))],
                "max_tokens": rng.randrange(max_tokens // 2, max_tokens + 1), "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        if kind in ("greedy_stream", "seeded_stream", "disconnect", "slow_reader"):
            body["stream"] = True
        if kind == "seeded_stream":
            body.update(temperature=0.9, seed=1000 + i)
        elif kind == "n2_seeded":
            body.update(temperature=0.8, seed=2000 + i, n=2)
        elif kind == "beam":
            body.update(use_beam_search=True, beam_width=2)
        elif kind == "disconnect":
            body["max_tokens"] = 4 * max_tokens
        out.append((kind, body))
    return out


class Load:
    """Sends every request with bounded concurrency; records how each one ended."""

    def __init__(self, url: str, requests: list[tuple[str, dict]], concurrency: int, hang_s: float):
        self.url, self.requests, self.hang_s = url, requests, hang_s
        self.semaphore = asyncio.Semaphore(concurrency)
        self.outcomes: list[dict | None] = [None] * len(requests)
        self.done = 0

    async def _whole(self, session, body) -> dict:
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            data = await resp.json()
        if resp.status != 200:
            return {"end": "error", "status": resp.status, "error": data.get("error")}
        choices = sorted(data["choices"], key=lambda c: c["index"])
        return {"end": "completed", "ids": [c["token_ids"] for c in choices]}

    async def _stream(self, session, body, kind: str) -> dict:
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return {"end": "error", "status": resp.status, "error": (await resp.json()).get("error")}
            raw, chunks = b"", 0
            async for line in resp.content:
                raw += line
                if line.startswith(b"data: {"):
                    chunks += 1
                    if kind == "disconnect" and chunks == 3:
                        return {"end": "disconnected"}  # leaving the block closes the connection
                    if kind == "slow_reader":
                        await asyncio.sleep(0.05)
        ids, error = [], None
        for event in sse_events(raw.decode()):
            error = event.get("error", error)
            for choice in event.get("choices", []):
                ids += choice.get("token_ids", [])
        if error is not None or not raw.rstrip().endswith(b"data: [DONE]"):
            return {"end": "error", "status": 200, "error": error or "stream ended without [DONE]"}
        return {"end": "completed", "ids": [ids]}

    async def _one(self, session: aiohttp.ClientSession, i: int) -> None:
        kind, body = self.requests[i]
        async with self.semaphore:
            try:
                call = self._stream(session, body, kind) if body.get("stream") else self._whole(session, body)
                self.outcomes[i] = await asyncio.wait_for(call, self.hang_s)
            except TimeoutError:
                self.outcomes[i] = {"end": "hung"}
            except aiohttp.ClientError as exc:
                self.outcomes[i] = {"end": "error", "status": 0, "error": repr(exc)}
            self.done += 1

    async def run(self) -> list[dict]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            await asyncio.gather(*(self._one(session, i) for i in range(len(self.requests))))
        return self.outcomes


class AttackRounds:
    """Sends every attack at once, round after round, until stopped; records each answer's
    problem (None when it was answered as it must be) or that it hung."""

    def __init__(self, url: str, hang_s: float):
        self.url, self.hang_s = url, hang_s
        self.answers: list[tuple[str, str | None]] = []  # (attack, problem or "hung")
        self.stop = asyncio.Event()

    async def _one(self, session, attack) -> None:
        try:
            status, data = await asyncio.wait_for(send(session, self.url, attack), self.hang_s)
            self.answers.append((attack.name, problem(attack, status, data)))
        except TimeoutError:
            self.answers.append((attack.name, "hung"))
        except aiohttp.ClientError as exc:
            self.answers.append((attack.name, f"{attack.name}: {exc!r}"))

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            while not self.stop.is_set():
                await asyncio.gather(*(self._one(session, a) for a in attacks()))

    def summary(self) -> dict:
        problems = [p for _, p in self.answers if p is not None]
        return {"sent": len(self.answers), "as_expected": len(self.answers) - len(problems),
                "hung": problems.count("hung"), "otherwise": len(problems) - problems.count("hung"),
                "samples": [p for p in problems if p != "hung"][:5]}


async def with_attacks(url: str, hang_s: float, main) -> tuple[object, dict]:
    """Run the coroutine main with attack rounds beside it; its result and the attacks' summary."""
    rounds = AttackRounds(url, hang_s)
    task = asyncio.create_task(rounds.run())
    try:
        result = await main
    finally:
        rounds.stop.set()
    await task
    return result, rounds.summary()


def health(url: str) -> tuple[int, dict]:
    status, body = get(url + "/health", timeout=5)
    return status, json.loads(body)


def pids(url: str) -> dict[str, int]:
    """The pid of each ready stage replica, by name (executor, scheduler, tokenizer-0, ...)."""
    _, body = health(url)
    out = {}
    for stage, replicas in body["stages"].items():
        for r in replicas:
            if r["ready"]:
                out[r["replica"] if stage == "tokenizer" else stage] = r["pid"]
    return out


async def until_back(url: str, target: str, old_pid: int, killed: bool, timeout_s: float = 180) -> float:
    """Seconds until the target is ready again (under a new pid if it was killed) and the
    server is healthy."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            status, _ = await asyncio.to_thread(health, url)
            pid = (await asyncio.to_thread(pids, url)).get(target)
            if status == 200 and pid is not None and (pid != old_pid or not killed):
                return time.monotonic() - started
        except (OSError, ValueError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{target} did not come back")


async def chaos(url: str, requests: list, concurrency: int, hang_s: float, freeze_s: float) -> tuple[list, list]:
    load = Load(url, requests, concurrency, hang_s)
    task = asyncio.create_task(load.run())
    events = []
    plan = [("kill", "executor"), ("freeze", "tokenizer-1"), ("kill", "tokenizer-0"), ("kill", "scheduler")]
    for k, (action, target) in enumerate(plan, start=1):
        while load.done < len(requests) * k / (len(plan) + 2) and not task.done():
            await asyncio.sleep(0.01)
        pid = (await asyncio.to_thread(pids, url))[target]
        event = {"action": action, "target": target, "completed_before": load.done}
        if action == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(freeze_s)
            finally:
                os.kill(pid, signal.SIGCONT)
        event["ready_again_after_s"] = round(await until_back(url, target, pid, action == "kill"), 2)
        events.append(event)
    return await task, events


def report(requests: list, reference: list, disturbed: list, events: list, wall_s: float, blocks_free: bool,
           attacks_reference: dict, attacks_chaos: dict) -> dict:
    ends = [o["end"] for o in disturbed]
    lost_tokens, compared, equal = 0, 0, 0
    for (kind, body), ref, got in zip(requests, reference, disturbed, strict=True):
        if got["end"] != "completed":
            continue
        expected = body["max_tokens"]
        lost_tokens += sum(max(0, expected - len(ids)) for ids in got["ids"])
        lost_tokens += max(0, body.get("n", 1) - len(got["ids"])) * expected
        if kind in DETERMINISTIC and ref["end"] == "completed":
            compared += 1
            equal += got["ids"] == ref["ids"]
    errors = [o for o in disturbed if o["end"] == "error"]
    return {
        "sent": len(disturbed),
        "completed": ends.count("completed"),
        "failed_with_error": len(errors),
        "disconnected_on_purpose": ends.count("disconnected"),
        "hung": ends.count("hung"),
        "lost_tokens": lost_tokens,
        "deterministic_outputs_equal_to_undisturbed_run": f"{equal}/{compared}",
        "deterministic_outputs_all_equal": equal == compared,
        "errors_by_kind": {kind: sum(1 for (k, _), o in zip(requests, disturbed, strict=True)
                                     if k == kind and o["end"] == "error") for kind in KINDS},
        "error_samples": [e.get("error") for e in errors][:5],
        "reference_all_ok": all(o["end"] in ("completed", "disconnected") for o in reference),
        "kv_blocks_free_at_end": blocks_free,
        "events": events,
        "chaos_wall_s": round(wall_s, 1),
        "attacks_undisturbed": attacks_reference,
        "attacks_during_chaos": attacks_chaos,
    }


def main() -> int:
    args = parse_args()
    requests = make_requests(args.requests, args.max_tokens, args.seed)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        model = args.model or make_tiny_llama(Path(tmp) / "tiny-llama")
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        extra = ["--dtype", args.dtype, "--tokenizer-replicas", "2"]
        with ServerProcess(model, run_dir, extra) as server:
            reference, attacks_reference = asyncio.run(with_attacks(
                server.url, args.hang_s, Load(server.url, requests, args.concurrency, args.hang_s).run()))
            started = time.monotonic()
            (disturbed, events), attacks_chaos = asyncio.run(with_attacks(
                server.url, args.hang_s, chaos(server.url, requests, args.concurrency, args.hang_s, args.freeze_s)))
            wall_s = time.monotonic() - started
            try:
                server.wait_blocks_free(timeout=30)
                blocks_free = True
            except AssertionError:
                blocks_free = False
    result = report(requests, reference, disturbed, events, wall_s, blocks_free, attacks_reference, attacks_chaos)
    print(f"sent {result['sent']}, completed {result['completed']}, failed with an error "
          f"{result['failed_with_error']}, disconnected on purpose {result['disconnected_on_purpose']}, "
          f"hung {result['hung']}, lost tokens {result['lost_tokens']}; deterministic outputs equal to the "
          f"undisturbed run: {result['deterministic_outputs_equal_to_undisturbed_run']}")
    for name, a in (("undisturbed", attacks_reference), ("chaos", attacks_chaos)):
        print(f"attacks ({name} run): sent {a['sent']}, as expected {a['as_expected']}, hung {a['hung']}, "
              f"answered otherwise {a['otherwise']}")
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    ok = (result["hung"] == 0 and result["lost_tokens"] == 0 and result["deterministic_outputs_all_equal"]
          and attacks_reference["hung"] == attacks_reference["otherwise"] == 0 and attacks_chaos["hung"] == 0)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

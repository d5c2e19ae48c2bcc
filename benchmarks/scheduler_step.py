"""The scheduler's own work per decode step, without sockets or a model.

    python -m benchmarks.scheduler_step [--batches 1 16 64 256] [--steps 200]

B requests of 150-token prompts are prefilled, then each timed step is what the
scheduler stage does between two executor steps: `schedule()`, encoding the
`ExecuteStep`, and `process_results()` with one sampled token per request. Prints the
median thread CPU time per step, so other processes on the machine barely move it.
This bounds what overlapping scheduling with the forward pass (vLLM's async
scheduling) could save per step.
"""

from __future__ import annotations

import argparse
import random
import time

import msgspec

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from shared.messages import SamplingParams


def time_batch(batch: int, steps: int, prompt_len: int = 150) -> float:
    sched = Scheduler(SchedulerConfig(max_num_seqs=max(256, batch), max_num_batched_tokens=max(8192, batch * prompt_len)),
                      BlockManager(max(4096, batch * 32), 16))
    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
        sched.add_request(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=10 * steps, ignore_eos=True),
                                  frozenset({2}), 0.0))
    _, chunks = sched.schedule()
    sched.process_results(chunks, [5] * len(chunks))
    encoder = msgspec.msgpack.Encoder()
    times = []
    for _ in range(steps):
        start = time.thread_time()
        step, chunks = sched.schedule()
        encoder.encode(step)
        sched.process_results(chunks, [rng.randrange(1000, 40000) for _ in chunks])
        times.append(time.thread_time() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    print(f"{'batch':>6} {'ms per step':>12}")
    for b in args.batches:
        print(f"{b:>6} {time_batch(b, args.steps) * 1e3:>12.3f}", flush=True)


if __name__ == "__main__":
    main()

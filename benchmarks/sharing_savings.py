"""KV memory saved by block sharing: parallel sampling (n) and beam search (width).

The real scheduler and block manager run a trace from the paper's length
distributions with a model-free executor (the simulator's step-time model drives
the clock; beams get seeded random candidate logprobs, EOS never wins). At every
step, saving = 1 - blocks held / block-table entries of the live sequences, i.e.
the share of blocks the sequences would hold without sharing; it prints the
step-time-weighted mean after a warm-up. The pool is large enough that no request
is preempted (a preempted sequence recomputes alone and shares nothing).

    python -m benchmarks.sharing_savings [--duration 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import random

from services.scheduler.block_manager import BlockManager
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.sequence import Sequence
from services.simulator.step_time import StepTimeModel
from services.simulator.workload import make_trace
from shared.messages import SamplingParams

PAPER = {  # OPT-13B, Figure 15 (parallel sampling) and Figure 16 (beam search) ranges
    ("alpaca", "n"): "6.09 / 8.53 / 9.79",
    ("alpaca", "beam"): "37.56 / 53.13 / 55.16",
    ("sharegpt", "n"): "16.2-30.5",
    ("sharegpt", "beam"): "44.3-66.3",
}


def run(dataset: str, mode: str, k: int, rate: float, duration: float, seed: int) -> float:
    trace = make_trace(dataset, rate, duration, seed)
    sched = Scheduler(SchedulerConfig(max_model_len=2048), BlockManager(1_000_000, 16, enable_prefix_caching=False))
    rng = random.Random(seed)
    step_time = StepTimeModel()
    t, i, weighted, total_w = 0.0, 0, 0.0, 0.0
    warmup = 0.2 * duration
    while t < duration:
        while i < len(trace) and trace[i].arrival <= t:
            tr = trace[i]
            params = SamplingParams(max_tokens=tr.output_len, ignore_eos=True, n=k) if mode == "n" else \
                SamplingParams(max_tokens=tr.output_len, ignore_eos=True, use_beam_search=True, beam_width=k, n=1)
            prompt = [rng.randrange(3, 50000) for _ in range(tr.prompt_len)]
            sched.add_request(Sequence(f"r{i}", prompt, params, frozenset({2}), tr.arrival))
            i += 1
        scheduled = sched.schedule()
        if scheduled is None:
            if i >= len(trace):
                break
            t = trace[i].arrival
            continue
        step, chunks = scheduled
        dt = step_time(chunks)
        live = [r for group in sched.groups.values() for r in group.live]
        entries = sum(len(r.block_table) for r in live)
        if t >= warmup and entries:
            weighted += dt * (1 - sched.blocks.num_used_blocks / entries)
            total_w += dt
        top = [[(rng.randrange(3, 50000), -rng.expovariate(1.0) * (j + 1)) for j in range(s.num_logprobs)]
               for s in step.seqs if s.sample and s.num_logprobs]
        for lst in top:
            lst.sort(key=lambda c: -c[1])
        sched.process_results(chunks, [rng.randrange(3, 50000) if s.sample else -1 for s in step.seqs], top)
        t += dt
    assert sched.num_preemptions_total == 0
    return 100 * weighted / total_w if total_w else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=300)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rates = {"sharegpt": 1.0, "alpaca": 10.0}
    print(f"KV memory saved by sharing, % (duration {args.duration:g} s simulated, seed {args.seed}; "
          f"request rate ShareGPT {rates['sharegpt']}/s, Alpaca {rates['alpaca']}/s)")
    print(f"{'trace':9} {'sharing':16} {'k=2':>7} {'k=4':>7} {'k=6':>7}   paper (OPT-13B)")
    for dataset in ("sharegpt", "alpaca"):
        for mode, label in (("n", "parallel n=k"), ("beam", "beam width=k")):
            vals = [run(dataset, mode, k, rates[dataset], args.duration, args.seed) for k in (2, 4, 6)]
            print(f"{dataset:9} {label:16} " + " ".join(f"{v:7.2f}" for v in vals) + f"   {PAPER[(dataset, mode)]}")


if __name__ == "__main__":
    main()

"""What verifying k proposed tokens costs at one user: step(1 + k tokens) / step(1 token).

    python -m benchmarks.verify_cost [--model smollm2] [--context 300] [--max-k 8] [--rounds 40]

One sequence with a `context`-token prefix runs steps through `ModelRunner.execute` as the
executor runs a speculating decode step: its last token plus k drafts (`draft_token_ids`), every
one of the 1 + k rows sampled (greedy). The sizes k = 0..max_k are interleaved in a fresh random
order each round, so a slow spell of a shared host hits every size alike; each size's median wall
and CPU (process) time, and its fastest wall time (extra load only adds time), is divided by
k = 0's. The ratios, not the milliseconds, are the figures:
with tokens per step from `benchmarks.ngram_acceptance`, expected TPOT / plain TPOT =
ratio(k) / tokens_per_step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.executor_step import _seq
from shared.messages import ExecuteStep


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--kv-blocks", type=int, default=256)
    p.add_argument("--int4-max-rows", type=int, default=None, help="as the server's flag (default: calibrated)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from services.executor.model_runner import ModelRunner
    from shared.model_files import resolve_model

    runner = ModelRunner(resolve_model(args.model), num_kv_blocks=args.kv_blocks,
                         int4_max_rows=args.int4_max_rows)
    int4 = next((m.int4.max_rows for m in runner.model.decoder_linears() if m.int4 is not None), 0)
    print(f"{args.model}: {runner.dtype}, {torch.get_num_threads()} threads, int4 copies serve steps of "
          f"<= {int4} rows, context {args.context}")
    bs = runner.block_size
    table = list(range(1, 2 + (args.context + args.max_k + 1) // bs))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.context,), generator=gen).tolist()
    last = runner.execute(ExecuteStep(step_id=0, seqs=[_seq(0, prompt, 0, table, bs)]))[0]
    wall: dict[int, list[float]] = {k: [] for k in range(args.max_k + 1)}
    cpu: dict[int, list[float]] = {k: [] for k in range(args.max_k + 1)}
    rng = random.Random(0)
    for r in range(args.rounds + 2):  # the first two rounds warm up
        order = list(wall)
        rng.shuffle(order)
        for k in order:
            draft = torch.randint(100, 40000, (k,), generator=gen).tolist()
            seq = _seq(0, [last, *draft], args.context, table, bs)
            seq.draft_token_ids = draft
            w0, c0 = time.perf_counter(), time.process_time()
            runner.execute(ExecuteStep(step_id=1, seqs=[seq]))
            w1, c1 = time.perf_counter(), time.process_time()
            if r >= 2:
                wall[k].append(w1 - w0)
                cpu[k].append(c1 - c0)
    base_w, base_c, base_m = statistics.median(wall[0]), statistics.median(cpu[0]), min(wall[0])
    print("| k | rows | wall p50 ms | wall ratio | CPU p50 ms | CPU ratio | wall min ms | min ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for k in wall:
        w, c, m = statistics.median(wall[k]), statistics.median(cpu[k]), min(wall[k])
        print(f"| {k} | {k + 1} | {w * 1e3:.2f} | {w / base_w:.2f} | {c * 1e3:.2f} | {c / base_c:.2f} | "
              f"{m * 1e3:.2f} | {m / base_m:.2f} |")


if __name__ == "__main__":
    main()

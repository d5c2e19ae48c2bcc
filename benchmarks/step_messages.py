"""What the step message costs: an ExecuteStep's size and its msgpack encode and decode times,
against the forward pass it feeds.

    python -m benchmarks.step_messages [--shapes 1x200 64x200 128x200 256x2048] [--forward] [--finding]

Each shape is SEQSxCONTEXT: a decode step of SEQS sequences with CONTEXT tokens each (the
executor's calibration step), their whole block tables in the message as the scheduler sends
them every step, plus the share
of the bytes that the block tables take. `--forward` also times SmolLM2's forward pass at
the same number of rows (service defaults), so the message's cost reads as a share of a
step. Block tables sent as changes would cut the block tables' share of the bytes and of
the decode time; this is what decides whether they are worth it on this machine.

`--finding` builds the steps of issue 19's request mix with the real scheduler (16 prompts x
n 16, 65,536 allowed ids, 1,024 logit biases, 64 bad words of 64 tokens) and prints each
step's bytes as sent (sampling once per request) beside what they would be with every
sequence's sampling and histories in every step, as before.
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec

from services.executor.step_calibration import decode_step as calibration_step
from shared.messages import ExecuteStep, SchedulerToExecutor


def decode_step(num_seqs: int, context: int, block_size: int = 16, tables: bool = True) -> ExecuteStep:
    """The executor's calibration step (every sequence on blocks of its own); without tables,
    every block table empty, to tell their share of the bytes."""
    blocks = num_seqs * -(-context // block_size) + 1
    step = calibration_step(num_seqs, context, block_size, blocks)
    if not tables:
        step.seqs = [msgspec.structs.replace(s, block_table=[]) for s in step.seqs]
    return step


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(num_seqs: int, context: int, repeat: int = 30) -> dict:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(SchedulerToExecutor)
    step = decode_step(num_seqs, context)
    frame = encoder.encode(step)
    bare = len(encoder.encode(decode_step(num_seqs, context, tables=False)))
    assert decoder.decode(frame) == step
    return {"seqs": num_seqs, "context": context, "bytes": len(frame), "tables_share": 1 - bare / len(frame),
            "encode_us": median_us(lambda: encoder.encode(step), repeat),
            "decode_us": median_us(lambda: decoder.decode(frame), repeat)}


def forward_ms(shapes: list[tuple[int, int]], kv_budget: int) -> dict[tuple[int, int], float]:
    """SmolLM2's forward (service defaults) at each shape whose KV fits in kv_budget bytes."""
    import torch

    from services.executor.batch import BatchMetadata
    from services.executor.model_runner import ModelRunner
    from shared.model_files import resolve_model

    runner = ModelRunner(resolve_model("smollm2"), dtype="auto", kv_cache_memory=kv_budget)
    out = {}
    for rows, context in shapes:
        step = calibration_step(rows, context, runner.block_size, runner.num_kv_blocks)
        if step is None:
            continue  # its KV does not fit the budget

        def forward(step=step):
            meta = BatchMetadata.from_step(step, runner.block_size, runner.num_kv_blocks, runner.device)
            with torch.inference_mode():
                runner.model(meta, runner.kv_cache.k_caches, runner.kv_cache.v_caches)

        forward()
        out[(rows, context)] = median_us(forward, 5) / 1e3
    return out


def finding_steps(num_steps: int = 4) -> list[tuple[int, int, int]]:
    """(sequences, bytes as sent, bytes with every sequence's whole state) of the first steps of
    issue 19's request mix, built by the scheduler against a pool that holds it all."""
    import random

    from services.scheduler.block_manager import BlockManager
    from services.scheduler.scheduler import Scheduler, SchedulerConfig
    from services.scheduler.sequence import Sequence
    from shared.messages import SamplingParams

    rng = random.Random(19)
    params = SamplingParams(max_tokens=64, n=16, ignore_eos=True, allowed_token_ids=list(range(65_536)),
                            logit_bias=[(rng.randrange(49_152), 1.0) for _ in range(1024)],
                            bad_words_ids=[[rng.randrange(49_152) for _ in range(64)] for _ in range(64)])
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8192), BlockManager(4096, 16))
    for i in range(16):
        sched.add_request(Sequence(f"r{i}", [rng.randrange(49_152) for _ in range(200)], params, frozenset({2}), 0.0))
    encoder, out = msgspec.msgpack.Encoder(), []
    for _ in range(num_steps):
        step, chunks = sched.schedule()
        whole = msgspec.structs.replace(step, seqs=[
            msgspec.structs.replace(s, sampling=c.sequence.sampling, output_start=0,
                                    output_token_ids=list(c.sequence.output_token_ids))
            for s, c in zip(step.seqs, chunks, strict=True)])
        out.append((len(step.seqs), len(encoder.encode(step)), len(encoder.encode(whole))))
        sched.process_results(chunks, [5 if c.samples else -1 for c in chunks])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["1x200", "64x200", "128x200", "256x512", "256x2048"])
    p.add_argument("--forward", action="store_true", help="also time SmolLM2's forward pass at each shape")
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--finding", action="store_true", help="also the steps of issue 19's request mix")
    p.add_argument("--kv-budget-gib", type=float, default=4.0,
                   help="KV pool of the --forward timing; shapes that do not fit it get no forward time")
    args = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    rows = [measure(n, c, args.repeat) for n, c in shapes]
    forwards = forward_ms(shapes, int(args.kv_budget_gib * (1 << 30))) if args.forward else {}
    print(f"{'seqs':>5} {'context':>8} {'KiB':>8} {'tables':>7} {'encode us':>10} {'decode us':>10}"
          + (f" {'forward ms':>11} {'enc+dec / fwd':>14}" if forwards else ""))
    for r in rows:
        line = (f"{r['seqs']:>5} {r['context']:>8} {r['bytes'] / 1024:>8.1f} {100 * r['tables_share']:>6.1f}% "
                f"{r['encode_us']:>10.1f} {r['decode_us']:>10.1f}")
        fwd = forwards.get((r["seqs"], r["context"]))
        if fwd is not None:
            line += f" {fwd:>11.1f} {100 * (r['encode_us'] + r['decode_us']) / 1e3 / fwd:>13.2f}%"
        print(line)
    if args.finding:
        print(f"\nissue 19's mix: {'step':>4} {'seqs':>5} {'MiB sent':>9} {'MiB whole':>10}")
        for i, (seqs, sent, whole) in enumerate(finding_steps()):
            print(f"{'':15}{i:>4} {seqs:>5} {sent / 2**20:>9.3f} {whole / 2**20:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

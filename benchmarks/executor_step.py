"""Executor step timing without the server: decode steps of B sequences through ModelRunner.

Each batch size gets B sequences prefilled to a context of about `--context` tokens on
a shared pool, then `--steps` greedy decode steps are timed. Prints, per batch size,
the median step time, output tok/s, the forward pass's share of the step, and the
attention backend and dtype that ran, so kernel and dtype choices compare side by side.

    python -m benchmarks.executor_step [--batches 1 16 64] [--dtype auto] [--backend auto]
    python -m benchmarks.executor_step --compare torch:bfloat16 torch:float32 auto:auto
    python -m benchmarks.executor_step --batches 64 --prefill 150   # C=64's mixed steps

--prefill P adds a new P-token prompt to every step, as a closed loop of C users with short
prompts runs them (at C=64, 64 output tokens: one ~150-token prompt a step), on one of 8 spare
block tables taken in turn, so that its blocks were written before, as a server's recycled
blocks are (fresh blocks of the zeroed pool would add first-touch page faults to the step).

--compare runs each backend:dtype pair in turn in one process (the same prompts and
block tables) and prints tok/s per batch size with the ratio to the first pair.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from services.executor.model_runner import ModelRunner
from shared.messages import ExecuteStep, ScheduledSeq, SeqSampling
from shared.model_files import resolve_model

GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, seed=None)


def _seq(i: int, tokens: list[int], start: int, table: list[int], block_size: int) -> ScheduledSeq:
    slots = [table[p // block_size] * block_size + p % block_size for p in range(start, start + len(tokens))]
    return ScheduledSeq(request_id=f"r{i}", token_ids=tokens, start_pos=start, block_table=table,
                        slot_mapping=slots, sample=True, output_index=0, sampling=GREEDY)


PREFILL_TABLES = 8  # spare block tables the --prefill prompts take in turn


def time_batch(runner: ModelRunner, batch: int, context: int, steps: int, seed: int = 0,
               decode_context=contextlib.nullcontext, prefill: int = 0) -> dict:
    bs = runner.block_size
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-max(context + context // 4 + steps + 1, prefill) // bs)
    spare = PREFILL_TABLES if prefill else 0
    order = torch.randperm(runner.num_kv_blocks - 1, generator=gen)[: (batch + spare) * per_seq] + 1
    tables = [order[i * per_seq:(i + 1) * per_seq].tolist() for i in range(batch + spare)]
    lens = [max(1, context + int(torch.randint(-context // 4, context // 4 + 1, (1,), generator=gen)))
            for _ in range(batch)]
    last = []
    for i in range(0, batch, 8):  # prefill in chunks of 8 sequences
        seqs = [_seq(j, torch.randint(100, 40000, (lens[j],), generator=gen).tolist(), 0, tables[j], bs)
                for j in range(i, min(batch, i + 8))]
        last += runner.execute(ExecuteStep(step_id=0, seqs=seqs))
    prompt = torch.randint(100, 40000, (prefill,), generator=gen).tolist()
    times, forward = [], []
    with decode_context():
        _decode(runner, batch, lens, tables, last, steps, times, forward, prompt)
    step = statistics.median(times[2:])
    return {"batch": batch, "step_ms": step * 1e3, "tok_s": batch / step,
            "forward_share": statistics.median(forward[2:]) / step}


def _decode(runner, batch, lens, tables, last, steps, times, forward, prompt=()) -> None:
    bs = runner.block_size
    for s in range(steps):
        seqs = [_seq(j, [last[j]], lens[j] + s, tables[j], bs) for j in range(batch)]
        if prompt:
            spare = batch + s % PREFILL_TABLES
            seqs.append(_seq(spare, list(prompt), 0, tables[spare], bs))
        start = time.perf_counter()
        last = runner.execute(ExecuteStep(step_id=s + 1, seqs=seqs))[:batch]
        times.append(time.perf_counter() - start)
        forward.append(runner.last_forward_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--quantization", default="auto", help="auto, int4 or none (see the executor's --quantization)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prefill", type=int, default=0, help="a new prompt of this many tokens in every step")
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top ops for the last batch")
    p.add_argument("--compare", nargs="+", metavar="BACKEND:DTYPE[:QUANT]",
                   help="configurations to run side by side (QUANT: auto, int4 or none; default auto)")
    args = p.parse_args(argv)
    if args.compare:
        compare(args)
        return
    runner = ModelRunner(resolve_model(args.model), dtype=args.dtype, num_kv_blocks=args.kv_blocks,
                         attention_backend=args.backend, max_num_seqs=max(args.batches),
                         quantization=args.quantization)
    print(f"dtype {runner.dtype}, backend {runner.backend.name}, {_int4_label(runner)}, "
          f"threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'step ms':>8} {'tok/s':>8} {'forward':>8}"
          + (f"  (+ a {args.prefill}-token prompt a step; tok/s counts decode rows)" if args.prefill else ""))
    for b in args.batches:
        r = time_batch(runner, b, args.context, args.steps, prefill=args.prefill)
        print(f"{r['batch']:>5} {r['step_ms']:>8.2f} {r['tok_s']:>8.1f} {r['forward_share']:>8.1%}", flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        prof = profile(activities=[ProfilerActivity.CPU])
        time_batch(runner, args.batches[-1], args.context, args.steps, decode_context=lambda: prof)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def _int4_label(runner: ModelRunner) -> str:
    rows = max((m.int4.max_rows for m in runner.model.decoder_linears() if m.int4 is not None), default=0)
    return f"int4<={rows}" if rows else "dense"


def compare(args) -> None:
    rows: dict[str, dict[int, float]] = {}
    for config in args.compare:
        backend, dtype, quantization = (config.split(":") + ["auto"])[:3]
        runner = ModelRunner(resolve_model(args.model), dtype=dtype, num_kv_blocks=args.kv_blocks,
                             attention_backend=backend, max_num_seqs=max(args.batches), quantization=quantization)
        label = f"{runner.backend.name}:{str(runner.dtype).removeprefix('torch.')}:{_int4_label(runner)} ({config})"
        rows[label] = {b: time_batch(runner, b, args.context, args.steps)["tok_s"] for b in args.batches}
        print(label, {b: round(v, 1) for b, v in rows[label].items()}, flush=True)
        del runner
    base = next(iter(rows.values()))
    print(f"\n{'configuration':56}" + "".join(f"{f'B={b} tok/s':>14}{'ratio':>7}" for b in args.batches))
    for label, by_batch in rows.items():
        print(f"{label:56}" + "".join(f"{by_batch[b]:>14.1f}{by_batch[b] / base[b]:>7.2f}" for b in args.batches))


if __name__ == "__main__":
    main()

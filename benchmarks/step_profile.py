"""Where a served step's time goes: per-op timers inside real executor steps.

A closed loop of C users with ~P-token prompts and O output tokens runs steps of about
C - C/O decode rows plus one new prompt chunk every O/C steps or so (at C=64, O=64: ~63 decode
rows and one ~150-token prefill per step). This builds such steps on SmolLM2 (or --model)
through `ModelRunner.execute` as the executor runs them, times every backend op and every
linear call with a wrapper (the ops are synchronous on the CPU), and prints each category's
share of the step: dense matmuls (oneDNN-packed or F.linear), int4/int8 matmuls, the output
head, paged attention (decode-only steps and mixed steps apart), norms, SiLU, RoPE + cache
writes, and the rest (embedding, batch metadata, sampling, Python).

    python -m benchmarks.step_profile                      # C=64: 64 decode rows, + a 150-token chunk
    python -m benchmarks.step_profile --decode 16 --prefill 0 150 2048
    python -m benchmarks.step_profile --threads 1          # shares without OpenMP barriers
    python -m benchmarks.step_profile --int4-rows 1000     # int4 copies for these steps too

Figures come from one process on whatever else shares the machine: run it on a quiet host.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from benchmarks.executor_step import _seq
from shared.messages import ExecuteStep

OPS = ("paged_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul", "rope_and_cache")
FUSED = ("q4_gate_up_silu_tiles", "bf16_gate_up_silu_tiles")  # gate/up matmuls with SiLU-and-mul, where offered
CATEGORY = {"q4_gate_up_silu_tiles": "int4 matmul (gate/up with SiLU)",
            "bf16_gate_up_silu_tiles": "dense matmul (packed; gate/up with SiLU)",
            "rms_norm": "norms", "fused_add_rms_norm": "norms", "silu_and_mul": "silu_and_mul",
            "rope_and_cache": "rope + KV write", "paged_attention": "paged attention"}


class OpTimers:
    """Seconds per category, accumulated while `active`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False

    @contextmanager
    def timed(self, category: str):
        if not self.active:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[category] += time.perf_counter() - start


def instrument(runner, timers: OpTimers) -> None:
    """Wrap the model's backend ops and its linears' forward with timers."""
    import services.executor.models.llama as llama

    model = runner.model
    ops = model.backend

    def wrap(name, fn):
        def timed(*args, **kwargs):
            with timers.timed(CATEGORY[name]):
                return fn(*args, **kwargs)
        return timed

    model.backend = dataclasses.replace(ops, **{n: wrap(n, getattr(ops, n)) for n in OPS},
                                        **{n: wrap(n, getattr(ops, n)) for n in FUSED if getattr(ops, n) is not None})
    model._layer_calls = None  # rebuilt from the wrapped backend
    forward = llama.Linear.forward

    def linear_forward(self, x):
        q, packed, n = self.int4, self.packed, x.shape[0]
        kind = ("int4 matmul" if q is not None and n <= q.max_rows else
                "dense matmul (packed)" if packed is not None and n <= packed.max_rows else "dense matmul (F.linear)")
        with timers.timed(kind):
            return forward(self, x)

    llama.Linear.forward = linear_forward
    llama.Linear.step_forward = linear_forward
    logits = type(model).logits

    def timed_logits(self, x):
        with timers.timed("output head"):
            return logits(self, x)

    type(model).logits = timed_logits


def profile(runner, timers: OpTimers, decode: int, prefill: int, context: int, steps: int, seed: int = 0) -> dict:
    """Per-category seconds of `steps` steps (the first two unmeasured); `runner` instrumented with `timers`."""
    timers.seconds.clear()
    timers.active = False
    bs = runner.block_size
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-(context + steps + prefill + 1) // bs)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(decode + steps + 1)]
    if (decode + steps + 1) * per_seq >= runner.num_kv_blocks:
        raise SystemExit(f"the pool of {runner.num_kv_blocks} blocks is too small: raise --kv-blocks")
    last: list[int] = []
    for i in range(0, decode, 8):
        seqs = [_seq(j, torch.randint(100, 40000, (context,), generator=gen).tolist(), 0, tables[j], bs)
                for j in range(i, min(decode, i + 8))]
        last += runner.execute(ExecuteStep(step_id=0, seqs=seqs))
    times = []
    for s in range(steps):
        seqs = [_seq(j, [last[j]], context + s, tables[j], bs) for j in range(decode)]
        if prefill:
            prompt = torch.randint(100, 40000, (prefill,), generator=gen).tolist()
            seqs.append(_seq(decode + s, prompt, 0, tables[decode + s], bs))
        timers.active = s >= 2  # the first steps warm caches and buffers
        start = time.perf_counter()
        out = runner.execute(ExecuteStep(step_id=s + 1, seqs=seqs))
        if timers.active:
            times.append(time.perf_counter() - start)
        last = out[:decode]
    step = statistics.median(times)
    per_step = {k: v / len(times) for k, v in timers.seconds.items()}
    per_step["other (embedding, metadata, sampling, Python)"] = sum(times) / len(times) - sum(per_step.values())
    return {"decode": decode, "prefill": prefill, "step_ms": step * 1e3, "mean_ms": sum(times) / len(times) * 1e3,
            "categories": per_step}


def table(result: dict) -> str:
    mean = result["mean_ms"] / 1e3
    lines = [f"decode rows {result['decode']}, prefill chunk {result['prefill']}: step p50 {result['step_ms']:.1f} ms "
             f"(mean {result['mean_ms']:.1f} ms)", "| part | ms / step | share |", "|---|---|---|"]
    for name, sec in sorted(result["categories"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {sec * 1e3:.1f} | {100 * sec / mean:.0f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--decode", type=int, default=64, help="decode rows per step")
    p.add_argument("--prefill", type=int, nargs="+", default=[0, 150], help="prompt chunk per step (0: none)")
    p.add_argument("--context", type=int, default=200, help="decode rows' context")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-blocks", type=int, default=4096)
    p.add_argument("--prepack", default="auto", choices=("auto", "tiles", "onednn", "none"))
    p.add_argument("--int4-rows", type=int, default=None,
                   help="steps of at most this many rows on the int4 copies, instead of the calibrated limit")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from services.executor.model_runner import ModelRunner
    from shared.model_files import resolve_model

    runner = ModelRunner(resolve_model(args.model), num_kv_blocks=args.kv_blocks, prepack=args.prepack)
    if args.int4_rows is not None:
        for m in runner.model.decoder_linears():
            if m.int4 is not None:
                m.int4.max_rows = args.int4_rows
    int4 = next((m.int4.max_rows for m in runner.model.decoder_linears() if m.int4 is not None), 0)
    print(f"{args.model}: {runner.dtype}, backend {runner.backend.name}, {torch.get_num_threads()} threads, "
          f"int4 copies serve steps of <= {int4} rows, prepack {args.prepack}")
    timers = OpTimers()
    instrument(runner, timers)
    for prefill in args.prefill:
        print(table(profile(runner, timers, args.decode, prefill, args.context, args.steps)))
        print()


if __name__ == "__main__":
    main()

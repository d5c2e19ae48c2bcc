"""Where the executor's compute threads lose time to the other stages on a small CPU: variants side by side.

    python -m benchmarks.placement [--concurrency 1 16] [--rounds 3] [--variants default,passive,threads-1,nice]
    python -m benchmarks.placement --variants default,sync   # async scheduling on (default) and off

On a 2-core machine the gateway, tokenizer/detokenizer and scheduler wake on every
step while the executor's OpenMP team wants both cores; a preempted worker stalls
the whole team at its next barrier. This serves SmolLM2 with pagedserve's defaults
and with one placement change each, all started before any point (one at a time,
so each calibrates on a quiet machine; later variants are pinned to the first
one's int4 row limit, so only the placement differs), then runs closed-loop
points against them in rotation for `--rounds` rounds, so host drift hits every
variant alike. Prints per variant and C the median over rounds of output tok/s
and TPOT p50, the ratio to the first variant, and the share of a decode step's
wall time spent outside the model's forward pass (the engine's own counters on
/metrics, read before and after each point).

Variants (`--variants`, comma-separated; the first is the baseline):
- default: pagedserve's defaults (torch's threads = the cores, libgomp's default wait policy);
- passive: OMP_WAIT_POLICY=PASSIVE in every stage (idle OpenMP workers sleep at once);
- active: OMP_WAIT_POLICY=ACTIVE (workers spin between parallel regions);
- threads-1: one executor thread (leaves a core to the other stages);
- nice: `--frontend-nice 10` (gateway and tokenizer yield to the executor and scheduler);
- spin-N (e.g. spin-10000): GOMP_SPINCOUNT=N in every stage (how long an idle OpenMP worker
  spins before it sleeps; libgomp's default is 300000 spins, PASSIVE is 0);
- sync: `--no-async-scheduling` (each step is built only once the previous result is back);
- unpinned: `--cpu-placement off` (by default the executor's main thread keeps a core to itself
  and every other thread and stage shares the rest, shared/cpu_placement.py; off, the OS places all).

The workload is serve_vs_peers's (ShareGPT prompts when installed, 64 output tokens, greedy,
ignore_eos). Idle servers only send heartbeats; their cost shows as the spread between rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
from pathlib import Path

from benchmarks import engine_counters
from benchmarks.long_prompts import Point
from benchmarks.serve_vs_peers import Trace, _log, dataset, point, point_offsets, point_requests
from loadgen.datasets import WorkloadSpec
from loadgen.peers import launch
from loadgen.targets import Target
from loadgen.tokenizer import tokenizer_for
from services.executor.quantization import ALL_ROWS

VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "default": ((), {}),
    "passive": ((), {"OMP_WAIT_POLICY": "PASSIVE"}),
    "active": ((), {"OMP_WAIT_POLICY": "ACTIVE"}),
    "threads-1": (("--executor-threads", "1"), {}),
    "nice": (("--frontend-nice", "10"), {}),
    "sync": (("--no-async-scheduling",), {}),
    # the next step built late in the one in flight whatever the prompts' length, or always at once
    "ahead-late": (("--ahead-long-prompts", "0"), {}),
    "ahead-now": (("--ahead-fraction", "0"), {}),
    "unpinned": (("--cpu-placement", "off"), {}),
}
INT4_ROWS = re.compile(r"int4 linears serve (?:steps of at most (\d+) tokens|(every step))")


def variant(name: str) -> tuple[tuple[str, ...], dict[str, str]] | None:
    """A variant's extra serve options and environment; None for an unknown name."""
    spins = name.removeprefix("spin-")
    if spins != name and spins.isdigit():
        return (), {"GOMP_SPINCOUNT": spins}
    return VARIANTS.get(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="default,passive,threads-1,nice")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dataset", choices=("auto", "sharegpt", "sharegpt-paper"), default="auto")
    p.add_argument("--max-input-len", type=int, default=160)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--waves", type=float, default=3.0)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-point-seconds", type=float, default=120.0)
    p.add_argument("--point-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default="out/placement/logs")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = {v for v in args.variants if variant(v) is None}
    if unknown or not args.variants:
        p.error(f"--variants: choose from {', '.join(VARIANTS)}, spin-N")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = tokenizer_for("smollm2")
    spec = WorkloadSpec(dataset=dataset(args), seed=0, max_input_len=args.max_input_len,
                        max_output_len=args.output_len)
    trace = Trace(spec, tokenizer, args.output_len)
    results: dict[str, dict[int, list[dict]]] = {v: {c: [] for c in args.concurrency} for v in args.variants}
    pinned: tuple[str, ...] = ()
    with contextlib.ExitStack() as stack:
        targets = {}
        for name in args.variants:
            options, env = variant(name)
            peer = launch.Peer("pagedserve", Path(args.log_dir), options=options + pinned, env=env, model=args.model,
                               startup_timeout=900.0, log_name=f"placement-{name}")
            _log(f"starting {name}: {' '.join(options + pinned)} {env or ''}")
            stack.enter_context(peer)
            targets[name] = Target(name=name, url=peer.url)
            if not pinned:
                found = INT4_ROWS.findall(peer.log_path.read_text(errors="replace"))
                if found:  # (rows, "") or ("", "every step")
                    pinned = ("--int4-max-rows", found[-1][0] or str(ALL_ROWS))
        per_round = sum(point_requests(c, args) for c in args.concurrency)
        for r in range(args.rounds):
            order = args.variants[r % len(args.variants):] + args.variants[: r % len(args.variants)]
            offsets = point_offsets(args.concurrency, args, r * per_round)  # each round new prompts, alike for all
            for name in order:
                for c in args.concurrency:
                    before = engine_counters.read(targets[name].url)
                    plan = Point(str(c), c, trace.take(offsets[c], point_requests(c, args)),
                                 trace.warmup(args.warmup))
                    rec = point(targets[name], plan, args, tokenizer)
                    rec["outside"] = engine_counters.outside_share(before, engine_counters.read(targets[name].url))
                    results[name][c].append(rec)
                    _log(f"round {r + 1} {name} C={c}: {rec['output_tok_s']:.1f} tok/s, "
                         f"TPOT p50 {1e3 * (rec['tpot_s'].get('median') or 0):.1f} ms, "
                         f"outside the forward {100 * rec['outside']:.1f}%, {rec['failed']} failed")
    base = args.variants[0]
    lines = [f"placement: {spec.dataset}, {args.output_len} output tokens, {args.rounds} rounds in rotation "
             f"(medians); int4 limit of later variants pinned to {' '.join(pinned) or 'nothing (no int4)'}",
             f"{'variant':>10} {'C':>4} {'tok/s':>8} {'TPOT p50 ms':>12} {'tok/s vs ' + base:>16} "
             f"{'TPOT vs ' + base:>15} {'outside fwd':>12}  per round tok/s"]
    for name in args.variants:
        for c in args.concurrency:
            recs = results[name][c]
            tok = statistics.median(r["output_tok_s"] for r in recs)
            tpot = statistics.median((r["tpot_s"].get("median") or float("nan")) for r in recs) * 1e3
            btok = statistics.median(r["output_tok_s"] for r in results[base][c])
            btpot = statistics.median((r["tpot_s"].get("median") or float("nan")) for r in results[base][c]) * 1e3
            rounds = " ".join(f"{r['output_tok_s']:.1f}" for r in recs)
            outside = statistics.median(r["outside"] for r in recs) * 100
            lines.append(f"{name:>10} {c:>4} {tok:8.1f} {tpot:12.1f} {tok / btok:15.2f}x {tpot / btpot:14.2f}x "
                         f"{outside:11.1f}%  {rounds}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

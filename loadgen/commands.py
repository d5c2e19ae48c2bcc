"""The four commands: run, capacity, sweep, compare; each writes JSON and prints a table.

The measured trace is drawn once per command (same seed, same requests) and replayed
against every target, probe, rate and repeat; warm-up requests come from another stream.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

from loadgen import report, runner
from loadgen.datasets import WorkloadSpec, workload
from loadgen.metrics import Slo, summarize
from loadgen.targets import Target, parse_target
from loadgen.tokenizer import Tokenizer, tokenizer_for

PROBE_SIZE_ARGS = ("num_requests", "duration")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _spec(args) -> WorkloadSpec:
    return WorkloadSpec(dataset=args.dataset, seed=args.seed, input_len=args.input_len, output_len=args.output_len,
                        range_ratio=args.range_ratio, prefix_len=args.prefix_len, max_input_len=args.max_input_len,
                        max_output_len=args.max_output_len)


def _config(args, **override) -> runner.LoadConfig:
    config = runner.LoadConfig(
        request_rate=getattr(args, "request_rate", None), burstiness=args.burstiness,
        concurrency=getattr(args, "concurrency", None), max_concurrency=args.max_concurrency,
        num_requests=args.num_requests, duration=args.duration, warmup=args.warmup, seed=args.seed,
        temperature=args.temperature, timeout=args.request_timeout, deadline=args.max_time,
        progress=not args.no_progress)
    return replace(config, **override)


def _targets(args, stack: contextlib.ExitStack) -> list[Target]:
    common = {"model": args.model, "endpoint": args.endpoint, "length_control": args.length_control}
    targets = []
    if args.url:
        name = args.name or parse_target(args.url).name
        targets.append(replace(parse_target(f"{name}={args.url}"), **common))
    targets += [replace(parse_target(spec), **common) for spec in getattr(args, "target", [])]
    if args.peer:
        from loadgen.peers.launch import Peer

        for kind in args.peer:
            _log(f"starting peer {kind} ...")
            peer = stack.enter_context(Peer(kind, Path(args.peer_log_dir), threads=args.peer_threads))
            _log(f"peer {kind} ready at {peer.url}")
            targets.append(replace(Target(name=kind, url=peer.url), **common))
    for t in targets:
        if not t.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
            _log(f"warning: {t.name} at {t.url} is not a loopback address")
    names = [t.name for t in targets]
    if not targets or len(set(names)) != len(names):
        raise ValueError(f"give one or more targets with distinct names (got {names})")
    return targets


def _trace(args, spec: WorkloadSpec, tokenizer: Tokenizer, count: int | None) -> tuple[Callable[[], Iterator], list]:
    """A maker of the measured requests (each call gives the same seeded trace from the start)
    and the warm-up requests. A trace of known length is drawn once and replayed."""
    if count is not None:
        trace = functools.partial(iter, list(itertools.islice(workload(spec, tokenizer), count)))
    else:
        trace = functools.partial(workload, spec, tokenizer)
    return trace, list(itertools.islice(workload(spec, tokenizer, "warmup"), args.warmup))


def _record(outcome: runner.RunOutcome, spec: WorkloadSpec, config: runner.LoadConfig, slo: Slo | None) -> dict:
    load = asdict(config)
    if load["request_rate"] is not None and math.isinf(load["request_rate"]):
        load["request_rate"] = "inf"
    return {**summarize(outcome.results, outcome.duration_s, slo), "target": asdict(outcome.target),
            "workload": asdict(spec), "load": load, "requests": [r.to_dict() for r in outcome.results]}


def _run_one(target: Target, trace: Callable[[], Iterator], warmup: list, spec, config, tokenizer, slo) -> dict:
    return _record(runner.run(target, trace(), config, warmup, tokenizer), spec, config, slo)


def run(args) -> int:
    if args.peer and args.url:
        raise ValueError("give --url or --peer, not both")
    slo = Slo.parse(args.slo) if args.slo else None
    spec, config = _spec(args), _config(args)
    config.check()
    tokenizer = tokenizer_for(args.tokenizer)
    with contextlib.ExitStack() as stack:
        (target,) = _targets(args, stack)
        trace, warmup = _trace(args, spec, tokenizer, config.num_requests)
        record = _run_one(target, trace, warmup, spec, config, tokenizer, slo)
    print(report.run_table(record, target.name))
    if args.out:
        _log(f"wrote {report.write_json(args.out, record)}")
    return 0


class _Replay:
    """The measured trace, drawn once and replayed for each target from its start; grows as probes
    need more. Each probe of a target takes the requests after its previous probe's, so no probe
    finds its prompts in a prefix cache an earlier probe filled."""

    def __init__(self, requests: Iterator) -> None:
        self._source, self._drawn = requests, []

    def take(self, start: int, n: int) -> list:
        self._drawn += itertools.islice(self._source, max(0, start + n - len(self._drawn)))
        return self._drawn[start : start + n]


def capacity(args) -> int:
    from loadgen.capacity import CapacitySlo, probe_summary, search

    given = [f"--{a.replace('_', '-')}" for a in PROBE_SIZE_ARGS if getattr(args, a) is not None]
    if given:
        raise ValueError(f"capacity sizes each probe itself (--probe-seconds, --probe-min-requests), "
                         f"not with {' '.join(given)}")
    slo = CapacitySlo.parse(args.slo)
    spec = _spec(args)
    tokenizer = tokenizer_for(args.tokenizer)
    trace = _Replay(workload(spec, tokenizer))
    warmup = list(itertools.islice(workload(spec, tokenizer, "warmup"), args.warmup))
    sizing = (f"{args.probe_seconds:g} s of arrivals and at least {args.probe_min_requests} requests per probe, "
              f"the first {100 * args.warmup_frac:g}% not judged")
    out = {"slo": slo.describe(), "workload": asdict(spec), "probe": sizing, "targets": {}}
    with contextlib.ExitStack() as stack:
        targets = _targets(args, stack)
        for target in targets:
            taken = [0]  # requests this target's probes used so far

            def probe(rate: float, target=target, taken=taken) -> dict:
                n = max(args.probe_min_requests, math.ceil(rate * args.probe_seconds))
                # The whole probe is bounded: what is still in flight at the deadline fails it.
                deadline = args.max_time or 2 * n / rate + 60
                config = _config(args, request_rate=rate, num_requests=n, duration=None, deadline=deadline)
                outcome = runner.run(target, trace.take(taken[0], n), config, warmup, tokenizer)
                taken[0] += n
                summary = probe_summary(outcome.results, outcome.duration_s, args.warmup_frac, args.max_backlog)
                summary["requests_sent"] = n
                return summary

            _log(f"capacity of {target.name} under {slo.describe()}; {sizing}")
            out["targets"][target.name] = search(
                probe, slo, start_rate=args.start_rate, max_rate=args.max_rate, tolerance=args.tolerance,
                max_probes=args.max_probes, time_budget=args.time_budget, max_failed_frac=args.max_failed_frac,
                log=_log)
    rows = [[name, r["capacity"], r["lowest_failing_rate"], len(r["probes"]), r["stopped"]]
            for name, r in out["targets"].items()]
    print(f"capacity under {slo.describe()} ({spec.dataset}; {sizing})")
    print(report.markdown_table(["target", "capacity (req/s)", "lowest failing", "probes", "stopped"], rows))
    _log(f"wrote {report.write_json(args.out, out)}")
    return 0


def sweep(args) -> int:
    from loadgen.plots import sweep_figure

    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    slo = Slo.parse(args.slo) if args.slo else None
    spec = _spec(args)
    config = _config(args, request_rate=rates[0])
    config.check()
    tokenizer = tokenizer_for(args.tokenizer)
    curves: dict[str, list[tuple[float, dict]]] = {}
    with contextlib.ExitStack() as stack:
        targets = _targets(args, stack)
        trace, warmup = _trace(args, spec, tokenizer, config.num_requests)
        for i, rate in enumerate(rates):
            for target in targets if i % 2 == 0 else targets[::-1]:  # alternate: drift hits all alike
                record = _run_one(target, trace, warmup, spec, replace(config, request_rate=rate), tokenizer, slo)
                curves.setdefault(target.name, []).append((rate, record))
                _log(f"{target.name} @ {rate:g} req/s: {record['completed']} ok, {record['failed']} failed, "
                     f"mean normalized latency {record['normalized_latency_s']['mean']}")
    out_dir = Path(args.out_dir)
    report.write_json(out_dir / "sweep.json", {n: [{"rate": r, **rec} for r, rec in pts] for n, pts in curves.items()})
    png = sweep_figure(curves, out_dir / "sweep.png", f"{spec.dataset}: latency against request rate")
    rows = [[n, r, rec["request_throughput"], rec["output_throughput"], rec["normalized_latency_s"]["mean"],
             report.ms(rec["ttft_s"]["p99"]), report.ms(rec["tpot_s"]["mean"]), rec["failed"]]
            for n, pts in curves.items() for r, rec in pts]
    print(report.markdown_table(["target", "rate", "req/s", "out tok/s", "norm. lat (s/tok)", "TTFT p99 ms",
                                 "TPOT mean ms", "failed"], rows))
    _log(f"wrote {out_dir / 'sweep.json'} and {png}")
    return 0


def compare(args) -> int:
    from loadgen.compare import compare_runs, median_table
    from loadgen.plots import compare_figure

    slo = Slo.parse(args.slo) if args.slo else None
    spec, config = _spec(args), _config(args)
    config.check()
    tokenizer = tokenizer_for(args.tokenizer)
    with contextlib.ExitStack() as stack:
        targets = _targets(args, stack)
        trace, warmup = _trace(args, spec, tokenizer, config.num_requests)
        runs = compare_runs(targets, args.repeats,
                            lambda t: _run_one(t, trace, warmup, spec, config, tokenizer, slo), log=_log)
    headers, rows = median_table(runs, slo is not None)
    load = f"{config.request_rate:g} req/s" if config.request_rate else f"concurrency {config.concurrency}"
    title = (f"{spec.dataset}, {config.num_requests or f'{config.duration:g} s of'} requests at {load}"
             + (f", outputs capped at {spec.max_output_len}" if spec.max_output_len else "")
             + f"; medians of {args.repeats} alternating repeats")
    table = report.markdown_table(headers, rows)
    out_dir = Path(args.out_dir)
    report.write_json(out_dir / "compare.json", {"title": title, "runs": runs})
    (out_dir / "compare.md").write_text(f"{title}\n\n{table}\n")
    png = compare_figure(runs, out_dir / "compare.png", title)
    print(title)
    print(table)
    _log(f"wrote {out_dir / 'compare.json'}, {out_dir / 'compare.md'} and {png}")
    return 0

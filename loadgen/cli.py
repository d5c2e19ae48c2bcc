"""Command line: `python -m loadgen run|capacity|sweep|compare` (also `pagedserve-loadgen`).

Targets are given as `--url URL` (run), `--target NAME=URL` (repeatable) or `--peer KIND`
(repeatable: the load generator starts that server, see loadgen/peers). Every option is
listed by `python -m loadgen COMMAND --help`.
"""

from __future__ import annotations

import argparse
import sys

from loadgen.datasets import DATASETS
from loadgen.peers.launch import KINDS
from loadgen.targets import ENDPOINTS, LENGTH_CONTROLS


def _targets(p: argparse.ArgumentParser, single: bool) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--url", help="base URL of one server, e.g. http://127.0.0.1:8000")
    g.add_argument("--name", help="name for --url in tables (default: its port)")
    if not single:
        g.add_argument("--target", action="append", default=[], metavar="NAME=URL", help="a running server")
    g.add_argument("--peer", action="append", default=[], choices=KINDS, help="start this server for the run")
    g.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    g.add_argument("--endpoint", choices=ENDPOINTS, default="completions")
    g.add_argument("--length-control", choices=LENGTH_CONTROLS, default="auto",
                   help="how output length is forced (auto: ignore_eos, else transformers' generation_config)")
    g.add_argument("--peer-threads", type=int, help="compute threads of every started peer (default: each its own)")
    g.add_argument("--peer-log-dir", default="out/loadgen/peer-logs")


def _workload(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=DATASETS, default="sharegpt-paper")
    g.add_argument("--input-len", type=int, default=128, help="random: prompt tokens; prefix: suffix tokens")
    g.add_argument("--output-len", type=int, default=128, help="random and prefix: output tokens")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths uniform in len*(1 +- ratio)")
    g.add_argument("--prefix-len", type=int, default=512, help="prefix: tokens of the shared prefix")
    g.add_argument("--max-input-len", type=int, help="cap drawn prompt lengths")
    g.add_argument("--max-output-len", type=int, help="cap drawn output lengths (keeps runs short)")
    g.add_argument("--tokenizer", default="smollm2", help="model alias, HF directory, or 'words'")
    g.add_argument("--seed", type=int, default=0)


def _load(p: argparse.ArgumentParser, shape: str) -> None:
    g = p.add_argument_group("load")
    if shape != "rate-only":
        how = g.add_mutually_exclusive_group(required=shape == "required")
        how.add_argument("--request-rate", type=float, help="open loop: mean requests/s (inf: all at once)")
        how.add_argument("--concurrency", type=int, help="closed loop: this many clients back to back")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, help="open loop: cap on requests in flight")
    g.add_argument("--num-requests", type=int, help="requests measured (per run or probe)")
    g.add_argument("--duration", type=float, help="seconds of arrivals measured")
    g.add_argument("--warmup", type=int, default=2, help="requests sent first and not counted")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--max-time", type=float, help="hard limit on one run's measured phase, seconds")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve-loadgen", description="Load and capacity testing of "
                                     "OpenAI-compatible servers")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="one run against one target; summary as JSON and a table")
    _targets(p, single=True)
    _workload(p)
    _load(p, "required")
    p.add_argument("--slo", help="per-request limits for goodput, e.g. ttft=0.5,tpot=50ms,e2e=10,normalized=0.1")
    p.add_argument("--out", help="write the run (summary and per-request results) to this JSON file")

    p = sub.add_parser("capacity", help="highest request rate each target sustains under an SLO")
    _targets(p, single=False)
    _workload(p)
    _load(p, "rate-only")
    p.add_argument("--slo", required=True, help="aggregate limits: normalized=0.1 (mean), ttft=1,tpot=0.1 (p99), "
                                                "or STAT_METRIC=SECONDS")
    p.add_argument("--start-rate", type=float, default=1.0)
    p.add_argument("--max-rate", type=float, default=1000.0)
    p.add_argument("--tolerance", type=float, default=0.1, help="stop when failing/passing rate <= 1 + this")
    p.add_argument("--max-probes", type=int, default=12)
    p.add_argument("--time-budget", type=float, default=1800.0, help="seconds for all probes of one target")
    p.add_argument("--max-failed-frac", type=float, default=0.0, help="failed requests a passing probe may have")
    p.add_argument("--probe-seconds", type=float, default=60.0,
                   help="seconds of arrivals per probe: long enough for the queue to settle or grow")
    p.add_argument("--probe-min-requests", type=int, default=100, help="requests per probe at least")
    p.add_argument("--warmup-frac", type=float, default=0.25,
                   help="share of a probe's arrival window not judged (the queue filling from empty)")
    p.add_argument("--max-backlog", type=float, default=0.05,
                   help="a probe fails when its queue grows by more than this share of its arrivals")
    p.add_argument("--out", default="out/loadgen/capacity.json")

    p = sub.add_parser("sweep", help="latency against request rate for each target, one PNG")
    _targets(p, single=False)
    _workload(p)
    _load(p, "rate-only")
    p.add_argument("--rates", required=True, help="comma-separated request rates, e.g. 0.5,1,2,4")
    p.add_argument("--slo", help="per-request limits for goodput")
    p.add_argument("--out-dir", default="out/loadgen/sweep")

    p = sub.add_parser("compare", help="the same seeded trace against each target, alternating and repeated")
    _targets(p, single=False)
    _workload(p)
    _load(p, "required")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slo", help="per-request limits for goodput")
    p.add_argument("--out-dir", default="out/loadgen/compare")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from loadgen import commands

    try:
        return getattr(commands, args.command)(args)
    except (ValueError, RuntimeError) as err:
        print(f"loadgen {args.command}: {err}", file=sys.stderr)
        return 2

"""`pagedserve simulate`: options, the runs, the report."""

from __future__ import annotations

import argparse
import logging
import sys

from services.scheduler.address_space import PLACEMENTS
from services.scheduler.reservation import POLICIES
from services.simulator import report
from services.simulator.engine import SimConfig, simulate
from services.simulator.workload import DATASETS, make_trace


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=DATASETS, default="sharegpt")
    p.add_argument("--kv-slots", type=int, default=15700, help="token slots in the KV pool (paper: 15.7K)")
    p.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals per second")
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds left out of the averages (default: a tenth of the duration)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", choices=(*POLICIES, "all"), default="all")
    p.add_argument("--block-size", type=int, default=16, help="paged block size in tokens")
    p.add_argument("--reserve-block-size", type=int, default=1,
                   help="granularity of reservations (1: token slots, as Orca; the engine rounds to blocks)")
    p.add_argument("--placement", choices=PLACEMENTS, default="buddy",
                   help="where a reservation's chunk goes: the buddy allocator (the paper's Orca) or first fit")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest sequence (OPT: 2048)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per policy")


def run(args: argparse.Namespace) -> int:
    logging.getLogger("services.scheduler").setLevel(logging.WARNING)  # a line per preemption otherwise
    warmup = args.duration / 10 if args.warmup is None else args.warmup
    cfg = SimConfig(
        kv_slots=args.kv_slots, duration_s=args.duration, warmup_s=warmup, block_size=args.block_size,
        reserve_block_size=args.reserve_block_size, placement=args.placement, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
    )
    trace = make_trace(args.dataset, args.request_rate, args.duration, args.seed, args.max_model_len)
    policies = POLICIES[1:] + POLICIES[:1] if args.policy == "all" else (args.policy,)
    results = [simulate(policy, trace, cfg) for policy in policies]
    if args.json:
        print(report.to_json(results))
    else:
        header = (f"{args.dataset}, {cfg.pool_slots} KV slots (paged block {args.block_size}, reservations in "
                  f"units of {args.reserve_block_size}, placed by {args.placement}), {args.request_rate:g} req/s, {args.duration:g} s simulated "
                  f"(warm-up {warmup:g} s), seed {args.seed}, {len(trace)} requests")
        print(report.table(results, args.dataset, args.request_rate, header))
    sys.stdout.flush()
    return 0

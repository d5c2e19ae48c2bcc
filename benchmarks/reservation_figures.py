"""The simulator's reservation baselines against the paper's Figures 2 and 13.

Runs `pagedserve simulate`'s engine at the paper's settings (OPT-13B's 15.7K KV token
slots, max length 2048; ShareGPT at 2 req/s, Alpaca at 30 req/s) for every policy and
prints, per dataset and policy, each figure beside the paper's with the relative
distance |ours - paper| / paper; `*` marks one beyond 20%. Figure 2 (the memory
breakdown) is of a ShareGPT run in the paper, so Alpaca rows compare batched requests
only. With several seeds the figures are means over the seeds' runs.

    python -m benchmarks.reservation_figures [--duration 600] [--seeds 0 1 2] [--placement buddy]
"""

from __future__ import annotations

import argparse
import statistics

from services.scheduler.address_space import PLACEMENTS
from services.scheduler.reservation import POLICIES
from services.simulator.engine import SimConfig, simulate
from services.simulator.report import PAPER_FIG2, PAPER_FIG13
from services.simulator.workload import make_trace

RATES = {"sharegpt": 2.0, "alpaca": 30.0}
METRICS = ("token states", "reserved", "internal", "external", "batched")
TOLERANCE = 0.20


def measure(dataset: str, policy: str, cfg: SimConfig, seeds: list[int]) -> list[float]:
    """Means over seeds of the four shares (in %) and the mean batched requests."""
    runs = []
    for seed in seeds:
        r = simulate(policy, make_trace(dataset, RATES[dataset], cfg.duration_s, seed, cfg.max_model_len), cfg)
        u = r.usage
        runs.append([100 * u.token_state_share, 100 * u.reserved_share, 100 * u.internal_frag_share,
                     100 * u.external_frag_share, r.mean_batched_requests])
    return [statistics.mean(col) for col in zip(*runs, strict=True)]


def distance(ours: float, paper: float | None) -> str:
    if paper is None:
        return "-"
    if paper == 0:
        return "exact" if abs(ours) < 0.05 else f"+{ours:.1f}pt *"
    d = abs(ours - paper) / paper
    return f"{100 * d:.1f}%" + (" *" if d > TOLERANCE else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="simulated seconds of arrivals per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--placement", choices=PLACEMENTS, default="buddy")
    args = p.parse_args()
    cfg = SimConfig(kv_slots=15700, duration_s=args.duration, warmup_s=args.duration / 10, placement=args.placement)
    print(f"{cfg.pool_slots} KV slots, reservations placed by {args.placement}, {args.duration:g} s simulated, "
          f"seeds {args.seeds}; distance = |ours - paper| / paper, * beyond {100 * TOLERANCE:.0f}%")
    print(f"{'dataset':9} {'policy':15} {'metric':13} {'ours':>8} {'paper':>8} {'distance':>10}")
    outside = []
    for dataset, rate in RATES.items():
        for policy in (*POLICIES[1:], POLICIES[0]):
            ours = measure(dataset, policy, cfg, args.seeds)
            fig2 = PAPER_FIG2[policy] if dataset == "sharegpt" else (None,) * 4
            paper = [*fig2, PAPER_FIG13[(dataset, rate)][policy]]
            for metric, o, theirs in zip(METRICS, ours, paper, strict=True):
                unit = "" if metric == "batched" else "%"
                d = distance(o, theirs)
                shown = "-" if theirs is None else f"{theirs:.2f}{unit}"
                print(f"{dataset:9} {policy:15} {metric:13} {o:7.2f}{unit or ' '} {shown:>8} {d:>10}")
                if d.endswith("*"):
                    outside.append(f"{dataset} {policy} {metric}")
    print("beyond 20%: " + (", ".join(outside) if outside else "none"))


if __name__ == "__main__":
    main()

"""Compare targets on one trace: run them one after another, alternating order, repeated.

Shared, noisy machines drift; running A B C, then C B A, then A B C ... spreads the drift
over every target, and the table reports each metric's median over the repeats.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from loadgen.targets import Target

# (column, summary key, statistic or None, scale)
COLUMNS = [
    ("req/s", "request_throughput", None, 1),
    ("out tok/s", "output_throughput", None, 1),
    ("TTFT p50 ms", "ttft_s", "median", 1000),
    ("TTFT p99 ms", "ttft_s", "p99", 1000),
    ("TPOT p50 ms", "tpot_s", "median", 1000),
    ("TPOT p99 ms", "tpot_s", "p99", 1000),
    ("ITL p99 ms", "itl_s", "p99", 1000),
    ("E2E p50 s", "e2e_s", "median", 1),
    ("norm. lat s/tok", "normalized_latency_s", "mean", 1),
]


def compare_runs(targets: list[Target], repeats: int, run: Callable[[Target], dict],
                 log: Callable[[str], None] = lambda _: None) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {t.name: [] for t in targets}
    for rep in range(repeats):
        for target in targets if rep % 2 == 0 else targets[::-1]:
            record = run(target)
            runs[target.name].append(record)
            log(f"repeat {rep + 1}/{repeats} {target.name}: {record['completed']} ok, {record['failed']} failed, "
                f"{record['output_throughput']:.1f} out tok/s")
    return runs


def median_of(records: list[dict], key: str, stat: str | None) -> float | None:
    values = [r[key] if stat is None else r[key][stat] for r in records]
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def median_table(runs: dict[str, list[dict]], with_goodput: bool) -> tuple[list[str], list[list]]:
    columns = COLUMNS + ([("goodput req/s", "goodput", None, 1)] if with_goodput else [])
    headers = ["target", *(c[0] for c in columns), "failed", "short"]
    rows = []
    for name, records in runs.items():
        row: list = [name]
        for _, key, stat, scale in columns:
            value = median_of(records, key, stat)
            row.append(None if value is None else value * scale)
        row += [sum(r["failed"] for r in records), sum(r["short_outputs"] for r in records)]
        rows.append(row)
    return headers, rows

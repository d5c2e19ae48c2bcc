"""Results out: JSON files and short tables for the terminal (Markdown, readable as text)."""

from __future__ import annotations

import json
from pathlib import Path

LATENCIES = (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("ITL", "itl_s"), ("E2E", "e2e_s"),
             ("Normalized", "normalized_latency_s"))


def write_json(path: Path | str, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    return path


def _jsonable(value):
    if hasattr(value, "to_dict"):
        return value.to_dict()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def markdown_table(headers: list[str], rows: list[list]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    def line(values: list[str]) -> str:  # first column (names) to the left, numbers to the right
        padded = [v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|:" + "-" * (widths[0] + 1) + "|" + "|".join("-" * (w + 1) + ":" for w in widths[1:]) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
    return str(value)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def run_table(summary: dict, name: str) -> str:
    head = (f"{name}: {summary['completed']} completed, {summary['failed']} failed in {summary['duration_s']:.2f} s"
            f" | {summary['request_throughput']:.3g} req/s | {summary['output_throughput']:.4g} output tok/s")
    if summary.get("errors"):
        head += f" | errors {summary['errors']}"
    if summary.get("slo_attainment") is not None:
        head += f" | goodput {summary['goodput']:.3g} req/s ({100 * summary['slo_attainment']:.0f}% within SLO)"
    rows = [[label, *(ms(summary[key][s]) for s in ("mean", "median", "p90", "p99"))] for label, key in LATENCIES]
    return head + "\n" + markdown_table(["latency (ms)", "mean", "median", "p90", "p99"], rows)

"""PNG figures (matplotlib, Agg): latency against request rate, throughput bars, TTFT/ITL spread.

`sweep_figure` is the PagedAttention paper's Figure 12 form (mean normalized latency
against request rate, one line per target) with p99 TTFT, mean TPOT and the throughput
achieved beside it. `compare_figure` shows one seeded trace across targets: throughput
bars (median over repeats, whiskers at min and max), latency bars, and the distributions
of TTFT and inter-token latency over every request of every repeat.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

plt.rcParams.update({"font.size": 11, "axes.titlesize": 12, "axes.grid": True, "grid.alpha": 0.3})


def sweep_figure(curves: dict[str, list[tuple[float, dict]]], path: Path, title: str) -> Path:
    panels = [("mean normalized latency (s/token)", lambda s: s["normalized_latency_s"]["mean"]),
              ("p99 TTFT (s)", lambda s: s["ttft_s"]["p99"]),
              ("mean TPOT (ms)", lambda s: _ms(s["tpot_s"]["mean"])),
              ("output throughput achieved (tok/s)", lambda s: s["output_throughput"])]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for ax, (label, get) in zip(axes.flat, panels, strict=True):
        for name, points in curves.items():
            rates = [rate for rate, _ in points]
            ax.plot(rates, [_nan(get(s)) for _, s in points], marker="o", label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    axes.flat[0].legend()
    return _save(fig, path, title)


def compare_figure(runs: dict[str, list[dict]], path: Path, title: str) -> Path:
    """`runs[target]` holds one run record (summary and per-request results) per repeat."""
    names = list(runs)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))

    ax = axes[0, 0]
    tput = [[r["output_throughput"] for r in runs[n]] for n in names]
    med = [np.median(v) for v in tput]
    err = [[m - min(v) for m, v in zip(med, tput, strict=True)], [max(v) - m for m, v in zip(med, tput, strict=True)]]
    bars = ax.bar(names, med, yerr=err, capsize=6, color=colors[:len(names)])
    ax.bar_label(bars, fmt="%.3g", label_type="center", color="white", fontweight="bold")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("throughput (median of repeats, min-max)")

    ax = axes[0, 1]
    groups = [("TTFT p50", "ttft_s", "median"), ("TTFT p99", "ttft_s", "p99"), ("TPOT p50", "tpot_s", "median"),
              ("ITL p99", "itl_s", "p99"), ("E2E p50", "e2e_s", "median")]
    width = 0.8 / len(names)
    x = np.arange(len(groups))
    for i, n in enumerate(names):
        vals = [np.median([_nan(_ms(r[key][stat])) for r in runs[n]]) for _, key, stat in groups]
        ax.bar(x + (i - (len(names) - 1) / 2) * width, vals, width, label=n, color=colors[i % len(colors)])
    ax.set_xticks(x, [g[0] for g in groups])
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms, log scale)")
    ax.set_title("latency (median of repeats)")
    ax.legend(fontsize=9)

    for ax, key, label in ((axes[1, 0], "ttft", "TTFT (s)"), (axes[1, 1], "itl", "inter-token latency (ms)")):
        for i, n in enumerate(names):
            values = _pooled(runs[n], key)
            if key == "itl":
                values = values * 1000
            if len(values):
                ax.plot(np.sort(values), np.linspace(0, 1, len(values), endpoint=False) + 1 / len(values),
                        label=n, color=colors[i % len(colors)])
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of " + ("requests" if key == "ttft" else "token gaps"))
        ax.set_title(f"{label.split(' (')[0]} distribution (CDF)")
        if key == "itl":
            ax.set_xscale("log")
        ax.legend(fontsize=9)
    return _save(fig, path, title)


def _pooled(runs: list[dict], key: str) -> np.ndarray:
    values: list[float] = []
    for run in runs:
        for r in run.get("requests", []):
            if r["ok"]:
                values.extend(r["itl"] if key == "itl" else [r[key]] if r[key] is not None else [])
    return np.asarray(values, dtype=float)


def _save(fig, path: Path, title: str) -> Path:
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value

"""The simulator's report: JSON, or a table beside the paper's figures.

Paper figures (Kwon et al., SOSP 2023; numbers as listed in shared/data/README.md):
Figure 2's KV memory breakdown, and Figure 13's mean batched requests, which hold
for OPT-13B with 15.7K token slots at 2 req/s on ShareGPT and 30 req/s on Alpaca.
Figure 2 does not name its trace; its Orca (Max) split fits ShareGPT's lengths
(and a simulation of them), not Alpaca's, so it is shown beside ShareGPT runs only.
"""

from __future__ import annotations

import json

from services.simulator.engine import PolicyResult

PAPER_NAMES = {"reserve-max": "Orca (Max)", "reserve-pow2": "Orca (Pow2)", "reserve-oracle": "Orca (Oracle)",
               "paged": "vLLM"}
# policy -> (token states, reserved, internal frag, external frag) in %; vLLM's rest is not broken down
PAPER_FIG2 = {
    "reserve-max": (20.4, 13.3, 57.3, 8.9),
    "reserve-pow2": (26.8, 17.9, 13.6, 41.6),
    "reserve-oracle": (38.2, 25.2, 0.0, 36.6),
    "paged": (96.3, None, None, None),
}
# (dataset, request rate) -> policy -> mean batched requests
PAPER_FIG13 = {
    ("sharegpt", 2.0): {"reserve-max": 7.00, "reserve-pow2": 9.81, "reserve-oracle": 13.62, "paged": 30.42},
    ("alpaca", 30.0): {"reserve-max": 7.00, "reserve-pow2": 43.24, "reserve-oracle": 72.75, "paged": 132.44},
}


def to_json(results: list[PolicyResult]) -> str:
    return json.dumps([r.as_json() for r in results], indent=2)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _paper_pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}%"


def table(results: list[PolicyResult], dataset: str, rate: float, header: str) -> str:
    fig13 = PAPER_FIG13.get((dataset, float(rate)), {})
    fig2 = PAPER_FIG2 if dataset == "sharegpt" else {}
    cols = ["policy", "token states", "paper", "reserved", "paper", "internal", "paper", "external", "paper",
            "batched", "paper", "free/pool", "finished", "waiting", "preempted", "norm.lat"]
    rows = []
    for r in results:
        u, paper = r.usage, fig2.get(r.policy, (None,) * 4)
        shares = (u.token_state_share, u.reserved_share, u.internal_frag_share, u.external_frag_share)
        row = [r.policy]
        for ours, theirs in zip(shares, paper, strict=True):
            row += [_pct(ours), _paper_pct(theirs)]
        row += [f"{r.mean_batched_requests:.2f}", f"{fig13[r.policy]:.2f}" if r.policy in fig13 else "-",
                _pct(u.free_share), str(r.num_finished), str(r.num_waiting_at_end), str(r.num_preemptions),
                "-" if r.mean_normalized_latency_s is None else f"{r.mean_normalized_latency_s:.3f}s"]
        rows.append(row)
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    lines = [header, fmt.format(*cols), *(fmt.format(*row) for row in rows)]
    if not fig13:
        lines.append("(the paper reports batched requests only for sharegpt at 2 req/s and alpaca at 30 req/s)")
    if not fig2:
        lines.append("(the paper's Figure 2 breakdown is of a ShareGPT run)")
    lines += [
        "Shares of the KV memory in use (pool minus the free slots the next request could use), from slot",
        "counts time-averaged after the warm-up; they sum to 100% like the paper's Figure 2. free/pool: free",
        "slots over the whole pool. internal: reserved past a request's real length; external: the allocator's",
        "rounding past a reservation, and holes too small for the waiting head's chunk (see kv_accounting).",
        "batched: running requests per step, time-averaged. paper: Kwon et al. 2023",
        "(Fig. 2 for shares, Fig. 13 for batched; vLLM = paged, Orca (Max/Pow2/Oracle) = reserve-*).",
        "norm.lat: mean (finish - arrival) / output tokens of requests that arrived after the warm-up and finished.",
    ]
    return "\n".join(lines)

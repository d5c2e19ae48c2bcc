"""Simulated requests: lengths from the paper's Figure 11 histograms, Poisson arrivals.

`paper_fig11_length_histograms.json` is an unchanged copy of the project's
`shared/data/` file (see its README there), bundled so the simulator stands alone.
A length is drawn by picking a bin with its probability, then uniformly inside the
bin, rounded, at least 1; prompt and output lengths are drawn independently. A pair
whose prompt + output exceeds max_model_len is redrawn (both lengths), as the
paper's benchmark drops such pairs, so the mix shifts slightly to shorter requests.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

DATA_FILE = Path(__file__).with_name("paper_fig11_length_histograms.json")
DATASETS = ("sharegpt", "alpaca")


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds
    prompt_len: int
    output_len: int


class LengthHistogram:
    def __init__(self, bin_edges: list[float], prob: list[float]):
        if len(bin_edges) != len(prob) + 1:
            raise ValueError("a histogram needs one more bin edge than bins")
        self.edges = bin_edges
        self.cum = list(itertools.accumulate(prob))

    def sample(self, rng: random.Random) -> int:
        i = min(bisect.bisect_right(self.cum, rng.random() * self.cum[-1]), len(self.cum) - 1)
        lo, hi = self.edges[i], self.edges[i + 1]
        return max(1, round(lo + (hi - lo) * rng.random()))


def load_histograms(dataset: str, path: Path = DATA_FILE) -> tuple[LengthHistogram, LengthHistogram]:
    """(prompt, output) length histograms of a dataset."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; one of {DATASETS}")
    data = json.loads(path.read_text())[dataset]
    return LengthHistogram(**data["input"]), LengthHistogram(**data["output"])


def make_trace(dataset: str, rate: float, duration: float, seed: int, max_model_len: int = 2048) -> list[TraceRequest]:
    """Requests arriving at `rate` per second (Poisson) during [0, duration)."""
    if rate <= 0:
        raise ValueError("the request rate must be positive")
    prompts, outputs = load_histograms(dataset)
    rng = random.Random(seed)
    trace, t = [], rng.expovariate(rate)
    while t < duration:
        while True:
            p, o = prompts.sample(rng), outputs.sample(rng)
            if p + o <= max_model_len:
                break
        trace.append(TraceRequest(t, p, o))
        t += rng.expovariate(rate)
    return trace

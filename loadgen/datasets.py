"""Workloads: seeded, reproducible streams of (prompt, prompt length, output length).

- `sharegpt-paper` / `alpaca-paper`: lengths drawn from the PagedAttention paper's
  Figure 11 histograms (data/paper_fig11_length_histograms.json), prompts cut from real
  text (textsource.py) to the drawn token length;
- `sharegpt`: real first-turn prompts (sharegpt.py);
- `random`: given input/output lengths, optionally spread by `range_ratio`;
- `prefix`: one long common prefix shared by every prompt, then a distinct suffix.

Output length is forced by the client (`max_tokens` plus `ignore_eos` or the target's
equivalent), so `output_len` is what the server is asked to generate.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

from loadgen.tokenizer import Tokenizer

DATASETS = ("sharegpt-paper", "alpaca-paper", "sharegpt", "random", "prefix")


@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str
    seed: int = 0
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 512
    max_input_len: int | None = None
    max_output_len: int | None = None


class LengthHistogram:
    """Pick a bin by its probability, then a length uniformly inside it; rounded, at least 1."""

    def __init__(self, bin_edges: list[float], prob: list[float]) -> None:
        if len(bin_edges) != len(prob) + 1:
            raise ValueError("need one more bin edge than probabilities")
        self.edges, self.prob = bin_edges, prob
        self._bins = range(len(prob))

    def sample(self, rng: random.Random) -> int:
        i = rng.choices(self._bins, weights=self.prob)[0]
        return max(1, round(rng.uniform(self.edges[i], self.edges[i + 1])))

    def mean(self) -> float:
        return sum(p * (a + b) / 2 for p, a, b in zip(self.prob, self.edges, self.edges[1:], strict=False))


def paper_histograms(name: str) -> tuple[LengthHistogram, LengthHistogram]:
    """(input, output) histograms of `sharegpt` or `alpaca`."""
    raw = json.loads(resources.files("loadgen").joinpath("data", "paper_fig11_length_histograms.json").read_text())
    series = raw[name]
    return LengthHistogram(**series["input"]), LengthHistogram(**series["output"])


def workload(spec: WorkloadSpec, tokenizer: Tokenizer, stream: str = "measured") -> Iterator[Request]:
    """Requests of `spec`; `stream` names an independent seeded stream (e.g. "warmup")."""
    if spec.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {spec.dataset!r}; choose from {', '.join(DATASETS)}")
    rng = random.Random(f"{spec.seed}:{spec.dataset}:{stream}")
    if spec.dataset == "sharegpt":
        yield from _sharegpt(spec, tokenizer, rng)
        return

    from loadgen.textsource import corpus_for

    corpus = corpus_for(tokenizer)
    if spec.dataset.endswith("-paper"):
        lengths_in, lengths_out = paper_histograms(spec.dataset.removesuffix("-paper"))
        while True:
            n_in, n_out = lengths_in.sample(rng), lengths_out.sample(rng)
            yield _request(corpus, rng, spec, n_in, n_out)
    elif spec.dataset == "random":
        while True:
            yield _request(corpus, rng, spec, _spread(rng, spec.input_len, spec.range_ratio),
                           _spread(rng, spec.output_len, spec.range_ratio))
    else:  # prefix: drawn from its own stream so every stream shares the same prefix
        prefix, prefix_len = corpus.window(random.Random(f"{spec.seed}:prefix"), spec.prefix_len)
        while True:
            suffix, suffix_len = corpus.window(rng, spec.input_len)
            yield Request(prefix + suffix, prefix_len + suffix_len, _cap(spec.output_len, spec.max_output_len))


def _request(corpus, rng: random.Random, spec: WorkloadSpec, n_in: int, n_out: int) -> Request:
    prompt, prompt_len = corpus.window(rng, _cap(n_in, spec.max_input_len))
    return Request(prompt, prompt_len, _cap(n_out, spec.max_output_len))


def _sharegpt(spec: WorkloadSpec, tokenizer: Tokenizer, rng: random.Random) -> Iterator[Request]:
    from loadgen.sharegpt import first_turns, sharegpt_requests

    for prompt, prompt_len, output_len in sharegpt_requests(first_turns(), tokenizer, rng):
        if spec.max_input_len is None or prompt_len <= spec.max_input_len:
            yield Request(prompt, prompt_len, _cap(output_len, spec.max_output_len))


def _spread(rng: random.Random, n: int, ratio: float) -> int:
    if ratio <= 0:
        return n
    return max(1, rng.randint(round(n * (1 - ratio)), round(n * (1 + ratio))))


def _cap(n: int, cap: int | None) -> int:
    return n if cap is None else max(1, min(n, cap))

"""Fixtures for the load generator's tests: requests of known lengths and a run helper."""

from __future__ import annotations

import pytest

from loadgen import runner
from loadgen.datasets import Request
from loadgen.targets import Target


def requests(n: int, output_len: int = 5) -> list[Request]:
    return [Request(prompt=f"prompt {i}", prompt_len=2, output_len=output_len) for i in range(n)]


def run(url: str, reqs: list[Request], **config) -> runner.RunOutcome:
    target = Target(name="fake", url=url, model=config.pop("model", None),
                    endpoint=config.pop("endpoint", "completions"),
                    length_control=config.pop("length_control", "ignore_eos"))
    config.setdefault("progress", False)
    if "request_rate" not in config and "concurrency" not in config:
        config["request_rate"] = float("inf")
    config.setdefault("num_requests", len(reqs))
    return runner.run(target, iter(reqs), runner.LoadConfig(**config))


@pytest.fixture
def run_load():
    return run

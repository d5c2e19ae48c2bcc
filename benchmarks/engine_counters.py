"""pagedserve's own counters on /metrics, read before and after a benchmark point.

Two figures come from them: the share of the decode steps' wall time spent outside the
model's forward pass (scheduling, messages, sampling), and how many prompt tokens the
engine computed per output token (prompt tokens less those found in its prefix cache),
which the matmul ceiling of a workload with prompts has to count.
"""

from __future__ import annotations

import time
import urllib.request

STEPS, STEP_SECONDS, FORWARD_SECONDS = ("pagedserve_decode_steps_total", "pagedserve_decode_step_seconds_total",
                                        "pagedserve_decode_forward_seconds_total")
PROMPT, CACHED, GENERATED = ("pagedserve_prompt_tokens_total", "pagedserve_prefix_cache_hits_total",
                             "pagedserve_generation_tokens_total")
COUNTERS = (STEPS, STEP_SECONDS, FORWARD_SECONDS, PROMPT, CACHED, GENERATED)


def parse(text: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """Each counter summed over its labels (absent: 0) from a Prometheus text page."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def read(url: str) -> dict[str, float]:
    """The counters, once the engine's heartbeats (every 0.25 s) caught up."""
    time.sleep(0.6)
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
        return parse(resp.read().decode())


def outside_share(before: dict[str, float], after: dict[str, float]) -> float:
    """Of the decode steps' wall time between the two readings, the share outside the forward pass.

    A step's wall time runs from the result before it to its own; with async scheduling the
    executor starts the next forward as soon as it sent a result, before the scheduler has it,
    so a step's interval can be a little shorter than its forward. When nothing is left outside
    the forward passes the two sums then differ by that skew alone, either way: 0 there, not a
    negative share."""
    wall = after[STEP_SECONDS] - before[STEP_SECONDS]
    forward = after[FORWARD_SECONDS] - before[FORWARD_SECONDS]
    return max(0.0, (wall - forward) / wall) if wall > 0 else float("nan")


def computed_prompt_per_output(before: dict[str, float], after: dict[str, float]) -> float:
    """Prompt tokens the engine ran through the model (not cached) per output token."""
    generated = after[GENERATED] - before[GENERATED]
    computed = (after[PROMPT] - before[PROMPT]) - (after[CACHED] - before[CACHED])
    return max(computed, 0.0) / generated if generated > 0 else float("nan")

"""Request arrival times: gamma-distributed gaps at a mean request rate.

Gaps have shape `burstiness` and mean 1/rate: burstiness 1 is a Poisson process (the
paper's arrivals), below 1 burstier, above 1 more regular. An infinite rate sends every
request at once. The same seed gives the same times, scaled by 1/rate, at any rate.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if math.isinf(rate):
        while True:
            yield 0.0
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def arrival_times(rate: float, burstiness: float, seed: int | str) -> Iterator[float]:
    """Offsets from the start of the run in seconds; the first request goes at 0."""
    t = 0.0
    for gap in gaps(rate, burstiness, random.Random(f"{seed}:arrivals")):
        yield t
        t += gap

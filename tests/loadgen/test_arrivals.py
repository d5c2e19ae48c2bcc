"""Arrival gaps follow the requested rate and burstiness: checked statistically, seeded."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from loadgen.arrivals import arrival_times, gaps

N = 20000


def draw(rate: float, burstiness: float, seed: int = 7) -> list[float]:
    return list(itertools.islice(gaps(rate, burstiness, random.Random(seed)), N))


@pytest.mark.parametrize("rate,burstiness", [(5.0, 1.0), (20.0, 0.5), (2.0, 4.0)])
def test_mean_rate_and_dispersion(rate, burstiness):
    xs = draw(rate, burstiness)
    mean = statistics.fmean(xs)
    cv2 = statistics.pvariance(xs) / mean**2
    # Standard error of the mean gap is (1/rate) * sqrt(1 / (burstiness * N)): < 1.5 % here.
    assert mean == pytest.approx(1 / rate, rel=0.05)
    # A gamma of shape k has squared coefficient of variation 1/k.
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)


def test_poisson_gaps_are_exponential():
    """Kolmogorov-Smirnov against Exp(rate); 1.63/sqrt(N) is the 1 % critical value."""
    rate = 3.0
    xs = sorted(draw(rate, 1.0))
    d = max(max((i + 1) / N - (1 - math.exp(-rate * x)), (1 - math.exp(-rate * x)) - i / N)
            for i, x in enumerate(xs))
    assert d < 1.63 / math.sqrt(N)


def test_seeded_reproducible_and_scaled_by_rate():
    a = list(itertools.islice(arrival_times(2.0, 1.0, seed=3), 50))
    b = list(itertools.islice(arrival_times(2.0, 1.0, seed=3), 50))
    c = list(itertools.islice(arrival_times(8.0, 1.0, seed=3), 50))
    other = list(itertools.islice(arrival_times(2.0, 1.0, seed=4), 50))
    assert a == b and a != other
    assert a[0] == 0.0 and all(y > x for x, y in itertools.pairwise(a))
    assert c == pytest.approx([t / 4 for t in a])  # same trace shape at any rate


def test_infinite_rate_sends_everything_at_once():
    assert list(itertools.islice(arrival_times(math.inf, 1.0, seed=0), 5)) == [0.0] * 5
    with pytest.raises(ValueError):
        next(gaps(0.0, 1.0, random.Random(0)))

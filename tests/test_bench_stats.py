"""labkit.bench.stats.median_ci against the binomial order-statistic interval and by simulation."""

from __future__ import annotations

import random
import statistics

import pytest

from labkit.bench.stats import median_ci


@pytest.mark.parametrize(("n", "k"), [(3, 1), (8, 1), (9, 2), (13, 3), (20, 6), (31, 10)])
def test_median_ci_takes_the_textbook_order_statistics(n, k):
    values = random.Random(n).sample(range(1000), n)
    ordered = sorted(values)
    assert median_ci(values) == (ordered[k - 1], ordered[n - k])


def test_median_ci_covers_the_true_median_at_least_at_its_level():
    rng = random.Random(0)
    trials, covered = 2000, 0
    for _ in range(trials):  # lognormal rounds: the true median is exp(0) = 1
        low, high = median_ci([rng.lognormvariate(0, 0.1) for _ in range(15)])
        covered += low <= 1.0 <= high
    assert covered / trials >= 0.93  # at n = 15 the interval's exact coverage is 96.5%


def test_median_ci_narrows_with_more_rounds():
    rng = random.Random(1)
    width = {n: statistics.median(_width(rng, n) for _ in range(200)) for n in (9, 41)}
    assert width[41] < 0.7 * width[9]


def _width(rng: random.Random, n: int) -> float:
    low, high = median_ci([rng.gauss(1, 0.1) for _ in range(n)])
    return high - low


@pytest.mark.parametrize(("values", "level"), [([], 0.95), ([1.0], 1.0), ([1.0], 0.0)])
def test_median_ci_rejects_bad_input(values, level):
    with pytest.raises(ValueError):
        median_ci(values, level)

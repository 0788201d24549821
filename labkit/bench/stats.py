"""Small statistics for the benchmarks' paired rounds."""

from __future__ import annotations

import math
from collections.abc import Sequence


def median_ci(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of `values` (independent rounds): the
    order statistics x_(k) and x_(n+1-k), k the largest with P(Binomial(n, 1/2) < k) <= (1 - level) / 2.
    With few values it is their whole range (n <= 8 at 0.95)."""
    if not values:
        raise ValueError("median_ci needs at least one value")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    ordered = sorted(values)
    n = len(ordered)
    tail, below, k = (1 - level) / 2, 0.0, 0
    while k < n // 2:
        below += math.comb(n, k) / 2**n  # P(Binomial < k + 1)
        if below > tail:
            break
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]

"""A fixed-bucket histogram of waits, served at GET /stats (how long turns waited to be durable).

Buckets grow by a factor of 1.25 from 10 microseconds to about a minute, so any percentile read
back is within 25% of the true value, the counts take a few hundred bytes whatever the number
of turns, and two snapshots subtract: a benchmark reads the waits of one round as the difference
of the counts before and after it.
"""

from __future__ import annotations

import math
from typing import Any

FIRST_S = 1e-5  # the first bucket's upper bound
GROWTH = 1.25
BUCKETS = 70  # 1e-5 * 1.25**70 is about 60 s; longer waits land in the last bucket


def upper_bounds_ms() -> list[float]:
    return [round(1000 * FIRST_S * GROWTH ** i, 4) for i in range(BUCKETS)]


class WaitHistogram:
    """Counts of waits per bucket, and their count and sum."""

    def __init__(self) -> None:
        self.counts = [0] * BUCKETS
        self.total_s = 0.0

    def observe(self, seconds: float) -> None:
        i = 0 if seconds <= FIRST_S else math.ceil(math.log(seconds / FIRST_S, GROWTH))
        self.counts[min(max(i, 0), BUCKETS - 1)] += 1
        self.total_s += seconds

    def as_json(self) -> dict[str, Any]:
        n = sum(self.counts)
        return {"count": n, "mean_ms": round(1000 * self.total_s / n, 4) if n else None,
                "p50_ms": percentile_ms(self.counts, 0.5), "p99_ms": percentile_ms(self.counts, 0.99),
                "bucket_upper_ms": upper_bounds_ms(), "counts": list(self.counts)}


def percentile_ms(counts: list[int], q: float) -> float | None:
    """The upper bound of the bucket holding the q-th quantile of `counts` (None when empty)."""
    n = sum(counts)
    if not n:
        return None
    rank, seen = q * n, 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank and c:
            return round(1000 * FIRST_S * GROWTH ** i, 4)
    return round(1000 * FIRST_S * GROWTH ** (len(counts) - 1), 4)

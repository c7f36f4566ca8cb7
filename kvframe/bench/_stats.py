"""Statistics the benchmarks share (one definition of each figure they print)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["p90"]


def p90(samples: Sequence[float]) -> float:
    """The 90th percentile of ``samples`` (inclusive method: between the smallest and the
    largest sample, never extrapolated); a single sample is its own p90."""
    if len(samples) < 2:
        return samples[0]
    return statistics.quantiles(samples, n=10, method="inclusive")[8]

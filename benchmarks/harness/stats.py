"""Percentiles for the benchmarks' latency figures."""
from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (the maximum of fewer than 100 values at q=99); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-int(q * len(ordered)) // 100) - 1))]

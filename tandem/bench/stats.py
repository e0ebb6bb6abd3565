"""Summary statistics: percentiles of latency samples, medians of metrics over runs."""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional, Sequence


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (numpy's default), None for no samples."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median_of_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over runs of the numeric values (None when any run lacks one)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [run.get(key) for run in runs]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = None
    return out


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or not b:
        return None
    return a / b

"""Bands over nodes: a median with a band around it, where one curve per node would be too many.

Two bands, each named for what it spans:

- the *interquartile* band (25th to 75th percentile) with min and max, in the results and
  analysis plots above ``AGGREGATE_ABOVE_NODES`` curves: ``quartiles`` (a list of values, the
  ``statistics`` module) and ``quartiles_by_column`` (a matrix, numpy);
- the *10-90* band (10th to 90th percentile), in the dashboard's live and stored views:
  ``median_10_90``.

Every percentile interpolates linearly between the sorted values.
"""
from __future__ import annotations

import statistics
from typing import Any, Optional

import numpy as np

AGGREGATE_ABOVE_NODES = 20  # more curves than this: a median and its band instead
BAND_10_90 = (10.0, 90.0)  # percentiles of the dashboard's band


def quartiles(values: list[float]) -> dict[str, float]:
    """Median, quartiles (``q1``, ``q3``), ``min``, ``max`` and ``n`` of ``values`` (at least one)."""
    ys = sorted(values)
    if len(ys) > 1:
        q = statistics.quantiles(ys, n=4, method="inclusive")
        q1, q3 = q[0], q[2]
    else:
        q1 = q3 = ys[0]
    return {"median": statistics.median(ys), "q1": q1, "q3": q3, "min": ys[0], "max": ys[-1], "n": len(ys)}


def quartiles_by_column(data: np.ndarray) -> np.ndarray:
    """Per column of ``data`` (rows: nodes): min, 25th percentile, median, 75th, max (five rows)."""
    return np.percentile(data, [0, 25, 50, 75, 100], axis=0)


def median_10_90(values: Any) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """Median, 10th and 90th percentile of the finite ``values`` (None when there is none), rounded
    for JSON (``finite_round``)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return None, None, None
    lo, med, hi = np.percentile(v, [BAND_10_90[0], 50.0, BAND_10_90[1]])
    return finite_round(med), finite_round(lo), finite_round(hi)


def finite_round(x: Any, digits: int = 6) -> Optional[float]:
    """``x`` rounded to ``digits`` as a float for JSON; None for None, NaN or an infinity."""
    return None if x is None or not np.isfinite(x) else round(float(x), digits)

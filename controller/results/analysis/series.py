"""Time series from cumulative counters and from packets: bins, rates, a mean with its 95 % interval.

Every time is seconds since the run's start. A bin k of width ``dt_s`` covers
``[t0 + k·dt_s, t0 + (k+1)·dt_s)``.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

Z_95 = 1.96


def bin_edges(t0_s: float, t1_s: float, dt_s: float) -> np.ndarray:
    """Edges of the bins of width ``dt_s`` that cover ``[t0_s, t1_s]`` (at least one bin)."""
    n = max(1, int(math.ceil((t1_s - t0_s) / dt_s - 1e-9)))
    return t0_s + dt_s * np.arange(n + 1)


def counter_at(times_s: np.ndarray, cumulative: np.ndarray, at_s: np.ndarray) -> np.ndarray:
    """A cumulative counter at the times ``at_s``, linear between samples and held flat outside
    them (a counter does not move before its first or after its last sample)."""
    if times_s.size == 0:
        return np.zeros(len(at_s))
    return np.interp(at_s, times_s, cumulative.astype(np.float64))


def counter_bins(times_s: np.ndarray, cumulative: np.ndarray, edges_s: np.ndarray) -> np.ndarray:
    """What a cumulative counter gained in each bin (never negative: a reset counts as zero)."""
    return np.maximum(np.diff(counter_at(times_s, cumulative, edges_s)), 0.0)


def event_bins(times_s: np.ndarray, sizes: np.ndarray, edges_s: np.ndarray) -> np.ndarray:
    """The sum of ``sizes`` of the events (packets) falling in each bin; events outside are left out."""
    if times_s.size == 0:
        return np.zeros(len(edges_s) - 1)
    dt = edges_s[1] - edges_s[0]
    k = np.floor((times_s - edges_s[0]) / dt).astype(np.int64)
    inside = (k >= 0) & (k < len(edges_s) - 1)
    return np.bincount(k[inside], weights=sizes[inside].astype(np.float64), minlength=len(edges_s) - 1)


def throughput_bps(bytes_per_bin: np.ndarray, dt_s: float) -> np.ndarray:
    """Bytes per bin as bit/s."""
    return bytes_per_bin * 8.0 / dt_s


def mean_ci95(values: np.ndarray) -> dict[str, Optional[float]]:
    """Mean of ``values`` and its 95 % interval m ± 1.96·σ/√n (σ the sample standard deviation,
    n the number of values); the half width is None below two values."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return {"mean": None, "ci95": None, "low": None, "high": None, "n": 0}
    m = float(v.mean())
    if v.size < 2:
        return {"mean": m, "ci95": None, "low": None, "high": None, "n": int(v.size)}
    half = Z_95 * float(v.std(ddof=1)) / math.sqrt(v.size)
    return {"mean": m, "ci95": half, "low": m - half, "high": m + half, "n": int(v.size)}


def step_integral(steps: list[tuple[float, Optional[float]]], t0_s: float, t1_s: float) -> tuple[float, float]:
    """(the integral of a step function over ``[t0_s, t1_s]``, the seconds of it where it has a
    value); None values (no link) count in neither."""
    total = seconds = 0.0
    bounds = [max(t0_s, min(t1_s, start)) for start, _ in steps[1:]] + [t1_s]
    start = t0_s
    for (_, value), end in zip(steps, bounds):
        if value is not None and end > start:
            total += value * (end - start)
            seconds += end - start
        start = max(start, end)
    return total, seconds

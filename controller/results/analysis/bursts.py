"""ON/OFF burst statistics of one resource series (their definitions: docs/how-to/telemetry.md).

x(k) is the resource's value in bin k of width Δ over the node's window. The threshold θ
is by default the midpoint of the two centroids of a 1-D 2-means split of x, raised to a
floor (1 % of the link rate for network, 5 % of the CPU quota for CPU); when the two
centroids are closer than 5 % of the range there is no burst structure. A bin is ON when
x ≥ θ; a single OFF bin between two ON bins counts as ON. A burst is a maximal ON run, an
idle a maximal OFF run between two bursts (leading and trailing runs are not idles).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

CENTROID_GAP_MIN = 0.05  # of the range: closer centroids mean no burst structure
NET_FLOOR_OF_RATE = 0.01
CPU_FLOOR_OF_QUOTA = 0.05
NO_STRUCTURE = "no burst structure"


def two_means(x: np.ndarray) -> tuple[float, float]:
    """The two centroids (low, high) of the optimal 1-D 2-means split of ``x`` (exact: the best
    of every split of the sorted values)."""
    s = np.sort(np.asarray(x, dtype=np.float64))
    n = s.size
    if n < 2 or s[0] == s[-1]:
        return float(s[0]) if n else 0.0, float(s[-1]) if n else 0.0
    c1, c2 = np.cumsum(s), np.cumsum(s * s)
    k = np.arange(1, n)  # k values in the low group
    low_sum, low_sq = c1[:-1], c2[:-1]
    high_sum, high_sq = c1[-1] - low_sum, c2[-1] - low_sq
    sse = (low_sq - low_sum ** 2 / k) + (high_sq - high_sum ** 2 / (n - k))
    sse[s[1:] == s[:-1]] = np.inf  # a split between equal values is no split
    best = int(np.argmin(sse))
    kk = best + 1
    return float(low_sum[best] / kk), float(high_sum[best] / (n - kk))


@dataclass
class Threshold:
    value: Optional[float]  # None: no burst structure
    rule: str  # which rule fired: "2-means midpoint", "floor: ...", "fixed", NO_STRUCTURE
    centroids: tuple[float, float] = (0.0, 0.0)


def choose_threshold(x: np.ndarray, floor: float = 0.0, floor_rule: str = "floor",
                     fixed: Optional[float] = None) -> Threshold:
    """θ for the series ``x``: ``fixed`` when given, else the 2-means midpoint raised to ``floor``
    (``floor_rule`` says what the floor is); no burst structure when the centroids are closer
    than 5 % of the range (or the series is flat)."""
    x = np.asarray(x, dtype=np.float64)
    if fixed is not None:
        return Threshold(float(fixed), "fixed")
    if x.size == 0:
        return Threshold(None, NO_STRUCTURE)
    lo, hi = two_means(x)
    span = float(x.max() - x.min())
    if span <= 0 or (hi - lo) < CENTROID_GAP_MIN * span:
        return Threshold(None, NO_STRUCTURE, (lo, hi))
    mid = (lo + hi) / 2
    if floor > mid:
        return Threshold(float(floor), floor_rule, (lo, hi))
    return Threshold(mid, "2-means midpoint", (lo, hi))


def on_bins(x: np.ndarray, threshold: float) -> np.ndarray:
    """ON where x ≥ θ, a single OFF bin between two ON bins counted ON."""
    on = np.asarray(x) >= threshold
    if on.size >= 3:
        gap = ~on[1:-1] & on[:-2] & on[2:]
        on = on.copy()
        on[1:-1] |= gap
    return on


def runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The maximal runs of a boolean array: (start index, length, value) of each."""
    m = np.asarray(mask, dtype=bool)
    if m.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool)
    change = np.flatnonzero(m[1:] != m[:-1]) + 1
    starts = np.concatenate(([0], change))
    lengths = np.diff(np.concatenate((starts, [m.size])))
    return starts, lengths, m[starts]


@dataclass
class Bursts:
    """The bursts and idles of one series, and what they are made of."""
    dt_s: float
    threshold: Threshold
    n_bins: int = 0
    burst_bins: list[int] = field(default_factory=list)  # length of each burst, in bins
    idle_bins: list[int] = field(default_factory=list)  # length of each idle, in bins
    on_values: Optional[np.ndarray] = None  # x over every ON bin
    burst_peaks: list[float] = field(default_factory=list)  # each burst's maximum

    @property
    def structured(self) -> bool:
        return self.threshold.value is not None

    def row(self) -> dict[str, Any]:
        """burst count, mean burst and idle duration (s), burst consumption (mean x over ON
        bins), burst peak (mean per-burst maximum), duty cycle (ON time / window)."""
        return summarize([self])


def summarize(parts: list[Bursts]) -> dict[str, Any]:
    """The statistics of one or more series pooled (a role: its nodes' bursts together)."""
    parts = [p for p in parts if p.structured]
    if not parts:
        return {"bursts": None, "burst_s": None, "burst_median_s": None, "burst_p95_s": None, "idle_s": None,
                "period_s": None, "burst_consumption": None, "burst_peak": None, "duty_cycle": None}
    burst_s = np.concatenate([np.asarray(p.burst_bins, np.float64) * p.dt_s for p in parts])
    idle_s = np.concatenate([np.asarray(p.idle_bins, np.float64) * p.dt_s for p in parts])
    on = np.concatenate([p.on_values if p.on_values is not None else np.zeros(0) for p in parts])
    peaks = [v for p in parts for v in p.burst_peaks]
    duty = [sum(p.burst_bins) / p.n_bins for p in parts if p.n_bins]
    return {"bursts": int(burst_s.size),
            "burst_s": float(burst_s.mean()) if burst_s.size else None,
            "burst_median_s": float(np.median(burst_s)) if burst_s.size else None,
            "burst_p95_s": float(np.percentile(burst_s, 95)) if burst_s.size else None,
            "idle_s": float(idle_s.mean()) if idle_s.size else None,
            "period_s": float(burst_s.mean() + idle_s.mean()) if burst_s.size and idle_s.size else None,
            "burst_consumption": float(on.mean()) if on.size else None,
            "burst_peak": float(np.mean(peaks)) if peaks else None,
            "duty_cycle": float(np.mean(duty)) if duty else None}


def detect(x: np.ndarray, dt_s: float, threshold: Threshold) -> Bursts:
    """The bursts of ``x`` (bins of ``dt_s``) at ``threshold``."""
    x = np.asarray(x, dtype=np.float64)
    out = Bursts(dt_s, threshold, n_bins=int(x.size))
    if threshold.value is None or x.size == 0:
        return out
    on = on_bins(x, threshold.value)
    starts, lengths, values = runs(on)
    out.burst_bins = [int(n) for n, v in zip(lengths, values) if v]
    on_idx = np.flatnonzero(values)
    if on_idx.size >= 2:  # OFF runs strictly between the first and the last burst
        inner = slice(on_idx[0] + 1, on_idx[-1])
        out.idle_bins = [int(n) for n, v in zip(lengths[inner], values[inner]) if not v]
    out.on_values = x[on]
    out.burst_peaks = [float(x[s:s + n].max()) for s, n, v in zip(starts, lengths, values) if v]
    return out

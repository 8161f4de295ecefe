"""How an aggregator makes one model of its children's updates: the rules a structure file names.

Each rule is a pure function of lists of layers (``[W1, b1, W2, b2, ...]``): every layer is
combined in float64 and returned in its own dtype.

- ``fedavg``: the updates averaged, weighted by their sample counts (FedAvg).
- ``fedavgm``: FedAvg with server momentum (FedAvgM): with ``avg`` the FedAvg of the updates,
  ``v <- momentum * v + (w_old - avg)`` and ``w_new = w_old - server_lr * v``; ``v`` (zero at
  first) is kept by the ``Aggregator`` between rounds. ``momentum`` 0 and ``server_lr`` 1 is FedAvg.
- ``trimmed_mean``: per coordinate, the ``trim_fraction`` largest and smallest values dropped
  (``floor(trim_fraction * n)`` of each, at least one value kept) and the rest averaged, unweighted.
- ``median``: the coordinate-wise median, unweighted.

The two robust rules ignore sample counts: a poisoned update could claim any count.

An ``Aggregator`` is built from the ``aggregation`` object of a structure file
(``{"rule": "fedavg", "server_lr": 1.0, "momentum": 0.9, "trim_fraction": 0.1}``, each key
optional) and its ``combine(current, updates, sample_counts)`` gives the next model.
"""
from __future__ import annotations

import difflib
import math
from typing import Any, Optional, Sequence

import numpy as np

Weights = list[np.ndarray]

RULES = ("fedavg", "fedavgm", "trimmed_mean", "median")
DEFAULTS: dict[str, Any] = {"rule": "fedavg", "server_lr": 1.0, "momentum": 0.9, "trim_fraction": 0.1}
MAX_SERVER_LR = 10.0  # server_lr in (0, MAX_SERVER_LR]; momentum in [0, 1); trim_fraction in [0, 0.5)
MAX_TRIM_FRACTION = 0.5


class AggregationConfError(ValueError):
    """An ``aggregation`` object that names no known rule, or a parameter out of its range."""


def fedavg(updates: Sequence[Weights], sample_counts: Sequence[float]) -> Weights:
    """Layer-wise average of ``updates`` weighted by ``sample_counts``."""
    if not updates or len(updates) != len(sample_counts):
        raise ValueError("need one weight per model, and at least one model")
    total = float(sum(sample_counts))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {list(sample_counts)}")
    out = []
    for layers in zip(*updates):
        acc = np.zeros(layers[0].shape, dtype=np.float64)
        for layer, w in zip(layers, sample_counts):
            acc += np.asarray(layer, dtype=np.float64) * (float(w) / total)
        out.append(acc.astype(layers[0].dtype))
    return out


def fedavgm(current: Weights, avg: Weights, velocity: Optional[list[np.ndarray]], server_lr: float,
            momentum: float) -> tuple[Weights, list[np.ndarray]]:
    """One server-momentum step from ``current`` towards ``avg`` (the round's FedAvg):
    (new model, new velocity in float64). ``velocity`` None: zero."""
    new, new_velocity = [], []
    for i, (w_old, target) in enumerate(zip(current, avg)):
        old64 = np.asarray(w_old, dtype=np.float64)
        v = old64 - np.asarray(target, dtype=np.float64)
        if velocity is not None:
            v = momentum * velocity[i] + v
        new_velocity.append(v)
        new.append((old64 - server_lr * v).astype(w_old.dtype))
    return new, new_velocity


def trim_count(n: int, trim_fraction: float) -> int:
    """How many of ``n`` values a trimmed mean drops at each end: ``floor(trim_fraction * n)``,
    leaving at least one."""
    return min(int(math.floor(trim_fraction * n + 1e-9)), (n - 1) // 2)


def trimmed_mean(updates: Sequence[Weights], trim_fraction: float) -> Weights:
    """Per coordinate, the mean of the values left once the ``trim_count`` largest and smallest
    are dropped (unweighted)."""
    _need(updates)
    k = trim_count(len(updates), trim_fraction)
    out = []
    for layers in zip(*updates):
        stacked = np.sort(np.stack([np.asarray(layer, dtype=np.float64) for layer in layers]), axis=0)
        out.append(stacked[k:len(layers) - k].mean(axis=0).astype(layers[0].dtype))
    return out


def median(updates: Sequence[Weights]) -> Weights:
    """The coordinate-wise median of ``updates`` (unweighted; the mean of the two middle values
    of an even count)."""
    _need(updates)
    return [np.median(np.stack([np.asarray(layer, dtype=np.float64) for layer in layers]), axis=0)
            .astype(layers[0].dtype) for layers in zip(*updates)]


def _need(updates: Sequence[Weights]) -> None:
    if not updates:
        raise ValueError("need at least one model")


def checked_conf(conf: Optional[dict[str, Any]]) -> dict[str, Any]:
    """``conf`` (an ``aggregation`` object; None: FedAvg) with every key, checked:
    ``AggregationConfError`` names an unknown key (with the nearest one) or a value out of range."""
    conf = dict(conf or {})
    for key in conf:
        if key not in DEFAULTS:
            close = difflib.get_close_matches(str(key), list(DEFAULTS), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid fields: {', '.join(DEFAULTS)}"
            raise AggregationConfError(f"aggregation, field {key!r}: unknown field{hint}")
    out = {**DEFAULTS, **conf}
    if out["rule"] not in RULES:
        raise AggregationConfError(f"aggregation, field 'rule': {out['rule']!r} is not one of {', '.join(RULES)}")
    for key, low, high, closed_low, closed_high in (("server_lr", 0.0, MAX_SERVER_LR, False, True),
                                                    ("momentum", 0.0, 1.0, True, False),
                                                    ("trim_fraction", 0.0, MAX_TRIM_FRACTION, True, False)):
        value = out[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
            and (value >= low if closed_low else value > low) and (value <= high if closed_high else value < high)
        if not ok:
            span = f"{'[' if closed_low else '('}{low:g}, {high:g}{']' if closed_high else ')'}"
            raise AggregationConfError(f"aggregation, field {key!r}: must be a number in {span}, got {value!r}")
        out[key] = float(value)
    return out


class Aggregator:
    """One aggregating position's rule, and its state between rounds (FedAvgM's velocity)."""

    def __init__(self, conf: Optional[dict[str, Any]] = None) -> None:
        self.conf = checked_conf(conf)
        self.rule: str = self.conf["rule"]
        self.velocity: Optional[list[np.ndarray]] = None

    def combine(self, current: Weights, updates: Sequence[Weights], sample_counts: Sequence[float]) -> Weights:
        """The next model from the one the updates started from (``current``), the updates and
        their sample counts."""
        rule, conf = self.rule, self.conf
        if rule == "fedavg":
            return fedavg(updates, sample_counts)
        if rule == "trimmed_mean":
            return trimmed_mean(updates, conf["trim_fraction"])
        if rule == "median":
            return median(updates)
        avg = fedavg(updates, sample_counts)
        if self.velocity is not None and [v.shape for v in self.velocity] != [np.shape(w) for w in current]:
            self.velocity = None  # another model: start again
        new, self.velocity = fedavgm(current, avg, self.velocity, conf["server_lr"], conf["momentum"])
        return new

"""Monitors of the training that policies decide on: the gradient noise scale and variance.

KungFu estimates the gradient noise scale every step from the local gradient (batch ``b``)
and the all-reduced one (``n * b``). Here a round's model *deltas* play those parts: the
local delta (the model after local training minus the model the round began with) and the
mean delta (the all-reduced model minus the same start). A delta over ``k`` samples is, to
first order, ``k`` steps' gradient with the noise of ``k`` samples, so ``b_small`` is the
samples a node trained on in the round and ``b_big`` the members' total. With ``|G_s|^2``
and ``|G_b|^2`` the squared norms (McCandlish et al., "An Empirical Model of Large-Batch
Training", appendix A):

    |G|^2 = (b_big |G_b|^2 - b_small |G_s|^2) / (b_big - b_small)
    S     = (|G_s|^2 - |G_b|^2) / (1 / b_small - 1 / b_big)
    B_noise = S / |G|^2        (in samples)

each of ``|G|^2`` and ``S`` smoothed by a moving average before the ratio (both are noisy).
The scale of the deltas (learning rate, steps) cancels in the ratio.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

MONITOR_FIELDS = ("comm_goodput_bps", "strategy", "cluster_size", "batch_size", "gns", "grad_var")  # of round events


def sq_norm(arrays: Sequence[np.ndarray]) -> float:
    """The squared L2 norm of the arrays taken as one vector (float64)."""
    return float(sum(np.vdot(a, a).real for a in (np.asarray(x, dtype=np.float64) for x in arrays)))


def delta(after: Sequence[np.ndarray], before: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``after - before``, array by array, in float64."""
    return [np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64) for a, b in zip(after, before)]


def grad_var(local: Sequence[np.ndarray], mean: Sequence[np.ndarray]) -> float:
    """The mean squared difference per parameter between the local and the mean delta."""
    count = sum(int(np.size(a)) for a in local)
    return sq_norm(delta(local, mean)) / count if count else 0.0


class NoiseScale:
    """The gradient noise scale, from pairs of small- and big-batch deltas.

    ``ema``: the weight of the newest estimate of ``|G|^2`` and ``S`` (None: the plain mean of all)."""

    def __init__(self, ema: Optional[float] = 0.2) -> None:
        self.ema = ema
        self.g2: Optional[float] = None
        self.s: Optional[float] = None
        self.count = 0

    def update(self, small: Sequence[np.ndarray], big: Sequence[np.ndarray], b_small: float,
               b_big: float) -> Optional[float]:
        """Take one pair (``small``: the local delta over ``b_small`` samples, ``big``: the mean
        over ``b_big``); the smoothed noise scale, None while it cannot be told (|G|^2 <= 0)."""
        if not b_big > b_small > 0:
            return self.value()
        gs2, gb2 = sq_norm(small), sq_norm(big)
        g2 = (b_big * gb2 - b_small * gs2) / (b_big - b_small)
        s = (gs2 - gb2) / (1.0 / b_small - 1.0 / b_big)
        self.count += 1
        w = 1.0 / self.count if self.ema is None or self.g2 is None else self.ema
        self.g2 = g2 if self.g2 is None else (1 - w) * self.g2 + w * g2
        self.s = s if self.s is None else (1 - w) * self.s + w * s
        return self.value()

    def value(self) -> Optional[float]:
        """The current estimate (samples), or None."""
        if self.g2 is None or self.s is None or self.g2 <= 0 or self.s <= 0:
            return None
        return self.s / self.g2

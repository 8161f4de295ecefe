"""The training loop the numpy models share: epochs of minibatches in a seeded order."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def train_epochs(rng: Any, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int,
                 step: Callable[[np.ndarray, np.ndarray], float]) -> dict[str, float]:
    """``epochs`` passes over ``x, y`` in batches of ``batch_size`` (``rng.permutation``'s order),
    ``step(x_batch, y_batch) -> loss`` on each; the mean loss of the last epoch and the seconds spent."""
    started = time.perf_counter()
    batch_size = max(1, int(batch_size))
    last = 0.0
    for _ in range(int(epochs)):
        order = rng.permutation(len(x))
        losses = [step(x[order[i:i + batch_size]], y[order[i:i + batch_size]]) for i in range(0, len(x), batch_size)]
        last = float(np.mean(losses)) if losses else 0.0
    return {"loss": last, "train_s": time.perf_counter() - started}

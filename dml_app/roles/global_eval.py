"""When and on what a node evaluates its model on the run's global test set.

A structure conf may set ``eval_every`` (evaluate every k-th round; default 1) and
``global_eval_n`` (evaluate on a fixed sample of that many samples; absent or null: the whole
set), with ``global_eval_seed`` (the structure's model seed) drawing the sample. The sample is
the first ``global_eval_n`` of a permutation of the set seeded by ``global_eval_seed``: every
node of a run holds the same set and the same seed, so every node and every round tests on the
same samples. The last round is always evaluated, on the whole set, so that the run's final
figure is exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

XY = tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class EvalPlan:
    """A node's global evaluation schedule: every ``every`` rounds, on ``sample_n`` samples
    (None: all), drawn with ``seed``."""

    every: int = 1
    sample_n: Optional[int] = None
    seed: int = 0

    @classmethod
    def of(cls, conf: dict[str, Any]) -> "EvalPlan":
        """The plan of a structure conf (defaults for what it leaves out); ValueError names a bad value."""
        every = _whole(conf, "eval_every", 1, 1)
        n = None if conf.get("global_eval_n") is None else _whole(conf, "global_eval_n", None, 1)
        return cls(every, n, _whole(conf, "global_eval_seed", 0, 0))

    def size(self, round_no: int, last: bool, total: int) -> int:
        """How many of the ``total`` global test samples round ``round_no`` evaluates on: all in
        the ``last`` round, none off the schedule, else ``sample_n`` (at most all)."""
        if last:
            return total
        if round_no % self.every:
            return 0
        return total if self.sample_n is None else min(self.sample_n, total)


def _whole(conf: dict[str, Any], key: str, default: Any, low: int) -> Any:
    """``conf[key]``, a whole number of at least ``low`` (``default`` when absent)."""
    value = conf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"structure conf: {key} must be a whole number >= {low}, got {value!r}")
    return value


def sample_indices(total: int, n: int, seed: int) -> np.ndarray:
    """The indices of the fixed sample: the first ``n`` of a permutation of ``range(total)``
    seeded by ``seed``, in increasing order (all of them when ``n >= total``)."""
    if n >= total:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).permutation(total)[:n])


class GlobalSample:
    """The global test set and its fixed sample, drawn once per set (``take``)."""

    def __init__(self) -> None:
        self._source: Optional[np.ndarray] = None  # the set's x the sample was drawn from
        self._key: Optional[tuple[int, int]] = None
        self._sample: Optional[XY] = None

    def take(self, global_test: XY, n: int, seed: int) -> XY:
        """``n`` samples of ``global_test`` (the whole set when ``n`` is its size)."""
        x, y = global_test
        if n >= len(y):
            return global_test
        if self._source is not x or self._key != (n, seed) or self._sample is None:
            idx = sample_indices(len(y), n, seed)
            self._source, self._key, self._sample = x, (n, seed), (x[idx], y[idx])
        return self._sample

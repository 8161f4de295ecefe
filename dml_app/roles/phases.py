"""When a node's round did what: start and end of its train, evaluate, send and wait phases.

Each ``round`` event carries ``phases`` = {"train": [[t0, t1], ...], "evaluate": ..., "send": ...,
"wait": ...} in Unix seconds (this node's clock). train, evaluate and send are timed where they
happen (from any thread: an aggregator sends in parallel) and taken with the round they precede,
like the round's traffic; intervals of one kind that overlap are merged. ``wait`` is what is left
of the round (from its ``t_start`` to its end) outside the other three, gaps of 1 ms or more:
waiting for peers.
A node in several E-tree layers gives a phase to the first round recorded after it.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

KINDS = ("train", "evaluate", "send")
MAX_PER_KIND = 256  # more intervals than this in one round: the closest are merged (an event stays small)
DIGITS = 4  # 0.1 ms
MIN_WAIT_S = 0.001  # a shorter gap between phases is the code between them, not a wait


def merge(spans: list[list[float]], limit: int = MAX_PER_KIND) -> list[list[float]]:
    """``spans`` sorted, overlapping ones merged; more than ``limit``: the shortest gaps closed."""
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    while len(out) > limit:
        i = min(range(len(out) - 1), key=lambda k: out[k + 1][0] - out[k][1])
        out[i:i + 2] = [[out[i][0], max(out[i][1], out[i + 1][1])]]
    return out


class Phases:
    """The phase intervals since the last round was recorded (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, list[list[float]]] = {k: [] for k in KINDS}

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        started = time.time()
        try:
            yield
        finally:
            with self._lock:
                self._spans[kind].append([started, time.time()])

    def take(self, t_start: float, t_end: float) -> dict[str, list[list[float]]]:
        """The round's phases (those gathered since the last ``take``) and its waits."""
        with self._lock:
            spans, self._spans = self._spans, {k: [] for k in KINDS}
        out = {k: merge(v) for k, v in spans.items()}
        busy = merge([s for v in out.values() for s in v], limit=10 ** 9)
        waits, at = [], t_start
        for a, b in busy:
            if a > at:
                waits.append([at, min(a, t_end)])
            at = max(at, b)
        if t_end > at:
            waits.append([at, t_end])
        out["wait"] = merge([w for w in waits if w[1] - w[0] >= MIN_WAIT_S])
        return {k: [[round(a, DIGITS), round(b, DIGITS)] for a, b in v] for k, v in out.items()}

"""When a node's round did what: start and end of its train, evaluate, send and wait phases.

Each ``round`` event carries ``phases`` = {"train": [[t0, t1, c0, c1], ...], "evaluate": ...,
"send": ..., "wait": [[t0, t1], ...]}: t in Unix seconds (this node's clock), c the node
process's CPU clock (``time.process_time``: user + system seconds of all its threads, the compute
thread's included) at the same edges, so c1 - c0 is the CPU the node used in the phase
(``CPU_CLOCK`` names it; a node is a process of its own). train, evaluate and send are timed
where they happen (from any thread: an aggregator sends in parallel) and taken with the round
they precede, like the round's traffic; intervals of one kind that overlap are merged (with the
CPU clock of the first start and of the last end: the counter is the process's, so overlapping
spans are not counted twice). ``wait`` is what is left of the round (from its ``t_start`` to its
end) outside the other three, gaps of 1 ms or more: waiting for peers.
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
CPU_CLOCK = "process_time"  # what c0 and c1 read: the node process's user + system CPU seconds
MIN_WAIT_S = 0.001  # a shorter gap between phases is the code between them, not a wait


def _join(x: list[float], y: list[float]) -> list[float]:
    """Two spans as one: the earlier start, the later end (with their CPU clocks when both have them)."""
    start = x if x[0] <= y[0] else y
    end = x if x[1] >= y[1] else y
    if len(x) >= 4 and len(y) >= 4:
        return [start[0], end[1], start[2], end[3]]
    return [start[0], end[1]]


def merge(spans: list[list[float]], limit: int = MAX_PER_KIND) -> list[list[float]]:
    """``spans`` ([t0, t1] or [t0, t1, c0, c1]) sorted, overlapping ones merged; more than
    ``limit``: the shortest gaps closed."""
    out: list[list[float]] = []
    for span in sorted(spans):
        if out and span[0] <= out[-1][1]:
            out[-1] = _join(out[-1], span)
        else:
            out.append(list(span))
    while len(out) > limit:
        i = min(range(len(out) - 1), key=lambda k: out[k + 1][0] - out[k][1])
        out[i:i + 2] = [_join(out[i], out[i + 1])]
    return out


class Phases:
    """The phase intervals since the last round was recorded (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, list[list[float]]] = {k: [] for k in KINDS}

    @contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        started, cpu = time.time(), time.process_time()
        try:
            yield
        finally:
            with self._lock:
                self._spans[kind].append([started, time.time(), cpu, time.process_time()])

    def take(self, t_start: float, t_end: float) -> dict[str, list[list[float]]]:
        """The round's phases (those gathered since the last ``take``) and its waits."""
        with self._lock:
            spans, self._spans = self._spans, {k: [] for k in KINDS}
        out = {k: merge(v) for k, v in spans.items()}
        busy = merge([s[:2] for v in out.values() for s in v], limit=10 ** 9)
        waits, at = [], t_start
        for a, b in busy:
            if a > at:
                waits.append([at, min(a, t_end)])
            at = max(at, b)
        if t_end > at:
            waits.append([at, t_end])
        out["wait"] = merge([w for w in waits if w[1] - w[0] >= MIN_WAIT_S])
        return {k: [[round(x, DIGITS) for x in span] for span in v] for k, v in out.items()}

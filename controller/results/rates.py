"""The configured rate of every link over a run: the one history telemetry, analysis,
``/metrics``, the live and stored views and the nodes' confs read.

A run's ``LinkRates`` starts from the rates deployed (``of_topology``: from before the start)
and records every change after it: a link re-shaped through ``/update/tc`` or ``/update/link``,
a scenario's link step, or a change the telemetry saw in a host's shaping. A link's history is
a step function ``[(from time_s, rate_bps or None)]`` (None: no link then), in time order; times
are seconds since the run's start, ``-inf`` for "from the start". A link first set after the
start had no rate before (its history begins with ``(-inf, None)``).

``telemetry/rates.csv.gz`` (``time_s,src,dst,rate_bps``) is this history, written when the run
finishes: each link's rate at the first sample, then each change at the time the controller
made it or the telemetry saw it, whichever came first (an empty rate: the link was removed). ``rows`` writes those rows, ``from_rows`` reads them back.
"""
from __future__ import annotations

import bisect
import math
import threading
from typing import Any, Iterable, Iterator, Mapping, Optional

from controller.results.run_dir import csv_fields, finite_float

Key = tuple[str, str]  # (src, dst)
Rate = Optional[float]  # bit/s, or None: no link
Steps = list[tuple[float, Rate]]  # [(from time_s, rate)], in time order
RATES_HEADER = "time_s,src,dst,rate_bps"
FROM_START = -math.inf


def rate_at(steps: Steps, t_s: float) -> Rate:
    """The value of the step function ``steps`` at ``t_s`` (its first value before its first step)."""
    value = steps[0][1] if steps else None
    for start, v in steps:
        if start > t_s:
            break
        value = v
    return value


class LinkRates:
    """Every link's configured rate over a run (thread-safe: the collector, the experiment, the
    scenario and the views share one). ``deployed``: each link's rate from the start."""

    def __init__(self, deployed: Optional[Mapping[Key, Rate]] = None) -> None:
        self._steps: dict[Key, Steps] = {key: [(FROM_START, rate)] for key, rate in (deployed or {}).items()}
        self._lock = threading.Lock()

    @classmethod
    def of_topology(cls, topology: Any) -> "LinkRates":
        """The rates of a ``controller.model.topology.Topology``'s links, from the start."""
        return cls({key: link.shape.rate_bps for key, link in topology.links.items()})

    # changes --------------------------------------------------------------------------------
    def set(self, key: Key, rate_bps: Rate, t_s: float = FROM_START) -> bool:
        """Link ``key`` has ``rate_bps`` from ``t_s`` on (None: removed); False when the history
        says so already. A change may come late (the telemetry reports the past about a second
        later): it goes in at its time, and a step that repeats the one before it is dropped."""
        rate = None if rate_bps is None else int(rate_bps)
        with self._lock:
            steps = self._steps.setdefault(key, [(FROM_START, None)])  # a new link: none before
            before = list(steps)
            i = bisect.bisect_right([t for t, _ in steps], t_s)
            if i > 0 and steps[i - 1][0] == t_s:
                steps[i - 1] = (t_s, rate)
            else:
                steps.insert(i, (t_s, rate))
            steps[1:] = [step for prev, step in zip(steps, steps[1:]) if step[1] != prev[1]]
            return steps != before

    # reading --------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._steps

    def keys(self) -> list[Key]:
        with self._lock:
            return sorted(self._steps)

    def now(self, key: Key) -> Rate:
        """The link's rate now (None: no such link, or removed)."""
        with self._lock:
            steps = self._steps.get(key)
            return steps[-1][1] if steps else None

    def current(self) -> dict[Key, float]:
        """Every link that has a rate now: key -> rate_bps."""
        with self._lock:
            return {key: steps[-1][1] for key, steps in self._steps.items() if steps[-1][1] is not None}

    def at(self, key: Key, t_s: float) -> Rate:
        """The link's rate at ``t_s`` (seconds since the start)."""
        return rate_at(self.steps(key), t_s)

    def over(self, key: Key, times_s: Iterable[float]) -> list[Rate]:
        """The link's rate at each of ``times_s`` (its history read once)."""
        steps = self.steps(key)
        return [rate_at(steps, t) for t in times_s]

    def steps(self, key: Key) -> Steps:
        """A copy of the link's history ([] for a link never known)."""
        with self._lock:
            return list(self._steps.get(key, []))

    # telemetry/rates.csv ------------------------------------------------------------------------
    def rows(self, first_s: float) -> list[str]:
        """The lines of ``telemetry/rates.csv`` (without the header): each link's rate at the
        first sample ``first_s``, then every change after it, in time order."""
        out: list[tuple[float, Key, Rate]] = []
        with self._lock:
            for key, steps in self._steps.items():
                at_first = rate_at(steps, first_s)
                if at_first is not None:
                    out.append((first_s, key, at_first))
                out += [(t, key, rate) for t, rate in steps if t > first_s]
        out.sort(key=lambda row: (row[0], row[1]))
        return [csv_fields((f"{t:.4f}", src, dst, None if rate is None else int(rate))) + "\n"
                for t, (src, dst), rate in out]

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]], deployed: Optional[Mapping[Key, Rate]] = None) -> "LinkRates":
        """The history a stored run's ``telemetry/rates.csv`` rows (dicts) give; a link without
        rows keeps its ``deployed`` rate (runs from before the file was written)."""
        changes: dict[Key, Steps] = {}
        for r in rows:
            t = finite_float(r.get("time_s"))
            if t is not None and r.get("src") and r.get("dst"):
                changes.setdefault((str(r["src"]), str(r["dst"])), []).append((t, finite_float(r.get("rate_bps"))))
        first = min((t for steps in changes.values() for t, _ in steps), default=0.0)  # the first sample
        for steps in changes.values():
            steps.sort(key=lambda step: step[0])
            if steps[0][0] > first:  # a link added during the run: none before
                steps.insert(0, (FROM_START, None))
        out = cls(deployed)
        out._steps.update(changes)
        return out

    def __iter__(self) -> Iterator[Key]:
        return iter(self.keys())

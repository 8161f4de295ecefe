"""The emulation host's load besides the experiment's nodes: an input of the burst predictions.

``host_busy_cores``: the cores the host kept busy with work other than the experiment's own
nodes, mean over the run. A node's CPU use in a compute burst is the share of a core it got,
and its network idles hold its compute's wall time, so both follow this load rather than the
configuration (over 54 runs of one grid: correlation -0.86 to -0.94 between the host's busy
cores and the CPU burst consumption). Busy is what the telemetry counts: all CPU time but idle
and iowait (``/proc/stat``, as ``worker.observe.telemetry.HostCounters``).

- A recorded run (``of_run``): per node, its host's busy CPU time (``telemetry/hosts.csv.gz``)
  minus that of the run's nodes on the host (``telemetry/nodes.csv.gz``, their cgroups), over
  the run's rounds (the first round's end to the last round's end, ``metrics.csv``), divided
  by that time. It holds the controller's, the agent's and the captures' work of the run.
- Expected (``measure``): the busy CPU time of this host over a short window now, divided by
  the window (when no experiment runs: all of it is other work); ``edgetb predict
  --host-busy-cores`` states it instead.

Busy cores stop at the host's core count: beyond it a heavier load shows the same value, so a
prediction can follow the load only up to that point.
"""
from __future__ import annotations

import csv
import gzip
import json
import os
import time
from typing import Optional

import numpy as np

from controller.results.run_dir import finite_float
from worker.api.errors import ConfigError

FEATURE = "host_busy_cores"
MEASURE_WINDOW_S = 0.5


def busy_s(stat_path: str = "/proc/stat") -> float:
    """This host's busy CPU time since boot, seconds (all but idle and iowait, every CPU)."""
    with open(stat_path, "rb") as f:
        fields = f.readline().split()
    if not fields or fields[0] != b"cpu" or len(fields) < 9:
        raise ConfigError(f"{stat_path}: no 'cpu' line of at least 8 counters")
    ticks = sum(int(x) for x in fields[1:9]) - int(fields[4]) - int(fields[5])
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(window_s: float = MEASURE_WINDOW_S, stat_path: str = "/proc/stat") -> float:
    """The cores this host keeps busy now: its busy CPU time over ``window_s`` seconds."""
    if not window_s > 0:
        raise ConfigError(f"host load window: {window_s!r} s, expected a positive number of seconds")
    t0, b0 = time.monotonic(), busy_s(stat_path)
    time.sleep(window_s)
    t1, b1 = time.monotonic(), busy_s(stat_path)
    return max(0.0, (b1 - b0) / (t1 - t0))


def _series(path: str, key: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per ``key`` value (host or node) of a telemetry CSV: (time_s, cpu_s), time-sorted."""
    out: dict[str, list[tuple[float, float]]] = {}
    with gzip.open(path, "rt", newline="") as f:
        reader = csv.DictReader(f)
        if not {"time_s", key, "cpu_s"} <= set(reader.fieldnames or []):
            raise ConfigError(f"{path}: needs the columns time_s, {key} and cpu_s")
        for row in reader:
            t, c = finite_float(row.get("time_s")), finite_float(row.get("cpu_s"))
            if t is not None and c is not None:
                out.setdefault(row[key], []).append((t, c))
    return {k: (np.array([t for t, _ in v]), np.array([c for _, c in v])) for k, v in
            ((k, sorted(v)) for k, v in out.items()) if len(v) >= 2}


def _used(series: tuple[np.ndarray, np.ndarray], a: float, b: float) -> float:
    t, c = series
    return float(np.interp(b, t, c) - np.interp(a, t, c))


def _window(run_dir: str) -> Optional[tuple[float, float]]:
    """From the first round's end to the last round's end over the run's nodes (``metrics.csv``)."""
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.isfile(path):
        return None
    with open(path, newline="") as f:
        ends = [t for t in (finite_float(r.get("time_s")) for r in csv.DictReader(f)) if t is not None]
    return (min(ends), max(ends)) if len(ends) >= 2 and max(ends) > min(ends) else None


def _hosts(run_dir: str) -> dict[str, str]:
    """Each node's host, from the run's ``topology.json`` (every node on ``local`` without it)."""
    path = os.path.join(run_dir, "topology.json")
    try:
        with open(path) as f:
            nodes = json.load(f).get("nodes", [])
    except (OSError, ValueError, AttributeError):
        return {}
    items = nodes.values() if isinstance(nodes, dict) else nodes
    return {str(n["name"]): str(n.get("host") or "local") for n in items if isinstance(n, dict) and "name" in n}


def of_run(run_dir: str) -> dict[str, float]:
    """Each node's ``host_busy_cores`` over a recorded run (empty when the run has no host
    telemetry: ``telemetry/hosts.csv.gz`` and ``nodes.csv.gz``, or no two round ends)."""
    tele = os.path.join(run_dir, "telemetry")
    hosts_csv, nodes_csv = os.path.join(tele, "hosts.csv.gz"), os.path.join(tele, "nodes.csv.gz")
    window = _window(run_dir)
    if window is None or not (os.path.isfile(hosts_csv) and os.path.isfile(nodes_csv)):
        return {}
    a, b = window
    hosts, nodes = _series(hosts_csv, "host"), _series(nodes_csv, "node")
    host_of = _hosts(run_dir)
    out: dict[str, float] = {}
    for host, series in hosts.items():
        mine = [n for n in nodes if host_of.get(n, "local") == host]
        other = _used(series, a, b) - sum(_used(nodes[n], a, b) for n in mine)
        for n in mine:
            out[n] = max(0.0, other / (b - a))
    return out

"""Modelled energy of device nodes: a pure function of the run folder's telemetry and topology.

For a node of a device class (``controller.model.devices``; its record in ``topology.json``)
the power at utilisation u is ``P(u) = idle_w + (max_w - idle_w) * u`` with
u = the node's CPU time / (its CPU quota x the time): 1 when all the emulated device's
cores are busy. Over the telemetry's samples (``telemetry/nodes.csv.gz``, cumulative
``cpu_s``, ``tx_bytes``, ``rx_bytes``)::

    E = sum_k P(u_k) * dt_k + e_byte_j * bytes

Between two stored rows a node's counters grow linearly (the collector stores a row when a
value changed, and the last unchanged one before a change), so u is constant on each interval
and the sum over rows is the sum over every 10 Hz sample. A round's energy is the difference
of the cumulative energy (interpolated) at the end of the node's previous round and at the end
of this one (``metrics.csv``'s ``time_s``; the first round from the run's start). A model: it
ignores a radio's tail energy, DVFS, temperature, memory and storage power.

A physical node whose board has power monitors (``worker.observe.power_rails``) is measured,
not modelled: its host's ``energy_mj`` in ``telemetry/hosts.csv.gz`` (``read_measured``) gives
its cumulative energy, and its rounds and total come from it the same way.

A node away (``scenario.csv``: from an applied ``pause``, ``crash`` or ``revoke`` until its ``resume`` or
``replace``, or the end) draws no power: a device that has left the experiment (out of reach,
switched off, in its owner's pocket) is not powered by it. Its u is its CPU time over the time
it was there.
"""
from __future__ import annotations

import csv
import gzip
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

from controller.results.run_dir import SCENARIO_CSV, TELEMETRY_DIR, TOPOLOGY_JSON

NODES_CSV_GZ = "nodes.csv.gz"
HOSTS_CSV_GZ = "hosts.csv.gz"
LEAVE_STEPS = ("pause", "crash", "revoke")
RETURN_STEPS = ("resume", "replace")


@dataclass(frozen=True)
class PowerModel:
    """One node's figures: watts at rest and all cores busy, its quota in host cores, J per byte."""

    idle_w: float
    max_w: float
    quota_cores: float
    e_byte_j: float = 0.0
    away_s: tuple[tuple[float, float], ...] = ()  # (left, returned) seconds of the run: no power

    @classmethod
    def of_device(cls, device: dict[str, Any], away_s: Iterable[tuple[float, float]] = ()) -> "PowerModel":
        return cls(float(device["idle_w"]), float(device["max_w"]), float(device["quota_cores"]),
                   float(device.get("e_byte_j") or 0.0), tuple(away_s))


def _away_in(t_s: np.ndarray, away_s: Iterable[tuple[float, float]]) -> np.ndarray:
    """The seconds of each interval ``t_s[k]..t_s[k+1]`` that fall in the ``away_s`` windows."""
    a, b = t_s[:-1], t_s[1:]
    out = np.zeros(len(a))
    for left, back in away_s:
        out += np.clip(np.minimum(b, back) - np.maximum(a, left), 0.0, None)
    return out


def cumulative_energy_j(t_s: np.ndarray, cpu_s: np.ndarray, bytes_: np.ndarray, model: PowerModel) -> np.ndarray:
    """The energy since ``t_s[0]`` at each sample (J), from cumulative CPU seconds and bytes."""
    t_s, cpu_s, bytes_ = (np.asarray(a, dtype=float) for a in (t_s, cpu_s, bytes_))
    if len(t_s) == 0:
        return np.zeros(0)
    dt = np.maximum(np.diff(t_s), 0.0)
    there = np.maximum(dt - _away_in(t_s, model.away_s), 0.0) if model.away_s else dt
    dcpu = np.maximum(np.diff(cpu_s), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(there > 0, dcpu / (model.quota_cores * there), 0.0)
    u = np.clip(u, 0.0, 1.0)
    power_w = model.idle_w + (model.max_w - model.idle_w) * u
    net_j = model.e_byte_j * np.maximum(np.diff(bytes_), 0.0)
    return np.concatenate([[0.0], np.cumsum(power_w * there + net_j)])


def energy_between_j(t_s: np.ndarray, energy_j: np.ndarray, a_s: float, b_s: float) -> Optional[float]:
    """The energy between ``a_s`` and ``b_s`` (interpolated; None outside the sampled span)."""
    if len(t_s) < 2 or b_s < a_s or a_s < t_s[0] - 1.0 or b_s > t_s[-1] + 1.0:
        return None
    ea, eb = np.interp([a_s, b_s], t_s, energy_j)
    return float(eb - ea)


def read_node_telemetry(run_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Node -> (time_s, cpu_s, tx+rx bytes) from ``telemetry/nodes.csv.gz`` ({} when absent);
    an empty counter is carried from the row before."""
    path = os.path.join(run_dir, TELEMETRY_DIR, NODES_CSV_GZ)
    if not os.path.exists(path):
        return {}
    rows: dict[str, list[tuple[float, float, float]]] = {}
    with gzip.open(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            try:
                t = float(r["time_s"])
            except (TypeError, ValueError):
                continue
            seen = rows.setdefault(r["node"], [])
            last = seen[-1] if seen else (t, 0.0, 0.0)
            cpu = _num(r.get("cpu_s"), last[1])
            sent_recv = _num(r.get("tx_bytes"), None), _num(r.get("rx_bytes"), None)
            b = last[2] if None in sent_recv else sent_recv[0] + sent_recv[1]
            seen.append((t, cpu, b))
    out = {}
    for node, seen in rows.items():
        a = np.array(sorted(seen))
        out[node] = (a[:, 0], a[:, 1], a[:, 2])
    return out


def _num(text: Any, default: Any) -> Any:
    try:
        return float(text) if text not in (None, "") else default
    except ValueError:
        return default


def away_windows(rows: Iterable[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Node -> the (left, returned) seconds it was away, from ``scenario.csv``'s rows: an applied
    ``pause`` or ``crash`` until the next applied ``resume`` or ``replace`` of it (inf: never)."""
    left: dict[str, float] = {}
    out: dict[str, list[tuple[float, float]]] = {}
    for r in sorted(rows, key=lambda r: r["applied_s"]):
        node, kind, t = str(r.get("target", "")), r.get("event"), float(r["applied_s"])
        if kind in LEAVE_STEPS and node not in left:
            left[node] = t
        elif kind in RETURN_STEPS and node in left:
            out.setdefault(node, []).append((left.pop(node), t))
    for node, t in left.items():
        out.setdefault(node, []).append((t, math.inf))
    return out


def read_away(run_dir: str) -> dict[str, list[tuple[float, float]]]:
    """``away_windows`` of the run's ``scenario.csv`` ({} without one); only applied rows count."""
    try:
        with open(os.path.join(run_dir, SCENARIO_CSV), newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error):
        return {}
    applied = []
    for r in rows:
        t = _num(r.get("applied_s"), None)
        if t is not None and math.isfinite(t) and str(r.get("outcome", "")).startswith("applied"):
            applied.append({**r, "applied_s": t})
    return away_windows(applied)


def device_models(run_dir: str) -> dict[str, PowerModel]:
    """Node -> its power model (with the windows it was away), for the nodes of ``topology.json``
    that have a device class."""
    try:
        with open(os.path.join(run_dir, TOPOLOGY_JSON)) as f:
            topo = json.load(f)
    except (OSError, ValueError):
        return {}
    away = read_away(run_dir)
    return {str(n["name"]): PowerModel.of_device(n["device"], away.get(str(n["name"]), ()))
            for n in topo.get("nodes", []) if isinstance(n, dict) and isinstance(n.get("device"), dict)}


def read_measured(run_dir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Physical node -> (time_s, its measured energy since the run's start in J) from its host's
    ``energy_mj`` in ``telemetry/hosts.csv.gz`` ({} for nodes whose host measured none)."""
    try:
        with open(os.path.join(run_dir, TOPOLOGY_JSON)) as f:
            topo = json.load(f)
    except (OSError, ValueError):
        return {}
    physical = {str(n.get("host")): str(n["name"]) for n in topo.get("nodes", [])
                if isinstance(n, dict) and n.get("kind") == "physical" and "name" in n}
    path = os.path.join(run_dir, TELEMETRY_DIR, HOSTS_CSV_GZ)
    if not physical or not os.path.exists(path):
        return {}
    seen: dict[str, list[tuple[float, float]]] = {}
    with gzip.open(path, "rt", newline="") as f:
        for r in csv.DictReader(f):
            node = physical.get(str(r.get("host")))
            t, mj = _num(r.get("time_s"), None), _num(r.get("energy_mj"), None)
            if node is not None and t is not None and mj is not None:
                seen.setdefault(node, []).append((t, mj / 1000.0))
    out = {}
    for node, points in seen.items():
        a = np.array(sorted(points))
        out[node] = (a[:, 0], a[:, 1])
    return out


def round_energy(rows: Iterable[dict[str, Any]], telemetry: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                 models: dict[str, PowerModel], measured: Optional[dict[str, tuple[np.ndarray, np.ndarray]]] = None
                 ) -> dict[tuple[str, Any], float]:
    """(node, round) -> the round's energy (J) for metrics.csv's rows of device nodes, modelled
    (``models``) or ``measured`` (each row's ``time_s`` its end; a round starts where the node's
    previous one ended, the first at 0)."""
    out: dict[tuple[str, Any], float] = {}
    previous: dict[str, float] = {}
    cumulative = {n: (telemetry[n][0], cumulative_energy_j(*telemetry[n], m)) for n, m in models.items()
                  if n in telemetry}
    cumulative.update(measured or {})
    for row in sorted(rows, key=lambda r: (r["node"], r["time_s"] if r["time_s"] is not None else -1.0)):
        node, end = row["node"], row["time_s"]
        if node not in cumulative or end is None:
            continue
        t, e = cumulative[node]
        start = previous.get(node, max(0.0, float(t[0])))
        previous[node] = end
        value = energy_between_j(t, e, start, end)
        if value is not None:
            out[(node, row["round"])] = round(value, 4)
    return out


def node_energy(telemetry: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
                models: dict[str, PowerModel], measured: Optional[dict[str, tuple[np.ndarray, np.ndarray]]] = None
                ) -> dict[str, dict[str, Any]]:
    """Node -> its energy over the sampled run (J), the span (s) and the mean power (W);
    ``measured``: true for a physical node's measured energy."""
    out: dict[str, dict[str, Any]] = {}
    for node, (t, e) in (measured or {}).items():
        if len(t) >= 2:
            span = float(t[-1] - t[0])
            total = float(e[-1] - e[0])
            out[node] = {"energy_j": round(total, 3), "sampled_s": round(span, 3), "away_s": 0.0,
                         "mean_power_w": round(total / span, 4) if span > 0 else None, "measured": True}
    for node, model in models.items():
        if node not in telemetry or len(telemetry[node][0]) < 2:
            continue
        t = telemetry[node][0]
        total = float(cumulative_energy_j(*telemetry[node], model)[-1])
        span = float(t[-1] - t[0])
        away = float(_away_in(np.asarray(t, dtype=float), model.away_s).sum()) if model.away_s else 0.0
        there = span - away
        out[node] = {"energy_j": round(total, 3), "sampled_s": round(span, 3), "away_s": round(away, 3),
                     "mean_power_w": round(total / there, 4) if there > 0 else None, "measured": False}
    return out

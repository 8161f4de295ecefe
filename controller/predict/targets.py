"""What a finished run measured, per node: the quantities prediction learns and checks.

From ``metrics.csv`` (one row per node and round): the round time (between the ends of
consecutive rounds; the first round, which holds the start-up, is left out), its mean and
95th percentile, the mean ``train_s`` and ``send_s``, bytes sent and received per round and the
node's total time (its last round's ``time_s``). A node in several layers (E-tree) is timed
by its lowest layer's rounds, and its bytes of every layer are counted per such round. From
``analysis/timed_bursts.csv`` (else ``analysis/bursts.csv``) when present:
the 12 burst metrics, {cpu, mem, net_tx, net_rx} x {burst_s, idle_s, burst_consumption}
(an empty cell, e.g. no idle period, is no value).
"""
from __future__ import annotations

import csv
import os
from typing import Optional

import numpy as np

from controller.predict.setting import MissingFileError
from controller.results.run_dir import finite_float
from worker.api.errors import ConfigError

TIME_TARGETS = ("round_mean_s", "round_p95_s", "train_s", "send_s", "total_s")
BYTE_TARGETS = ("bytes_sent_per_round", "bytes_recv_per_round")
BURST_RESOURCES = ("cpu", "mem", "net_tx", "net_rx")
BURST_FIELDS = ("burst_s", "idle_s", "burst_consumption")
BURST_TARGETS = tuple(f"{r}_{f}" for r in BURST_RESOURCES for f in BURST_FIELDS)
TARGETS = TIME_TARGETS + BYTE_TARGETS + BURST_TARGETS


def _mean(values: list[float]) -> Optional[float]:
    return float(np.mean(values)) if values else None


def read_metrics(run_dir: str) -> dict[str, dict[str, Optional[float]]]:
    """Each node's round, byte and total targets from ``metrics.csv``."""
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.isfile(path):
        raise MissingFileError(f"{path}: missing (a finished run's per-round metrics)")
    rows: dict[str, list[dict[str, str]]] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        need = {"node", "round", "time_s", "train_s", "send_s", "bytes_sent", "bytes_recv"}
        if not need <= set(reader.fieldnames or []):
            raise ConfigError(f"{path}: needs the columns {', '.join(sorted(need - set(reader.fieldnames or [])))}")
        for row in reader:
            rows.setdefault(row["node"], []).append(row)
    out: dict[str, dict[str, Optional[float]]] = {}
    for node, every in rows.items():
        layers = sorted({r.get("layer") or "" for r in every}, key=lambda v: (v == "", finite_float(v) or 0.0))
        mine = sorted((r for r in every if (r.get("layer") or "") == layers[0]), key=lambda r: int(r["round"]))
        ends = [t for t in (finite_float(r["time_s"]) for r in mine) if t is not None]
        durations = [b - a for a, b in zip(ends, ends[1:]) if b >= a]
        col = {k: [v for v in (finite_float(r[k]) for r in mine) if v is not None] for k in ("train_s", "send_s")}
        moved = {k: sum(v for v in (finite_float(r[k]) for r in every) if v is not None)
                 for k in ("bytes_sent", "bytes_recv")}
        out[node] = {"round_mean_s": _mean(durations),
                     "round_p95_s": float(np.percentile(durations, 95)) if durations else None,
                     "train_s": _mean(col["train_s"]), "send_s": _mean(col["send_s"]),
                     "total_s": max(t for t in (finite_float(r["time_s"]) for r in every) if t is not None)
                     if ends else None,
                     "bytes_sent_per_round": moved["bytes_sent"] / len(mine) if mine else None,
                     "bytes_recv_per_round": moved["bytes_recv"] / len(mine) if mine else None,
                     "rounds_done": float(len(mine))}
    return out


def read_bursts(run_dir: str) -> dict[str, dict[str, Optional[float]]]:
    """Each node's 12 burst metrics from ``analysis/timed_bursts.csv`` (phases and packets: the one
    burst definition, controller/results/analysis/timed_bursts.py), else from the sampled series'
    ``analysis/bursts.csv`` of an older analysis (empty when neither is there)."""
    out: dict[str, dict[str, Optional[float]]] = {}
    paths = [os.path.join(run_dir, "analysis", name) for name in ("timed_bursts.csv", "bursts.csv")]
    path = next((p for p in paths if os.path.isfile(p)), None)
    if path is None:
        return out
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("resource") not in BURST_RESOURCES:
                continue
            node = out.setdefault(row.get("node", ""), {})
            for field in BURST_FIELDS:
                node[f"{row['resource']}_{field}"] = finite_float(row.get(field))
    return out


def read_targets(run_dir: str) -> dict[str, dict[str, Optional[float]]]:
    """Each node's measured targets (``TARGETS``; None where the run has no value)."""
    metrics, bursts = read_metrics(run_dir), read_bursts(run_dir)
    return {node: {t: {**values, **bursts.get(node, {})}.get(t) for t in (*TARGETS, "rounds_done")}
            for node, values in metrics.items()}

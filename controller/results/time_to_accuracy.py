"""Time-to-accuracy: how long, how many rounds and how many bytes a run took to reach each target
accuracy on the global test set. A pure function of the rows of ``metrics.csv``.

Targets come from the structure file's ``target_accuracy`` (a list of accuracies in (0, 1],
default ``controller.confs.structures.DEFAULT_TARGET_ACCURACY``); every node's conf carries
them, so a run folder's ``confs.json`` says which targets it asked for.

Definitions (times count from the run's start, as ``metrics.csv``'s ``time_s``):

- **a node** reaches a target at its first round whose ``global_accuracy`` is at least the
  target: ``time_s`` is that round's end, ``rounds`` its number, ``bytes_sent`` and
  ``bytes_recv`` what the node counted sending and receiving in its rounds up to and with it.
- **the run** reaches a target at the first round number k where the mean, over the nodes that
  evaluated round k, of their global accuracy is at least the target. ``time_s`` is when the
  last of those nodes ended round k (only then is that mean known), ``rounds`` is k, and
  ``bytes_sent`` is every byte the nodes sent in rounds that ended by that time (each byte moved
  counted once, at its sender). ``accuracy`` is that mean, ``nodes`` how many nodes it is over.

A target never reached is ``null``, for a node and for the run. Energy is not modelled by the
testbed, so it is not given.
"""
from __future__ import annotations

import csv
import os
from typing import Any, Iterable, Optional, Sequence

from controller.confs.structures import DEFAULT_TARGET_ACCURACY as DEFAULT_TARGETS
from controller.results.run_dir import CONFS_JSON, METRICS_CSV, finite_number, read_json

KEY = "target_accuracy"  # the structure file's field, and each node conf's


def targets_of(confs: Any) -> list[float]:
    """The targets a run asked for: the ``target_accuracy`` of any of its node confs (as
    ``confs.json`` holds them: ``{node: {"structure": conf}}`` or ``{node: conf}``); the defaults
    for a run made before the field existed."""
    if isinstance(confs, dict):
        for conf in confs.values():
            conf = conf.get("structure", conf) if isinstance(conf, dict) else None
            if isinstance(conf, dict) and isinstance(conf.get(KEY), list):
                found = [float(t) for t in conf[KEY] if finite_number(t) is not None and 0 < float(t) <= 1]
                return sorted(set(found))
    return list(DEFAULT_TARGETS)


def _int(value: Any) -> Optional[int]:
    v = finite_number(value)
    return int(v) if v is not None and float(v).is_integer() else None


def _rows(rows: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The usable rows by node, in round order: a round number and an end time (CSV cells or numbers)."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        number, t = _int(r.get("round")), finite_number(r.get("time_s"))
        if number is None or t is None or not r.get("node"):
            continue
        by_node.setdefault(str(r["node"]), []).append(
            {"round": number, "time_s": float(t), "accuracy": finite_number(r.get("global_accuracy")),
             "bytes_sent": _int(r.get("bytes_sent")) or 0, "bytes_recv": _int(r.get("bytes_recv")) or 0})
    for node_rows in by_node.values():
        node_rows.sort(key=lambda x: (x["round"], x["time_s"]))
    return by_node


def node_reached(node_rows: Sequence[dict[str, Any]], target: float) -> Optional[dict[str, Any]]:
    """When one node (its rows from ``_rows``) first reached ``target``; None if never."""
    sent = recv = 0
    for r in node_rows:
        sent, recv = sent + r["bytes_sent"], recv + r["bytes_recv"]
        if r["accuracy"] is not None and r["accuracy"] >= target:
            return {"time_s": round(r["time_s"], 3), "rounds": r["round"], "bytes_sent": sent, "bytes_recv": recv,
                    "accuracy": r["accuracy"]}
    return None


def run_reached(by_node: dict[str, list[dict[str, Any]]], target: float) -> Optional[dict[str, Any]]:
    """When the run first reached ``target`` (the mean over nodes of a round, see the module); None if never."""
    per_round: dict[int, list[tuple[float, float]]] = {}
    for node_rows in by_node.values():
        for r in node_rows:
            if r["accuracy"] is not None:
                per_round.setdefault(r["round"], []).append((r["time_s"], r["accuracy"]))
    for k in sorted(per_round):
        got = per_round[k]
        mean = sum(a for _, a in got) / len(got)
        if mean >= target:
            at = max(t for t, _ in got)
            sent = sum(r["bytes_sent"] for node_rows in by_node.values() for r in node_rows if r["time_s"] <= at)
            return {"time_s": round(at, 3), "rounds": k, "bytes_sent": sent, "accuracy": round(mean, 6),
                    "nodes": len(got)}
    return None


def time_to_accuracy(rows: Iterable[dict[str, Any]], targets: Sequence[float]) -> list[dict[str, Any]]:
    """Per target (in increasing order): ``{"target", "run": {...} | None, "nodes": {node: {...} | None}}``
    from ``metrics.csv``'s rows (dicts with node, round, time_s, global_accuracy, bytes_sent, bytes_recv)."""
    by_node = _rows(rows)
    return [{"target": t, "run": run_reached(by_node, t),
             "nodes": {n: node_reached(by_node[n], t) for n in sorted(by_node)}}
            for t in sorted(set(float(x) for x in targets))]


def target_label(target: float) -> str:
    """A target as it appears in column names: ``0.8`` -> ``0.8``, ``0.95`` -> ``0.95``."""
    return f"{target:g}"


def of_run_dir(run_dir: str) -> list[dict[str, Any]]:
    """``time_to_accuracy`` of a finished run folder: its ``metrics.csv`` and the targets of its
    ``confs.json`` (``[]`` without metrics)."""
    path = os.path.join(run_dir, METRICS_CSV)
    if not os.path.isfile(path):
        return []
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return time_to_accuracy(rows, targets_of(read_json(os.path.join(run_dir, CONFS_JSON))))

"""The dashboard's view of a stored run (``controller.web.live`` describes the view) and the list of
runs in an experiment's ``dml_file/log/``, read from the run folders' files only."""
from __future__ import annotations

import csv
import math
import os
import re
from typing import Any, Optional

import numpy as np

from controller.results import adaptation
from controller.results.analysis.inputs import read_run
from controller.results.analysis.series import counter_at
from controller.results.bands import finite_round, median_10_90
from controller.results.run_dir import (CONFS_JSON, MEMBERSHIP_CSV, METRICS_CSV, RUN_JSON, SUMMARY_JSON, TIMELINE_JSON,
                                        TOPOLOGY_JSON, finite_float, models, read_json_object, read_run_events)
from controller.results.tables import read_scenario
from controller.run.trace_replay import TRACE_NETEM_CSV, stored_netem
from controller.web.live import TIME_SERIES, round_series
from controller.web.structure import places_of
from worker.api.errors import NotFound

RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,80}")
MAX_POINTS = 2000  # points of a stored run's time series (the step grows with the run's length)


def log_root(workdir: str) -> str:
    return os.path.join(os.path.realpath(workdir), "dml_file", "log")


def run_dir_of(workdir: str, run_id: Any) -> str:
    """The folder of run ``run_id`` in ``workdir``'s log (never a path outside it)."""
    root = log_root(workdir)
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id) or run_id in (".", ".."):
        raise NotFound(f"no run {str(run_id)[:40]!r}: a run id is letters, digits, '.', '_' and '-'")
    path = os.path.realpath(os.path.join(root, run_id))
    if os.path.dirname(path) != root or not os.path.isdir(path):
        raise NotFound(f"no run {run_id!r} in {root}")
    return path


def list_runs(workdir: str) -> list[dict[str, Any]]:
    """The runs of ``workdir``, newest first, each with what its run.json and summary.json say."""
    root = log_root(workdir)
    try:
        names = sorted(os.listdir(root), reverse=True)
    except OSError:
        return []
    runs = []
    for name in names:
        path = os.path.join(root, name)
        if not RUN_ID_RE.fullmatch(name) or not os.path.isfile(os.path.join(path, RUN_JSON)):
            continue
        record, summary = read_json_object(os.path.join(path, RUN_JSON)), read_json_object(os.path.join(path, SUMMARY_JSON))
        started, ended = record.get("started_at"), record.get("ended_at")
        accs = [n.get("final_global_accuracy") if n.get("final_global_accuracy") is not None else n.get("accuracy")
                for n in summary.get("nodes", []) if isinstance(n, dict)]
        accs = [a for a in accs if isinstance(a, (int, float))]
        runs.append({"run_id": name, "algorithm": record.get("algorithm"), "ended": record.get("ended"),
                     "started_at": started, "nodes": len(record.get("nodes") or {}),
                     "duration_s": round(ended - started, 1) if isinstance(started, (int, float))
                     and isinstance(ended, (int, float)) else None,
                     "accuracy_median": median_10_90(accs)[0] if accs else None})
    return runs


def _metric_rows(run_dir: str) -> list[dict[str, Any]]:
    num = finite_float
    rows = []
    try:
        with open(os.path.join(run_dir, METRICS_CSV), newline="", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                acc = num(r.get("global_accuracy"))
                loss = num(r.get("global_loss"))
                skipped = r.get("global_eval_n") == "0"  # no global evaluation that round: no value
                rows.append({"node": r.get("node", ""), "round": int(num(r.get("round")) or 0),
                             "layer": int(num(r.get("layer"))) if num(r.get("layer")) is not None else None,
                             "time_s": num(r.get("time_s")), "accuracy": num(r.get("accuracy")),
                             "value": None if skipped else acc if acc is not None else num(r.get("accuracy")),
                             "loss": None if skipped else loss if loss is not None else num(r.get("loss")),
                             "skipped": skipped, "strategy": adaptation.text(r.get("strategy"))})
    except (OSError, UnicodeDecodeError, csv.Error):
        pass
    return rows


def _grid(end_s: float) -> np.ndarray:
    step = max(1.0, math.ceil(end_s / MAX_POINTS))
    return np.arange(0.0, end_s + step, step)


def _held(times: list[float], values: list[Optional[float]], grid: np.ndarray) -> np.ndarray:
    """A node's last reported value at each grid time (NaN before its first report)."""
    t = np.asarray(times, np.float64)
    v = np.asarray([np.nan if x is None else x for x in values], np.float64)
    k = np.searchsorted(t, grid, side="right") - 1
    out = np.where(k >= 0, v[np.clip(k, 0, None)], np.nan)
    return out


def _bands(matrix: np.ndarray) -> tuple[list, list, list]:
    """Median, 10th and 90th percentile per column of ``matrix`` (rows: nodes), NaN columns as None."""
    meds, los, his = [], [], []
    for column in matrix.T:
        med, lo, hi = median_10_90(column)
        meds.append(med)
        los.append(lo)
        his.append(hi)
    return meds, los, his


def stored_view(run_dir: str) -> dict[str, Any]:
    """The view of the finished run in ``run_dir``."""
    inp = read_run(run_dir, captures=False, counters=("links", "nodes"))
    record = read_json_object(os.path.join(run_dir, RUN_JSON))
    summary = read_json_object(os.path.join(run_dir, SUMMARY_JSON))
    rows = _metric_rows(run_dir)
    names = list(inp.nodes)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r["time_s"] is not None:
            by_node.setdefault(r["node"], []).append(r)
    for rs in by_node.values():
        rs.sort(key=lambda r: r["time_s"])
    end_s = inp.ended_s or max((r["time_s"] for r in rows if r["time_s"] is not None), default=1.0)
    grid = _grid(end_s)
    series: dict[str, list] = {k: [] for k in TIME_SERIES}
    series["t_s"] = [round(float(t), 3) for t in grid]
    for prefix, key in (("acc", "value"), ("loss", "loss")):
        evaluated = [[r for r in rs if not r["skipped"]] for rs in by_node.values()]  # a skipped round holds on
        held = [_held([r["time_s"] for r in rs], [r[key] for r in rs], grid) for rs in evaluated if rs]
        meds, los, his = _bands(np.vstack(held)) if held else ([None] * grid.size,) * 3
        series[f"{prefix}_med"], series[f"{prefix}_lo"], series[f"{prefix}_hi"] = meds, los, his
    total = np.zeros(grid.size)
    links = inp.link_counters
    if links is not None:
        for key in links.keys:
            total += counter_at(links.times[key], links.values[key]["tx_bytes"], grid)
    rate = np.diff(total, prepend=0.0) * 8 / np.diff(grid, prepend=grid[0] - 1.0)
    series["throughput_bps"] = [finite_round(x, 1) if links is not None else None for x in np.maximum(rate, 0)]
    node_counters = inp.node_counters
    cpu_rows, mem_rows = [], []
    if node_counters is not None:
        for key in node_counters.keys:
            t, values = node_counters.times[key], node_counters.values[key]
            if t.size < 2:
                continue
            cpu = counter_at(t, values["cpu_s"], grid)
            cores = np.diff(cpu, prepend=np.nan) / np.diff(grid, prepend=np.nan)
            inside = (grid >= t[0]) & (grid <= t[-1])
            cpu_rows.append(np.where(inside, cores, np.nan))
            mem_rows.append(np.where(inside, np.interp(grid, t, values["mem_bytes"]), np.nan))
    for prefix, matrix in (("cpu", cpu_rows), ("mem", mem_rows)):
        meds, los, his = _bands(np.vstack(matrix)) if matrix else ([None] * grid.size,) * 3
        series[f"{prefix}_med"], series[f"{prefix}_lo"], series[f"{prefix}_hi"] = meds, los, his
    by_round: dict[int, tuple[list[float], list[float]]] = {}
    layers: dict[str, int] = {}
    for r in rows:
        accs, losses = by_round.setdefault(r["round"], ([], []))
        if r["value"] is not None:
            accs.append(r["value"])
        if r["loss"] is not None:
            losses.append(r["loss"])
        if r["layer"] is not None:
            layers[r["node"]] = r["layer"]
    link_keys = sorted(set(inp.links) | {k for k in inp.rates.keys() if k[0] in inp.nodes and k[1] in inp.nodes})
    kinds = {n.get("name"): str(n.get("kind") or "") for n in read_json_object(os.path.join(run_dir, TOPOLOGY_JSON)).get(
        "nodes", []) if isinstance(n, dict)}
    finals = {n.get("node"): n for n in summary.get("nodes", []) if isinstance(n, dict)}
    confs = read_json_object(os.path.join(run_dir, CONFS_JSON))
    places = places_of(confs)
    endings = record.get("nodes") or {}
    last = {name: (rs[-1] if rs else {}) for name, rs in by_node.items()}
    duration = max(end_s, 1e-9)
    link_bps = []
    for key in link_keys:
        gained = 0.0
        if links is not None and (key[0], key[1]) in links.times:
            gained = float(links.values[key]["tx_bytes"][-1]) if links.times[key].size else 0.0
        link_bps.append(round(gained * 8 / duration, 1))

    def final(name: str, field: str) -> Optional[float]:
        value = finals.get(name, {}).get(field)
        return finite_round(value) if isinstance(value, (int, float)) else None

    def counter_last(name: str, column: str) -> Optional[int]:
        if node_counters is None or (name,) not in node_counters.values:
            return None
        values = node_counters.values[(name,)][column]
        return int(values[-1]) if values.size else None

    snapshot = {"t_s": round(end_s, 3), "phase": "finished",
                "state": [str(endings.get(n, "")) for n in names],
                "round": [int(finals.get(n, {}).get("rounds") or last.get(n, {}).get("round") or 0) for n in names],
                "accuracy": [final(n, "accuracy") for n in names],
                "global_accuracy": [final(n, "final_global_accuracy") for n in names],
                "loss": [final(n, "loss") for n in names], "cpu_cores": [None for _ in names],
                "strategy": [last.get(n, {}).get("strategy") for n in names],
                "mem_bytes": [counter_last(n, "mem_bytes") for n in names],
                "tx_bytes": [counter_last(n, "tx_bytes") for n in names],
                "rx_bytes": [counter_last(n, "rx_bytes") for n in names],
                "link_bps": link_bps,
                "link_rate_bps": [inp.rates.at(k, end_s) for k in link_keys], "link_down": []}
    return {"version": 1, "live": False, "run_id": inp.run_id, "algorithm": record.get("algorithm"),
            "phase": "finished", "ended": record.get("ended"), "started_at": record.get("started_at"),
            "models": model_labels(record, confs),
            "nodes": [{"name": n, "host": inp.nodes[n].get("host") or "", "kind": kinds.get(n, ""),
                       "role": inp.nodes[n].get("role"),
                       "layer": layers.get(n), "places": places.get(n, [])} for n in names],
            "links": [{"src": s, "dst": d} for s, d in link_keys], "snapshot": snapshot,
            "series": {"time": series, "round": round_series(by_round)},
            "timeline": _timeline(run_dir, inp.t0, endings, end_s), "samples": grid.size}


def model_labels(record: dict[str, Any], confs: dict[str, Any]) -> list[str]:
    """The run's models as the dashboard names them (``run.json``'s ``models``; for a run recorded
    before it had them, the nodes' confs in ``confs.json``)."""
    found = record.get("models")
    if not isinstance(found, list):
        try:
            found = models({n: dict(c.get("structure") or {}) for n, c in confs.items() if isinstance(c, dict)})
        except (ValueError, TypeError, AttributeError):
            return []
    return [str(m.get("label")) for m in found if isinstance(m, dict) and m.get("label")]


def _timeline(run_dir: str, t0: Optional[float], endings: dict[str, Any], end_s: float) -> list[dict[str, Any]]:
    """The run's ``timeline.json`` (the run's own timeline, with the nodes' adaptation events),
    else the timeline rebuilt from scenario.csv, membership.csv, the nodes' policy decisions and
    strategy changes (their events) and the nodes' endings."""
    stored = read_json_object(os.path.join(run_dir, TIMELINE_JSON)).get("entries")
    if isinstance(stored, list) and all(isinstance(e, dict) for e in stored):
        return stored
    entries = []
    for r in read_scenario(run_dir):
        entries.append((r["applied_s"], str(r.get("event", "")), str(r.get("target", "")), str(r.get("detail", ""))))
    try:
        with open(os.path.join(run_dir, MEMBERSHIP_CSV), newline="", encoding="utf-8") as f:
            for r in csv.DictReader(f):
                try:
                    t = float(r.get("t") or "nan") - (t0 or 0.0)
                except ValueError:
                    continue
                who = r.get("peer") if r.get("node") == "controller" else r.get("node")
                detail = r.get("detail", "") if r.get("node") == "controller" else f"peer {r.get('peer', '')}"
                entries.append((t, str(r.get("event", "")), str(who or ""), detail))
    except (OSError, UnicodeDecodeError, csv.Error):
        pass
    if t0 is not None:
        adapted = adaptation.adaptation_events(read_run_events(run_dir, {}), t0)
        entries += [adaptation.timeline_entry(a) for a in adapted]
    for name, ending in endings.items():
        if ending != "done":
            entries.append((end_s, "ended", name, str(ending)))
    entries.sort(key=lambda e: e[0] if math.isfinite(e[0]) else 0.0)
    return [{"seq": i + 1, "t_s": finite_round(t, 3), "kind": k, "target": target, "detail": d}
            for i, (t, k, target, d) in enumerate(entries)]


def stored_link_series(run_dir: str, src: str, dst: str) -> dict[str, Any]:
    """Link ``src -> dst``'s throughput over the stored run (on the view's time grid), and its rate;
    ``delay_ms`` and ``loss_pct`` when a recording's were replayed on it (``trace_netem.csv``)."""
    inp = read_run(run_dir, captures=False, counters=("links",))
    key = (src, dst)
    if key not in inp.links and key not in inp.rates:  # (a link added during the run)
        raise NotFound(f"no link {src}->{dst} in run {inp.run_id}")
    grid = _grid(inp.ended_s or 1.0)
    bps: list[Optional[float]] = [None] * grid.size
    links = inp.link_counters
    if links is not None and key in links.times:
        cum = counter_at(links.times[key], links.values[key]["tx_bytes"], grid)
        rate = np.maximum(np.diff(cum, prepend=0.0), 0) * 8 / np.diff(grid, prepend=grid[0] - 1.0)
        bps = [finite_round(x, 1) for x in rate]
    out = {"src": src, "dst": dst, "t_s": [round(float(t), 3) for t in grid], "bps": bps,
           "rate_bps": inp.links.get(key, {}).get("rate_bps"),
           "rates": inp.rates.over(key, (float(t) for t in grid))}  # as configured over time
    netem_path = os.path.join(run_dir, TRACE_NETEM_CSV)  # a recording's delay and loss, as replayed
    if os.path.isfile(netem_path):
        with open(netem_path, encoding="utf-8") as f:
            netem = stored_netem(f.read(), key, (float(t) for t in grid))
        if netem is not None:
            out.update(netem)
    return out


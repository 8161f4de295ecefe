"""A sweep's table: one row per run, one per configuration with means and 95 % intervals over
its repeats, as CSV and plots. A pure function of the sweep folder, so ``edgetb analyze
SWEEP_DIR`` rebuilds it at any time.

The sweep folder (``controller.sweep`` writes it)::

    sweep.json        the sweep file, verbatim
    plan.json         every run: number, folder name, configuration, parameters, repeat, seed
    state.json        every run's status: pending, running, completed, failed, interrupted
    runs/<name>/      a run: inputs/ (the files made for it), output.log, run/ (its run folder)
    runs.csv          one row per run (``RUN_COLUMNS`` + a column per varied parameter and target)
    configs.csv       one row per configuration
    plots/<metric>_vs_<parameter>.png
    sweep_summary.json

A run's figures: ``final_accuracy`` (mean over nodes of the final model's global accuracy; the
last round's where no final model was evaluated), ``bytes_sent`` (every byte the nodes sent),
``round_s`` (mean over nodes of the mean time between a node's consecutive round ends),
``seconds`` (the run's wall time, start-up and teardown included) and, per target accuracy T,
``tta_T_s``, ``tta_T_rounds``, ``tta_T_bytes``: when the run first reached T
(``controller.results.time_to_accuracy``), empty when it did not.

A configuration's row has, for each figure, ``_mean``, ``_ci95`` (half width), ``_low``,
``_high`` and ``_n`` over its completed runs: the Student-t interval mean ± t(0.975, n-1)·s/√n
(s the sample standard deviation); no interval under two values. A time-to-accuracy figure is
over the runs that reached the target (``_n`` says how many).
"""
from __future__ import annotations

import csv
import json
import math
import os
import statistics
from typing import Any, Callable, Iterable, Optional, Sequence

from controller.results.run_dir import METRICS_CSV, SUMMARY_JSON, csv_bytes, finite_number, read_json
from controller.results.time_to_accuracy import target_label

SWEEP_FILE = "sweep.json"
PLAN_JSON = "plan.json"
STATE_JSON = "state.json"
RUNS_DIR = "runs"
RUN_FOLDER = "run"  # runs/<name>/run/: the run folder
INPUTS_DIR = "inputs"
OUTPUT_LOG = "output.log"
RUNS_CSV = "runs.csv"
CONFIGS_CSV = "configs.csv"
PLOTS_DIR = "plots"
SUMMARY = "sweep_summary.json"
STATUSES = ("pending", "running", "completed", "failed", "interrupted")

RUN_COLUMNS = ["run", "name", "config", "repeat", "seed", "status", "detail", "run_id", "seconds", "final_accuracy",
               "bytes_sent", "round_s"]
FIGURES = ["final_accuracy", "bytes_sent", "round_s", "seconds"]
STATS = ("mean", "ci95", "low", "high", "n")
# t(0.975, df) for df = 1..30; beyond, 1.96 within half a percent by df 120
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_975(df: int) -> float:
    """Student's t quantile 0.975 with ``df`` degrees of freedom (tabled to 30, then 1.96 + 2.4/df)."""
    return T_975[df - 1] if df <= len(T_975) else 1.96 + 2.4 / df


def mean_ci95(values: Iterable[Any]) -> dict[str, Optional[float]]:
    """Mean and 95 % Student-t interval of the finite numbers among ``values``."""
    v = [float(x) for x in values if finite_number(x, cells=False) is not None]
    if not v:
        return {"mean": None, "ci95": None, "low": None, "high": None, "n": 0}
    m = statistics.fmean(v)
    if len(v) < 2:
        return {"mean": m, "ci95": None, "low": None, "high": None, "n": 1}
    half = t_975(len(v) - 1) * statistics.stdev(v) / math.sqrt(len(v))
    return {"mean": m, "ci95": half, "low": m - half, "high": m + half, "n": len(v)}


def tta_columns(targets: Sequence[float]) -> list[str]:
    return [f"tta_{target_label(t)}_{what}" for t in targets for what in ("s", "rounds", "bytes")]


def round_s(metrics_rows: Iterable[dict[str, Any]]) -> Optional[float]:
    """Mean over nodes of the mean time between a node's consecutive round ends (None: under two rounds)."""
    ends: dict[str, list[float]] = {}
    for r in metrics_rows:
        t = finite_number(r.get("time_s"))
        if t is not None and r.get("node"):
            ends.setdefault(str(r["node"]), []).append(t)
    per_node = [(max(ts) - min(ts)) / (len(ts) - 1) for ts in ends.values() if len(ts) >= 2]
    return statistics.fmean(per_node) if per_node else None


def run_figures(run_dir: Optional[str]) -> tuple[dict[str, Any], list[float]]:
    """(a run's figures, its target accuracies) from its run folder (empty when it has none)."""
    summary = read_json(os.path.join(run_dir, SUMMARY_JSON)) if run_dir else None
    if not isinstance(summary, dict):
        return {}, []
    acc = summary.get("accuracy") or {}
    final = next((acc[k]["mean"] for k in ("final_global_accuracy", "global_accuracy")
                  if isinstance(acc.get(k), dict) and acc[k].get("mean") is not None), None)
    nodes = [n for n in summary.get("nodes") or [] if isinstance(n, dict)]
    out: dict[str, Any] = {"run_id": summary.get("run_id"), "final_accuracy": final,
                           "bytes_sent": sum(int(n.get("bytes_sent") or 0) for n in nodes) if nodes else None}
    try:
        with open(os.path.join(run_dir or "", METRICS_CSV), newline="", encoding="utf-8") as f:
            out["round_s"] = round_s(csv.DictReader(f))
    except OSError:
        out["round_s"] = None
    targets = []
    for entry in summary.get("time_to_accuracy") or []:
        if not isinstance(entry, dict) or finite_number(entry.get("target"), cells=False) is None:
            continue
        t = float(entry["target"])
        targets.append(t)
        reached = entry.get("run") or {}
        label = target_label(t)
        out[f"tta_{label}_s"] = reached.get("time_s")
        out[f"tta_{label}_rounds"] = reached.get("rounds")
        out[f"tta_{label}_bytes"] = reached.get("bytes_sent")
    return out, targets


def run_rows(sweep_dir: str, plan: dict[str, Any], state: dict[str, Any]) -> tuple[list[dict[str, Any]], list[float]]:
    """One row per planned run (its parameters, status and figures); the union of the targets."""
    rows, targets = [], set()
    done = state.get("runs", {})
    for p in plan["runs"]:
        st = done.get(p["key"], {})
        folder = os.path.join(sweep_dir, RUNS_DIR, p["name"], RUN_FOLDER)
        figures, found = run_figures(folder if os.path.isdir(folder) else None)
        targets.update(found)
        row = {"run": p["index"], "name": p["name"], "config": p["config"], "repeat": p["repeat"], "seed": p["seed"],
               "status": st.get("status", "pending"), "detail": st.get("detail", ""),
               "seconds": st.get("seconds"), **p["params"], **figures}
        row["run_id"] = figures.get("run_id") or st.get("run_id")
        rows.append(row)
    return rows, sorted(targets)


def config_rows(rows: list[dict[str, Any]], varied: Sequence[str], targets: Sequence[float]
                ) -> list[dict[str, Any]]:
    """One row per configuration: its parameters, its runs and statistics of each figure over the completed ones."""
    by_config: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_config.setdefault(r["config"], []).append(r)
    out = []
    for config, members in sorted(by_config.items()):
        completed = [m for m in members if m["status"] == "completed"]
        row: dict[str, Any] = {"config": config, **{p: members[0].get(p) for p in varied}, "runs": len(members),
                               "completed": len(completed), "failed": sum(m["status"] == "failed" for m in members)}
        for figure in FIGURES + tta_columns(targets):
            stats = mean_ci95(m.get(figure) for m in completed)
            row.update({f"{figure}_{s}": stats[s] for s in STATS})
        out.append(row)
    return out


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, sort_keys=True)
    return value


def build(sweep_dir: str, write: Callable[[str, bytes], Any], plots: bool = True) -> dict[str, Any]:
    """Write runs.csv, configs.csv, the plots and sweep_summary.json of ``sweep_dir`` with
    ``write(relative path, bytes)``; return the summary."""
    plan = read_json(os.path.join(sweep_dir, PLAN_JSON))
    if not isinstance(plan, dict) or not isinstance(plan.get("runs"), list):
        from worker.api.errors import ConfigError

        raise ConfigError(f"{sweep_dir} is not a sweep folder (no readable {PLAN_JSON} in it)")
    state = read_json(os.path.join(sweep_dir, STATE_JSON)) or {}
    varied = list(plan.get("varied", []))
    rows, targets = run_rows(sweep_dir, plan, state)
    columns = RUN_COLUMNS[:5] + varied + RUN_COLUMNS[5:] + tta_columns(targets)
    write(RUNS_CSV, csv_bytes(columns, rows, cell=_cell))
    configs = config_rows(rows, varied, targets)
    config_columns = (["config", *varied, "runs", "completed", "failed"]
                      + [f"{f}_{s}" for f in FIGURES + tta_columns(targets) for s in STATS])
    write(CONFIGS_CSV, csv_bytes(config_columns, configs, cell=_cell))
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    summary: dict[str, Any] = {"version": 1, "runs": len(rows), "configurations": len(configs), "status": counts,
                               "varied": varied, "targets": targets, "files": [RUNS_CSV, CONFIGS_CSV], "plots": [],
                               "problems": []}
    if plots:
        try:
            from controller.results.sweep_plots import sweep_plots

            for name, data in sweep_plots(configs, varied, targets, plan.get("values", {})):
                write(f"{PLOTS_DIR}/{name}", data)
                summary["plots"].append(f"{PLOTS_DIR}/{name}")
        except Exception as e:  # noqa: BLE001 - a plot that fails costs the plots, not the tables
            summary["problems"].append(f"plots: {type(e).__name__}: {e}")
    write(SUMMARY, (json.dumps(summary, indent=1) + "\n").encode())
    return summary

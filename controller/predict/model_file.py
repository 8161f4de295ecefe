"""Fit the three predictors on run folders, store them as plain JSON, predict a configuration.

model.json (never pickle)::

    {"version": 2, "kind": "edgetb-predict-model", "features": [...], "targets": [...],
     "runs": [{"run_id", "config", "algorithm", "path"}],
     "calibration": {"compute_s_per_unit": ...},
     "groups": {"<algorithm>/<role>": {
         "algorithm", "role", "configs": [...], "rows": n,
         "range": {feature: [min, max]}, "names": {"model"|"dataset"|"strategy"|...: [seen]},
         "calibration": {"overhead_sent_bytes_per_msg", "overhead_recv_bytes_per_msg",
                         "latency_s_per_step", "host_s_per_byte_node"},
         "greybox": {target: {"columns": [...], "coef": [...]} | {"refused": "..."}},
         "blackbox": {target: {"x_mean", "x_std", "y_mean", "y_std", "svr": {...}, "linear": {...}}
                      | {"refused": "..."}}}}}

The analytic predictor's calibration is measured once from the training runs: the compute
speed (median train_s per training FLOP of an epoch's samples, over every node that trained), the
framing overhead per message (median bytes beyond the payload, per algorithm and role), and the
latency per step of the critical path and the host's seconds per byte sent and node sharing it
(the non-negative least-squares split of the round time beyond the compute and the transfers,
per algorithm and role).
"""
from __future__ import annotations

import csv
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from controller.predict import analytic, blackbox, greybox
from controller.predict.analytic import Terms
from controller.predict.features import FEATURES, categories, config_key, node_features, roles, vector
from controller.predict.setting import Setting, from_input_dir, from_run_dir
from controller.predict.targets import TARGETS, read_targets
from worker.api.errors import ConfigError

VERSION = 2  # 2: compute in training FLOPs (model_graph), flops_per_sample a feature
KIND = "edgetb-predict-model"
MIN_CONFIGS = 2
PREDICTORS = ("analytic", "greybox", "svr", "linear")
# named settings predicted even when never seen in training (listed under outside_range): a model is
# known by its own features (parameters, bytes, FLOPs per sample)
UNSEEN_NAMES_PREDICTED = ("model",)


@dataclass
class Row:
    """One node of one configuration: features, analytic terms and (from a run) measured targets."""

    source: str
    run_id: str
    config: str
    algorithm: str
    node: str
    role: str
    features: dict[str, float]
    terms: Terms
    targets: dict[str, Optional[float]] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)

    @property
    def group(self) -> str:
        return f"{self.algorithm}/{self.role}"

    def columns(self) -> dict[str, float]:
        return greybox.column_values(self.terms, self.features["rounds"], self.features)


def rows_of_setting(setting: Setting, run_id: str = "") -> list[Row]:
    """A configuration's rows (no targets)."""
    feats, role_of, terms, names = node_features(setting), roles(setting), analytic.terms(setting), categories(setting)
    config = config_key(setting, feats)
    return [Row(setting.source, run_id, config, setting.algorithm, n, role_of[n], feats[n], terms[n], names=names[n])
            for n in setting.structure]


def strategies(run_dir: str) -> list[str]:
    """The ring strategies a run's rounds ran under, in order of first use (``metrics.csv``'s
    ``strategy`` column; empty without one)."""
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return list(dict.fromkeys(row["strategy"] for row in csv.DictReader(f) if row.get("strategy")))


def _rows_by_strategy(run_dir: str, setting: Setting, names: list[str]) -> list[Row]:
    """A run whose strategy changed mid-run, as one configuration per strategy: each node's rounds
    under it (from a copy of metrics.csv holding only them; burst metrics, which are the whole
    run's, are left out) and the structure as if it had been configured."""
    import dataclasses
    import tempfile

    run_id = os.path.basename(os.path.normpath(run_dir))
    out: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="edgetb-predict-split-") as tmp:
        with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
            reader = csv.DictReader(f)
            every = list(reader)
            fields = list(reader.fieldnames or [])
        for name in names:
            with open(os.path.join(tmp, "metrics.csv"), "w", newline="") as f:
                writer = csv.DictWriter(f, fields)
                writer.writeheader()
                writer.writerows(row for row in every if row.get("strategy") == name)
            measured = read_targets(tmp)
            structure = {n: {**c, "strategy": name} for n, c in setting.structure.items()}
            part = dataclasses.replace(setting, structure=structure)
            rows = [r for r in rows_of_setting(part, f"{run_id}:{name}") if r.node in measured]
            for r in rows:
                r.targets = measured[r.node]
            out += rows
    return out


def rows_of_run(run_dir: str) -> list[Row]:
    """A finished run's rows, with what it measured (nodes without metrics are left out); a run
    whose ring strategy changed mid-run gives the rows of each strategy apart."""
    setting = from_run_dir(run_dir)
    names = strategies(run_dir)
    if len(names) > 1 and setting.algorithm == "ring":
        rows = _rows_by_strategy(run_dir, setting, names)
        if rows:
            return rows
    measured = read_targets(run_dir)
    run_id = os.path.basename(os.path.normpath(run_dir))
    rows = [r for r in rows_of_setting(setting, run_id) if r.node in measured]
    for r in rows:
        r.targets = measured[r.node]
    if not rows:
        raise ConfigError(f"{os.path.join(run_dir, 'metrics.csv')}: no node of confs.json has a row")
    return rows


def load_runs(run_dirs: Sequence[str]) -> list[Row]:
    """The rows of every run folder."""
    if not run_dirs:
        raise ConfigError("no run folder given")
    return [row for d in run_dirs for row in rows_of_run(d)]


def _median(values: list[float], default: float = 0.0) -> float:
    return float(np.median(values)) if values else default


def _calibration(rows: Sequence[Row]) -> dict[str, float]:
    speeds = [r.targets["train_s"] / r.terms.own_units for r in rows  # type: ignore[operator]
              if r.terms.own_units > 0 and r.targets.get("train_s")]
    return {"compute_s_per_unit": _median(speeds)}


def _overheads(rows: Sequence[Row], compute_s_per_unit: float = 0.0) -> dict[str, float]:
    """The framing per message and the latency per step of a group's rows: the medians of what
    the runs measured beyond the analytic payload and the analytic compute and transfers."""
    timed = [r for r in rows if r.terms.steps > 0 and r.targets.get("round_mean_s") is not None]
    out = dict(zip(("latency_s_per_step", "host_s_per_byte_node"), _latency_and_host(timed, compute_s_per_unit)))
    for direction in ("sent", "recv"):
        per = [(r.targets[f"bytes_{direction}_per_round"] - getattr(r.terms, f"payload_{direction}_bytes"))
               / getattr(r.terms, f"messages_{direction}") for r in rows
               if getattr(r.terms, f"messages_{direction}") > 0 and r.targets.get(f"bytes_{direction}_per_round")]
        out[f"overhead_{direction}_bytes_per_msg"] = _median(per)  # type: ignore[arg-type]
    return out


def _latency_and_host(rows: Sequence[Row], compute_s_per_unit: float) -> tuple[float, float]:
    """The latency per step and the host's seconds per byte sent by all nodes and node sharing its
    cores (``Terms.host_contention``): the non-negative least-squares split of what the rows' round times hold beyond compute and transfers, each
    row weighted by 1 / its round time (relative errors). One configuration: latency alone."""
    if not rows:
        return 0.0, 0.0
    residual = np.array([r.targets["round_mean_s"] - compute_s_per_unit * r.terms.round_units  # type: ignore[operator]
                         - r.terms.transfer_s for r in rows])
    x = np.array([[r.terms.steps, r.terms.host_contention] for r in rows], dtype=float)
    if len({r.config for r in rows}) < 2 or not np.any(x[:, 1]):
        return max(0.0, _median([float(v) for v in residual / x[:, 0]])), 0.0
    from scipy.optimize import nnls

    w = 1.0 / np.array([r.targets["round_mean_s"] for r in rows], dtype=float)  # type: ignore[misc]
    scale = np.linalg.norm(x * w[:, None], axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(x * w[:, None] / scale, residual * w)
    return float(coef[0] / scale[0]), float(coef[1] / scale[1])


def _fit_group(name: str, rows: Sequence[Row], compute_s_per_unit: float = 0.0) -> dict[str, Any]:
    configs = sorted({r.config for r in rows})
    x_all = np.array([vector(r.features) for r in rows])
    group: dict[str, Any] = {
        "algorithm": rows[0].algorithm, "role": rows[0].role, "configs": configs, "rows": len(rows),
        "range": {f: [float(x_all[:, i].min()), float(x_all[:, i].max())] for i, f in enumerate(FEATURES)},
        "names": {k: sorted({r.names.get(k, "") for r in rows}) for k in rows[0].names},
        "calibration": _overheads(rows, compute_s_per_unit), "greybox": {}, "blackbox": {}}
    for target in TARGETS:
        usable = [r for r in rows if r.targets.get(target) is not None]
        if target in greybox.COLUMNS and not rows[0].terms.unsupported:
            try:
                group["greybox"][target] = greybox.fit(target, [r.columns() for r in usable],
                                                       [r.targets[target] for r in usable],  # type: ignore[misc]
                                                       [r.config for r in usable], f"{name}: ")
            except greybox.TooFewConfigurations as e:
                group["greybox"][target] = {"refused": e.message}
        n_configs = len({r.config for r in usable})
        if n_configs < MIN_CONFIGS:
            group["blackbox"][target] = {"refused": f"{name}: {target}: measured in {n_configs} configuration(s), "
                                                    f"the black-box fits need {MIN_CONFIGS}"}
            continue
        group["blackbox"][target] = blackbox.fit([vector(r.features) for r in usable],
                                                 [r.targets[target] for r in usable])  # type: ignore[misc]
    return group


def fit(rows: Sequence[Row]) -> dict[str, Any]:
    """The model document fitted on ``rows`` (of at least ``MIN_CONFIGS`` configurations)."""
    configs = {r.config for r in rows}
    if len(configs) < MIN_CONFIGS:
        raise greybox.TooFewConfigurations(
            f"the runs hold {len(configs)} configuration(s) ({', '.join(sorted({r.source for r in rows}))}): "
            f"a model needs at least {MIN_CONFIGS} (runs of the same inputs are one configuration)")
    groups: dict[str, list[Row]] = {}
    for r in rows:
        groups.setdefault(r.group, []).append(r)
    runs = {(r.source, r.run_id): {"run_id": r.run_id, "config": r.config, "algorithm": r.algorithm,
                                   "path": r.source} for r in rows}
    calibration = _calibration(rows)
    return {"version": VERSION, "kind": KIND, "created_at": time.time(), "features": list(FEATURES),
            "targets": list(TARGETS), "predictors": list(PREDICTORS), "runs": list(runs.values()),
            "calibration": calibration,
            "groups": {name: _fit_group(name, members, calibration["compute_s_per_unit"])
                       for name, members in sorted(groups.items())}}


def save(doc: dict[str, Any], path: str) -> None:
    """Write the model document as JSON."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def load(path: str) -> dict[str, Any]:
    """A model document written by ``save``; a clear error for anything else."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such model file (make one with 'edgetb predict fit RUN_DIR... --out {path}')")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a JSON model file: {e}") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND or doc.get("version") != VERSION:
        raise ConfigError(f"{path}: expected a model file with \"kind\": \"{KIND}\", \"version\": {VERSION}")
    if list(doc.get("features", [])) != list(FEATURES):
        raise ConfigError(f"{path}: made for other features ({len(doc.get('features', []))}); fit it again")
    groups = doc.get("groups")
    if not isinstance(groups, dict) or not groups or not all(
            isinstance(g, dict) and isinstance(g.get("algorithm"), str) and isinstance(g.get("names", {}), dict)
            for g in groups.values()):
        raise ConfigError(f"{path}: its 'groups' are damaged (an object of fitted groups, each with its "
                          "algorithm); fit it again")
    return doc


def unseen(doc: dict[str, Any], r: Row) -> Optional[str]:
    """Why the model cannot predict row ``r`` (its algorithm, role or a named setting never seen
    in training), None when it can."""
    known = sorted({g["algorithm"] for g in doc["groups"].values()})
    if r.algorithm not in known:
        return (f"{r.source}: algorithm {r.algorithm!r} was never seen in training "
                f"(the model knows {', '.join(known)}); record runs of it and fit again")
    if r.group not in doc["groups"]:
        return (f"{r.source}: node {r.node!r}: role {r.role!r} of {r.algorithm!r} was never seen in "
                f"training (the model knows {', '.join(sorted(doc['groups']))})")
    seen = doc["groups"][r.group].get("names", {})
    for key, value in r.names.items():
        if key in UNSEEN_NAMES_PREDICTED:
            continue
        if key in seen and value not in seen[key]:
            return (f"{r.source}: node {r.node!r}: {key} {value!r} was never seen in training for "
                    f"{r.group} (the model knows {', '.join(repr(v) for v in seen[key])})")
    return None


def _check_known(doc: dict[str, Any], rows: Sequence[Row]) -> None:
    for r in rows:
        why = unseen(doc, r)
        if why:
            raise ConfigError(why)


def outside(group: dict[str, Any], features: dict[str, float],
            names: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """The features of a row outside the group's fitted range, and a model never seen in training
    (predicted from its own FLOPs and size: an extrapolation)."""
    out: list[dict[str, Any]] = []
    for key in UNSEEN_NAMES_PREDICTED:
        seen = group.get("names", {}).get(key)
        if names and seen is not None and names.get(key) not in seen:
            out.append({"feature": key, "value": names.get(key), "seen": seen})
    for name, (lo, hi) in group["range"].items():
        value = features[name]
        if value < lo - 1e-9 * abs(lo) or value > hi + 1e-9 * abs(hi):
            out.append({"feature": name, "value": value, "range": [lo, hi]})
    return out


def predict_row(doc: dict[str, Any], row: Row) -> dict[str, dict[str, Optional[float]]]:
    """Every target's prediction by every predictor for one row (None where a predictor has none)."""
    group = doc["groups"][row.group]
    calibration = {**doc["calibration"], **group["calibration"]}
    ana = analytic.predict(row.terms, row.features["rounds"], calibration)
    x, cols = vector(row.features), row.columns()
    out: dict[str, dict[str, Optional[float]]] = {}
    for target in TARGETS:
        black = group["blackbox"].get(target) or {}
        bb = blackbox.predict(None if "refused" in black else black, x)
        out[target] = {"analytic": ana.get(target), "greybox": greybox.predict(group["greybox"].get(target), cols),
                       "svr": bb["svr"], "linear": bb["linear"]}
    return out


def refusals(group: dict[str, Any]) -> dict[str, str]:
    """Why a predictor has no fit for a target, by ``predictor:target``."""
    out = {f"greybox:{t}": m["refused"] for t, m in group["greybox"].items() if "refused" in m}
    out.update({f"blackbox:{t}": m["refused"] for t, m in group["blackbox"].items() if "refused" in m})
    return out


def _mean_measured(members: Sequence[dict[str, Any]]) -> dict[str, Optional[float]]:
    out: dict[str, Optional[float]] = {}
    for target in TARGETS:
        values = [m["measured"][target] for m in members if m["measured"].get(target) is not None]
        out[target] = float(np.mean(values)) if values else None
    return out


def predict_rows(doc: dict[str, Any], rows: Sequence[Row]) -> dict[str, Any]:
    """Per node and per role predictions of a configuration's rows, each with its fitted range
    and the features outside it."""
    _check_known(doc, rows)
    nodes, by_role = [], {}
    for r in rows:
        group = doc["groups"][r.group]
        nodes.append({"node": r.node, "role": r.role, "predictions": predict_row(doc, r),
                      "outside_range": outside(group, r.features, r.names), "features": r.features})
        if r.targets:
            nodes[-1]["measured"] = {t: r.targets.get(t) for t in TARGETS}
        by_role.setdefault(r.role, []).append(nodes[-1])
    roles_out = {}
    for role, members in by_role.items():
        group = doc["groups"][f"{rows[0].algorithm}/{role}"]
        summary: dict[str, dict[str, Optional[float]]] = {}
        for target in TARGETS:
            summary[target] = {}
            for p in PREDICTORS:
                values = [m["predictions"][target][p] for m in members if m["predictions"][target][p] is not None]
                summary[target][p] = float(np.mean(values)) if values else None
        roles_out[role] = {"nodes": [m["node"] for m in members], "predictions": summary,
                           **({"measured": _mean_measured(members)} if "measured" in members[0] else {}),
                           "fitted_range": group["range"], "configs_fitted": len(group["configs"]),
                           "extrapolating": sorted({o["feature"] for m in members for o in m["outside_range"]}),
                           "refused": refusals(group),
                           "unsupported": rows[0].terms.unsupported}
    overhead = {r.node: doc["groups"][r.group]["calibration"].get("overhead_sent_bytes_per_msg", 0.0) for r in rows}
    return {"algorithm": rows[0].algorithm, "config": rows[0].config, "source": rows[0].source,
            "roles": roles_out, "nodes": nodes,
            "links_bytes_per_round": analytic.link_bytes([(r.terms, overhead[r.node]) for r in rows])}


def predict_run_dir(doc: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """The predictions for a finished run's configuration, beside what it measured."""
    return predict_rows(doc, rows_of_run(run_dir))


def predict_input_dir(doc: dict[str, Any], input_dir: str, algorithm: Optional[str] = None) -> dict[str, Any]:
    """The predictions for the configuration an input directory describes."""
    return predict_rows(doc, rows_of_setting(from_input_dir(input_dir, algorithm)))

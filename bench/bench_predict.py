"""How well ``edgetb predict`` predicts round time, traffic and bursts, on grids of real runs.

Run as root: ``.venv/bin/python bench/bench_predict.py [--keep DIR] [--suite all|grid|etree|models]``
(``--eval-only --keep DIR`` scores the runs a previous call kept, without running anything).
Three suites, one after another by default (about 20 minutes on a quiet 2-core host), each in
``<keep>/<suite>``:

- ``grid``: ring, FL and gossip, below;
- ``etree``: three-layer E-trees of 10, 20, 40 and 80 nodes (the root over N / 5 aggregators, each
  over itself and 4 trainers, links both ways along the tree; 3 global rounds of 2 aggregator
  rounds) at 5 and 20 Mbit/s, a 38,410-parameter MLP: leave one configuration out among the
  ``--fit-nodes`` (10, 20, 40) runs, and fitted on them, the ``--check-nodes`` (80) runs;
- ``models``: FL with 4 nodes at 5 and 20 Mbit/s, 2 epochs a round, for ``mlp``, ``lenet5``,
  ``edgetb_cifar10_cnn`` (fitted on) and ``edgetb_fashion_cnn`` and a user's numpy CNN
  (``user_cnn``: never run, predicted from their input files), beside a one-batch profile.

The grid: ring all-reduce, FL and gossip; N in {4, 6, 8} nodes; every link at 5 or 20 Mbit/s;
every node limited to 0.5 or 1 CPU; 10 rounds each, recorded by the run scripts themselves
(``ra_run.py``/``fl_run.py``/``gl_run.py --auto`` in a scratch experiment directory; netns
nodes, the digits data set, one epoch a round). The ring and gossip nodes form a directed ring
of links (each node sends to its successor), FL a star of links both ways around the
aggregator n1, which picks every trainer every round (quorum 1).

The model: a numpy MLP 64-2048-10 (153,610 parameters, 0.61 MB of float32 weights). The size
is chosen so that every round is dominated by its transfers and lasts about 0.5 to 3 s at
these rates: a ring node moves (N - 1)/N x 12 bytes x P a round, an FL round the model down
and up, a gossip round one model, while one epoch on a node's share of digits costs tens of
milliseconds (measured mean rounds: ring 0.69 to 2.98 s, FL 0.55 to 2.12 s, gossip 0.31 to
1.11 s; the grid takes about 11 minutes). Smaller models give rounds of 20 to 300 ms, where the CPU noise of a busy
2-core host is as large as the differences between configurations.

Each run folder is kept under ``--keep`` (default: a temporary directory, removed at the end),
named for its configuration; a later call with the same ``--keep`` reuses the folders it finds.
Then ``edgetb predict eval --by config`` leaves one configuration out at a time
(``predict_eval.json`` in the keep directory), and a second evaluation fits on the smallest N
only and predicts the runs of twice that N (round time extrapolating N x 2). The table gives,
per target, the MAPE of the four predictors (analytic, grey-box, CM-DARE's SVR, linear)
beside the targets and CM-DARE's published figures (10-14 % MAPE per setting; its README
claims 3.4 %); duty cycle = burst / (burst + idle), from the predicted burst and idle
durations (a compute burst's length is its CPU time where the phases carry the CPU clock, so the
CPU duty cycle there is the share of the node's time spent computing on a core). Burst metrics are pooled over cpu, net tx and net rx, the resources whose bursts
follow the rounds; memory, which does not, has its own line. ``--plot`` (default docs/img/predict.png) draws predicted against measured round
time.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from controller.predict.model_file import PREDICTORS  # noqa: E402
from controller.predict.targets import BURST_RESOURCES, BYTE_TARGETS  # noqa: E402

HIDDEN = 2048  # 64-2048-10: 153,610 parameters (see the module docstring)
SCRIPTS = {"ring": ("ra_run.py", "ra"), "fl": ("fl_run.py", "fl"), "gossip": ("gl_run.py", "gl"),
           "etree": ("el_run.py", "el")}
ETREE_GROUP = 5  # an E-tree's layer-2 aggregator and its trainers (itself one of them)
ROUND_RESOURCES = ("cpu", "net_tx", "net_rx")  # the resources whose bursts follow the rounds (not memory)
CM_DARE = "10-14 % (README: 3.4 %)"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] bench: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    """One configuration of the grid."""

    algorithm: str
    nodes: int
    rate: str
    cpu: float
    model: str = "mlp"

    @property
    def label(self) -> str:
        return f"{self.algorithm}-n{self.nodes}-{self.rate}-cpu{self.cpu:g}" + (
            "" if self.model == "mlp" else f"-{self.model}")


USER_CNN = "user_cnn.py"  # a user's numpy CNN of another shape than the built-ins (never fitted on)
USER_CNN_SOURCE = '''"""A user's CNN: two 3x3 convolutions of 24 and 48 filters, one pooling, a dense layer of 96."""
from dml_app.models.numpy import layers as L
from dml_app.models.numpy.net import Sequential


def build(input_shape, n_classes, conf):
    return Sequential([L.Conv2D(24, 3, "same", "relu"), L.MaxPool2D(), L.Conv2D(48, 3, "same", "relu"), L.Flatten(),
                       L.Dense(96, "relu"), L.Dense(n_classes)], input_shape, 0.001, seed=int(conf.get("seed", 0)))
'''


def model_conf(name: str, hidden: int) -> dict[str, Any]:
    """The structure's model entry for ``name``: the MLP of ``hidden`` units, a built-in network, or
    ``user_cnn`` (the file ``USER_CNN``)."""
    if name == "mlp":
        return {"kind": "numpy", "hidden": [hidden], "learning_rate": 0.005, "seed": 0}
    if name == "user_cnn":
        return {"kind": "numpy", "module": USER_CNN, "seed": 0}
    return {"kind": "numpy", "name": name, "seed": 0}


def experiment_files(cfg: Config, rounds: int, hidden: int = HIDDEN, epochs: int = 1) -> dict[str, Any]:
    """The input files of one configuration, by file name."""
    names = [f"n{i}" for i in range(1, cfg.nodes + 1)]
    model = model_conf(cfg.model, hidden)
    prefix = SCRIPTS[cfg.algorithm][1]
    if cfg.algorithm == "etree":
        links, structure = etree_files(names, model, rounds, cfg.rate)
    elif cfg.algorithm == "fl":
        agg, trainers = names[0], names[1:]
        links = {agg: [{"dest": t, "bw": cfg.rate} for t in trainers]}
        links.update({t: [{"dest": agg, "bw": cfg.rate}] for t in trainers})
        structure: dict[str, Any] = {"model": model, "node_list": [
            {"name": agg, "sync": rounds, "trainer_fraction": 1.0, "deadline_s": 120, "quorum": 1.0}]
            + [{"name": t, "epoch": epochs} for t in trainers]}
    else:
        links = {a: [{"dest": names[(i + 1) % len(names)], "bw": cfg.rate}] for i, a in enumerate(names)}
        structure = {"sync": rounds, "model": model, "node_list": [{"name": n, "epoch": epochs} for n in names]}
        structure.update({"step_timeout_s": 60} if cfg.algorithm == "ring" else {"wait_s": 10})
    return {"links.json": links, "nodes.json": {"nodes": [{"name": n, "cpu": cfg.cpu} for n in names]},
            f"{prefix}_structure.json": structure,
            f"{prefix}_dataset.json": {"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}}


def etree_files(names: list[str], model: dict[str, Any], rounds: int, rate: str
                ) -> tuple[dict[str, Any], dict[str, Any]]:
    """A three-layer E-tree over ``names``: the root n1 over N / 5 layer-2 aggregators (n1 one of
    them), each over itself and 4 trainers; links both ways along the tree; the root runs
    ``rounds`` // 2 global rounds (at least 1), the aggregators 2 rounds each."""
    groups = [names[i:i + ETREE_GROUP] for i in range(0, len(names), ETREE_GROUP)]
    aggs = [g[0] for g in groups]
    root = aggs[0]
    node_list: list[dict[str, Any]] = [{"name": root, "layer": 3, "sync": max(1, rounds // 2), "child_num": len(aggs)}]
    node_list += [{"name": a, "layer": 2, "sync": 2, "child_num": len(g)} for a, g in zip(aggs, groups)]
    node_list += [{"name": n, "layer": 1, "epoch": 1} for g in groups for n in g]
    links: dict[str, list[dict[str, str]]] = {n: [] for n in names}
    for a, g in zip(aggs, groups):
        for child in [c for c in g if c != a] + ([a] if a != root else []):
            top = root if child == a else a
            links[top].append({"dest": child, "bw": rate})
            links[child].append({"dest": top, "bw": rate})
    return {k: v for k, v in links.items() if v}, {"model": model, "node_list": node_list}


def write_experiment(workdir: str, cfg: Config, rounds: int, hidden: int = HIDDEN, epochs: int = 1) -> None:
    """The configuration's input files in ``workdir`` (and the user's model file)."""
    for name, data in experiment_files(cfg, rounds, hidden, epochs).items():
        with open(os.path.join(workdir, name), "w") as f:
            json.dump(data, f)
    if cfg.model == "user_cnn":
        with open(os.path.join(workdir, USER_CNN), "w") as f:
            f.write(USER_CNN_SOURCE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(cfg: Config, args: argparse.Namespace, epochs: Optional[int] = None, options: Sequence[str] = (),
           done_file: str = "metrics.csv") -> str:
    """Run ``cfg`` with its run script (and ``options``) and keep its run folder as
    ``<keep>/<label>``; one kept earlier (with ``done_file``) is used again."""
    kept = os.path.join(args.keep, cfg.label)
    if os.path.isfile(os.path.join(kept, done_file)):
        log(f"{cfg.label}: kept from an earlier call")
        return kept
    workdir = tempfile.mkdtemp(prefix="edgetb-predict-")
    os.chmod(workdir, 0o755)  # (the node processes read it as their own users)
    try:
        write_experiment(workdir, cfg, args.rounds, args.hidden, args.epochs if epochs is None else epochs)
        started = time.monotonic()
        out = subprocess.run([sys.executable, os.path.join(ROOT, SCRIPTS[cfg.algorithm][0]), "--workdir", workdir,
                              "--auto", "--nodes", "nodes.json", "--id", args.id, "--subnet", args.subnet,
                              "--port", str(free_port()), "--quiet-nodes", *options],
                             capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            raise SystemExit(f"{cfg.label}: the run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        found = glob.glob(os.path.join(workdir, "dml_file", "log", "*", "metrics.csv"))
        if len(found) != 1:
            raise SystemExit(f"{cfg.label}: expected one run folder with metrics.csv, found {found}")
        shutil.copytree(os.path.dirname(found[0]), kept)
        log(f"{cfg.label}: recorded in {time.monotonic() - started:.0f} s")
        return kept
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def grid(args: argparse.Namespace) -> list[Config]:
    return [Config(a, n, r, c, m) for m in args.models for a in args.algorithms for n in args.nodes for r in args.rates
            for c in args.cpus]


def cli_eval(run_dirs: Sequence[str], out: str) -> dict[str, Any]:
    """``edgetb predict eval RUN_DIR... --by config``, as a user runs it; its predict_eval.json."""
    done = subprocess.run([sys.executable, "-m", "controller", "predict", "eval", *run_dirs, "--by", "config",
                           "--out", out], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"predict eval failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def extrapolate(run_dirs: Sequence[str]) -> tuple[int, int, list[dict[str, Any]]]:
    """Fit on the runs of the smallest N, predict those of twice that N: (fitted N, predicted N,
    prediction rows shaped like predict_eval.json's)."""
    from controller.predict import model_file
    from controller.predict.targets import TARGETS

    rows = model_file.load_runs(run_dirs)
    small = min(r.features["n_nodes"] for r in rows)
    train = [r for r in rows if r.features["n_nodes"] == small]
    test = [r for r in rows if r.features["n_nodes"] == 2 * small]
    out: list[dict[str, Any]] = []
    if not test:
        return int(small), int(2 * small), out
    doc = model_file.fit(train)
    for r in test:
        if model_file.unseen(doc, r):
            continue
        predicted = model_file.predict_row(doc, r)
        for target in TARGETS:
            if r.targets.get(target) is None:
                continue
            out.append({"config": r.config, "run_id": r.run_id, "node": r.node, "algorithm": r.algorithm,
                        "role": r.role, "kind": "extrapolation", "target": target, "measured": r.targets[target],
                        **{p: predicted[target][p] for p in PREDICTORS}})
    return int(small), int(2 * small), out


def fit_and_check(run_dirs: Sequence[str], fit_nodes: Sequence[int], check_nodes: Sequence[int],
                  algorithm: str = "etree") -> list[dict[str, Any]]:
    """Fit on the ``algorithm`` runs of ``fit_nodes`` nodes, predict those of ``check_nodes``: rows
    shaped like predict_eval.json's predictions (kind "extrapolation")."""
    from controller.predict import model_file

    rows = [r for r in model_file.load_runs(run_dirs) if r.algorithm == algorithm]
    train = [r for r in rows if int(r.features["n_nodes"]) in fit_nodes]
    test = [r for r in rows if int(r.features["n_nodes"]) in check_nodes]
    return _predicted(model_file.fit(train), test) if train and test else []


def _predicted(doc: dict[str, Any], rows: Sequence[Any], kind: str = "extrapolation") -> list[dict[str, Any]]:
    from controller.predict import model_file
    from controller.predict.targets import TARGETS

    out = []
    for r in rows:
        if model_file.unseen(doc, r):
            continue
        predicted = model_file.predict_row(doc, r)
        out += [{"config": r.config, "run_id": r.run_id, "node": r.node, "algorithm": r.algorithm, "role": r.role,
                 "kind": kind, "target": target, "measured": r.targets[target],
                 **{p: predicted[target][p] for p in PREDICTORS}}
                for target in TARGETS if r.targets.get(target) is not None]
    return out


FIT_MODELS = ("mlp", "lenet5", "edgetb_cifar10_cnn")  # the issue's: fitted on these built-ins
NEW_MODELS = ("edgetb_fashion_cnn", "user_cnn")  # predicted with no recorded run


def never_run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Fit on the runs of ``FIT_MODELS``, predict each run of ``NEW_MODELS`` from its input files
    alone (written again, the user's file with them), as a user would before running it. Beside
    the four predictors, ``profile``: the analytic prediction with its compute taken from a
    one-batch profile of the model in this process (``model_graph.profile_s_per_sample``), scaled
    by the median ratio of the fitted runs' train_s to their models' profiles."""
    import statistics

    from controller.predict import analytic, model_file
    from controller.predict.model_graph import profile_s_per_sample
    from controller.predict.setting import from_input_dir
    from controller.predict.targets import read_targets

    configs = {c.label: c for c in grid(args)}
    fitted = [c for c in configs.values() if c.model in FIT_MODELS]
    new = [c for c in configs.values() if c.model in NEW_MODELS]
    runs = {c.label: os.path.join(args.keep, c.label) for c in configs.values()
            if os.path.isfile(os.path.join(args.keep, c.label, "metrics.csv"))}
    rows = [r for c in fitted if c.label in runs for r in model_file.rows_of_run(runs[c.label])]
    if not rows or not any(c.label in runs for c in new):
        return []
    doc = model_file.fit(rows)
    work = tempfile.mkdtemp(prefix="edgetb-never-run-")
    profiles: dict[str, float] = {}
    try:
        def inputs(cfg: Config) -> str:
            folder = os.path.join(work, cfg.label)
            os.makedirs(folder, exist_ok=True)
            write_experiment(folder, cfg, args.rounds, args.hidden, args.epochs)
            return folder

        def profile(cfg: Config, folder: str, batch: int) -> float:
            if cfg.model not in profiles:
                setting = from_input_dir(folder)
                profiles[cfg.model] = profile_s_per_sample(model_conf(cfg.model, args.hidden), (8, 8, 1), 10, folder,
                                                           batch) / (analytic.work_per_sample(setting) or 1.0)
            return profiles[cfg.model]  # profiled seconds per training FLOP

        ratios = []
        for cfg in fitted:
            if cfg.label not in runs:
                continue
            folder = inputs(cfg)
            for r in model_file.rows_of_setting(from_input_dir(folder)):
                measured = read_targets(runs[cfg.label]).get(r.node, {})
                if r.terms.own_units > 0 and measured.get("train_s"):
                    ratios.append(measured["train_s"] / (r.terms.own_units * profile(cfg, folder, 32)))
        scale = statistics.median(ratios) if ratios else 1.0
        out = []
        for cfg in new:
            if cfg.label not in runs:
                continue
            folder = inputs(cfg)
            measured = read_targets(runs[cfg.label])
            rows_new = [r for r in model_file.rows_of_setting(from_input_dir(folder), cfg.label) if r.node in measured]
            for r in rows_new:
                r.targets = measured[r.node]
            compute = doc["calibration"]["compute_s_per_unit"]
            per_flop = scale * profile(cfg, folder, 32)
            for row in _predicted(doc, rows_new, "never run"):
                row["model"] = cfg.model
                t = next(x for x in rows_new if x.node == row["node"]).terms
                if row["target"] in ("round_mean_s", "round_p95_s") and row["analytic"] is not None:
                    row["profile"] = row["analytic"] + (per_flop - compute) * t.round_units
                elif row["target"] == "train_s" and row["analytic"] is not None:
                    row["profile"] = per_flop * t.own_units
                out.append(row)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def with_duty_cycles(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` plus a ``<resource>_duty_cycle`` row per node where both the burst and the idle
    duration were measured: burst / (burst + idle), measured and by each predictor."""
    by_key = {(r["config"], r["run_id"], r["node"], r["target"]): r for r in rows}
    out = list(rows)
    for (config, run_id, node, target), burst in by_key.items():
        if not target.endswith("_burst_s"):
            continue
        resource = target[: -len("_burst_s")]
        idle = by_key.get((config, run_id, node, f"{resource}_idle_s"))
        if idle is None or burst["measured"] + idle["measured"] <= 0:
            continue
        duty = {**burst, "target": f"{resource}_duty_cycle",
                "measured": burst["measured"] / (burst["measured"] + idle["measured"])}
        for p in PREDICTORS:
            b, i = burst.get(p), idle.get(p)
            duty[p] = b / (b + i) if b is not None and i is not None and b + i > 0 else None
        out.append(duty)
    return out


def mape(rows: Sequence[dict[str, Any]], predictor: str) -> tuple[Optional[float], int]:
    """MAPE (percent) of ``predictor`` over ``rows`` measured non-zero, and how many rows (``predictor``
    absent from a row: not counted)."""
    ape = [100.0 * abs(r[predictor] - r["measured"]) / abs(r["measured"]) for r in rows
           if r.get(predictor) is not None and r["measured"]]
    return (sum(ape) / len(ape) if ape else None), len(ape)


def pick(rows: Sequence[dict[str, Any]], targets: Sequence[str], kind: Optional[str] = None,
         algorithm: Optional[str] = None) -> list[dict[str, Any]]:
    return [r for r in rows if r["target"] in targets and (kind is None or r["kind"] == kind)
            and (algorithm is None or r["algorithm"] == algorithm)]


def fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f} %"


def table(loco: list[dict[str, Any]], extra: list[dict[str, Any]], small: int, big: int) -> str:
    """The Markdown table: MAPE per target and predictor, beside the targets and CM-DARE."""
    def per_resource(field: str) -> dict[str, list[str]]:
        return {"pooled": [f"{r}_{field}" for r in ROUND_RESOURCES], **{r: [f"{r}_{field}"] for r in BURST_RESOURCES}}

    bursts, idles, duties = per_resource("burst_s"), per_resource("idle_s"), per_resource("duty_cycle")
    lines_spec = [
        ("bytes per round (sent and received)", pick(loco, BYTE_TARGETS), "≤ 2 %", "-"),
        ("  sent", pick(loco, ("bytes_sent_per_round",)), "", ""),
        *[(f"  received, {a}", pick(loco, ("bytes_recv_per_round",), algorithm=a), "", "")
          for a in sorted({r["algorithm"] for r in loco})],
        ("round time, inside the fitted range", pick(loco, ("round_mean_s",), "interpolation"), "≤ 10 %", CM_DARE),
        *[(f"  {a}", pick(loco, ("round_mean_s",), "interpolation", a), "", "")
          for a in sorted({r["algorithm"] for r in loco})],
        (f"round time, N x 2 (fit N = {small}, predict N = {big})", pick(extra, ("round_mean_s",)), "≤ 25 %", "-"),
        *[(f"  {a}", pick(extra, ("round_mean_s",), algorithm=a), "", "")
          for a in sorted({r["algorithm"] for r in extra})],
        ("round time p95, inside the fitted range", pick(loco, ("round_p95_s",), "interpolation"), "-", "-"),
        *[row for name, targets in (("burst duration", bursts), ("idle duration", idles), ("duty cycle", duties))
          for row in [(f"{name} (cpu, net tx, net rx)", pick(loco, targets["pooled"]), "≤ 20 %", "-")]
          + [(f"  {r}", pick(loco, targets[r]), "", "") for r in BURST_RESOURCES]],
    ]
    out = ["| target (MAPE, leave one configuration out) | analytic | grey-box | SVR (CM-DARE's) | linear | n "
           "| issue's target | CM-DARE |", "|---|---|---|---|---|---|---|---|"]
    for name, rows, goal, cm in lines_spec:
        scores = [mape(rows, p) for p in PREDICTORS]
        n = max(s[1] for s in scores)
        out.append(f"| {name} | " + " | ".join(fmt(s[0]) for s in scores) + f" | {n} | {goal} | {cm} |")
    return "\n".join(out)


def per_role(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` averaged over the nodes of each configuration's role: measured and predicted."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["role"], r["target"]), []).append(r)
    out = []
    for members in groups.values():
        mean = {**members[0], "measured": sum(m["measured"] for m in members) / len(members)}
        for p in PREDICTORS:
            values = [m[p] for m in members if m.get(p) is not None]
            mean[p] = sum(values) / len(values) if values else None
        out.append(mean)
    return out


def plot(loco: list[dict[str, Any]], extra: list[dict[str, Any]], small: int, big: int, path: str) -> None:
    """Predicted against measured mean round time, one point per configuration and role: left
    the held-out configurations, right N x 2."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullFormatter

    colors = {"analytic": "tab:blue", "greybox": "tab:orange", "svr": "tab:green", "linear": "tab:gray"}
    markers = {"ring": "o", "fl": "s", "gossip": "^", "etree": "D"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.6))
    for ax, rows, title in ((axes[0], per_role(pick(loco, ("round_mean_s",))), "leave one configuration out"),
                            (axes[1], per_role(pick(extra, ("round_mean_s",))),
                             f"fit on N = {small}, predict N = {big}")):
        values = [r["measured"] for r in rows] + [r[p] for r in rows for p in PREDICTORS if r.get(p)]
        positive = [v for v in values if v > 0] or [1.0]
        lo, hi = 0.8 * min(positive), 1.25 * max(positive)
        for p in PREDICTORS:
            for algorithm, marker in markers.items():
                pts = [(r["measured"], r[p]) for r in rows if r["algorithm"] == algorithm and r.get(p) is not None]
                if pts:
                    ax.scatter(*zip(*pts), s=16, marker=marker, color=colors[p], alpha=0.6,
                               label=f"{p}, {algorithm}")
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [0.9 * lo, 0.9 * hi], [1.1 * lo, 1.1 * hi], color="k", alpha=0.08, label="±10 %")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ticks = [t for t in (0.2, 0.3, 0.5, 1, 2, 3, 5, 10, 20) if lo <= t <= hi]
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(FixedLocator(ticks))
            axis.set_major_formatter(FormatStrFormatter("%g"))
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("measured mean round time (s)")
        ax.set_ylabel("predicted (s)")
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, ncol=7, loc="lower center")
    fig.tight_layout(rect=(0, 0.09, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def etree_and_models_tables(args: argparse.Namespace, run_dirs: Sequence[str]) -> str:
    """The E-tree rows (leave one configuration out among the ``--fit-nodes`` runs; fitted on them,
    the ``--check-nodes`` runs) and the never-run models' rows, when the runs hold them."""
    from controller.predict import model_file
    from controller.predict.evaluate import evaluate

    lines = ["| target (MAPE) | analytic | grey-box | SVR | linear | profile | n | issue's target |",
             "|---|---|---|---|---|---|---|---|"]

    def line(name: str, rows: list[dict[str, Any]], goal: str) -> None:
        scores = [mape(rows, p) for p in (*PREDICTORS, "profile")]
        lines.append(f"| {name} | " + " | ".join(fmt(sc[0]) for sc in scores)
                     + f" | {max(sc[1] for sc in scores)} | {goal} |")

    etree = [d for d in run_dirs if os.path.basename(d).startswith("etree-")]
    fit_dirs = [d for d in etree if int(os.path.basename(d).split("-")[1][1:]) in args.fit_nodes]
    if len({os.path.basename(d).split("-cpu")[0] for d in fit_dirs}) >= 3:
        report = evaluate(model_file.load_runs(fit_dirs))
        inside = [r for r in report["predictions"] if r["kind"] == "interpolation"]
        line(f"E-tree round time, leave one configuration out, N {args.fit_nodes} (inside the range)",
             pick(inside, ("round_mean_s",)), "≤ 10 %")
        if len(inside) < len(report["predictions"]):
            line("  … all held out (inside the range or not)", pick(report["predictions"], ("round_mean_s",)), "")
        line("E-tree bytes per round, leave one out", pick(report["predictions"], BYTE_TARGETS), "")
        checked = fit_and_check(etree, args.fit_nodes, args.check_nodes)
        line(f"E-tree round time, fit N {args.fit_nodes}, predict N {args.check_nodes}",
             pick(checked, ("round_mean_s",)), "≤ 15 %")
        line("E-tree bytes per round, same", pick(checked, BYTE_TARGETS), "")
    gossip = [d for d in run_dirs if os.path.basename(d).startswith("gossip-")]
    if len(gossip) >= 3:
        report = evaluate(model_file.load_runs(gossip))
        line("gossip bytes received per round, leave one out", pick(report["predictions"], ("bytes_recv_per_round",)),
             "≤ 1 %")
    new = never_run(args) if any(m in NEW_MODELS for m in args.models) else []
    for model in NEW_MODELS:
        mine = [r for r in new if r["model"] == model]
        if mine:
            line(f"never run: {model}, round time (fit on {', '.join(FIT_MODELS)})", pick(mine, ("round_mean_s",)),
                 "≤ 20 %")
            line(f"  … {model}, train_s", pick(mine, ("train_s",)), "")
    return "\n".join(lines) if len(lines) > 2 else ""


SUITES: dict[str, dict[str, Any]] = {
    "grid": {},  # ring, FL and gossip as the options say (default: the 36 runs)
    "etree": {"algorithms": ["etree"], "nodes": [10, 20, 40, 80], "rates": ["5mbit", "20mbit"], "cpus": [1.0],
              "hidden": 512, "rounds": 6, "models": ["mlp"], "epochs": 1},
    "models": {"algorithms": ["fl"], "nodes": [4], "rates": ["5mbit", "20mbit"], "cpus": [1.0], "hidden": 512,
               "rounds": 5, "epochs": 2, "models": ["mlp", "lenet5", "edgetb_cifar10_cnn", "edgetb_fashion_cnn",
                                                    "user_cnn"]},
}


def run_suite(args: argparse.Namespace, temporary: bool) -> None:
    """Record (or find) one suite's runs under ``args.keep`` and print its tables."""
    if args.eval_only:
        run_dirs = sorted(os.path.dirname(m) for m in glob.glob(os.path.join(args.keep, "*", "metrics.csv")))
    else:
        if os.geteuid() != 0:
            raise SystemExit("run as root: the nodes are network namespaces")
        started = time.monotonic()
        configs = grid(args)
        run_dirs = []
        for i, cfg in enumerate(configs, 1):
            log(f"{i}/{len(configs)} {cfg.label}")
            run_dirs.append(record(cfg, args))
        log(f"grid of {len(configs)} runs in {(time.monotonic() - started) / 60:.1f} min")
    report_path = os.path.join(args.keep, "predict_eval.json")
    started = time.monotonic()
    report = cli_eval(run_dirs, report_path)
    small, big, extra = extrapolate(run_dirs)
    log(f"evaluated in {time.monotonic() - started:.0f} s ({report_path})")
    loco = with_duty_cycles(report["predictions"])
    extra = with_duty_cycles(extra)
    kinds = [h.get("kind", "skipped") for h in report["held_out"]]
    print(f"\n{report['configs']} configurations, {report['runs']} runs"
          + ("" if args.eval_only else f", {args.rounds} rounds each") + "; "
          f"{kinds.count('interpolation')} held-out configurations inside the fitted range, "
          f"{kinds.count('extrapolation')} outside, {kinds.count('skipped')} skipped\n")
    print(table(loco, extra, small, big))
    more = etree_and_models_tables(args, run_dirs)
    if more:
        print("\n" + more)
    if args.plot:
        plot(loco, extra, small, big, args.plot)
        print(f"\nplot: {args.plot}")
    if not temporary:
        print(f"run folders and predict_eval.json kept in {args.keep}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep", help="keep the run folders here (default: a temporary directory, removed at the end)")
    p.add_argument("--eval-only", action="store_true", help="score the run folders under --keep, run nothing")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[4, 6, 8])
    p.add_argument("--rates", type=lambda s: s.split(","), default=["5mbit", "20mbit"])
    p.add_argument("--cpus", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0])
    p.add_argument("--algorithms", type=lambda s: s.split(","), default=["ring", "fl", "gossip"])
    p.add_argument("--hidden", type=int, default=HIDDEN, help="the MLP's hidden units (default %(default)s)")
    p.add_argument("--models", type=lambda s: s.split(","), default=["mlp"],
                   help="models: mlp, the built-in networks, user_cnn (a user's numpy CNN)")
    p.add_argument("--epochs", type=int, default=1, help="epochs a round")
    p.add_argument("--fit-nodes", type=lambda s: [int(x) for x in s.split(",")], default=[10, 20, 40],
                   help="E-tree: the sizes fitted on (default 10,20,40)")
    p.add_argument("--check-nodes", type=lambda s: [int(x) for x in s.split(",")], default=[80],
                   help="E-tree: the sizes predicted from them (default 80)")
    p.add_argument("--id", default="pbg", help="testbed id of the runs")
    p.add_argument("--subnet", default="10.252.0.0/16")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "predict.png"))
    p.add_argument("--suite", choices=("all", *SUITES), default="all",
                   help="all (default): the grid (with the options above), then the E-trees, then the models, "
                        "each in its own folder under --keep; one name: that one, in --keep itself")
    args = p.parse_args()
    if args.eval_only and not args.keep:
        raise SystemExit("--eval-only needs --keep DIR (the run folders of an earlier call)")
    if not args.eval_only and os.geteuid() != 0:
        raise SystemExit("run as root: the nodes are network namespaces")
    temporary = not args.keep
    args.keep = os.path.abspath(args.keep or tempfile.mkdtemp(prefix="edgetb-predict-runs-"))
    os.makedirs(args.keep, exist_ok=True)
    try:
        names = list(SUITES) if args.suite == "all" else [args.suite]
        for name in names:
            suite = argparse.Namespace(**{**vars(args), **SUITES[name]})
            if args.suite == "all":
                suite.keep = os.path.join(args.keep, name)
                os.makedirs(suite.keep, exist_ok=True)
            if name != "grid":
                suite.plot = ""
            print(f"\n## {name}")
            run_suite(suite, temporary)
    finally:
        if temporary:
            shutil.rmtree(args.keep, ignore_errors=True)


if __name__ == "__main__":
    main()

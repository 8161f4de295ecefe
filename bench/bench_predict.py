"""How well ``edgetb predict`` predicts round time, traffic and bursts, on a grid of real runs.

Run as root: ``.venv/bin/python bench/bench_predict.py [--keep DIR] [--rounds 10]``
(``--eval-only --keep DIR`` scores the runs a previous call kept, without running anything).

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
durations. Burst metrics are pooled over cpu, net tx and net rx, the resources whose bursts
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
SCRIPTS = {"ring": ("ra_run.py", "ra"), "fl": ("fl_run.py", "fl"), "gossip": ("gl_run.py", "gl")}
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

    @property
    def label(self) -> str:
        return f"{self.algorithm}-n{self.nodes}-{self.rate}-cpu{self.cpu:g}"


def experiment_files(cfg: Config, rounds: int, hidden: int = HIDDEN) -> dict[str, Any]:
    """The input files of one configuration, by file name."""
    names = [f"n{i}" for i in range(1, cfg.nodes + 1)]
    model = {"kind": "numpy", "hidden": [hidden], "learning_rate": 0.005, "seed": 0}
    prefix = SCRIPTS[cfg.algorithm][1]
    if cfg.algorithm == "fl":
        agg, trainers = names[0], names[1:]
        links = {agg: [{"dest": t, "bw": cfg.rate} for t in trainers]}
        links.update({t: [{"dest": agg, "bw": cfg.rate}] for t in trainers})
        structure: dict[str, Any] = {"model": model, "node_list": [
            {"name": agg, "sync": rounds, "trainer_fraction": 1.0, "deadline_s": 120, "quorum": 1.0}]
            + [{"name": t, "epoch": 1} for t in trainers]}
    else:
        links = {a: [{"dest": names[(i + 1) % len(names)], "bw": cfg.rate}] for i, a in enumerate(names)}
        structure = {"sync": rounds, "model": model, "node_list": [{"name": n, "epoch": 1} for n in names]}
        structure.update({"step_timeout_s": 60} if cfg.algorithm == "ring" else {"wait_s": 10})
    return {"links.json": links, "nodes.json": {"nodes": [{"name": n, "cpu": cfg.cpu} for n in names]},
            f"{prefix}_structure.json": structure,
            f"{prefix}_dataset.json": {"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}}


def write_experiment(workdir: str, cfg: Config, rounds: int, hidden: int = HIDDEN) -> None:
    """The configuration's input files in ``workdir``."""
    for name, data in experiment_files(cfg, rounds, hidden).items():
        with open(os.path.join(workdir, name), "w") as f:
            json.dump(data, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(cfg: Config, args: argparse.Namespace) -> str:
    """Run ``cfg`` with its run script and keep its run folder as ``<keep>/<label>``."""
    kept = os.path.join(args.keep, cfg.label)
    if os.path.isfile(os.path.join(kept, "metrics.csv")):
        log(f"{cfg.label}: kept from an earlier call")
        return kept
    workdir = tempfile.mkdtemp(prefix="edgetb-predict-")
    os.chmod(workdir, 0o755)  # (the node processes read it as their own users)
    try:
        write_experiment(workdir, cfg, args.rounds, args.hidden)
        started = time.monotonic()
        out = subprocess.run([sys.executable, os.path.join(ROOT, SCRIPTS[cfg.algorithm][0]), "--workdir", workdir,
                              "--auto", "--nodes", "nodes.json", "--id", args.id, "--subnet", args.subnet,
                              "--port", str(free_port()), "--quiet-nodes"],
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
    return [Config(a, n, r, c) for a in args.algorithms for n in args.nodes for r in args.rates for c in args.cpus]


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
    """MAPE (percent) of ``predictor`` over ``rows`` measured non-zero, and how many rows."""
    ape = [100.0 * abs(r[predictor] - r["measured"]) / abs(r["measured"]) for r in rows
           if r.get(predictor) is not None and r["measured"] != 0]
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
    p.add_argument("--id", default="pbg", help="testbed id of the runs")
    p.add_argument("--subnet", default="10.252.0.0/16")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "predict.png"))
    args = p.parse_args()
    if args.eval_only and not args.keep:
        raise SystemExit("--eval-only needs --keep DIR (the run folders of an earlier call)")
    temporary = not args.keep
    args.keep = os.path.abspath(args.keep or tempfile.mkdtemp(prefix="edgetb-predict-runs-"))
    os.makedirs(args.keep, exist_ok=True)
    try:
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
        if args.plot:
            plot(loco, extra, small, big, args.plot)
            print(f"\nplot: {args.plot}")
        if not temporary:
            print(f"run folders and predict_eval.json kept in {args.keep}")
    finally:
        if temporary:
            shutil.rmtree(args.keep, ignore_errors=True)


if __name__ == "__main__":
    main()

"""How well ``edgetb predict`` predicts Driple's 12 burst metrics, on real runs with captures.

Run as root: ``.venv/bin/python bench/bench_bursts.py [--keep DIR] [--eval-only]``. Records the
grid below with bench_predict.py's experiment files, every node captured (``--capture all``) and
sampled at 100 ms, so that each run's analysis writes ``analysis/timed_bursts.csv`` (the burst
definition: controller/results/analysis/timed_bursts.py). Then ``edgetb predict eval --by config``
leaves one configuration out, and the table gives per metric the error of each predictor as
MAPE over rows measured non-zero and as sMAPE (|p - m| / ((|p| + |m|) / 2)), beside the issue's
<= 20 % target. ``--eval-only --keep DIR1 DIR2``: the runs kept in several folders evaluated
together (a configuration recorded several times is held out whole). Each run is predicted
under the host load it recorded (``host_busy_cores``, controller/predict/host_load.py: the
cores the host kept busy besides the run's nodes), as a user who states their host's load
would be; the range of those loads is printed under the table.

``--background-cores K`` keeps K busy loops of its own running while it records (a host load a
user would state), and measures the host's load for 1 s before each run, as ``edgetb predict``
does by default; ``--fit-on DIR...`` then fits on the runs kept there and predicts each recorded
configuration from its inputs under that load measured beforehand (the user's way) and under the
load the run recorded, beside what it measured.

Grid (defaults): ring all-reduce and FL, 4 nodes, every link at 5, 10 or 20 Mbit/s, 1 CPU a node,
6 rounds, the 153,610-parameter MLP of bench_predict.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench_predict as BP  # noqa: E402
from controller.predict import host_load  # noqa: E402
from controller.predict.model_file import PREDICTORS  # noqa: E402
from controller.predict.targets import BURST_FIELDS, BURST_RESOURCES  # noqa: E402

DRIPLE = ("Driple (Yang et al., POMACS 6(2), 2022, doi 10.1145/3530895) predicts the same 12 metrics with a GNN "
          "(its code, github.com/gsyang33/Driple, writes per resource 'avg Idle time', 'avg Active time' and 'avg Peak "
          "consumption': its burst consumption is a burst's peak, ours its mean); its per-metric error figures were "
          "not found in its abstract, its repository or the pages searched")
TARGET_PCT = 20.0


def background(cores: int) -> list[subprocess.Popen]:
    """``cores`` busy loops, each a process of its own (ended by ``stop``)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]


def stop(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


def stated(dirs: Sequence[str], before: dict[str, float], fit_on: Sequence[str], cfgs: Sequence[BP.Config]) -> str:
    """sMAPE per burst metric of each run of ``dirs`` predicted from its inputs by a model fitted
    on the ``cfgs`` kept in ``fit_on``: under the load measured before it and the load it recorded."""
    from controller.predict import model_file
    from controller.predict.setting import from_run_dir
    from controller.predict.targets import BURST_TARGETS, read_targets

    fitted = [d for k in fit_on for d in (os.path.join(k, c.label) for c in cfgs) if os.path.isdir(d)]
    doc = model_file.fit(model_file.load_runs(fitted))
    rows: dict[str, list[dict[str, Any]]] = {"before": [], "recorded": []}
    for d in dirs:
        label = os.path.basename(d)
        measured = read_targets(d)
        recorded = host_load.of_run(d)
        for how, load in (("before", before.get(label)), ("recorded", float(np.mean(list(recorded.values()))))):
            if load is None:
                continue
            result = model_file.predict_setting(doc, from_run_dir(d), load)
            for node in result["nodes"]:
                for t in BURST_TARGETS:
                    if measured.get(node["node"], {}).get(t) is not None:
                        rows[how].append({"target": t, "measured": measured[node["node"]][t],
                                          **node["predictions"][t]})
    out = [f"fitted on {len(fitted)} runs of {', '.join(fit_on)}; sMAPE % of the best predictor, the run's load "
           "measured before it / recorded by it", "| metric | " + " | ".join(BURST_FIELDS) + " |",
           "|---|" + "---|" * len(BURST_FIELDS)]
    for resource in BURST_RESOURCES:
        cells = []
        for field in BURST_FIELDS:
            best = []
            for how in ("before", "recorded"):
                sm = [errors([r for r in rows[how] if r["target"] == f"{resource}_{field}"], p)[1] for p in PREDICTORS]
                best.append(min((v for v in sm if v is not None), default=None))
            cells.append(" / ".join(fmt(v) for v in best))
        out.append(f"| {resource} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def record(cfg: BP.Config, args: argparse.Namespace) -> str:
    """``cfg``'s run with every node captured and telemetry at 100 ms, kept as ``<keep>/<label>``."""
    return BP.record(cfg, args, epochs=1, options=("--capture", "all", "--telemetry-period-ms", "100"),
                     done_file=os.path.join("analysis", "timed_bursts.csv"))


def errors(rows: Sequence[dict[str, Any]], predictor: str) -> tuple[Optional[float], Optional[float], int]:
    """(MAPE over rows measured non-zero, sMAPE, n)."""
    pairs = [(r["measured"], r[predictor]) for r in rows if r.get(predictor) is not None]
    if not pairs:
        return None, None, 0
    m, p = np.array(pairs, float).T
    nz = m != 0
    mape = float(np.mean(np.abs(p[nz] - m[nz]) / np.abs(m[nz])) * 100) if nz.any() else None
    den = (np.abs(p) + np.abs(m)) / 2
    smape = float(np.mean(np.where(den > 0, np.abs(p - m) / np.where(den > 0, den, 1), 0.0)) * 100)
    return mape, smape, len(pairs)


def fmt(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(predictions: Sequence[dict[str, Any]]) -> str:
    out = ["| metric (leave one configuration out) | " + " | ".join(f"{p} MAPE / sMAPE %" for p in PREDICTORS)
           + " | n | <= 20 %? |", "|---|" + "---|" * (len(PREDICTORS) + 2)]
    for resource in BURST_RESOURCES:
        for field in BURST_FIELDS:
            target = f"{resource}_{field}"
            rows = [r for r in predictions if r["target"] == target]
            cells, best = [], None
            n = 0
            for p in PREDICTORS:
                mape, smape, n_p = errors(rows, p)
                n = max(n, n_p)
                cells.append(f"{fmt(mape)} / {fmt(smape)}")
                if smape is not None:
                    best = smape if best is None else min(best, smape)
            met = "-" if best is None else ("yes" if best <= TARGET_PCT else "no")
            out.append(f"| {target} | " + " | ".join(cells) + f" | {n} | {met} (best sMAPE {fmt(best)}) |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keep", nargs="+", help="keep the run folders here (default: a temporary directory); with "
                                              "--eval-only, every folder given is read")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--algorithms", nargs="+", default=["ring", "fl"])
    p.add_argument("--nodes", type=int, nargs="+", default=[4])
    p.add_argument("--rates", nargs="+", default=["5mbit", "10mbit", "20mbit"])
    p.add_argument("--cpus", type=float, nargs="+", default=[1.0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--hidden", type=int, default=BP.HIDDEN)
    p.add_argument("--id", default="bb")
    p.add_argument("--subnet", default="10.213.0.0/16")
    p.add_argument("--background-cores", type=int, default=0, help="busy loops of its own kept running while recording")
    p.add_argument("--fit-on", nargs="+", help="predict the recorded runs with a model fitted on the runs kept there")
    args = p.parse_args()
    temporary = args.keep is None
    keeps = args.keep or [tempfile.mkdtemp(prefix="edgetb-bench-bursts-")]
    if len(keeps) > 1 and not args.eval_only:
        p.error("several --keep folders are read with --eval-only only")
    args.keep = keeps[0]
    os.makedirs(args.keep, exist_ok=True)
    try:
        cfgs = [BP.Config(a, n, r, c) for a in args.algorithms for n in args.nodes for r in args.rates for c in args.cpus]
        if args.eval_only:
            dirs = [d for k in keeps for d in (os.path.join(k, c.label) for c in cfgs) if os.path.isdir(d)]
        else:
            procs = background(args.background_cores)
            loads_json = os.path.join(args.keep, "loads_before.json")
            before = json.load(open(loads_json)) if os.path.isfile(loads_json) else {}
            try:
                dirs = []
                for c in cfgs:
                    if not os.path.isdir(os.path.join(args.keep, c.label)):
                        before[c.label] = host_load.measure(1.0)
                    dirs.append(record(c, args))
                    with open(loads_json, "w") as f:
                        json.dump(before, f, indent=1)
            finally:
                stop(procs)
        if args.fit_on:  # the load measured before each run, as recorded in the (first) --keep folder
            loads_json = os.path.join(args.keep, "loads_before.json")
            before = json.load(open(loads_json)) if os.path.isfile(loads_json) else {}
            print(stated(dirs, before, args.fit_on, cfgs) + "\n")
        doc = BP.cli_eval(dirs, os.path.join(args.keep, "predict_eval.json"))
        print(table(doc["predictions"]))
        loads = [v for d in dirs for v in host_load.of_run(d).values()]
        if loads:
            print(f"\nhost busy cores besides the runs' nodes: {min(loads):.2f}-{max(loads):.2f} "
                  f"(median {float(np.median(loads)):.2f})")
        print(f"\n{len(dirs)} runs, {doc['configs']} configurations; {DRIPLE}")
    finally:
        if temporary:
            shutil.rmtree(args.keep, ignore_errors=True)


if __name__ == "__main__":
    main()

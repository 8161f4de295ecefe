"""``edgetb predict``: fit on run folders, predict a configuration, cross-validate.

    edgetb predict fit RUN_DIR... --out model.json
    edgetb predict INPUT_DIR --model model.json [--algorithm ring] [--out prediction.json] [--json]
    edgetb predict RUN_DIR --model model.json      (a finished run: predicted beside measured)
    edgetb predict eval RUN_DIR... [--by config] [--out predict_eval.json]

Predicting needs no root and no testbed: it reads the input files and the model file.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Optional

from worker.api.errors import ConfigError

LINKS_SHOWN = 8


def add_parser(sub: Any) -> None:
    """Register ``predict`` on the ``edgetb`` subparsers."""
    p = sub.add_parser("predict", help="predict round time, traffic and bursts from recorded runs",
                       usage="edgetb predict fit RUN_DIR... --out model.json\n"
                             "       edgetb predict INPUT_DIR|RUN_DIR --model model.json [--out prediction.json]\n"
                             "       edgetb predict eval RUN_DIR... [--by config] [--out predict_eval.json]")
    p.add_argument("paths", nargs="+", metavar="PATH", help="'fit RUN_DIR...', 'eval RUN_DIR...', an INPUT_DIR "
                   "(structure, dataset, links and optional nodes and scenario files, as for a run) or a finished "
                   "RUN_DIR (predicted beside measured)")
    p.add_argument("--model", help="the model file to predict with (from 'predict fit')")
    p.add_argument("--out", help="where to write: the model (fit, required), prediction.json (predict) or "
                                 "predict_eval.json (eval)")
    p.add_argument("--by", default="config", choices=("config",),
                   help="eval: what a fold holds out (a configuration: the runs of the same inputs)")
    p.add_argument("--algorithm", choices=("gossip", "fl", "etree", "ring"),
                   help="the INPUT_DIR's algorithm (default: from the structure file's name, gl_/fl_/el_/ra_)")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the table")


def _fmt(value: Optional[float]) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:.0f}"
    if magnitude < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4g}"


def render(result: dict[str, Any]) -> str:
    """The per-role prediction table, with what lies outside the fitted range and what was refused."""
    from controller.predict.model_file import PREDICTORS

    lines = [f"{result['algorithm']} configuration {result['config']} ({result['source']})"]
    for role, entry in result["roles"].items():
        lines.append("")
        lines.append(f"role {role} ({len(entry['nodes'])} node(s), fitted on {entry['configs_fitted']} "
                     f"configuration(s))")
        measured = entry.get("measured")
        lines.append(f"  {'target':<26}" + "".join(f"{p:>12}" for p in PREDICTORS)
                     + (f"{'measured':>12}" if measured else ""))
        for target, values in entry["predictions"].items():
            if all(v is None for v in values.values()):
                continue
            lines.append(f"  {target:<26}" + "".join(f"{_fmt(values[p]):>12}" for p in PREDICTORS)
                         + (f"{_fmt(measured.get(target)):>12}" if measured else ""))
        if entry["extrapolating"]:
            lines.append(f"  outside the fitted range: {', '.join(entry['extrapolating'])}")
        if entry["unsupported"]:
            lines.append(f"  analytic: {entry['unsupported']}")
        refused = [k for k in entry["refused"]]
        if refused:
            lines.append(f"  refused: {len(refused)} fit(s), e.g. {entry['refused'][refused[0]]}")
    links = result.get("links_bytes_per_round") or {}
    if links:
        busiest = sorted(links.items(), key=lambda kv: -kv[1])[:LINKS_SHOWN]
        lines.append("")
        lines.append("analytic bytes per round on the busiest links: "
                     + ", ".join(f"{k} {_fmt(v)}" for k, v in busiest)
                     + (f" (all {len(links)} in the JSON)" if len(links) > LINKS_SHOWN else ""))
    return "\n".join(lines)


def _fit(args: argparse.Namespace, run_dirs: list[str]) -> int:
    from controller.predict import model_file

    if not args.out:
        raise ConfigError("predict fit: --out model.json is required")
    rows = model_file.load_runs(run_dirs)
    doc = model_file.fit(rows)
    model_file.save(doc, args.out)
    for name, group in doc["groups"].items():
        refused = model_file.refusals(group)
        print(f"{name}: {group['rows']} node rows of {len(group['configs'])} configuration(s)"
              + (f"; {len(refused)} fit(s) refused, e.g. {next(iter(refused.values()))}" if refused else ""))
    print(f"model written in {args.out} ({len(doc['runs'])} runs)")
    return 0


def _eval(args: argparse.Namespace, run_dirs: list[str]) -> int:
    from controller.predict import model_file
    from controller.predict.evaluate import evaluate

    report = evaluate(model_file.load_runs(run_dirs), args.by)
    out = args.out or "predict_eval.json"
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    kinds = [h.get("kind", "skipped") for h in report["held_out"]]
    print(f"{report['configs']} configurations, {report['runs']} runs: "
          f"{kinds.count('interpolation')} interpolation, {kinds.count('extrapolation')} extrapolation folds")
    print(f"{'target':<26}{'predictor':>10}{'MAPE %':>10}{'median %':>10}{'R2':>8}{'n':>6}")
    for target, by_predictor in report["results"].items():
        for predictor, by_kind in by_predictor.items():
            s = by_kind["all"]
            print(f"{target:<26}{predictor:>10}{_fmt(s['mape']):>10}{_fmt(s['median_ape']):>10}"
                  f"{_fmt(s['r2']):>8}{s['n']:>6}")
    print(f"written in {out}")
    return 0


def _predict(args: argparse.Namespace, input_dir: str) -> int:
    from controller.predict import model_file

    if not args.model:
        raise ConfigError("predict INPUT_DIR: --model model.json is required (make one with 'edgetb predict fit')")
    doc = model_file.load(args.model)
    if os.path.isfile(os.path.join(input_dir, "run.json")):  # a finished run: predicted beside measured
        result = model_file.predict_run_dir(doc, input_dir)
    else:
        result = model_file.predict_input_dir(doc, input_dir, args.algorithm)
    out = args.out or "prediction.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1) if args.json else render(result))
    if not args.json:
        print(f"\nwritten in {out}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    """Dispatch ``edgetb predict``."""
    first, rest = args.paths[0], args.paths[1:]
    if first in ("fit", "eval"):
        if not rest:
            raise ConfigError(f"predict {first}: give one or more run folders (dml_file/log/<run id>)")
        return _fit(args, rest) if first == "fit" else _eval(args, rest)
    if rest:
        raise ConfigError(f"predict: one INPUT_DIR, got {len(args.paths)} paths (did you mean 'predict fit'?)")
    return _predict(args, first)

"""Prediction on real run folders: four ring all-reduce runs (N = 3, 4, 5, 6) on netns nodes,
a model fitted on three of them predicts the fourth from its input directory alone; its bytes per
round match what the run sent (traffic.csv); fit, predict and eval through the CLI."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT
from tests.e2e.test_algorithms import run_to_end

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
SIZES = (3, 4, 5, 6)
HELD_OUT = 5  # inside the range of the others: an interpolation
ROUNDS = 4
MODEL = {"kind": "numpy", "hidden": [256], "learning_rate": 0.005, "seed": 0}  # 19,210 parameters


def ring_experiment(n: int) -> dict:
    names = [f"n{i}" for i in range(1, n + 1)]
    return {"structure": {"sync": ROUNDS, "step_timeout_s": 60, "model": MODEL,
                          "node_list": [{"name": m, "epoch": 1} for m in names]},
            "links": {a: [{"dest": names[(i + 1) % n], "bw": "20mbit"}] for i, a in enumerate(names)},
            "dataset": {"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}}


def edgetb(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "controller", "predict", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def traffic_per_round(run_dir: Path) -> dict[tuple[str, str], float]:
    """Bytes each node sent and received per round, by traffic.csv (every message)."""
    totals: Counter = Counter()
    with open(run_dir / "traffic.csv", newline="") as f:
        for row in csv.DictReader(f):
            totals[(row["node"], row["direction"])] += int(row["bytes"])
    return {key: total / ROUNDS for key, total in totals.items()}


def test_a_model_fitted_on_three_ring_runs_predicts_the_fourths_bytes(run, tmp_path):
    runs = {}
    for n in SIZES:  # one after another: never two experiments at once
        r = run(kind="ra", defer=True, **ring_experiment(n))
        r.start()
        summary, _ = run_to_end(r, timeout_s=240)
        assert all(node["ended"] == "done" and node["rounds"] == ROUNDS for node in summary["nodes"]), summary
        r.close()
        runs[n] = (r.workdir, Path(summary["run_dir"]))
    fitted = [str(runs[n][1]) for n in SIZES if n != HELD_OUT]
    model = tmp_path / "model.json"
    out = edgetb("fit", *fitted, "--out", str(model), cwd=tmp_path).stdout
    assert "ring/ring: " in out and "3 configuration(s)" in out, out
    # grey-box round time has 4 coefficients: refused with 3 configurations, and said so
    assert json.loads(model.read_text())["groups"]["ring/ring"]["greybox"]["round_mean_s"].get("refused")

    workdir, run_dir = runs[HELD_OUT]
    prediction = tmp_path / "prediction.json"
    table = edgetb(str(workdir), "--model", str(model), "--out", str(prediction), cwd=tmp_path).stdout
    assert "role ring (5 node(s), fitted on 3 configuration(s))" in table, table
    result = json.loads(prediction.read_text())
    assert result["algorithm"] == "ring" and result["roles"]["ring"]["extrapolating"] == []
    assert sorted(n["node"] for n in result["nodes"]) == [f"n{i}" for i in range(1, 6)]
    measured = traffic_per_round(run_dir)
    for node in result["nodes"]:
        for direction in ("sent", "recv"):
            truth = measured[(node["node"], direction)]
            for predictor in ("analytic", "greybox"):
                value = node["predictions"][f"bytes_{direction}_per_round"][predictor]
                assert value == pytest.approx(truth, rel=0.02), (node["node"], direction, predictor, value, truth)
    # every link of the ring carries the same: each node's chunks to its successor
    links = result["links_bytes_per_round"]
    assert sorted(links) == sorted(f"n{i}->n{i % 5 + 1}" for i in range(1, 6))
    for key, value in links.items():
        assert value == pytest.approx(measured[(key.split("->")[0], "sent")], rel=0.02), key

    # a finished run: predicted beside measured
    beside = tmp_path / "beside.json"
    edgetb(str(run_dir), "--model", str(model), "--out", str(beside), cwd=tmp_path)
    ring = json.loads(beside.read_text())["roles"]["ring"]
    assert ring["measured"]["bytes_sent_per_round"] == pytest.approx(
        ring["predictions"]["bytes_sent_per_round"]["analytic"], rel=0.02)
    assert ring["measured"]["round_mean_s"] > 0

    # leave one configuration out over the four runs
    report_path = tmp_path / "predict_eval.json"
    out = edgetb("eval", *(str(runs[n][1]) for n in SIZES), "--by", "config", "--out", str(report_path),
                 cwd=tmp_path).stdout
    assert "4 configurations, 4 runs" in out, out
    report = json.loads(report_path.read_text())
    assert [h["kind"] for h in report["held_out"]].count("interpolation") == 2  # N = 4 and 5; 3 and 6 lie outside
    for target in ("bytes_sent_per_round", "bytes_recv_per_round"):
        scores = report["results"][target]["analytic"]["all"]
        assert scores["n"] == sum(SIZES) and scores["mape"] <= 2.0, (target, scores)
    assert report["results"]["round_mean_s"]["analytic"]["all"]["n"] == sum(SIZES)

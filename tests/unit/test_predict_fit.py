"""Prediction's fits on synthetic run folders whose round times follow the grey-box formula with
known coefficients and 5 % noise: the fit recovers each coefficient, and leave-one-configuration-out
predicts held-out configurations."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from controller.predict import model_file
from controller.predict.evaluate import evaluate
from controller.predict.features import node_features
from controller.predict.greybox import COLUMNS
from controller.predict.setting import from_input_dir, from_run_dir

# seconds per training FLOP, per second of configured transfer, per message, per byte all nodes send
# and node sharing the host, per round
TRUE = {"round_units": 5e-9, "transfer_s": 1.5, "messages": 0.004, "host_contention": 2e-8, "one": 0.05}
GRID = [  # (nodes, link rate in mbit/s, cpu, epochs, hidden)
    (3, 5, 1.0, 1, 32), (3, 20, 0.5, 3, 128), (4, 5, 0.5, 2, 64), (4, 20, 1.0, 1, 128),
    (4, 10, 1.0, 3, 32), (5, 5, 1.0, 1, 128), (5, 20, 0.5, 2, 32), (6, 10, 0.5, 1, 64),
    (6, 5, 1.0, 3, 64), (6, 20, 1.0, 2, 128), (3, 10, 0.5, 2, 96), (5, 10, 1.0, 3, 96),
    (8, 10, 1.0, 2, 64),  # the only N = 8: held out, an extrapolation
]
ROUNDS = 20


def write_inputs(folder: str, n: int, rate_mbit: int, cpu: float, epochs: int, hidden: int) -> None:
    """A ring's input files: the ring's links at one rate, every node at ``cpu``."""
    os.makedirs(folder, exist_ok=True)
    names = [f"n{i + 1}" for i in range(n)]
    links = {a: [{"dest": names[(i + 1) % n], "bw": f"{rate_mbit}mbit"}] for i, a in enumerate(names)}
    files = {"links.json": links,
             "nodes.json": {"nodes": [{"name": a, "cpu": cpu} for a in names]},
             "ra_structure.json": {"sync": ROUNDS, "model": {"kind": "numpy", "hidden": [hidden], "seed": 0},
                                   "node_list": [{"name": a, "epoch": epochs} for a in names]},
             "ra_dataset.json": {"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}}
    for name, doc in files.items():
        with open(os.path.join(folder, name), "w") as f:
            json.dump(doc, f)


def make_run(root: str, name: str, spec: tuple, rng: np.random.Generator, noise: float = 0.05) -> str:
    """A run folder as the testbed writes one, its metrics drawn from the grey-box formula."""
    inputs = os.path.join(root, name + "-inputs")
    write_inputs(inputs, *spec)
    setting = from_input_dir(inputs)
    run_dir = os.path.join(root, name)
    os.makedirs(os.path.join(run_dir, "inputs"))
    for f in os.listdir(inputs):
        shutil.copy(os.path.join(inputs, f), os.path.join(run_dir, "inputs", f))
    with open(os.path.join(run_dir, "run.json"), "w") as f:
        json.dump({"version": 1, "run_id": name, "algorithm": "ring"}, f)
    with open(os.path.join(run_dir, "confs.json"), "w") as f:
        json.dump({n: {"structure": c} for n, c in setting.structure.items()}, f)
    with open(os.path.join(run_dir, "topology.json"), "w") as f:
        json.dump(setting.topology.to_dict(), f)
    lines = ["run_id,algorithm,node,role,layer,round,time_s,bytes_sent,bytes_recv,train_s,send_s"]
    for row in model_file.rows_of_setting(setting):
        cols = row.columns()
        clock = 0.0
        for r in range(1, ROUNDS + 1):
            round_s = sum(TRUE[c] * cols[c] for c in TRUE) * (1.0 + noise * rng.standard_normal())
            clock += round_s
            sent = row.terms.payload_sent_bytes + 230 * row.terms.messages_sent
            recv = row.terms.payload_recv_bytes + 230 * row.terms.messages_recv
            lines.append(f"{name},ring,{row.node},ring,,{r},{clock:.6f},{sent:.0f},{recv:.0f},"
                         f"{TRUE['round_units'] * row.terms.own_units:.6f},{row.terms.own_send_s:.6f}")
    with open(os.path.join(run_dir, "metrics.csv"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[str]:
    root = str(tmp_path_factory.mktemp("predict-runs"))
    rng = np.random.default_rng(7)
    return [make_run(root, f"c{i:02d}", spec, rng) for i, spec in enumerate(GRID)]


def test_a_synthetic_run_folder_has_its_input_directorys_features(runs):
    assert node_features(from_run_dir(runs[0])) == node_features(from_input_dir(runs[0] + "-inputs"))


def test_the_grey_box_fit_recovers_each_coefficient_within_5_percent(runs):
    doc = model_file.fit(model_file.load_runs(runs))
    fitted = doc["groups"]["ring/ring"]["greybox"]["round_mean_s"]
    assert fitted["columns"] == list(COLUMNS["round_mean_s"]) == list(TRUE)
    for name, coef in zip(fitted["columns"], fitted["coef"]):
        assert coef == pytest.approx(TRUE[name], rel=0.05), name
    train = doc["groups"]["ring/ring"]["greybox"]["train_s"]  # train_s = 5e-9 x own units, no noise
    assert train["coef"][0] == pytest.approx(TRUE["round_units"], rel=1e-3)
    assert train["coef"][1] == pytest.approx(0.0, abs=1e-6)


def test_leave_one_configuration_out_mape_within_6_percent(runs):
    report = evaluate(model_file.load_runs(runs))
    assert report["configs"] == len(GRID)
    assert len(report["held_out"]) == len(GRID)
    grey = report["results"]["round_mean_s"]["greybox"]
    assert grey["all"]["n"] == sum(spec[0] for spec in GRID)
    assert grey["all"]["mape"] <= 6.0
    assert grey["all"]["r2"] > 0.9
    kinds = {h["kind"] for h in report["held_out"]}
    assert kinds == {"interpolation", "extrapolation"}  # the grid's corners lie outside the others' range
    extrapolated = [h for h in report["held_out"] if h["kind"] == "extrapolation"]
    assert any(h["outside_range"] and "n_nodes" in h["outside_range"] for h in extrapolated)
    n_by_kind = sum(grey[k]["n"] for k in ("interpolation", "extrapolation") if k in grey)
    assert n_by_kind == grey["all"]["n"]
    assert report["results"]["bytes_sent_per_round"]["analytic"]["all"]["mape"] < 0.1  # framing 230 B/message
    assert report["results_by_algorithm"]["ring"]["round_mean_s"]["greybox"] == grey["all"]
    points = [p for p in report["predictions"] if p["target"] == "round_mean_s"]
    assert len(points) == grey["all"]["n"]
    by_hand = 100 * np.mean([abs(p["greybox"] - p["measured"]) / p["measured"] for p in points])
    assert by_hand == pytest.approx(grey["all"]["mape"])


def test_predictions_carry_the_fitted_range_and_flag_what_lies_outside(runs, tmp_path):
    doc = model_file.fit(model_file.load_runs(runs))
    write_inputs(str(tmp_path / "big"), 12, 20, 1.0, 1, 64)  # N doubled
    result = model_file.predict_input_dir(doc, str(tmp_path / "big"))
    ring = result["roles"]["ring"]
    assert ring["fitted_range"]["n_nodes"] == [3.0, 8.0]
    assert "n_nodes" in ring["extrapolating"]
    node = result["nodes"][0]
    assert {"feature": "n_nodes", "value": 12.0, "range": [3.0, 8.0]} in node["outside_range"]
    expected = sum(TRUE[c] * model_file.rows_of_setting(from_input_dir(str(tmp_path / "big")))[0].columns()[c]
                   for c in TRUE)
    assert ring["predictions"]["round_mean_s"]["greybox"] == pytest.approx(expected, rel=0.05)

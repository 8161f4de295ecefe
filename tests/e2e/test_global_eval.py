"""Global evaluation at a chosen cost, end to end: a gossip run with ``eval_every`` and
``global_eval_n`` in gl_structure.json, read back from metrics.csv and summary.json."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

NODES = ["n1", "n2", "n3", "n4"]
LINKS = {n: [{"dest": NODES[(i + 1) % 4], "bw": "20mbit"}, {"dest": NODES[(i - 1) % 4], "bw": "20mbit"}]
         for i, n in enumerate(NODES)}
STRUCTURE = {"sync": 5, "wait_s": 1, "eval_every": 2, "global_eval_n": 50, "model": {"hidden": [32], "seed": 3},
             "node_list": [{"name": n, "epoch": 2} for n in NODES]}


def test_every_second_round_on_50_samples_and_the_last_on_the_whole_set(run):
    r = run(structure=STRUCTURE, links=LINKS)
    r.wait_phase("ready")
    assert r.get("/start").json()["phase"] == "running"
    done = r.wait_phase("finished", timeout_s=150)
    assert done["done"] == 4 and done["failed"] == 0, done
    summary = r.get("/finish").json()
    conf = json.loads((r.workdir / "dml_file" / "conf" / "n1_dataset.json").read_text())
    with np.load(r.workdir / conf["global_test"], allow_pickle=False) as g:
        whole = len(g["y"])
    assert whole > 50

    rows = list(csv.DictReader((Path(summary["run_dir"]) / "metrics.csv").open()))
    assert list(rows[0]).index("global_eval_n") == list(rows[0]).index("global_accuracy") + 1
    for node in NODES:
        mine = sorted((row for row in rows if row["node"] == node), key=lambda row: int(row["round"]))
        assert [row["global_eval_n"] for row in mine] == ["0", "50", "0", "50", str(whole)], node
        assert [row["global_accuracy"] == "" for row in mine] == [True, False, True, False, False], node
        assert [row["global_loss"] == "" for row in mine] == [True, False, True, False, False], node
        assert all(row["accuracy"] != "" for row in mine), node  # the local shard: every round
    for node in summary["nodes"]:  # the last round and the final model: the whole set, the same figure
        last = next(row for row in rows if row["node"] == node["node"] and row["round"] == "5")
        assert node["global_accuracy"] == pytest.approx(float(last["global_accuracy"]), abs=1e-6), node
        assert node["final_global_accuracy"] == pytest.approx(node["global_accuracy"], abs=1e-6), node
        assert node["final_global_accuracy"] >= 0.8, node

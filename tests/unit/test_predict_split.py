"""A run whose ring strategy changed mid-run is split by strategy: one configuration each, its
rounds only, its own analytic terms."""
from __future__ import annotations

import csv
import os
import shutil

from controller.predict import model_file

RING4 = os.path.join(os.path.dirname(__file__), "data", "predict", "ring4")


def test_a_run_whose_strategy_changed_is_split_by_strategy(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(RING4, run)
    with open(run / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        fields, rows = reader.fieldnames, list(reader)
    rounds = sorted({int(r["round"]) for r in rows})
    later = rounds[len(rounds) // 2:]
    for r in rows:
        if int(r["round"]) in later:
            r["strategy"] = "binary_tree"
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)
    assert model_file.strategies(str(run)) == ["ring", "binary_tree"]
    split = model_file.rows_of_run(str(run))
    by = {}
    for r in split:
        by.setdefault(r.names["strategy"], []).append(r)
    assert set(by) == {"ring", "binary_tree"} and len({r.config for r in split}) == 2
    assert {r.run_id.split(":")[1] for r in by["binary_tree"]} == {"binary_tree"}
    assert all(r.targets["rounds_done"] == len(later) for r in by["binary_tree"])
    assert all(r.targets["rounds_done"] == len(rounds) - len(later) for r in by["ring"])
    # a binary tree's root sends no partial sum up; every ring member sends (N - 1)/N x 12 P
    assert by["ring"][0].terms.payload_sent_bytes != by["binary_tree"][0].terms.payload_sent_bytes
    whole = model_file.rows_of_run(RING4)
    assert len({r.config for r in whole}) == 1 and len(whole) == len(by["ring"])

"""Time-to-accuracy (controller.results.time_to_accuracy): per node and for the run, null when never."""
from __future__ import annotations

import json

import pytest

from controller.confs.structures import DEFAULT_TARGET_ACCURACY, load_structure_file
from controller.model.topology import load_links
from controller.results.time_to_accuracy import of_run_dir, targets_of, time_to_accuracy
from worker.api.errors import ConfigError


def row(node, k, t, acc, sent=100, recv=50):
    return {"node": node, "round": k, "time_s": t, "global_accuracy": acc, "bytes_sent": sent, "bytes_recv": recv}


ROWS = [row("n1", 1, 1.0, 0.4), row("n1", 2, 2.0, 0.7), row("n1", 3, 3.0, 0.85),
        row("n2", 1, 1.5, 0.5), row("n2", 2, 2.5, 0.75), row("n2", 3, 3.5, 0.78)]


def test_each_node_and_the_run_reach_a_target_at_their_first_round_over_it():
    got = {t["target"]: t for t in time_to_accuracy(ROWS, [0.5, 0.8])}
    half = got[0.5]
    assert half["nodes"]["n1"] == {"time_s": 2.0, "rounds": 2, "bytes_sent": 200, "bytes_recv": 100,
                                   "accuracy": 0.7}
    assert half["nodes"]["n2"]["rounds"] == 1 and half["nodes"]["n2"]["time_s"] == 1.5
    # the run: round 2's mean (0.725) is the first >= 0.5 (round 1's is 0.45); known when n2 ended round 2
    assert half["run"] == {"time_s": 2.5, "rounds": 2, "bytes_sent": 400, "accuracy": 0.725, "nodes": 2}
    eight = got[0.8]
    assert eight["nodes"]["n1"]["rounds"] == 3 and eight["nodes"]["n2"] is None
    assert eight["run"]["rounds"] == 3 and eight["run"]["time_s"] == 3.5 and eight["run"]["bytes_sent"] == 600


def test_never_reached_is_null_and_targets_come_sorted():
    got = time_to_accuracy(ROWS, [0.99, 0.5, 0.99])
    assert [t["target"] for t in got] == [0.5, 0.99]
    assert got[1]["run"] is None and set(got[1]["nodes"].values()) == {None}


def test_rows_from_csv_cells_and_rounds_without_evaluation():
    cells = [{k: ("" if v is None else str(v)) for k, v in r.items()} for r in
             [row("n1", 1, 1.0, None), row("n1", 2, 2.0, 0.9), row("n1", "", 2.5, 0.95)]]
    got = time_to_accuracy(cells, [0.8])[0]
    assert got["nodes"]["n1"] == {"time_s": 2.0, "rounds": 2, "bytes_sent": 200, "bytes_recv": 100, "accuracy": 0.9}
    assert got["run"]["rounds"] == 2
    assert time_to_accuracy([], [0.8]) == [{"target": 0.8, "run": None, "nodes": {}}]


def test_the_run_counts_bytes_of_faster_nodes_sent_by_then():
    rows = [row("a", 1, 1.0, 0.9, sent=10), row("a", 2, 2.0, 0.9, sent=10), row("b", 1, 3.0, 0.9, sent=10)]
    run = time_to_accuracy(rows, [0.8])[0]["run"]
    assert run["time_s"] == 3.0 and run["bytes_sent"] == 30  # a's round 2 ended before b's round 1


def test_targets_of_confs_and_the_default():
    assert targets_of({"n1": {"structure": {"target_accuracy": [0.9, 0.6]}}}) == [0.6, 0.9]
    assert targets_of({"n1": {"target_accuracy": [0.7]}}) == [0.7]
    assert targets_of(None) == list(DEFAULT_TARGET_ACCURACY) == targets_of({"n1": {"structure": {}}})


def _links(tmp_path):
    (tmp_path / "links.json").write_text(json.dumps({"n1": [{"dest": "n2", "bw": "10mbit"}],
                                                     "n2": [{"dest": "n1", "bw": "10mbit"}]}))
    return load_links(str(tmp_path / "links.json"))


@pytest.mark.parametrize("algorithm,doc", [
    ("gossip", {"sync": 2, "node_list": [{"name": "n1"}, {"name": "n2"}]}),
    ("fl", {"node_list": [{"name": "n1", "sync": 2}, {"name": "n2"}]}),
    ("ring", {"sync": 2, "node_list": [{"name": "n1"}, {"name": "n2"}]}),
    ("etree", {"node_list": [{"name": "n1", "layer": 2, "sync": 2, "child_num": 2}, {"name": "n1", "layer": 1},
                             {"name": "n2", "layer": 1}]}),
])
def test_every_algorithm_takes_target_accuracy_with_a_default(tmp_path, algorithm, doc):
    topology = _links(tmp_path)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    confs = load_structure_file(str(path), topology, algorithm)
    assert {tuple(c["target_accuracy"]) for c in confs.values()} == {DEFAULT_TARGET_ACCURACY}
    path.write_text(json.dumps({**doc, "target_accuracy": [0.7, 0.6]}))
    confs = load_structure_file(str(path), topology, algorithm)
    assert {tuple(c["target_accuracy"]) for c in confs.values()} == {(0.6, 0.7)}
    path.write_text(json.dumps({**doc, "target_accuracy": [1.5]}))
    with pytest.raises(ConfigError, match=r"s.json: field 'target_accuracy\[0\]': must be a number in \(0, 1\]"):
        load_structure_file(str(path), topology, algorithm)


def test_of_run_dir_reads_metrics_and_confs(tmp_path):
    (tmp_path / "metrics.csv").write_text("node,round,time_s,global_accuracy,bytes_sent,bytes_recv\n"
                                          "n1,1,1.5,0.65,10,20\nn1,2,3.0,0.91,10,20\n")
    (tmp_path / "confs.json").write_text(json.dumps({"n1": {"structure": {"target_accuracy": [0.6, 0.9]}}}))
    got = of_run_dir(str(tmp_path))
    assert [(t["target"], t["run"]["rounds"]) for t in got] == [(0.6, 1), (0.9, 2)]
    assert of_run_dir(str(tmp_path / "none")) == []

"""Results from structured events only: metrics.csv, traffic.csv, plots and the summary."""
import csv
import json

import pytest

from controller.results import plots, tables
from controller.results.run_dir import read_run_events
from worker.api.errors import ConfigError


def _events(tmp_path, node, rounds, ended="done", role="gossip", glob_acc=True, layer=None, t0=100.0, acc0=0.5):
    (tmp_path / "events").mkdir(parents=True, exist_ok=True)
    lines = [{"type": "started", "t": t0, "role": role}]
    for r in range(1, rounds + 1):
        e = {"type": "round", "run_id": "R", "round": r, "t_end": t0 + r, "loss": 1.0 / r,
             "accuracy": acc0 + r / 10, "bytes_sent": 10, "bytes_recv": 5, "train_s": 0.1, "send_s": 0.2,
             "train_loss": 2.0 / r, "sent_to": {"b": 10}, "recv_from": {"c": 5},
             "global_accuracy": (acc0 + r / 20) if glob_acc else None, "global_loss": (1.5 / r) if glob_acc else None}
        if layer is not None:
            e["layer"] = layer(r) if callable(layer) else layer
        lines.append(e)
    if ended == "done":
        lines.append({"type": "done", "run_id": "R", "bytes_sent": 7, "bytes_recv": 0, "sent_to": {"b": 7},
                      "recv_from": {}})
    elif ended == "failed":
        lines.append({"type": "failed", "detail": "RingAborted: no chunk"})
    (tmp_path / "events" / f"{node}.jsonl").write_text("\n".join(json.dumps(e) for e in lines) + "\n{torn")


def test_build_writes_metrics_traffic_plots_and_summary(tmp_path):
    _events(tmp_path, "a", 3)
    _events(tmp_path, "b", 2, ended="failed")
    built = tables.build(str(tmp_path), 100.0, "gossip", {"a": "done"},
                          final={"a": {"global_accuracy": 0.91, "global_loss": 0.3, "model": "m/a.safetensors"}})
    rows = list(csv.DictReader(open(built["metrics"])))
    assert list(rows[0]) == tables.METRIC_COLUMNS
    assert [(r["node"], r["round"], r["time_s"]) for r in rows] == [
        ("a", "1", "1.0"), ("a", "2", "2.0"), ("a", "3", "3.0"), ("b", "1", "1.0"), ("b", "2", "2.0")]
    assert {r["algorithm"] for r in rows} == {"gossip"} and {r["role"] for r in rows} == {"gossip"}
    assert rows[2]["global_accuracy"] == "0.65" and rows[2]["accuracy"] == "0.8" and rows[0]["layer"] == ""
    assert len(built["plots"]) == 4 and all((tmp_path / p).exists() for p in built["plots"])
    assert built["plot_mode"] == "lines"
    by_node = {n["node"]: n for n in built["nodes"]}
    a, b = by_node["a"], by_node["b"]
    assert a["rounds"] == 3 and a["accuracy"] == 0.8 and a["global_accuracy"] == 0.65 and a["ended"] == "done"
    assert a["final_global_accuracy"] == 0.91 and a["model"] == "m/a.safetensors" and a["role"] == "gossip"
    assert b["ended"] == "failed: RingAborted: no chunk" and b["final_global_accuracy"] is None  # by its events
    assert a["sent_to"] == ["b"] and a["bytes_sent"] == 3 * 10 + 7
    assert built["accuracy"]["final_global_accuracy"] == {"mean": 0.91, "median": 0.91, "min": 0.91, "nodes": 1}
    table = tables.format_summary(built["nodes"])
    assert "global acc" in table and "0.650" in table and "0.910" in table and "failed: RingAborted" in table


def test_metrics_rows_are_exactly_the_round_events(tmp_path):
    _events(tmp_path, "a", 12, ended="none")
    built = tables.build(str(tmp_path), 100.0, "gossip", {"a": "stopped", "ghost": "lost"})
    rows = list(csv.DictReader(open(built["metrics"])))
    events = [json.loads(line) for line in (tmp_path / "events" / "a.jsonl").read_text().splitlines()[:-1]]
    assert [int(r["round"]) for r in rows] == [e["round"] for e in events if e["type"] == "round"]
    by_node = {n["node"]: n for n in built["nodes"]}
    assert by_node["a"]["rounds"] == 12 and by_node["a"]["ended"] == "stopped"
    assert by_node["ghost"] == {**by_node["ghost"], "rounds": 0, "ended": "lost", "accuracy": None}


def test_traffic_csv_is_flat_per_peer(tmp_path):
    _events(tmp_path, "a", 2)
    built = tables.build(str(tmp_path), 100.0, "gossip", {})
    rows = list(csv.DictReader(open(built["traffic"])))
    assert list(rows[0]) == ["run_id", "node", "round", "peer", "direction", "bytes"]
    assert [(r["round"], r["peer"], r["direction"], r["bytes"]) for r in rows] == [
        ("1", "b", "sent", "10"), ("1", "c", "recv", "5"), ("2", "b", "sent", "10"), ("2", "c", "recv", "5"),
        ("", "b", "sent", "7")]  # after the last round (the done event)
    assert sum(int(r["bytes"]) for r in rows if r["direction"] == "sent") == built["nodes"][0]["bytes_sent"]


def test_missing_global_set_leaves_empty_cells_and_local_plots(tmp_path):
    _events(tmp_path, "a", 2, glob_acc=False)
    built = tables.build(str(tmp_path), 100.0, "gossip", {"a": "done"})
    rows = list(csv.DictReader(open(built["metrics"])))
    assert rows[0]["global_accuracy"] == "" and rows[0]["global_loss"] == ""
    assert built["nodes"][0]["global_accuracy"] is None and "-" in tables.format_summary(built["nodes"])


@pytest.mark.parametrize("n_nodes,mode", [(8, "lines"), (20, "lines"), (21, "aggregate"), (50, "aggregate")])
def test_plots_choose_aggregate_above_20_nodes(tmp_path, n_nodes, mode):
    for i in range(n_nodes):
        _events(tmp_path, f"n{i}", 5, t0=100.0 + i / 10, acc0=0.3 + i / 200)
    built = tables.build(str(tmp_path), 100.0, "gossip", {})
    assert built["plot_mode"] == mode
    names = sorted(p.split("/")[-1] for p in built["plots"])
    assert names == ["accuracy_vs_round.png", "accuracy_vs_time.png", "loss_vs_round.png", "loss_vs_time.png"]
    for p in built["plots"]:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_aggregate_median_quartiles_min_max():
    agg = plots.aggregate({"a": [(1, 0.1), (2, 0.5)], "b": [(1, 0.2)], "c": [(1, 0.3)], "d": [(1, 0.4)]})
    assert agg[0] == pytest.approx({"x": 1, "median": 0.25, "q1": 0.175, "q3": 0.325, "min": 0.1, "max": 0.4, "n": 4})
    assert agg[1] == {"x": 2, "median": 0.5, "q1": 0.5, "q3": 0.5, "min": 0.5, "max": 0.5, "n": 1}


def test_ring_and_etree_plots(tmp_path):
    ring = tmp_path / "ring"
    for i in range(4):
        _events(ring, f"r{i}", 3, role="ring")
    built = tables.build(str(ring), 100.0, "ra", {})
    assert len(built["plots"]) == 4 and all(open(p, "rb").read(4) == b"\x89PNG" for p in built["plots"])
    assert plots._shared_curve(tables.metric_rows(read_run_events(str(ring)), 100.0), "round",
                                 "global_accuracy") == [(1, 0.55), (2, 0.6), (3, 0.65)]
    etree = tmp_path / "etree"
    _events(etree, "root", 2, role="etree", layer=3)
    _events(etree, "mid", 6, role="etree", layer=lambda r: 1 if r % 2 else 2)
    _events(etree, "leaf", 4, role="etree", layer=1)
    built = tables.build(str(etree), 100.0, "el", {})
    rows = list(csv.DictReader(open(built["metrics"])))
    assert {r["layer"] for r in rows} == {"1", "2", "3"}
    mid = next(n for n in built["nodes"] if n["node"] == "mid")
    assert mid["rounds_by_layer"] == {"1": 3, "2": 3}
    ranked = plots._layer_rounds(tables.metric_rows(read_run_events(str(etree)), 100.0))
    assert [r["layer_round"] for r in ranked if r["node"] == "mid"] == [1, 1, 2, 2, 3, 3]
    assert all((etree / name).exists() for name in ("accuracy_vs_round.png", "loss_vs_time.png"))


def test_files_are_written_atomically(tmp_path):
    _events(tmp_path, "a", 2)
    tables.build(str(tmp_path), 100.0, "gossip", {})
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]


def test_a_planted_link_is_not_followed(tmp_path):
    _events(tmp_path, "a", 2)
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    import os

    os.symlink(outside, tmp_path / "metrics.csv")  # planted where the results go
    os.symlink(outside, tmp_path / "accuracy_vs_round.png")
    tables.build(str(tmp_path), 100.0, "gossip", {})
    assert outside.read_text() == "keep" and not (tmp_path / "metrics.csv").is_symlink()
    assert (tmp_path / "metrics.csv").read_text().startswith("run_id,algorithm,node")


def test_a_callers_writer_gets_every_file(tmp_path):
    _events(tmp_path, "a", 2)
    got = {}
    built = tables.build(str(tmp_path), 100.0, "gossip", {}, write=lambda rel, data: got.__setitem__(rel, data))
    assert sorted(got) == ["accuracy_vs_round.png", "accuracy_vs_time.png", "loss_vs_round.png", "loss_vs_time.png",
                           "metrics.csv", "traffic.csv"]
    assert got["metrics.csv"].startswith(b"run_id,algorithm,node,role,layer,round")
    assert not (tmp_path / "metrics.csv").exists() and built["metrics"] == str(tmp_path / "metrics.csv")


def test_local_writer_stays_in_the_run_dir(tmp_path):
    import os

    write = tables.local_writer(str(tmp_path))
    assert write("models/x.bin", b"1") == str(tmp_path / "models" / "x.bin")
    for bad in ("../x", "/etc/x", "models/../../x", "a//b"):
        with pytest.raises(ConfigError, match="plain path"):
            write(bad, b"")
    os.symlink(tmp_path / "models", tmp_path / "linked")
    with pytest.raises(ConfigError, match="link"):
        write("linked/y.bin", b"")


def test_algorithm_of_roles():
    assert tables.algorithm_of(["fl_aggregator", "fl_trainer"]) == "fl"
    assert tables.algorithm_of(["gossip"] * 3) == "gossip" and tables.algorithm_of(["ring", "etree"]) == "etree+ring"


def test_malformed_node_events_do_not_stop_the_results(tmp_path):
    """Events are a node's words: a round without a time, a byte count or layer of the wrong
    type must not keep the run's files from being written (25 nodes: the aggregate plots)."""
    for i in range(25):
        _events(tmp_path, f"n{i}", 3)
    path = tmp_path / "events" / "n0.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()[:-1]]
    del lines[2]["t_end"]
    lines[3].update(bytes_sent="many", layer=[1])
    path.write_text("\n".join(json.dumps(e) for e in lines) + "\n")
    built = tables.build(str(tmp_path), 100.0, "gossip", {})
    n0 = next(n for n in built["nodes"] if n["node"] == "n0")
    assert n0["rounds"] == 3 and n0["bytes_sent"] == 10 + 10 + 7 and "rounds_by_layer" not in n0
    assert len(built["plots"]) == 4


def test_a_line_of_deep_brackets_is_skipped_and_an_unreadable_file_is_that_nodes_problem(tmp_path):
    """A node's line of 5,000 ``[`` used to raise RecursionError and stop every result; a node's
    events that cannot be read at all are its problem, and the others' files are written."""
    _events(tmp_path, "a", 3)
    _events(tmp_path, "b", 2)
    with open(tmp_path / "events" / "a.jsonl", "a") as f:
        f.write("\n" + "[" * 5000 + "\n" + '{"type": "x", "deep": ' + "[" * 5000 + "]" * 5000 + "}\n")
    (tmp_path / "events" / "c.jsonl").mkdir()  # unreadable: a directory
    problems: dict = {}
    built = tables.build(str(tmp_path), 100.0, "gossip", {}, problems=problems)
    nodes = {n["node"]: n for n in built["nodes"]}
    assert nodes["a"]["rounds"] == 3 and nodes["b"]["rounds"] == 2 and nodes["c"]["rounds"] == 0
    assert "events/c.jsonl" in problems["c"][0] and nodes["c"]["problems"] == problems["c"]
    assert set(problems) == {"c"}
    assert len(list(csv.DictReader(open(built["metrics"])))) == 5 and len(built["plots"]) == 4


def test_the_bands_over_nodes_are_named_for_what_they_span():
    import numpy as np

    from controller.results.bands import median_10_90, quartiles, quartiles_by_column

    values = [0.1, 0.2, 0.3, 0.4, 0.9]
    q = quartiles(values)
    by_column = quartiles_by_column(np.array([[v] for v in values]))[:, 0]
    assert [q["min"], q["q1"], q["median"], q["q3"], q["max"]] == pytest.approx(list(by_column))  # one definition
    assert quartiles([0.7]) == {"median": 0.7, "q1": 0.7, "q3": 0.7, "min": 0.7, "max": 0.7, "n": 1}
    assert median_10_90(list(range(11))) == (5.0, 1.0, 9.0) and median_10_90([]) == (None, None, None)

"""Metrics rows and the summary come from structured events only."""
import csv
import json

from controller import results


def _events(tmp_path, node, rounds, ended="done"):
    (tmp_path / "events").mkdir(exist_ok=True)
    lines = [{"type": "started", "t": 100.0}]
    for r in range(1, rounds + 1):
        lines.append({"type": "round", "run_id": "R", "round": r, "t_end": 100.0 + r, "loss": 1.0 / r,
                      "accuracy": 0.5 + r / 10, "bytes_sent": 10, "bytes_recv": 5, "train_s": 0.1, "send_s": 0.2,
                      "sent_to": {"b": 10}, "recv_from": {"c": 5}})
    lines.append({"type": ended})
    (tmp_path / "events" / f"{node}.jsonl").write_text("\n".join(json.dumps(e) for e in lines) + "\n{torn")


def test_build_writes_metrics_plots_and_summary(tmp_path):
    _events(tmp_path, "a", 3)
    _events(tmp_path, "b", 2, ended="failed")
    built = results.build(str(tmp_path), t0=100.0)
    rows = list(csv.DictReader(open(built["metrics"])))
    assert [(r["node"], r["round"], r["time_s"]) for r in rows] == [("a", "1", "1.0"), ("a", "2", "2.0"),
                                                                    ("a", "3", "3.0"), ("b", "1", "1.0"), ("b", "2", "2.0")]
    assert len(built["plots"]) == 4 and all((tmp_path / p).exists() for p in built["plots"])
    by_node = {n["node"]: n for n in built["nodes"]}
    assert by_node["a"]["rounds"] == 3 and by_node["a"]["accuracy"] == 0.8 and by_node["a"]["ended"] == "done"
    assert by_node["b"]["ended"] == "failed" and by_node["a"]["sent_to"] == ["b"] and by_node["a"]["bytes_sent"] == 30
    table = results.format_summary(built["nodes"])
    assert "a" in table and "0.800" in table and "failed" in table

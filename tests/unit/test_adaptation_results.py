"""Adaptation in a run's results: the monitor columns of metrics.csv, the /metrics gauges, the
policies' decisions and strategy changes in the timeline and scenario_effects.csv, and the
traffic matrix of star-shaped rounds."""
from __future__ import annotations

import csv
import json

import pytest

from controller.model.topology import load_links
from controller.results import adaptation, tables
from controller.results.analysis import AnalysisConfig, analyze
from controller.results.finish import RunResults, full_timeline
from controller.results.run_dir import RunDir
from controller.run.experiment import Experiment
from controller.run.nodes import Nodes
from controller.telemetry.export import prometheus_text
from controller.web import run_view
from controller.web.live import LiveFeed
from tests.unit.test_analysis import make_run

T0 = 100.0
DECISION = {"type": "policy_decision", "round": 5, "policy": "0:adaptive_strategy",
            "inputs": {"comm_goodput_bps": 4e6, "reference_bps": 8e6}, "votes": {"n1": True, "n2": True},
            "action": {"strategy": "star:n3", "reason": "goodput 0.5 of the reference"}}
CHANGED = {"type": "strategy_changed", "round": 6, "strategy": "star:n3", "previous": "star:n1",
           "reason": "0:adaptive_strategy", "digest": "ab12"}


def _write(run_dir, node, events):
    (run_dir / "events").mkdir(parents=True, exist_ok=True)
    lines = [{"v": 1, "run_id": "R", "node": node, **e} for e in events]
    (run_dir / "events" / f"{node}.jsonl").write_text("\n".join(json.dumps(e) for e in lines) + "\n")


def _rounds(n, **monitors):
    """Rounds 1..n, round r ending at T0 + r (one a second)."""
    return [{"type": "round", "round": r, "t": T0 + r, "t_end": T0 + r, "loss": 1.0, "accuracy": 0.5,
             "bytes_sent": 10, "bytes_recv": 10, **monitors} for r in range(1, n + 1)]


def _adaptive_run(tmp_path):
    """Two ring members doing a round a second for 20 s; both decide at 5 s to switch to
    star:n3, n1 writes the change at 6.5 s."""
    monitors = {"comm_goodput_bps": 8_000_000.5, "strategy": "star:n1", "cluster_size": 2, "batch_size": 32,
                "gns": 12.25, "grad_var": None}
    _write(tmp_path, "n1", [{"type": "started", "t": T0, "role": "ring"}, *_rounds(20, **monitors),
                            {**DECISION, "t": T0 + 5.0}, {**CHANGED, "t": T0 + 6.5}])
    _write(tmp_path, "n2", [{"type": "started", "t": T0, "role": "ring"},
                            *_rounds(20, cluster_size=True, gns="12", strategy=7),  # malformed: left empty
                            {**DECISION, "t": T0 + 5.0}])


# metrics.csv ---------------------------------------------------------------------------------
def test_metrics_csv_has_the_monitor_columns(tmp_path):
    _adaptive_run(tmp_path)
    built = tables.build(str(tmp_path), T0, "ring", {})
    rows = list(csv.DictReader(open(built["metrics"])))
    assert list(rows[0])[-6:] == ["comm_goodput_bps", "strategy", "cluster_size", "batch_size", "gns", "grad_var"]
    n1 = rows[0]
    assert (n1["node"], n1["round"]) == ("n1", "1")
    assert [n1[k] for k in adaptation.MONITOR_FIELDS] == ["8000000.5", "star:n1", "2", "32", "12.25", ""]
    n2 = rows[20]
    assert n2["node"] == "n2" and [n2[k] for k in adaptation.MONITOR_FIELDS] == ["", "", "", "", "", ""]


def test_monitor_fields_keep_only_what_is_well_formed():
    got = adaptation.monitor_fields({"comm_goodput_bps": float("nan"), "strategy": "star:\x1b[31mn1",
                                     "cluster_size": -1, "batch_size": 64, "gns": 3, "grad_var": 0.5})
    assert got == {"comm_goodput_bps": None, "strategy": "star:[31mn1", "cluster_size": None, "batch_size": 64,
                   "gns": 3, "grad_var": 0.5}
    assert adaptation.monitor_fields({}) == dict.fromkeys(adaptation.MONITOR_FIELDS)


# /metrics ------------------------------------------------------------------------------------
def test_metrics_endpoint_shows_the_monitors_and_the_strategy():
    from prometheus_client.parser import text_string_to_metric_families

    nodes = [{"name": "a", "round": 3, "accuracy": 0.5, "loss": 1.0, "bytes_sent": 10,
              "comm_goodput_bps": 8_000_000.0, "strategy": "star:a", "cluster_size": 4, "batch_size": 32,
              "gns": 12.25, "grad_var": None},
             {"name": "b", "round": 3, "bytes_sent": 0, "batch_size": 64, "gns": "x", "strategy": ""},
             {"name": "c", "round": 2}]
    text = prometheus_text("r1", nodes, None).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def values(name):
        return {s.labels["node"]: s.value for s in families[name].samples}

    assert values("edgetb_node_comm_goodput_bps") == {"a": 8_000_000.0}
    assert values("edgetb_node_cluster_size") == {"a": 4.0}
    assert values("edgetb_node_batch_size") == {"a": 32.0, "b": 64.0}
    assert values("edgetb_node_gns") == {"a": 12.25}  # b's is not a number
    assert values("edgetb_node_grad_var") == {}
    assert [(s.labels, s.value) for s in families["edgetb_node_strategy"].samples] == [
        ({"run": "r1", "node": "a", "strategy": "star:a"}, 1.0)]
    assert values("edgetb_node_round") == {"a": 3.0, "b": 3.0, "c": 2.0}  # unchanged


# scenario_effects.csv ------------------------------------------------------------------------
def test_decisions_and_changes_are_effect_rows(tmp_path):
    _adaptive_run(tmp_path)
    built = tables.build(str(tmp_path), T0, "ring", {})
    assert built["scenario"]["events"] == 0 and built["scenario"]["adaptation_events"] == 3
    rows = list(csv.DictReader(open(tmp_path / "scenario_effects.csv")))
    assert list(rows[0]) == tables.SCENARIO_EFFECT_COLUMNS
    assert [(r["applied_s"], r["event"], r["target"], r["round"], r["policy"]) for r in rows] == [
        ("5.0", "policy_decision", "n1", "5", "0:adaptive_strategy"),
        ("5.0", "policy_decision", "n2", "5", "0:adaptive_strategy"),
        ("6.5", "strategy_changed", "n1", "6", "")]
    first, change = rows[0], rows[2]
    assert json.loads(first["action"]) == {"strategy": "star:n3", "reason": "goodput 0.5 of the reference"}
    assert json.loads(change["action"]) == {"strategy": "star:n3", "previous": "star:n1",
                                            "reason": "0:adaptive_strategy"}
    # before 5 s: rounds at 1..4 s per node, 4 / 5 s = 48 a minute; after, to the end (20 s): 5..19 s, 15 / 15 s
    assert (first["rounds_per_min_before"], first["rounds_per_min_after"]) == ("48.0", "60.0")
    # 6.5 s: 6 rounds in 6.5 s (55.385 a minute), then 7..19 s: 13 in 13.5 s (57.778)
    assert (change["rounds_per_min_before"], change["rounds_per_min_after"]) == ("55.385", "57.778")
    assert first["planned_s"] == "" and first["recovery_s"] == ""


def test_scenario_and_adaptation_rows_in_time_order(tmp_path):
    _adaptive_run(tmp_path)
    (tmp_path / "scenario.csv").write_text("planned_s,applied_s,skew_ms,event,target,detail,outcome\n"
                                           "4,4.001,1,background,n1,iperf3,applied\n"
                                           "9,9.0,0,bw,n1->n2,1mbit,applied\n")
    built = tables.build(str(tmp_path), T0, "ring", {})
    rows = list(csv.DictReader(open(tmp_path / "scenario_effects.csv")))
    assert [(r["event"], r["target"]) for r in rows] == [
        ("background", "n1"), ("policy_decision", "n1"), ("policy_decision", "n2"), ("strategy_changed", "n1"),
        ("bw", "n1->n2")]
    assert rows[0]["round"] == rows[0]["policy"] == rows[0]["action"] == "" and rows[0]["planned_s"] == "4.0"
    assert built["scenario"]["events"] == 2


# timeline --------------------------------------------------------------------------------------
def test_describe_a_decision_and_a_change():
    decision = {"t_s": 5.0, "node": "n1", "type": "policy_decision", "round": 5, "policy": "0:adaptive_batch",
                "action": {"batch_size": 64}}
    assert adaptation.describe(decision) == "round 5, 0:adaptive_batch: batch_size 64"
    change = {"t_s": 6.5, "node": "n1", "type": "strategy_changed", "round": 6, "policy": None,
              "action": {"strategy": "ring", "previous": "star:n1", "reason": "recovered"}}
    assert adaptation.timeline_entry(change) == (6.5, "strategy_changed", "n1", "round 6: star:n1 -> ring (recovered)")


def test_the_written_timeline_has_the_nodes_adaptation_events(tmp_path):
    _adaptive_run(tmp_path)
    live = [{"seq": 1, "t_s": 4.001, "kind": "background", "target": "n1", "detail": "iperf3"},
            {"seq": 2, "t_s": 21.0, "kind": "done", "target": "n1", "detail": ""}]
    run = RunResults(RunDir(str(tmp_path)), str(tmp_path), str(tmp_path), "R", "ring", {}, "completed", {},
                     t_start=T0, timeline=live)
    got = full_timeline(run)
    assert [(e["seq"], e["t_s"], e["kind"], e["target"]) for e in got] == [
        (1, 4.001, "background", "n1"), (2, 5.0, "policy_decision", "n1"), (3, 5.0, "policy_decision", "n2"),
        (4, 6.5, "strategy_changed", "n1"), (5, 21.0, "done", "n1")]
    assert got[1]["detail"] == "round 5, 0:adaptive_strategy: strategy star:n3 (goodput 0.5 of the reference)"
    assert got[3]["detail"] == "round 6: star:n1 -> star:n3 (0:adaptive_strategy)"
    assert full_timeline(RunResults(**{**run.__dict__, "timeline": got})) == got  # not added twice


def test_the_stored_view_rebuilds_them_without_timeline_json(tmp_path):
    run = make_run(tmp_path, telemetry=False, captures=False)
    t0 = json.loads((run / "run.json").read_text())["started_at"]
    with open(run / "events" / "a.jsonl", "a") as f:
        f.write(json.dumps({**CHANGED, "node": "a", "t": t0 + 7.25}) + "\n")
    timeline = run_view.stored_view(str(run))["timeline"]
    assert [(e["t_s"], e["kind"], e["target"], e["detail"]) for e in timeline] == [
        (7.25, "strategy_changed", "a", "round 6: star:n1 -> star:n3 (0:adaptive_strategy)")]


def test_the_run_s_timeline_takes_a_decision_as_it_comes(tmp_path):
    (tmp_path / "links.json").write_text(json.dumps({"a": [{"dest": "b", "bw": "8mbit"}],
                                                     "b": [{"dest": "a", "bw": "8mbit"}]}))
    structure = {"a": {"sync": 3, "role": "ring"}, "b": {"sync": 3, "role": "ring"}}
    exp = Experiment(load_links(str(tmp_path / "links.json")), Nodes(str(tmp_path), None, structure), structure,
                     progress=lambda line: None)
    exp.t_start = 1000.0
    feed = exp.live = LiveFeed(exp)
    exp.on_print("a", {"decisions": [{**DECISION, "t": 1003.5}]})  # with a node's progress report
    assert exp.timeline.node_event("a", {"type": "round", "t": 1004.0}) is False
    entry = exp.timeline.entries()[-1]
    assert feed.view()["timeline"] == exp.timeline.entries()  # what the dashboard shows
    assert (entry["t_s"], entry["kind"], entry["target"]) == (3.5, "policy_decision", "a")
    assert entry["detail"].startswith("round 5, 0:adaptive_strategy: strategy star:n3")


# traffic matrix ----------------------------------------------------------------------------------
def _star_round(root, members, r, bytes_=1000):
    """Each member's round event of a star all-reduce round ``r`` around ``root``."""
    out = {}
    for m in members:
        peers = [p for p in members if p != root] if m == root else [root]
        out[m] = {"type": "round", "round": r, "t": T0 + r, "t_end": T0 + r, "strategy": f"star:{root}",
                  "sent_to": {p: bytes_ for p in peers}, "recv_from": {p: bytes_ for p in peers},
                  "bytes_sent": bytes_ * len(peers), "bytes_recv": bytes_ * len(peers)}
    return out


@pytest.mark.parametrize("switch_at", [None, 3])
def test_the_traffic_matrix_shows_the_star_s_root(tmp_path, switch_at):
    members = ["n1", "n2", "n3", "n4"]
    run = tmp_path / "run"
    events = {m: [{"type": "started", "t": T0, "role": "ring"}] for m in members}
    for r in range(1, 7):  # star:n1, from round ``switch_at`` star:n3
        root = "n3" if switch_at is not None and r >= switch_at else "n1"
        for m, e in _star_round(root, members, r).items():
            events[m].append(e)
    for m, ev in events.items():
        _write(run, m, ev)
    (run / "run.json").write_text(json.dumps({"run_id": "R", "started_at": T0}))
    (run / "topology.json").write_text(json.dumps({"nodes": [{"name": m, "ip": f"10.9.0.{i + 2}"}
                                                             for i, m in enumerate(members)], "links": []}))
    tables.build(str(run), T0, "ring", {})
    summary = analyze(str(run), AnalysisConfig(plots=False))
    assert summary["traffic_matrix_source"].startswith("nodes' counts")
    with open(run / "analysis" / "traffic_matrix.csv", newline="") as f:
        matrix = {r.pop("src"): {d: int(v) for d, v in r.items()} for r in csv.DictReader(f)}
    sent = {m: sum(row.values()) for m, row in matrix.items()}
    recv = {m: sum(matrix[s][m] for s in members) for m in members}
    if switch_at is None:  # six rounds: the root sends 3 x 1000 a round, a leaf 1000
        assert sent == recv == {"n1": 18_000, "n2": 6_000, "n3": 6_000, "n4": 6_000}
        assert matrix["n2"] == {"n1": 6_000, "n2": 0, "n3": 0, "n4": 0}  # a leaf talks to the root only
    else:  # rounds 1-2 around n1, 3-6 around n3: n3 roots 4 rounds (12,000) and is a leaf in 2 (2,000)
        assert sent == recv == {"n1": 10_000, "n2": 6_000, "n3": 14_000, "n4": 6_000}
        assert matrix["n1"] == {"n1": 0, "n2": 2_000, "n3": 6_000, "n4": 2_000}
    top = max(sent, key=sent.get)
    assert top == ("n1" if switch_at is None else "n3") and max(recv, key=recv.get) == top

"""A whole FL run with every node captured: the round events carry phase timestamps, and the
analysis at its end computes Driple's 12 burst metrics from them and the captures
(analysis/timed_bursts.csv), which prediction reads as its burst targets."""
from __future__ import annotations

import csv
import json
import os
import shutil

import pytest

from controller.predict.targets import read_bursts
from dml_app.runtime.events import read_events
from tests.e2e.harness import Run
from tests.e2e.test_capture_runs import finished_run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)"),
              pytest.mark.skipif(shutil.which("tcpdump") is None, reason="tcpdump not installed")]
MODEL = {"kind": "numpy", "hidden": [256], "learning_rate": 0.005, "seed": 0}  # 19,210 parameters: 77 kB a model


def test_fl_run_records_phases_and_its_analysis_gives_the_twelve_burst_metrics(tmp_path):
    trainers = ["t1", "t2"]
    links = {"agg": [{"dest": t, "bw": "5mbit"} for t in trainers], **{t: [{"dest": "agg", "bw": "5mbit"}]
                                                                         for t in trainers}}
    structure = {"model": MODEL, "node_list": [{"name": "agg", "sync": 4, "trainer_fraction": 1.0, "deadline_s": 60,
                                                "quorum": 1.0}] + [{"name": t, "epoch": 1} for t in trainers]}
    r = Run(tmp_path, kind="fl", structure=structure, links=links, extra_args=("--capture", "all"))
    try:
        summary, run_dir = finished_run(r)
        assert "error" not in summary["analysis"], summary["analysis"]
        events = {p.stem: read_events(str(p)) for p in (run_dir / "events").glob("*.jsonl")}
        assert set(events) >= {"agg", *trainers}, sorted(events)
        for node, es in events.items():
            rounds = [e for e in es if e["type"] == "round"]
            assert rounds and all(set(e["phases"]) == {"train", "evaluate", "send", "wait"} for e in rounds), node
            if node in trainers:  # a trainer trains, evaluates and sends its update every round
                assert all(e["phases"]["train"] and e["phases"]["send"] for e in rounds), node
        with open(run_dir / "analysis" / "timed_bursts.csv", newline="") as f:
            rows = {(row["node"], row["resource"]): row for row in csv.DictReader(f)}
        for t in trainers:
            cpu, tx, rx = rows[(t, "cpu")], rows[(t, "net_tx")], rows[(t, "net_rx")]
            # a compute burst's length is the CPU time the node's process spent in it (its clock at the phases' edges)
            assert cpu["source"] == "phases+clock" and int(cpu["bursts"]) >= 3 and float(cpu["burst_s"]) > 0
            assert float(cpu["burst_wall_s"]) > 0 and float(cpu["idle_s"]) > 0
            assert 0 < float(cpu["burst_consumption"]) <= 200  # percent of a core (two threads at most)
            assert all(len(s) == 4 and s[2] <= s[3] for e in events[t] if e["type"] == "round"
                       for s in e["phases"]["train"])
            assert float(rows[(t, "mem")]["burst_consumption"]) > 1e6  # resident bytes of a Python process
            # one update up and one model down a round (77 kB at 5 Mbit/s: about 0.12 s each)
            assert tx["source"] == "capture" and 3 <= int(tx["bursts"]) <= 6, tx
            assert 3 <= int(rx["bursts"]) <= 6 and 0.05 < float(rx["burst_s"]) < 1.0, rx
            assert 1e6 < float(tx["burst_consumption"]) <= 5.5e6, tx  # at most the link's rate
        assert {k[1] for k in rows if k[0] == "*"} == {"cpu", "mem", "net_tx", "net_rx"}
        doc = json.loads((run_dir / "analysis" / "summary.json").read_text())
        assert "gaps < 0.1 s" in doc["timed_bursts"]["definition"]
        targets = read_bursts(str(run_dir))
        assert all(targets["t1"].get(f"{res}_burst_s") for res in ("cpu", "mem", "net_tx", "net_rx"))
    finally:
        r.close()

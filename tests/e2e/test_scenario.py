"""A run script with --scenario: a link event and a crash applied mid-run, recorded in
scenario.csv, the run completing with the rest; a bad scenario refused before anything starts."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.results.analysis.table import open_text
from tests.e2e.harness import ROOT, Run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]


def gossip(rounds: int) -> dict:
    structure = json.loads((ROOT / "gl_structure.json").read_text())
    structure.update(sync=rounds, wait_s=1)
    return structure


def test_link_event_and_crash_applied_and_recorded(run):
    r: Run = run(structure=gossip(30), defer=True)
    (r.workdir / "scenario.json").write_text(json.dumps({"seed": 1, "events": [
        {"at": 0.2, "link": {"src": "n1", "dst": "n2", "bw": "2mbit", "both_ways": True}},
        {"at_round": {"node": "n1", "round": 12}, "crash": "n5"}]}))  # n1 has reached round 8 at 0.8 s
    r.start("--scenario", "scenario.json")
    r.wait_phase("ready", timeout_s=120)
    assert r.get("/start").ok
    status = r.wait_phase("finished", timeout_s=240)
    run_dir = Path(status["run_dir"])
    rows = list(csv.DictReader((run_dir / "scenario.csv").open()))
    assert [row["event"] for row in rows] == ["link", "crash"], rows
    link, crash = rows
    assert link["target"] == "n1<->n2" and link["outcome"] == "applied" and float(link["planned_s"]) == 0.2
    assert abs(float(link["skew_ms"])) < 1000  # a loaded start; bench_scenario measures skew
    assert crash["target"] == "n5" and crash["outcome"] == "applied"
    assert float(crash["applied_s"]) > float(link["applied_s"])
    nodes = {n["name"]: n for n in status["nodes"]}
    assert nodes["n5"]["ending"] != "done"  # killed mid-run
    assert sum(n["ending"] == "done" for n in nodes.values()) >= 5, nodes  # the rest went on
    assert nodes["n5"]["round"] < 30
    assert (run_dir / "inputs" / "scenario.json").exists()
    effects = list(csv.DictReader((run_dir / "scenario_effects.csv").open()))
    assert [e["event"] for e in effects] == ["link", "crash"]
    rates = [(float(row["time_s"]), row["rate_bps"])
             for row in csv.DictReader(open_text(str(run_dir / "telemetry" / "rates.csv.gz")))
             if (row["src"], row["dst"]) == ("n1", "n2")]
    assert len(rates) == 2 and rates[1][1] == "2000000" and rates[0][1] != "2000000", rates
    assert rates[1][0] >= float(link["applied_s"]) - 0.5  # sampled at the change (times of one clock)
    analysed = {(row["src"], row["dst"]): row for row in csv.DictReader((run_dir / "analysis" / "links.csv").open())}
    assert float(analysed[("n1", "n2")]["rate_bps"]) < float(analysed[("n2", "n3")]["rate_bps"])  # 2 against 20 Mbit/s


def test_bad_scenario_refused_before_anything_starts(tmp_path):
    r = Run(tmp_path, structure=gossip(3), defer=True)
    (r.workdir / "scenario.json").write_text(json.dumps({"events": [{"at": 1, "crash": "n42"}]}))
    done = subprocess.run([sys.executable, str(ROOT / "gl_run.py"), "--workdir", str(r.workdir), "--id", r.id,
                           "--subnet", r.subnet, "--port", str(r.port), "--scenario", "scenario.json"],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, EDGETB_STATE_DIR=str(r.state)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "scenario.json: events[0]" in done.stderr and "unknown node 'n42'" in done.stderr, done.stderr
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"etb-{r.id}-" not in left


def test_auto_run_whose_revoked_trainer_is_replaced_exits_0(run):
    """--auto: trainer t3 revoked at 3 s and replaced 2 s later, its second life finishing, is
    no failure of the run: the script exits 0 and run.json says how each life ended."""
    trainers = [f"t{i}" for i in range(1, 5)]
    structure = {"model": {"kind": "numpy", "hidden": [64], "learning_rate": 0.005, "seed": 0}, "node_list": [
        {"name": "agg", "sync": 40, "trainer_fraction": 1.0, "deadline_s": 8, "quorum": 0.5}]
        + [{"name": t, "epoch": 2} for t in trainers]}
    links = {"agg": [{"dest": t, "bw": "1mbit"} for t in trainers],
             **{t: [{"dest": "agg", "bw": "1mbit"}] for t in trainers}}
    r: Run = run(kind="fl", structure=structure, links=links, defer=True)
    (r.workdir / "scenario.json").write_text(json.dumps({"seed": 1, "events": [
        {"at": 0, "revocation": {"nodes": ["t3"], "lifetime": {"at": [3]}, "replace_after_s": {"fixed": 2}}}]}))
    r.start("--scenario", "scenario.json", "--auto", "--timeout", "300")
    out = r.proc.stdout.read()  # until the script exits (its --timeout bounds the run)
    r.proc.wait(timeout=60)
    record = json.loads(next((r.workdir / "dml_file" / "log").glob("*/run.json")).read_text())
    assert record["nodes"]["t3"] == "revoked by the scenario, replaced, done", (record, out)
    assert all(record["nodes"][n] == "done" for n in ("agg", "t1", "t2", "t4")), (record, out)
    assert r.proc.returncode == 0, out
    assert "did not finish" not in out, out

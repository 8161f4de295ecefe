"""However a run ends, its folder is complete and consistent: metrics.csv, summary.json and
run.json built from the same events, each node's ending, and /status agreeing with them."""
from __future__ import annotations

import csv
import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from dml_app.runtime.events import read_events

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

ENDINGS = ("done", "stopped", "timeout", "lost")


def slow_gossip(rounds: int = 200) -> dict:
    """The default gossip experiment, long enough to be interrupted mid-run."""
    from tests.e2e.harness import ROOT

    structure = json.loads((ROOT / "gl_structure.json").read_text())
    structure.update(sync=rounds, wait_s=1)
    return structure


def only_run_dir(workdir: Path) -> Path:
    runs = list((workdir / "dml_file" / "log").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def check_consistent(run_dir: Path, ended: str, status: dict | None = None) -> dict:
    """The folder's files agree with each other (and with ``status``); returns run.json."""
    record = json.loads((run_dir / "run.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert record["ended"] == ended == summary["ended"], (record["ended"], summary["ended"])
    for key in ("run_id", "algorithm", "command", "code_revision", "python", "numpy", "host", "started_at",
                "ended_at", "seeds"):
        assert record.get(key) is not None, key
    assert record["ended_at"] >= record["started_at"]
    assert sorted(p.name for p in (run_dir / "inputs").iterdir()) == ["gl_dataset.json", "gl_structure.json",
                                                                      "links.json"]
    topology = json.loads((run_dir / "topology.json").read_text())
    assert all(n["ip"] for n in topology["nodes"]) and all(link["rate_bps"] > 0 for link in topology["links"])

    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    rounds_in_metrics = Counter(r["node"] for r in rows)
    by_node = {n["node"]: n for n in summary["nodes"]}
    assert set(by_node) == set(record["nodes"]) and len(by_node) == 8
    for name, ending in record["nodes"].items():
        assert ending in ENDINGS or ending.startswith("failed: "), ending
        events = read_events(str(run_dir / "events" / f"{name}.jsonl"))
        round_events = sum(e["type"] == "round" for e in events)
        assert rounds_in_metrics[name] == round_events == by_node[name]["rounds"], name
        assert by_node[name]["ended"] == ending
    assert sum(rounds_in_metrics.values()) > 0  # the folder holds a run, not an empty agreement
    if status is not None:
        assert status["ended"] == ended and len(status["nodes"]) == 8
        for node in status["nodes"]:
            assert node["ending"] == record["nodes"][node["name"]]
            assert node["round"] == by_node[node["name"]]["rounds"]
    return record


def test_finish_mid_run_leaves_a_consistent_folder(run):
    r = run(structure=slow_gossip())
    r.wait_phase("ready")
    assert r.get("/start").ok
    r.wait_phase("running")
    import time

    time.sleep(6)
    summary = r.get("/finish").json()
    status = r.get("/status").json()
    assert status["phase"] == "finished"
    record = check_consistent(Path(summary["run_dir"]), "finished", status)
    assert "stopped" in record["nodes"].values()


def test_reset_mid_run_writes_the_folder_then_removes_the_testbed(run):
    r = run(structure=slow_gossip())
    r.wait_phase("ready")
    assert r.get("/start").ok
    import time

    time.sleep(5)
    assert r.get("/emulated/reset").ok
    assert r.proc.wait(timeout=60) == 0
    check_consistent(only_run_dir(r.workdir), "reset")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_leaves_a_consistent_folder(run, sig):
    r = run(structure=slow_gossip())
    r.wait_phase("ready")
    assert r.get("/start").ok
    import time

    time.sleep(5)
    r.proc.send_signal(sig)
    r.proc.wait(timeout=90)
    check_consistent(only_run_dir(r.workdir), "interrupted")


def test_auto_timeout_marks_the_running_nodes(run):
    r = run(structure=slow_gossip(), extra_args=("--auto", "--timeout", "8"))
    r.proc.wait(timeout=150)
    record = check_consistent(only_run_dir(r.workdir), "timeout")
    assert "timeout" in record["nodes"].values()


def test_a_node_killed_mid_run_is_failed_with_its_events_kept(run):
    r = run(structure=slow_gossip(40))
    r.wait_phase("ready")
    status = r.get("/status").json()
    victim = next(n for n in status["nodes"] if n["name"] == "n3")
    assert r.get("/start").ok
    import time

    time.sleep(2)
    os.killpg(victim["pid"], signal.SIGKILL)
    status = r.wait_phase("finished", timeout_s=150)
    run_dir = Path(status["run_dir"])
    record = check_consistent(run_dir, "completed", status)
    assert record["nodes"]["n3"].startswith("failed: process exited"), record["nodes"]["n3"]
    assert (run_dir / "events" / "n3.jsonl").stat().st_size > 0

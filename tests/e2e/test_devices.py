"""Device classes in a real run: the node's cgroup gets the class's CPU quota and memory, run.json
records the calibration, metrics.csv and summary.json carry the modelled energy."""
from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from tests.e2e.harness import Run
from tests.netns.conftest import free_subnet

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

LINKS = {"n1": [{"dest": "n2", "bw": "20mbit"}, {"dest": "n3", "bw": "20mbit"}],
         "n2": [{"dest": "n3", "bw": "20mbit"}, {"dest": "n1", "bw": "20mbit"}],
         "n3": [{"dest": "n1", "bw": "20mbit"}, {"dest": "n2", "bw": "20mbit"}]}
# a board of one core 4 times slower than the calibration says a core here is; one Pi 4 class overridden
CLASSES = {"classes": {"board": {"cores": 1, "mem": "384M", "nic": "100mbit", "idle_w": 1.0, "max_w": 3.0,
                                 "kernel_s": 1.0}}}
NODES = {"device_classes": "classes.json", "defaults": {"device": "board"},
         "nodes": [{"name": "n1"}, {"name": "n2"}, {"name": "n3", "mem": "512M"}]}


def cpu_quota_cores(group: str, node: str) -> float:
    """The node's CPU quota read back from its cgroup (v1 cpu.cfs_quota_us or v2 cpu.max)."""
    v1 = Path("/sys/fs/cgroup/cpu") / group / node
    if v1.is_dir():
        quota = int((v1 / "cpu.cfs_quota_us").read_text())
        return quota / int((v1 / "cpu.cfs_period_us").read_text())
    quota, period = (Path("/sys/fs/cgroup") / group / node / "cpu.max").read_text().split()
    return int(quota) / int(period)


def memory_limit(group: str, node: str) -> int:
    v1 = Path("/sys/fs/cgroup/memory") / group / node / "memory.limit_in_bytes"
    return int(v1.read_text() if v1.exists() else (Path("/sys/fs/cgroup") / group / node / "memory.max").read_text())


def test_device_nodes_get_their_quota_and_report_energy(tmp_path):
    structure = {"sync": 3, "wait_s": 1, "model": {"kind": "numpy", "hidden": [32], "learning_rate": 0.005,
                                                    "seed": 0},
                 "node_list": [{"name": n, "epoch": 1} for n in LINKS]}
    r = Run(tmp_path, structure=structure, links=LINKS, defer=True)
    (r.workdir / "nodes.json").write_text(json.dumps(NODES))
    (r.workdir / "classes.json").write_text(json.dumps(CLASSES))
    r.subnet = free_subnet()
    try:
        r.start("--nodes", "nodes.json", "--telemetry-period-ms", "100")
        r.wait_phase("ready", timeout_s=180)
        group = f"edgetb-{r.id}"
        quotas = {n: cpu_quota_cores(group, n) for n in LINKS}
        memory = {n: memory_limit(group, n) for n in LINKS}
        assert r.get("/start").json()["phase"] == "running"
        done = r.wait_phase("finished", timeout_s=300)
        assert done["done"] == 3, done
        run_dir = Path(r.get("/finish").json()["run_dir"])
    finally:
        out = r.close()
    record = json.loads((run_dir / "run.json").read_text())
    devices = record["devices"]
    assert set(devices) == set(LINKS), out[-2000:]
    for node, device in devices.items():
        # the calibration ran here: slowdown = the class's kernel time / the host's; quota = cores / slowdown
        assert device["class"] == "board" and device["host_kernel_s"] > 0
        assert device["slowdown"] == pytest.approx(1.0 / device["host_kernel_s"], rel=1e-3)
        assert quotas[node] == pytest.approx(device["quota_cores"], abs=1e-4)
    assert memory == {"n1": 384 << 20, "n2": 384 << 20, "n3": 512 << 20}  # the class's, or the node's own

    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(row["energy_j"] for row in rows), rows[:3]
    for row in rows:  # between idle power and full power over the round
        assert 0 < float(row["energy_j"]) <= 3.0 * (float(row["time_s"]) + 1.0)
    summary = json.loads((run_dir / "summary.json").read_text())
    by_node = {n["node"]: n for n in summary["nodes"]}
    for node in LINKS:
        e = by_node[node]
        assert e["energy_j"] > 0 and 1.0 <= e["mean_power_w"] <= 3.0, e


def test_availability_trace_pauses_and_resumes_a_node(run):
    """A node absent from 1 s to 3 s of the trace (time_scale 1) is frozen and thawed on time."""
    structure = json.loads((Path(__file__).resolve().parents[2] / "gl_structure.json").read_text())
    structure.update(sync=20, wait_s=1)
    r = run(structure=structure, defer=True)
    (r.workdir / "availability.csv").write_text("node,t_on_s,t_off_s\nn3,0,1\nn3,3,\n")
    (r.workdir / "scenario.json").write_text(json.dumps({"seed": 1, "events": [
        {"at": 0, "availability": {"file": "availability.csv", "mode": "pause"}}]}))
    r.start("--scenario", "scenario.json")
    r.wait_phase("ready", timeout_s=120)
    assert r.get("/start").ok
    status = r.wait_phase("finished", timeout_s=240)
    with open(Path(status["run_dir"]) / "scenario.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(row["event"], row["target"], float(row["planned_s"])) for row in rows] == [
        ("pause", "n3", 1.0), ("resume", "n3", 3.0)], rows
    for row in rows:  # target: applied within 1 s of the plan
        assert row["outcome"] == "applied" and abs(float(row["skew_ms"])) < 1000, row
    nodes = {n["name"]: n for n in status["nodes"]}
    assert nodes["n3"]["ending"] == "done" and nodes["n3"]["round"] == 20, nodes["n3"]  # back, and finished


NAMES8 = [f"n{i}" for i in range(1, 9)]  # gl_structure.json's nodes


def test_availability_trace_in_crash_mode_kills_and_restarts_a_device_node(run):
    """Crash mode end to end: n3 (a device class's node) leaves at 1 s of the trace (its
    processes killed) and comes back at 3 s (started again, rejoining); the gossip run finishes
    with n3's two lives, and n3's energy leaves the 2 s it was away out (0 W, not idle power)."""
    structure = json.loads((Path(__file__).resolve().parents[2] / "gl_structure.json").read_text())
    structure.update(sync=60, wait_s=1)
    r = run(kind="gl", structure=structure, defer=True)
    (r.workdir / "classes.json").write_text(json.dumps(CLASSES))
    (r.workdir / "nodes.json").write_text(json.dumps({"device_classes": "classes.json",
                                                      "nodes": [{"name": n, "device": "board"} if n == "n3"
                                                                else {"name": n} for n in NAMES8]}))
    (r.workdir / "availability.csv").write_text("node,t_on_s,t_off_s\nn3,0,1\nn3,3,\n")
    (r.workdir / "scenario.json").write_text(json.dumps({"seed": 1, "events": [
        {"at": 0, "availability": {"file": "availability.csv", "mode": "crash"}}]}))
    r.start("--scenario", "scenario.json", "--nodes", "nodes.json", "--telemetry-period-ms", "100")
    r.wait_phase("ready", timeout_s=180)
    assert r.get("/start").ok
    r.wait_phase("finished", timeout_s=300)
    gauge = next(float(line.split()[-1]) for line in r.get("/metrics").text.splitlines()
                 if line.startswith("edgetb_node_energy_joules{") and 'node="n3"' in line)
    summary = r.get("/finish").json()
    run_dir = Path(summary["run_dir"])
    with open(run_dir / "scenario.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(row["event"], row["target"], float(row["planned_s"])) for row in rows] == [
        ("crash", "n3", 1.0), ("replace", "n3", 3.0)], rows
    for row in rows:
        assert row["outcome"] == "applied" and abs(float(row["skew_ms"])) < 1000, row
    lives = json.loads((run_dir / "lives.json").read_text())
    assert [life["ended"] for life in lives["nodes"]["n3"]] == ["crashed by the scenario", "done"], lives["nodes"]
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert nodes["n3"]["ended"].startswith("crashed") and nodes["n3"]["ended"].endswith("replaced, done"), nodes["n3"]
    assert all(n["ended"] == "done" for name, n in nodes.items() if name != "n3"), nodes
    stored = {n["node"]: n for n in json.loads((run_dir / "summary.json").read_text())["nodes"]}
    away = [(float(rows[0]["applied_s"]), float(rows[1]["applied_s"]))]
    e = stored["n3"]
    assert e["away_s"] == pytest.approx(away[0][1] - away[0][0], abs=0.2), e
    # idle 1 W at least over the time there, and nothing while away: below max power x time there
    there_s = e["sampled_s"] - e["away_s"]
    assert 1.0 * there_s * 0.98 <= e["energy_j"] <= 3.0 * there_s * 1.02, e
    assert gauge > 0  # the live gauge (its away windows from the scenario's rows: tests/unit/test_energy.py)
    assert "energy_j" not in stored["n1"] or stored["n1"].get("energy_j") is None

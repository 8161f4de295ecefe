"""Gossip learning end to end through the user's interface: gl_run.py and curl-style calls on :PORT."""
from __future__ import annotations

import csv
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.e2e.harness import ROOT, Run, free_port, make_workdir
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]


def test_gossip_through_the_http_workflow(run):
    r = run()
    ready = r.wait_phase("ready")
    assert all(n["up"] and n["shaping_verified"] for n in ready["nodes"]) and len(ready["nodes"]) == 8
    assert r.get("/conf/dataset").json()["pushed"] == [f"n{i}" for i in range(1, 9)]
    assert r.get("/conf/structure").ok
    status = r.get("/status").json()
    assert all(n["dataset_conf"] and n["structure_conf"] for n in status["nodes"])

    # a node cannot drive the controller: only loopback or the admin token may
    bridge_ip = r.subnet.replace("0.0/16", "0.1")
    probe = (f"import urllib.request, urllib.error\ntry:\n urllib.request.urlopen('http://{bridge_ip}:{r.port}/start')\n"
             "except urllib.error.HTTPError as e:\n print(e.code)")
    from_node = subprocess.run(["ip", "netns", "exec", f"etb-{r.id}-n1", sys.executable, "-c", probe],
                               capture_output=True, text=True, timeout=30)
    assert from_node.stdout.strip() == "401", from_node
    forged = requests.post(r.url + "/log?node=n1", data=b"{}", timeout=10)
    assert forged.status_code == 401

    # re-shape one link at run time; the file must lie inside the experiment directory
    (r.workdir / "links_update.json").write_text(json.dumps({"n1": [{"dest": "n2", "bw": "1mbit"}]}))
    assert r.get("/update/tc?file=links_update.json").ok
    from worker.host import WorkerHost

    kernel = WorkerHost(r.id, r.subnet, state_root=str(r.state)).shaping("n1")
    rates = {rule["dest"]: rule["shape"]["rate_bps"] for rule in kernel["plan"]["rules"]}
    assert kernel["verified"] and rates == {"n2": 1_000_000, "n8": 10_000_000, "n5": 5_000_000}, rates
    escape = r.get("/update/tc?file=../../../etc/passwd")
    assert escape.status_code == 400 and "outside the experiment directory" in escape.json()["message"]

    assert r.get("/start").json()["phase"] == "running"
    done = r.wait_phase("finished", timeout_s=150)
    assert done["done"] == 8 and done["failed"] == 0
    summary = r.get("/finish").json()
    assert r.get("/finish").json() == summary  # safe to call twice

    run_dir = Path(summary["run_dir"])
    assert run_dir.parent == r.workdir / "dml_file" / "log"
    assert sorted(p.name for p in (run_dir / "events").iterdir()) == [f"n{i}.jsonl" for i in range(1, 9)]
    for name in ("metrics.csv", "topology.json", "accuracy_vs_round.png", "accuracy_vs_time.png",
                 "loss_vs_round.png", "loss_vs_time.png"):
        assert (run_dir / name).stat().st_size > 0, name
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert {"run_id", "algorithm", "node", "role", "layer", "round", "time_s", "loss", "accuracy", "global_loss",
            "global_accuracy", "bytes_sent", "bytes_recv"} <= set(rows[0])
    assert len(rows) == 8 * 20 and {(r["algorithm"], r["role"]) for r in rows} == {("gossip", "gossip")}
    traffic = list(csv.DictReader((run_dir / "traffic.csv").open()))
    assert list(traffic[0]) == ["run_id", "node", "round", "peer", "direction", "bytes"]
    for node in summary["nodes"]:  # traffic.csv adds up to the summary's totals
        mine = [t for t in traffic if t["node"] == node["node"]]
        assert sum(int(t["bytes"]) for t in mine if t["direction"] == "sent") == node["bytes_sent"], node["node"]
    from safetensors.numpy import load_file

    for node in summary["nodes"]:  # every final model saved in the ecosystem's format
        assert node["model"] == str(run_dir / "models" / f"{node['node']}.safetensors"), node
        assert load_file(node["model"])["dense/kernel"].shape[0] == 64  # named by layer, as the node sent it
    has_global_set = bool(json.loads((r.workdir / "dml_file" / "conf" / "n1_dataset.json").read_text())
                          .get("global_test"))

    links = json.loads((r.workdir / "links.json").read_text())
    for node in summary["nodes"]:
        assert node["rounds"] == 20 and node["ended"] == "done"
        assert node["accuracy"] >= 0.85, node
        if has_global_set:  # one common test set: the same samples judge every node
            assert node["global_accuracy"] >= 0.85 and node["final_global_accuracy"] >= 0.85, node
        allowed = {l["dest"] for l in links[node["node"]]}
        assert set(node["sent_to"]) <= allowed, f"{node['node']} sent to {node['sent_to']}, links only to {allowed}"
        assert node["bytes_sent"] > 0
    r.get("/emulated/reset")
    assert r.proc.wait(timeout=30) == 0, "gl_run.py serves until reset, then exits"


def test_a_killed_node_does_not_hang_the_run(run):
    structure = json.loads((ROOT / "gl_structure.json").read_text())
    structure.update(sync=25, wait_s=1)
    r = run(structure=structure)
    r.wait_phase("ready")
    r.get("/start")
    time.sleep(1.0)
    victim = next(n for n in r.get("/status").json()["nodes"] if n["name"] == "n3")
    os.kill(victim["pid"], signal.SIGKILL)
    status = r.wait_phase("finished", timeout_s=150)
    states = {n["name"]: n["state"] for n in status["nodes"]}
    assert states["n3"] == "failed" and "exited" in next(n for n in status["nodes"] if n["name"] == "n3")["detail"]
    assert all(s == "done" for name, s in states.items() if name != "n3"), states
    summary = r.get("/finish").json()
    assert {n["node"] for n in summary["nodes"] if n["ended"] == "done"} == {f"n{i}" for i in range(1, 9)} - {"n3"}


@pytest.mark.parametrize("structure,expected", [
    ({"sync": 5, "node_list": [{"name": "n1"}, {"name": "zz"}]}, ["gl_structure.json", "'zz'", "unknown node"]),
    ({"node_list": [{"name": "n1"}]}, ["gl_structure.json", "'sync'"]),
    ({"sync": "5", "node_list": [{"name": "n1"}]}, ["gl_structure.json", "'sync'", "int"]),
    ({"sync": 5, "node_list": [{"name": "n1", "epoch": 1.5}]}, ["gl_structure.json", "(n1)", "'epoch'"]),
])
def test_bad_structure_is_refused_before_anything_starts(tmp_path, structure, expected):
    r = Run(tmp_path, structure=structure)
    code = r.proc.wait(timeout=60)
    out = r.proc.stdout.read()
    assert code == 2, out
    for part in expected:
        assert part in out, (part, out)
    assert f"etb-{r.id}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_bad_dataset_is_refused(tmp_path):
    r = Run(tmp_path, dataset={"dataset": "cifar", "batch_size": 32})
    assert r.proc.wait(timeout=60) == 2
    out = r.proc.stdout.read()
    assert "gl_dataset.json" in out and "'dataset'" in out and "cifar" in out
    assert f"etb-{r.id}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_tensorflow_model_gossip(run):
    pytest.importorskip("tensorflow", reason="TensorFlow not installed: pip install '.[tf]'")
    structure = {"sync": 1, "wait_s": 1, "model": {"kind": "tf", "hidden": [32], "learning_rate": 0.01},
                 "node_list": [{"name": "a", "epoch": 1}, {"name": "b", "epoch": 1}]}
    r = run(structure=structure, links={"a": [{"dest": "b", "bw": "20mbit"}], "b": [{"dest": "a", "bw": "20mbit"}]})
    r.wait_phase("ready", timeout_s=180)
    r.get("/start")
    status = r.wait_phase("finished", timeout_s=300)
    assert status["done"] == 2, status
    summary = r.get("/finish").json()
    for node in summary["nodes"]:
        assert node["rounds"] == 1 and node["bytes_sent"] > 0 and 0 < node["accuracy"] <= 1


def test_testbed_api_runs_an_experiment(tmp_path):
    """The EdgeTB-style Python API: declare, load links, start --auto."""
    workdir = make_workdir(tmp_path, structure={"sync": 3, "wait_s": 1, "node_list": [{"name": "a"}, {"name": "b"}]},
                           links={"a": [{"dest": "b", "bw": "10mbit"}], "b": [{"dest": "a", "bw": "10mbit"}]})
    tb_id = "t" + secrets.token_hex(2)
    script = workdir / "experiment.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from controller.testbed import Testbed
tb = Testbed(workdir={str(workdir)!r}, port={free_port()}, testbed_id={tb_id!r}, subnet="10.229.0.0/16")
tb.add_emulator("local")
tb.add_emulated_node("a", cpu=1, mem="256M")
tb.add_emulated_node("b")
tb.load_link("links.json")
run = tb.start(auto=True)
print("RUN", run.run_id, run.ended, run.exit_code, len(run.metrics()), [n["ended"] for n in run.nodes])
sys.exit(run.exit_code)
""")
    # a python without the project's dependencies re-runs the script under .venv
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    done = subprocess.run([python, str(script)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, EDGETB_STATE_DIR=str(tmp_path / "state")))
    assert done.returncode == 0, done.stdout + done.stderr
    runs = list((workdir / "dml_file" / "log").iterdir())
    assert len(runs) == 1
    assert f"RUN {runs[0].name} completed 0 6 ['done', 'done']" in done.stdout, done.stdout
    assert f"etb-{tb_id}-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

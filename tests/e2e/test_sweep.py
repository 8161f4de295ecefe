"""A real sweep through ``edgetb sweep``: two runs of a 3-node gossip experiment, interrupted in the
second run and resumed, then its table rebuilt by ``edgetb analyze``."""
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

from tests.e2e.harness import ROOT, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
NODES = ["n1", "n2", "n3"]


def experiment(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    workdir = tmp_path / "exp"
    workdir.mkdir()
    os.chmod(workdir, 0o755)  # (the nodes read it as their own users)
    links = {a: [{"dest": b, "bw": "20mbit"} for b in NODES if b != a] for a in NODES}
    (workdir / "links.json").write_text(json.dumps(links))
    (workdir / "gl_structure.json").write_text(json.dumps({
        "sync": 3, "wait_s": 1, "model": {"kind": "numpy", "hidden": [32], "seed": 0},
        "target_accuracy": [0.3, 0.999], "node_list": [{"name": n, "epoch": 1} for n in NODES]}))
    (workdir / "gl_dataset.json").write_text(json.dumps({"dataset": "digits", "split": "iid", "seed": 0,
                                                         "batch_size": 32}))
    tid = "w" + secrets.token_hex(2)
    (workdir / "sweep.json").write_text(json.dumps({
        "vary": {"links.*[*].bw": ["10mbit", "40mbit"]}, "repeats": {"seeds": [5]},
        "run": {"testbed_id": tid, "subnet": f"10.{200 + int(tid[1:], 16) % 20}.0.0/16", "port": free_port(),
                "timeout_s": 120}}))
    env = dict(os.environ, EDGETB_STATE_DIR=str(tmp_path / "state"))
    return workdir, env


def edgetb(workdir: Path, env: dict[str, str], *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "controller", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def state_of(sweep_dir: Path) -> dict:
    try:
        return json.loads((sweep_dir / "state.json").read_text())["runs"]
    except (OSError, ValueError, KeyError):
        return {}


def test_a_sweep_runs_keeps_its_runs_resumes_and_tabulates(tmp_path):
    workdir, env = experiment(tmp_path)
    sweep_dir = workdir / "dml_file" / "sweeps" / "sweep"
    first = edgetb(workdir, env, "sweep", str(workdir / "sweep.json"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and first.poll() is None:  # stop it during its second run
        if any(e.get("index") == 2 and e.get("status") == "running" for e in state_of(sweep_dir).values()):
            time.sleep(2)
            first.send_signal(signal.SIGINT)
            break
        time.sleep(0.2)
    out = first.communicate(timeout=180)[0]
    assert first.returncode == 130, out
    runs = {e["index"]: e for e in state_of(sweep_dir).values()}
    assert runs[1]["status"] == "completed" and runs[2]["status"] == "interrupted", out
    kept = sweep_dir / "runs" / runs[1]["name"] / "run"
    kept_id = json.loads((kept / "run.json").read_text())["run_id"]
    summary_mtime = (kept / "summary.json").stat().st_mtime

    second = edgetb(workdir, env, "sweep", str(workdir / "sweep.json"))
    out = second.communicate(timeout=240)[0]
    assert second.returncode == 0, out
    assert "1 kept from before" in out and "run 2 of 2" in out and "run 1 of 2" not in out
    assert json.loads((kept / "run.json").read_text())["run_id"] == kept_id
    assert (kept / "summary.json").stat().st_mtime == summary_mtime  # the completed run untouched
    runs = {e["index"]: e for e in state_of(sweep_dir).values()}
    assert {e["status"] for e in runs.values()} == {"completed"}
    second_run = sweep_dir / "runs" / runs[2]["name"]
    assert list(second_run.glob("interrupted-*")), "the interrupted attempt is kept"
    made = json.loads((second_run / "inputs" / "links.json").read_text())
    assert {link["bw"] for links in made.values() for link in links} == {"40mbit"}
    assert json.loads((second_run / "inputs" / "gl_structure.json").read_text())["model"]["seed"] == 5

    for run in (kept, second_run / "run"):  # time-to-accuracy in the summary and the analysis
        tta = {t["target"]: t for t in json.loads((run / "summary.json").read_text())["time_to_accuracy"]}
        assert tta[0.999]["run"] is None
        reached = tta[0.3]["run"]
        assert reached is not None and 1 <= reached["rounds"] <= 3 and reached["bytes_sent"] > 0
        assert set(tta[0.3]["nodes"]) == set(NODES)
        analysed = json.loads((run / "analysis" / "summary.json").read_text())["time_to_accuracy"]
        assert analysed[0]["run"] == reached

    rows = list(csv.DictReader((sweep_dir / "runs.csv").open()))
    assert [(r["links.*[*].bw"], r["seed"], r["status"]) for r in rows] == [("10mbit", "5", "completed"),
                                                                           ("40mbit", "5", "completed")]
    assert all(float(r["final_accuracy"]) > 0.3 and float(r["tta_0.3_s"]) > 0 and r["tta_0.999_s"] == ""
               for r in rows)
    (sweep_dir / "configs.csv").unlink()
    again = edgetb(workdir, env, "analyze", str(sweep_dir))
    out = again.communicate(timeout=120)[0]
    assert again.returncode == 0, out
    configs = list(csv.DictReader((sweep_dir / "configs.csv").open()))
    assert [(c["links.*[*].bw"], c["completed"]) for c in configs] == [("10mbit", "1"), ("40mbit", "1")]
    plotted = [p.name for p in (sweep_dir / "plots").glob("final_accuracy_vs_*.png")]
    assert plotted == ["final_accuracy_vs_links._.bw.png"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    tid = json.loads((workdir / "sweep.json").read_text())["run"]["testbed_id"]
    assert f"etb-{tid}-" not in left, f"namespaces left behind:\n{left}"

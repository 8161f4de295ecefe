"""Flower apps over the emulated network (flwr_run.py): the numpy example app, 4 SuperNodes and
2 rounds on shaped links, per-round rows in metrics.csv, bytes on every SuperLink<->SuperNode
link, no process of the nodes' uids after the run; bad input refused before anything is made."""
from __future__ import annotations

import csv
import gzip
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT

FLWR_PYTHON = os.environ.get("EDGETB_FLWR_PYTHON", "/opt/edgetb-flwr")
HAVE_FLWR = os.access(os.path.join(FLWR_PYTHON, "bin", "flower-superlink"), os.X_OK)
REQUIRED = os.environ.get("EDGETB_REQUIRE_FLOWER") == "1"
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)"),
              pytest.mark.skipif(not HAVE_FLWR and not REQUIRED,
                                 reason=f"flwr not installed in {FLWR_PYTHON} (bash scripts/flower_setup.sh)")]
SUPERNODES = ["n2", "n3", "n4", "n5"]
RATE = "20mbit"


def experiment(tmp_path: Path, **structure) -> Path:
    workdir = tmp_path / "exp"
    workdir.mkdir()
    os.chmod(workdir, 0o755)  # (the nodes read it as their own users)
    shutil.copytree(ROOT / "examples" / "flower" / "numpy_app", workdir / "app")
    links = {"n1": [{"dest": n, "bw": RATE} for n in SUPERNODES], **{n: [{"dest": "n1", "bw": RATE}] for n in SUPERNODES}}
    (workdir / "links.json").write_text(json.dumps(links))
    (workdir / "flwr_dataset.json").write_text(json.dumps({"dataset": "digits", "split": "iid", "seed": 0,
                                                           "batch_size": 32}))
    (workdir / "flwr_structure.json").write_text(json.dumps({
        "app": "app", "python": FLWR_PYTHON, "superlink": "n1", "node_list": ["n1", *SUPERNODES],
        "run_config": {"num-server-rounds": 2}, **structure}))
    return workdir


def flwr_argv(workdir: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    """flwr_run.py's command line on a testbed id, subnet and controller port of its own."""
    tb = "f" + secrets.token_hex(2)
    env = dict(os.environ, EDGETB_STATE_DIR=str(workdir / "state"))
    return [sys.executable, str(ROOT / "flwr_run.py"), "--workdir", str(workdir), "--id", tb,
            "--subnet", f"10.{200 + int(tb[1:], 16) % 20}.0.0/16", "--port", str(free_port()),
            "--telemetry-period-ms", "200", *args], env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flwr_run(workdir: Path, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    argv, env = flwr_argv(workdir, *args)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)


def processes_of(uids: set[int]) -> list[str]:
    """The live processes whose real uid is one of ``uids``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 ").split()[0]) in uids and "Z" not in fields.get("State", ""):
            found.append(f"{pid} {fields.get('Name', '').strip()}")
    return found


def run_folder(workdir: Path) -> Path:
    (found,) = (workdir / "dml_file" / "log").iterdir()
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def watch_forks(proc: subprocess.Popen, seen: dict[str, set]) -> None:
    """Until ``proc`` ends: its Flower fork server, the server's children, the shims, and any
    ClientApp started as a fresh Python (``seen``)."""
    while proc.poll() is None:
        parents = {}
        for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        for pid, ppid in parents.items():
            argv = cmdline(pid)
            if ppid == proc.pid and any("flower_forks" in a for a in argv):
                seen["server"].add(pid)
            elif ppid in seen["server"]:
                seen["children"].add(pid)
            elif any(a.startswith("/run/edgetb-flwr/") and a.endswith("/flwr-clientapp") for a in argv):
                seen["shims"].add(pid)
            elif any(a.endswith("/bin/flwr-clientapp") for a in argv):
                seen["fresh"].add(pid)
        time.sleep(0.1)


def test_a_flower_app_runs_two_rounds_over_shaped_links_and_leaves_nothing(tmp_path):
    import threading

    workdir = experiment(tmp_path)
    argv, env = flwr_argv(workdir, "-d", "flwr_dataset.json", "--auto")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[str, set] = {"server": set(), "children": set(), "shims": set(), "fresh": set()}
    watcher = threading.Thread(target=watch_forks, args=(proc, seen), daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate(timeout=600)
    watcher.join(timeout=10)
    done = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    assert done.returncode == 0, done.stdout + done.stderr
    # every Flower server and ClientApp forked from one Flower fork server (flwr imported once):
    # the SuperLink, 4 SuperNodes and 4 SuperExecs, and ClientApps asked for through the shims
    assert len(seen["server"]) == 1, seen
    assert len(seen["children"]) >= 9 + 1 and seen["shims"] and not seen["fresh"], seen
    assert "Flower round 2/2" in done.stdout and "4 SuperNodes registered" in done.stdout
    out = run_folder(workdir)
    record = json.loads((out / "run.json").read_text())
    assert record["ended"] == "completed" and record["algorithm"] == "flower" and record["flower"]["flwr"]
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["round"], r["node"]) for r in rows] == [("1", "n1"), ("2", "n1")]
    assert all(0.0 <= float(r["flwr_eval_acc"]) <= 1.0 for r in rows)
    assert float(rows[1]["flwr_train_loss"]) < float(rows[0]["flwr_train_loss"])
    # the rounds timed by Flower itself (the SuperLink's stored log pieces), within the run
    assert record["flower"]["time_s"] == "the SuperLink's stored log pieces"
    assert 0.0 < float(rows[0]["time_s"]) < float(rows[1]["time_s"]) < record["ended_at"] - record["started_at"]
    # each SuperNode trained on its own edgetb shard, given by its node config
    supernode_log = (out / "flower" / "n3-supernode.log").read_text()
    # the SuperNodes and SuperExecs ended by themselves on SIGTERM (with telemetry on, flwr's
    # exit waited for it until they were killed: their logs stopped short)
    for n in SUPERNODES:
        assert "Application shutdown complete" in (out / "flower" / f"{n}-supernode.log").read_text()
        assert "SuperExec terminated gracefully" in (out / "flower" / f"{n}-superexec.log").read_text()
    assert (out / "flower" / "n1-superlink.log").stat().st_size > 0
    assert supernode_log.count("Received successfully") >= 4  # 2 rounds of train + evaluate
    with gzip.open(out / "telemetry" / "links.csv.gz", "rt") as f:
        sent: dict[tuple[str, str], int] = {}
        for r in csv.DictReader(f):
            sent[(r["src"], r["dst"])] = max(sent.get((r["src"], r["dst"]), 0), int(r["tx_bytes"]))
    model_bytes = (64 * 10 + 10) * 4
    for n in SUPERNODES:  # the model went out and came back on every link, 2 rounds (+ evaluation)
        assert sent[("n1", n)] > 2 * 2 * model_bytes, sent
        assert sent[(n, "n1")] > 2 * model_bytes, sent
    uids = set(record["flower"]["uids"].values())
    assert len(uids) == 5
    assert processes_of(uids) == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in seen["server"])  # the server, stopped
    assert not any(Path("/run/edgetb-flwr", str(uid)).exists() for uid in uids)  # its sockets and shims, removed
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "etb-" + record["testbed_id"] + "-" not in left


@pytest.mark.parametrize("change, message", [
    ({"app": "nowhere"}, "no app directory"),
    ({"python": "/usr"}, "flwr is not installed in /usr"),
])
def test_bad_input_is_refused_before_anything_is_made(tmp_path, change, message):
    workdir = experiment(tmp_path, **change)
    done = flwr_run(workdir, "--auto", timeout_s=120)
    assert done.returncode == 2 and message in done.stderr, done.stdout + done.stderr
    assert "creating" not in done.stdout
    assert not (workdir / "dml_file" / "log").exists() or not any((workdir / "dml_file" / "log").iterdir())


def test_an_app_without_tool_flwr_app_is_refused(tmp_path):
    workdir = experiment(tmp_path)
    (workdir / "app" / "pyproject.toml").write_text('[project]\nname = "x"\n')
    done = flwr_run(workdir, "--auto", timeout_s=120)
    assert done.returncode == 2 and "no [tool.flwr.app] table" in done.stderr, done.stdout + done.stderr


def test_an_app_that_does_not_load_is_refused_before_anything_is_made(tmp_path):
    workdir = experiment(tmp_path)
    with open(workdir / "app" / "numpy_app" / "client_app.py", "a") as f:
        f.write("\nimport a_module_nobody_installed\n")
    done = flwr_run(workdir, "--auto", timeout_s=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "does not load" in done.stderr and "a_module_nobody_installed" in done.stderr, done.stderr
    assert "creating" not in done.stdout


def test_a_server_app_that_fails_ends_the_run_failed_with_its_folder_written_and_nothing_left(tmp_path):
    workdir = experiment(tmp_path)
    server = workdir / "app" / "numpy_app" / "server_app.py"
    server.write_text(server.read_text().replace("    strategy = FedAvg(", "    raise RuntimeError('broken on purpose')\n"
                                                 "    strategy = FedAvg("))
    done = flwr_run(workdir, "--auto", "--timeout", "240")
    assert done.returncode == 1, done.stdout + done.stderr
    out = run_folder(workdir)
    record = json.loads((out / "run.json").read_text())
    assert record["ended"] == "failed" and record["rounds"] == 0, record
    assert "broken on purpose" in (out / "flower" / "n1-run.log").read_text()
    assert "broken on purpose" in done.stdout + done.stderr  # (the run log's last lines, said on the console)
    assert (out / "metrics.csv").read_text().startswith("run_id,algorithm,node,round,time_s")
    assert processes_of(set(record["flower"]["uids"].values())) == []


def call(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=300) as answer:
        return json.loads(answer.read())


def test_the_curl_workflow_start_status_dashboard_then_reset(tmp_path):
    """flwr_run.py without --auto: the controller waits; /start runs the app, /status and the
    dashboard's view show its rounds, the run finishes by itself, /emulated/reset removes all."""
    workdir = experiment(tmp_path)
    argv, env = flwr_argv(workdir, "-d", "flwr_dataset.json")
    port = int(argv[argv.index("--port") + 1])
    log = open(tmp_path / "flwr_run.log", "w+")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while "Next: curl" not in (tmp_path / "flwr_run.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "flwr_run.log").read_text()
            time.sleep(0.5)
        ready = call(port, "/status")
        assert ready["phase"] == "ready" and all(n["shaping_verified"] and not n["up"] for n in ready["nodes"]), ready
        started = call(port, "/start")
        assert started["started"] == ["n1", *SUPERNODES]
        assert all(n["up"] for n in call(port, "/status")["nodes"])  # (2 rounds take longer than this call)
        while (status := call(port, "/status"))["phase"] == "running":
            assert time.monotonic() < deadline + 400, status
            time.sleep(1)
        assert status["phase"] == "finished" and status["ended"] == "completed" and status["round"] == 2, status
        assert not any(n["up"] for n in status["nodes"]), status  # (its Flower processes stopped)
        view = call(port, "/api/view")
        assert view["algorithm"] == "flower" and view["series"]["round"]["round"] == [1, 2], view["series"]
        assert view["models"] == ["numpy-app · flower"]
        assert call(port, "/finish")["rounds"] == 2  # the written run's summary, again
        call(port, "/emulated/reset")
        assert proc.wait(timeout=120) == 0, (tmp_path / "flwr_run.log").read_text()
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=120)
        log.close()
    out = run_folder(workdir)
    record = json.loads((out / "run.json").read_text())
    assert record["ended"] == "completed" and record["seeds"]["dataset"] == 0  # (flwr_dataset.json's)
    with open(out / "metrics.csv", newline="") as f:
        assert [r["round"] for r in csv.DictReader(f)] == ["1", "2"]
    assert json.loads((out / "timeline.json").read_text()) is not None
    assert processes_of(set(record["flower"]["uids"].values())) == []
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "etb-" + record["testbed_id"] + "-" not in left


def test_a_scenario_crashes_a_supernode_mid_round_and_cuts_a_link_the_run_goes_on(tmp_path):
    """Round 2 begins: n5 is killed (all its processes) and n1<->n4 cut for 5 s; Flower's strategy
    goes on without n5, and the run's timeline and scenario.csv record both."""
    workdir = experiment(tmp_path, run_config={"num-server-rounds": 3})
    (workdir / "scenario.json").write_text(json.dumps({"events": [
        {"at_round": {"node": "n1", "round": 2}, "crash": "n5"},
        {"at_round": {"node": "n1", "round": 2}, "link_down": ["n1", "n4"], "for": 5}]}))
    done = flwr_run(workdir, "-d", "flwr_dataset.json", "--scenario", "scenario.json", "--auto", "--timeout", "600",
                    timeout_s=900)
    assert done.returncode == 0, done.stdout + done.stderr
    out = run_folder(workdir)
    with open(out / "scenario.csv", newline="") as f:
        applied = {(r["event"], r["target"]): r["outcome"] for r in csv.DictReader(f)}
    assert applied[("crash", "n5")] == "applied" and any(e == "block" for e, _ in applied), applied
    assert all(outcome == "applied" for outcome in applied.values()), applied
    timeline = json.loads((out / "timeline.json").read_text())
    assert any(e["target"] == "n5" and "crashed" in e["kind"] for e in timeline), timeline
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["round"] for r in rows] == ["1", "2", "3"]
    assert "n5: crashed by the scenario" in done.stdout, done.stdout
    assert "Received 3 results" in (out / "flower" / "n1-run.log").read_text()
    record = json.loads((out / "run.json").read_text())
    assert record["ended"] == "completed"
    assert processes_of(set(record["flower"]["uids"].values())) == []

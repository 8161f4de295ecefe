"""Your own programs in nodes through the edgetb command: exec --detach with --env, ps, logs [-f],
stop, signals passed to an attached exec, and down with programs still running."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli import run, write

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
SUBNET = "10.233.0.0/16"
LINKS = {"a": [{"dest": "b", "bw": "10mbit"}], "b": [{"dest": "a", "bw": "10mbit"}]}


@pytest.fixture
def testbed(tmp_path):
    """The environment of a testbed of its own (brought up by the test); always taken down,
    nothing of it left."""
    tb = "p" + secrets.token_hex(2)
    env = dict(os.environ, EDGETB_ID=tb, EDGETB_SUBNET=SUBNET, EDGETB_STATE_DIR=str(tmp_path / "state"))
    yield env
    run(["down"], env, check=False)
    assert_nothing_left(env)


def assert_nothing_left(env: dict[str, str]) -> None:
    from worker.nodes.netns import NetnsRuntime
    from worker.state import StateStore

    left = NetnsRuntime(StateStore(env["EDGETB_ID"], env["EDGETB_STATE_DIR"]), SUBNET).leftovers()
    assert not any(left.values()), left


@pytest.fixture
def two_nodes(testbed, tmp_path):
    """Nodes a (10.233.0.2) and b (10.233.0.3) of a testbed of their own."""
    run(["up", write(tmp_path, "links.json", LINKS)], testbed)
    return testbed


def records(env: dict[str, str], node: str = "") -> list[dict]:
    return json.loads(run(["ps", "--json", *([node] if node else [])], env).stdout)


def status_field(pid: int, field: str) -> str:
    """A field of /proc/PID/status ('' once the process is gone or a zombie)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except FileNotFoundError:
        return ""
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return "" if fields.get("State", "").strip().startswith("Z") else fields.get(field, "").split()[0]


def live_pids_of_uids(uids: set[int]) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (uid := status_field(int(entry), "Uid")) and int(uid) in uids:
            found.append(int(entry))
    return found


def test_detach_ps_logs_stop_with_env(two_nodes):
    env = two_nodes
    server = run(["exec", "--detach", "--env", "PORT=8000", "b", "--",
                  "sh", "-c", 'exec python3 -m http.server "$PORT" --bind 0.0.0.0'], env).stdout.strip()
    greeter = run(["exec", "-d", "-e", "WHO=world", "a", "--", "sh", "-c",
                   'echo "hi $WHO"; printf "\\033[31mred\\033]0;title\\007\\n"; sleep 1; echo bye; exit 3'],
                  env).stdout.strip()
    assert len(server) == 12 and server != greeter

    # logs -f prints until the process ends, its escape sequences removed
    follow = run(["logs", "-f", greeter], env)
    assert follow.stdout == "hi world\nred\nbye\n"
    assert [r["returncode"] for r in records(env, "a")] == [3]
    assert "exited 3" in run(["ps", "a"], env).stdout

    # a client in a reaches the server in b over the shaped link
    deadline = time.monotonic() + 20
    probe = "import urllib.request as u; print(u.urlopen('http://10.233.0.3:8000/', timeout=2).status)"
    while (got := run(["exec", "a", "--", "python3", "-c", probe], env, check=False)).returncode != 0:
        assert time.monotonic() < deadline, got.stderr
        time.sleep(0.3)
    assert got.stdout.strip() == "200"
    (rec,) = records(env, "b")
    assert rec["id"] == server and rec["running"] and rec["argv"][0] == "sh"
    assert int(status_field(rec["pid"], "Uid")) != 0  # the node's uid, not root
    assert '"GET / HTTP/1.1" 200' in run(["logs", server], env).stdout

    assert run(["stop", server], env).stdout.startswith(f"stopped {server}")
    assert records(env, "b") == [] and not status_field(rec["pid"], "Pid")
    missing = run(["logs", server], env, check=False)
    assert missing.returncode != 0 and f"no process '{server}'" in missing.stderr


def test_attached_exec_runs_as_the_node_with_env_unless_as_root(two_nodes):
    env = two_nodes
    out = run(["exec", "-e", "X=42", "a", "--", "sh", "-c", 'echo "$X $(id -u) $(pwd)"'], env).stdout.split()
    assert out[0] == "42" and out[1] != "0" and out[2] == "/"
    assert run(["exec", "a", "--", "cat", str(Path(env["EDGETB_STATE_DIR"]) / "token")], env,
               check=False).returncode != 0  # the worker's state is not in the node's view
    assert run(["exec", "--as-root", "a", "--", "id", "-u"], env).stdout.strip() == "0"
    refused = run(["exec", "--as-root", "--detach", "a", "--", "true"], env, check=False)
    assert refused.returncode == 2 and "--as-root" in refused.stderr
    bad = run(["exec", "-e", "1X=2", "a", "--", "true"], env, check=False)
    assert bad.returncode == 2 and "NAME=VALUE" in bad.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_an_attached_exec_reaches_the_node_process(two_nodes, sig):
    script = ('trap "echo got-signal; exit 5" INT TERM; sleep 300 & echo ready; wait')
    # started as a shell starts a background job: SIGINT ignored
    wrapper = subprocess.Popen([sys.executable, "-m", "controller", "exec", "a", "--", "sh", "-c", script], cwd=ROOT,
                               env=two_nodes, stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert wrapper.stdout.readline() == "ready\n"
        wrapper.send_signal(sig)
        assert wrapper.wait(timeout=15) == 5
        assert wrapper.stdout.read() == "got-signal\n"
    finally:
        wrapper.kill()
        wrapper.wait()
    sleepers = subprocess.run(["pgrep", "-f", "^sleep 300$"], capture_output=True, text=True).stdout.split()
    assert not [p for p in sleepers if status_field(int(p), "Uid") not in ("", "0")]  # its group went too


def test_down_stops_running_programs_and_leaves_no_process_of_a_node(two_nodes):
    env = two_nodes
    stubborn = run(["exec", "-d", "a", "--", "sh", "-c", 'trap "" TERM; while true; do sleep 1; done'], env)
    polite = run(["exec", "-d", "b", "--", "sh", "-c", 'trap "echo terminated; exit 0" TERM; while true; do sleep 0.1; '
                                                    'done'], env)
    running = {r["id"]: r for r in records(env)}
    assert set(running) == {stubborn.stdout.strip(), polite.stdout.strip()}
    uids = {int(status_field(r["pid"], "Uid")) for r in running.values()}
    supervisors = {int(status_field(r["pid"], "PPid")) for r in running.values()}
    assert len(uids) == 2 and 0 not in uids and all(supervisors)

    polite_log = Path(running[polite.stdout.strip()]["log"])
    started = time.monotonic()
    down = run(["down"], env)
    assert polite_log.read_text().endswith("terminated\n")  # SIGTERM first: a program may clean up
    assert "removed 2 nodes" in down.stderr
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 5
    while (left := live_pids_of_uids(uids) + [p for p in supervisors if status_field(p, "Pid")]):
        assert time.monotonic() < deadline, f"left after down: {left}"
        time.sleep(0.1)


@pytest.fixture
def venv(tmp_path):
    """A virtual environment in the system's temporary directory (as the issue found it: under
    directories closed to others), with a helper program of its own in bin/."""
    path = tmp_path / "envs" / "flwr"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    helper = path / "bin" / "edgetb-helper"
    helper.write_text("#!/bin/sh\necho \"helper $(id -u)\"\n")
    for p in (path.parent, *(d for d in path.rglob("*") if d.is_dir()), path):
        p.chmod(0o755)
    helper.chmod(0o755)
    return str(path)


def test_a_declared_python_leads_the_nodes_path_and_is_in_its_view(testbed, tmp_path, venv):
    env = testbed
    nodes = write(tmp_path, "nodes.json", {"defaults": {"python": venv}, "nodes": [{"name": "a"}, {"name": "b"}]})
    run(["up", write(tmp_path, "links.json", LINKS), "--nodes", nodes], env)
    probe = "import os, sys; print(sys.prefix); print(os.environ['PATH'].split(':')[0])"
    assert run(["exec", "a", "--", "python3", "-c", probe], env).stdout.split() == [venv, f"{venv}/bin"]
    helper = run(["exec", "a", "--", "edgetb-helper"], env).stdout.split()  # started by name
    assert helper[0] == "helper" and helper[1] != "0"
    detached = run(["exec", "-d", "b", "--", "sh", "-c", "command -v python3; command -v edgetb-helper"],
                   env).stdout.strip()
    assert run(["logs", "-f", detached], env).stdout.split() == [f"{venv}/bin/python3", f"{venv}/bin/edgetb-helper"]
    write_it = run(["exec", "a", "--", "touch", f"{venv}/written"], env, check=False)
    assert write_it.returncode != 0 and not os.path.exists(f"{venv}/written")  # read-only
    # nothing else of /tmp: not the files beside it; the worker's state dir there covered (no file)
    assert set(run(["exec", "a", "--", "ls", str(tmp_path)], env).stdout.split()) <= {"envs", "state"}
    assert run(["exec", "a", "--", "find", str(tmp_path / "state"), "-type", "f"], env).stdout == ""


@pytest.mark.parametrize("case", ["missing", "unreadable", "not-a-python"])
def test_a_declared_python_that_cannot_serve_is_refused_before_anything_is_made(testbed, tmp_path, venv, case):
    env = testbed
    bad = {"missing": str(tmp_path / "nope"), "unreadable": str(tmp_path / "closed"), "not-a-python": str(tmp_path / "envs")}[case]
    if case == "unreadable":
        shutil.copytree(venv, bad, symlinks=True)
        os.chmod(bad, 0o750)
    nodes = write(tmp_path, "nodes.json", {"nodes": [{"name": "a", "python": venv}, {"name": "b", "python": bad}]})
    up = run(["up", write(tmp_path, "links.json", LINKS), "--nodes", nodes], env, check=False)
    says = {"missing": "it does not exist", "unreadable": "cannot read the environment",
            "not-a-python": "not a Python environment"}[case]
    assert up.returncode != 0 and f"node 'b': python '{bad}'" in up.stderr and says in up.stderr, up.stderr
    assert "node 'a'" not in up.stderr
    assert_nothing_left(env)
    status = json.loads(run(["status", "--json"], env).stdout)
    assert status["nodes"] == [] and status["processes_running"] == 0


API_SCRIPT = """
import json, os, sys, time
from controller.workers.connect import connect
from controller.workers import programs

worker = connect(os.environ["EDGETB_ID"], os.environ["EDGETB_SUBNET"])
done = programs.run(worker, "a", ["sh", "-c", 'echo "$X $(id -u)"; exit 3'], {"X": "ran"})
proc = programs.start(worker, "b", ["sh", "-c", 'echo "up $Y"; trap "echo bye; exit 0" TERM; sleep 600 & wait'],
                      {"Y": "b"})
deadline = time.monotonic() + 10
while not (seen := "".join(programs.follow(worker, proc["id"], keep_following=False))):
    assert time.monotonic() < deadline
    time.sleep(0.1)
listed = [(p["id"], p["node"], p["running"]) for p in programs.processes(worker, "b")]
stopped = programs.stop(worker, proc["id"])
print(json.dumps({"done": done, "seen": seen, "listed": listed, "id": proc["id"], "stopped": stopped,
                  "after": programs.processes(worker)}))
"""


def test_the_python_api_runs_starts_lists_reads_and_stops_programs(two_nodes):
    env = two_nodes
    out = subprocess.run([sys.executable, "-c", API_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["done"]["returncode"] == 3 and got["done"]["stdout"].split()[0] == "ran"
    assert got["done"]["stdout"].split()[1] != "0"  # as the node
    assert got["seen"] == "up b\n" and got["listed"] == [[got["id"], "b", True]]
    assert got["stopped"]["stopped"] is True and got["after"] == []  # (its exit code: the supervisor's to see)

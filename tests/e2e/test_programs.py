"""Your own programs in nodes through the edgetb command: exec --detach with --env, ps, logs [-f],
stop, signals passed to an attached exec, and down with programs still running."""
from __future__ import annotations

import json
import os
import secrets
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
def two_nodes(tmp_path):
    """Nodes a (10.233.0.2) and b (10.233.0.3) of a testbed of their own; always taken down."""
    tb = "p" + secrets.token_hex(2)
    env = dict(os.environ, EDGETB_ID=tb, EDGETB_SUBNET=SUBNET, EDGETB_STATE_DIR=str(tmp_path / "state"))
    run(["up", write(tmp_path, "links.json", LINKS)], env)
    yield env
    run(["down"], env, check=False)
    from worker.nodes.netns import NetnsRuntime
    from worker.state import StateStore

    left = NetnsRuntime(StateStore(tb, str(tmp_path / "state")), SUBNET).leftovers()
    assert not any(left.values()), left


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

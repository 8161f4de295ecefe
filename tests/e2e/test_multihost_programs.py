"""Your own programs in nodes of another host (issue 46, the multi-host tier): the edgetb command
driving an agent over the LAN (tests/e2e/lan.py, its certificate pinned) brings up nodes with a
declared Python, runs programs detached with an environment, lists them, follows a log, stops
one, and takes the testbed down with programs running, leaving no process of a node's uid.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.e2e.lan import Lan
from tests.e2e.test_cli import run, write
from tests.e2e.test_programs import live_pids_of_uids, status_field

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
LINKS = {"a": [{"dest": "b", "bw": "10mbit"}], "b": [{"dest": "a", "bw": "10mbit"}]}


@pytest.fixture
def remote(tmp_path):
    """(the edgetb command's environment and arguments for an agent on another host of a LAN,
    the host); the agent resets and the LAN goes at teardown, nothing of them left."""
    lan = Lan(tmp_path)
    try:
        host = lan.add_host("netns", f"10.{lan.octet}.16.0/20")
        base = ["--agent", host["url"], "--token-file", str(host["token_file"]),
                "--agent-fingerprint", host["fingerprint"]]
        yield {k: v for k, v in os.environ.items() if k not in ("EDGETB_TOKEN", "EDGETB_AGENT")}, base, host
    finally:
        left = lan.close()
        assert not left, f"the agent left namespaces behind: {left}"


@pytest.fixture
def venv(tmp_path):
    """A virtual environment readable by others, with a helper program of its own in bin/."""
    path = tmp_path / "envs" / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    helper = path / "bin" / "etb-remote-helper"
    helper.write_text("#!/bin/sh\necho \"helper $(id -u) $GREETING\"\n")
    for p in (path.parent, path, *(d for d in path.rglob("*") if d.is_dir())):
        p.chmod(0o755)
    helper.chmod(0o755)
    return str(path)


def test_programs_on_another_host_through_its_agent(remote, tmp_path, venv):
    env, base, host = remote
    missing = str(tmp_path / "envs" / "gone")
    links = write(tmp_path, "links.json", LINKS)
    refused = run([*base, "up", links, "--nodes", write(tmp_path, "bad.json", {
        "nodes": [{"name": "a", "python": venv}, {"name": "b", "python": missing}]})], env, check=False)
    assert refused.returncode != 0 and f"node 'b': python '{missing}': it does not exist" in refused.stderr, \
        refused.stderr
    assert json.loads(run([*base, "status", "--json"], env).stdout)["nodes"] == []  # nothing made

    run([*base, "up", links, "--nodes", write(tmp_path, "nodes.json", {"defaults": {"python": venv},
                                                                        "nodes": [{"name": "a"}, {"name": "b"}]})], env)
    # the declared Python: first on PATH (its helper found by name), shown read-only
    probe = "import os, sys; print(sys.prefix); print(os.environ['PATH'].split(':')[0])"
    assert run([*base, "exec", "a", "--", "python3", "-c", probe], env).stdout.split() == [venv, f"{venv}/bin"]
    wrote = run([*base, "exec", "a", "--", "touch", f"{venv}/written"], env, check=False)
    assert wrote.returncode != 0 and not os.path.exists(f"{venv}/written")

    # detached, with an environment; listed; its log followed to its end
    greeter = run([*base, "exec", "--detach", "--env", "GREETING=hi", "b", "--", "sh", "-c",
                   "etb-remote-helper; sleep 1; echo done"], env).stdout.strip()
    followed = run([*base, "logs", "-f", greeter], env).stdout.split("\n")
    assert followed[0].startswith("helper ") and followed[0].endswith(" hi") and followed[1] == "done", followed
    assert followed[0].split()[1] != "0"  # as the node's uid, not root
    # a server stopped by id; then two left running when the testbed goes down
    server = run([*base, "exec", "-d", "a", "--", "python3", "-m", "http.server", "8000"], env).stdout.strip()
    stubborn = run([*base, "exec", "-d", "a", "--", "sh", "-c", 'trap "" TERM; while true; do sleep 1; done'],
                   env).stdout.strip()
    polite = run([*base, "exec", "-d", "b", "--", "sh", "-c",
                  'trap "echo terminated; exit 0" TERM; while true; do sleep 0.1; done'], env).stdout.strip()
    listed = {p["id"]: p for p in json.loads(run([*base, "ps", "--json"], env).stdout)}
    assert {server, stubborn, polite} <= set(listed) and all(listed[i]["running"] for i in (server, stubborn, polite))
    assert listed[greeter]["running"] is False
    assert run([*base, "stop", server], env).stdout.startswith(f"stopped {server}")
    running = [p["id"] for p in json.loads(run([*base, "ps", "--json", "a"], env).stdout) if p["running"]]
    assert running == [stubborn]
    uids = {int(status_field(listed[i]["pid"], "Uid")) for i in (stubborn, polite)}
    assert len(uids) == 2 and 0 not in uids

    started = time.monotonic()
    down = run([*base, "down"], env)
    assert "removed 2 nodes" in down.stderr, down.stderr
    assert time.monotonic() - started < 60
    assert open(listed[polite]["log"]).read().endswith("terminated\n")  # SIGTERM first
    deadline = time.monotonic() + 5
    while left := live_pids_of_uids(uids):
        assert time.monotonic() < deadline, f"left after down: {left}"
        time.sleep(0.1)

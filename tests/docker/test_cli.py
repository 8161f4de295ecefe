"""``edgetb up --runtime docker``: the user's command brings a network up as containers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.docker.conftest import DOCKER, assert_no_leftovers
from tests.netns.conftest import free_subnet, new_testbed_id
from worker.host import WorkerHost

pytestmark = DOCKER
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def edgetb(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controller", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_up_exec_shape_down_with_docker_nodes(tmp_path):
    tb, subnet = new_testbed_id(), free_subnet()
    state = str(tmp_path / "state")
    env = {**os.environ, "EDGETB_STATE_DIR": state, "EDGETB_ID": tb, "EDGETB_SUBNET": subnet}
    links = tmp_path / "links.json"
    links.write_text(json.dumps({"n1": [{"dest": "n2", "bw": "10mbit"}], "n2": [{"dest": "n1", "bw": "5mbit"}]}))
    nodes = tmp_path / "nodes.json"
    nodes.write_text(json.dumps({"nodes": [{"name": "n1", "cpu": 0.5, "mem": "128M"}, {"name": "n2"}]}))
    try:
        up = edgetb(env, "up", "--runtime", "docker", str(links), "--nodes", str(nodes))
        assert up.returncode == 0, up.stderr
        status = json.loads(edgetb(env, "status", "--json").stdout)
        assert status["runtime"] == "docker" and [n["shaped"] for n in status["nodes"]] == [True, True]
        n2 = next(n["ip"] for n in status["nodes"] if n["name"] == "n2")
        ping = edgetb(env, "exec", "n1", "--", "ping", "-c", "1", "-W", "2", n2)
        assert ping.returncode == 0 and "1 received" in ping.stdout, ping
        assert edgetb(env, "exec", "n1", "--", "sh", "-c", "exit 7").returncode == 7
        shown = edgetb(env, "shape", "show", "n1")
        assert shown.returncode == 0 and "verified: yes" in shown.stdout, shown
        down = edgetb(env, "down")
        assert down.returncode == 0 and "removed 2 nodes" in down.stderr, down.stderr
    finally:
        host = WorkerHost(tb, subnet, state_root=state, runtime="docker")
        host.reset()
        assert_no_leftovers(host)

"""The real agent process with ``--runtime docker``, driven over HTTP as the controller does."""
from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time

import requests

from controller.workers.agent_client import AgentClient
from tests.docker.conftest import DOCKER, assert_no_leftovers
from tests.netns.conftest import free_subnet, new_testbed_id
from worker.host import WorkerHost

pytestmark = DOCKER
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_docker_agent_nodes_links_processes_reset(tmp_path):
    token = secrets.token_hex(16)
    port, tb, subnet = _free_port(), new_testbed_id(), free_subnet()
    state = str(tmp_path / "state")
    env = dict(os.environ, EDGETB_TOKEN=token, EDGETB_STATE_DIR=state)
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worker.agent", "--port", str(port),
                                 "--listen", "127.0.0.1", "--plain-http",
                                 "--id", tb, "--subnet", subnet, "--runtime", "docker"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    client = AgentClient(url, token, timeout_s=120)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if requests.get(url + "/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.05)
        caps = client.capabilities()
        assert caps["runtime"] == "docker" and "docker" in caps["runtimes"], caps
        made = client.create_nodes({"version": 1, "nodes": [{"name": "a", "cpu": 0.5}, {"name": "b"}]})["nodes"]
        ip = {n["name"]: n["ip"] for n in made}
        shaped = client.set_links({"version": 1, "links": [
            {"src": "a", "dst": "b", "dst_ip": ip["b"], "shape": {"rate_bps": 10_000_000}}]})
        assert shaped["nodes"][0]["verified"]
        # a server in a container, reached from the host by the container's own address (no published port)
        server = client.start_process("b", {"version": 1, "argv": ["python3", "-m", "http.server", "8000"]})
        deadline = time.monotonic() + 20
        while True:
            try:
                if requests.get(f"http://{ip['b']}:8000/", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "the server in container b did not answer"
            time.sleep(0.1)
        out = client.exec("a", {"version": 1, "argv": ["python3", "-c",
                                                       f"import urllib.request; print(urllib.request.urlopen('http://{ip['b']}:8000/').status)"]})
        assert out["stdout"].strip() == "200", out
        assert [p["running"] for p in client.processes()["processes"]] == [True]
        client.stop_process("b", server["id"])
        assert client.processes()["processes"] == []
        assert client.reset()["removed"]["nodes"] == 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        host = WorkerHost(tb, subnet, state_root=state, runtime="docker")
        host.reset()
        assert_no_leftovers(host)

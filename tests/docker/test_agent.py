"""The real agent process with ``--runtime docker``, driven over HTTP as the controller does."""
from __future__ import annotations

import time

import requests

from tests.docker.conftest import DOCKER, docker_agent

pytestmark = DOCKER


def test_docker_agent_nodes_links_processes_reset(tmp_path):
    with docker_agent(tmp_path) as client:
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

"""The real agent process over HTTP: token required for every state change, JSON errors, size limit."""
import json
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest
import requests

from controller.agent_client import AgentClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent(tmp_path):
    token = secrets.token_urlsafe(24)
    port = _free_port()
    tb = "a" + secrets.token_hex(2)
    env = dict(os.environ, EDGETB_TOKEN=token, EDGETB_STATE_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "worker.agent", "--port", str(port), "--bind", "127.0.0.1",
                             "--id", tb, "--subnet", "10.249.0.0/16"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            requests.get(url + "/health", timeout=1)
            break
        except requests.ConnectionError:
            time.sleep(0.05)
    client = AgentClient(url, token)
    yield url, token, client
    try:
        client.reset()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    from worker.runtime_netns import Naming
    from worker import nsfs

    assert not [n for n in nsfs.list_netns() if Naming(tb).owns_netns(n)]


STATE_CHANGING = [("post", "/nodes", {"version": 1, "nodes": [{"name": "x"}]}),
                  ("put", "/links", {"version": 1, "links": []}),
                  ("patch", "/links", {"version": 1, "links": []}),
                  ("delete", "/links", None),
                  ("post", "/nodes/x/exec", {"version": 1, "argv": ["true"]}),
                  ("post", "/nodes/x/processes", {"version": 1, "argv": ["true"]}),
                  ("post", "/reset", {"version": 1})]


@pytest.mark.parametrize("method,path,body", STATE_CHANGING)
def test_state_changes_need_the_token(agent, method, path, body):
    url, _, client = agent
    for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": "Basic abc"}):
        resp = requests.request(method, url + path, json=body, headers=headers, timeout=10)
        assert resp.status_code == 401, (path, headers, resp.text)
        assert resp.json()["error"] == "unauthorized" and "detail" in resp.json()
    assert client.status()["nodes"] == []  # nothing was created


def test_nodes_links_exec_over_http(agent):
    url, token, client = agent
    assert requests.get(url + "/health", timeout=5).json()["ok"] is True
    nodes = client.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    again = client.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    assert nodes == again  # idempotent
    b_ip = nodes[1]["ip"]
    shaped = client.set_links({"version": 1, "links": [{"src": "a", "dst": "b", "dst_ip": b_ip,
                                                        "shape": {"rate_bps": 10**7}}]})
    assert shaped["nodes"][0]["verified"] is True
    out = client.exec("a", {"version": 1, "argv": ["ip", "-br", "addr", "show", "eth0"]})
    assert nodes[0]["ip"] in out["stdout"] and out["returncode"] == 0

    auth = {"Authorization": f"Bearer {token}"}
    bad_json = requests.post(url + "/nodes", data="{not json", headers={**auth, "Content-Type": "application/json"}, timeout=5)
    assert bad_json.status_code == 400 and bad_json.json()["error"] == "config_error"
    huge = requests.post(url + "/nodes", data=b"x" * (17 * 1024 * 1024),
                         headers={**auth, "Content-Type": "application/json"}, timeout=30)
    assert huge.status_code == 413 and "error" in huge.json()
    missing = requests.post(url + "/nodes/nobody/exec", json={"version": 1, "argv": ["true"]}, headers=auth, timeout=5)
    assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    bad_name = requests.post(url + "/nodes", json={"version": 1, "nodes": [{"name": "x; reboot"}]}, headers=auth, timeout=5)
    assert bad_name.status_code == 400 and "x; reboot" in json.dumps(bad_name.json())
    assert len(client.status()["nodes"]) == 2

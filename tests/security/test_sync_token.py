"""The run's token and the code sync (hardening of issue 46's review): agents fetch the run's
files over plain HTTP on the LAN, so the token they got over their pinned TLS channel must never
cross that connection, and the controller must refuse a fetch that carries the bare token.

Attacks: someone on the LAN records an agent's sync (a TCP relay in its way, as a sniffer);
with what it saw, or with the token as a bearer, it fetches files from the real controller.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from controller.workers import files
from controller.workers.agent_client import AgentClient
from tests.security.test_agent_transport import TOKEN, agents, fingerprint_of, serve_code  # noqa: F401 (fixture)
from tests.security.test_controller_callers import make_controller  # noqa: F401 (fixture)
from tests.security.test_pair_keys import Recorder
from worker.api import file_auth

pytestmark = pytest.mark.security

NODE_TOKEN = "node-token-" + "z" * 24
REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_run_token_never_crosses_the_plain_http_fetch(agents, tmp_path):
    src = tmp_path / "src"
    (src / "dml_app").mkdir(parents=True)
    (src / "dataset").mkdir()
    (src / "dml_app" / "role.py").write_text("print('the code')\n")
    (src / "dataset" / "shard.npz").write_bytes(b"shard" * 1000)
    server = serve_code(src, NODE_TOKEN)
    sniffer = Recorder(("127.0.0.1", server.server_port))  # what the agent sends, as a sniffer sees it
    agent = agents("--listen", "127.0.0.1", "--workdir", str(tmp_path / "agent-work")).start()
    client = AgentClient(f"https://127.0.0.1:{agent.port}", TOKEN, name="e1", fingerprint=fingerprint_of(agent))
    try:
        trusted = files.manifest(str(src), ("dml_app", "dataset"))
        done = client.sync({"version": 1, "url": f"http://127.0.0.1:{sniffer.port}", "token": NODE_TOKEN,
                            "manifest": trusted})
        assert done["fetched"] == 2, done
        time.sleep(0.2)  # the relay's last bytes
        seen = bytes(sniffer.sent)
        assert b"GET /files/dml_app/role.py" in seen and b"GET /files/dataset/shard.npz" in seen  # it saw the sync
        assert NODE_TOKEN.encode() not in seen, "the run's token crossed the plain-HTTP connection"
        assert b"Bearer" not in seen
        # what it saw fetches nothing else: a recorded signature is for its own path only
        request = seen[seen.index(b"GET /files/dml_app/role.py"):]
        header = next(line for line in request.split(b"\r\n") if line.startswith(b"Authorization: "))
        stolen = header.split(b": ", 1)[1].decode()
        other = requests.get(f"http://127.0.0.1:{server.server_port}/files/dataset/shard.npz",
                             headers={"Authorization": stolen}, timeout=10)
        assert other.status_code == 401
    finally:
        sniffer.close()
        server.shutdown()


def test_the_controller_refuses_the_bare_token_and_serves_a_signed_fetch(make_controller):  # noqa: F811
    exp, served, _ = make_controller()
    url = f"http://127.0.0.1:{served.port}/files/dml_app/node.py"
    for header in (f"Bearer {exp.node_token}", exp.node_token, "",
                   file_auth.header(exp.node_token, "GET", "/files/dml_app/roles/gossip.py"),
                   file_auth.header("another run's token-0123456789", "GET", "/files/dml_app/node.py"),
                   file_auth.header(exp.node_token, "GET", "/files/dml_app/node.py", now=time.time() - 3600)):
        resp = requests.get(url, headers={"Authorization": header} if header else {}, timeout=10)
        assert resp.status_code == 401, (header, resp.status_code)
        assert exp.node_token not in resp.text
    resp = requests.get(url, headers={"Authorization": file_auth.header(exp.node_token, "GET", "/files/dml_app/node.py")},
                        timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.content == (REPO_ROOT / "dml_app" / "node.py").read_bytes()


@pytest.mark.parametrize("skew_s", [-file_auth.MAX_SKEW_S + 5, file_auth.MAX_SKEW_S - 5])
def test_a_signature_holds_across_a_small_clock_skew_only(skew_s):
    signed = file_auth.header(NODE_TOKEN, "GET", "/files/dml_app/a.py", now=time.time() + skew_s)
    assert file_auth.verify(NODE_TOKEN, signed, "GET", "/files/dml_app/a.py")
    late = file_auth.header(NODE_TOKEN, "GET", "/files/dml_app/a.py",
                            now=time.time() - file_auth.VALID_S - file_auth.MAX_SKEW_S - 5)
    assert not file_auth.verify(NODE_TOKEN, late, "GET", "/files/dml_app/a.py")

"""A route that answers from the headers: the caller's body never crosses (Expect: 100-continue)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dml_app.runtime import http
from dml_app.runtime.http import request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BODY = bytes(range(256)) * 2048  # 512 KiB: over any socket buffer's first window


SERVER = """
import socket
from dml_app.node import NoDelayServer
from dml_app.runtime.http import Router, json_response
BODY = bytes(range(256)) * 2048
router = Router(name="n1")
router.add("POST", "/take", lambda req: json_response({"took": len(req.body), "same": req.body == BODY}), "public",
           len(BODY), early=lambda req: json_response({"accepted": False}) if req.query.get("refuse") else None)
server = NoDelayServer(("127.0.0.1", 0), router, log=None)  # the node's own server
server.start()
print(server.server_port, server.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), flush=True)
server.serve_forever()
"""


@pytest.fixture
def server():
    """A node's server, in a process of its own, with one route that refuses early when asked."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port, nodelay = proc.stdout.readline().split()
        assert nodelay != "0", "a 100 Continue and then the answer: the answer would wait for a delayed ACK"
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_an_early_answer_leaves_the_body_unsent_and_a_taken_body_arrives_whole(server, monkeypatch):
    url = server
    sent: list[int] = []
    real_send = http._sendall
    monkeypatch.setattr(http, "_sendall", lambda sock, data: sent.append(len(data)) or real_send(sock, data))

    status, answer = request("POST", url + "/take?refuse=1", BODY, "application/octet-stream", timeout_s=10,
                             expect_continue=True)
    assert (status, answer) == (200, b'{"accepted": false}')
    assert sum(sent) < 4096, sent  # the headers only

    sent.clear()
    status, answer = request("POST", url + "/take", BODY, "application/octet-stream", timeout_s=10,
                             expect_continue=True)
    assert status == 200 and answer == b'{"took": 524288, "same": true}'
    assert sum(sent) > len(BODY)

    status, answer = request("POST", url + "/take", BODY, "application/octet-stream", timeout_s=10)
    assert answer == b'{"took": 524288, "same": true}'  # (without Expect, as before)

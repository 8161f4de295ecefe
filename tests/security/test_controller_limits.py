"""What one node, or anyone who reaches the controller's port, can make the controller hold.

Attacks, each bounded on the real app over real sockets: a node answers with a gzip bomb or a
huge body; a caller announces a 60 MiB /log without a valid signature; a node prints rounds
and layers of its choosing and NaN; idle connections pile up; the port is reached from
another address of the machine.
"""
from __future__ import annotations

import gzip
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from controller.runner import listen_addresses
from tests.security.callers_fixtures import free_port
from tests.security.test_controller_callers import lan_address, make_controller, node_post, run_as_nobody  # noqa: F401
from worker import serving
from worker.admission import Places
from worker.api.errors import ConfigError, TestbedError

BOMB_BYTES = 20 << 20  # what the node's 20 KiB gzip answer expands to


class BadNode(BaseHTTPRequestHandler):
    """A node that answers with more than anyone asked for; records each Accept-Encoding."""

    seen: list = []
    bomb = gzip.compress(b" " * BOMB_BYTES, 9)
    big = json.dumps({"pad": "x" * (2 << 20)}).encode()

    def _answer(self) -> None:
        BadNode.seen.append(self.headers.get("Accept-Encoding"))
        if self.headers.get("Content-Length"):
            self.rfile.read(int(self.headers["Content-Length"]))
        if self.path in ("/health", "/gzip"):
            body, extra = self.bomb, {"Content-Encoding": "gzip"}
        elif self.path == "/big":
            body, extra = self.big, {}
        elif self.path == "/deep":
            body, extra = b"[" * 5000 + b"]" * 5000, {}
        elif self.path == "/trickle":  # a byte every 0.4 s: each read is quick, the whole never ends
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.4)
            return
        else:
            body, extra = b'{"ok": true}', {}
        self.send_response(200)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **extra}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def bad_node():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BadNode)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    BadNode.seen = []
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_a_node_answer_is_read_raw_and_capped(make_controller, bad_node):
    exp, _, _ = make_controller()
    exp.nodes["n1"].ip, exp.nodes.port = "127.0.0.1", bad_node
    assert exp.nodes.post("n1", "/ok", {}) == {"ok": True}
    assert exp.nodes.health("n1") is None  # a compressed answer is not a health report
    with pytest.raises(ConfigError, match="Content-Encoding 'gzip'"):
        exp.nodes.post("n1", "/gzip", {})
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        exp.nodes.post("n1", "/big", {})
    with pytest.raises(ConfigError, match="no JSON"):  # nested past the bound: malformed, not a crash
        exp.nodes.post("n1", "/deep", {})
    started = time.monotonic()
    with pytest.raises(TestbedError, match="took longer than 2s"):  # a trickle holds the call no longer
        exp.nodes.call("n1", "GET", "/trickle", 2)
    assert time.monotonic() - started < 5
    assert BadNode.seen and set(BadNode.seen) == {"identity"}, BadNode.seen


def test_calls_to_nodes_ignore_the_proxy_environment(make_controller, bad_node, monkeypatch):
    """Institutions set $HTTP_PROXY: the controller's calls to its own nodes never go there."""
    exp, _, _ = make_controller()
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # nothing listens: a proxied call fails
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    exp.nodes["n1"].ip, exp.nodes.port = "127.0.0.1", bad_node
    assert exp.nodes.post("n1", "/ok", {}) == {"ok": True}


def _answer_within(port: int, request: bytes, seconds: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=seconds) as s:
        s.sendall(request)
        try:
            return s.recv(4096)
        except socket.timeout:
            return b""


def test_a_log_upload_is_authenticated_before_its_body_is_read(make_controller):
    exp, served, _ = make_controller()
    body = b'{"kind": "x"}\n'
    forged = {**exp.keys.node_headers("n1", "POST", "/log", body), "X-Edgetb-Sig": "00" * 32}
    head = "".join(f"{k}: {v}\r\n" for k, v in forged.items())
    # 60 MiB announced, not one byte sent: the answer comes from the headers alone
    answer = _answer_within(served.port, f"POST /log HTTP/1.1\r\nHost: localhost\r\n{head}"
                                         f"Content-Length: {60 << 20}\r\n\r\n".encode(), 5)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    # signed for one body, another sent: refused
    signed = exp.keys.node_headers("n1", "POST", "/log", body)
    resp = requests.post(served.url + "/log", data=b'{"kind": "y"}\n', headers=signed, timeout=10)
    assert resp.status_code == 401 and "not the one signed" in resp.text, resp.text
    # the node's own upload goes through
    resp = requests.post(served.url + "/log", data=body, headers=exp.keys.node_headers("n1", "POST", "/log", body),
                         timeout=10)
    assert resp.status_code == 200 and resp.json()["stored"] is True, resp.text


def test_print_keeps_only_the_run_rounds_and_finite_values(make_controller):
    exp, served, _ = make_controller()  # sync 2: rounds 0 to 2, no E-tree layers
    for bad in ({"round": 10 ** 9}, {"round": -1}, {"round": 1.5}, {"round": 1, "layer": 7}):
        resp = node_post(exp, served, "/print", {"msg": "x", "accuracy": 0.5, **bad})
        assert resp.status_code == 400, (bad, resp.text)
    assert exp.nodes["n1"].accuracy is None and exp.live._by_round == {}
    resp = node_post(exp, served, "/print", {"msg": "x", "round": 2, "accuracy": 0.5, "loss": 1.0})
    assert resp.status_code == 200, resp.text
    body = b'{"msg": "x", "round": 2, "accuracy": NaN, "loss": Infinity, "global_accuracy": -Infinity}'
    headers = {"Content-Type": "application/json", **exp.keys.node_headers("n1", "POST", "/print", body)}
    assert requests.post(served.url + "/print", data=body, headers=headers, timeout=10).status_code == 200
    assert exp.nodes["n1"].accuracy == 0.5 and exp.nodes["n1"].loss == 1.0
    # a number too large for a float is dropped; nesting past the bound is no object: neither is a 500
    for body, status in ((b'{"msg": "x", "round": 2, "accuracy": 1' + b"0" * 400 + b"}", 200), (b"[" * 5000, 404)):
        headers = {"Content-Type": "application/json", **exp.keys.node_headers("n1", "POST", "/print", body)}
        assert requests.post(served.url + "/print", data=body, headers=headers, timeout=10).status_code == status
    assert exp.nodes["n1"].accuracy == 0.5
    assert set(exp.live._by_round) == {2}
    assert all(math.isfinite(v) for series in exp.live._by_round[2] for v in series), exp.live._by_round


def test_an_idle_connection_is_closed(make_controller, monkeypatch):
    monkeypatch.setattr(serving, "IDLE_READ_S", 1.0)
    _, served, _ = make_controller()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(b"GET /status HTTP/1.1\r\n")  # and nothing more
        started = time.monotonic()
        got = b""
        while chunk := s.recv(4096):  # an error answer at most, then the end
            got += chunk
        assert got == b"" or got.startswith(b"HTTP/1.1 4"), got
        assert time.monotonic() - started < 5


def test_an_untrusted_callers_connections_are_capped_and_roots_are_not(make_controller):
    """Root's connections are never refused for room; the nobody uid's share is 4 at once: its
    fifth is closed at accept, and a place it frees is its own again."""
    _, served, _ = make_controller(places=Places(per_caller=4, total=4096, trusted=frozenset({0})))
    status = b"GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n"
    roots = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(8)]
    try:
        for s in roots:
            s.sendall(status)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        for s in roots:
            s.close()
    codes = json.loads(run_as_nobody(HOLD_FIVE, served.port))
    assert codes == {"held": [200, 200, 200, 200], "fifth": "closed", "after_one_left": 200}, codes


# Run as nobody: 4 connections that each get an answer and stay open, a fifth (closed by the
# server at once: its recv ends), then one of the four closed and a new one answered.
HOLD_FIVE = r"""
import json, socket, sys, time
port = int(sys.argv[1])
status = b"GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n"

def ask(s):
    s.sendall(status)
    got = s.recv(4096)
    return int(got.split()[1]) if got else "closed"

held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
out = {"held": [ask(s) for s in held]}
with socket.create_connection(("127.0.0.1", port), timeout=10) as fifth:
    try:
        out["fifth"] = ask(fifth)
    except OSError:
        out["fifth"] = "closed"
held.pop().close()
deadline = time.monotonic() + 10
while True:  # the server gives the place back once it has seen the close
    with socket.create_connection(("127.0.0.1", port), timeout=10) as again:
        try:
            out["after_one_left"] = ask(again)
        except OSError:
            out["after_one_left"] = "closed"
    if out["after_one_left"] != "closed" or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(json.dumps(out))
"""


def test_the_controller_listens_on_loopback_and_the_nodes_address_only(make_controller):
    from controller.web.app import create_app

    exp, _, _ = make_controller()
    args = type("Args", (), {"subnet": "10.231.0.0/16", "listen": []})()
    assert listen_addresses(args, exp.worker) == ["127.0.0.1", "10.231.0.1"]
    args.listen = ["not-an-address"]
    with pytest.raises(ValueError, match="not-an-address"):
        listen_addresses(args, exp.worker)
    args.listen = []
    port = free_port()
    import gevent

    done = threading.Event()

    def serve() -> None:  # the bridge's address does not exist yet: bound all the same
        servers = serving.Servers([(a, port) for a in listen_addresses(args, exp.worker)], create_app(exp))
        servers.start()
        done.set()
        while done.is_set():
            gevent.sleep(0.05)
        servers.stop()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert done.wait(10)
        assert requests.get(f"http://127.0.0.1:{port}/status", timeout=10).status_code == 200
        lan = lan_address()
        if lan is not None:
            with pytest.raises(requests.ConnectionError):
                requests.get(f"http://{lan}:{port}/status", timeout=5)
    finally:
        done.clear()
        thread.join(10)

"""Who may drive the controller: the real app on a real socket, called by real local users.

Attacks from the security review, each refused while the legitimate path still works:
another local user resets the testbed with curl, borrows root's identity from closed sockets
of its own port (FIN-WAIT-2 decoys), or hangs up before its request is read; a page of another
site (foreign Host, Origin, Sec-Fetch-Site) drives it; a GET carries a large body; a node
prints escape sequences to the operator's terminal; an internal error leaks its text.
"""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import time

import pytest
import requests

from controller.model.topology import load_links
from controller.run.experiment import Experiment
from controller.run.nodes import Nodes
from controller.web import callers
from controller.web.app import create_app
from controller.web.live import LiveFeed
from tests.netns.conftest import free_subnet, new_testbed_id
from tests.security.callers_fixtures import NOBODY_UID, Served, curl_as, need_root
from worker import sockets
from worker.admission import Places
from worker.api.errors import ConfigError
from worker.host import WorkerHost

ADMIN_TOKEN = "admin-token-0123456789abcdef"
LINKS = {"n1": [{"dest": "n2", "bw": "10mbit"}], "n2": [{"dest": "n1", "bw": "10mbit"}]}


@pytest.fixture
def make_controller(tmp_path, monkeypatch):
    """Factory: (experiment, served app, progress lines), with the environment given (SUDO_UID,
    EDGETB_ALLOWED_HOSTS) at the controller's start. The worker is a real, empty WorkerHost."""
    need_root()
    made = []

    def make(env: dict | None = None, progress=None, record: list | None = None, places=None, **kw):
        for key in ("SUDO_UID", callers.ALLOWED_HOSTS_ENV):
            monkeypatch.delenv(key, raising=False)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        (tmp_path / "links.json").write_text(json.dumps(LINKS))
        worker = WorkerHost(new_testbed_id(), free_subnet(), state_root=str(tmp_path / "state"))
        lines: list[str] = []
        structure = {"n1": {"sync": 2}, "n2": {"sync": 2}}
        exp = Experiment(load_links(str(tmp_path / "links.json")), Nodes(str(tmp_path), worker, structure), structure,
                         progress=progress or lines.append)
        exp.live = LiveFeed(exp)
        app = create_app(exp, admin_token=kw.pop("admin_token", ADMIN_TOKEN), **kw)
        served = Served(app if record is None else recording(app, record), places)
        made.append((served, worker))
        return exp, served, lines

    yield make
    for served, worker in made:
        served.close()
        worker.reset()
        assert not any(worker.runtime.leftovers().values())


def recording(app, seen: list):
    """``app``, appending (method, path, status) to ``seen`` for each answer it gives (the
    answers to callers that hung up are not seen otherwise)."""
    def wsgi(environ, start_response):
        def start(status, headers, exc_info=None):
            seen.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], int(status[:3])))
            return start_response(status, headers, exc_info)
        return app(environ, start)
    return wsgi


def lan_address() -> str | None:
    """A non-loopback IPv4 address of this machine (a caller from it is not on loopback)."""
    for addr in sorted(callers.local_addresses()):
        if ":" not in addr and not addr.startswith("127."):
            return addr
    return None


# --- the kernel's socket table ----------------------------------------------------------------

def test_the_socket_table_names_the_owner_of_a_connection():
    need_root()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert sockets.listener_uid("127.0.0.1", port) == 0
        with socket.create_connection(("127.0.0.1", port)) as client:
            peer, _ = server.accept()
            with peer:
                here = ("127.0.0.1", port)
                assert sockets.peer_uid("127.0.0.1", client.getsockname()[1], here) == 0
                assert sockets.peer_uid("::ffff:127.0.0.1", client.getsockname()[1], here) == 0
                assert sockets.peer_uid("127.0.0.1", client.getsockname()[1], ("127.0.0.1", port + 1)) is None
                assert sockets.peer_uid("127.0.0.1", client.getsockname()[1], ("127.0.0.2", port)) is None
    if socket.has_ipv6 and "::1" in callers.local_addresses():  # the IPv6 table too
        with socket.socket(socket.AF_INET6) as server:
            server.bind(("::1", 0))
            server.listen()
            port = server.getsockname()[1]
            assert sockets.listener_uid("::1", port) == 0 and sockets.listener_uid("127.0.0.1", port) is None
            with socket.create_connection(("::1", port)) as client:
                peer, _ = server.accept()
                with peer:
                    assert sockets.peer_uid("::1", client.getsockname()[1], ("::1", port)) == 0
    assert callers.trusted_uids({"SUDO_UID": "1234"}) == {0, 1234}
    assert callers.trusted_uids({"SUDO_UID": "x"}) == {0}


# --- caller identity --------------------------------------------------------------------------

def test_another_local_user_cannot_reset_and_root_can(make_controller):
    exp, served, _ = make_controller()
    for method in ("GET", "POST"):
        code, body = curl_as(NOBODY_UID, method, served.url + "/emulated/reset")
        assert code == 403 and body["error"] == "forbidden", (code, body)
        assert f"uid {NOBODY_UID}" in body["message"], body
        assert exp.phase == "created"
    for path in ("/conf/dataset", "/conf/structure", "/start", "/finish", "/update/tc?file=links.json",
                 "/physical/reset"):
        code, body = curl_as(NOBODY_UID, "GET", served.url + path)
        assert code == 403, (path, code, body)
    # anyone on loopback reads the status
    code, body = curl_as(NOBODY_UID, "GET", served.url + "/status")
    assert code == 200 and body["phase"] == "created", body
    # root (this test) resets, as `sudo curl` or a root shell would
    resp = requests.get(served.url + "/emulated/reset", timeout=30)
    assert resp.status_code == 200, resp.text
    assert exp.phase == "reset"


# Run as nobody by /usr/bin/python3: 32 decoy connections from local port P to 127.0.0.2 ...
# 127.0.0.33 (each reads the start of /api/stream, then hangs up: the server keeps its end, the
# caller's is an orphan in FIN-WAIT-2, uid 0, inode 0), then a live one from P to 127.0.0.1 that
# asks for a reset; prints each try's status.
DECOYS = r"""
import json, socket, sys
port, tries = int(sys.argv[1]), int(sys.argv[2])

def bound(local_port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", local_port))
    return s

codes = []
for _ in range(tries):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        p = probe.getsockname()[1]
    for k in range(2, 34):
        with bound(p) as s:
            s.connect((f"127.0.0.{k}", port))
            s.sendall(b"GET /api/stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
            got = b""
            while got.count(b"\n\n\r\n") < 2:  # all it sends at first (retry, data): unread data means RST
                got += s.recv(4096)
    with bound(p) as s:
        s.connect(("127.0.0.1", port))
        s.sendall(b"POST /emulated/reset HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n"
                  b"Connection: close\r\n\r\n")
        codes.append(int(s.recv(64).split()[1]))
print(json.dumps(codes))
"""

# Run as nobody: GET /status and POST /emulated/reset pipelined, the sending side shut, the answers
# read (prints the reset's status for each try); then a reset sent, the sending side shut and the
# socket closed at once (an orphan caller's end: uid 0, inode 0), as many times.
HANG_UP = r"""
import json, re, socket, sys, time
port, tries = int(sys.argv[1]), int(sys.argv[2])
reset = b"POST /emulated/reset HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n"
codes = []
for _ in range(tries):
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n" + reset)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    codes.append([int(code) for code in re.findall(rb"HTTP/1.1 (\d{3}) ", got)])
for _ in range(tries):
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(reset)
    s.shutdown(socket.SHUT_WR)
    s.close()
    time.sleep(0.01)
print(json.dumps(codes))
"""


def run_as_nobody(script: str, *args) -> str:
    done = subprocess.run(["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups",
                           "/usr/bin/python3", "-c", script, *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_closed_socket_lends_no_identity_to_a_live_one(make_controller, monkeypatch):
    """Closed sockets of the attacker's local port stay in the table with uid 0: none of them
    names the caller of a live connection."""
    from controller.web import dashboard

    # the server's next write to a decoy (a keep-alive line) ends it: 3200 decoys come and go
    monkeypatch.setattr(dashboard, "KEEPALIVE_S", 1.0)
    monkeypatch.setattr(dashboard, "PUSH_CHECK_S", 0.5)
    # the decoys are nobody's: its shares would refuse them before the server notices they left
    exp, served, _ = make_controller(places=Places(per_caller=4096, streams_per_caller=4096))
    codes = json.loads(run_as_nobody(DECOYS, served.port, 100))
    assert codes == [403] * 100, codes
    assert exp.phase == "created"
    assert requests.post(served.url + "/emulated/reset", timeout=30).status_code == 200  # root still can


def test_a_caller_that_shut_its_end_or_hung_up_is_nobody(make_controller):
    seen: list = []
    exp, served, _ = make_controller(record=seen)
    codes = json.loads(run_as_nobody(HANG_UP, served.port, 100))
    assert codes == [[200, 403]] * 100, codes
    deadline = time.monotonic() + 30
    while sum(1 for m, _, _ in seen if m == "POST") < 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    resets = [code for method, path, code in seen if method == "POST"]
    assert resets == [403] * 200, resets
    assert exp.phase == "created"


def test_the_sudo_user_is_accepted_and_others_are_not(make_controller):
    exp, served, _ = make_controller({"SUDO_UID": "4321"})
    code, body = curl_as(4322, "POST", served.url + "/physical/reset")
    assert code == 403, body
    code, body = curl_as(4321, "POST", served.url + "/physical/reset")
    assert code == 200 and body["reset"] is True, body
    code, body = curl_as(4321, "GET", served.url + "/emulated/reset")
    assert code == 200, body
    assert exp.phase == "reset"


def test_the_admin_token_is_accepted_from_any_local_user_and_refused_in_clear_from_other_hosts(make_controller,
                                                                                               caplog):
    exp, served, _ = make_controller()
    code, body = curl_as(NOBODY_UID, "POST", served.url + "/physical/reset",
                         {"Authorization": "Bearer wrong-token-wrong-token"})
    assert code == 403, body
    # on loopback (an SSH tunnel's end): any local user with the token
    code, body = curl_as(NOBODY_UID, "POST", served.url + "/physical/reset", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert code == 200, body
    lan = lan_address()
    if lan is None:
        pytest.skip("this machine has no non-loopback IPv4 address to call from")
    url = f"http://{lan}:{served.port}"
    # not on loopback: even root needs the token, for the status too
    assert requests.post(url + "/emulated/reset", timeout=10).status_code == 401
    assert requests.get(url + "/status", timeout=10).status_code == 401
    # and the token over plain HTTP from another address crossed the network in clear: refused, said so
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    for method, path in (("GET", "/status"), ("GET", "/metrics"), ("POST", "/emulated/reset"), ("GET", "/start")):
        resp = requests.request(method, url + path, headers=auth, timeout=30)
        assert resp.status_code == 403, (path, resp.status_code, resp.text)
        assert "SSH tunnel" in resp.json()["detail"] and "replace it" in resp.json()["detail"], resp.text
    assert exp.phase == "created"
    assert any("crossed the network in clear" in r.getMessage() for r in caplog.records)
    # the same token through loopback still works (what a tunnel delivers)
    assert requests.post(served.url + "/emulated/reset", headers=auth, timeout=30).status_code == 200
    assert exp.phase == "reset"


def test_short_admin_tokens_are_refused(make_controller, tmp_path):
    with pytest.raises(ConfigError, match="shorter than 16"):
        make_controller(admin_token="short")


# --- pages of other sites ---------------------------------------------------------------------

def test_foreign_host_origin_and_cross_site_requests_are_refused(make_controller):
    exp, served, _ = make_controller({callers.ALLOWED_HOSTS_ENV: "testbed.lab.example"})
    attacks = [{"Host": f"attacker.example:{served.port}"},
               {"Host": "attacker.example"},
               {"Origin": "http://attacker.example"},
               {"Origin": f"http://localhost:{served.port + 1}"},  # another local site (another port)
               {"Origin": "null"},
               {"Referer": "http://attacker.example/page.html"},
               {"Sec-Fetch-Site": "cross-site"},
               {"Sec-Fetch-Site": "same-site"}]
    for headers in attacks:
        for method, path in (("GET", "/emulated/reset"), ("POST", "/emulated/reset"), ("GET", "/status")):
            resp = requests.request(method, served.url + path, headers=headers, timeout=10)
            assert resp.status_code == 403, (headers, method, path, resp.text)
            assert resp.json()["error"] == "forbidden"
    assert exp.phase == "created"
    # the same page served by the controller itself, curl, and configured or own names pass
    lan = lan_address()
    fine = [{"Host": f"localhost:{served.port}"}, {"Host": f"[::1]:{served.port}"},
            {"Host": f"127.0.0.1:{served.port}", "Origin": f"http://127.0.0.1:{served.port}",
             "Sec-Fetch-Site": "same-origin"},
            {"Host": f"testbed.lab.example:{served.port}"}, {"Sec-Fetch-Site": "none"}]
    if lan:
        fine.append({"Host": f"{lan}:{served.port}"})  # how nodes and agents name it
    for headers in fine:
        resp = requests.get(served.url + "/status", headers=headers, timeout=10)
        assert resp.status_code == 200, (headers, resp.text)
    resp = requests.post(served.url + "/emulated/reset", headers=fine[2], timeout=30)
    assert resp.status_code == 200, resp.text


def test_a_new_bridge_address_is_accepted_as_host(make_controller):
    """A node reaches the controller at its bridge's address, made after the controller started."""
    _, served, _ = make_controller()
    from pyroute2 import IPRoute

    name = f"cb{new_testbed_id()}"
    addr = f"10.{__import__('random').randint(200, 250)}.{__import__('random').randint(1, 250)}.1"
    requests.get(served.url + "/status", timeout=10)  # the addresses are read once before
    with IPRoute() as ipr:
        ipr.link("add", ifname=name, kind="bridge")
        try:
            index = ipr.link_lookup(ifname=name)[0]
            ipr.addr("add", index=index, address=addr, prefixlen=32)
            time.sleep(callers.HostPolicy.REFRESH_S)
            resp = requests.get(served.url + "/status", headers={"Host": f"{addr}:{served.port}"}, timeout=10)
            assert resp.status_code == 200, resp.text
        finally:
            ipr.link("del", index=ipr.link_lookup(ifname=name)[0])
    resp = requests.get(served.url + "/status", headers={"Host": f"10.{1}.2.3:{served.port}"}, timeout=10)
    assert resp.status_code == 403


# --- bodies, limits, POST equivalents ----------------------------------------------------------

def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_get_with_a_body_is_refused_without_reading_it_into_memory(make_controller):
    _, served, _ = make_controller()
    resp = requests.get(served.url + "/status", data=b"x" * 1000, timeout=10)
    assert resp.status_code == 400 and "carry no body" in resp.json()["detail"], resp.text
    resp = requests.get(served.url + "/start", data=b"x" * 1000, timeout=10)
    assert resp.status_code == 400
    # 128 MiB announced and streamed: the answer comes, and the server's memory does not grow with it
    before = _rss_kib()
    total, chunk = 128 << 20, b"\0" * (1 << 20)
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(f"GET /status HTTP/1.1\r\nHost: localhost\r\nContent-Length: {total}\r\n\r\n".encode())
        sent = 0
        try:
            while sent < total:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server may close early
        answer = s.recv(4096).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 400"), answer[:200]
    assert _rss_kib() - before < 32 * 1024, (before, _rss_kib())


def node_post(exp, served, path: str, data: dict, node: str = "n1") -> requests.Response:
    """A POST signed as node ``node`` would sign it (its own key)."""
    body = json.dumps(data).encode()
    headers = {"Content-Type": "application/json", **exp.keys.node_headers(node, "POST", path, body)}
    return requests.post(served.url + path, data=body, headers=headers, timeout=10)


def test_routes_have_size_limits(make_controller):
    exp, served, _ = make_controller()
    resp = node_post(exp, served, "/print", {"msg": "x" * (20 * 1024)})
    assert resp.status_code == 413, resp.text
    resp = requests.post(served.url + "/start", json={"pad": "x" * (100 * 1024)}, timeout=10)
    assert resp.status_code == 413, resp.text
    resp = node_post(exp, served, "/print", {"msg": "fits"})
    assert resp.status_code == 200, resp.text


def test_post_equivalents_of_the_get_routes(make_controller, tmp_path):
    exp, served, _ = make_controller()
    resp = requests.post(served.url + "/physical/reset", timeout=10)
    assert resp.status_code == 200 and resp.json()["reset"] is True
    for path in ("/conf/dataset", "/conf/structure", "/start", "/finish", "/update/tc"):
        # nothing is deployed: each fails as its GET does, in the handler, not as an unknown route
        post = requests.post(served.url + path, json={"file": "links.json"}, timeout=30)
        get = requests.get(served.url + path, params={"file": "links.json"}, timeout=30)
        assert post.status_code not in (401, 403, 405) and post.status_code == get.status_code, (path, post.text)
        assert post.json() == get.json() and "requested URL" not in post.text, (path, post.text)
    resp = requests.post(served.url + "/update/tc", json={}, timeout=10)
    assert resp.status_code == 400 and "links file" in resp.json()["message"]
    assert requests.post(served.url + "/emulated/reset", timeout=30).status_code == 200
    assert exp.phase == "reset"


# --- what nodes send and what the client sees ----------------------------------------------------

def test_print_reaches_the_terminal_without_escape_sequences(make_controller):
    exp, served, lines = make_controller()
    exp.verbose = True  # each node's lines reach the terminal
    msg = "\x1b[2J\x1b[H\x1b]0;owned\x07round 1\r\x1b[31mfake: n2 done\x1b[0m\nnext\x07\x00\ttab\x9b1m"
    resp = node_post(exp, served, "/print", {"msg": msg, "round": 1})
    assert resp.status_code == 200, resp.text
    assert lines[-1] == "n1: round 1fake: n2 donenext\ttab", lines
    assert not any(ch in lines[-1] for ch in "\x1b\r\n\x07\x00\x9b")
    spoof = "round 2 \u202egnp.exe\u202c \u2066x\u2069 \u200fy\u061c"  # bidi overrides, isolates, marks
    assert node_post(exp, served, "/print", {"msg": spoof, "round": 2}).status_code == 200
    assert lines[-1] == "n1: round 2 gnp.exe x y", lines


def test_an_internal_error_answers_only_a_reference(make_controller, caplog):
    def broken(line: str) -> None:
        raise RuntimeError("secret /etc/edgetb path and state")

    exp, served, _ = make_controller(progress=broken)
    exp.verbose = True
    with caplog.at_level(logging.ERROR, logger="edgetb.controller"):
        resp = node_post(exp, served, "/print", {"msg": "hi"})
    assert resp.status_code == 500, resp.text
    body = resp.json()
    assert body["error"] == "internal" and len(body["reference"]) == 8, body
    assert "secret" not in resp.text and "RuntimeError" not in resp.text, resp.text
    logged = [r for r in caplog.records if body["reference"] in r.getMessage()]
    assert logged and "secret /etc/edgetb" in (logged[0].exc_text or str(logged[0].exc_info)), caplog.records


def test_a_nodes_refusal_reaches_an_error_printable_and_bounded():
    from controller.run.nodes import MAX_REFUSAL_CHARS, refusal

    answer = json.dumps({"error": "bad_conf", "message": "nns/m.py: \x1b[2Jbad \u202eexe\u202c" + "x" * 5000}).encode()
    text = refusal(answer)
    assert text.startswith("nns/m.py: bad exe") and len(text) == MAX_REFUSAL_CHARS, text[:40]
    assert refusal(b"\x1b]0;owned\x07not json\xff") == "not json\ufffd"

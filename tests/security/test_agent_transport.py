"""The agent's transport, with the real agent process (python3 -m worker.agent): TLS with a
certificate made on first start and pinned by the controller, loopback by default, no short
tokens, retries and clear messages in the client, code sync checked against hashes that came
over the pinned channel."""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from flask import Flask, request
from werkzeug.serving import make_server

from controller.workers import files
from controller.workers.agent_client import AgentClient
from tests.netns.conftest import free_subnet, new_testbed_id
from tests.security.callers_fixtures import NOBODY_UID, free_port, need_root
from worker.api import errors, file_auth
from worker.api.protocol import OPERATIONS
from worker.serving import json_errors

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "agent-token-" + "x" * 20


class AgentProc:
    """``python3 -m worker.agent`` on a free loopback port, with its own state directory."""

    def __init__(self, tmp: Path, *extra: str, env: dict | None = None, port: int | None = None,
                 state: Path | None = None) -> None:
        self.port = port or free_port()
        self.state = state or tmp / f"state-{secrets.token_hex(2)}"
        self.log_path = tmp / f"agent-{self.port}-{secrets.token_hex(2)}.log"
        self.tb = new_testbed_id()
        self.argv = [sys.executable, "-m", "worker.agent", "--port", str(self.port), "--id", self.tb,
                     "--subnet", free_subnet(), *extra]
        base = {k: v for k, v in os.environ.items() if k != "EDGETB_TOKEN"}
        self.env = dict(base, EDGETB_STATE_DIR=str(self.state), **(env if env is not None else {"EDGETB_TOKEN": TOKEN}))
        self.proc: subprocess.Popen | None = None

    def run(self, *argv: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
        """The agent's CLI run to its end (e.g. --print-fingerprint, or a start that must fail)."""
        return subprocess.run([*self.argv, *argv], cwd=str(ROOT), env=self.env, capture_output=True, text=True,
                              timeout=timeout_s)

    def start(self, wait: bool = True) -> "AgentProc":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=str(ROOT), env=self.env, stdout=log, stderr=subprocess.STDOUT)
        if wait:
            deadline = time.monotonic() + 30
            while "agent listening" not in self.log():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"agent did not start (exit {self.proc.poll()}): {self.log()}")
                time.sleep(0.05)
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def agents(tmp_path):
    need_root()
    started: list[AgentProc] = []

    def make(*extra: str, **kw) -> AgentProc:
        agent = AgentProc(tmp_path, *extra, **kw)
        started.append(agent)
        return agent

    yield make
    for agent in started:
        agent.stop()


def fingerprint_of(agent: AgentProc) -> str:
    done = agent.run("--print-fingerprint")
    assert done.returncode == 0, done.stderr
    fp = done.stdout.strip()
    assert re.fullmatch(r"([0-9A-F]{2}:){31}[0-9A-F]{2}", fp), fp
    return fp


# --- TLS and pinning ----------------------------------------------------------------------------

def test_the_agent_makes_its_certificate_once_and_serves_tls_pinned_by_fingerprint(agents):
    agent = agents("--listen", "127.0.0.1")
    fp = fingerprint_of(agent)
    key = agent.state / "tls" / "agent.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    cert = (agent.state / "tls" / "agent.crt").read_bytes()
    assert fingerprint_of(agent) == fp  # made once, kept
    agent.start()
    assert fp in agent.log() and f"https://127.0.0.1:{agent.port}" in agent.log(), agent.log()
    assert (agent.state / "tls" / "agent.crt").read_bytes() == cert

    url = f"https://127.0.0.1:{agent.port}"
    client = AgentClient(url, TOKEN, name="e1", fingerprint=fp)
    assert client.status()["testbed_id"] == agent.tb
    # the fingerprint as hosts files may write it
    assert AgentClient(url, TOKEN, fingerprint="sha256:" + fp.replace(":", "").lower()).health()["ok"]
    # plain HTTP to the TLS port gets nothing
    with pytest.raises(errors.AgentUnreachable, match=r"agent e1 \(http://127.0.0.1:\d+\): GET /status: .*https"):
        AgentClient(f"http://127.0.0.1:{agent.port}", TOKEN, name="e1", tries=1).status()


def test_a_wrong_fingerprint_fails_clearly_and_sends_nothing(agents):
    agent = agents("--listen", "127.0.0.1").start()
    fp = fingerprint_of(agent)
    wrong = hashlib.sha256(b"another machine").hexdigest()
    client = AgentClient(f"https://127.0.0.1:{agent.port}", TOKEN, name="e1", fingerprint=wrong)
    with pytest.raises(errors.AuthError) as caught:
        client.reset()
    message = caught.value.message
    assert message.startswith(f"agent e1 (https://127.0.0.1:{agent.port}): POST /reset: "), message
    assert fp in message and "pins" in message and "--print-fingerprint" in message, message
    assert "urllib3" not in message and "HTTPSConnectionPool" not in message, message
    with pytest.raises(errors.ConfigError, match="not a SHA-256 fingerprint"):
        AgentClient(f"https://127.0.0.1:{agent.port}", TOKEN, fingerprint="abc")


def test_tls_to_a_plain_http_agent_says_so(agents):
    agent = agents("--listen", "127.0.0.1", "--plain-http").start()
    assert AgentClient(f"http://127.0.0.1:{agent.port}", TOKEN).health()["ok"]
    with pytest.raises(errors.AgentUnreachable, match="TLS handshake failed.*plain http"):
        AgentClient(f"https://127.0.0.1:{agent.port}", TOKEN, name="h", fingerprint="ab" * 32, tries=1).status()


def test_plain_http_only_on_loopback_and_loopback_by_default(agents):
    agent = agents("--listen", "0.0.0.0", "--plain-http")
    done = agent.run()
    assert done.returncode == 2 and "--plain-http is for a loopback address only" in done.stderr, done.stderr
    agent = agents().start()  # no --listen: loopback only
    listening = subprocess.run(["ss", "-Htln", f"sport = :{agent.port}"], capture_output=True, text=True).stdout
    assert f"127.0.0.1:{agent.port}" in listening and f"0.0.0.0:{agent.port}" not in listening, listening


def test_the_client_refuses_unpinned_or_plain_transport_to_other_machines():
    with pytest.raises(errors.ConfigError, match=r"agent e1 \(http://10.254.0.2:3334\): plain http is refused"):
        AgentClient("http://10.254.0.2:3334", TOKEN, name="e1")
    with pytest.raises(errors.ConfigError, match=r"agent e1 .*no tls_fingerprint.*--print-fingerprint"):
        AgentClient("https://10.254.0.2:3334", TOKEN, name="e1")
    AgentClient("https://10.254.0.2:3334", TOKEN, name="e1", fingerprint="AB" * 32)  # pinned: fine


def test_a_loopback_port_held_by_another_user_gets_no_token(tmp_path):
    """Another local user binds the agent's port first: the controller will not send it the token."""
    need_root()
    port = free_port()
    seen = tmp_path / "seen"
    server = subprocess.Popen(["setpriv", f"--reuid={NOBODY_UID}", f"--regid={NOBODY_UID}", "--clear-groups",
                               sys.executable, "-c",
                               "import socket,sys\n"
                               "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                               f"s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True)\n"
                               "c,_=s.accept(); sys.stdout.write(c.recv(4096).decode(errors='replace'))\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        with pytest.raises(errors.AuthError, match=f"held by a process of uid {NOBODY_UID}, not root"):
            AgentClient(f"http://127.0.0.1:{port}", TOKEN, name="local").status()
    finally:
        server.kill()
        out = server.communicate(timeout=10)[0]
    assert TOKEN not in out


# --- tokens ---------------------------------------------------------------------------------------

def test_short_tokens_are_refused_from_every_source(agents, tmp_path):
    done = agents(env={"EDGETB_TOKEN": "x"}).run()
    assert done.returncode == 2 and "EDGETB_TOKEN is shorter than 16 characters" in done.stderr, done.stderr
    token_file = tmp_path / "short-token"
    token_file.write_text("fifteen-chars-x\n")
    token_file.chmod(0o600)
    done = agents("--token-file", str(token_file), env={}).run()
    assert done.returncode == 2 and f"{token_file} is shorter than 16 characters" in done.stderr, done.stderr
    with pytest.raises(errors.ConfigError, match="shorter than 16"):
        AgentClient("https://127.0.0.1:3334", "short-token")
    cli = subprocess.run([sys.executable, "-m", "controller.cli", "--agent", "https://127.0.0.1:1", "--token-file",
                          str(token_file), "status"], cwd=str(ROOT), capture_output=True, text=True, timeout=30,
                         env={k: v for k, v in os.environ.items() if k != "EDGETB_TOKEN"})
    assert cli.returncode != 0 and "shorter than 16 characters" in cli.stdout + cli.stderr, (cli.stdout, cli.stderr)


# --- retries and messages ----------------------------------------------------------------------

def test_idempotent_calls_are_retried_with_backoff_and_name_the_host(agents):
    agent = agents("--listen", "127.0.0.1")
    fp = fingerprint_of(agent)
    url = f"https://127.0.0.1:{agent.port}"
    client = AgentClient(url, TOKEN, name="e1", fingerprint=fp, backoff_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(errors.AgentUnreachable) as caught:
        client.status()
    assert caught.value.message == f"agent e1 ({url}): GET /status: connection refused after 3 tries"
    assert time.monotonic() - t0 >= 0.2 + 0.4  # two waits, doubling
    with pytest.raises(errors.AgentUnreachable) as caught:  # not idempotent: tried once
        client.exec("n1", {"version": 1, "argv": ["true"]})
    assert caught.value.message == f"agent e1 ({url}): POST /nodes/n1/exec: connection refused"
    assert OPERATIONS["set_links"].idempotent and OPERATIONS["stop_process"].idempotent
    assert not OPERATIONS["start_process"].idempotent and not OPERATIONS["start_node"].idempotent

    # the agent comes back while the client waits: the call succeeds
    patient = AgentClient(url, TOKEN, name="e1", fingerprint=fp, tries=6, backoff_s=0.5)
    threading.Timer(0.3, agent.start, kwargs={"wait": False}).start()
    assert patient.status()["testbed_id"] == agent.tb


def test_agent_errors_become_the_matching_exceptions(agents):
    agent = agents("--listen", "127.0.0.1").start()
    url = f"https://127.0.0.1:{agent.port}"
    client = AgentClient(url, TOKEN, name="e1", fingerprint=fingerprint_of(agent))
    with pytest.raises(errors.NotFound) as caught:
        client.shaping("nobody")
    assert caught.value.message.startswith(f"agent e1 ({url}): GET /nodes/nobody/shaping: "), caught.value.message
    with pytest.raises(errors.ConfigError, match=r"POST /nodes: .*version"):
        client.create_nodes({"version": 99, "nodes": []})
    bad = AgentClient(url, "wrong-token-wrong-token", name="e1", fingerprint=fingerprint_of(agent))
    with pytest.raises(errors.AuthError, match=r"agent e1 .*: GET /status: "):
        bad.status()
    # bodies on GET refused, and per-route limits
    session = requests.Session()
    session.mount("https://", client.session.get_adapter("https://"))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    resp = session.get(url + "/status", data=b"x" * 100, headers=auth, timeout=10)
    assert resp.status_code == 400 and "carry no body" in resp.text, resp.text
    resp = session.post(url + "/reset", data=b" " * (100 * 1024), headers={**auth, "Content-Type": "application/json"},
                        timeout=10)
    assert resp.status_code == 413, resp.text


def serve_code(src: Path, token: str) -> Any:
    """The controller's file server over ``src`` (requests signed with ``token``, as the
    controller checks them) on a free port, in a thread (``server_port``; ``shutdown()`` stops it)."""
    app = Flask("files")
    json_errors(app, __import__("logging").getLogger("test"))

    def check() -> None:
        if not file_auth.verify(token, request.headers.get("Authorization", ""), request.method, request.path):
            raise errors.AuthError("no")

    files.register(app, str(src), check)
    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# --- code sync over the pinned channel -----------------------------------------------------------

def test_sync_trusts_only_the_manifest_sent_over_the_pinned_channel(agents, tmp_path):
    src = tmp_path / "src"
    (src / "dml_app").mkdir(parents=True)
    (src / "dataset").mkdir()
    (src / "dml_app" / "role.py").write_text("print('the real code')\n")
    (src / "dataset" / "shard.npz").write_bytes(os.urandom(5000))
    node_token = "node-token-" + "y" * 20
    server = serve_code(src, node_token)
    file_port = server.server_port
    work = tmp_path / "agent-work"
    agent = agents("--listen", "127.0.0.1", "--workdir", str(work)).start()
    client = AgentClient(f"https://127.0.0.1:{agent.port}", TOKEN, name="e1", fingerprint=fingerprint_of(agent))
    try:
        trusted = files.manifest(str(src), ("dml_app", "dataset"))
        body = {"version": 1, "url": f"http://127.0.0.1:{file_port}", "token": node_token}
        with pytest.raises(errors.ConfigError, match="manifest"):
            client.sync(body)  # hashes from the file server alone are not trusted
        done = client.sync({**body, "manifest": trusted})
        assert done["fetched"] == 2, done
        assert (work / "dml_app" / "role.py").read_text() == "print('the real code')\n"
        # the file server now serves other code (same size): the agent refuses it
        (src / "dml_app" / "role.py").write_text("print('the evil code')\n")
        (work / "dml_app" / "role.py").unlink()
        with pytest.raises(errors.ConfigError, match="does not match the manifest"):
            client.sync({**body, "manifest": trusted})
        assert not (work / "dml_app" / "role.py").exists()
    finally:
        server.shutdown()


def test_an_agent_that_does_not_accept_times_out_per_try_not_per_call():
    """A host that drops connection attempts costs tries x connect timeout, not the call's timeout."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)  # never accepted: once the queue is full, SYNs are dropped
        port = server.getsockname()[1]
        fill = []
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            fill.append(s)
        time.sleep(0.2)
        client = AgentClient(f"https://127.0.0.1:{port}", TOKEN, name="slow", fingerprint="ab" * 32, timeout_s=300,
                             connect_timeout_s=0.5, backoff_s=0.1)
        t0 = time.monotonic()
        with pytest.raises(errors.AgentUnreachable) as caught:
            client.status()
        assert time.monotonic() - t0 < 10
        assert caught.value.message == (f"agent slow (https://127.0.0.1:{port}): GET /status: connection timed out "
                                         "after 3 tries"), caught.value.message
        for s in fill:
            s.close()


def test_the_cli_reaches_a_loopback_agent_over_tls_without_a_pin_and_a_remote_one_with_it(agents):
    agent = agents("--listen", "127.0.0.1").start()
    env = dict(os.environ, EDGETB_TOKEN=TOKEN, REQUESTS_CA_BUNDLE="/nonexistent/ca.pem")  # no CA is involved
    base = [sys.executable, "-W", "error::Warning", "-m", "controller.cli", "--agent", f"https://127.0.0.1:{agent.port}"]
    done = subprocess.run([*base, "status"], cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"testbed {agent.tb}" in done.stdout, (done.stdout, done.stderr)
    done = subprocess.run([*base, "--agent-fingerprint", fingerprint_of(agent), "status"], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"testbed {agent.tb}" in done.stdout, (done.stdout, done.stderr)

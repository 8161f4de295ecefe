"""Pair keys never cross a network in clear: a real node process, the controller's own signed
client, and a relay on a real socket that records every byte of the structure conf's push.

The conf travels in plain HTTP (to a node on another host it crosses the LAN); the pair keys in
it are sealed with the receiving node's own secret, which reached the node in its environment
(through an agent's pinned HTTPS channel on another host). The node opens them: a peer that
holds the pair key is heard, one that does not is refused; a conf with keys in clear is refused.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from controller.run.node_auth import RunKeys
from dml_app.runtime import auth
from tests.e2e.harness import ROOT
from tests.security.callers_fixtures import free_port

RUN = bytes(range(32))
CONFS = {"n1": {"role": "gossip", "sync": 2, "connect": {"n2": "127.0.0.1:9"}},
         "n2": {"role": "gossip", "sync": 2, "connect": {"n1": "127.0.0.1:9"}}}


class Recorder:
    """A TCP relay on 127.0.0.1:<port> to ``target``: every byte a client sends is kept."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sent = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def node(tmp_path: Path):
    """Node n1's real process on 127.0.0.1 (its secret in its environment), and its port."""
    keys = RunKeys(RUN)
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), **keys.env_for("n1")}
    proc = subprocess.Popen([sys.executable, "-m", "dml_app.node", "--name", "n1", "--controller",
                             "http://127.0.0.1:9", "--run-id", "r1", "--workdir", str(tmp_path), "--port", str(port),
                             "--bind", "127.0.0.1"], env=env, cwd=str(ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the node did not answer /health"
            time.sleep(0.1)
        yield keys, port
    finally:
        proc.terminate()
        proc.wait(10)


def push(keys: RunKeys, url: str, conf: dict) -> requests.Response:
    """The controller's signed POST of ``conf`` to n1's /conf/structure at ``url``."""
    netloc = url.split("//", 1)[1]
    with requests.Session() as session:
        session.trust_env = False
        session.auth = keys.signer(lambda: {netloc: "n1"})
        return session.post(url + "/conf/structure", json=conf, timeout=10)


def done_from(keys: auth.NodeKeys, port: int) -> int:
    """n2's signed /gossip/done to n1 with a body over that route's limit: the status n1 answers
    (the signature is checked first: 401; then the size: 413)."""
    body = b"x" * (64 * 1024 + 1)
    digest = auth.body_hash(body)
    path = "/gossip/done"
    headers = {**keys.peer_headers("n1", "POST", path, digest), **keys.hop_headers("n1", "POST", path, digest)}
    return requests.post(f"http://127.0.0.1:{port}{path}", data=body, headers=headers, timeout=10).status_code


def test_pair_keys_cross_the_wire_sealed_and_the_node_opens_them(node):
    keys, port = node
    clear = keys.pair_key("n1", "n2")
    confs = {name: dict(conf) for name, conf in CONFS.items()}
    keys.complete_structure_confs(confs, lambda n: {"train_samples": 10})
    # a conf with the keys in clear (what used to be pushed) is refused by the node
    plain = dict(confs["n1"], peer_keys={"n2": clear.hex()})
    resp = push(keys, f"http://127.0.0.1:{port}", plain)
    assert resp.status_code == 400 and "sealed" in resp.json()["detail"], resp.text

    recorder = Recorder(("127.0.0.1", port))
    try:
        resp = push(keys, f"http://127.0.0.1:{recorder.port}", confs["n1"])
    finally:
        recorder.close()
    assert resp.status_code == 200, resp.text
    wire = bytes(recorder.sent)
    assert b"/conf/structure" in wire and b"sealed_peer_keys" in wire
    for form in (clear.hex(), clear.hex().upper(), clear):
        assert (form.encode() if isinstance(form, str) else form) not in wire, "a pair key crossed the wire in clear"

    # n1 opened the key: its peer n2, which holds it, passes the signature check (its body then
    # refused for its size); with the sealed value as the key, it is refused as unsigned
    assert done_from(auth.NodeKeys("n2", keys.node_secret("n2"), {"n1": clear}), port) == 413
    wrong = bytes.fromhex(confs["n1"]["sealed_peer_keys"]["n2"])
    assert done_from(auth.NodeKeys("n2", keys.node_secret("n2"), {"n1": wrong}), port) == 401

"""Node identity and payload checks, attacked on a real FL run (netns nodes, shaped links).

The attacker owns node B (n3): it has B's own secret and B's pair key with the
aggregator, exactly the keys B's process holds. The test knows the run secret
(the run script is started with it) only to compute those keys.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

from controller.run.node_auth import RunKeys
from dml_app.models.make import make_model
from dml_app.runtime import auth
from dml_app.runtime.events import read_events
from dml_app.wire import weights as wire
from tests.e2e.harness import ROOT, Run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
MODEL = {"kind": "numpy", "hidden": [64], "learning_rate": 0.005, "seed": 0}
NAMES = ["n1", "n2", "n3", "n4", "n5"]
ROUNDS = 12
B = "n3"  # the attacker's node

# fl_run.py, with the run secret chosen by the test (popped before any node starts)
DRIVER = """
import os, sys
sys.path.insert(0, os.environ.pop('EDGETB_TEST_ROOT'))
from dml_app.runtime import auth
secret = bytes.fromhex(os.environ.pop('EDGETB_TEST_RUN_SECRET'))
auth.new_run_secret = lambda: secret
from controller.runner import main
kind = os.environ.pop('EDGETB_TEST_KIND')
sys.exit(main(sys.argv[1:], algorithm={'fl': 'fl', 'gl': 'gossip'}[kind], structure_default=f'{kind}_structure.json',
              dataset_default=f'{kind}_dataset.json'))
"""


class KnownSecretRun(Run):
    def __init__(self, tmp: Path, secret: bytes, **kw) -> None:
        self.secret = secret
        super().__init__(tmp, **kw)

    def start(self, *extra_args: str) -> None:
        env = dict(os.environ, EDGETB_STATE_DIR=str(self.state), EDGETB_TEST_RUN_SECRET=self.secret.hex(),
                   EDGETB_TEST_ROOT=str(ROOT), EDGETB_TEST_KIND=self.kind)
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, "--workdir", str(self.workdir),
                                      "--port", str(self.port), "--id", self.id, "--subnet", self.subnet,
                                      "--quiet-nodes", *extra_args],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def star(center: str, leaves: list[str]) -> dict:
    links = {center: [{"dest": leaf, "bw": "20mbit"} for leaf in leaves]}
    links.update({leaf: [{"dest": center, "bw": "10mbit"}] for leaf in leaves})
    return links


def vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def raw_request(ip: str, port: int, head: str, body_bytes: int) -> tuple[int, int]:
    """Send ``head`` announcing a large body, read the answer's status, then try to push
    the body: (status, body bytes the node let through before closing)."""
    with socket.create_connection((ip, port), timeout=10) as s:
        s.sendall(head.encode())
        status = int(s.recv(4096).split(b" ", 2)[1])
        sent, chunk = 0, b"\0" * (1 << 20)
        s.settimeout(2)
        try:
            while sent < body_bytes:
                sent += s.send(chunk)
        except OSError:
            pass
        return status, sent


@pytest.fixture
def fl_run(tmp_path):
    secret = os.urandom(32)
    structure = {"model": MODEL, "node_list": [
        {"name": "n1", "sync": ROUNDS, "trainer_fraction": 1.0, "selection": "uniform", "deadline_s": 30,
         "quorum": 0.5}, *[{"name": n, "epoch": 3} for n in NAMES[1:]]]}
    r = KnownSecretRun(tmp_path, secret, structure=structure, links=star("n1", NAMES[1:]), kind="fl")
    try:
        yield r, RunKeys(secret)
    finally:
        r.close()


def test_node_b_cannot_stop_forge_or_impersonate_and_bad_payloads_are_refused(fl_run):
    r, keys = fl_run
    ready = r.wait_phase("ready")
    nodes = {n["name"]: n for n in ready["nodes"]}
    url = {n: f"http://{nodes[n]['ip']}:4444" for n in NAMES}

    # B's process holds B's own secret, in its environment; nothing shared with A
    environ = Path(f"/proc/{nodes[B]['pid']}/environ").read_bytes().split(b"\0")
    given = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(auth.SECRET_ENV.encode() + b"=")]
    b_secret = keys.node_secret(B)
    if given or os.environ.get("EDGETB_ZYGOTE") == "0":  # started with exec: in its environment
        assert given == [b_secret.hex()]
    else:  # forked by the zygote: the secret came by a pipe; B keeps what it derives from it
        from tests.security.test_zygote_node import memory_holds

        key = auth.to_controller_key(b_secret)
        assert memory_holds(nodes[B]["pid"], [key]) == [key]
    assert b_secret != keys.node_secret("n2")
    assert not any(e.startswith(b"EDGETB_NODE_TOKEN=") for e in environ)
    b_pair = keys.pair_key("n1", B)  # what B's structure conf brings: its key with the aggregator
    b = auth.NodeKeys(B, b_secret, {"n1": b_pair})

    assert r.get("/conf/dataset").ok and r.get("/conf/structure").ok
    train_samples = {n: json.loads((r.workdir / "dml_file" / "conf" / f"{n}_dataset.json").read_text())["train_samples"]
                     for n in NAMES[1:]}
    shard = np.load(r.workdir / json.loads((r.workdir / "dml_file" / "conf" / "n1_dataset.json").read_text())["shard"])
    model = make_model(MODEL, input_shape=int(np.prod(shard["x_train"].shape[1:])), n_classes=10).get_weights()

    # a GET with a large body: refused before it is read, the node's memory does not grow
    pid4 = nodes["n4"]["pid"]
    before = vm_rss_kib(pid4)
    big = 240 * 1024 * 1024
    status, let_through = raw_request(nodes["n4"]["ip"], 4444, f"GET /health HTTP/1.1\r\nHost: n4\r\n"
                                                               f"Content-Length: {big}\r\n\r\n", big)
    assert status == 400 and let_through < 64 * 1024 * 1024
    get_status = status
    status, _ = raw_request(nodes["n1"]["ip"], 4444, f"POST /fl/update HTTP/1.1\r\nHost: n1\r\n"
                                                     f"Content-Length: {big}\r\n\r\n", big)
    assert status == 401  # unsigned: refused on its headers
    time.sleep(0.5)
    after = vm_rss_kib(pid4)
    print(f"GET /health with a {big} byte body: {get_status}, {let_through} bytes let through, "
          f"VmRSS {before} -> {after} KiB")
    assert after - before < 8 * 1024, (before, after)
    assert requests.get(url["n4"] + "/health", timeout=10).json()["state"] == "waiting"  # still serving

    assert r.get("/start").json()["phase"] == "running"

    # signed, but larger than a model message can be: refused before it is read
    digest = auth.body_hash(b"")
    signed = {**b.peer_headers("n1", "POST", "/fl/update", digest), **b.hop_headers("n1", "POST", "/fl/update", digest)}
    head = "".join(f"{k}: {v}\r\n" for k, v in signed.items())
    status, _ = raw_request(nodes["n1"]["ip"], 4444, f"POST /fl/update HTTP/1.1\r\nHost: n1\r\n{head}"
                                                     f"Content-Length: {big}\r\n\r\n", big)
    assert status == 413

    # B cannot stop A (n2): neither unsigned, nor with any key B can derive from its secret
    for key in (None, auth.to_controller_key(b_secret), auth.from_controller_key(b_secret), b_secret, b_pair):
        headers = {} if key is None else auth.sign(key, auth.E2E, "POST", "/stop", "n2", "controller", b"{}")
        answer = requests.post(url["n2"] + "/stop", data=b"{}", headers=headers, timeout=10)
        assert answer.status_code == 401, answer.text
    # the controller's call to B is no call to A either
    answer = requests.post(url["n2"] + "/stop", data=b"{}", headers=keys.headers_for(B, "POST", "/stop", b"{}"),
                           timeout=10)
    assert answer.status_code == 401

    # B cannot upload A's log: the controller takes the name from the key
    forged_log = json.dumps({"v": 1, "node": "n2", "type": "done", "t": time.time()}).encode() + b"\n"
    for target in ("/log?node=n2", "/log"):
        signed_as_a = auth.sign(auth.to_controller_key(b_secret), auth.E2E, "POST", target, "controller", "n2",
                                forged_log)
        assert requests.post(r.url + target, data=forged_log, headers=signed_as_a, timeout=10).status_code == 401
    assert requests.post(r.url + "/log?node=n2", data=forged_log, timeout=10).status_code == 401
    status = r.get("/status").json()
    a = next(n for n in status["nodes"] if n["name"] == "n2")
    assert a["state"] == "running" and not a["log_received"]

    def update(arrays: list, meta: dict, claim: str = B) -> requests.Response:
        body = wire.encode(arrays, meta)
        digest = auth.body_hash(body)
        headers = {**auth.sign(b_pair, auth.E2E, "POST", "/fl/update", "n1", claim, digest=digest),
                   **auth.sign(b_pair, auth.HOP, "POST", "/fl/update", "n1", B, digest=digest),
                   "Content-Type": wire.CONTENT_TYPE}
        return requests.post(url["n1"] + "/fl/update", data=body, headers=headers, timeout=10)

    def open_round() -> int:
        agg = next(n for n in r.get("/status").json()["nodes"] if n["name"] == "n1")
        return agg["round"] + 1

    # signed with B's pair key but claiming to be n2 (a trainer), with a huge sample count: refused
    for _ in range(10):
        forged = update(model, {"from": "n2", "round": open_round(), "samples": 10**12}, claim="n2")
        assert forged.status_code == 401, forged.text
    # NaN and wrong-shape payloads from B itself: 400, nothing queued
    nan = [w.copy() for w in model]
    nan[0][0, 0] = np.nan
    wrong = [np.zeros((3, 3), dtype=np.float32), *model[1:]]
    for arrays, reason in ((nan, "NaN"), (wrong, "shape"), (model[:-1], "arrays where the model has")):
        answer = update(arrays, {"from": B, "round": open_round(), "samples": 1})
        assert answer.status_code == 400 and reason in answer.json()["detail"], answer.text
    # B's own update, claiming 10^12 samples, lands in an open round: it counts with B's
    # sample count from its dataset conf (a zero model weighted 10^12 would wipe out the round).
    # The attacker holds B's real process back so that its forged update is the one taken.
    os.kill(nodes[B]["pid"], signal.SIGSTOP)
    try:
        accepted, deadline = False, time.monotonic() + 25
        while not accepted and time.monotonic() < deadline:
            answer = update([np.zeros_like(w) for w in model], {"from": B, "round": open_round(), "samples": 10**12})
            assert answer.status_code == 200, answer.text
            accepted = answer.json()["accepted"]
            time.sleep(0.05)
    finally:
        os.kill(nodes[B]["pid"], signal.SIGCONT)
    assert accepted, "the aggregator never took B's update in an open round"

    r.wait_phase("finished", timeout_s=240)
    summary = r.get("/finish").json()
    events = {p.stem: read_events(str(p)) for p in (Path(summary["run_dir"]) / "events").iterdir()}
    for node in summary["nodes"]:
        assert node["ended"] == "done" and node["accuracy"] >= 0.85, node
    a_done = next(n for n in summary["nodes"] if n["node"] == "n2")
    assert a_done["rounds"] == ROUNDS  # B did not stop A
    rejected = [e for e in events["n1"] if e["type"] == "rejected_update"]
    assert len(rejected) == 3 and {e["peer"] for e in rejected} == {B}
    assert any("NaN" in e["reason"] for e in rejected) and any("shape" in e["reason"] for e in rejected)
    rounds = [e for e in events["n1"] if e["type"] == "round"]
    assert len(rounds) == ROUNDS
    for e in rounds:  # every real trainer's update taken, each with its dataset conf's count
        assert e["samples"] == {t: train_samples[t] for t in NAMES[1:]}, e["samples"]
        assert e["accuracy"] >= 0.5, e  # no round wiped out by a forged count


def gossip_attacker(r: KnownSecretRun) -> tuple[dict, dict, list, list, auth.NodeKeys]:
    """Once the gossip run ``r`` is ready: the nodes' addresses, links.json, B's out-neighbours,
    a model of the run's shape, and B's keys (B signs as itself, with its real pair keys)."""
    keys = RunKeys(r.secret)
    ready = r.wait_phase("ready")
    ips = {n["name"]: n["ip"] for n in ready["nodes"]}
    links = json.loads((r.workdir / "links.json").read_text())
    victims = [link["dest"] for link in links[B]]
    structure = json.loads((r.workdir / "gl_structure.json").read_text())
    shard = np.load(r.workdir / json.loads((r.workdir / "dml_file" / "conf" / "n1_dataset.json").read_text())
                    ["shard"])
    model = make_model(structure["model"], input_shape=int(np.prod(shard["x_train"].shape[1:])),
                       n_classes=10).get_weights()
    return ips, links, victims, model, auth.NodeKeys(B, keys.node_secret(B), {v: keys.pair_key(B, v) for v in victims})


def test_nan_and_wrong_shape_gossip_is_refused_and_learning_goes_on(tmp_path):
    """B (n3) gossips NaN and wrong-shape models to its out-neighbours all through the run."""
    r = KnownSecretRun(tmp_path, os.urandom(32), kind="gl")
    try:
        ips, links, victims, model, b = gossip_attacker(r)
        nan = [np.full_like(w, np.nan) for w in model]
        wrong = [w.T.copy() if w.ndim == 2 else w for w in model]
        assert r.get("/start").json()["phase"] == "running"
        answers: dict[str, list[int]] = {v: [] for v in victims}
        for i in range(12):
            for victim in victims:
                body = wire.encode(nan if i % 2 == 0 else wrong, {"from": B, "round": i, "samples": 10})
                digest = auth.body_hash(body)
                headers = {**b.peer_headers(victim, "POST", "/gossip", digest),
                           **b.hop_headers(victim, "POST", "/gossip", digest), "Content-Type": wire.CONTENT_TYPE}
                answer = requests.post(f"http://{ips[victim]}:4444/gossip", data=body, headers=headers, timeout=30)
                # a victim done with its rounds refuses every model from the headers, before the body
                answers[victim].append(400 if answer.status_code == 400 else f"{answer.status_code} {answer.json()}")
            time.sleep(0.3)
        refused = {400, "200 {'ok': True, 'accepted': False}"}
        assert all(set(codes) <= refused and codes[0] == 400 for codes in answers.values()), \
            {v: set(c) for v, c in answers.items()}
        r.wait_phase("finished", timeout_s=240)
        summary = r.get("/finish").json()
        for node in summary["nodes"]:
            assert node["ended"] == "done" and node["accuracy"] >= 0.85, node
        for victim in victims:
            events = read_events(str(Path(summary["run_dir"]) / "events" / f"{victim}.jsonl"))
            rejected = [e for e in events if e["type"] == "rejected_update"]
            # (the uploaded log ends with the node's run: later attacks are refused all the same)
            assert len(rejected) >= 4 and {e["peer"] for e in rejected} == {B}
            assert any("NaN" in e["reason"] for e in rejected) and any("shape" in e["reason"] for e in rejected)
    finally:
        r.close()


def test_a_peer_that_floods_models_weighs_one_model_a_round(tmp_path):
    """B (n3) posts valid models as fast as it can to its out-neighbours: each keeps one of B's
    at a time (a later one replaces it), so no round combines more models than it has senders."""
    r = KnownSecretRun(tmp_path, os.urandom(32), kind="gl")
    try:
        ips, links, victims, model, b = gossip_attacker(r)
        senders = {v: {src for src, out in links.items() if any(link["dest"] == v for link in out)} for v in victims}
        assert r.get("/start").json()["phase"] == "running"
        replaced = 0
        with requests.Session() as http:
            for i in range(30):
                for victim in victims:
                    body = wire.encode(model, {"from": B, "round": i, "samples": 10})
                    digest = auth.body_hash(body)
                    headers = {**b.peer_headers(victim, "POST", "/gossip", digest),
                               **b.hop_headers(victim, "POST", "/gossip", digest), "Content-Type": wire.CONTENT_TYPE}
                    answer = http.post(f"http://{ips[victim]}:4444/gossip", data=body, headers=headers, timeout=30)
                    assert answer.status_code == 200, answer.text
                    replaced += bool(answer.json().get("replaced"))
        assert replaced > 0, "no flooded model ever met an earlier one of B's still waiting"
        r.wait_phase("finished", timeout_s=240)
        summary = r.get("/finish").json()
        for victim in victims:
            events = read_events(str(Path(summary["run_dir"]) / "events" / f"{victim}.jsonl"))
            counts = [e["received_models"] for e in events if e["type"] == "round"]
            assert counts and max(counts) <= len(senders[victim]), (victim, counts, senders[victim])
    finally:
        r.close()


def test_an_answer_its_destination_did_not_sign_is_refused():
    """a asks d over real HTTP: d's answer is signed by d and bound to a's message; an impostor
    at d's address, even one that signs with its own pair key with a, is refused."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from dml_app.runtime.http import Router, json_response
    from dml_app.runtime.transport import HttpTransport

    run = os.urandom(32)
    keys = {n: auth.NodeKeys(n, auth.node_secret(run, n)) for n in ("a", "c", "d")}
    for n, peers in {"a": ("c", "d"), "c": ("a",), "d": ("a",)}.items():
        keys[n].set_peer_keys({p: auth.pair_key(run, n, p).hex() for p in peers})

    class Quiet(WSGIRequestHandler):
        def log_message(self, *_):
            pass

    def impostor(environ, start_response):  # answers in d's place, signing as c (a's other peer)
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        body, nonce = b'{"accepted": false}', environ.get("HTTP_X_EDGETB_NONCE", "")
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                                  (auth.ANSWER_SIG, keys["c"].answer_sig("a", nonce, body))])
        return [body]

    def serve(app) -> str:
        server = make_server("127.0.0.1", 0, app, handler_class=Quiet)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    d = Router(lambda: keys["d"], "d")
    d.add("POST", "/gossip", lambda req: json_response({"accepted": True}), "peer", 4096)
    servers: list = []
    try:
        answer = HttpTransport({"d": serve(d)}, keys["a"]).post("d", "d", "/gossip", b"{}", "application/json", 10)
        assert json.loads(answer) == {"accepted": True}
        with pytest.raises(auth.AuthFailed, match="not signed by it"):  # c answers in d's place
            HttpTransport({"d": serve(impostor)}, keys["a"]).post("d", "d", "/gossip", b"{}", "application/json", 10)
    finally:
        for server in servers:
            server.shutdown()

"""Node identity: key derivation, signing and checking, the router's gates, weights checks."""
from __future__ import annotations

import io
import json
import time

import numpy as np
import pytest
import requests

from controller.run.node_auth import RunKeys, talking_pairs
from dml_app.runtime import auth
from dml_app.runtime.http import Router, json_response
from dml_app.wire import weights as wire
from worker.api.errors import AuthError, ConfigError

RUN = bytes(range(32))


def lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


# derivation ------------------------------------------------------------------------------------
def test_keys_are_distinct_per_node_direction_and_pair():
    a, b = auth.node_secret(RUN, "n1"), auth.node_secret(RUN, "n2")
    assert a != b and len(a) == 32 and auth.node_secret(RUN, "n1") == a
    assert auth.node_secret(bytes(32), "n1") != a  # another run, other secrets
    assert auth.to_controller_key(a) != auth.from_controller_key(a)
    assert auth.pair_key(RUN, "n1", "n2") == auth.pair_key(RUN, "n2", "n1")
    assert auth.pair_key(RUN, "n1", "n2") != auth.pair_key(RUN, "n1", "n3")
    assert auth.pair_key(RUN, "n1", "n2") not in (a, b)
    # the separator keeps ("n1", "2x") and ("n12", "x") apart
    assert auth.pair_key(RUN, "n1", "2x") != auth.pair_key(RUN, "n12", "x")
    with pytest.raises(ValueError):
        auth.pair_key(RUN, "n1", "n1")


def test_env_carries_the_node_secret_only():
    keys = RunKeys(RUN)
    env = keys.env_for("n1")
    assert list(env) == [auth.SECRET_ENV] and bytes.fromhex(env[auth.SECRET_ENV]) == auth.node_secret(RUN, "n1")
    node = auth.NodeKeys.from_env("n1", env)
    assert node is not None and node.to_controller == auth.to_controller_key(auth.node_secret(RUN, "n1"))
    assert auth.NodeKeys.from_env("n1", {}) is None
    with pytest.raises(ValueError):
        auth.NodeKeys.from_env("n1", {auth.SECRET_ENV: "zz"})


# node -> controller -------------------------------------------------------------------------------
def test_controller_takes_the_name_from_the_key_not_the_message():
    keys = RunKeys(RUN)
    n2 = auth.NodeKeys("n2", keys.node_secret("n2"))
    body = b'{"type": "done"}\n'
    headers = n2.controller_headers("POST", "/log", body)
    assert keys.verify(headers, "POST", "/log", body, ["n1", "n2"]) == "n2"
    # n2 claiming to be n1 with its own key
    forged = {**n2.controller_headers("POST", "/log", body), "X-Edgetb-From": "n1"}
    with pytest.raises(AuthError, match="bad signature"):
        keys.verify(forged, "POST", "/log", body, ["n1", "n2"])
    # a node signs for itself only: another run's key, a changed body or target fail
    other = auth.NodeKeys("n1", RunKeys(bytes(32)).node_secret("n1")).controller_headers("POST", "/log", body)
    with pytest.raises(AuthError):
        keys.verify(other, "POST", "/log", body, ["n1", "n2"])
    for method, target, sent in (("POST", "/log", body + b"x"), ("POST", "/print", body), ("PUT", "/log", body)):
        with pytest.raises(AuthError):
            keys.verify(n2.controller_headers("POST", "/log", body), method, target, sent, ["n1", "n2"])
    with pytest.raises(AuthError, match="no node"):
        keys.verify(n2.controller_headers("POST", "/log", body), "POST", "/log", body, ["n1"])
    with pytest.raises(AuthError, match="unsigned"):
        keys.verify({}, "POST", "/log", body, ["n1"])


def test_a_signed_call_is_accepted_once_and_only_in_the_clock_window():
    keys = RunKeys(RUN)
    n1 = auth.NodeKeys("n1", keys.node_secret("n1"))
    headers = n1.controller_headers("POST", "/print", b"{}")
    assert keys.verify(headers, "POST", "/print", b"{}", ["n1"]) == "n1"
    with pytest.raises(AuthError, match="replayed"):
        keys.verify(headers, "POST", "/print", b"{}", ["n1"])
    key = auth.to_controller_key(keys.node_secret("n1"))
    ts, nonce = f"{time.time() - 3600:.3f}", "0123456789abcdef"
    old = {"X-Edgetb-From": "n1", "X-Edgetb-Ts": ts, "X-Edgetb-Nonce": nonce,
           "X-Edgetb-Sig": auth.mac(key, "POST", "/print", "controller", "n1", ts, nonce, auth.body_hash(b"{}"))}
    with pytest.raises(AuthError, match="clock"):
        keys.verify(old, "POST", "/print", b"{}", ["n1"])


# controller -> node ------------------------------------------------------------------------------
def test_controller_calls_are_signed_for_one_node():
    keys = RunKeys(RUN)
    n1 = auth.NodeKeys("n1", keys.node_secret("n1"))
    n2 = auth.NodeKeys("n2", keys.node_secret("n2"))
    signer = keys.signer(lambda: {"10.0.0.2:4444": "n1", "10.0.0.3:4444": "n2"})
    prepared = signer(requests.Request("POST", "http://10.0.0.2:4444/stop", json={}).prepare())
    digest = auth.body_hash(prepared.body)
    n1.check_controller(lower(dict(prepared.headers)), "POST", "/stop", digest)
    prepared = signer(requests.Request("POST", "http://10.0.0.2:4444/stop", json={}).prepare())
    with pytest.raises(auth.AuthFailed):  # n2 does not take n1's call
        n2.check_controller(lower(dict(prepared.headers)), "POST", "/stop", digest)
    # a node's own key to the controller is not a controller call
    from_node = {**n2.controller_headers("POST", "/stop", b"{}"), "X-Edgetb-From": "controller"}
    with pytest.raises(auth.AuthFailed, match="bad signature"):
        n2.check_controller(lower(from_node), "POST", "/stop", auth.body_hash(b"{}"))
    # an address that is no node's gets no signature
    assert "X-Edgetb-Sig" not in signer(requests.Request("GET", "http://10.9.9.9:4444/log").prepare()).headers


# node -> node ------------------------------------------------------------------------------------
def pair_nodes(*names: str, pairs: tuple[tuple[str, str], ...]) -> dict[str, auth.NodeKeys]:
    keys = RunKeys(RUN)
    nodes = {n: auth.NodeKeys(n, keys.node_secret(n)) for n in names}
    for n in names:
        nodes[n].set_peer_keys({(b if a == n else a): keys.pair_key(a, b).hex() for a, b in pairs if n in (a, b)})
    return nodes


def test_end_to_end_signature_survives_a_relay_and_names_the_sender():
    nodes = pair_nodes("a", "r", "d", "x", pairs=(("a", "r"), ("r", "d"), ("a", "d"), ("x", "r"), ("x", "d")))
    body = wire.encode([np.ones(3, dtype=np.float32)], {"from": "x"})
    digest = auth.body_hash(body)
    e2e = nodes["a"].peer_headers("d", "POST", "/gossip", digest)
    # a -> r: the hop signature over the relay URL
    to_relay = {**e2e, **nodes["a"].hop_headers("r", "POST", "/relay?to=d&path=%2Fgossip", digest)}
    assert nodes["r"].check_hop(lower(to_relay), "POST", "/relay?to=d&path=%2Fgossip", digest) == "a"
    # r -> d: r's own hop signature, a's end-to-end one untouched
    to_dest = {**e2e, **nodes["r"].hop_headers("d", "POST", "/gossip", digest)}
    assert nodes["d"].check_hop(lower(to_dest), "POST", "/gossip", digest) == "r"
    assert nodes["d"].check_peer(lower(to_dest), "POST", "/gossip", digest) == "a"
    # the relay cannot alter the body, nor re-address the message, nor claim another sender
    altered = auth.body_hash(body + b"\0")
    e2e2 = nodes["a"].peer_headers("d", "POST", "/gossip", digest)
    with pytest.raises(auth.AuthFailed):
        nodes["d"].check_peer(lower(e2e2), "POST", "/gossip", altered)
    with pytest.raises(auth.AuthFailed):
        nodes["d"].check_peer(lower(e2e2), "POST", "/fl/update", digest)
    with pytest.raises(auth.AuthFailed):
        nodes["d"].check_peer(lower({**e2e2, "X-Edgetb-From": "x"}), "POST", "/gossip", digest)
    # the relay cannot forge a message from a: its own key with d does not sign as a
    forged = {**nodes["r"].peer_headers("d", "POST", "/gossip", digest), "X-Edgetb-From": "a"}
    with pytest.raises(auth.AuthFailed, match="bad signature for sender 'a'"):
        nodes["d"].check_peer(lower(forged), "POST", "/gossip", digest)


def test_a_node_holds_no_key_for_pairs_it_is_not_in():
    nodes = pair_nodes("a", "b", "c", pairs=(("a", "b"),))
    with pytest.raises(auth.AuthFailed, match="exchanges no messages"):
        nodes["c"].peer_headers("a", "POST", "/gossip", auth.body_hash(b""))
    signed = {**nodes["a"].peer_headers("b", "POST", "/gossip", auth.body_hash(b"")),
              **nodes["a"].hop_headers("b", "POST", "/gossip", auth.body_hash(b""))}
    with pytest.raises(auth.AuthFailed, match="exchanges no messages with 'a'"):
        nodes["c"].check_hop(lower(signed), "POST", "/gossip", auth.body_hash(b""))


def test_talking_pairs_and_completed_confs():
    confs = {"agg": {"role": "fl_aggregator", "trainers": ["t1", "t2"], "connect": {"t1": "", "r": ""},
                     "forward": {"t2": "r"}},
             "t1": {"role": "fl_trainer", "connect": {"agg": ""}},
             "t2": {"role": "fl_trainer", "connect": {"r": ""}, "forward": {"agg": "r"}},
             "r": {"role": "fl_trainer", "connect": {"agg": "", "t2": ""}},
             "lone": {"role": "gossip", "connect": {}}}
    assert talking_pairs(confs) == {("agg", "t1"), ("agg", "r"), ("agg", "t2"), ("r", "t2")}
    keys = RunKeys(RUN)
    keys.complete_structure_confs(confs, lambda n: {"train_samples": {"t1": 100, "t2": 50}[n]})
    assert sorted(confs["agg"]["sealed_peer_keys"]) == ["r", "t1", "t2"]
    assert sorted(confs["t2"]["sealed_peer_keys"]) == ["agg", "r"]
    assert confs["lone"]["sealed_peer_keys"] == {} and "peer_keys" not in confs["agg"]
    # sealed for each end: neither holds the key in clear, each opens it with its own secret
    clear = keys.pair_key("agg", "t2").hex()
    assert clear not in (confs["agg"]["sealed_peer_keys"]["t2"], confs["t2"]["sealed_peer_keys"]["agg"])
    opened = {}
    for me, peer in (("agg", "t2"), ("t2", "agg")):
        node = auth.NodeKeys(me, keys.node_secret(me))
        node.open_peer_keys(confs[me]["sealed_peer_keys"])
        opened[me] = node.peers[peer].hex()
    assert opened == {"agg": clear, "t2": clear}
    wrong = auth.NodeKeys("t1", keys.node_secret("t1"))  # another node's secret opens nothing useful
    wrong.open_peer_keys({"t2": confs["agg"]["sealed_peer_keys"]["t2"]})
    assert wrong.peers["t2"].hex() != clear
    with pytest.raises(ValueError, match="not 32 bytes"):
        wrong.open_peer_keys({"t2": "00" * 8})
    assert confs["agg"]["trainer_samples"] == {"t1": 100, "t2": 50}
    with pytest.raises(ConfigError, match="train_samples"):
        keys.complete_structure_confs(confs, lambda n: {})


# the router --------------------------------------------------------------------------------------
class Stream(io.BytesIO):
    """Like gevent's input: counts what was read, and says how long the body is."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.content_length, self.position, self.chunked_input = len(data), 0, False

    def read(self, n: int = -1) -> bytes:  # type: ignore[override]
        out = super().read(n)
        self.position += len(out)
        return out


def call(router: Router, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None,
         length: int | None = None) -> tuple[int, dict, Stream, list]:
    path, _, query = target.partition("?")
    stream = Stream(body)
    environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query, "wsgi.input": stream,
               "CONTENT_LENGTH": str(len(body) if length is None else length)}
    environ.update({"HTTP_" + k.upper().replace("-", "_"): v for k, v in (headers or {}).items()})
    got = {}
    out = router(environ, lambda status, hdrs: got.update(status=int(status.split()[0]), headers=hdrs))
    return got["status"], json.loads(b"".join(out)), stream, got["headers"]


def node_router() -> tuple[Router, RunKeys, auth.NodeKeys, list]:
    keys = RunKeys(RUN)
    n1 = auth.NodeKeys("n1", keys.node_secret("n1"), {"n2": keys.pair_key("n1", "n2")})
    seen: list = []
    router = Router(lambda: n1, "n1")
    router.add("GET", "/health", lambda req: json_response({"ok": True}), "public")
    router.add("POST", "/stop", lambda req: (seen.append(("stop", req.sender)), json_response({"ok": True}))[1],
               "controller")
    router.add("POST", "/gossip", lambda req: (seen.append(("gossip", req.sender, req.hop)),
                                               json_response({"ok": True}))[1], "peer", 1000)
    router.add("POST", "/boom", lambda req: 1 / 0, "public")
    return router, keys, n1, seen


def test_router_gates_routes_by_caller():
    router, keys, n1, seen = node_router()
    assert call(router, "POST", "/stop", b"{}")[0] == 401
    assert call(router, "POST", "/stop", b"{}", keys.headers_for("n2", "POST", "/stop", b"{}"))[0] == 401
    assert call(router, "POST", "/stop", b"{}", keys.headers_for("n1", "POST", "/stop", b"{}"))[0] == 200
    # a peer's key does not open controller routes
    n2 = auth.NodeKeys("n2", keys.node_secret("n2"), {"n1": keys.pair_key("n1", "n2")})
    digest = auth.body_hash(b"{}")
    as_peer = {**n2.peer_headers("n1", "POST", "/stop", digest), **n2.hop_headers("n1", "POST", "/stop", digest)}
    assert call(router, "POST", "/stop", b"{}", as_peer)[0] == 401
    signed = {**n2.peer_headers("n1", "POST", "/gossip", digest), **n2.hop_headers("n1", "POST", "/gossip", digest)}
    assert call(router, "POST", "/gossip", b"{}", signed)[0] == 200
    assert seen == [("stop", "controller"), ("gossip", "n2", "n2")]
    assert call(router, "POST", "/gossip", b"{}", signed)[0] == 401  # replayed


def test_router_refuses_bodies_without_reading_them():
    router, keys, _, seen = node_router()
    status, answer, stream, headers = call(router, "GET", "/health", b"x" * 5000)
    assert status == 400 and answer["error"] == "body_not_allowed" and stream.position == 0
    assert ("Connection", "close") in headers and stream.content_length == 0  # gevent will not drain it
    status, answer, stream, _ = call(router, "POST", "/gossip", b"x" * 1001)
    assert status == 401 and stream.position == 0  # unsigned: refused on its headers
    n2 = auth.NodeKeys("n2", keys.node_secret("n2"), {"n1": keys.pair_key("n1", "n2")})

    def signed(body: bytes) -> dict:
        digest = auth.body_hash(body)
        return {**n2.peer_headers("n1", "POST", "/gossip", digest), **n2.hop_headers("n1", "POST", "/gossip", digest)}

    status, answer, stream, _ = call(router, "POST", "/gossip", b"x" * 1001, signed(b"x" * 1001))
    assert status == 413 and answer["error"] == "too_large" and stream.position == 0
    status, answer, stream, _ = call(router, "POST", "/gossip", b"x" * 10, signed(b"x" * 10), length=20)
    assert status == 400 and answer["error"] == "short_body"
    # the signature is checked before the body is read: a forged one reads nothing
    forged = {**signed(b"y" * 500), "X-Edgetb-Sig": "00" * 32}
    status, answer, stream, _ = call(router, "POST", "/gossip", b"y" * 500, forged)
    assert status == 401 and stream.position == 0
    # and the body read must be the one whose hash was signed
    status, answer, stream, _ = call(router, "POST", "/gossip", b"z" * 500, signed(b"y" * 500))
    assert status == 401 and answer["detail"] == "the body is not the one signed"
    unhashed = {k: v for k, v in signed(b"y" * 500).items() if k != auth.DIGEST}
    status, answer, stream, _ = call(router, "POST", "/gossip", b"y" * 500, unhashed)
    assert status == 401 and "no body hash" in answer["detail"] and stream.position == 0
    # an unsigned body under the limit is not read either
    status, _, stream, _ = call(router, "POST", "/gossip", b"x" * 500)
    assert status == 401 and stream.position == 0
    status, _, stream, _ = call(router, "POST", "/stop", b"x" * 500)
    assert status == 401 and stream.position == 0
    assert seen == []


def test_internal_errors_answer_a_reference_only(capsys):
    router, *_ = node_router()
    status, answer, _, _ = call(router, "POST", "/boom")
    assert status == 500 and "ZeroDivision" not in json.dumps(answer)
    ref = answer["reference"]
    err = capsys.readouterr().err
    assert f"ref {ref}" in err and "ZeroDivisionError" in err


# weights checks ----------------------------------------------------------------------------------
MODEL = [np.zeros((4, 3), dtype=np.float32), np.zeros(3, dtype=np.float32)]


@pytest.mark.parametrize("arrays, reason", [
    ([np.zeros((4, 3), dtype=np.float32)], "1 arrays where the model has 2"),
    ([np.zeros((3, 4), dtype=np.float32), np.zeros(3, dtype=np.float32)], "array 0 has shape [3, 4]"),
    ([np.zeros((4, 3), dtype=np.float64), np.zeros(3, dtype=np.float32)], "array 0 has dtype <f8"),
    ([np.zeros((4, 3), dtype=np.float32), np.array([0, np.nan, 0], dtype=np.float32)], "array 1 holds NaN"),
    ([np.full((4, 3), np.inf, dtype=np.float32), np.zeros(3, dtype=np.float32)], "array 0 holds NaN or inf"),
])
def test_weights_that_do_not_fit_the_model_are_named(arrays, reason):
    assert reason in (wire.problem(arrays, wire.spec_of(MODEL)) or "")


def test_weights_that_fit_pass_and_the_body_limit_covers_them():
    spec = wire.spec_of(MODEL)
    assert wire.problem([m + 1 for m in MODEL], spec) is None
    body = wire.encode(MODEL, {"from": "n1", "round": 3, "samples": 100})
    assert len(body) < wire.body_limit(spec) < 10 * len(body) + 128 * 1024


# roles: who may send what, and what they take ---------------------------------------------------
def role_ctx(tmp_path, name: str, conf: dict):
    from dml_app.models.make import make_model
    from dml_app.roles.base import Context
    from dml_app.runtime.events import EventLog

    data = (np.zeros((4, 6), dtype=np.float32), np.zeros(4, dtype=np.int64), np.zeros((2, 6), dtype=np.float32),
            np.zeros(2, dtype=np.int64))
    model = make_model({"hidden": [5], "seed": 0}, input_shape=6, n_classes=3)
    return Context(name, model, data, conf, {}, EventLog(str(tmp_path / f"{name}.jsonl"), "run", name),
                   lambda *a, **k: None)


def weights_request(path: str, sender: str, arrays: list, meta: dict):
    from dml_app.runtime.http import Request

    return Request("POST", path, {}, wire.encode(arrays, meta), wire.CONTENT_TYPE, sender=sender, hop=sender)


def test_aggregator_takes_asked_trainers_with_their_conf_sample_counts(tmp_path):
    from dml_app.roles.fl import AggregatorRole
    from dml_app.runtime.events import read_events
    from dml_app.runtime.http import HttpError

    ctx = role_ctx(tmp_path, "agg", {"role": "fl_aggregator", "trainers": ["t1", "t2", "t3"], "sync": 1,
                                     "trainer_samples": {"t1": 100, "t2": 50, "t3": 7}})
    agg = AggregatorRole(ctx)
    model = ctx.model.get_weights()
    agg._round, agg._open, agg._expected = 1, True, {"t1", "t2"}
    answer = agg.on_update(weights_request("/fl/update", "t1", model, {"from": "t1", "round": 1, "samples": 10**12}))
    assert json.loads(answer[2])["accepted"] and agg._updates["t1"][1] == 100
    with pytest.raises(HttpError) as refused:  # not a trainer of this aggregator
        agg.on_update(weights_request("/fl/update", "x", model, {"from": "t2", "round": 1}))
    assert refused.value.status == 403
    nan = [w.copy() for w in model]
    nan[-1][0] = np.nan
    with pytest.raises(HttpError) as refused:
        agg.on_update(weights_request("/fl/update", "t2", nan, {"from": "t2", "round": 1}))
    assert refused.value.status == 400 and "NaN" in refused.value.detail and "t2" not in agg._updates
    # a trainer that was not asked this round: taken as late, not counted
    answer = agg.on_update(weights_request("/fl/update", "t3", model, {"from": "t3", "round": 1}))
    assert not json.loads(answer[2])["accepted"] and "t3" not in agg._updates
    events = read_events(ctx.events.path)
    assert [(e["type"], e.get("peer")) for e in events if e["type"] == "rejected_update"] == \
        [("rejected_update", "x"), ("rejected_update", "t2")]


def test_ring_takes_chunks_of_the_right_size_from_its_predecessor_only(tmp_path):
    from dml_app.roles.ring import RingRole
    from dml_app.roles.ring_membership import Formation
    from dml_app.runtime.http import HttpError

    ctx = role_ctx(tmp_path, "r1", {"role": "ring", "ring": ["r0", "r1", "r2"], "sync": 1})
    ring = RingRole(ctx)
    ring.membership.adopt(Formation(1, 1, ["r0", "r1", "r2"]))  # the ring formation these chunks belong to
    total = sum(w.size for w in ctx.model.get_weights())
    sizes = [len(c) for c in np.array_split(np.zeros(total), 3)]
    good = np.ones(sizes[0], dtype=np.float64)  # r0 sends its chunk 0 in reduce step 0
    ring.on_chunk(weights_request("/ring/chunk", "r0", [good], {"epoch": 1, "round": 1, "phase": "reduce", "step": 0}))
    assert (1, "reduce", 0) in ring._arrived
    for sender, arrays, meta, status in (
            ("r2", [good], {"epoch": 1, "round": 1, "phase": "reduce", "step": 1}, 403),
            ("r0", [np.ones(sizes[0] + 1)], {"epoch": 1, "round": 1, "phase": "reduce", "step": 1}, 400),
            ("r0", [good.astype(np.float32)], {"epoch": 1, "round": 1, "phase": "reduce", "step": 1}, 400),
            ("r0", [good], {"epoch": 1, "round": 1, "phase": "sideways", "step": 1}, 400),
            ("r0", [good], {"epoch": 1, "round": 1, "phase": "reduce", "step": 7}, 400)):
        with pytest.raises(HttpError) as refused:
            ring.on_chunk(weights_request("/ring/chunk", sender, arrays, meta))
        assert refused.value.status == status, (sender, meta, refused.value.detail)


def test_etree_positions_get_the_samples_of_each_child_subtree():
    # root a (layer 3) -> a, b (layer 2); a (layer 2) -> a, c; b (layer 2) -> b, d (layer 1)
    def pos(layer, parent, children):
        return {"layer": layer, "parent": parent, "children": children}

    confs = {"a": {"role": "etree", "positions": [pos(3, None, ["a", "b"]), pos(2, "a", ["a", "c"]), pos(1, "a", [])]},
             "b": {"role": "etree", "positions": [pos(2, "a", ["b", "d"]), pos(1, "b", [])]},
             "c": {"role": "etree", "positions": [pos(1, "a", [])]},
             "d": {"role": "etree", "positions": [pos(1, "b", [])]}}
    samples = {"a": 10, "b": 20, "c": 30, "d": 40}
    RunKeys(RUN).complete_structure_confs(confs, lambda n: {"train_samples": samples[n]})
    assert confs["a"]["positions"][0]["child_samples"] == {"b": 60}  # b's subtree: b and d
    assert confs["a"]["positions"][1]["child_samples"] == {"c": 30}
    assert confs["b"]["positions"][0]["child_samples"] == {"d": 40}


def test_a_peers_answer_over_what_the_caller_takes_is_refused_unread():
    """Answers are capped (by their length, and while reading one without a length), not retried."""
    import http.server
    import threading

    from dml_app.runtime.http import AnswerTooLarge, request

    class Answers(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the handler's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            if self.path == "/chunked":
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.write(b"3e8\r\n" + b"y" * 1000 + b"\r\n" + b"0\r\n\r\n")
                return
            size = 10_000 if self.path == "/big" else 10
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.write(b"x" * size)

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert request("POST", url + "/small", b"{}", max_answer_bytes=100) == (200, b"x" * 10)
        for path in ("/big", "/chunked"):
            with pytest.raises(AnswerTooLarge, match="over the 100"):
                request("POST", url + path, b"{}", max_answer_bytes=100, retries=3, backoff_s=5)
    finally:
        server.shutdown()

"""Protocols run in one process: several roles wired by a ``MemoryNetwork`` (their real handlers,
rounds and checks, no sockets), and the HTTP transport a node uses instead."""
import threading

import numpy as np
import pytest

from dml_app.models.make import make_model
from dml_app.reduction.aggregation import fedavg as weighted_average
from dml_app.roles.base import Context, Role
from dml_app.roles.etree import ETreeRole
from dml_app.roles.fl import AggregatorRole, TrainerRole
from dml_app.roles.gossip import GossipRole
from dml_app.roles.memory import MemoryNetwork
from dml_app.roles.ring import RingRole
from dml_app.runtime import auth
from dml_app.runtime.events import EventLog, read_events
from dml_app.runtime.transport import TTL_HEADER, HttpTransport

N_FEATURES, N_CLASSES = 2, 3
CENTRES = np.array([[0.0, 4.0], [4.0, -2.0], [-4.0, -2.0]])


def blobs(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points of three separable classes."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, N_CLASSES, n)
    return (CENTRES[y] + rng.normal(0, 0.5, (n, N_FEATURES))).astype(np.float32), y.astype(np.int64)


def role_of(cls: type, tmp_path, net: MemoryNetwork, name: str, conf: dict, peers: list[str], seed: int = 0,
            samples: int = 40, progress: list | None = None) -> Role:
    """A role with a small numpy model and its own shard, linked to ``peers`` in ``net``."""
    x, y = blobs(100 + len(name) * 7 + sum(map(ord, name)), samples)
    x_test, y_test = blobs(1, 60)
    model = make_model({"hidden": [8], "seed": seed, "learning_rate": 0.05}, input_shape=N_FEATURES,
                       n_classes=N_CLASSES)
    conf = {"connect": {p: "memory" for p in peers if p != name}, **conf}
    def report(msg: str, **fields) -> None:
        if progress is not None:
            progress.append((name, msg, fields))

    ctx = Context(name, model, (x, y, x_test, y_test), conf, {"batch_size": 16},
                  EventLog(str(tmp_path / f"{name}.jsonl"), "run", name), report)
    return net.attach(cls(ctx))


def run_all(roles: list[Role], timeout_s: float = 60) -> dict[str, dict]:
    """Every role's ``run`` on a thread of its own; their results by name."""
    out: dict[str, dict] = {}
    errors: list[BaseException] = []

    def one(role: Role) -> None:
        try:
            out[role.ctx.name] = role.run()
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in roles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), "a role hung"
    assert not errors, errors
    return out


def events_of(role: Role, kind: str) -> list[dict]:
    return [e for e in read_events(role.ctx.events.path) if e["type"] == kind]


def spread(roles: list[Role]) -> float:
    """How far the roles' models are from their mean (the largest difference of any weight)."""
    models = [r.ctx.model.get_weights() for r in roles]
    mean = [np.mean(np.stack(layer), axis=0) for layer in zip(*models)]
    return max(float(np.max(np.abs(w - m))) for model in models for w, m in zip(model, mean))


def test_gossip_nodes_in_memory_run_their_rounds_and_their_models_come_together(tmp_path):
    net = MemoryNetwork()
    names = ["g1", "g2", "g3", "g4"]
    # no training: gossip only averages, so the models (different seeds) must come together
    roles = [role_of(GossipRole, tmp_path, net, n, {"sync": 8, "epoch": 0, "wait_s": 0.3}, names, seed=i)
             for i, n in enumerate(names)]
    before = spread(roles)
    results = run_all(roles)
    for r in roles:
        assert [e["round"] for e in events_of(r, "round")] == list(range(1, 9)), r.ctx.name
        assert results[r.ctx.name]["rounds"] == 8 and r.finished
        assert sum(e["bytes_sent"] for e in events_of(r, "round")) > 0  # counted against the peers it sent to
    assert sum(e["received_models"] for r in roles for e in events_of(r, "round")) >= 8
    assert spread(roles) < 0.5 * before


def test_fl_in_memory_averages_the_trainers_updates_by_their_samples(tmp_path):
    net, progress = MemoryNetwork(), []
    trainers = {"t1": 30, "t2": 20, "t3": 10}
    names = ["agg", *trainers]
    agg = role_of(AggregatorRole, tmp_path, net, "agg",
                  {"sync": 3, "epoch": 0, "trainers": list(trainers), "trainer_samples": trainers,
                   "deadline_s": 20, "quorum": 1.0}, names, progress=progress)
    workers = [role_of(TrainerRole, tmp_path, net, t, {"sync": 3, "epoch": 2, "aggregator": "agg",
                                                       "idle_timeout_s": 30}, names, samples=n)
               for t, n in trainers.items()]
    start = agg.ctx.model.get_weights()
    results = run_all([agg, *workers])
    rounds = events_of(agg, "round")
    assert [e["round"] for e in rounds] == [1, 2, 3] and results["agg"]["rounds"] == 3
    assert all(e["closed"] == "all" and e["received_models"] == 3 for e in rounds)
    assert rounds[-1]["samples"] == trainers  # weighted by the confs' counts
    for w in workers:  # every trainer trained every round, and was told the run is over
        assert [e["round"] for e in events_of(w, "round")] == [1, 2, 3] and results[w.ctx.name]["rounds"] == 3
    # the global model is FedAvg of the last updates (each trainer still holds the model it sent)
    expected = weighted_average([w.ctx.model.get_weights() for w in workers], list(trainers.values()))
    assert all(np.array_equal(a, b) for a, b in zip(agg.ctx.model.get_weights(), expected))
    assert any(not np.array_equal(a, b) for a, b in zip(agg.ctx.model.get_weights(), start))
    assert rounds[-1]["accuracy"] > 0.9  # three separable blobs
    assert [f["round"] for name, _, f in progress if name == "agg"] == [1, 2, 3]
    for e in [*rounds, *(x for w in workers for x in events_of(w, "round"))]:  # phase timestamps in the round
        ph = e["phases"]
        assert set(ph) == {"train", "evaluate", "send", "wait"} and ph["evaluate"] and ph["send"]
        spans = [s for v in ph.values() for s in v]
        assert all(s[0] <= s[1] for s in spans) and max(s[1] for s in spans) <= round(e["t_end"], 4) + 1e-4
        assert all(s[2] <= s[3] for v in (ph["train"], ph["evaluate"], ph["send"]) for s in v)  # CPU clocks
    assert all(e["phases"]["train"] for w in workers for e in events_of(w, "round"))  # trainers trained
    assert all(not e["phases"]["train"] for e in rounds)  # the aggregator does not


def test_ring_all_reduce_in_memory_leaves_every_member_with_the_same_model(tmp_path):
    net = MemoryNetwork()
    names = ["r0", "r1", "r2"]
    conf = {"sync": 3, "epoch": 1, "ring": names, "join_wait_s": 5, "step_timeout_s": 10}
    roles = [role_of(RingRole, tmp_path, net, n, conf, names) for n in names]
    results = run_all(roles)
    held = [r.ctx.model.get_weights() for r in roles]
    for r in roles:
        assert [(e["round"], e["members"]) for e in events_of(r, "round")] == [(1, names), (2, names), (3, names)]
        assert results[r.ctx.name]["rounds"] == 3 and r.finished
    assert all(np.array_equal(a, b) for other in held[1:] for a, b in zip(held[0], other))
    assert events_of(roles[0], "round")[-1]["accuracy"] > 0.9


def test_ring_in_memory_goes_on_without_a_member_that_is_down(tmp_path):
    net = MemoryNetwork()
    names = ["r0", "r1", "r2"]
    conf = {"sync": 2, "epoch": 0, "ring": names, "join_wait_s": 2, "step_timeout_s": 5}
    roles = [role_of(RingRole, tmp_path, net, n, conf, names, seed=i) for i, n in enumerate(names)]
    net.down.add("r2")  # never joins: the others form a ring of two and average exactly
    before = [r.ctx.model.get_weights() for r in roles[:2]]
    run_all(roles[:2])
    mean = [(a.astype(np.float64) + b) / 2 for a, b in zip(*before)]
    for r in roles[:2]:
        assert [e["members"] for e in events_of(r, "round")] == [["r0", "r1"]] * 2
        assert max(float(np.max(np.abs(w - m))) for w, m in zip(r.ctx.model.get_weights(), mean)) <= 1e-6
    assert [e["members"] for e in events_of(roles[0], "ring_formed")] == [["r0", "r1"]]


def test_etree_in_memory_runs_its_rounds_down_the_tree(tmp_path):
    net, progress = MemoryNetwork(), []
    names = ["a", "b", "c"]
    leaf = {"layer": 1, "parent": "a", "children": [], "sync": 1, "epoch": 1}
    root = {"sync": 2, "epoch": 1, "root": "a", "members": ["b", "c"],
            "positions": [{"layer": 2, "parent": None, "children": names, "sync": 2, "epoch": 1,
                           "deadline_s": 20, "quorum": 1.0}, leaf]}
    roles = [role_of(ETreeRole, tmp_path, net, "a", root, names, progress=progress)]
    roles += [role_of(ETreeRole, tmp_path, net, n, {"sync": 2, "epoch": 1, "root": "a", "positions": [leaf]},
                      names, progress=progress) for n in ("b", "c")]
    start = roles[0].ctx.model.get_weights()
    run_all(roles)
    top = [e for e in events_of(roles[0], "round") if e["layer"] == 2]
    assert len(top) == 2 and all(e["closed"] == "all" and e["received_models"] == 3 for e in top)
    for r in roles:  # every node trained once per global round
        assert len([e for e in events_of(r, "round") if e["layer"] == 1]) == 2, r.ctx.name
    # progress counts the rounds of each layer
    assert [f["round"] for name, _, f in progress if name == "a" and f["layer"] == 2] == [1, 2]
    assert [f["round"] for name, _, f in progress if name == "b"] == [1, 2]
    assert any(not np.array_equal(a, b) for a, b in zip(roles[0].ctx.model.get_weights(), start))
    assert all(r.done.is_set() for r in roles[1:])  # the root told the tree it is done


# the node's transport: signed HTTP, through a relay when the destination is not linked --------------
def test_http_transport_signs_end_to_end_and_per_hop_and_relays(monkeypatch):
    from dml_app.runtime import transport

    run = bytes(range(32))
    nodes = {n: auth.NodeKeys(n, auth.node_secret(run, n)) for n in ("a", "r", "d")}
    for n, peers in {"a": ("r", "d"), "r": ("a",), "d": ("a",)}.items():
        nodes[n].set_peer_keys({p: auth.pair_key(run, n, p).hex() for p in peers})
    sent = []

    def request(method, url, body, content_type, timeout_s, retries, headers, max_answer_bytes, answer_headers,
                expect_continue):
        assert not expect_continue  # a relay reads the body whatever the destination would answer
        sent.append((url, {k.lower(): v for k, v in headers().items()}, timeout_s, retries))
        nonce = sent[-1][1][auth.E2E[2].lower()]  # d signs its answer to that message (the relay passes it back)
        answer_headers[auth.ANSWER_SIG.lower()] = nodes["d"].answer_sig("a", nonce, b"answer")
        return 200, b"answer"

    monkeypatch.setattr(transport, "request", request)
    http = HttpTransport({"r": "10.0.0.2:4444"}, nodes["a"])
    assert http.post("r", "d", "/gossip", b"body", "application/octet-stream", 7.5, 0, ttl=5) == b"answer"
    monkeypatch.setattr(nodes["d"], "answer_sig", lambda asker, nonce, answer: "00" * 32)
    with pytest.raises(auth.AuthFailed, match="not signed by it"):  # an answer d did not sign
        http.post("r", "d", "/gossip", b"body", "application/octet-stream", 7.5)
    url, headers, timeout_s, retries = sent[0]
    assert url == "http://10.0.0.2:4444/relay?to=d&path=/gossip" and (timeout_s, retries) == (7.5, 0)
    digest = auth.body_hash(b"body")
    assert nodes["d"].check_peer(headers, "POST", "/gossip", digest) == "a"
    assert nodes["r"].check_hop(headers, "POST", "/relay?to=d&path=/gossip", digest) == "a"
    assert headers[TTL_HEADER.lower()] == "5"
    monkeypatch.setattr(transport, "request", lambda *a, **k: (502, b"relay_failed"))
    with pytest.raises(ConnectionError, match="502"):
        http.post("r", "d", "/gossip", b"body", "application/octet-stream", 1.0)
    with pytest.raises(ConnectionError, match="no keys"):
        HttpTransport({"r": "x:1"}, None).post("r", "r", "/gossip", b"", "application/octet-stream", 1.0)


def test_a_role_sends_through_its_transport_and_counts_bytes_against_the_next_hop(tmp_path):
    net = MemoryNetwork()
    a = role_of(GossipRole, tmp_path, net, "a", {"forward": {"c": "b"}}, ["a", "b"])
    role_of(GossipRole, tmp_path, net, "b", {}, ["a", "b"])
    c = role_of(GossipRole, tmp_path, net, "c", {}, ["c"])
    c.inbox.put = lambda item: None  # (nothing runs c's rounds)
    assert a.post_weights("c", "/gossip", 1)  # delivered, counted against b, the next hop
    assert set(a.traffic.sent) == {"b"} and set(c.traffic.recv) == {"a"}
    assert a.post("x", "/gossip", b"", "application/octet-stream", 1) is None  # no route
    net.down.add("c")
    assert not a.post_weights("c", "/gossip", 2)
    assert [e["peer"] for e in events_of(a, "send_failed")] == ["x", "c"]


def test_dml_app_imports_nothing_of_the_controller_or_the_worker():
    """What runs in a node stands alone (it is synced to nodes without the rest)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "dml_app"
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n.split(".")[0] in ("controller", "worker")], path

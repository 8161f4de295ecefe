"""The user-algorithm examples (examples/algorithms/), loaded by path as a node loads them, run in
memory against the built-in roles on the digits, and their effect checked against hand formulas."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import numpy as np
import pytest

from controller.confs.datasets import digits_arrays
from dml_app.models.make import make_model
from dml_app.roles.base import Context, Role
from dml_app.roles.fl import AggregatorRole
from dml_app.roles.gossip import GossipRole
from dml_app.roles.memory import MemoryNetwork
from dml_app.runtime.events import EventLog
from tests.unit.test_roles_memory import events_of, run_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = {"hidden": [32], "seed": 0, "learning_rate": 0.01}


def load_example(name: str) -> ModuleType:
    """``examples/algorithms/<name>.py`` imported from its path."""
    path = os.path.join(ROOT, "examples", "algorithms", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"user_algorithm_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits (pixels / 16), shuffled: 1,497 to train, 300 to test."""
    pixels, y = digits_arrays()
    order = np.random.default_rng(0).permutation(len(y))
    x = (pixels / 16.0).astype(np.float32)[order]
    y = y[order]
    return x[300:], y[300:], x[:300], y[:300]


def node(cls: type, tmp_path, net: MemoryNetwork, name: str, conf: dict, peers: list[str], data: tuple,
         model: dict = MODEL) -> Role:
    """A role of class ``cls`` with a numpy MLP on ``data``, linked to ``peers`` in ``net``."""
    n_features = data[0].shape[1]
    ctx = Context(name, make_model(model, n_features, 10), data,
                  {"connect": {p: "memory" for p in peers if p != name}, "model": model, **conf},
                  {"batch_size": 32}, EventLog(str(tmp_path / f"{name}.jsonl"), "run", name), lambda *a, **k: None)
    return net.attach(cls(ctx))


def shard(digits: tuple, i: int, of: int) -> tuple:
    x, y, x_test, y_test = digits
    return x[i::of], y[i::of], x_test, y_test


# FedProx ----------------------------------------------------------------------------------------------
def fedprox_run(tmp_path, digits: tuple, mu: float, sync: int) -> tuple[Role, list[Role]]:
    fedprox = load_example("fedprox")
    net, names = MemoryNetwork(), ["agg", "t1", "t2", "t3"]
    agg = node(AggregatorRole, tmp_path, net, "agg", {"sync": sync, "epoch": 0, "trainers": names[1:],
                                                      "deadline_s": 60, "quorum": 1.0}, names, digits)
    trainers = [node(fedprox.FedProxTrainer, tmp_path, net, t,
                     {"sync": sync, "epoch": 1, "aggregator": "agg", "idle_timeout_s": 60,
                      "algorithm": {"module": "algos/fedprox.py", "role": "FedProxTrainer", "mu": mu}},
                     names, shard(digits, i, 3)) for i, t in enumerate(names[1:])]
    run_all([agg, *trainers], timeout_s=120)
    return agg, trainers


def test_fedprox_trainers_with_the_built_in_aggregator_learn_the_digits(tmp_path, digits):
    agg, trainers = fedprox_run(tmp_path, digits, mu=0.01, sync=3)
    rounds = events_of(agg, "round")
    assert [(e["round"], e["closed"], e["received_models"], e["aggregation"]) for e in rounds] == \
        [(1, "all", 3, "fedavg"), (2, "all", 3, "fedavg"), (3, "all", 3, "fedavg")]
    assert rounds[-1]["accuracy"] > 0.85, rounds[-1]["accuracy"]
    for t in trainers:  # the built-in round's event, with the algorithm's fields
        events = events_of(t, "round")
        assert [e["round"] for e in events] == [1, 2, 3]
        assert all(e["prox_mu"] == 0.01 and e["prox_distance"] > 0 and e["train_loss"] > 0 and e["bytes_sent"] > 0
                   for e in events)


def test_a_huge_mu_keeps_the_update_at_the_global_model(tmp_path, digits):
    distances = {}
    for mu in (0.0, 1e5):
        (tmp_path / str(mu)).mkdir()
        agg, trainers = fedprox_run(tmp_path / str(mu), digits, mu=mu, sync=1)
        start = make_model(MODEL, 64, 10).get_weights()  # the global model the trainers got
        for t in trainers:  # what each sent (and still holds), and what its event says
            held = math_distance(t.ctx.model.get_weights(), start)
            assert abs(events_of(t, "round")[0]["prox_distance"] - held) <= 1e-3 * max(held, 1e-6)
        distances[mu] = np.mean([events_of(t, "round")[0]["prox_distance"] for t in trainers])
    # mu = 0: plain training moves the weights; eta mu = 1000 pulls each step 1000/1001 of the way back
    assert distances[0.0] > 0.5
    assert distances[1e5] < 0.02 * distances[0.0], distances


def math_distance(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((x.astype(np.float64) - y) ** 2) for x, y in zip(a, b))))


def test_fedprox_refuses_a_bad_mu(tmp_path, digits):
    fedprox = load_example("fedprox")
    with pytest.raises(ValueError, match="'mu': expected a finite number >= 0, got -1"):
        node(fedprox.FedProxTrainer, tmp_path, MemoryNetwork(), "t1",
             {"aggregator": "agg", "algorithm": {"mu": -1}}, ["agg", "t1"], digits)


# momentum gossip -------------------------------------------------------------------------------------
def test_momentum_gossip_nodes_learn_the_digits(tmp_path, digits):
    gossip = load_example("gossip_momentum")
    net, names = MemoryNetwork(), ["g1", "g2", "g3", "g4"]
    roles = [node(gossip.MomentumGossip, tmp_path, net, n,
                  {"sync": 6, "epoch": 1, "wait_s": 1.0, "algorithm": {"beta": 0.3}}, names, shard(digits, i, 4))
             for i, n in enumerate(names)]
    results = run_all(roles, timeout_s=120)
    for r in roles:
        events = events_of(r, "round")
        assert [e["round"] for e in events] == [1, 2, 3, 4, 5, 6] and results[r.ctx.name]["rounds"] == 6
        assert all(e["momentum_beta"] == 0.3 for e in events) and events[0]["momentum_norm"] == 0.0
        assert any(e["momentum_norm"] > 0 for e in events[1:])
    accuracy = np.mean([events_of(r, "round")[-1]["accuracy"] for r in roles])
    assert accuracy > 0.85, accuracy


def controlled(cls: type, tmp_path, conf: dict) -> tuple[Role, Role]:
    """A node of ``cls`` holding every weight 1.0, with two models in its inbox (every weight
    3.0, and 8.0), linked to a plain gossip node that takes what it sends."""
    net = MemoryNetwork()
    data = (np.zeros((4, 2), np.float32), np.zeros(4, np.int64), np.zeros((4, 2), np.float32), np.zeros(4, np.int64))
    model = {"hidden": [3], "seed": 0}
    role = node(cls, tmp_path, net, "n", {"sync": 2, "epoch": 0, "wait_s": 1.0, **conf}, ["n", "sink"], data, model)
    sink = node(GossipRole, tmp_path, net, "sink", {"sync": 1, "epoch": 0}, ["n", "sink"], data, model)
    shapes = [w.shape for w in role.ctx.model.get_weights()]
    role.ctx.model.set_weights([np.full(s, 1.0, np.float32) for s in shapes])
    for peer, value in (("sink", 3.0), ("n3", 8.0)):  # (one model a peer is kept: two peers)
        role.deliver(peer, [np.full(s, value, np.float32) for s in shapes])
    return role, sink


def test_the_momentum_buffer_moves_the_weights_by_the_hand_formula(tmp_path):
    gossip = load_example("gossip_momentum")
    plain, _ = controlled(GossipRole, tmp_path / "plain", {})
    moving, sink = controlled(gossip.MomentumGossip, tmp_path / "momentum", {"algorithm": {"beta": 0.5}})
    moving.momentum = [np.full(w.shape, 2.0) for w in moving.ctx.model.get_weights()]  # m after earlier rounds
    plain.round(2)
    record = moving.round(2)
    # avg = (1 + 3 + 8) / 3 = 4: plain gossip holds 4; m = 0.5 * 2 + (4 - 1) = 4 and w = 1 + 4 = 5
    assert all(np.array_equal(w, np.full(w.shape, 4.0, np.float32)) for w in plain.ctx.model.get_weights())
    assert all(np.array_equal(w, np.full(w.shape, 5.0, np.float32)) for w in moving.ctx.model.get_weights())
    assert all(np.array_equal(m, np.full(m.shape, 4.0)) for m in moving.momentum)
    assert record.received == 2 and record.extra["momentum_beta"] == 0.5
    assert record.extra["momentum_norm"] == pytest.approx(4.0 * np.sqrt(sum(m.size for m in moving.momentum)))
    assert list(sink.pending) == ["n"]  # and sent the model on, as plain gossip does
    # the next round from an empty buffer: m = avg - w, the plain gossip step, then momentum carries on
    fresh, _ = controlled(gossip.MomentumGossip, tmp_path / "fresh", {"algorithm": {"beta": 0.5}})
    fresh.round(2)  # m = 4 - 1 = 3, w = 4 (plain gossip's)
    fresh.deliver("sink", [np.full(w.shape, 6.0, np.float32) for w in fresh.ctx.model.get_weights()])
    fresh.round(3)  # avg = (4 + 6) / 2 = 5: m = 0.5 * 3 + (5 - 4) = 2.5, w = 4 + 2.5 = 6.5
    assert all(np.array_equal(w, np.full(w.shape, 6.5, np.float32)) for w in fresh.ctx.model.get_weights())


def test_momentum_gossip_refuses_a_bad_beta(tmp_path):
    gossip = load_example("gossip_momentum")
    with pytest.raises(ValueError, match=r"'beta': expected a number in \[0, 1\), got 1"):
        controlled(gossip.MomentumGossip, tmp_path, {"algorithm": {"beta": 1}})

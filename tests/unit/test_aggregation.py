"""The aggregation rules against hand computations, their confs, and the roles that use them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from controller.confs.confs import load_structure
from dml_app.reduction.aggregation import (AggregationConfError, Aggregator, checked_conf, fedavg, median, trim_count,
                                 trimmed_mean)
from dml_app.roles.etree import ETreeRole
from dml_app.roles.fl import AggregatorRole, TrainerRole
from dml_app.roles.memory import MemoryNetwork
from tests.unit.test_algorithms import LINE, _load, write
from tests.unit.test_roles_memory import events_of, role_of, run_all
from worker.api.errors import ConfigError


def model(*layers: list) -> list[np.ndarray]:
    """A model of float32 layers."""
    return [np.array(layer, dtype=np.float32) for layer in layers]


def same(got: list[np.ndarray], expected: list[np.ndarray]) -> bool:
    return all(g.dtype == e.dtype and g.shape == e.shape and np.allclose(g, e, atol=1e-6)
               for g, e in zip(got, expected)) and len(got) == len(expected)


# the rules, by hand ---------------------------------------------------------------------------------
def test_fedavg_weights_by_samples_and_is_the_weighted_average_bit_for_bit():
    a, b = model([[1.0, 2.0]], [10.0]), model([[4.0, 8.0]], [40.0])
    # (1 * 1 + 3 * 4) / 4 = 3.25, (1 * 2 + 3 * 8) / 4 = 6.5, (10 + 120) / 4 = 32.5
    assert same(fedavg([a, b], [1, 3]), model([[3.25, 6.5]], [32.5]))
    rng = np.random.default_rng(3)
    updates = [[rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=4).astype(np.float32)] for _ in range(7)]
    counts = [int(n) for n in rng.integers(1, 500, 7)]
    by_hand = []  # each layer summed in float64, weighted by count / total, back to float32
    for i in range(2):
        acc = np.zeros(updates[0][i].shape, dtype=np.float64)
        for u, n in zip(updates, counts):
            acc += u[i].astype(np.float64) * (n / sum(counts))
        by_hand.append(acc.astype(np.float32))
    for got, want in zip(Aggregator().combine(updates[0], updates, counts), by_hand):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_median_per_coordinate():
    updates = [model([1.0, 30.0]), model([2.0, 10.0]), model([100.0, 20.0])]
    assert same(median(updates), model([2.0, 20.0]))
    assert same(median(updates + [model([3.0, -5.0])]), model([2.5, 15.0]))  # even: the two middle ones' mean


@pytest.mark.parametrize("n,fraction,k", [(10, 0.1, 1), (5, 0.1, 0), (5, 0.2, 1), (3, 0.4, 1), (4, 0.49, 1),
                                          (2, 0.45, 0), (1, 0.4, 0), (100, 0.29, 29), (10, 0.0, 0)])
def test_trim_count_keeps_at_least_one(n, fraction, k):
    assert trim_count(n, fraction) == k


def test_trimmed_mean_drops_the_extremes_of_each_coordinate():
    # coordinate 0: 1, 2, 3, 4, 100 -> 2, 3, 4 -> 3; coordinate 1: -50, 5, 6, 7, 8 -> 5, 6, 7 -> 6
    updates = [model([1.0, 8.0]), model([100.0, 5.0]), model([3.0, -50.0]), model([2.0, 7.0]), model([4.0, 6.0])]
    assert same(trimmed_mean(updates, 0.2), model([3.0, 6.0]))
    assert same(trimmed_mean(updates, 0.1), model([22.0, -4.8]))  # floor(0.5) = 0 dropped: the plain mean


def test_fedavgm_two_rounds_by_hand():
    agg = Aggregator({"rule": "fedavgm", "server_lr": 0.5, "momentum": 0.9})
    w0 = model([1.0, 2.0])
    # round 1: avg = ([0, 0] + [0, 2]) / 2 = [0, 1]; v = w0 - avg = [1, 1]; w1 = w0 - 0.5 v = [0.5, 1.5]
    w1 = agg.combine(w0, [model([0.0, 0.0]), model([0.0, 2.0])], [1, 1])
    assert same(w1, model([0.5, 1.5]))
    # round 2: avg = [0.5, 0.5]; v = 0.9 [1, 1] + (w1 - avg) = [0.9, 1.9]; w2 = w1 - 0.5 v = [0.05, 0.55]
    w2 = agg.combine(w1, [model([0.5, 0.5])], [7])
    assert same(w2, model([0.05, 0.55]))
    assert np.allclose(agg.velocity[0], [0.9, 1.9]) and agg.velocity[0].dtype == np.float64
    # no momentum and a step of 1 is FedAvg
    plain = Aggregator({"rule": "fedavgm", "server_lr": 1.0, "momentum": 0.0})
    for _ in range(2):
        assert same(plain.combine(w0, [model([0.0, 0.0]), model([0.0, 2.0])], [1, 3]), model([0.0, 1.5]))


def test_a_poisoned_update_moves_fedavg_but_not_the_robust_rules():
    rng = np.random.default_rng(0)
    honest = [[rng.normal(1.0, 0.1, size=(4, 3)).astype(np.float32), rng.normal(-1.0, 0.1, size=3).astype(np.float32)]
              for _ in range(9)]
    poisoned = [np.full((4, 3), 1000.0, dtype=np.float32), np.full(3, -1000.0, dtype=np.float32)]
    honest_mean = fedavg(honest, [1] * 9)
    updates, counts = honest + [poisoned], [1] * 10

    def distance(weights: list[np.ndarray]) -> float:
        return max(float(np.max(np.abs(w - m))) for w, m in zip(weights, honest_mean))

    assert distance(Aggregator({"rule": "fedavg"}).combine(honest[0], updates, counts)) > 90  # (1000 - 1) / 10
    assert distance(Aggregator({"rule": "median"}).combine(honest[0], updates, counts)) < 0.2
    assert distance(Aggregator({"rule": "trimmed_mean", "trim_fraction": 0.1}).combine(honest[0], updates,
                                                                                       counts)) < 0.2
    # the robust rules ignore the sample count a poisoned update could inflate
    assert distance(Aggregator({"rule": "median"}).combine(honest[0], updates, [1] * 9 + [10**6])) < 0.2


def test_rules_keep_each_layers_dtype():
    updates = [[np.array([1.0, 2.0], dtype=np.float64), np.array([1.0], dtype=np.float32)],
               [np.array([3.0, 5.0], dtype=np.float64), np.array([2.0], dtype=np.float32)]]
    for rule in ("fedavg", "fedavgm", "trimmed_mean", "median"):
        out = Aggregator({"rule": rule}).combine(updates[0], updates, [1, 1])
        assert [w.dtype for w in out] == [np.float64, np.float32], rule


# the conf --------------------------------------------------------------------------------------------
def test_aggregator_conf_defaults_and_refusals():
    assert checked_conf(None) == {"rule": "fedavg", "server_lr": 1.0, "momentum": 0.9, "trim_fraction": 0.1}
    with pytest.raises(AggregationConfError, match="'trim_fractoin': unknown field; did you mean 'trim_fraction'"):
        Aggregator({"trim_fractoin": 0.2})
    with pytest.raises(ValueError, match="'rule': 'mean' is not one of"):
        Aggregator({"rule": "mean"})
    for key, value in (("server_lr", 0), ("server_lr", 10.5), ("momentum", 1.0), ("momentum", -0.1),
                       ("trim_fraction", 0.5), ("momentum", True), ("server_lr", float("nan"))):
        with pytest.raises(AggregationConfError, match=f"'{key}': must be a number in"):
            Aggregator({key: value})
    assert Aggregator({"server_lr": 10, "momentum": 0, "trim_fraction": 0}).conf["server_lr"] == 10.0


def test_fl_structure_takes_an_aggregation_and_refuses_a_bad_one(tmp_path):
    topo = _load(LINE)
    entry = {"name": "a", "sync": 2, "aggregation": {"rule": "fedavgm", "momentum": 0.5}}
    confs = load_structure(write(tmp_path, "fl_structure.json", {"node_list": [entry, {"name": "b"}]}), topo, "fl")
    assert confs["a"]["aggregation"] == {"rule": "fedavgm", "server_lr": 1.0, "momentum": 0.5, "trim_fraction": 0.1}
    plain = load_structure(write(tmp_path, "fl_structure.json", {"node_list": [{"name": "a", "sync": 2},
                                                                               {"name": "b"}]}), topo, "fl")
    assert plain["a"]["aggregation"]["rule"] == "fedavg" and "aggregation" not in plain["b"]
    for aggregation, expected in (({"rule": "medain"}, "'rule': 'medain' is not one of .*did you mean 'median'"),
                                  ({"momentun": 0.5}, "'momentun': unknown field; did you mean 'momentum'"),
                                  ({"momentum": 1}, r"'momentum': 1.0 is not a number in \[0, 1\)"),
                                  ({"trim_fraction": 0.5}, r"'trim_fraction': 0.5 is not a number in \[0, 0.5\)"),
                                  ({"server_lr": 0}, r"'server_lr': must be a number in \(0, 10\]"),
                                  ("median", "'aggregation': expected an object")):
        path = write(tmp_path, "fl_structure.json", {"node_list": [{**entry, "aggregation": aggregation},
                                                                   {"name": "b"}]})
        with pytest.raises(ConfigError, match=expected) as e:
            load_structure(path, topo, "fl")
        assert "fl_structure.json: node_list[0] (a)" in str(e.value)


def test_etree_structure_gives_its_aggregators_the_aggregation(tmp_path):
    path = write(tmp_path, "el_structure.json", {"aggregation": {"rule": "trimmed_mean", "trim_fraction": 0.2},
                                                 "node_list": [{"name": "b", "layer": 2, "sync": 1, "child_num": 2},
                                                               {"name": "a", "layer": 1}, {"name": "c", "layer": 1}]})
    confs = load_structure(path, _load(LINE), "etree")
    assert confs["b"]["aggregation"] == {"rule": "trimmed_mean", "server_lr": 1.0, "momentum": 0.9,
                                         "trim_fraction": 0.2}
    assert "aggregation" not in confs["a"] and "aggregation" not in confs["c"]
    with pytest.raises(ConfigError, match="el_structure.json: field 'aggregation': expected an object"):
        load_structure(write(tmp_path, "el_structure.json", {"aggregation": [], "node_list": []}), _load(LINE), "etree")


# the roles -------------------------------------------------------------------------------------------
def test_fl_aggregator_combines_by_its_rule_and_names_it(tmp_path):
    net = MemoryNetwork()
    trainers = {"t1": 30, "t2": 20, "t3": 10}
    agg = role_of(AggregatorRole, tmp_path, net, "agg",
                  {"sync": 2, "epoch": 0, "trainers": list(trainers), "trainer_samples": trainers, "deadline_s": 20,
                   "quorum": 1.0, "aggregation": {"rule": "median"}}, ["agg", *trainers])
    workers = [role_of(TrainerRole, tmp_path, net, t, {"sync": 2, "epoch": 1, "aggregator": "agg",
                                                       "idle_timeout_s": 30}, ["agg", *trainers], samples=n)
               for t, n in trainers.items()]
    run_all([agg, *workers])
    rounds = events_of(agg, "round")
    assert [(e["round"], e["aggregation"], e["closed"]) for e in rounds] == [(1, "median", "all"),
                                                                            (2, "median", "all")]
    # each trainer still holds the update it sent last: the global model is their coordinate-wise median
    expected = median([w.ctx.model.get_weights() for w in workers])
    assert all(np.array_equal(a, b) for a, b in zip(agg.ctx.model.get_weights(), expected))
    assert not all(np.array_equal(a, b) for a, b in zip(expected, fedavg([w.ctx.model.get_weights()
                                                                           for w in workers], [30, 20, 10])))


def test_etree_aggregators_combine_by_their_rule(tmp_path):
    net = MemoryNetwork()
    names = ["a", "b", "c", "d"]
    leaf = {"layer": 1, "parent": "a", "children": [], "sync": 1, "epoch": 1}
    root = {"sync": 1, "epoch": 1, "root": "a", "members": ["b", "c", "d"], "aggregation": {"rule": "median"},
            "positions": [{"layer": 2, "parent": None, "children": ["b", "c", "d"], "sync": 1, "epoch": 1,
                           "deadline_s": 20, "quorum": 1.0}]}
    roles = [role_of(ETreeRole, tmp_path, net, "a", root, names)]
    roles += [role_of(ETreeRole, tmp_path, net, n, {"sync": 1, "epoch": 1, "root": "a", "positions": [leaf]},
                      names, samples=s) for n, s in (("b", 10), ("c", 20), ("d", 40))]
    run_all(roles)
    top = [e for e in events_of(roles[0], "round") if e["layer"] == 2]
    assert [(e["aggregation"], e["received_models"]) for e in top] == [("median", 3)]
    children = [r.ctx.model.get_weights() for r in roles[1:]]
    got = roles[0].ctx.model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(got, median(children)))
    assert not all(np.allclose(a, b) for a, b in zip(got, fedavg(children, [10, 20, 40])))  # not FedAvg's


def test_fl_structure_file_in_the_repository_still_loads(tmp_path):
    """The shipped fl_structure.json needs no aggregation field (FedAvg)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = json.load(open(os.path.join(root, "fl_structure.json")))
    links = _load(json.load(open(os.path.join(root, "links.json"))))
    confs = load_structure(write(tmp_path, "fl_structure.json", data), links, "fl")
    assert next(iter(confs.values()))["aggregation"]["rule"] == "fedavg"

"""Pure logic of the FL, E-tree and ring roles, and of their structure files."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from controller.topology import Topology, load_links
from dml_app.roles.base import weighted_average
from dml_app.roles.fl import pick, quorum_count
from dml_app.roles.ring import join, split
from dml_tool.confs import load_structure, next_hops, structure_confs
from dml_tool.structures import guess_algorithm
from worker.errors import ConfigError


def _load(links: dict) -> Topology:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/links.json"
        with open(path, "w") as f:
            json.dump(links, f)
        return load_links(path)


LINE = {"a": [{"dest": "b", "bw": "10mbit"}], "b": [{"dest": "a", "bw": "10mbit"}, {"dest": "c", "bw": "10mbit"}],
        "c": [{"dest": "b", "bw": "10mbit"}]}


def write(tmp_path, name: str, data: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


# FedAvg ---------------------------------------------------------------------------------------
def test_fedavg_matches_a_hand_computation():
    a = [np.array([[1.0, 2.0]], dtype=np.float32), np.array([10.0], dtype=np.float32)]
    b = [np.array([[4.0, 8.0]], dtype=np.float32), np.array([40.0], dtype=np.float32)]
    # 100 and 300 samples: (100 * 1 + 300 * 4) / 400 = 3.25, (100 * 2 + 300 * 8) / 400 = 6.5, ...
    avg = weighted_average([a, b], [100, 300])
    assert np.array_equal(avg[0], np.array([[3.25, 6.5]], dtype=np.float32))
    assert np.array_equal(avg[1], np.array([32.5], dtype=np.float32))
    assert avg[0].dtype == np.float32
    unweighted = [np.mean(layer, axis=0) for layer in zip(a, b)]
    assert not np.array_equal(avg[0], unweighted[0]), "weights matter"


def test_fedavg_refuses_mismatched_weights():
    with pytest.raises(ValueError):
        weighted_average([[np.zeros(2)]], [1, 2])
    with pytest.raises(ValueError):
        weighted_average([[np.zeros(2)]], [0])


# trainer selection ------------------------------------------------------------------------------
@pytest.mark.parametrize("quorum,picked,needed", [(0.5, 6, 3), (0.5, 5, 3), (1.0, 4, 4), (0.01, 10, 1), (0.3, 10, 3)])
def test_quorum_count(quorum, picked, needed):
    assert quorum_count(quorum, picked) == needed


def test_uniform_pick_is_distinct_and_seeded():
    trainers = [f"t{i}" for i in range(10)]
    first = pick(random.Random(1), trainers, 4)
    assert len(set(first)) == 4 and set(first) <= set(trainers)
    assert pick(random.Random(1), trainers, 4) == first


def test_speed_pick_favours_fast_trainers():
    trainers = ["fast", "slow"]
    seconds = {"fast": 1.0, "slow": 9.0}
    rng = random.Random(0)
    firsts = [pick(rng, trainers, 1, seconds)[0] for _ in range(2000)]
    assert 0.85 < firsts.count("fast") / 2000 < 0.95  # probability 0.9
    assert sorted(pick(rng, trainers, 2, seconds)) == trainers


# ring chunks ------------------------------------------------------------------------------------
def test_split_covers_every_element_even_when_a_layer_is_smaller_than_the_ring():
    weights = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([7.0, 8.0], dtype=np.float32)]
    chunks = split(weights, 6)
    assert len(chunks) == 6 and sum(c.size for c in chunks) == 14
    back = join(chunks, weights)
    assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(back, weights))
    assert len(split([np.array([1.0], dtype=np.float32)], 4)) == 4  # empty chunks are fine


def test_ring_all_reduce_in_process_gives_the_mean():
    """Four RingRoles wired to each other in memory (no network): the arithmetic only."""
    import threading

    from dml_app.events import EventLog
    from dml_app.http import Request
    from dml_app.roles.base import Context
    from dml_app.roles.ring import RingRole
    from dml_app import weights as wire

    names = ["r0", "r1", "r2", "r3"]
    rng = np.random.default_rng(0)
    models = {n: [rng.standard_normal((3, 2)).astype(np.float32), rng.standard_normal(3).astype(np.float32)]
              for n in names}
    roles: dict[str, RingRole] = {}

    def deliver(role: RingRole):
        def post_weights(peer, path, round_no, weights=None, meta=None, timeout_s=60.0):
            body = wire.encode(weights, {"from": role.ctx.name, "round": round_no, **(meta or {})})
            roles[peer].on_chunk(Request("POST", path, {}, body, wire.CONTENT_TYPE, sender=role.ctx.name,
                                         hop=role.ctx.name))
            return True
        return post_weights

    import tempfile

    tmp = tempfile.mkdtemp()
    for n in names:
        data = (np.zeros((1, 2)), np.zeros(1), np.zeros((1, 2)), np.zeros(1))
        ctx = Context(n, None, data, {"ring": names, "sync": 1}, {}, EventLog(f"{tmp}/{n}.jsonl", "r", n),
                      lambda *a, **k: None)
        roles[n] = RingRole(ctx)
        roles[n].post_weights = deliver(roles[n])  # type: ignore[method-assign]
    results: dict[str, list[np.ndarray]] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, roles[n].all_reduce(1, models[n])))
               for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    expected = [np.mean(np.stack(layer).astype(np.float64), axis=0) for layer in zip(*models.values())]
    for n in names:
        assert max(float(np.max(np.abs(h - e))) for h, e in zip(results[n], expected)) <= 1e-6


# structure files ---------------------------------------------------------------------------------
def test_fl_structure(tmp_path):
    topo = _load(LINE)
    path = write(tmp_path, "fl_structure.json", {"node_list": [
        {"name": "a", "sync": 3, "trainer_fraction": 0.5, "deadline_s": 5}, {"name": "b", "epoch": 2}, {"name": "c"}]})
    confs = load_structure(path, topo, "fl")
    assert confs["a"]["role"] == "fl_aggregator" and confs["a"]["trainers"] == ["b", "c"]
    assert confs["a"]["quorum"] == 0.5 and confs["a"]["selection"] == "uniform"
    assert confs["b"]["role"] == "fl_trainer" and confs["b"]["epoch"] == 2 and confs["c"]["epoch"] == 1
    out = structure_confs(confs, topo, {"a": "10.0.0.2", "b": "10.0.0.3", "c": "10.0.0.4"})
    # a and c have no link: b relays, both ways
    assert out["a"]["connect"] == {"b": "10.0.0.3:4444"} and out["a"]["forward"] == {"c": "b"}
    assert out["c"]["connect"] == {"b": "10.0.0.3:4444"} and out["c"]["forward"] == {"a": "b"}
    assert out["b"]["connect"] == {"a": "10.0.0.2:4444", "c": "10.0.0.4:4444"} and out["b"]["forward"] == {}
    assert "talks_to" not in out["a"]


@pytest.mark.parametrize("entry,expected", [
    ({"name": "a", "sync": 0}, r"'sync': must be an integer in \[1, 100000\], got 0"),
    ({"name": "a", "sync": 2, "trainer_fraction": 1.5}, "'trainer_fraction'"),
    ({"name": "a", "sync": 2, "selection": "fastest"}, "'selection'"),
    ({"name": "a", "sync": 2, "quorum": 0}, "'quorum'"),
    ({"name": "a"}, "missing field 'sync'"),
])
def test_bad_fl_aggregator(tmp_path, entry, expected):
    path = write(tmp_path, "fl_structure.json", {"node_list": [entry, {"name": "b"}]})
    with pytest.raises(ConfigError, match=expected) as e:
        load_structure(path, _load(LINE), "fl")
    assert "fl_structure.json: node_list[0] (a)" in str(e.value)


def test_fl_needs_trainers_and_a_separate_aggregator(tmp_path):
    with pytest.raises(ConfigError, match="at least one trainer"):
        load_structure(write(tmp_path, "f.json", {"node_list": [{"name": "a", "sync": 1}]}), _load(LINE), "fl")
    with pytest.raises(ConfigError, match="cannot also be a trainer"):
        load_structure(write(tmp_path, "g.json", {"node_list": [{"name": "a", "sync": 1}, {"name": "a"}]}),
                       _load(LINE), "fl")


def test_etree_structure_breadth_first(tmp_path):
    topo = _load(LINE)
    path = write(tmp_path, "el_structure.json", {"node_list": [
        {"name": "b", "layer": 3, "sync": 4, "child_num": 1},
        {"name": "b", "layer": 2, "sync": 2, "child_num": 3},
        {"name": "a", "layer": 1, "epoch": 2}, {"name": "b", "layer": 1}, {"name": "c", "layer": 1}]})
    confs = load_structure(path, topo, "etree")
    assert [p["layer"] for p in confs["b"]["positions"]] == [3, 2, 1]
    assert confs["b"]["positions"][0] == {"layer": 3, "parent": None, "children": ["b"], "sync": 4, "epoch": 1,
                                          "deadline_s": 2 * 60.0 + 60.0, "quorum": 0.5}
    assert confs["b"]["positions"][1]["deadline_s"] == 60.0
    assert confs["b"]["positions"][1]["children"] == ["a", "b", "c"] and confs["b"]["positions"][1]["parent"] == "b"
    assert confs["a"]["positions"] == [{"layer": 1, "parent": "b", "children": [], "sync": 1, "epoch": 2}]
    assert confs["a"]["epoch"] == 2 and confs["b"]["sync"] == 4
    assert sorted(confs["b"]["talks_to"]) == ["a", "c"] and confs["a"]["talks_to"] == ["b"]


@pytest.mark.parametrize("node_list,expected", [
    ([{"name": "a", "layer": 2, "sync": 1, "child_num": 2}, {"name": "b", "layer": 1}], "ask for 2 children"),
    ([{"name": "a", "layer": 2, "sync": 1, "child_num": 1}, {"name": "b", "layer": 1}, {"name": "c", "layer": 1}],
     "no aggregator above"),
    ([{"name": "a", "layer": 3, "sync": 1, "child_num": 1}, {"name": "b", "layer": 1}], "must be on layer 2"),
    ([{"name": "a", "layer": 2, "child_num": 1}, {"name": "b", "layer": 1}], "missing field 'sync'"),
    ([{"name": "a", "layer": 1}], "its layer must be >= 2"),
    ([{"name": "a", "layer": 2, "sync": 1, "child_num": 2}, {"name": "b", "layer": 1}, {"name": "b", "layer": 1}],
     "already on layer 1"),
    ([{"name": "a", "layer": 2, "sync": 1, "child_num": 1}, {"name": "zz", "layer": 1}], "unknown node"),
])
def test_bad_etree_structure(tmp_path, node_list, expected):
    with pytest.raises(ConfigError, match=expected):
        load_structure(write(tmp_path, "el_structure.json", {"node_list": node_list}), _load(LINE), "etree")


def test_ring_structure_and_missing_path(tmp_path):
    topo = _load(LINE)
    confs = load_structure(write(tmp_path, "ra.json", {"sync": 2, "node_list": [{"name": "a"}, {"name": "b"},
                                                                                  {"name": "c"}]}), topo, "ring")
    assert confs["a"]["ring"] == ["a", "b", "c"] and confs["c"]["talks_to"] == ["a"]
    out = structure_confs(confs, topo, {"a": "1.1.1.1", "b": "1.1.1.2", "c": "1.1.1.3"})
    assert out["c"]["forward"] == {"a": "b"}
    with pytest.raises(ConfigError, match="needs at least 2"):
        load_structure(write(tmp_path, "rb.json", {"sync": 2, "node_list": [{"name": "a"}]}), topo, "ring")
    one_way = _load({"a": [{"dest": "b", "bw": "1mbit"}], "b": []})
    ring = load_structure(write(tmp_path, "rc.json", {"sync": 1, "node_list": [{"name": "a"}, {"name": "b"}]}),
                          one_way, "ring")
    with pytest.raises(ConfigError, match="b must send to a, but no path"):
        structure_confs(ring, one_way, {"a": "1.1.1.1", "b": "1.1.1.2"})


def test_next_hops_agree_along_a_path():
    topo = _load({"a": [{"dest": "b", "bw": "1mbit"}], "b": [{"dest": "c", "bw": "1mbit"}],
                  "c": [{"dest": "d", "bw": "1mbit"}], "d": []})
    assert next_hops(topo, {"a", "b", "c", "d"}, "d") == {"c": "d", "b": "c", "a": "b"}
    assert next_hops(topo, {"a", "b", "d"}, "d") == {}  # c takes no part: it cannot relay


def test_guess_algorithm():
    assert [guess_algorithm(p) for p in ("x/fl_structure.json", "el_structure.json", "ra_s.json", "mine.json")] == \
        ["fl", "etree", "ring", "gossip"]


def test_every_role_serves_the_routes_it_declares():
    from dml_app.roles.etree import ETreeRole
    from dml_app.roles.fl import AggregatorRole, TrainerRole
    from dml_app.roles.gossip import GossipRole
    from dml_app.roles.ring import RingRole

    for role in (GossipRole, AggregatorRole, TrainerRole, ETreeRole, RingRole):
        obj = role.__new__(role)
        assert set(role.routes(obj)) == set(role.ROUTES), role.name

"""Pure logic of the FL, E-tree and ring roles, and of their structure files."""
from __future__ import annotations

import json
import random

import time

import numpy as np
import pytest

from controller.confs.confs import load_structure, next_hops, structure_confs
from controller.confs.structures import guess_algorithm
from controller.model.topology import Topology, load_links
from dml_app.reduction.aggregation import fedavg as weighted_average
from dml_app.reduction.allreduce import join, split
from dml_app.roles.fl import pick
from dml_app.roles.memory import MemoryNetwork
from dml_app.roles.shared import quorum_count
from worker.api.errors import ConfigError


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


def ring_role(tmp, name: str, names: list[str], net: MemoryNetwork, sync: int = 1, life: int = 1, seed: int = 0,
              offset: float = 0.0):
    """A RingRole with a tiny numpy model; its 'training' adds ``offset`` to every weight."""
    from dml_app.models.make import make_model
    from dml_app.roles.base import Context
    from dml_app.roles.ring import RingRole
    from dml_app.runtime.events import EventLog

    model = make_model({"hidden": [3], "seed": seed}, input_shape=2, n_classes=5)
    data = (np.zeros((2, 2)), np.zeros(2, dtype=int), np.zeros((2, 2)), np.zeros(2, dtype=int))
    conf = {"connect": {n: "memory" for n in names if n != name}, "ring": names, "sync": sync, "epoch": 1, "join_wait_s": 0.5, "step_timeout_s": 5, "life": life}
    ctx = Context(name, model, data, conf, {}, EventLog(f"{tmp}/{name}-{life}.jsonl", "r", name),
                  lambda *a, **k: None)
    role = RingRole(ctx)

    def train_local():
        time.sleep(0.1)  # rounds take a little time, as training does
        role.ctx.model.set_weights([w + np.asarray(offset, dtype=w.dtype) for w in role.ctx.model.get_weights()])
        return {"loss": float("nan"), "train_s": 0.0}

    role.train_local = train_local
    net.attach(role)
    return role


def run_all(roles) -> dict:
    import threading

    out: dict = {}
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r.ctx.name, r.run()), daemon=True) for r in roles]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a ring node hung"
    return out


def events_of(role, kind: str) -> list[dict]:
    from dml_app.runtime.events import read_events

    return [e for e in read_events(role.ctx.events.path) if e["type"] == kind]


def test_ring_all_reduce_in_process_gives_the_mean(tmp_path):
    """Four RingRoles in memory, different models: one round leaves each with the exact mean."""
    net = MemoryNetwork()
    names = ["r0", "r1", "r2", "r3"]
    roles = [ring_role(tmp_path, n, names, net, seed=i) for i, n in enumerate(names)]
    before = [r.ctx.model.get_weights() for r in roles]
    run_all(roles)
    expected = [np.mean(np.stack(layer).astype(np.float64), axis=0) for layer in zip(*before)]
    for r in roles:
        held = r.ctx.model.get_weights()
        assert max(float(np.max(np.abs(h - e))) for h, e in zip(held, expected)) <= 1e-6
        assert [e["members"] for e in events_of(r, "round")] == [names]


def test_ring_re_forms_without_a_lost_node_and_takes_its_replacement_back(tmp_path):
    """r2 dies after round 2: from round 3 the ring is r0, r1, r3 and the mean is theirs,
    exactly; its replacement joins at a round boundary, starts from the ring's model and
    contributes until the end."""
    import threading

    net = MemoryNetwork()
    names = ["r0", "r1", "r2", "r3"]
    offsets = {"r0": 1.0, "r1": 2.0, "r2": 4.0, "r3": 8.0}
    roles = [ring_role(tmp_path, n, names, net, sync=8, seed=0, offset=offsets[n]) for n in names]
    start = [w.astype(np.float64) for w in roles[0].ctx.model.get_weights()]  # the same seed everywhere
    victim = roles[2]
    record = victim.record_round

    def dies_after_round_2(out):
        event = record(out)
        if out.round == 2:
            net.down.add("r2")
            victim.ctx.stop.set()
        return event

    victim.record_round = dies_after_round_2
    replaced = {}

    def replace_later():
        while not any(e["round"] >= 3 for e in events_of(roles[0], "round")):
            threading.Event().wait(0.05)
        net.down.discard("r2")
        replaced["role"] = ring_role(tmp_path, "r2", names, net, sync=8, life=2, offset=offsets["r2"])
        replaced["result"] = replaced["role"].run()

    helper = threading.Thread(target=replace_later, daemon=True)
    helper.start()
    run_all(roles)
    helper.join(timeout=60)
    survivors = [roles[0], roles[1], roles[3]]
    for r in survivors:
        rounds = events_of(r, "round")
        assert [e["round"] for e in rounds] == [1, 2, 3, 4, 5, 6, 7, 8], r.ctx.name
        assert rounds[0]["members"] == names and rounds[2]["members"] == ["r0", "r1", "r3"]
        assert rounds[-1]["members"] == names, "the replacement is back by the last round"
        formed = events_of(r, "ring_formed")
        assert any(e["dropped"] == ["r2"] for e in formed) and any(e["joined"] == ["r2"] for e in formed)
    # the exact mean of that round's members, round by round (training adds each node's offset)
    member_rounds = [e["members"] for e in events_of(roles[0], "round")]
    held, was_in = start, True
    for members in member_rounds:
        # the round r2's replacement joins, it holds the coordinator's (r0's) trained model
        added = [offsets["r0"] if m == "r2" and not was_in else offsets[m] for m in members]
        was_in = "r2" in members
        held = [w + np.mean(added) for w in held]
    for r in survivors + [replaced["role"]]:
        got = r.ctx.model.get_weights()
        assert max(float(np.max(np.abs(g - h))) for g, h in zip(got, held)) <= 1e-4, r.ctx.name
    back = events_of(replaced["role"], "round")
    # started once r0 had finished round 3: it joins the next formation the others reach (4 when
    # they were slower to form it, as under load), and stays to the end
    assert back and back[0]["round"] >= 4 and back[-1]["round"] == 8


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
    assert confs["b"]["members"] == ["a", "c"] and {c["root"] for c in confs.values()} == {"b"}


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
    assert confs["a"]["ring"] == ["a", "b", "c"] and confs["c"]["talks_to"] == ["a", "b"]  # its successor first
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


def test_a_trainers_upload_may_take_as_long_as_the_round_is_open():
    from dml_app.roles.fl import upload_timeout_s

    assert upload_timeout_s({"round": 1, "deadline_s": 60}) == 60.0
    assert upload_timeout_s({"round": 1}) is None  # an older aggregator: the link's rate and a margin
    for bad in (True, "60", -1, 0, 10**9):
        assert upload_timeout_s({"round": 1, "deadline_s": bad}) is None

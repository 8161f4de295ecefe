"""The structure file's adaptation fields: ``policies`` (built-in and user entries, checked with
their defaults filled), the ring's ``strategy`` and its entries' ``site``; and the example policy
(examples/policies/schedule_batch.py) against the API it is written for."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from controller.confs.structures import load_structure_file
from controller.model.topology import Topology
from dml_app.policies.contract import PolicyError, PolicyView, check_action, check_vote
from dml_app.policies.runner import build
from worker.api.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STRATEGY_DEFAULTS = {"kind": "adaptive_strategy", "mode": "robust", "threshold": 0.8, "warmup_rounds": 1,
                     "reference_rounds": 5, "window_rounds": 3, "cooldown_rounds": 5, "probe_rounds": 20}
BATCH_DEFAULTS = {"kind": "adaptive_batch", "max_batch": 1024, "max_growth": 2.0, "ema": 0.5, "every_rounds": 1}


@pytest.fixture
def topology() -> Topology:
    """n1 and n2 on host h1, n3 on h2 (nodes.json's ``host``), a line n1 - n2 - n3."""
    t = Topology()
    for name, host in (("n1", "h1"), ("n2", "h1"), ("n3", "h2")):
        t.add_node(name, host=host)
    t.add_symmetric_link("n1", "n2", "10mbit")
    t.add_symmetric_link("n2", "n3", "10mbit")
    return t


def load(tmp_path, topology: Topology, algorithm: str = "ring", **top) -> dict:
    prefix = {"ring": "ra", "gossip": "gl", "fl": "fl", "etree": "el"}[algorithm]
    path = tmp_path / f"{prefix}_structure.json"
    path.write_text(json.dumps({"sync": 4, "node_list": [{"name": "n1"}, {"name": "n2"}, {"name": "n3"}], **top}))
    return load_structure_file(str(path), topology, algorithm)


def test_every_conf_gets_the_policies_with_their_defaults_filled(tmp_path, topology):
    policies = [{"kind": "adaptive_strategy"},
                {"kind": "adaptive_batch", "max_batch": 256, "max_growth": 4},
                {"module": "policies/mine.py", "class": "Mine", "every": 3, "levels": [1, 2]}]
    confs = load(tmp_path, topology, policies=policies)
    expected = [STRATEGY_DEFAULTS, {**BATCH_DEFAULTS, "max_batch": 256, "max_growth": 4.0},
                {"every": 3, "levels": [1, 2], "module": "policies/mine.py", "class": "Mine"}]
    for conf in confs.values():
        assert conf["policies"] == expected
    assert isinstance(confs["n1"]["policies"][1]["max_growth"], float)
    confs["n1"]["policies"][0]["mode"] = "changed"  # each conf its own copy
    assert confs["n2"]["policies"][0]["mode"] == "robust"
    kungfu = load(tmp_path, topology, policies=[{"kind": "adaptive_strategy", "mode": "kungfu",
                                                 "alternative": "star:n3", "warmup_rounds": 0}])
    assert kungfu["n3"]["policies"] == [{**STRATEGY_DEFAULTS, "mode": "kungfu", "warmup_rounds": 0,
                                         "alternative": "star:n3"}]
    assert "policies" not in load(tmp_path, topology)["n1"]
    assert load(tmp_path, topology, policies=[])["n1"]["policies"] == []


def test_every_algorithm_takes_user_policies_but_only_a_ring_adaptive_strategy_or_batch(tmp_path, topology):
    fl_nodes = {"node_list": [{"name": "n2", "sync": 3}, {"name": "n1"}, {"name": "n3"}]}
    for algorithm, extra in (("gossip", {}), ("fl", fl_nodes)):
        policies = [{"module": "p.py", "class": "P"}]
        confs = load(tmp_path, topology, algorithm, policies=policies, **extra)
        assert all(c["policies"] == [{"module": "p.py", "class": "P"}] for c in confs.values())
        file = f"{tmp_path}/{algorithm[:2].replace('go', 'gl')}_structure.json"
        with pytest.raises(ConfigError) as refused:
            load(tmp_path, topology, algorithm, policies=[*policies, {"kind": "adaptive_strategy"}], **extra)
        assert str(refused.value) == (
            f"{file}: policies[1] (adaptive_strategy): adaptive_strategy changes a ring all-reduce's strategy "
            f"(ra_structure.json); the {algorithm} algorithm has no strategy to change")
        with pytest.raises(ConfigError) as refused:
            load(tmp_path, topology, algorithm, policies=[{"kind": "adaptive_batch"}], **extra)
        assert str(refused.value) == (
            f"{file}: policies[0] (adaptive_batch): adaptive_batch follows the gradient noise scale, which a ring "
            f"all-reduce measures (ra_structure.json); the {algorithm} algorithm does not")


BAD = [  # (policies, the message's end)
    ({"kind": "adaptive_strategy"}, "expected a list like"),
    ([{"kind": "adaptive_batch"}] * 9, "field 'policies': at most 8 policies, got 9"),
    (["adaptive_batch"], "policies[0]: expected an object like"),
    ([{"max_batch": 4}], "policies[0]: missing field 'kind' (a built-in policy: adaptive_strategy, adaptive_batch, "
                         "elastic_scaling)"),
    ([{"kind": "adaptiv_batch"}], "policies[0], field 'kind': 'adaptiv_batch' is not one of 'adaptive_strategy', "
                                  "'adaptive_batch', 'elastic_scaling'; did you mean 'adaptive_batch'?"),
    ([{"kind": "adaptive_strategy", "treshold": 0.5}],
     "policies[0] (adaptive_strategy), field 'treshold': unknown field; did you mean 'threshold'? "
     "(adaptive_strategy's fields: kind, mode, threshold, warmup_rounds, reference_rounds, window_rounds, "
     "cooldown_rounds, probe_rounds, alternative)"),
    ([{"kind": "adaptive_batch", "speed": 2}],
     "policies[0] (adaptive_batch), field 'speed': unknown field (adaptive_batch's fields: kind, max_batch, "
     "max_growth, ema, every_rounds)"),
    ([{"kind": "adaptive_strategy", "mode": "fast"}], "field 'mode': 'fast' is not one of 'kungfu', 'robust'"),
    ([{"kind": "adaptive_strategy", "threshold": 0}], "field 'threshold': must be a number in (0, 1], got 0"),
    ([{"kind": "adaptive_strategy", "threshold": 1.5}], "field 'threshold': must be a number in (0, 1], got 1.5"),
    ([{"kind": "adaptive_strategy", "threshold": "0.8"}], "field 'threshold': expected a number in (0, 1], "
                                                          "got the string '0.8'"),
    ([{"kind": "adaptive_strategy", "warmup_rounds": -1}], "field 'warmup_rounds': must be an integer in "
                                                           "[0, 100000], got -1"),
    ([{"kind": "adaptive_strategy", "reference_rounds": 0}], "field 'reference_rounds': must be an integer in "
                                                             "[1, 100000], got 0"),
    ([{"kind": "adaptive_strategy", "window_rounds": 0}], "field 'window_rounds': must be an integer in "
                                                          "[1, 100000], got 0"),
    ([{"kind": "adaptive_strategy", "cooldown_rounds": 2.5}], "field 'cooldown_rounds': expected an integer in "
                                                              "[0, 100000], got 2.5"),
    ([{"kind": "adaptive_strategy", "mode": "kungfu"}],
     "policies[0] (adaptive_strategy): missing field 'alternative' (the kungfu mode switches to it: ring, "
     "star:NODE (a star around a member), binary_tree or site_tree, e.g. 'binary_tree')"),
    ([{"kind": "adaptive_strategy", "mode": "kungfu", "alternative": "star:n9"}],
     "policies[0] (adaptive_strategy), field 'alternative': strategy 'star:n9': n9 is not one of the ring's nodes"),
    ([{"kind": "adaptive_strategy", "mode": "kungfu", "alternative": "mesh"}],
     "field 'alternative': unknown strategy 'mesh'; known: ring, star:<node>, binary_tree, site_tree"),
    ([{"kind": "adaptive_strategy", "mode": "kungfu", "alternative": "ring"}],
     "field 'alternative': 'ring' is the strategy the ring starts with (field 'strategy'); name another to "
     "switch to"),
    ([{"kind": "adaptive_strategy", "alternative": "binary_tree"}],
     "field 'alternative': only the kungfu mode switches to a fixed alternative; the robust mode picks one from "
     "the measured link rates (remove it, or set \"mode\": \"kungfu\")"),
    ([{"kind": "adaptive_strategy"}, {"kind": "adaptive_strategy", "mode": "kungfu", "alternative": "star:n1"}],
     "policies[1] (adaptive_strategy): policies[0] is already an adaptive_strategy; a ring has one strategy, so "
     "at most one policy changes it"),
    ([{"kind": "adaptive_batch", "max_batch": 0}], "field 'max_batch': must be an integer in [1, 65536], got 0"),
    ([{"kind": "adaptive_batch", "max_growth": 1}], "field 'max_growth': must be a number in (1, 16], got 1.0"),
    ([{"kind": "adaptive_batch", "max_growth": 17}], "field 'max_growth': must be a number in (1, 16], got 17.0"),
    ([{"kind": "adaptive_batch", "ema": 0}], "field 'ema': must be a number in (0, 1], got 0.0"),
    ([{"kind": "adaptive_batch", "every_rounds": 0}], "field 'every_rounds': must be an integer in [1, 100000], "
                                                      "got 0"),
    ([{"module": "policies/mine.py"}], "policies[0]: missing field 'class' (the class: a subclass of "
                                       "dml_app.policies.Policy)"),
    ([{"class": "Mine"}], "policies[0]: missing field 'module'"),
    ([{"module": "../mine.py", "class": "Mine"}], "policies[0], field 'module': '../mine.py' is not a .py file "
                                                  "relative to the experiment directory"),
    ([{"module": "dml_user/mine.py", "class": "Mine"}], "field 'module': 'dml_user/mine.py' is not a .py file"),
    ([{"module": "mine.py", "class": "not a name"}], "field 'class': 'not a name' is not a Python name"),
    ([{"module": "mine.py", "class": "Mine", "kind": "adaptive_batch"}],
     "policies[0]: a policy is either built-in ('kind') or your own ('module' and 'class'), not both"),
    ([{"module": "mine.py", "class": "Mine", "table": "x" * 70_000}],
     "policies[0]: its own keys take more than 65536 bytes"),
]


@pytest.mark.parametrize("policies,message", BAD, ids=[m[:40] for _, m in BAD])
def test_each_bad_policy_field_is_refused_with_the_file_the_entry_and_the_field(tmp_path, topology, policies,
                                                                                message):
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, topology, policies=policies)
    text = str(refused.value)
    assert text.startswith(f"{tmp_path}/ra_structure.json: "), text
    assert message in text, text


def test_the_rings_strategy_is_checked_against_its_members_and_reaches_every_conf(tmp_path, topology):
    assert {c["strategy"] for c in load(tmp_path, topology).values()} == {"ring"}
    for strategy in ("star:n2", "binary_tree", "site_tree"):
        assert {c["strategy"] for c in load(tmp_path, topology, strategy=strategy).values()} == {strategy}
    for strategy, message in (("star:n9", "strategy 'star:n9': n9 is not one of the ring's nodes"),
                              ("star", "strategy 'star': a star names its root, like 'star:n1'"),
                              ("binary_tree:n1",
                               "strategy 'binary_tree:n1': only a star takes a node (star:<node>)"),
                              ("tree", "unknown strategy 'tree'; known: ring, star:<node>, binary_tree, site_tree")):
        with pytest.raises(ConfigError) as refused:
            load(tmp_path, topology, strategy=strategy)
        assert str(refused.value) == f"{tmp_path}/ra_structure.json: field 'strategy': {message}"
    with pytest.raises(ConfigError, match="field 'strategy': expected a string, got 3"):
        load(tmp_path, topology, strategy=3)
    with pytest.raises(ConfigError, match="gl_structure.json: field 'strategy': unknown field"):
        load(tmp_path, topology, "gossip", strategy="ring")  # gossip has no strategy


def test_sites_default_to_the_nodes_host_and_an_entry_may_name_its_own(tmp_path, topology):
    confs = load(tmp_path, topology)
    assert all(c["sites"] == {"n1": "h1", "n2": "h1", "n3": "h2"} for c in confs.values())
    confs = load(tmp_path, topology, node_list=[{"name": "n1", "site": "lab-1"}, {"name": "n2"}, {"name": "n3"}])
    assert confs["n3"]["sites"] == {"n1": "lab-1", "n2": "h1", "n3": "h2"}
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, topology, node_list=[{"name": "n1", "site": "a b"}, {"name": "n2"}])
    assert str(refused.value).startswith(f"{tmp_path}/ra_structure.json: node_list[0] (n1), field 'site': 'a b' "
                                         "is not a name of 1 to 64 letters")
    with pytest.raises(ConfigError, match=r"node_list\[0\] \(n1\), field 'site': unknown field"):
        load(tmp_path, topology, "gossip", node_list=[{"name": "n1", "site": "x"}, {"name": "n2"}])


def test_the_validated_entries_build_the_node_side_policies(tmp_path, topology):
    confs = load(tmp_path, topology, policies=[{"kind": "adaptive_strategy", "mode": "kungfu",
                                                "alternative": "binary_tree", "threshold": 0.5},
                                               {"kind": "adaptive_batch", "max_growth": 3}])
    conf = confs["n1"]
    view = PolicyView("n1", "ring", conf["ring"], conf["strategy"], 32, sites=conf["sites"])
    strategy, batch = build(conf["policies"], view, str(tmp_path))
    assert (strategy.mode, strategy.threshold, strategy.alternative, strategy.warmup_rounds) == \
        ("kungfu", 0.5, "binary_tree", 1)
    assert (batch.max_batch, batch.max_growth, batch.ema, batch.every) == (1024, 3.0, 0.5, 1)


# The example policy ------------------------------------------------------------------------------
def schedule_batch_class() -> type:
    path = os.path.join(ROOT, "examples", "policies", "schedule_batch.py")
    spec = importlib.util.spec_from_file_location("user_policy_schedule_batch", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ScheduleBatch


def test_the_example_doubles_the_batch_every_n_rounds_up_to_the_cap():
    cls = schedule_batch_class()
    policy = cls({"module": "policies/schedule_batch.py", "class": "ScheduleBatch", "every_rounds": 3,
                  "max_batch": 100}, PolicyView("n1", "ring", ["n1", "n2"], "ring", 32))
    sizes, size = [], 32
    for round_no in range(1, 14):
        action = check_action(policy.decide(round_no, {"n1": {"batch_size": size}, "n2": {"batch_size": size}}), "x")
        if action:
            size = action["batch_size"]
        sizes.append(size)
        check_vote(policy.after_round({"round": round_no, "batch_size": size}), "x")
    # rounds 1-3 at 32, 4-6 at 64, then the cap: 100 (not 128), and no action after it
    assert sizes == [32, 32, 32, 64, 64, 64, 100, 100, 100, 100, 100, 100, 100]
    with pytest.raises(PolicyError, match="field 'every_rounds': expected a whole number >= 1, got 0"):
        cls({"every_rounds": 0}, PolicyView("n1", "ring"))


def test_the_structure_files_kinds_are_the_nodes_kinds():
    from controller.confs.structures import POLICY_KINDS
    from dml_app.policies.builtin import KINDS

    assert list(POLICY_KINDS) == list(KINDS)


def test_standby_trainers_need_fl_and_an_elastic_scaling_policy(tmp_path, topology):
    topology.node("n3").standby = True
    elastic = [{"kind": "elastic_scaling"}]
    confs = load(tmp_path, topology, "fl", policies=elastic)
    assert confs["n1"]["standby"] == ["n3"] and confs["n1"]["trainers"] == ["n2", "n3"]
    assert confs["n1"]["policies"] == [{"kind": "elastic_scaling", "window_rounds": 3, "alpha": 1 / 3}]
    with pytest.raises(ConfigError, match=r"n3 is marked standby in nodes.json: add an elastic_scaling policy"):
        load(tmp_path, topology, "fl")
    with pytest.raises(ConfigError, match="only an FL trainer can stand by"):
        load(tmp_path, topology, "gossip", policies=[{"module": "p.py", "class": "P"}])
    with pytest.raises(ConfigError, match="elastic_scaling adds trainers to an FL aggregator"):
        load(tmp_path, topology, "ring", policies=elastic)
    topology.node("n3").standby = False
    with pytest.raises(ConfigError, match="elastic_scaling needs trainers marked \"standby\": true"):
        load(tmp_path, topology, "fl", policies=elastic)
    with pytest.raises(ConfigError, match=r"policies\[0\] \(elastic_scaling\).*alpha"):
        load(tmp_path, topology, "fl", policies=[{"kind": "elastic_scaling", "alpha": 0}])


def test_nodes_json_marks_standby_nodes(tmp_path):
    from controller.model.topology import load_nodes
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps({"nodes": [{"name": "a"}, {"name": "b", "standby": True}]}))
    topo = load_nodes(str(path))
    assert [topo.node(n).standby for n in ("a", "b")] == [False, True]
    assert Topology.from_dict(topo.to_dict()).node("b").standby
    path.write_text(json.dumps({"nodes": [{"name": "a", "standby": "yes"}]}))
    with pytest.raises(Exception, match="standby"):
        load_nodes(str(path))


def test_the_rings_monitor_every_reaches_its_confs(tmp_path, topology):
    assert load(tmp_path, topology)["n1"]["monitor_every"] == 0
    assert load(tmp_path, topology, monitor_every=4)["n2"]["monitor_every"] == 4
    with pytest.raises(ConfigError, match="monitor_every"):
        load(tmp_path, topology, monitor_every=-1)

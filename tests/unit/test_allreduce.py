"""All-reduce strategies: their structures (one root, no cycle, digests) and the exact mean each
gives when a ring of roles runs it in one process."""
import numpy as np
import pytest

from dml_app.reduction import allreduce
from dml_app.reduction.allreduce import Structure, StructureError, best_strategy, build, check, estimated_time_s
from dml_app.roles.memory import MemoryNetwork
from dml_app.roles.ring import RingRole
from tests.unit.test_roles_memory import events_of, role_of, run_all

NAMES = [f"n{i}" for i in range(1, 8)]


def test_star_binary_tree_and_site_tree_have_the_documented_parents():
    star = build("star:n3", NAMES)
    assert star.root == "n3" and all(star.parent_of(m) == "n3" for m in NAMES if m != "n3")
    tree = build("binary_tree", NAMES)
    assert dict(tree.parent) == {"n1": None, "n2": "n1", "n3": "n1", "n4": "n2", "n5": "n2", "n6": "n3", "n7": "n3"}
    sites = {"n1": "a", "n2": "b", "n3": "a", "n4": "c", "n5": "b", "n6": "c", "n7": "a"}
    site = build("site_tree", NAMES, sites)
    # masters n1 (a), n2 (b), n4 (c) as a heap; each site's others under its master
    assert dict(site.parent) == {"n1": None, "n2": "n1", "n3": "n1", "n4": "n1", "n5": "n2", "n6": "n4", "n7": "n1"}
    assert build("ring", NAMES).is_ring and build("ring", NAMES).edges()[-1] == ("n7", "n1")
    assert build("star:gone", ["a", "b"]).root == "a"  # a root that left: the first member


def test_structures_with_two_roots_a_cycle_or_an_outsider_are_refused():
    with pytest.raises(StructureError, match="one root, this one has 2"):
        check(Structure("t", ("a", "b"), (("a", None), ("b", None))))
    with pytest.raises(StructureError, match="does not reach the root"):
        check(Structure("t", ("a", "b", "c"), (("a", None), ("b", "c"), ("c", "b"))))
    with pytest.raises(StructureError, match="does not reach the root"):
        check(Structure("t", ("a", "b"), (("a", None), ("b", "x"))))
    for bad, words in [("star", "names its root"), ("mesh", "unknown strategy"), ("ring:n1", "only a star"),
                       ("star:zz", "not one of the ring's nodes"), (3, "a strategy is a string")]:
        with pytest.raises(StructureError, match=words):
            allreduce.parse(bad, NAMES)


def test_a_digest_names_strategy_members_and_parents():
    a, b = build("star:n1", NAMES), build("star:n1", NAMES)
    assert a.digest() == b.digest()
    assert a.digest() != build("star:n2", NAMES).digest() != build("star:n2", NAMES[:-1]).digest()
    assert build("site_tree", NAMES, {"n1": "x"}).digest() != build("site_tree", NAMES, {"n2": "x"}).digest()


def test_estimated_time_counts_a_stars_slow_edges_and_best_avoids_them():
    members = ["a", "b", "c", "d"]
    even = {(s, r): 8e6 for s in members for r in members if s != r}  # 1 MB/s: a model of 1 MB takes 1 s
    assert estimated_time_s(build("star:a", members), 1e6, even) == pytest.approx(2.0)
    assert estimated_time_s(build("ring", members), 1e6, even) == pytest.approx(2 * 3 * 0.25)
    assert estimated_time_s(build("binary_tree", members), 1e6, even) == pytest.approx(4.0)  # depth 2, up and down
    slow = {**even, ("a", "b"): 1e6, ("a", "c"): 1e6}  # a's sends to b and c at 1/8
    assert best_strategy(members, slow, None) == "star:d"  # the ring and star:a/b/c use a slow edge of a
    assert best_strategy(members, even, None) == "ring"


@pytest.mark.parametrize("strategy", ["ring", "star:r2", "binary_tree", "site_tree"])
def test_every_strategy_gives_the_members_exact_mean(tmp_path, strategy):
    net = MemoryNetwork()
    names = ["r0", "r1", "r2", "r3", "r4"]
    conf = {"sync": 1, "epoch": 0, "ring": names, "join_wait_s": 5, "step_timeout_s": 10, "strategy": strategy,
            "sites": {"r0": "x", "r1": "y", "r2": "x", "r3": "y", "r4": "z"}}
    roles = [role_of(RingRole, tmp_path, net, n, conf, names, seed=i) for i, n in enumerate(names)]
    before = [r.ctx.model.get_weights() for r in roles]
    run_all(roles)
    expected = [np.mean([np.asarray(w[k], np.float64) for w in before], axis=0) for k in range(len(before[0]))]
    for r in roles:
        got = r.ctx.model.get_weights()
        assert all(g.dtype == e.dtype for g, e in zip(got, before[0]))
        assert max(float(np.max(np.abs(g - e))) for g, e in zip(got, expected)) <= 1e-6
        event = events_of(r, "round")[0]
        assert event["strategy"] == strategy and event["cluster_size"] == 5 and event["comm_goodput_bps"] > 0
    if strategy == "star:r2":  # the root received and sent every other model
        sent = events_of(roles[2], "round")[0]["sent_to"]
        assert set(sent) == {"r0", "r1", "r3", "r4"}
        leaf = events_of(roles[0], "round")[0]["sent_to"]
        assert set(leaf) == {"r2"}

"""No link, no path, as pure logic: the node space, the set-links bodies, the merge of a
runtime link, the cluster's split, verification of the drop filters and their encoding."""
from __future__ import annotations

import copy
import ipaddress
import socket
import struct
from typing import Any, Optional

import pytest

from controller.model.topology import Topology
from controller.workers import deploy
from worker.api.errors import ConfigError
from worker.api.shape import Shape
from worker.kernel import netlink as nl
from worker.shaping.apply import Observed, mismatches
from worker.shaping.plan import DROP_MINOR, DROP_PRIO, Isolation, Target, make_plan


def topo(*links: tuple[str, str], physical: Optional[dict[str, str]] = None) -> Topology:
    t = Topology()
    for name in sorted(({n for pair in links for n in pair} | {"d"}) - set(physical or {})):
        t.add_node(name)
    for name, ip in (physical or {}).items():
        t.add_node(name, "physical", name, ip=ip)
    for src, dst in links:
        t.add_link(src, dst, "10mbit")
    return t


IPS = {"a": "10.9.0.2", "b": "10.9.0.3", "c": "10.9.0.4", "d": "10.9.0.5", "pi": "192.168.1.50"}


# --- the node space --------------------------------------------------------------------------------

def test_node_space_of_one_host():
    space = deploy.node_space(topo(("a", "b")), IPS, ["10.9.0.0/16"], "10.9.0.1")
    assert space == Isolation(("10.9.0.0/16",), ("10.9.0.1",))


def test_node_space_of_several_hosts_and_a_physical_device():
    t = topo(("a", "b"), physical={"pi": "192.168.1.50"})
    space = deploy.node_space(t, IPS, ["10.9.0.0/16", "10.10.0.0/16"], "192.168.1.10")
    # the device's address is dropped, the LAN and the controller (192.168.1.10) are not
    assert space.drop == ("10.9.0.0/16", "10.10.0.0/16", "192.168.1.50/32")
    assert space.keep == ("10.9.0.1", "10.10.0.1")


def test_controller_on_a_node_address_stays_reachable():
    t = topo(("a", "b"), physical={"pi": "192.168.1.50"})
    space = deploy.node_space(t, IPS, ["10.9.0.0/16"], "192.168.1.50")
    assert "192.168.1.50" in space.keep


def test_nothing_to_isolate_is_an_error():
    with pytest.raises(ConfigError, match="no node subnet and no node address"):
        deploy.node_space(Topology(), {}, [], None)


def test_worker_subnets_of_a_host_and_of_a_cluster():
    assert deploy.worker_subnets({"subnet": "10.9.0.0/16"}) == ["10.9.0.0/16"]
    assert deploy.worker_subnets({"hosts": {"e1": {"subnet": "10.9.0.0/16"}, "pi": {"subnet": None},
                                            "e2": {"subnet": "10.10.0.0/16"}}}) == ["10.9.0.0/16", "10.10.0.0/16"]
    assert deploy.worker_subnets({"subnet": None}) == []


# --- bodies ----------------------------------------------------------------------------------------

def test_unshaped_peers_are_the_way_back_of_one_way_links():
    t = topo(("a", "b"), ("b", "a"), ("a", "c"), ("d", "c"))
    assert deploy.unshaped_peers(t, IPS) == {
        "a": [], "b": [], "d": [],
        "c": [{"dst": "a", "dst_ip": "10.9.0.2"}, {"dst": "d", "dst_ip": "10.9.0.5"}]}
    assert deploy.unshaped_peers(t, IPS, ["c"]) == {"c": [{"dst": "a", "dst_ip": "10.9.0.2"},
                                                          {"dst": "d", "dst_ip": "10.9.0.5"}]}


def test_isolation_request_lists_every_node():
    t = topo(("a", "b"))
    space = Isolation(("10.9.0.0/16",), ("10.9.0.1",))
    body = deploy.isolation_request(t, IPS, space)
    assert body["isolation"] == {"drop": ["10.9.0.0/16"], "keep": ["10.9.0.1"]}
    assert set(body["unshaped"]) == {"a", "b", "d"}  # d has no link and still gets its tree
    assert deploy.isolation_request(t, IPS, None) == {"isolation": {"open": True}}


def test_dry_run_plans_give_every_node_a_tree_when_isolated():
    t = topo(("a", "b"))
    space = Isolation(("10.9.0.0/16",), ("10.9.0.1",))
    plans = deploy.plans(t, IPS, space)
    assert set(plans) == {"a", "b", "d"}
    assert [(p.dest, p.dest_ip) for p in plans["b"].passes] == [("", "10.9.0.1"), ("a", "10.9.0.2")]
    assert set(deploy.plans(t, IPS)) == {"a"}  # open: only sources of links, as before


class FakeWorker:
    """Records set_links calls and answers shaping() from given plans (pure logic only)."""

    def __init__(self, plans: dict[str, Any]) -> None:
        self.plans = plans
        self.calls: list[tuple[dict[str, Any], bool]] = []
        self.asked: list[str] = []

    def shaping(self, node: str) -> dict[str, Any]:
        self.asked.append(node)
        return {"plan": self.plans.get(node)}

    def set_links(self, body: Any, merge: bool = False) -> dict[str, Any]:
        self.calls.append((copy.deepcopy(body), merge))
        return {"version": 1, "nodes": [], "seconds": 0}


SPACE = Isolation(("10.9.0.0/16",), ("10.9.0.1",))


def plan_dict(links: list[str], unshaped: list[str] = (), isolated: bool = True) -> dict[str, Any]:
    targets = [Target(d, IPS[d], Shape(10**7)) for d in links]
    return make_plan("eth0", targets, isolation=SPACE if isolated else None,
                     unshaped=[(u, IPS[u]) for u in unshaped]).to_dict()


def test_merge_of_a_one_way_link_opens_the_way_back():
    worker = FakeWorker({"c": plan_dict(["b"], unshaped=["d"])})
    deploy.merge_links(topo(("a", "c")), worker, IPS)
    body, merge = worker.calls[0]
    assert merge is True
    assert [(l["src"], l["dst"]) for l in body["links"]] == [("a", "c")]
    assert body["unshaped"] == {"c": [{"dst": "d", "dst_ip": "10.9.0.5"}, {"dst": "a", "dst_ip": "10.9.0.2"}]}
    assert "isolation" not in body  # every node keeps its own setting


@pytest.mark.parametrize("plans,sent", [
    ({"c": plan_dict(["a"])}, None),  # c links back to a already
    ({"c": plan_dict(["b"], isolated=False)}, None),  # c is open
    ({}, None),  # c was never shaped (open)
    ({"c": plan_dict(["b"], unshaped=["a"])}, [{"dst": "a", "dst_ip": "10.9.0.2"}]),  # open already: unchanged
])
def test_merge_opens_nothing_more_than_needed(plans, sent):
    worker = FakeWorker(plans)
    deploy.merge_links(topo(("a", "c")), worker, IPS)
    body = worker.calls[0][0]
    assert worker.asked == ["c"]
    assert body.get("unshaped", {}).get("c") == sent


def test_merge_of_both_directions_asks_nothing():
    worker = FakeWorker({})
    deploy.merge_links(topo(("a", "c"), ("c", "a")), worker, IPS)
    assert worker.asked == [] and "unshaped" not in worker.calls[0][0]


# --- the cluster passes isolation to every host ------------------------------------------------------

def test_cluster_splits_unshaped_by_host_and_passes_isolation():
    from controller.workers.cluster import Cluster

    w1, w2 = FakeWorker({}), FakeWorker({})
    cluster = Cluster.__new__(Cluster)
    cluster.placement = {"a": "e1", "b": "e1", "c": "e2", "d": "e2"}
    cluster.workers = {"e1": w1, "e2": w2}
    body = {"version": 1, "links": [{"src": "a", "dst": "c", "dst_ip": IPS["c"], "shape": {"rate_bps": 10**7}}],
            "isolation": SPACE.to_dict(), "unshaped": {"c": [{"dst": "a", "dst_ip": IPS["a"]}], "d": [], "b": []}}
    cluster.set_links(body)
    (b1, _), (b2, _) = w1.calls[0], w2.calls[0]
    assert [l["src"] for l in b1["links"]] == ["a"] and b2["links"] == []
    assert b1["isolation"] == b2["isolation"] == SPACE.to_dict()
    assert b1["unshaped"] == {"b": []} and b2["unshaped"] == {"c": [{"dst": "a", "dst_ip": IPS["a"]}], "d": []}


# --- verification ----------------------------------------------------------------------------------

PLAN = make_plan("eth0", [Target("b", "10.9.0.3", Shape(10**7))], isolation=SPACE, unshaped=[("c", "10.9.0.4")])


def observed(**changes: Any) -> Observed:
    seen = Observed(root={"kind": "htb", "handle": 0x10000, "default_minor": 1},
                    classes={1: 10**10 // 8, DROP_MINOR: 10**10 // 8, 3: 10**10 // 8, 0x10: 10**7 // 8},
                    leaves={DROP_MINOR: {"kind": "pfifo", "limit": 0}},
                    filters={0x10: {"dest_ip": "10.9.0.3", "minor": 0x10}, 0x11: {"dest_ip": "10.9.0.1", "minor": 1},
                             0x12: {"dest_ip": "10.9.0.4", "minor": 1}},
                    drops={"10.9.0.0/16": DROP_MINOR})
    for key, value in changes.items():
        setattr(seen, key, value)
    return seen


def test_isolated_state_matches():
    assert mismatches(PLAN, observed()) == []


@pytest.mark.parametrize("changes,expected", [
    ({"drops": {}}, "isolation filters: missing ['10.9.0.0/16']"),
    ({"drops": {"10.9.0.0/16": DROP_MINOR, "10.8.0.0/16": DROP_MINOR}}, "not in the plan ['10.8.0.0/16']"),
    ({"drops": {"10.9.0.0/16": 1}}, "not into 1:2 ['10.9.0.0/16']"),
    ({"leaves": {DROP_MINOR: {"kind": "pfifo", "limit": 5}}}, "isolation drop leaf under 1:2"),
    ({"leaves": {}}, "isolation drop leaf under 1:2: found None"),
    ({"classes": {1: 10**10 // 8, 0x10: 10**7 // 8}}, "class 1:2: rate None"),
    ({"filters": {0x10: {"dest_ip": "10.9.0.3", "minor": 0x10}, 0x12: {"dest_ip": "10.9.0.4", "minor": 1}}},
     "filter for the kept address 10.9.0.1: found None"),
    ({"filters": {0x10: {"dest_ip": "10.9.0.3", "minor": 0x10}, 0x11: {"dest_ip": "10.9.0.1", "minor": 1},
                  0x12: {"dest_ip": "10.9.0.4", "minor": 0x10}}}, "unshaped way to c (10.9.0.4)"),
])
def test_each_isolation_difference_is_named(changes, expected):
    problems = mismatches(PLAN, observed(**changes))
    assert any(expected in p for p in problems), problems


def test_open_plan_against_isolated_kernel_state():
    open_plan = make_plan("eth0", [Target("b", "10.9.0.3", Shape(10**7))])
    problems = mismatches(open_plan, observed())
    assert "class 1:2 is not in the plan" in problems
    assert any("isolation filters" in p and "10.9.0.0/16" in p for p in problems), problems
    assert "filter 800::11 is not in the plan" in problems


# --- netlink encoding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix,mask", [("10.9.0.0/16", 0xFFFF0000), ("192.168.1.50/32", 0xFFFFFFFF),
                                         ("0.0.0.0/0", 0), ("172.16.0.0/12", 0xFFF00000)])
def test_u32_prefix_filter(prefix, mask):
    data = nl.u32_prefix_filter(4, prefix, DROP_MINOR, DROP_PRIO)
    _, kind, flags, _, _ = struct.unpack_from("=IHHII", data)
    assert kind == nl.RTM_NEWTFILTER and flags & nl.NLM_F_CREATE and flags & nl.NLM_F_EXCL
    _, index, handle, parent, info = struct.unpack_from("=BxxxiIII", data, 16)
    assert (index, handle, parent) == (4, 0, 0x10000)  # handle 0: the kernel numbers it
    assert info == (DROP_PRIO << 16) | socket.htons(0x0800)
    classid, keys = nl.u32_key(nl.parse_attrs(data, 16 + 20)[nl.TCA_OPTIONS])
    net = ipaddress.IPv4Network(prefix)
    assert classid == 0x10000 | DROP_MINOR and keys == [(mask, int(net.network_address), 16)]
    assert nl.dst_prefix(keys) == (str(net.network_address) if net.prefixlen == 32 else prefix)


@pytest.mark.parametrize("keys,expected", [
    ([(0xFFFFFFFF, 0x0A090003, 16)], "10.9.0.3"),
    ([(0xFFFF0000, 0x0A090000, 16)], "10.9.0.0/16"),
    ([(0xFFFF0000, 0x0A090001, 16)], None),  # bits outside the mask
    ([(0xFF00FF00, 0x0A000000, 16)], None),  # a mask with holes
    ([(0xFFFFFFFF, 0x0A090003, 12)], None),  # the source address
    ([(0xFFFFFFFF, 1, 16), (0xFFFFFFFF, 2, 12)], None),
    ([], None),
])
def test_dst_prefix(keys, expected):
    assert nl.dst_prefix(keys) == expected


def test_delete_filters_of_a_priority():
    data = nl.delete_filters(3, DROP_PRIO)
    _, kind, _, _, _ = struct.unpack_from("=IHHII", data)
    _, index, handle, parent, info = struct.unpack_from("=BxxxiIII", data, 16)
    assert kind == nl.RTM_DELTFILTER
    assert (index, handle, parent, info) == (3, 0, 0x10000, (DROP_PRIO << 16) | socket.htons(0x0800))


def test_ipv6_drop_is_verified():
    plan = make_plan("eth0", [Target("b", "10.9.0.3", Shape(10**7))], isolation=SPACE, unshaped=[("c", "10.9.0.4")],
                     drop_ipv6=True)
    assert mismatches(plan, observed(ipv6_drop=DROP_MINOR)) == []
    assert mismatches(plan, observed()) == ["IPv6 isolation filter: found None, expected 1:2"]
    assert mismatches(PLAN, observed(ipv6_drop=DROP_MINOR)) == ["IPv6 isolation filter: found 1:2, expected None"]


def test_u32_all_filter_for_ipv6():
    data = nl.u32_all_filter(4, nl.ETH_P_IPV6, DROP_MINOR, 3)
    _, index, handle, parent, info = struct.unpack_from("=BxxxiIII", data, 16)
    assert (index, handle, parent, info) == (4, 0, 0x10000, (3 << 16) | socket.htons(0x86DD))
    assert nl.u32_key(nl.parse_attrs(data, 16 + 20)[nl.TCA_OPTIONS]) == (0x10000 | DROP_MINOR, [(0, 0, 0)])


def test_dry_run_drops_ipv6_on_emulated_nodes_only():
    t = topo(("a", "pi"), ("pi", "a"), physical={"pi": "192.168.1.50"})
    plans = deploy.plans(t, IPS, deploy.node_space(t, IPS, ["10.9.0.0/16"]))
    assert plans["a"].drop_ipv6 and not plans["pi"].drop_ipv6


def test_a_kept_address_a_link_reaches_is_kept_when_that_link_goes():
    """An update without new isolation keeps the plan's own: a gateway reached by a link while
    the link lasts must get its pass filter back once the link is removed."""
    from worker.api.shape import Shape
    from worker.shaping.plan import Plan

    isolation = Isolation(("10.77.0.0/16",), ("10.77.0.1",))
    linked = make_plan("eth0", [Target("gw", "10.77.0.1", Shape(rate_bps=10**6))], isolation=isolation)
    stored = Plan.from_dict(linked.to_dict())
    assert stored.isolation() == isolation
    unlinked = make_plan("eth0", [], stored, isolation=stored.isolation())
    assert [p.dest_ip for p in unlinked.passes] == ["10.77.0.1"]

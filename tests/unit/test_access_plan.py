"""Access links as data: class rates under an uplink, tc lines, the nodes file, message encoding."""
import json

import pytest

from controller.model.topology import load_nodes
from controller.workers.deploy import access_request, link_requests
from worker.api.errors import TopologyError
from worker.api.shape import Shape
from worker.shaping import downlink as access
from worker.shaping.apply import Observed, mismatches
from worker.shaping.plan import ACCESS_MINOR, make_plan, render, render_update, Target

MBIT = 10**6
TARGETS = [Target("b", "10.0.0.3", Shape(20 * MBIT)), Target("c", "10.0.0.4", Shape(2 * MBIT)),
           Target("d", "10.0.0.5", Shape(20 * MBIT))]


def test_without_an_uplink_each_link_has_rate_equal_ceil():
    plan = make_plan("eth0", TARGETS)
    assert [plan.class_rates(r) for r in plan.rules] == [(20 * MBIT,) * 2, (2 * MBIT,) * 2, (20 * MBIT,) * 2]
    assert plan.access_rate_bps == 10 * 10**9


def test_under_an_uplink_rates_are_equal_shares_capped_by_the_link_and_ceil_is_the_link():
    plan = make_plan("eth0", TARGETS, uplink_bps=9 * MBIT)
    rates = [plan.class_rates(r) for r in plan.rules]
    assert rates == [(3 * MBIT, 20 * MBIT), (2 * MBIT, 2 * MBIT), (3 * MBIT, 20 * MBIT)]
    assert sum(rate for rate, _ in rates) <= plan.uplink_bps


@pytest.mark.parametrize("links", [1, 7, 300, 3000])
def test_guarantees_never_add_up_past_the_uplink(links):
    targets = [Target(f"n{i}", f"10.1.{i // 250}.{i % 250 + 1}", Shape(50 * MBIT)) for i in range(links)]
    plan = make_plan("eth0", targets, uplink_bps=10 * MBIT)
    assert sum(plan.class_rates(r)[0] for r in plan.rules) <= 10 * MBIT


def test_render_shows_the_access_class_the_children_and_the_downlink():
    plan = make_plan("eth0", TARGETS[:2], uplink_bps=10 * MBIT, downlink_bps=8 * MBIT)
    lines = render(plan)
    assert f"tc class add dev eth0 parent 1: classid 1:{ACCESS_MINOR:x} htb rate 10mbit ceil 10mbit" in lines
    assert "tc class add dev eth0 parent 1:3 classid 1:10 htb rate 5mbit ceil 20mbit" in lines
    assert "tc class add dev eth0 parent 1:3 classid 1:11 htb rate 2mbit ceil 2mbit" in lines
    assert lines[-1] == (f"tc filter add dev eth0 parent ffff: protocol all prio 1 u32 match u32 0 0 "
                         f"action mirred egress redirect dev {access.IFB_NAME}")
    assert f"tc class add dev {access.IFB_NAME} parent 1: classid 1:1 htb rate 8mbit ceil 8mbit" in lines


def test_an_uplink_change_changes_classes_in_place_and_keeps_minors():
    old = make_plan("eth0", TARGETS, uplink_bps=9 * MBIT)
    new = make_plan("eth0", TARGETS, previous=old, uplink_bps=3 * MBIT)
    assert [r.minor for r in new.rules] == [r.minor for r in old.rules]
    lines = render_update(old, new)
    assert lines[0] == "tc class change dev eth0 parent 1: classid 1:3 htb rate 3mbit ceil 3mbit"
    assert "tc class change dev eth0 parent 1:3 classid 1:10 htb rate 1mbit ceil 20mbit" in lines
    assert not any(" add " in line or " del " in line for line in lines), lines


def test_a_link_added_under_an_uplink_reshares_the_others():
    old = make_plan("eth0", TARGETS[:2], uplink_bps=8 * MBIT)
    new = make_plan("eth0", TARGETS, previous=old, uplink_bps=8 * MBIT)
    lines = render_update(old, new)
    assert any(line.startswith("tc class change dev eth0 parent 1:3 classid 1:10 htb rate ")
               and line.endswith(" ceil 20mbit") for line in lines), lines
    assert any(line.startswith("tc class add dev eth0 parent 1:3 classid 1:12 ") for line in lines)


def test_downlink_removal_is_rendered():
    old = make_plan("eth0", [], downlink_bps=8 * MBIT)
    new = make_plan("eth0", [], previous=old)
    assert render_update(old, new) == ["tc qdisc del dev eth0 ingress", f"ip link del {access.IFB_NAME}"]
    assert new.empty and not old.empty  # a plan without links or access holds nothing


def test_plan_round_trips_with_access():
    plan = make_plan("eth0", TARGETS, uplink_bps=9 * MBIT, downlink_bps=4 * MBIT)
    assert type(plan).from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_redirect_filter_encodes_the_target_device():
    msg = access.redirect_filter(7, 42)
    options = msg[16 + 20:]  # nlmsghdr + tcmsg, then the attributes
    from worker.kernel import netlink as nl

    attrs = nl.parse_attrs(options)
    assert access.redirect_target(attrs[nl.TCA_OPTIONS]) == 42


def test_verify_names_a_missing_downlink_and_a_wrong_parent():
    plan = make_plan("eth0", TARGETS[:1], uplink_bps=10 * MBIT, downlink_bps=8 * MBIT)
    seen = Observed(root={"kind": "htb", "handle": 0x10000, "default_minor": 1},
                    classes={1: 10**10 // 8, 3: 10 * MBIT // 8, 0x10: 10 * MBIT // 8},
                    ceils={0x10: 20 * MBIT // 8}, parents={1: 0, 3: 0, 0x10: 0},
                    filters={0x10: {"dest_ip": "10.0.0.3", "minor": 0x10}})
    problems = mismatches(plan, seen)
    assert "class 1:10: parent 1:0, expected 1:3" in problems
    assert "downlink: rate None bit/s, expected 8000000" in problems
    assert f"downlink: no ingress redirect to {access.IFB_NAME}" in problems


def _nodes(tmp_path, data) -> str:
    path = tmp_path / "nodes.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_nodes_file_access_links_and_defaults(tmp_path):
    topo = load_nodes(_nodes(tmp_path, {"defaults": {"uplink": "10mbit", "downlink": "20mbit"},
                                        "nodes": [{"name": "agg", "uplink": "50mbit", "downlink": "50mbit"},
                                                  {"name": "t1"}, {"name": "t2", "downlink": "1mbps"}]}))
    assert [(n.uplink_bps, n.downlink_bps) for n in topo.nodes.values()] == [
        (50 * MBIT, 50 * MBIT), (10 * MBIT, 20 * MBIT), (10 * MBIT, 8 * MBIT)]
    body = link_requests(topo, {})
    assert body["access"]["t2"] == {"uplink_bps": 10 * MBIT, "downlink_bps": 8 * MBIT}
    assert access_request(topo, ["t1"]) == {"t1": {"uplink_bps": 10 * MBIT, "downlink_bps": 20 * MBIT}}


@pytest.mark.parametrize("data, message", [
    ({"nodes": [{"name": "a", "uplnik": "1mbit"}]}, "did you mean 'uplink'"),
    ({"nodes": [{"name": "a", "uplink": "10mb"}]}, "field 'uplink'"),
    ({"nodes": [{"name": "a", "downlink": 5}]}, "field 'downlink'"),
    ({"defaults": {"uplink": "1mbit", "down": "1mbit"}, "nodes": [{"name": "a"}]}, "did you mean 'downlink'"),
    ({"nodes": [{"name": "p", "kind": "physical", "ip": "192.168.9.9", "downlink": "1mbit"}]},
     "emulated nodes only"),
])
def test_bad_access_fields_are_refused_with_their_place(tmp_path, data, message):
    with pytest.raises(TopologyError) as err:
        load_nodes(_nodes(tmp_path, data))
    assert message in str(err.value) and "nodes.json" in str(err.value)


def test_the_downlink_has_a_class_per_peer_and_a_default_class():
    plan = make_plan("eth0", TARGETS[:2], downlink_bps=9 * MBIT)
    assert plan.downlink_peers() == ("10.0.0.3", "10.0.0.4")
    lines = render(plan)
    ifb = access.IFB_NAME
    assert f"tc qdisc add dev {ifb} root handle 1: htb default 2" in lines
    for minor in ("2", "10", "11"):  # guarantees add up to the downlink; each may take all of it
        assert f"tc class add dev {ifb} parent 1:1 classid 1:{minor} htb rate 3mbit ceil 9mbit" in lines
        assert f"tc qdisc replace dev {ifb} parent 1:{minor} handle {minor}: pfifo limit 100" in lines
    assert f"tc filter add dev {ifb} parent 1: protocol ip prio 1 u32 match ip src 10.0.0.4/32 flowid 1:11" in lines


def test_a_new_peer_remakes_the_downlink_and_a_rate_change_does_not_add():
    old = make_plan("eth0", TARGETS[:1], downlink_bps=8 * MBIT)
    assert render_update(old, make_plan("eth0", TARGETS[:1], previous=old, downlink_bps=8 * MBIT)) == []
    grown = make_plan("eth0", TARGETS[:2], previous=old, downlink_bps=8 * MBIT)
    assert any("match ip src 10.0.0.4/32" in line for line in render_update(old, grown))
    ifb = 7
    changes = access.tree_messages(ifb, 6 * MBIT, ["10.0.0.3"], flags=0)
    assert len(changes) == 3  # the downlink, the default class, one peer: classes only, changed in place


def test_verify_names_missing_and_extra_downlink_peers():
    plan = make_plan("eth0", TARGETS[:2], downlink_bps=9 * MBIT)
    share = 3 * MBIT
    seen = access.Downlink(rate_bps=9 * MBIT, redirect=True, peers={"10.0.0.3": share, "10.0.0.9": share},
                           default_bps=share)
    problems = access.downlink_mismatches(plan.downlink_bps, seen, plan.downlink_peers())
    assert problems == ["downlink peers: missing ['10.0.0.4'], not in the plan ['10.0.0.9']"]
    seen.peers = {"10.0.0.3": share, "10.0.0.4": MBIT}
    assert access.downlink_mismatches(plan.downlink_bps, seen, plan.downlink_peers()) == [
        "downlink: the classes of ['10.0.0.4'] are not at their share 3000000 bit/s"]


def test_source_filter_matches_the_source_address():
    from worker.kernel import netlink as nl

    msg = nl.u32_src_filter(7, 1, "10.0.0.4", 0x11)
    attrs = nl.parse_attrs(nl.parse_attrs(msg[16 + 20:])[nl.TCA_OPTIONS])
    classid, keys = nl.u32_key(nl.attr(nl.TCA_U32_CLASSID, attrs[nl.TCA_U32_CLASSID])
                               + nl.attr(nl.TCA_U32_SEL, attrs[nl.TCA_U32_SEL]))
    assert classid == nl.tc_handle(1, 0x11)
    assert nl.dst_prefix(keys, nl.IP_SRC_OFFSET) == "10.0.0.4" and nl.dst_prefix(keys) is None


def test_send_timeouts_count_on_the_share_of_an_access_link(tmp_path):
    from controller.workers.deploy import shared_rate_bps
    from controller.model.topology import load_links

    topo = load_nodes(_nodes(tmp_path, {"nodes": [{"name": "agg", "uplink": "8mbit", "downlink": "9mbit"},
                                                  {"name": "t1"}, {"name": "t2"}]}))
    links_path = tmp_path / "links.json"
    links_path.write_text(json.dumps({"t1": [{"dest": "agg", "bw": "10mbit"}, {"dest": "t2", "bw": "1mbit"}],
                                      "t2": [{"dest": "agg", "bw": "10mbit"}],
                                      "agg": [{"dest": "t1", "bw": "10mbit"}, {"dest": "t2", "bw": "10mbit"}]}))
    topo = load_links(str(links_path), topo, nodes_declared=True)
    assert shared_rate_bps(topo, "t1", "agg") == 3 * MBIT  # the downlink's share: 2 peers and the default class
    assert shared_rate_bps(topo, "agg", "t2") == 4 * MBIT  # the uplink's share among its 2 links
    assert shared_rate_bps(topo, "t1", "t2") == 1 * MBIT  # no access link: the link's rate

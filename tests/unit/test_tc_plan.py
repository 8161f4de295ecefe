"""Shaping plans as tables: minors, leaves, diffs and the tc lines they render to."""
import pytest

from worker.api.errors import ConfigError
from worker.api.shape import Shape
from worker.shaping.plan import (DEFAULT_MINOR, FIRST_MINOR, MAX_MINOR, Change, Plan, Rule, Target, diff,
                                 make_plan, netem_limit_pkts, render, render_diff, rule_commands)

MBIT = 10**6


def t(dest, ip, mbit=1, **kw):
    return Target(dest, ip, Shape(mbit * MBIT, **kw))


def minors(plan):
    return [(r.dest, r.minor) for r in plan.rules]


# --- minors -------------------------------------------------------------------------------------

def test_constants():
    assert (DEFAULT_MINOR, FIRST_MINOR, MAX_MINOR) == (1, 0x10, 0xFFF)


def test_minors_assigned_in_order_from_first_minor():
    plan = make_plan("eth0", [t("c", "10.0.0.4"), t("a", "10.0.0.2"), t("b", "10.0.0.3")])
    assert plan.ifname == "eth0"
    assert minors(plan) == [("c", 0x10), ("a", 0x11), ("b", 0x12)]
    assert [r.dest_ip for r in plan.rules] == ["10.0.0.4", "10.0.0.2", "10.0.0.3"]


def test_empty_plan():
    assert make_plan("eth0", []) == Plan("eth0", ())


@pytest.mark.parametrize("before,after,expected", [
    # unchanged targets keep their minors
    (["a", "b"], ["a", "b"], [("a", 0x10), ("b", 0x11)]),
    # order of the new targets does not move the kept minors
    (["a", "b"], ["b", "a"], [("b", 0x11), ("a", 0x10)]),
    # a new dest takes the first free minor after the kept ones
    (["a", "b"], ["a", "b", "c"], [("a", 0x10), ("b", 0x11), ("c", 0x12)]),
    # a removed dest's minor is reused by a new one
    (["a", "b", "c"], ["a", "d", "c"], [("a", 0x10), ("d", 0x11), ("c", 0x12)]),
    (["a", "b"], ["c", "b"], [("c", 0x10), ("b", 0x11)]),
    # two new dests fill the holes lowest first, skipping kept minors
    (["a", "b", "c", "d"], ["x", "b", "y", "d", "z"],
     [("x", 0x10), ("b", 0x11), ("y", 0x12), ("d", 0x13), ("z", 0x14)]),
    # everything removed: numbering starts over
    (["a", "b"], ["c"], [("c", 0x10)]),
])
def test_previous_plan_keeps_minors(before, after, expected):
    old = make_plan("eth0", [t(d, f"10.0.1.{i + 1}") for i, d in enumerate(before)])
    new = make_plan("eth0", [t(d, f"10.0.2.{i + 1}") for i, d in enumerate(after)], previous=old)
    assert minors(new) == expected


def test_previous_minors_are_kept_even_when_not_dense():
    old = Plan("eth0", (Rule("a", "10.0.0.2", 0x40, Shape(MBIT)),))
    new = make_plan("eth0", [t("b", "10.0.0.3"), t("a", "10.0.0.2", 5)], previous=old)
    assert minors(new) == [("b", 0x10), ("a", 0x40)]
    assert new.rules[1].shape.rate_bps == 5 * MBIT


def test_duplicate_dest_is_a_config_error():
    with pytest.raises(ConfigError, match="two links to 'b'"):
        make_plan("eth0", [t("b", "10.0.0.3", 1), t("c", "10.0.0.4"), t("b", "10.0.0.3", 2)])


def many(n):
    return [Target(f"n{i}", f"10.1.{i // 200}.{i % 200 + 1}", Shape(MBIT)) for i in range(n)]


def test_as_many_destinations_as_minors_fit():
    plan = make_plan("eth0", many(MAX_MINOR - FIRST_MINOR + 1))
    assert plan.rules[0].minor == FIRST_MINOR and plan.rules[-1].minor == MAX_MINOR


def test_too_many_destinations_is_a_config_error():
    with pytest.raises(ConfigError, match="eth0: more than 4080 destinations"):
        make_plan("eth0", many(MAX_MINOR - FIRST_MINOR + 2))


# --- leaves -------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,leaf", [
    (Shape(MBIT), None),
    (Shape(MBIT, queue_pkts=10), "pfifo"),
    (Shape(MBIT, delay_ms=5), "netem"),
    (Shape(MBIT, delay_ms=5, jitter_ms=1), "netem"),
    (Shape(MBIT, loss_pct=1), "netem"),
    (Shape(MBIT, loss_pct=1, queue_pkts=10), "netem"),
    (Shape(MBIT, delay_ms=5, queue_pkts=10), "netem"),
])
def test_leaf_kind(shape, leaf):
    rule = make_plan("eth0", [Target("b", "10.0.0.3", shape)]).rules[0]
    assert rule.leaf == leaf
    assert make_plan("eth0", [Target("b", "10.0.0.3", shape)]).needs_netem is (leaf == "netem")


def test_plan_needs_netem_when_any_rule_does():
    plain = [t("a", "10.0.0.2"), t("b", "10.0.0.3", queue_pkts=5)]
    assert not make_plan("eth0", plain).needs_netem
    assert make_plan("eth0", plain + [t("c", "10.0.0.4", loss_pct=1)]).needs_netem


# --- diff ---------------------------------------------------------------------------------------

BASE = [t("a", "10.0.0.2", 1), t("b", "10.0.0.3", 2), t("c", "10.0.0.4", 3)]


@pytest.mark.parametrize("after,expected", [
    (BASE, []),
    (BASE + [t("d", "10.0.0.5", 4)], [("add", "d")]),
    (BASE[:2], [("remove", "c")]),
    ([BASE[0], t("b", "10.0.0.3", 5), BASE[2]], [("change", "b")]),
    ([BASE[0], t("b", "10.0.0.3", 2, delay_ms=1), BASE[2]], [("change", "b")]),
    ([BASE[0], t("b", "10.0.0.3", 2, queue_pkts=4), BASE[2]], [("change", "b")]),
    ([BASE[0], t("b", "10.0.0.9", 2), BASE[2]], [("change", "b")]),
    ([BASE[2], BASE[1], BASE[0]], []),  # order alone is no change
    ([t("a", "10.0.0.2", 1), t("b", "10.0.0.3", 5), t("d", "10.0.0.5", 4)],
     [("remove", "c"), ("change", "b"), ("add", "d")]),
    ([], [("remove", "a"), ("remove", "b"), ("remove", "c")]),
])
def test_diff_table(after, expected):
    old = make_plan("eth0", BASE)
    new = make_plan("eth0", after, previous=old)
    changes = diff(old, new)
    assert [(c.op, (c.old or c.new).dest) for c in changes] == expected
    for c in changes:
        assert isinstance(c, Change)
        if c.op == "add":
            assert c.old is None and c.new == new.by_dest()[c.new.dest]
        elif c.op == "remove":
            assert c.new is None and c.old == old.by_dest()[c.old.dest]
        else:
            assert c.old == old.by_dest()[c.old.dest] and c.new == new.by_dest()[c.new.dest]
            assert c.old.minor == c.new.minor


def test_diff_from_empty_adds_everything():
    new = make_plan("eth0", BASE)
    assert [(c.op, c.new.dest) for c in diff(Plan("eth0"), new)] == [("add", "a"), ("add", "b"), ("add", "c")]


# --- render -------------------------------------------------------------------------------------

def small_plan():
    return make_plan("eth0", [
        t("b", "10.0.0.3", 10),
        t("c", "10.0.0.4", 5, delay_ms=20, jitter_ms=5, loss_pct=0.5),
        t("d", "10.0.0.5", 1, queue_pkts=50),
    ])


SMALL_LINES = [
    "tc qdisc replace dev eth0 root handle 1: htb default 1",
    "tc class add dev eth0 parent 1: classid 1:1 htb rate 10gbit ceil 10gbit",
    "tc class add dev eth0 parent 1: classid 1:3 htb rate 10gbit ceil 10gbit",
    "tc class add dev eth0 parent 1:3 classid 1:10 htb rate 10mbit ceil 10mbit",
    "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::10 u32 match ip dst 10.0.0.3/32 flowid 1:10",
    "tc class add dev eth0 parent 1:3 classid 1:11 htb rate 5mbit ceil 5mbit",
    "tc qdisc replace dev eth0 parent 1:11 handle 11: netem delay 20ms 5ms loss 0.5% limit 1011",
    "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::11 u32 match ip dst 10.0.0.4/32 flowid 1:11",
    "tc class add dev eth0 parent 1:3 classid 1:12 htb rate 1mbit ceil 1mbit",
    "tc qdisc replace dev eth0 parent 1:12 handle 12: pfifo limit 50",
    "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::12 u32 match ip dst 10.0.0.5/32 flowid 1:12",
]


def test_render_exact_lines():
    assert render(small_plan()) == SMALL_LINES


def test_render_with_netns_prefix():
    assert render(small_plan(), "NS") == ["ip netns exec NS " + line for line in SMALL_LINES]


def test_render_empty_plan_is_root_and_default_class():
    assert render(Plan("veth1")) == [
        "tc qdisc replace dev veth1 root handle 1: htb default 1",
        "tc class add dev veth1 parent 1: classid 1:1 htb rate 10gbit ceil 10gbit",
        "tc class add dev veth1 parent 1: classid 1:3 htb rate 10gbit ceil 10gbit",
    ]


@pytest.mark.parametrize("shape,leaf_line", [
    (Shape(MBIT, delay_ms=20), "netem delay 20ms limit 1002"),
    (Shape(MBIT, delay_ms=0.5, jitter_ms=0.25), "netem delay 0.5ms 0.25ms limit 1001"),
    (Shape(MBIT, loss_pct=2), "netem delay 0ms loss 2% limit 1000"),
    (Shape(MBIT, delay_ms=3, queue_pkts=30), "netem delay 3ms limit 31"),
    (Shape(MBIT, queue_pkts=7), "pfifo limit 7"),
])
def test_leaf_arguments(shape, leaf_line):
    rule = Rule("b", "10.0.0.3", 0x2A, shape)
    assert rule_commands("eth0", rule)[1] == f"tc qdisc replace dev eth0 parent 1:2a handle 2a: {leaf_line}"


def test_minors_render_in_hex():
    rule = Rule("b", "192.168.1.7", 0xABC, Shape(1_500_000))
    assert rule_commands("eth0", rule) == [
        "tc class add dev eth0 parent 1:3 classid 1:abc htb rate 1500kbit ceil 1500kbit",
        "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::abc u32 "
        "match ip dst 192.168.1.7/32 flowid 1:abc",
    ]


def test_render_diff_lines():
    old = make_plan("eth0", [t("a", "10.0.0.2", 1, queue_pkts=5), t("b", "10.0.0.3", 2),
                             t("c", "10.0.0.4", 3)])
    new = make_plan("eth0", [t("a", "10.0.0.2", 3), t("c", "10.0.0.4", 3, delay_ms=10),
                             t("e", "10.0.0.6", 4, queue_pkts=8)], previous=old)
    assert render_diff("eth0", diff(old, new)) == [
        # b removed: filter first, then its class
        "tc filter del dev eth0 parent 1: protocol ip prio 1 handle 800::11 u32",
        "tc class del dev eth0 classid 1:11",
        # a changed and lost its pfifo leaf
        "tc class change dev eth0 parent 1:3 classid 1:10 htb rate 3mbit ceil 3mbit",
        "tc qdisc del dev eth0 parent 1:10 handle 10:",
        # c changed and gained a netem leaf
        "tc class change dev eth0 parent 1:3 classid 1:12 htb rate 3mbit ceil 3mbit",
        "tc qdisc replace dev eth0 parent 1:12 handle 12: netem delay 10ms limit 1003",
        # e added in b's old minor
        "tc class add dev eth0 parent 1:3 classid 1:11 htb rate 4mbit ceil 4mbit",
        "tc qdisc replace dev eth0 parent 1:11 handle 11: pfifo limit 8",
        "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::11 u32 match ip dst 10.0.0.6/32 flowid 1:11",
    ]


def test_render_diff_shows_a_new_destination_ip():
    old = make_plan("eth0", [t("a", "10.0.0.2", 1)])
    new = make_plan("eth0", [t("a", "10.0.0.9", 1)], previous=old)
    lines = render_diff("eth0", diff(old, new))
    assert any(" filter " in line and "10.0.0.9/32" in line and "800::10" in line for line in lines), lines


def test_render_diff_of_nothing_is_nothing():
    plan = small_plan()
    assert render_diff("eth0", diff(plan, plan)) == []


# --- wire form ----------------------------------------------------------------------------------

def test_plan_round_trip():
    plan = small_plan()
    data = plan.to_dict()
    assert data["ifname"] == "eth0"
    assert data["rules"][1] == {"dest": "c", "dest_ip": "10.0.0.4", "minor": 0x11,
                                "shape": {"rate_bps": 5 * MBIT, "delay_ms": 20, "jitter_ms": 5,
                                          "loss_pct": 0.5, "queue_pkts": None}}
    assert Plan.from_dict(data) == plan
    assert Plan.from_dict(Plan("eth0").to_dict()) == Plan("eth0")


def test_plan_from_dict_validates_shapes():
    data = small_plan().to_dict()
    data["rules"][0]["shape"]["loss_pct"] = 500
    with pytest.raises(ConfigError, match="loss_pct"):
        Plan.from_dict(data)


def test_render_diff_deletes_a_leaf_that_changes_kind():
    old = make_plan("eth0", [Target("a", "10.0.0.2", Shape(10**6, queue_pkts=5))])
    new = make_plan("eth0", [Target("a", "10.0.0.2", Shape(10**6, delay_ms=5))], previous=old)
    lines = render_diff("eth0", diff(old, new))
    assert lines.index("tc qdisc del dev eth0 parent 1:10 handle 10:") == 1, lines


# --- isolation (no link, no path) ----------------------------------------------------------------

from worker.shaping.plan import (DROP_MINOR, DROP_PRIO, Isolation, Pass, pass_diff,  # noqa: E402
                            render_update)

SPACE = Isolation(("10.0.0.0/16", "192.168.1.9/32"), ("10.0.0.1",))


def test_isolated_plan_keeps_the_gateway_and_drops_the_space():
    plan = make_plan("eth0", [t("b", "10.0.0.3")], isolation=SPACE)
    assert plan.isolated and plan.drops == ("10.0.0.0/16", "192.168.1.9/32")
    assert plan.rules == (Rule("b", "10.0.0.3", 0x10, Shape(MBIT)),)
    assert plan.passes == (Pass("", "10.0.0.1", 0x11),)  # the gateway: after the links, from the same range
    assert plan.isolation() == SPACE


def test_open_plan_has_no_isolation_whatever_else_is_asked():
    plan = make_plan("eth0", [t("b", "10.0.0.3")], unshaped=[("c", "10.0.0.4")])
    assert plan == Plan("eth0", plan.rules) and not plan.isolated and plan.isolation() is None
    assert make_plan("eth0", []).empty and not make_plan("eth0", [], isolation=SPACE).empty


@pytest.mark.parametrize("unshaped,expected", [
    ([("c", "10.0.0.4")], [("", "10.0.0.1"), ("c", "10.0.0.4")]),
    ([("b", "10.0.0.3")], [("", "10.0.0.1")]),  # a shaped link already reaches b
    ([("c", "10.0.0.4"), ("c2", "10.0.0.4")], [("", "10.0.0.1"), ("c", "10.0.0.4")]),  # one filter per address
    ([("x", "172.16.0.5")], [("", "10.0.0.1")]),  # outside the node space: not dropped, no pass needed
    ([("p", "192.168.1.9")], [("", "10.0.0.1"), ("p", "192.168.1.9")]),  # a physical node's address
])
def test_passes(unshaped, expected):
    plan = make_plan("eth0", [t("b", "10.0.0.3")], isolation=SPACE, unshaped=unshaped)
    assert [(p.dest, p.dest_ip) for p in plan.passes] == expected
    assert len({p.node for p in plan.passes} | {r.minor for r in plan.rules}) == len(plan.passes) + len(plan.rules)


def test_keep_outside_the_space_needs_no_pass():
    plan = make_plan("eth0", [], isolation=Isolation(("10.0.0.0/16",), ("10.9.0.1", "10.0.0.1")))
    assert [p.dest_ip for p in plan.passes] == ["10.0.0.1"]


def test_passes_keep_their_node_across_updates_and_new_ids_are_fresh():
    old = make_plan("eth0", [t("b", "10.0.0.3")], isolation=SPACE, unshaped=[("c", "10.0.0.4"), ("d", "10.0.0.5")])
    assert [(p.dest, p.node) for p in old.passes] == [("", 0x11), ("c", 0x12), ("d", 0x13)]
    new = make_plan("eth0", [t("b", "10.0.0.3"), t("e", "10.0.0.6")], previous=old, isolation=SPACE,
                    unshaped=[("d", "10.0.0.5")])
    assert [(r.dest, r.minor) for r in new.rules] == [("b", 0x10), ("e", 0x14)]  # not c's node: removed after
    assert [(p.dest, p.node) for p in new.passes] == [("", 0x11), ("d", 0x13)]
    removed, added = pass_diff(old, new)
    assert [p.dest for p in removed] == ["c"] and added == []
    # a new pass never takes an old link's minor either (it is added before links change)
    newer = make_plan("eth0", [t("e", "10.0.0.6")], previous=new, isolation=SPACE, unshaped=[("b", "10.0.0.3")])
    assert [(p.dest, p.node) for p in newer.passes] == [("", 0x11), ("b", 0x12)]  # not 0x10, b's old link
    assert [(r.dest, r.minor) for r in newer.rules] == [("e", 0x14)]


def test_update_order_never_drops_a_peer_moving_between_pass_and_link():
    as_pass = make_plan("eth0", [], isolation=SPACE, unshaped=[("c", "10.0.0.4")])
    as_link = make_plan("eth0", [t("c", "10.0.0.4")], previous=as_pass, isolation=SPACE, unshaped=[])
    lines = render_update(as_pass, as_link)
    assert [line.split(" dev ")[0] for line in lines] == ["tc class add", "tc filter add", "tc filter del"], lines
    back = make_plan("eth0", [], previous=as_link, isolation=SPACE, unshaped=[("c", "10.0.0.4")])
    lines = render_update(as_link, back)
    assert [line.split(" dev ")[0] for line in lines] == ["tc filter add", "tc filter del", "tc class del"], lines


def test_a_link_to_an_unshaped_peer_replaces_its_pass():
    old = make_plan("eth0", [], isolation=SPACE, unshaped=[("c", "10.0.0.4")])
    new = make_plan("eth0", [t("c", "10.0.0.4")], previous=old, isolation=SPACE, unshaped=old.unshaped())
    assert [p.dest for p in new.passes] == [""] and [r.dest for r in new.rules] == ["c"]
    removed, added = pass_diff(old, new)
    assert [p.dest for p in removed] == ["c"] and not added


def test_passes_count_against_the_destination_limit():
    with pytest.raises(ConfigError, match="more than 4080 destinations"):
        make_plan("eth0", many(MAX_MINOR - FIRST_MINOR + 1), isolation=Isolation(("10.1.0.0/16",), ("10.1.250.1",)))


def test_render_isolated_plan():
    plan = make_plan("eth0", [t("b", "10.0.0.3", 10)], isolation=SPACE, unshaped=[("c", "10.0.0.4")])
    assert render(plan) == [
        "tc qdisc replace dev eth0 root handle 1: htb default 1",
        "tc class add dev eth0 parent 1: classid 1:1 htb rate 10gbit ceil 10gbit",
        "tc class add dev eth0 parent 1: classid 1:2 htb rate 10gbit ceil 10gbit",
        "tc qdisc replace dev eth0 parent 1:2 handle 2: pfifo limit 0",
        "tc class add dev eth0 parent 1: classid 1:3 htb rate 10gbit ceil 10gbit",
        "tc class add dev eth0 parent 1:3 classid 1:10 htb rate 10mbit ceil 10mbit",
        "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::10 u32 match ip dst 10.0.0.3/32 flowid 1:10",
        "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::11 u32 match ip dst 10.0.0.1/32 flowid 1:1",
        "tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::12 u32 match ip dst 10.0.0.4/32 flowid 1:1",
        "tc filter add dev eth0 parent 1: protocol ip prio 2 u32 match ip dst 10.0.0.0/16 flowid 1:2",
        "tc filter add dev eth0 parent 1: protocol ip prio 2 u32 match ip dst 192.168.1.9/32 flowid 1:2",
    ]
    assert (DROP_MINOR, DROP_PRIO) == (2, 2) and DROP_MINOR < FIRST_MINOR


def test_render_update_switches_isolation_on_and_off():
    open_plan = make_plan("eth0", [t("b", "10.0.0.3", 10)])
    closed = make_plan("eth0", [t("b", "10.0.0.3", 10)], previous=open_plan, isolation=SPACE)
    on = render_update(open_plan, closed)
    assert on[:2] == ["tc class add dev eth0 parent 1: classid 1:2 htb rate 10gbit ceil 10gbit",
                      "tc qdisc replace dev eth0 parent 1:2 handle 2: pfifo limit 0"]  # the class before its filters
    assert on[2].endswith("match ip dst 10.0.0.1/32 flowid 1:1") and "prio 2" in on[3]
    off = render_update(closed, make_plan("eth0", [t("b", "10.0.0.3", 10)], previous=closed))
    assert off == ["tc filter del dev eth0 parent 1: protocol ip prio 1 handle 800::11 u32",
                   "tc filter del dev eth0 parent 1: protocol ip prio 2 u32",
                   "tc class del dev eth0 classid 1:2"]
    assert render_update(closed, closed) == []


def test_isolated_plan_round_trip_and_old_state_files():
    plan = make_plan("eth0", [t("b", "10.0.0.3")], isolation=SPACE, unshaped=[("c", "10.0.0.4")])
    assert Plan.from_dict(plan.to_dict()) == plan
    assert plan.to_dict()["drops"] == ["10.0.0.0/16", "192.168.1.9/32"]
    old_style = {"ifname": "eth0", "rules": [plan.rules[0].to_dict()]}  # written before isolation existed
    assert Plan.from_dict(old_style) == Plan("eth0", plan.rules)


@pytest.mark.parametrize("data,error", [
    ({"open": True}, None),
    ({"drop": ["10.0.0.0/16"]}, None),
    ({"drop": ["10.0.0.0/16"], "keep": ["10.0.0.1"]}, None),
    ({"open": False}, "isolation: field 'open': unknown field"),
    ({"open": True, "drop": ["10.0.0.0/16"]}, "field 'open': unknown field"),
    ({"drop": []}, "at least one prefix"),
    ({"drop": "10.0.0.0/16"}, "isolation: field 'drop': expected a list"),
    ({"drop": ["10.0.0.1/16"]}, "isolation: field 'drop\\[0\\]': '10.0.0.1/16' is not an IPv4 prefix"),
    ({"drop": ["10.0.0.0/16"], "keep": ["10.0.0"]}, "isolation: field 'keep\\[0\\]': '10.0.0' is not an IPv4 address"),
    ({"drop": ["10.0.0.0/16"], "kept": []}, "field 'kept': unknown field; did you mean 'keep'"),
    ({"keep": []}, "isolation: missing field 'drop'"),
    ([], "isolation: expected an object"),
])
def test_isolation_wire_form(data, error):
    if error is None:
        got = Isolation.from_dict(data)
        assert (got is None) == ("open" in data)
        if got is not None:
            assert Isolation.from_dict(got.to_dict()) == got
    else:
        with pytest.raises(ConfigError, match=error):
            Isolation.from_dict(data)


def test_ipv6_drop_only_with_isolation():
    from worker.shaping.plan import IPV6_DROP_PRIO

    assert make_plan("eth0", [], isolation=SPACE, drop_ipv6=True).drop_ipv6 is True
    assert make_plan("eth0", [], drop_ipv6=True).drop_ipv6 is False  # open: nothing dropped
    plan = make_plan("eth0", [], isolation=SPACE, drop_ipv6=True)
    assert render(plan)[-1] == (f"tc filter add dev eth0 parent 1: protocol ipv6 prio {IPV6_DROP_PRIO} u32 "
                                "match u32 0 0 flowid 1:2")
    assert Plan.from_dict(plan.to_dict()) == plan
    assert render_update(plan, make_plan("eth0", [], previous=plan)) == [
        "tc filter del dev eth0 parent 1: protocol ip prio 1 handle 800::10 u32",
        "tc filter del dev eth0 parent 1: protocol ip prio 2 u32",
        "tc filter del dev eth0 parent 1: protocol ipv6 prio 3 u32",
        "tc class del dev eth0 classid 1:2"]


@pytest.mark.parametrize("shape, limit", [
    (Shape(10**9, delay_ms=100), 1000 + 8334),  # 1 Gbit/s x 100 ms = 12.5 MB in flight
    (Shape(10 * MBIT, delay_ms=50, jitter_ms=5, queue_pkts=100), 100 + 46),
    (Shape(10 * MBIT, loss_pct=1), 1000),  # no delay: nothing in flight
])
def test_netem_limit_holds_the_queue_and_the_bandwidth_delay_product(shape, limit):
    assert netem_limit_pkts(shape) == limit

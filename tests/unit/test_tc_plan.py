"""Shaping plans as tables: minors, leaves, diffs and the tc lines they render to."""
import pytest

from worker.errors import ConfigError
from worker.shape import Shape
from worker.tc_plan import FIRST_MINOR, MAX_MINOR, Plan, Target, diff, make_plan, render, render_diff


def t(dest, ip, mbit, **kw):
    return Target(dest, ip, Shape(mbit * 10**6, **kw))


def test_minors_in_order_and_kept_across_updates():
    first = make_plan("eth0", [t("b", "10.0.0.3", 10), t("c", "10.0.0.4", 20)])
    assert [(r.dest, r.minor) for r in first.rules] == [("b", FIRST_MINOR), ("c", FIRST_MINOR + 1)]
    second = make_plan("eth0", [t("d", "10.0.0.5", 5), t("c", "10.0.0.4", 30)], previous=first)
    assert {r.dest: r.minor for r in second.rules} == {"c": FIRST_MINOR + 1, "d": FIRST_MINOR}  # b's minor reused


def test_duplicate_and_too_many_destinations():
    with pytest.raises(ConfigError, match="two links"):
        make_plan("eth0", [t("b", "10.0.0.3", 1), t("b", "10.0.0.3", 2)])
    many = [Target(f"n{i}", f"10.1.{i // 200}.{i % 200 + 1}", Shape(10**6)) for i in range(MAX_MINOR - FIRST_MINOR + 2)]
    with pytest.raises(ConfigError, match="destinations"):
        make_plan("eth0", many)


@pytest.mark.parametrize("shape,leaf", [
    (Shape(10**6), None), (Shape(10**6, queue_pkts=10), "pfifo"), (Shape(10**6, delay_ms=5), "netem"),
    (Shape(10**6, delay_ms=5, jitter_ms=1), "netem"), (Shape(10**6, loss_pct=1), "netem"),
    (Shape(10**6, loss_pct=1, queue_pkts=10), "netem"),
])
def test_leaf_kind(shape, leaf):
    assert make_plan("eth0", [Target("b", "10.0.0.3", shape)]).rules[0].leaf == leaf


def test_diff_table():
    old = make_plan("eth0", [t("a", "10.0.0.2", 1), t("b", "10.0.0.3", 2), t("c", "10.0.0.4", 3)])
    new = make_plan("eth0", [t("a", "10.0.0.2", 1), t("b", "10.0.0.3", 5), t("d", "10.0.0.5", 4)], previous=old)
    assert sorted((c.op, (c.old or c.new).dest) for c in diff(old, new)) == [("add", "d"), ("change", "b"), ("remove", "c")]
    assert diff(new, new) == []


def test_render_exact_lines():
    plan = make_plan("eth0", [t("b", "10.0.0.3", 10), t("c", "10.0.0.4", 5, delay_ms=20, jitter_ms=5, loss_pct=0.5),
                              t("d", "10.0.0.5", 1, queue_pkts=50)])
    assert render(plan, "etb-0-a") == [
        "ip netns exec etb-0-a tc qdisc replace dev eth0 root handle 1: htb default 1",
        "ip netns exec etb-0-a tc class add dev eth0 parent 1: classid 1:1 htb rate 10gbit ceil 10gbit",
        "ip netns exec etb-0-a tc class add dev eth0 parent 1: classid 1:10 htb rate 10mbit ceil 10mbit",
        "ip netns exec etb-0-a tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::10 u32 match ip dst 10.0.0.3/32 flowid 1:10",
        "ip netns exec etb-0-a tc class add dev eth0 parent 1: classid 1:11 htb rate 5mbit ceil 5mbit",
        "ip netns exec etb-0-a tc qdisc replace dev eth0 parent 1:11 handle 11: netem delay 20ms 5ms loss 0.5% limit 1000",
        "ip netns exec etb-0-a tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::11 u32 match ip dst 10.0.0.4/32 flowid 1:11",
        "ip netns exec etb-0-a tc class add dev eth0 parent 1: classid 1:12 htb rate 1mbit ceil 1mbit",
        "ip netns exec etb-0-a tc qdisc replace dev eth0 parent 1:12 handle 12: pfifo limit 50",
        "ip netns exec etb-0-a tc filter add dev eth0 parent 1: protocol ip prio 1 handle 800::12 u32 match ip dst 10.0.0.5/32 flowid 1:12",
    ]


def test_render_diff_lines():
    old = make_plan("eth0", [t("a", "10.0.0.2", 1, queue_pkts=5), t("b", "10.0.0.3", 2)])
    new = make_plan("eth0", [t("a", "10.0.0.2", 3)], previous=old)
    assert render_diff("eth0", diff(old, new)) == [
        "tc filter del dev eth0 parent 1: protocol ip prio 1 handle 800::11 u32",
        "tc class del dev eth0 classid 1:11",
        "tc class change dev eth0 parent 1: classid 1:10 htb rate 3mbit ceil 3mbit",
        "tc qdisc del dev eth0 parent 1:10 handle 10:",
    ]


def test_plan_round_trip():
    plan = make_plan("eth0", [t("b", "10.0.0.3", 10, delay_ms=1, queue_pkts=3)])
    assert Plan.from_dict(plan.to_dict()) == plan

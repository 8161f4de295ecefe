"""Comparing what the kernel holds with the plan: every difference is named."""
import pytest

from worker.shape import Shape
from worker.tc_apply import Observed, mismatches
from worker.tc_plan import Target, make_plan

PLAN = make_plan("eth0", [Target("b", "10.0.0.3", Shape(10**7)), Target("c", "10.0.0.4", Shape(2 * 10**7, queue_pkts=9))])


def observed(**changes):
    seen = Observed(root={"kind": "htb", "handle": 0x10000, "default_minor": 1},
                    classes={1: 10**10 // 8, 0x10: 10**7 // 8, 0x11: 2 * 10**7 // 8},
                    leaves={0x11: {"kind": "pfifo", "limit": 9}},
                    filters={0x10: {"dest_ip": "10.0.0.3", "minor": 0x10}, 0x11: {"dest_ip": "10.0.0.4", "minor": 0x11}})
    for key, value in changes.items():
        setattr(seen, key, value)
    return seen


def test_exact_match():
    assert mismatches(PLAN, observed()) == []


@pytest.mark.parametrize("changes,expected", [
    ({"root": None}, "root qdisc"),
    ({"root": {"kind": "htb", "handle": 0x10000, "default_minor": 0}}, "default class"),
    ({"classes": {1: 10**10 // 8, 0x10: 5 * 10**6 // 8, 0x11: 2 * 10**7 // 8}}, "class 1:10: rate 5000000"),
    ({"classes": {1: 10**10 // 8, 0x10: 10**7 // 8, 0x11: 2 * 10**7 // 8, 0x12: 1}}, "class 1:12 is not in the plan"),
    ({"filters": {0x11: {"dest_ip": "10.0.0.4", "minor": 0x11}}}, "filter for b"),
    ({"filters": {0x10: {"dest_ip": "10.9.9.9", "minor": 0x10}, 0x11: {"dest_ip": "10.0.0.4", "minor": 0x11}}}, "filter for b"),
    ({"leaves": {0x11: {"kind": "pfifo", "limit": 1000}}}, "limit 1000, expected 9"),
    ({"leaves": {}}, "expected pfifo"),
    ({"leaves": {0x10: {"kind": "netem"}, 0x11: {"kind": "pfifo", "limit": 9}}}, "expected the default"),
])
def test_each_difference_is_named(changes, expected):
    problems = mismatches(PLAN, observed(**changes))
    assert any(expected in p for p in problems), problems

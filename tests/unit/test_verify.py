"""Comparing what the kernel holds with the plan: every difference is named, agreement is []."""
import copy

import pytest

from worker.api.shape import Shape
from worker.shaping.apply import Observed, mismatches
from worker.shaping.plan import Plan, Target, make_plan

# b: plain class (kernel default leaf), c: pfifo leaf, d: netem leaf
PLAN = make_plan("eth0", [
    Target("b", "10.0.0.3", Shape(10**7)),
    Target("c", "10.0.0.4", Shape(2 * 10**7, queue_pkts=9)),
    Target("d", "10.0.0.5", Shape(5 * 10**6, delay_ms=20, jitter_ms=5, loss_pct=0.5)),
])
B, C, D = 0x10, 0x11, 0x12

ROOT = {"kind": "htb", "handle": 0x10000, "default_minor": 1}
CLASSES = {1: 10**10 // 8, 3: 10**10 // 8, B: 10**7 // 8, C: 2 * 10**7 // 8, D: 5 * 10**6 // 8}
LEAVES = {C: {"kind": "pfifo", "limit": 9},
          D: {"kind": "netem", "delay_us": 20_000, "jitter_us": 5_000, "loss_pct": 0.5, "limit": 1011}}
FILTERS = {B: {"dest_ip": "10.0.0.3", "minor": B}, C: {"dest_ip": "10.0.0.4", "minor": C},
           D: {"dest_ip": "10.0.0.5", "minor": D}}


def observed(**changes):
    """What the kernel holds after a correct apply, with ``changes`` swapped in."""
    seen = Observed(root=dict(ROOT), classes=dict(CLASSES), leaves=copy.deepcopy(LEAVES),
                    filters=copy.deepcopy(FILTERS))
    for key, value in changes.items():
        setattr(seen, key, value)
    return seen


def test_exact_match():
    assert mismatches(PLAN, observed()) == []


def test_empty_plan_against_root_and_default_class():
    assert mismatches(Plan("eth0"), Observed(root=dict(ROOT), classes={1: 10**10 // 8, 3: 10**10 // 8})) == []


@pytest.mark.parametrize("tolerated", [
    {"delay_us": 20_001}, {"jitter_us": 4_999}, {"loss_pct": 0.50000001},
])
def test_netem_rounding_is_tolerated(tolerated):
    leaves = copy.deepcopy(LEAVES)
    leaves[D].update(tolerated)
    assert mismatches(PLAN, observed(leaves=leaves)) == []


def with_(table, key, value):
    """A copy of ``table`` with ``key`` set to ``value`` (removed when value is None)."""
    out = copy.deepcopy(table)
    if value is None:
        out.pop(key, None)
    else:
        out[key] = value
    return out


@pytest.mark.parametrize("changes,expected", [
    # the root
    ({"root": None},
     ["root qdisc is None, expected htb 1:"]),
    ({"root": {"kind": "tbf", "handle": 0x10000}},
     ["root qdisc is {'kind': 'tbf', 'handle': 65536}, expected htb 1:"]),
    ({"root": {"kind": "htb", "handle": 0x20000, "default_minor": 1}},
     ["root qdisc is {'kind': 'htb', 'handle': 131072, 'default_minor': 1}, expected htb 1:"]),
    ({"root": {"kind": "htb", "handle": 0x10000, "default_minor": 0}},
     ["root default class is 0, expected 1"]),
    ({"root": {"kind": "htb", "handle": 0x10000, "default_minor": 0x10}},
     ["root default class is 16, expected 1"]),
    # classes
    ({"classes": with_(CLASSES, B, 5 * 10**6 // 8)},
     ["class 1:10: rate 5000000 bit/s, expected 10000000"]),
    ({"classes": with_(CLASSES, 1, 10**9 // 8)},
     ["class 1:1: rate 1000000000 bit/s, expected 10000000000"]),
    ({"classes": with_(CLASSES, 1, None)},
     ["class 1:1: rate None bit/s, expected 10000000000"]),
    ({"classes": with_(CLASSES, C, None)},
     ["class 1:11: rate None bit/s, expected 20000000"]),
    ({"classes": with_(CLASSES, 0x13, 125)},
     ["class 1:13 is not in the plan"]),
    # filters
    ({"filters": with_(FILTERS, B, None)},
     ["filter for b (10.0.0.3): found None"]),
    ({"filters": with_(FILTERS, B, {"dest_ip": "10.9.9.9", "minor": B})},
     ["filter for b (10.0.0.3): found {'dest_ip': '10.9.9.9', 'minor': 16}"]),
    ({"filters": with_(FILTERS, C, {"dest_ip": "10.0.0.4", "minor": B})},
     ["filter for c (10.0.0.4): found {'dest_ip': '10.0.0.4', 'minor': 16}"]),
    ({"filters": with_(FILTERS, B, {"dest_ip": None, "minor": B})},
     ["filter for b (10.0.0.3): found {'dest_ip': None, 'minor': 16}"]),
    ({"filters": with_(FILTERS, 0x20, {"dest_ip": "10.0.0.9", "minor": 0x20})},
     ["filter 800::20 is not in the plan"]),
    # leaves
    ({"leaves": with_(LEAVES, C, {"kind": "pfifo", "limit": 1000})},
     ["leaf of 1:11 (c): limit 1000, expected 9"]),
    ({"leaves": with_(LEAVES, C, None)},
     ["leaf of 1:11 (c): found None, expected pfifo"]),
    ({"leaves": with_(LEAVES, C, {"kind": "bfifo", "limit": 9})},
     ["leaf of 1:11 (c): found bfifo, expected pfifo"]),
    ({"leaves": with_(LEAVES, D, None)},  # netem expected, the kernel's default found
     ["leaf of 1:12 (d): found None, expected netem"]),
    ({"leaves": with_(LEAVES, D, {"kind": "pfifo", "limit": 1000})},
     ["leaf of 1:12 (d): found pfifo, expected netem"]),
    ({"leaves": with_(LEAVES, B, {"kind": "pfifo", "limit": 5})},
     ["leaf of 1:10 (b): found pfifo, expected the default"]),
    ({"leaves": with_(LEAVES, D, {**LEAVES[D], "delay_us": 10_000})},
     ["leaf of 1:12 (d): delay_us 10000 (expected 20000)"]),
    ({"leaves": with_(LEAVES, D, {**LEAVES[D], "jitter_us": 0, "limit": 50})},
     ["leaf of 1:12 (d): jitter_us 0 (expected 5000), limit 50 (expected 1011)"]),
    ({"leaves": with_(LEAVES, D, {**LEAVES[D], "loss_pct": 1.0})},
     ["leaf of 1:12 (d): loss 1.0% (expected 0.5%)"]),
    ({"leaves": with_(LEAVES, D, {"kind": "netem"})},  # options could not be decoded
     ["leaf of 1:12 (d): delay_us None (expected 20000), jitter_us None (expected 5000), "
      "limit None (expected 1011), loss None% (expected 0.5%)"]),
])
def test_each_difference_is_named(changes, expected):
    assert mismatches(PLAN, observed(**changes)) == expected


def test_several_differences_are_all_reported():
    problems = mismatches(PLAN, observed(
        root={"kind": "htb", "handle": 0x10000, "default_minor": 2},
        classes=with_(CLASSES, B, 1),
        filters=with_(FILTERS, C, None),
        leaves=with_(LEAVES, C, None)))
    assert problems == [
        "root default class is 2, expected 1",
        "class 1:10: rate 8 bit/s, expected 10000000",
        "filter for c (10.0.0.4): found None",
        "leaf of 1:11 (c): found None, expected pfifo",
    ]


def test_nothing_applied_yet():
    assert mismatches(PLAN, Observed()) == ["root qdisc is None, expected htb 1:"]


def test_observed_to_dict():
    seen = observed()
    data = seen.to_dict()
    assert data["root"] == ROOT
    assert data["classes"] == {"1:1": {"rate_bps": 10**10}, "1:3": {"rate_bps": 10**10}, "1:10": {"rate_bps": 10**7},
                               "1:11": {"rate_bps": 2 * 10**7}, "1:12": {"rate_bps": 5 * 10**6}}
    assert data["leaves"]["1:11"] == {"kind": "pfifo", "limit": 9}
    assert list(data["filters"]) == ["800::10", "800::11", "800::12"]
    assert data["filters"]["800::12"] == {"dest_ip": "10.0.0.5", "minor": D}


def test_stray_leaf_outside_the_plan_is_named():
    seen = observed()
    seen.leaves[1] = {"kind": "pfifo", "limit": 5}
    assert "leaf under 1:1 is not in the plan" in mismatches(PLAN, seen)

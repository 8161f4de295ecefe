"""The host's trace clock when one node's links are cleared: only that node's links stop."""
from __future__ import annotations

from types import SimpleNamespace

from worker.shaping.schedule import HostSchedule


class _Clock:
    def __init__(self, keys):
        self.links = [SimpleNamespace(src=s, dst=d) for s, d in keys]
        self.ended: set = set()

    def end(self, keys):
        self.ended |= set(keys)


def test_clearing_one_nodes_links_ends_only_the_traced_links_it_is_on():
    schedule = HostSchedule(store=None)
    schedule.clock = _Clock([("a", "b"), ("b", "a"), ("c", "d")])
    schedule.end_node("a")
    assert schedule.clock.ended == {("a", "b"), ("b", "a")}
    schedule.end_node("z")
    assert schedule.clock.ended == {("a", "b"), ("b", "a")}


def test_with_no_clock_clearing_a_nodes_links_is_nothing():
    HostSchedule(store=None).end_node("a")

"""The host's trace clock when one node's links are cleared: only that node's links stop."""
from __future__ import annotations

from types import SimpleNamespace

from worker.shaping.host_schedule import HostSchedule
from tests.unit.fake_netlink import CountingSockets


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


def test_a_late_wake_up_folds_the_ticks_passed_into_one_batch():
    from worker.shaping.schedule import due_ticks

    assert list(due_ticks(5, 0.5, 0.1)) == [5]  # on time
    assert list(due_ticks(5, 0.5999, 0.1)) == [5]  # late within its own bin
    assert list(due_ticks(5, 0.83, 0.1)) == [5, 6, 7, 8]  # three ticks passed meanwhile
    assert list(due_ticks(5, 0.2, 0.1)) == [5]  # (never before the first not applied)


def test_ticks_folded_into_a_late_batch_each_get_a_row_with_its_time(one_node_plan):
    from worker.shaping.schedule import LinkSchedule, ScheduleClock

    sockets, plan = CountingSockets(), one_node_plan
    batches = sockets.batches
    links = [LinkSchedule("a", "b", (1, 2, 3, 4, 4)), LinkSchedule("a", "c", (9, 9, 9, 8, 7))]
    links = [LinkSchedule(l.src, l.dst, tuple(r * 10**6 for r in l.rates_bps)) for l in links]
    now = [0.0]
    clock = ScheduleClock(links, {"a": ("ns-a", plan)}, start=0.0, sockets=sockets, clock=lambda: now[0])
    clock.tick(0.0)
    now[0] = 0.43  # woke 330 ms late for the tick of 0.1 s: the bins of 0.4 s go in one batch
    assert clock.tick(0.4, late_from_s=0.1) == 2 and batches == [1, 2] and clock.applied == [4, 4]
    rows = [(r["planned_s"], r["skew_ms"], r["changed"]) for r in clock.rows]  # (a->b's first bin: deployed at it)
    assert rows == [(0.0, 0.0, 1), (0.1, 330.0, 1), (0.2, 230.0, 1), (0.3, 130.0, 2), (0.4, 30.0, 2)]
    assert all(r["applied_s"] == 0.43 and r["outcome"] == "applied" for r in clock.rows[1:])
    late = ScheduleClock(links, {"a": ("ns-a", plan)}, start=0.0, sockets=sockets, clock=lambda: 0.15)
    late.tick(0.1, late_from_s=0.0)  # started late: tick 0's row counts the first bins the plan lacked
    assert [(r["planned_s"], r["skew_ms"], r["changed"]) for r in late.rows] == [(0.0, 150.0, 1), (0.1, 50.0, 2)]


def test_a_clock_whose_tick_fails_unexpectedly_stops_with_a_row_saying_why(one_node_plan):
    import time

    from worker.shaping.schedule import LinkSchedule, ScheduleClock

    class Broken(CountingSockets):
        def run(self, msgs: list) -> list:
            raise RuntimeError("no such thing")

    links = [LinkSchedule("a", "b", (10**6, 2 * 10**6), bin_ms=100)]
    clock = ScheduleClock(links, {"a": ("ns-a", one_node_plan)}, start=time.monotonic(), sockets=Broken())
    clock.begin()
    assert clock._thread is not None
    clock._thread.join(timeout=10)
    assert not clock._thread.is_alive()
    assert clock.rows[-1]["outcome"] == "failed: the clock stopped: RuntimeError: no such thing", clock.rows
    clock.stop()  # (stopping it after is harmless)


def test_the_clock_thread_runs_real_time_and_gives_it_up_after():
    import os
    import threading

    from worker.shaping.schedule import realtime

    seen: dict[str, object] = {}

    def run() -> None:
        seen["before"] = os.sched_getscheduler(0)
        with realtime() as policy:
            seen["policy"], seen["inside"] = policy, os.sched_getscheduler(0)
        seen["after"] = os.sched_getscheduler(0)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen["after"] == seen["before"] == os.sched_getscheduler(0)  # (the main thread's: untouched)
    if seen["policy"] == "fifo":
        assert seen["inside"] == os.SCHED_FIFO
    else:  # not allowed here (not root, no real-time budget): nice -10 or as it was
        assert seen["inside"] == seen["before"]


def test_the_clock_process_answers_each_command_with_one_json_line():
    import io
    import json

    from worker.shaping.clock_process import serve

    link = {"src": "a", "dst": "b", "rates_bps": [10**6], "netem": None, "bin_ms": 100, "loop": False,
            "offset_s": 0.0}
    commands = [{"op": "stop"}, {"op": "end", "links": [["a", "b"]]},
                {"op": "start", "start": 0.0, "links": [link], "nodes": {"a": [None, {"ifname": "lo", "rules": []}]}},
                {"op": "start", "start": 0.0, "links": [{**link, "bin_ms": 1}], "nodes": {}},
                {"op": "evil"}]
    out = io.StringIO()
    assert serve(io.StringIO("".join(json.dumps(c) + "\n" for c in commands) + "not json\n"), out) == 0
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    assert answers[0]["ready"] and answers[1] == {"running": False} and answers[2] == {"running": False, "ended": []}
    assert answers[3] == {"error": "schedule: no shaped link a->b on this host", "kind": "ConfigError"}
    assert answers[4]["kind"] == "ConfigError" and "bin_ms 1 under 10" in answers[4]["error"]
    assert answers[5]["error"] == "unknown command 'evil'" and "malformed" in answers[6]["error"]


def test_the_clock_process_is_a_child_that_refuses_naming_the_link_and_ends_with_its_input():
    import pytest

    from worker.api.errors import ConfigError
    from worker.shaping.clock_process import ClockProcess

    proc = ClockProcess()
    try:
        assert proc.call({"op": "stop"}) == {"running": False}
        with pytest.raises(ConfigError, match="no shaped link a->b"):
            proc.call({"op": "start", "start": 0.0, "nodes": {"a": [None, {"ifname": "lo", "rules": []}]},
                       "links": [{"src": "a", "dst": "b", "rates_bps": [10**6], "netem": None, "bin_ms": 100,
                                  "loop": False, "offset_s": 0.0}]})
    finally:
        proc.close()
    assert proc.proc.returncode == 0 and not proc.alive()


def test_a_clock_process_that_died_leaves_the_links_at_their_bins_and_the_calls_answer():
    from worker.shaping.clock_process import ClockProcess
    from worker.shaping.host_schedule import RunningClock
    from worker.shaping.schedule import LinkSchedule

    schedule = HostSchedule(store=SimpleNamespace(snapshot=lambda: {"nodes": {}, "plans": {}}))
    schedule.clock = RunningClock([LinkSchedule("a", "b", (10**6,))], 0.1, set())
    schedule._proc = ClockProcess()
    schedule._proc.proc.kill()
    schedule._proc.proc.wait()
    schedule.end_node("a")  # (said in the log, no error)
    schedule.replanned()
    assert schedule.end({"version": 1, "links": [{"src": "a", "dst": "b"}]}) == {"running": False, "ended": []}
    assert schedule.stop() == {"running": False, "links": 0, "rows": [], "applied": []}
    assert schedule.clock is None and schedule._proc is None

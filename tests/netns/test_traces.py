"""Recorded traces replayed on real links: three links of real namespaces change rate bin by
bin (each tick's HTB class rates read back from the kernel by netlink), and a bulk TCP flow over
a traced link follows the recording second by second (iperf3)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from controller.model.traces import REPLAY_GSO_MAX_BYTES, Replay, Trace
from controller.run.trace_replay import TracedLink, TraceReplay
from tests.netns.conftest import (IPERF_PORT, NETNS, gso_max_size, iperf_json, iperf_server, links, need_iperf3,
                                  nodes_body, report, wait_for)
from worker.api.errors import NotFound

pytestmark = NETNS


@pytest.fixture
def three(host):
    created = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    ips = {n["name"]: n["ip"] for n in created}
    host.set_links(links(("a", "b", ips["b"], 10**7), ("b", "c", ips["c"], 10**7), ("c", "a", ips["a"], 10**7),
                         ("b", "a", ips["a"], 10**7)))
    yield host, ips
    host.reset()


def replay(rates_mbit: list[float], bin_s: float = 0.1, **kw) -> Replay:
    return Replay(Trace("fixture", bin_s, np.array([round(r * 1e6) for r in rates_mbit])), "fixture", "csv", **kw)


def kernel_rate_bps(host, src: str, dst: str) -> int:
    """The rate of the HTB class of ``src -> dst`` as the kernel reports it (netlink dump)."""
    info = host.shaping(src)
    minor = next(r["minor"] for r in info["plan"]["rules"] if r["dest"] == dst)
    assert info["verified"], info["mismatches"]  # the plan on disk follows the kernel too
    return info["kernel"]["classes"][f"1:{minor:x}"]["rate_bps"]


def test_three_traced_links_change_rate_each_tick_in_the_kernel(three):
    host, _ = three
    traces = {("a", "b"): replay([2, 4, 4, 1]), ("b", "c"): replay([8, 8, 3, 3]),
              ("c", "a"): replay([1, 2, 3, 4], offset_s=0.1)}
    replayer = TraceReplay(host, clock=lambda: 0.0, progress=lambda _: None)
    replayer.t0 = 0.0
    replayer.add(TracedLink(s, d, r) for (s, d), r in traces.items())
    for k in range(5):
        replayer.tick(k / 10)
        for (src, dst), r in traces.items():
            assert kernel_rate_bps(host, src, dst) == r.rate_at(k / 10 + 1e-6), (k, src, dst)
    assert [row["changed"] for row in replayer.rows] == [3, 2, 2, 2, 3]
    assert kernel_rate_bps(host, "b", "a") == 10**7  # a link without a trace keeps its rate
    with pytest.raises(NotFound, match="no shaped link a->c"):
        host.set_rates({"version": 1, "rates": [{"src": "a", "dst": "c", "rate_bps": 10**6}]})
    # a full links update after a replay diffs against the replayed rates and verifies
    host.set_links(links(("a", "b", three[1]["b"], 5 * 10**6)), merge=True)
    assert kernel_rate_bps(host, "a", "b") == 5 * 10**6


def test_the_replay_clock_sets_all_rates_in_time(three, request):
    host, _ = three
    replayer = TraceReplay(host, progress=lambda _: None)
    replayer.add([TracedLink("a", "b", replay([2, 6] * 10)), TracedLink("b", "c", replay([6, 2] * 10)),
                  TracedLink("c", "a", replay([1, 3, 5, 7] * 5))])
    replayer.start()
    time.sleep(1.55)
    replayer.stop()
    skews = sorted(r["skew_ms"] for r in replayer.rows)
    report(request, "median_skew_ms", skews[len(skews) // 2])
    assert 10 <= len(replayer.rows) <= 17 and all(r["outcome"] == "applied" for r in replayer.rows)
    assert replayer.rows[0]["planned_s"] == 0.0 and skews[len(skews) // 2] < 15, skews  # (a busy machine: a late one)
    last = replayer.rows[-1]["planned_s"]
    assert kernel_rate_bps(host, "c", "a") == replay([1, 3, 5, 7] * 5).rate_at(last + 1e-6)


def test_a_bulk_flow_follows_the_trace_second_by_second(three, request):
    need_iperf3()
    host, ips = three
    iperf_server(host, "b")
    # b -> a replays 8, 2, 8, 2 Mbit/s a second (100 ms bins); b sends (-R from a)
    trace = replay([8] * 10 + [2] * 10 + [8] * 10 + [2] * 10 + [8] * 10)
    replayer = TraceReplay(host, progress=lambda _: None)
    replayer.add([TracedLink("b", "a", trace)])
    replayer.start()
    shift = time.monotonic() - replayer.t0  # the flow's time 0 on the replay's clock (+ its start-up)
    flow = host.start_process("a", {"version": 1, "argv": ["iperf3", "-c", ips["b"], "-p", str(IPERF_PORT), "-t",
                                                            "5", "-i", "1", "-R", "-J"]})
    deadline = time.monotonic() + 30
    while any(p["running"] for p in host.processes()["processes"] if p["id"] == flow["id"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    replayer.stop()
    with open(flow["log"]) as f:
        doc = iperf_json(f.read())
    measured = [(i["sum"]["start"] + shift, i["sum"]["bits_per_second"]) for i in doc["intervals"]]
    ratios = []
    for start_s, bps in measured[1:]:  # (the first second: slow start)
        expected = np.mean([trace.rate_at(start_s + k / 10 + 0.05) for k in range(10)])
        ratios.append(bps / expected)
    report(request, "median_goodput_ratio", float(np.median(ratios)))
    assert len(ratios) >= 3 and all(0.6 <= r <= 1.15 for r in ratios), (measured, ratios)


def test_an_access_link_replays_its_trace_in_the_kernel(three):
    host, ips = three
    host.set_links({"version": 1, "links": [], "access": {"a": {"uplink_bps": 10**7}}}, merge=True)
    uplink = replay([3, 5, 2])
    replayer = TraceReplay(host, clock=lambda: 0.0, progress=lambda _: None)
    replayer.t0 = 0.0
    replayer.add([TracedLink("a", "", uplink, side="uplink"), TracedLink("a", "b", replay([1, 2, 4]))])
    for k in range(3):
        replayer.tick(k / 10)
        info = host.shaping("a")
        assert info["verified"], info["mismatches"]
        assert info["kernel"]["classes"]["1:3"]["rate_bps"] == uplink.rate_at(k / 10 + 1e-6)  # the access class
        assert kernel_rate_bps(host, "a", "b") <= uplink.rate_at(k / 10 + 1e-6)  # the link's share of it
        assert info["plan"]["uplink_bps"] == uplink.rate_at(k / 10 + 1e-6)


def test_the_workers_own_clock_applies_each_bin_in_the_kernel_on_time(three, request):
    """worker.shaping.schedule: the bins handed over once, ticked by the worker's thread."""
    from worker.shaping.schedule import LinkSchedule, ScheduleClock

    host, _ = three
    state = host.links.store.snapshot()
    nodes = {n: (state["nodes"][n]["netns"], state["plans"][n]) for n in ("a", "b")}
    links = [LinkSchedule("a", "b", (2_000_000, 4_000_000, 6_000_000), bin_ms=100),
             LinkSchedule("b", "c", (3_000_000, 5_000_000), bin_ms=100, loop=True, offset_s=0.1)]

    def in_kernel(src: str, dst: str) -> int:
        minor = next(r["minor"] for r in state["plans"][src]["rules"] if r["dest"] == dst)
        return host.shaping(src)["kernel"]["classes"][f"1:{minor:x}"]["rate_bps"]

    clock = ScheduleClock(links, nodes, start=time.monotonic() + 0.05)
    try:
        clock.tick(0.0)  # by hand first: the bins of 0 s
        assert (in_kernel("a", "b"), in_kernel("b", "c")) == (2_000_000, 5_000_000)
        clock.tick(0.1)
        assert (in_kernel("a", "b"), in_kernel("b", "c")) == (4_000_000, 3_000_000)
        clock.applied = [-1, -1]
        clock.rows.clear()
        clock.begin()
        time.sleep(0.6)
    finally:
        last = clock.stop()
    assert last[("a", "b")] == 2 and last[("b", "c")] in (0, 1)  # what the caller stores as the plans' rates
    assert in_kernel("a", "b") == 6_000_000  # held at its last bin (no loop)
    skews = sorted(r["skew_ms"] for r in clock.rows)
    assert len(clock.rows) >= 4 and all(r["outcome"] == "applied" for r in clock.rows), clock.rows
    report(request, "schedule clock median skew ms", skews[len(skews) // 2])
    report(request, "schedule clock max skew ms", skews[-1])
    assert skews[len(skews) // 2] < 50  # a loaded test host: the bench measures the target


def test_a_run_hands_its_traces_to_the_hosts_clock_and_a_constant_rate_ends_one(three):
    """TraceReplay's default: the host's clock ticks the links (no set_rates per tick); ``end``
    (a live /update/tc) stops one there and the constant rate set after it stays."""
    host, ips = three
    seen: list[tuple[dict, float]] = []
    replayer = TraceReplay(host, progress=lambda _: None, on_change=lambda r, t: seen.append((r, t)))
    replayer.add([TracedLink("a", "b", replay([2, 6] * 20)), TracedLink("b", "c", replay([6, 2] * 20))])
    try:
        replayer.start()
        assert set(replayer.handed) == {("a", "b"), ("b", "c")} and not replayer.links
        assert host.schedule.clock is not None
        time.sleep(0.55)
        assert replayer.end([("a", "b")]) == [("a", "b")]
        host.set_links(links(("a", "b", ips["b"], 3 * 10**6)), merge=True)
        time.sleep(0.4)
        assert kernel_rate_bps(host, "a", "b") == 3 * 10**6  # not overwritten by a later bin
    finally:
        replayer.stop()
    assert host.schedule.clock is None
    assert replayer.rows and replayer.rows[0]["planned_s"] == 0.0
    assert all(r["outcome"] == "applied" for r in replayer.rows)
    assert seen and seen[0][0] == {("a", "b"): 2 * 10**6, ("b", "c"): 6 * 10**6}
    last = replayer.rows[-1]["planned_s"]
    assert kernel_rate_bps(host, "b", "c") == replay([6, 2] * 20).rate_at(last + 1e-6)  # plan stored at stop
    assert host.schedule_stop()["running"] is False  # (as after an agent restart: no clock)


def test_a_constant_rate_on_one_of_a_node_s_traced_links_leaves_the_other_ticking(three):
    """b's two links are traced; a live change of b->c ends its trace there and verifies b's
    shaping with b->a at its current bin (not its plan's first rate): nothing is removed."""
    host, ips = three
    replayer = TraceReplay(host, progress=lambda _: None)
    replayer.add([TracedLink("b", "c", replay([2, 6] * 20)), TracedLink("b", "a", replay([1, 5] * 20))])
    try:
        replayer.start()
        time.sleep(0.35)  # (b->a at a bin other than its first: the plan's rate is 1 Mbit/s)
        assert replayer.end([("b", "c")]) == [("b", "c")]
        host.set_links(links(("b", "c", ips["c"], 3 * 10**6)), merge=True)
        assert kernel_rate_bps(host, "b", "c") == 3 * 10**6  # (verified: kernel_rate_bps asserts it)
        assert host.schedule.ticked("b") == frozenset({"a"})
        time.sleep(0.3)
        assert kernel_rate_bps(host, "b", "a") in (10**6, 5 * 10**6)  # still shaped, still ticked
    finally:
        replayer.stop()
    assert all(r["outcome"] == "applied" for r in replayer.rows), [r for r in replayer.rows if r["outcome"] != "applied"]


def test_a_schedule_is_refused_whole_before_anything_runs(three):
    from worker.api.errors import ConfigError

    host, _ = three
    good = {"src": "a", "dst": "b", "rates_bps": [10**6, 2 * 10**6], "bin_ms": 100}
    other = {**good, "src": "b", "dst": "a"}
    for bad, match in [({**other, "rates_bps": [10**6, -5]}, "at least 8"),
                       ({**other, "bin_ms": 1}, "under 10"),
                       ({**good, "dst": "c"}, "no shaped link a->c"),
                       ({**other, "netem": [[1, 200], [1, 0]]}, "loss_pct"),
                       ({**other, "evil": 1}, "unknown fields"),
                       (good, "listed twice")]:
        with pytest.raises(ConfigError, match=match):
            host.schedule_start({"version": 1, "start_wall_s": time.time(), "links": [good, bad]})
        assert host.schedule.clock is None
    with pytest.raises(ConfigError, match="clocks synchronised"):
        host.schedule_start({"version": 1, "start_wall_s": time.time() + 3600, "links": [good]})
    host.schedule_start({"version": 1, "start_wall_s": time.time(), "links": [good]})
    host.reset()  # stops the clock too
    assert host.schedule.clock is None


def test_a_bulk_flow_is_back_with_the_trace_right_after_a_bin_of_nothing_delivered(host, request):
    """A 64 KB segment sent at a floor of 8 kbit/s was a minute of HTB debt that a later, higher
    rate did not pay sooner: the flow sent nothing for the rest of the run. Nodes of a replay are
    handed one frame at a time, and the floor lets one packet leave a bin."""
    need_iperf3()
    replayed = {"gso_max_bytes": REPLAY_GSO_MAX_BYTES}
    created = host.create_nodes(nodes_body({"name": "a", **replayed}, {"name": "b", **replayed}, "c"))["nodes"]
    ips = {n["name"]: n["ip"] for n in created}
    assert [gso_max_size(n["netns"]) for n in created] == [REPLAY_GSO_MAX_BYTES] * 2 + [65_536]
    assert [n["gso_max_bytes"] for n in host.status()["nodes"]] == [REPLAY_GSO_MAX_BYTES] * 2 + [None]
    host.set_links(links(("b", "a", ips["a"], 8 * 10**6)))
    iperf_server(host, "b")
    trace = replay([8] * 20 + [0] * 10 + [8] * 60)  # b -> a: 2 s at 8 Mbit/s, 1 s of nothing, 6 s at 8 again
    replayer = TraceReplay(host, progress=lambda _: None)
    replayer.add([TracedLink("b", "a", trace)])
    replayer.start()
    shift = time.monotonic() - replayer.t0
    flow = host.start_process("a", {"version": 1, "argv": ["iperf3", "-c", ips["b"], "-p", str(IPERF_PORT), "-t",
                                                            "7", "-i", "0.5", "-R", "-J"]})
    try:
        wait_for(lambda: not any(p["running"] for p in host.processes()["processes"] if p["id"] == flow["id"]),
                 timeout_s=30, what="the flow's end")
    finally:
        replayer.stop()
    with open(flow["log"]) as f:
        doc = iperf_json(f.read())
    after_gap = [i["sum"]["bits_per_second"] for i in doc["intervals"] if i["sum"]["start"] + shift >= 3.5]
    report(request, "goodput_after_gap_mbit", float(np.median(after_gap)) / 1e6)
    assert len(after_gap) >= 5 and min(after_gap) > 4e6, after_gap  # (8 Mbit/s from 3.0 s; was 0 to the end)
    host.reset()

"""Delay, jitter and netem loss of links, measured on Debian's stock kernel (it has sch_netem):
round-trip times and losses of UDP probes, TCP goodput with a delay, a queue that holds the
bandwidth-delay product, a delay and a loss changed in place by scenario events, and the read-back."""
import json
import os
import statistics
import sys
import time

import pytest

from controller.model.scenario import resolve
from controller.model.topology import Topology
from controller.run.scenario_runner import ScenarioRunner
from tests.netns.conftest import (IPERF_PORT, goodput_bps, iperf_json, iperf_server, links, need_iperf3,
                                  nodes_body, report)
from worker.api.shape import Shape
from worker.shaping.plan import netem_limit_pkts

MBIT = 10**6
# run as ``python -c``: a node's uid may not reach the checkout (one under /root, mode 0700)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "udp_probe.py")) as _f:
    PROBE_CODE = _f.read()
PROBE_PORT = 7007
TCP_PAYLOAD_SHARE = 1448 / 1514  # a full TCP segment's payload (with timestamps) in its Ethernet frame


def shaped(src: str, dst: str, ip: str, **shape) -> dict:
    return {"src": src, "dst": dst, "dst_ip": ip, "shape": {"rate_bps": 10 * MBIT, **shape}}


def probe(host, src: str, ip: str, count: int, interval_s: float) -> dict:
    out = host.exec(src, {"version": 1, "timeout_s": count * interval_s + 60,
                          "argv": [sys.executable, "-c", PROBE_CODE, "probe", ip, str(PROBE_PORT), str(count),
                                   str(interval_s)]})
    assert out["returncode"] == 0, out
    return json.loads(out["stdout"])


@pytest.fixture
def pair(host):
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.start_process("b", {"version": 1, "argv": [sys.executable, "-c", PROBE_CODE, "serve", str(PROBE_PORT)]})
    time.sleep(0.5)
    return host, a["ip"], b["ip"]


def leaf_of(host, node: str, dest: str) -> dict:
    shaping = host.shaping(node)
    assert shaping["verified"] is True, shaping["mismatches"]
    minor = next(r["minor"] for r in shaping["plan"]["rules"] if r["dest"] == dest)
    return shaping["kernel"]["leaves"][f"1:{minor:x}"]


def _logged(path: str, word: str) -> bool:
    with open(path) as f:
        return word in f.read()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[1], q[2]


def test_delay_and_jitter_give_the_round_trip_and_its_spread(pair, request):
    host, ip_a, ip_b = pair
    # base: the round trip through netem's timers at 1 ms each way, less those 2 ms (the emulated
    # guest's timers fire a little late; that lateness is part of every delayed round trip)
    host.set_links({"version": 1, "links": [shaped("a", "b", ip_b, delay_ms=1.0), shaped("b", "a", ip_a, delay_ms=1.0)]})
    base = probe(host, "a", ip_b, 100, 0.01)
    assert len(base["rtts_ms"]) == 100, base
    base_ms = statistics.median(base["rtts_ms"]) - 2.0
    # a->b 50 ms +- 5 ms (uniform), b->a 50 ms, changed in place: a round trip of 100 ms + base
    result = host.set_links({"version": 1, "links": [shaped("a", "b", ip_b, delay_ms=50.0, jitter_ms=5.0),
                                                     shaped("b", "a", ip_a, delay_ms=50.0)]}, merge=True)
    assert all(n["verified"] for n in result["nodes"]), result
    leaf = leaf_of(host, "a", "b")
    assert leaf["kind"] == "netem" and leaf["delay_us"] == 50_000 and leaf["jitter_us"] == 5_000, leaf
    assert leaf["limit"] == netem_limit_pkts(Shape(10 * MBIT, delay_ms=50.0, jitter_ms=5.0)), leaf
    got = probe(host, "a", ip_b, 400, 0.01)
    rtts = got["rtts_ms"]
    assert len(rtts) == 400, f"{400 - len(rtts)} probes lost without any loss set"
    median = statistics.median(rtts)
    deciles = statistics.quantiles(rtts, n=10)
    jitter_ms = (deciles[-1] - deciles[0]) / 1.6  # uniform over +-J: the middle 80 % span 1.6 J
    report(request, "base RTT ms", base_ms)
    report(request, "RTT median ms", median)
    report(request, "jitter from the RTT deciles ms", jitter_ms)
    # (the base's timers are late by more than a delayed round trip's on a loaded emulated guest)
    assert 99 <= median <= 100 + base_ms + 2, f"RTT median {median:.2f} ms, expected 100 ms + up to {base_ms:.2f} ms"
    assert abs(jitter_ms - 5.0) <= 1.0, f"RTT spread gives a jitter of {jitter_ms:.2f} ms, expected 5 ms (+-20 %)"


def test_netem_loss_drops_its_share(pair, request):
    host, ip_a, ip_b = pair
    host.set_links({"version": 1, "links": [shaped("a", "b", ip_b, loss_pct=10.0), shaped("b", "a", ip_a)]})
    assert leaf_of(host, "a", "b")["loss_pct"] == pytest.approx(10.0, abs=1e-4)
    got = probe(host, "a", ip_b, 1500, 0.003)
    lost_pct = 100 * (1 - len(got["rtts_ms"]) / got["sent"])
    report(request, "lost percent at 10 %", lost_pct)
    assert 7.0 <= lost_pct <= 13.0, f"{lost_pct:.1f} % of the probes lost with netem loss 10 %"


def test_goodput_keeps_the_rate_with_a_delay(host, request):
    need_iperf3()
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links({"version": 1, "links": [shaped("a", "b", b["ip"], delay_ms=20.0),
                                            shaped("b", "a", a["ip"], delay_ms=20.0)]})
    iperf_server(host, "b")
    ratio = goodput_bps(host, "a", b["ip"], seconds=5) / (10 * MBIT * TCP_PAYLOAD_SHARE)
    report(request, "goodput ratio to the payload rate at 10 Mbit/s, 40 ms round trip", ratio)
    # (a queue short of the bandwidth-delay product loses far more; a loaded emulated guest up to 13 %)
    assert 0.85 <= ratio <= 1.03, f"goodput {ratio:.3f} of the 10 Mbit/s rate's payload with 20 ms each way"


def test_the_netem_queue_holds_the_bandwidth_delay_product(host, request):
    """At 10 Mbit/s, 1.5 s of delay holds about 1,250 full-size packets: more than a queue of
    1,000, so a netem limit of the queue alone would drop a flow below the rate."""
    need_iperf3()
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links({"version": 1, "links": [shaped("a", "b", b["ip"], delay_ms=1500.0), shaped("b", "a", a["ip"])]})
    iperf_server(host, "b")
    out = host.exec("a", {"version": 1, "timeout_s": 40, "argv": [
        "iperf3", "-c", b["ip"], "-p", str(IPERF_PORT), "-u", "-b", "9M", "-l", "1400", "-t", "4", "-J"]})
    doc = iperf_json(out["stdout"])
    lost = float(doc["end"]["sum"]["lost_percent"])
    report(request, "UDP lost percent at 9 of 10 Mbit/s through 1.5 s", lost)
    assert lost < 1.0, f"{lost:.1f} % of a 9 Mbit/s UDP flow lost on a 10 Mbit/s link with 1.5 s delay"


def test_a_scenario_event_changes_the_delay_in_place_without_loss(pair, request):
    host, ip_a, ip_b = pair
    host.set_links({"version": 1, "links": [shaped("a", "b", ip_b, delay_ms=50.0),
                                            shaped("b", "a", ip_a, delay_ms=50.0)]})
    root_before = host.shaping("a")["kernel"]["root"]
    topo = Topology()
    topo.add_node("a")
    topo.add_node("b")
    topo.add_symmetric_link("a", "b", "10mbit", delay="50ms")
    timeline = resolve({"events": [{"at": 1.5, "link": {"src": "a", "dst": "b", "bw": "10mbit", "delay": "10ms",
                                                        "both_ways": True}}]}, topo)
    runner = ScenarioRunner(timeline, host, {"a": ip_a, "b": ip_b}, progress=lambda _: None)
    proc = host.start_process("a", {"version": 1, "argv": [sys.executable, "-c", PROBE_CODE, "probe", ip_b,
                                                           str(PROBE_PORT), "400", "0.01"]})
    deadline = time.monotonic() + 30
    while not _logged(proc["log"], "probing"):
        assert time.monotonic() < deadline, "the prober did not start"
        time.sleep(0.02)
    runner.start()
    assert runner.wait(20) and all(r["outcome"] == "applied" for r in runner.rows), runner.rows
    deadline = time.monotonic() + 60
    while {p["id"]: p for p in host.processes()["processes"]}[proc["id"]]["running"]:
        assert time.monotonic() < deadline, "the prober did not end"
        time.sleep(0.2)
    with open(proc["log"]) as f:
        got = json.loads(f.read().strip().splitlines()[-1])
    rtts = got["rtts_ms"]
    assert len(rtts) == 400, f"{400 - len(rtts)} probes lost while the delay changed"
    # (the emulated guest may apply the two directions late and apart: probes are judged by when
    # they ran, on the clock the runner and the prober share)
    first_s = runner.t0 + min(r["planned_s"] for r in runner.rows)  # (no direction changes before it is due)
    last_s = runner.t0 + max(r["applied_s"] for r in runner.rows)
    report(request, "the event applied s after it was due", max(r["skew_ms"] for r in runner.rows) / 1000)
    before = [rtt for rtt, sent in zip(rtts, got["sent_s"]) if sent + rtt / 1000 < first_s]
    after = [rtt for rtt, sent in zip(rtts, got["sent_s"]) if sent > last_s + 0.05]
    assert len(before) >= 30 and len(after) >= 30, (len(before), len(after), runner.rows)
    report(request, "RTT before ms", statistics.median(before))
    report(request, "RTT after ms", statistics.median(after))
    assert 99 <= statistics.median(before) <= 110 and 19 <= statistics.median(after) <= 30, \
        (statistics.median(before), statistics.median(after))
    leaf = leaf_of(host, "a", "b")
    assert leaf["delay_us"] == 10_000, leaf
    assert host.shaping("a")["kernel"]["root"] == root_before
    # a link event's netem loss, on the topology's delay
    lossy = resolve({"events": [{"at": 0, "link": {"src": "a", "dst": "b", "bw": "10mbit", "loss": "5%"}}]}, topo)
    runner = ScenarioRunner(lossy, host, {"a": ip_a, "b": ip_b}, progress=lambda _: None)
    runner.start()
    assert runner.wait(20) and runner.rows[0]["outcome"] == "applied", runner.rows
    leaf = leaf_of(host, "a", "b")
    assert leaf["loss_pct"] == pytest.approx(5.0, abs=1e-4) and leaf["delay_us"] == 50_000, leaf

"""Scenario changes made real: drops by iptables in the source's namespace, partitions that heal
with the shaping as it was, pause and resume by the freezer, crash and restart, ON/OFF flows,
and a timed bandwidth change measured by iperf3."""
from __future__ import annotations

import os
import sys
import time

import pytest

from controller.model.scenario import resolve
from controller.model.topology import Topology
from controller.run.scenario_runner import ScenarioRunner
from tests.netns.conftest import (IPERF_PORT, NETNS, iperf_json, iperf_server, links, need_iperf3, nodes_body,
                                  report)
from worker.api.errors import TestbedTimeout

pytestmark = NETNS


@pytest.fixture
def pair(host):
    created = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    ips = {n["name"]: n["ip"] for n in created}
    yield host, ips
    host.reset()
    assert host.faults.leftovers() == []


CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"


def ping_ok(host, src: str, ip: str) -> bool:
    """A TCP connection from ``src`` to the iperf3 server at ``ip`` opens within a second."""
    out = host.exec(src, {"version": 1, "argv": [sys.executable, "-c", CONNECT, ip, str(IPERF_PORT)],
                          "timeout_s": 10})
    return out["returncode"] == 0


def topology_of(ips: dict[str, str], rate: str = "20mbit") -> Topology:
    topo = Topology()
    for name in ips:
        topo.add_node(name)
    for a in ips:
        for b in ips:
            if a != b:
                topo.add_link(a, b, rate)
    return topo


def test_loss_drops_its_share_of_a_udp_flow(pair, request):
    need_iperf3()
    host, ips = pair
    topo = topology_of(ips)
    runner = ScenarioRunner(resolve({"events": [{"at": 0, "loss": {"src": "a", "dst": "b", "percent": 10}}]}, topo),
                            host, ips, progress=lambda _: None)
    runner.start()
    assert runner.wait(10) and runner.rows[0]["outcome"] == "applied"
    assert len(host.faults.rules("b")) == 1 and host.faults.rules("a") == []  # where packets from a arrive
    iperf_server(host, "b")
    doc: dict = {}
    for attempt in range(3):  # iperf3 (3.12) waits for ever, or ends with an error, when the datagram
        try:                  # opening its UDP stream is the one lost
            out = host.exec("a", {"version": 1, "argv": ["iperf3", "-c", ips["b"], "-p", str(IPERF_PORT), "-u",
                                                         "-b", "4M", "-l", "500", "-t", "4", "-J"], "timeout_s": 15})
            doc = iperf_json(out["stdout"])
            if "sum" in doc.get("end", {}):
                break
        except TestbedTimeout:
            if attempt == 2:
                raise
    assert "sum" in doc.get("end", {}), doc.get("error", doc)
    lost = float(doc["end"]["sum"]["lost_percent"])
    report(request, "udp_lost_percent", lost)
    assert 8.0 <= lost <= 12.0, lost
    host.fault({"version": 1, "faults": [{"kind": "undrop", "node": "b", "key": "e0"}]})
    assert host.faults.rules("b") == []


def test_partition_blocks_both_ways_and_heals_with_shaping_as_it_was(pair):
    host, ips = pair
    host.set_links(links(("a", "b", ips["b"], 8_000_000), ("b", "a", ips["a"], 4_000_000),
                         ("a", "c", ips["c"], 2_000_000)))
    before = {n: host.shaping(n)["kernel"] for n in ("a", "b")}
    for n in ips:
        iperf_server(host, n)
    assert ping_ok(host, "a", ips["b"]) and ping_ok(host, "b", ips["a"])
    topo = topology_of(ips)
    timeline = resolve({"events": [{"at": 0, "partition": [["a"], ["b", "c"]], "for": 4}]}, topo)
    runner = ScenarioRunner(timeline, host, ips, progress=lambda _: None)
    runner.start()
    while not runner.rows:
        time.sleep(0.02)
    assert not ping_ok(host, "a", ips["b"]) and not ping_ok(host, "b", ips["a"])
    assert not ping_ok(host, "c", ips["a"])
    assert ping_ok(host, "b", ips["c"])  # inside one group, traffic goes on
    runner.wait(10)
    assert ping_ok(host, "a", ips["b"]) and ping_ok(host, "b", ips["a"]) and ping_ok(host, "c", ips["a"])
    for n in ("a", "b"):
        shaping = host.shaping(n)
        assert shaping["verified"] and shaping["mismatches"] == []
        assert shaping["kernel"] == before[n]
    assert [r["outcome"] for r in runner.rows] == ["applied", "applied"]


def test_pause_freezes_and_resume_thaws(pair):
    host, ips = pair
    proc = host.start_process("a", {"version": 1, "argv": ["sleep", "60"]})
    host.fault({"version": 1, "faults": [{"kind": "freeze", "node": "a"}]})
    deadline = time.monotonic() + 5
    while _state(proc["pid"]) != "D" and _state(proc["pid"]) not in ("T",) and time.monotonic() < deadline:
        if host.faults.frozen("a") and _frozen_state(host, "a") == "FROZEN":
            break
        time.sleep(0.05)
    assert _frozen_state(host, "a") == "FROZEN"
    with open(os.path.join(host.faults.freezer_dir("a")[0], "cgroup.procs")) as f:
        assert str(proc["pid"]) in f.read().split()
    host.fault({"version": 1, "faults": [{"kind": "thaw", "node": "a"}]})
    assert _frozen_state(host, "a") == "THAWED"
    host.fault({"version": 1, "faults": [{"kind": "kill", "node": "a"}]})
    time.sleep(0.2)
    assert not host.processes()["processes"][0]["running"]
    restarted = host.fault({"version": 1, "faults": [{"kind": "restart", "node": "a"}]})["results"][0]["started"]
    assert len(restarted) == 1
    procs = host.processes()["processes"]
    assert [p["running"] for p in procs] == [True] and procs[0]["argv"] == ["sleep", "60"]


def test_prepared_pause_and_limits_move_processes_once_ahead(pair):
    host, _ = pair
    proc = host.start_process("a", {"version": 1, "argv": ["sleep", "60"]})
    freezer = os.path.join(host.faults.freezer_dir("a")[0], "cgroup.procs")
    own = host.runtime.cgroups.freezer_dir("a") == host.faults.freezer_dir("a")[0]  # it started in it
    done = host.fault({"version": 1, "faults": [{"kind": "prepare", "node": "a", "for": "freeze"}]})["results"][0]
    assert done["moved"] == (0 if own else 1)
    with open(freezer) as f:
        assert str(proc["pid"]) in f.read().split()
    assert _frozen_state(host, "a") == "THAWED"  # ready, not paused
    again = host.fault({"version": 1, "faults": [{"kind": "prepare", "node": "a", "for": "freeze"}]})["results"][0]
    assert again["moved"] == 0  # a member is never written again
    host.fault({"version": 1, "faults": [{"kind": "freeze", "node": "a"}]})
    assert _frozen_state(host, "a") == "FROZEN"
    host.fault({"version": 1, "faults": [{"kind": "thaw", "node": "a"}]})
    host.fault({"version": 1, "faults": [{"kind": "prepare", "node": "a", "for": "limits"}]})
    for procs in host.runtime.cgroups.procs_files("a"):
        with open(procs) as f:
            assert str(proc["pid"]) in f.read().split()
    host.fault({"version": 1, "faults": [{"kind": "limits", "node": "a", "cpu": 0.5}]})
    assert host.store.read()["nodes"]["a"]["cpu"] == 0.5


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _frozen_state(host, node: str) -> str:
    """FROZEN or THAWED (v1's words; on v2 read from cgroup.events, waiting out a freeze in progress)."""
    path, version = host.faults.freezer_dir(node)
    if version == 1:
        with open(os.path.join(path, "freezer.state")) as f:
            return f.read().strip()
    deadline = time.monotonic() + 5
    while True:
        with open(os.path.join(path, "cgroup.freeze")) as f:
            wanted = f.read().strip() == "1"
        with open(os.path.join(path, "cgroup.events")) as f:
            frozen = dict(line.split() for line in f.read().splitlines())["frozen"] == "1"
        if frozen == wanted or time.monotonic() > deadline:
            return "FROZEN" if frozen else "THAWED"
        time.sleep(0.05)


def test_on_off_background_flow_shows_in_its_intervals(pair, request):
    need_iperf3()
    host, ips = pair
    topo = topology_of(ips)
    timeline = resolve({"events": [{"at": 0, "background": {"src": "a", "dst": "b", "rate": "4mbit", "on_s": 1,
                                                             "off_s": 1, "for": 5}}]}, topo)
    runner = ScenarioRunner(timeline, host, ips, progress=lambda _: None)
    runner.start()
    runner.wait(10)
    flow = runner.wait_flows(30)["e0"]
    samples = flow["samples"]
    starts = sorted({round(r["start_s"]) for r in flow["runs"]})
    report(request, "on_periods", len(flow["runs"]))
    assert len(flow["runs"]) >= 2 and all(r["error"] is None for r in flow["runs"]), flow["runs"]
    assert starts[1] - starts[0] >= 2  # on 1 s, then off 1 s
    busy = [s for s in samples if s["bps"] > 0]
    assert busy and all(2e6 < s["bps"] < 8e6 for s in busy if s["seconds"] > 0.15), busy
    gaps = [b["start_s"] - (a["start_s"] + a["seconds"]) for a, b in zip(samples, samples[1:])]
    assert max(gaps) >= 0.8, gaps  # the OFF period: no interval at all


def test_scheduled_bandwidth_change_halves_goodput_on_time(pair, request):
    need_iperf3()
    host, ips = pair
    host.set_links(links(("a", "b", ips["b"], 8_000_000), ("b", "a", ips["a"], 8_000_000)))
    iperf_server(host, "b")
    topo = topology_of({"a": ips["a"], "b": ips["b"]}, "8mbit")
    # b sends (-R): a's intervals are what a received, so they follow the b->a link's rate at once
    timeline = resolve({"events": [{"at": 3, "link": {"src": "b", "dst": "a", "bw": "4mbit"}}]}, topo)
    flow = host.start_process("a", {"version": 1, "argv": ["iperf3", "-c", ips["b"], "-p", str(IPERF_PORT), "-t",
                                                            "6", "-i", "0.1", "-R", "-J"]})
    runner = ScenarioRunner(timeline, host, ips, progress=lambda _: None)
    runner.start()
    runner.wait(10)
    deadline = time.monotonic() + 20
    while any(p["running"] for p in host.processes()["processes"] if p["id"] == flow["id"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with open(flow["log"]) as f:
        doc = iperf_json(f.read())
    row = runner.rows[0]
    report(request, "skew_ms", row["skew_ms"])
    assert row["outcome"] == "applied" and abs(row["skew_ms"]) < 50
    # where the event fell in the flow's own clock: the flow began just before the runner's start
    t0 = doc["start"]["timestamp"]["timesecs"]
    change_s = runner.t0_wall + row["applied_s"] - t0
    rates = [(i["sum"]["start"], i["sum"]["bits_per_second"]) for i in doc["intervals"]]
    before = [r for t, r in rates if 1.0 <= t < change_s - 0.3]
    after = [r for t, r in rates if change_s + 0.7 <= t < 5.8]
    b, a = sum(before) / len(before), sum(after) / len(after)
    report(request, "before_bps", b)
    report(request, "after_bps", a)
    assert 0.4 <= a / b <= 0.6, (b, a)
    # within 0.2 s of its time: the first interval that starts 0.2 s after the change is at the new rate
    settled = [r for t, r in rates if change_s + 0.2 <= t < change_s + 0.5]
    assert settled and max(settled) < 0.75 * b, (change_s, rates)

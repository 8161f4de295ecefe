"""Captures on demand, for real: tcpdump in a node's namespace, its egress only, snap length 128;
the analysis of what it captured (ON/OFF bursts at 10 ms, throughput at 1 s)."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import time

import dpkt
import numpy as np
import pytest

from controller.results.analysis import AnalysisConfig, analyze
from controller.results.analysis import bursts as B
from controller.results.analysis.pcap import ip_int, read_pcap
from controller.results.analysis.series import bin_edges, event_bins, throughput_bps
from tests.netns.conftest import (NETNS, iperf_json, iperf_server, links, need_iperf3, need_tools, nodes_body,
                                  report)
from tests.netns.test_agent_http import agent  # noqa: F401 - the real agent process, as a fixture

pytestmark = NETNS
MBIT = 10**6

# 1 s sending UDP, 1 s silent, CYCLES times. The shaped link paces the packets: the sender
# keeps LEAD_S of them queued ahead, so a sender descheduled for less than that (a loaded
# machine) leaves no gap on the wire, and it stops when the second's bytes are queued.
ON_OFF_SENDER = """
import socket, sys, time
dst, cycles, rate_bps = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
LEAD_S, FRAME = 0.5, 1000 + 8 + 20 + 14
per_s = rate_bps / 8 / FRAME
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
payload = b"x" * 1000
start = time.monotonic() + 0.2
for c in range(cycles):
    t_on = start + 2.0 * c
    while time.monotonic() < t_on:
        time.sleep(0.001)
    sent, total = 0, int(per_s * 1.0)
    while sent < total:
        due = min(total, int(per_s * (time.monotonic() - t_on + LEAD_S)) + 1)
        while sent < due:
            s.sendto(payload, (dst, 9000))
            sent += 1
        time.sleep(0.002)
"""


def _uid_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))


def _capabilities(pid: int) -> dict:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v, 16) for k, v in (line.split(":") for line in f) if k in ("CapEff", "CapPrm", "CapBnd")}


def _pcap_records(path: str) -> tuple[int, list[bytes]]:
    with open(path, "rb") as f:
        reader = dpkt.pcap.Reader(f)
        return reader.snaplen, [buf for _, buf in reader]


def _exec(host, node, argv, timeout_s=60):
    out = host.exec(node, {"version": 1, "argv": argv, "timeout_s": timeout_s})
    assert out["returncode"] == 0, out
    return out


@pytest.fixture(autouse=True)
def _tcpdump():
    need_tools("tcpdump")


def test_capture_holds_only_the_nodes_egress_cut_at_128_bytes(host, request):
    need_iperf3()
    a, b, c = host.create_nodes(nodes_body("a", "b", "c"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], 20 * MBIT), ("b", "a", a["ip"], 20 * MBIT),
                         ("c", "a", a["ip"], 20 * MBIT), ("a", "c", c["ip"], 20 * MBIT)))
    started = host.start_capture("a", {"version": 1})
    assert started["argv"][-3:] == ["src", "host", a["ip"]] and "-s" in started["argv"]
    assert _uid_of(started["pid"]) == pwd.getpwnam("tcpdump").pw_uid != 0  # never root: CAP_NET_RAW alone
    assert _capabilities(started["pid"]) == {"CapEff": 1 << 13, "CapPrm": 1 << 13, "CapBnd": 1 << 13}
    iperf_server(host, "b")
    iperf_server(host, "a")
    _exec(host, "a", ["iperf3", "-c", b["ip"], "-t", "1", "-J"])
    _exec(host, "c", ["iperf3", "-c", a["ip"], "-t", "1", "-J"])  # c's data is a's ingress, a's ACKs its egress
    stopped = host.stop_capture("a")
    assert stopped["stopped"] and stopped["bytes"] > 0
    path = host.captures.path("a")
    snaplen, records = _pcap_records(path)
    assert snaplen == 128 and records and max(len(r) for r in records) <= 128
    p = read_pcap(path)
    assert set(p.src.tolist()) == {ip_int(a["ip"])}, "a packet not sent by a was captured"
    assert {ip_int(b["ip"]), ip_int(c["ip"])} <= set(p.dst.tolist())  # data to b, ACKs to c
    to_c = p.dst == ip_int(c["ip"])
    # a's second of iperf3 at 20 Mbit/s (segments offloaded: frames of many MTUs), wire lengths kept beyond the snap
    assert p.length[~to_c].sum() >= 0.75 * 20 * MBIT / 8 and (p.length[~to_c] > 128).sum() > 20
    assert p.length[to_c].max() < 1000, "c's data to a (a's ingress) was captured"  # ACKs and control only
    assert abs(p.time_s.mean() - time.time()) < 60, "timestamps are not epoch seconds"
    report(request, "captured packets", len(p))


def test_reset_ends_captures_and_removes_their_files(make_host):
    host = make_host()
    host.create_nodes(nodes_body("a"))
    pid = host.start_capture("a", {"version": 1})["pid"]
    path = host.captures.path("a")
    assert os.path.exists(path)
    host.reset()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    assert not os.path.exists(path) and not host.captures.running()


def test_on_off_sender_gives_one_second_bursts_and_idles(host, request):
    cycles = 5
    rate = 4 * MBIT
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], rate), ("b", "a", a["ip"], rate)))
    host.start_capture("a", {"version": 1})
    _exec(host, "a", [sys.executable, "-c", ON_OFF_SENDER, b["ip"], str(cycles), str(rate)], timeout_s=60)
    time.sleep(0.5)  # what is still queued on the link leaves
    host.stop_capture("a")
    p = read_pcap(host.captures.path("a"))
    udp = p.proto == 17
    t, length = p.time_s[udp], p.length[udp]
    edges = bin_edges(t.min() - 0.5, t.max() + 0.5, 0.010)
    x = throughput_bps(event_bins(t, length, edges), 0.010)
    th = B.choose_threshold(x, 0.01 * rate, "floor: 1% of the link rate")
    found = B.detect(x, 0.010, th)
    row = found.row()
    report(request, "bursts", row["bursts"])
    report(request, "burst_s", row["burst_s"])
    report(request, "idle_s", row["idle_s"])
    assert th.rule == "2-means midpoint" and row["bursts"] == cycles, (th, found.burst_bins, found.idle_bins)
    # within 2 bins of 1 s: a loaded host's shaper timers fire a little late (102 bins seen in CI)
    assert all(abs(n * 0.010 - 1.0) <= 0.020 + 1e-9 for n in found.burst_bins), found.burst_bins
    assert all(abs(n * 0.010 - 1.0) <= 0.020 + 1e-9 for n in found.idle_bins), found.idle_bins
    assert len(found.idle_bins) == cycles - 1


def test_iperf3_at_a_shaped_rate_shows_that_rate_in_throughput_1s(host, request, tmp_path):
    need_iperf3()
    rate = 10 * MBIT
    a, b = host.create_nodes(nodes_body("a", "b"))["nodes"]
    host.set_links(links(("a", "b", b["ip"], rate), ("b", "a", a["ip"], rate)))
    iperf_server(host, "b")
    t0 = time.time()
    host.start_capture("a", {"version": 1})
    time.sleep(1.5)
    started = time.time()
    out = _exec(host, "a", ["iperf3", "-c", b["ip"], "-t", "4", "-J"])
    ended = time.time()
    assert iperf_json(out["stdout"])["end"]["sum_sent"]["bytes"] > 0
    time.sleep(2.5)
    host.stop_capture("a")
    run = tmp_path / "run"
    (run / "telemetry" / "pcap").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "iperf", "started_at": t0, "ended_at": time.time()}))
    (run / "topology.json").write_text(json.dumps({
        "nodes": [{"name": "a", "ip": a["ip"]}, {"name": "b", "ip": b["ip"]}],
        "links": [{"src": "a", "dst": "b", "rate_bps": rate}, {"src": "b", "dst": "a", "rate_bps": rate}]}))
    shutil.copy(host.captures.path("a"), run / "telemetry" / "pcap" / "a.pcap")
    summary = analyze(str(run), AnalysisConfig(plots=False))
    assert "rounds (events/ or metrics.csv)" in summary["missing"]
    lines = (run / "analysis" / "throughput_1s.csv").read_text().splitlines()
    header = lines[0].split(",")
    rows = np.array([[float(v) for v in line.split(",")] for line in lines[1:]])
    col = rows[:, header.index("a->b")]
    at = rows[:, 0] + t0  # epoch start of each 1 s bin
    inside = (at >= started + 1) & (at + 1 <= ended - 0.2)  # whole seconds of the transfer, slow start left out
    before = at + 1 <= started
    after = at >= ended + 0.1
    ratio = col[inside].mean() / rate
    report(request, "throughput_1s / rate", ratio)
    assert inside.sum() >= 2 and abs(ratio - 1) <= 0.05, (ratio, col)
    assert before.any() and after.any()
    assert col[before].max() < 0.01 * rate and col[after].max() < 0.01 * rate, col


SEND_UDP = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    s.sendto(b"y" * 500, (sys.argv[1], 9000))
"""


def test_tcpdump_dies_with_the_agent_even_on_kill_9(agent):
    agent.client.create_nodes(nodes_body("a"))
    pid = agent.client.start_capture("a", {"version": 1})["pid"]
    assert _uid_of(pid) != 0
    agent.proc.kill()
    agent.proc.wait(timeout=10)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{pid}"), "tcpdump outlived the agent that started it"


def test_a_remote_agent_streams_its_capture_back(agent, tmp_path):
    from worker.api.errors import ConfigError, NotFound

    client = agent.client
    a, b = client.create_nodes(nodes_body("a", "b"))["nodes"]
    client.set_links(links(("a", "b", b["ip"], 20 * MBIT)))
    client.start_capture("a", {"version": 1})
    out = client.exec("a", {"version": 1, "argv": [sys.executable, "-c", SEND_UDP, b["ip"], "200"], "timeout_s": 30})
    assert out["returncode"] == 0, out
    time.sleep(0.2)
    assert client.stop_capture("a")["stopped"]
    streamed = b"".join(client.capture_chunks("a"))
    on_disk = tmp_path / "state" / agent.testbed_id / "capture" / "a.pcap"
    assert streamed == on_disk.read_bytes()
    copy = tmp_path / "a.pcap"
    copy.write_bytes(streamed)
    p = read_pcap(str(copy))
    assert ((p.proto == 17) & (p.dst == ip_int(b["ip"]))).sum() == 200
    assert client.remove_capture("a")["removed"] == 2 and not on_disk.exists()
    with pytest.raises(NotFound):
        client.capture_chunks("a")  # removed
    with pytest.raises(NotFound):
        client.capture_chunks("b")  # never captured
    with pytest.raises(ConfigError):
        client.capture_chunks("../token")

"""Docker nodes: shaped goodput and CPU quota, measured."""
from __future__ import annotations

import os
import time

from tests.docker.conftest import DOCKER
from tests.netns.conftest import goodput_bps, iperf_server, links, report

pytestmark = DOCKER


def test_goodput_through_shaped_container_links(host, request):
    made = host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    ip = {n["name"]: n["ip"] for n in made}
    rates = {("a", "b"): 20_000_000, ("b", "a"): 8_000_000}
    result = host.set_links(links(*[(s, d, ip[d], r) for (s, d), r in rates.items()]))
    assert all(n["verified"] for n in result["nodes"])
    assert host.shaping("a")["verified"] and host.shaping("b")["verified"]
    iperf_server(host, "b")
    forward = goodput_bps(host, "a", ip["b"], seconds=4)
    backward = goodput_bps(host, "a", ip["b"], seconds=4, reverse=True)  # b sends: its own shaping
    report(request, "a_to_b_ratio", forward / rates[("a", "b")])
    report(request, "b_to_a_ratio", backward / rates[("b", "a")])
    assert 0.93 <= forward / rates[("a", "b")] <= 1.03, forward
    assert 0.93 <= backward / rates[("b", "a")] <= 1.03, backward


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_cpu_quota_holds_a_busy_loop(host, request):
    host.create_nodes({"version": 1, "nodes": [{"name": "slow", "cpu": 0.2}, {"name": "free"}]})
    loop = {"version": 1, "argv": ["python3", "-c", "while True: pass"]}
    procs = {name: host.start_process(name, loop) for name in ("slow", "free")}
    hz = os.sysconf("SC_CLK_TCK")
    time.sleep(0.5)
    t0, c0 = time.monotonic(), {n: _cpu_ticks(p["pid"]) for n, p in procs.items()}
    time.sleep(4)
    elapsed = time.monotonic() - t0
    share = {n: (_cpu_ticks(p["pid"]) - c0[n]) / hz / elapsed for n, p in procs.items()}
    for name, p in procs.items():
        host.stop_process(name, p["id"])
    report(request, "cpu_share_limited", share["slow"])
    report(request, "cpu_share_unlimited", share["free"])
    assert 0.16 <= share["slow"] <= 0.24, f"a busy loop in a cpu=0.2 container used {share['slow']:.3f} of a core"
    # the same loop in a container without a limit gets clearly more (the measurement can fail both ways;
    # on an idle 2-core machine it gets a whole core, with other work running about its fair share)
    assert share["free"] >= 0.3, f"a busy loop in an unlimited container used only {share['free']:.3f} of a core"

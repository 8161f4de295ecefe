"""Benchmark of the scenario engine: how late events are applied (skew = applied - planned).

Run as root: ``.venv/bin/python bench/bench_scenario.py [--nodes 100] [--events 100] [--no-agent]``.
Prints Markdown tables on stdout (progress on stderr).

100 nodes on one host (a ring of shaped links, a ``sleep`` in every node), then a seeded
timeline of 100 events spread over them, one every 50 ms: bandwidth changes of random
links (netlink, in place), pauses and resumes (cgroup freezer), CPU limit changes (cgroup
writes) and crashes with restarts (SIGKILL, then the process started again). A second
timeline of link-down/up events (iptables in both nodes) is measured apart: it runs
``iptables-restore`` processes. The same timeline again through a real agent on loopback
(``--no-agent`` skips it). ``applied_s`` is when the worker confirmed the change, so the
skew includes the change itself. Targets (one host): median <= 5 ms, p99 <= 20 ms.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_agent import deploy, loopback_agent, percentile  # noqa: E402
from bench_netns import BenchError, log, scratch_host, table  # noqa: E402

from controller.model.scenario import resolve  # noqa: E402
from controller.model.topology import Topology  # noqa: E402
from controller.run.scenario_runner import ScenarioRunner  # noqa: E402

SEED = 20261123
TARGET_MEDIAN_MS = 5.0
TARGET_P99_MS = 20.0
SPACING_S = 0.05
START_S = 0.5


def ring(n: int) -> Topology:
    topo = Topology()
    for i in range(n):
        topo.add_node(f"n{i}")
    for i in range(n):
        a, b = f"n{i}", f"n{(i + 1) % n}"
        topo.add_link(a, b, "20mbit")
        topo.add_link(b, a, "20mbit")
    return topo


def node_events(n: int, count: int) -> list[dict[str, Any]]:
    """A seeded mix of link and node events, one every SPACING_S, over ``n`` nodes."""
    rng = random.Random(SEED)
    events: list[dict[str, Any]] = []
    paused: list[str] = []
    crashed: list[str] = []
    for k in range(count):
        at = round(START_S + k * SPACING_S, 3)
        choice = k % 4
        if choice == 0:
            i = rng.randrange(n)
            events.append({"at": at, "link": {"src": f"n{i}", "dst": f"n{(i + 1) % n}",
                                              "bw": f"{rng.randint(1, 20)}mbit"}})
        elif choice == 1:
            if paused and rng.random() < 0.5:
                events.append({"at": at, "resume": paused.pop()})
            else:
                node = f"n{rng.randrange(n)}"
                paused.append(node)
                events.append({"at": at, "pause": node})
        elif choice == 2:
            events.append({"at": at, "cpu": {"node": f"n{rng.randrange(n)}", "cores": rng.choice([0.2, 0.5, 1.0])}})
        else:
            if crashed and rng.random() < 0.5:
                node = crashed.pop()
                events.append({"at": at, "revocation": {"nodes": [node], "lifetime": {"at": [0]},
                                                        "replace_after_s": {"fixed": 0}}})
            else:
                node = f"n{rng.randrange(n)}"
                crashed.append(node)
                events.append({"at": at, "crash": node})
    return events


def filter_events(n: int, count: int) -> list[dict[str, Any]]:
    rng = random.Random(SEED + 1)
    events = []
    for k in range(count):
        i = rng.randrange(n)
        events.append({"at": round(START_S + k * 2 * SPACING_S, 3), "link_down": [f"n{i}", f"n{(i + 1) % n}"],
                       "for": SPACING_S})
    return events


def play(worker: Any, ips: dict[str, str], topo: Topology, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    timeline = resolve({"seed": SEED, "events": events}, topo)
    runner = ScenarioRunner(timeline, worker, ips, progress=lambda _: None)
    runner.start()
    if not runner.wait(120):
        runner.stop()
        raise BenchError("the timeline did not finish within 120 s")
    runner.stop()
    failed = [r for r in runner.rows if r["outcome"].startswith("failed")]
    if failed:
        raise BenchError(f"{len(failed)} steps failed, first: {failed[0]}")
    return runner.rows


def summarize(label: str, rows: list[dict[str, Any]]) -> list[list[Any]]:
    out = []
    kinds = sorted({r["event"] for r in rows})
    for kind in ["all", *kinds]:
        skews = [r["skew_ms"] for r in rows if kind == "all" or r["event"] == kind]
        out.append([label, kind, len(skews), f"{statistics.median(skews):.2f}", f"{percentile(skews, 0.99):.2f}",
                    f"{max(skews):.2f}"])
    return out


def one_host(n: int, count: int) -> list[list[Any]]:
    topo = ring(n)
    rows: list[list[Any]] = []
    with scratch_host("10.78.0.0/16") as host:
        log(f"one host: {n} nodes, testbed {host.testbed_id}")
        ips = deploy(host, topo, ["sleep", "3600"])
        log(f"  playing {count} link and node events")
        rows += summarize("one host", play(host, ips, topo, node_events(n, count)))
        log(f"  playing {count // 4} link-down/up events (iptables)")
        rows += summarize("one host, packet filters", play(host, ips, topo, filter_events(n, count // 4)))
    return rows


def through_agent(n: int, count: int) -> list[list[Any]]:
    topo = ring(n)
    with loopback_agent("10.79.0.0/16") as (client, _):
        ips = deploy(client, topo, ["sleep", "3600"])
        return summarize("through an agent", play(client, ips, topo, node_events(n, count)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--events", type=int, default=100)
    p.add_argument("--no-agent", action="store_true")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 2
    rows = one_host(args.nodes, args.events)
    if not args.no_agent:
        rows += through_agent(args.nodes, args.events)
    print(f"\nScenario skew (applied - planned), {args.nodes} nodes, {args.events} events "
          f"({SPACING_S * 1000:.0f} ms apart); targets on one host: median <= {TARGET_MEDIAN_MS:g} ms, "
          f"p99 <= {TARGET_P99_MS:g} ms\n")
    print(table(["where", "event", "steps", "median ms", "p99 ms", "max ms"], rows))
    overall = next(r for r in rows if r[0] == "one host" and r[1] == "all")
    ok = float(overall[3]) <= TARGET_MEDIAN_MS and float(overall[4]) <= TARGET_P99_MS
    print(f"\none host, link and node events: {'meets' if ok else 'MISSES'} the targets")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of recorded traces: one trace replayed on 100 real links under bulk TCP flows.

Run as root: ``.venv/bin/python bench/bench_traces.py [--links 100] [--seconds 30] [--in-process]
[--worker-clock] [--controller-ticks] [--full-segments] [--busy-loops 4]``.
Prints Markdown tables on stdout (progress on stderr).

A seeded cellular-like recording (a random walk of the rate, mean about 5 Mbit/s, written as a
Mahimahi delivery trace and read by the testbed's importer) binned at 100 ms is replayed on
``--links`` links of a ring of nodes (n_i -> n_i+1; each link from its own offset in the
recording; the way back is a constant 50 Mbit/s), with one bulk TCP flow per link (the
scenario's ``background`` generator: iperf3 at 100 Mbit/s, so the link is the bottleneck).
Through the agent the replay is a run's: its bins handed once to the agent's own clock (a
real-time process of its own, ``worker.shaping.clock_process``; ``PUT /links/schedule``;
``--controller-ticks``: a ``set_rates`` call a tick, as before).
The worker is an agent on loopback (``--in-process``: driven in this process), so the
controller's and the worker's CPU are measured apart.

Figures: each flow's goodput per second (iperf3's intervals) against the trace's mean rate
over that second (seconds with a bin under 0.5 Mbit/s excluded, and the first two: slow
start), median and spread of the ratio; the replay's ticks: how late each was applied
(skew: the time the kernel answered the tick's last netlink batch minus the tick's due time;
a tick the clock woke too late for is folded into the next batch and counted with that
batch's time), median and p99; the CPU of the controller (this process) and of
the worker agent during the replay. Targets: median ratio within 1 +- 0.10; skew median
<= 15 ms, p99 <= 60 ms.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_agent import deploy, loopback_agent, percentile  # noqa: E402
from bench_netns import BenchError, free_subnet, fresh_testbed_id, log, shielded, table, teardown  # noqa: E402

from controller.model.scenario import resolve  # noqa: E402
from controller.model.topology import Topology, links_from_data  # noqa: E402
from controller.model.traces import TraceFiles  # noqa: E402
from controller.run.scenario_runner import ScenarioRunner  # noqa: E402
from controller.run.trace_replay import EDGE_S, TracedLink  # noqa: E402
from worker.host import WorkerHost  # noqa: E402
from worker.shaping.schedule import LinkSchedule, ScheduleClock  # noqa: E402

SEED = 20261128
BIN_MS = 100
MEAN_BPS = 5e6
EXCLUDE_BELOW_BPS = 0.5e6
WARMUP_S = 2
FLOW_RATE = "100mbit"
BACK_RATE = "50mbit"
TARGET_RATIO = 0.10
TARGET_MEDIAN_MS, TARGET_P99_MS = 15.0, 60.0


def synthetic_trace(seconds: int, rng: random.Random) -> list[int]:
    """Mahimahi delivery opportunities (ms) of a cellular-like rate: a random walk of its
    logarithm, a new value each 100 ms, pulled back to a mean near MEAN_BPS, 0.3-14 Mbit/s."""
    lines: list[int] = []
    log_rate = math.log(MEAN_BPS)
    carry = 0.0
    for b in range(seconds * 1000 // BIN_MS):
        log_rate += rng.gauss(0, 0.18) + 0.08 * (math.log(MEAN_BPS) - log_rate)
        rate = min(14e6, max(0.3e6, math.exp(log_rate)))
        packets = rate * BIN_MS / 1000 / 12_000 + carry
        whole = int(packets)
        carry = packets - whole
        lines += sorted(b * BIN_MS + rng.randrange(BIN_MS) for _ in range(whole))
    return lines


def cpu_s(pid: int) -> float:
    """The user + system CPU seconds of process ``pid`` (its own threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def clock_pids(agent_pid: int) -> list[int]:
    """The agent's trace clock process (``worker.shaping.clock_process``), a child of the agent."""
    found = []
    for task in os.listdir(f"/proc/{agent_pid}/task"):
        with open(f"/proc/{agent_pid}/task/{task}/children") as f:
            for pid in f.read().split():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        if b"worker.shaping.clock_process" in c.read():
                            found.append(int(pid))
                except OSError:
                    pass
    return found


def host_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores since boot."""
    with open("/proc/stat") as f:
        values = [int(x) for x in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def network(n: int, trace_dir: str, seconds: int) -> Topology:
    """The ring of ``n`` nodes: n_i -> n_i+1 replays the recording from its own offset."""
    data: dict[str, list[dict[str, Any]]] = {}
    for i in range(n):
        a, b = f"n{i}", f"n{(i + 1) % n}"
        data.setdefault(a, []).append({"dest": b, "trace": {"file": "cell.down", "format": "mahimahi",
                                                            "bin_ms": BIN_MS, "offset_s": round(i * 7.3 % seconds, 1)}})
        data.setdefault(b, []).append({"dest": a, "bw": BACK_RATE})
    return links_from_data(data, os.path.join(trace_dir, "links.json"), traces=TraceFiles(trace_dir))


def schedule_of(topo: Topology, seconds: int) -> list[LinkSchedule]:
    """Each traced link's bins over ``seconds`` (and a margin), as its replay gives them."""
    bins = int((seconds + 60) * 1000 / BIN_MS)
    return [LinkSchedule(s, d, tuple(r.rate_at(k * BIN_MS / 1000 + EDGE_S) for k in range(bins)), bin_ms=BIN_MS)
            for (s, d), r in topo.traces.items()]


def replay_under_flows(worker: Any, topo: Topology, seconds: int, agent_pid: int, worker_clock: bool = False,
                       controller_ticks: bool = False, full_segments: bool = False) -> dict[str, Any]:
    ips = deploy(worker, topo, full_segments=full_segments)
    events = [{"at": 0, "background": {"src": s, "dst": d, "rate": FLOW_RATE, "for": seconds}}
              for (s, d) in topo.traces]
    runner = ScenarioRunner(resolve({"events": events}, topo), worker, ips, progress=lambda _: None)
    runner.replay.worker_clock = not controller_ticks  # a run's default: the bins to the agent's clock (its route)
    clock = None
    if worker_clock:  # the bins handed to the worker once, ticked by its own thread (worker.shaping.schedule)
        state = worker.links.store.snapshot()
        nodes = {s: (state["nodes"][s]["netns"], state["plans"][s]) for s, _ in topo.traces}
        clock = ScheduleClock(schedule_of(topo, seconds), nodes, start=0.0)
    else:
        runner.replay.add(TracedLink(s, d, r) for (s, d), r in topo.traces.items())
    cpu0, agent0, busy0, wall0 = time.process_time(), cpu_s(agent_pid), host_busy(), time.monotonic()
    runner.start()
    clocks = {pid: cpu_s(pid) for pid in clock_pids(agent_pid)}
    if clock is not None:
        clock.start = runner.t0
        clock.begin()
    log(f"replaying on {len(topo.traces)} links under {len(events)} flows for {seconds} s"
        + (" (the worker's clock)" if worker_clock else ""))
    runner.wait(120)
    flows = runner.wait_flows(seconds + 60)
    wall = time.monotonic() - wall0
    cpu1, agent1, busy1 = time.process_time(), cpu_s(agent_pid), host_busy()
    clock_cpu_s = sum(cpu_s(pid) - c0 for pid, c0 in clocks.items())
    if clock is not None:
        clock.stop()
    runner.stop()
    failed = [r for r in runner.rows if r["outcome"].startswith("failed")]
    if failed:
        raise BenchError(f"{len(failed)} flows did not start, first: {failed[0]}")
    started = {r["target"]: r["applied_s"] for r in runner.rows}
    return {"flows": flows, "started": started, "ticks": clock.rows if clock is not None else runner.replay.rows,
            "wall_s": wall,
            "controller_cpu_s": cpu1 - cpu0, "agent_cpu_s": agent1 - agent0, "clock_cpu_s": clock_cpu_s,
            "host_busy": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]), "keys": list(topo.traces),
            "traces": topo.traces}


def goodput_ratios(result: dict[str, Any]) -> tuple[list[float], int]:
    """Each (link, second)'s goodput over the trace's mean rate then; how many were excluded."""
    ratios, excluded = [], 0
    for i, key in enumerate(result["keys"]):
        flow = result["flows"][f"e{i}"]
        t0 = result["started"][f"{key[0]}->{key[1]}"]  # when the flow was started, on the replay's clock
        replay = result["traces"][key]
        per_second: dict[int, list[float]] = {}
        for s in flow["samples"]:
            per_second.setdefault(int(s["start_s"]), []).append(s)  # (iperf3's 0.2 s intervals)
        for second, samples in sorted(per_second.items()):
            covered = sum(s["seconds"] for s in samples)
            if second < WARMUP_S or covered < 0.95:
                continue
            start = t0 + samples[0]["start_s"]
            bins = [replay.rate_at(start + (k + 0.5) * covered / 10) for k in range(10)]
            if min(bins) < EXCLUDE_BELOW_BPS:
                excluded += 1
                continue
            ratios.append(sum(s["bytes"] for s in samples) * 8 / covered / statistics.mean(bins))
    return ratios, excluded


def replay(args: argparse.Namespace, topo: Topology) -> dict[str, Any]:
    """``replay_under_flows`` in this process or through an agent on loopback, taken down after."""
    if not args.in_process and not args.worker_clock:
        with loopback_agent("10.81.0.0/16") as (client, proc):
            return replay_under_flows(client, topo, args.seconds, proc.pid, controller_ticks=args.controller_ticks,
                                      full_segments=args.full_segments)
    host = WorkerHost(fresh_testbed_id(), free_subnet("10.81.0.0/16"), state_root=tempfile.mkdtemp())
    try:
        result = replay_under_flows(host, topo, args.seconds, os.getpid(), args.worker_clock,
                                    full_segments=args.full_segments)
    finally:
        with shielded():
            left = teardown(host)
        if left:
            raise BenchError(f"reset left {left} behind")
    result["agent_cpu_s"] = float("nan")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", type=int, default=100)
    p.add_argument("--seconds", type=int, default=30)
    p.add_argument("--in-process", action="store_true", help="drive the worker in this process, not an agent")
    p.add_argument("--controller-ticks", action="store_true",
                   help="through the agent, the controller's ticks (one set_rates call a tick) instead of a run's "
                        "default, the agent's own clock given the bins once (PUT /links/schedule)")
    p.add_argument("--worker-clock", action="store_true",
                   help="the bins handed to the worker once and ticked by its own clock (worker.shaping.schedule; "
                        "in process: not yet an agent's route)")
    p.add_argument("--full-segments", action="store_true",
                   help="nodes keep the kernel's 64 KB segments (a run's replaying nodes send one frame at a time)")
    p.add_argument("--busy-loops", type=int, default=0,
                   help="this many processes spinning at nice 0 during the replay: a loaded host, reproducibly")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 2
    trace_dir = tempfile.mkdtemp(prefix="edgetb-bench-traces-")
    recording = synthetic_trace(max(60, args.seconds * 2), random.Random(SEED))
    with open(os.path.join(trace_dir, "cell.down"), "w") as f:
        f.write("\n".join(map(str, recording)) + "\n")
    topo = network(args.links, trace_dir, max(60, args.seconds * 2))
    trace = next(iter(topo.traces.values())).trace
    log(f"recording: {len(recording)} packets, {trace.duration_s:g} s, mean {trace.rates_bps.mean() / 1e6:.2f} Mbit/s")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_loops)]
    try:
        result = replay(args, topo)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    ratios, excluded = goodput_ratios(result)
    ticks = result["ticks"]
    skews = [t["skew_ms"] for t in ticks if t["changed"]]
    changed = [t["changed"] for t in ticks]
    folded = sum(1 for a, b in zip(ticks, ticks[1:]) if a["applied_s"] == b["applied_s"])  # woke late: one batch
    wall = result["wall_s"]
    print(f"\nRecorded trace ({BIN_MS} ms bins, mean {trace.rates_bps.mean() / 1e6:.2f} Mbit/s) on {args.links} links, "
          f"one bulk TCP flow each, {args.seconds} s, worker {'in process' if args.in_process or args.worker_clock else 'an agent'}"
          + (", ticked by the worker's own clock" if args.worker_clock else "")
          + (", 64 KB segments" if args.full_segments else ", one frame a segment")
          + (f", {args.busy_loops} busy loops beside it" if args.busy_loops else "") + "\n")
    med = statistics.median(ratios) if ratios else float("nan")
    print(table(["goodput / trace rate", "link-seconds", "excluded (a bin < 0.5 Mbit/s)", "median", "p10", "p90"],
                [["per second", len(ratios), excluded, f"{med:.3f}", f"{percentile(ratios, 0.1):.3f}",
                  f"{percentile(ratios, 0.9):.3f}"]]))
    print()
    print(table(["replay ticks", "ticks", "folded into a later batch", "rates set a tick (median)",
                 "skew median ms", "p99 ms", "max ms", "failed"],
                [[f"every {BIN_MS} ms", len(ticks), folded, statistics.median(changed) if changed else 0,
                  f"{statistics.median(skews):.2f}", f"{percentile(skews, 0.99):.2f}", f"{max(skews):.2f}",
                  sum(1 for t in ticks if t["outcome"] != "applied")]]))
    print()
    print(table(["CPU during the replay", "controller (this process)", "worker agent", "its trace clock process",
                 "whole host (2 cores)"],
                [["% of one core", f"{100 * result['controller_cpu_s'] / wall:.1f}",
                  f"{100 * result['agent_cpu_s'] / wall:.1f}", f"{100 * result['clock_cpu_s'] / wall:.1f}",
                  f"{200 * result['host_busy']:.1f}"]]))
    ok = abs(med - 1) <= TARGET_RATIO and statistics.median(skews) <= TARGET_MEDIAN_MS \
        and percentile(skews, 0.99) <= TARGET_P99_MS
    print(f"\ntargets (median ratio 1 +- {TARGET_RATIO:g}, skew median <= {TARGET_MEDIAN_MS:g} ms, "
          f"p99 <= {TARGET_P99_MS:g} ms): {'met' if ok else 'MISSED'}")
    print(f"(peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

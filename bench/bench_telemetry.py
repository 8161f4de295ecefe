"""Benchmark of the telemetry sampler: its CPU cost and the shortest period it sustains.

Run as root: ``.venv/bin/python bench/bench_telemetry.py [--quick] [--seconds 10]``. Prints
Markdown tables on stdout (progress on stderr); the figures go into BENCHMARKS.md.

For each size (147 nodes and 1,466 links, EdgeTB's largest experiment; 500 nodes and 5,000
links) a fresh testbed is brought up in-process, isolated as a deployed one (a seeded random
graph, links of 1-100 Mbit/s), and then:

1. the sampler thread runs at 10 Hz for ``--seconds``: its CPU time (``time.thread_time``
   of the sampling thread) per second of wall time is its share of one core; the time of
   one sample (mean, p95) and the samples it had to skip are measured too, and so is the
   controller's side (pulling once a second and writing the three CSV files);
   (all busy: every class is dumped at every sample, as when every link carries traffic; idle:
   an interface whose root qdisc did not change is not dumped, as between rounds); the system
   calls of an all-busy sample are also made alone, without decoding, at 10 Hz: the share no
   decoding could go under (the kernel's work and the calls' own cost);
2. the same at shorter periods (all busy; 50, 20, 10 ms): the shortest period at which at most
   1 % of the samples are skipped is the highest rate it sustains on this machine as loaded;
   the CPU time of one sample is the shortest period it could sustain on a core of its own.
3. (``--real-run``) a real run of EdgeTB's largest size: ``gl_run.py --auto`` with 147 gossip
   nodes (bench_scale's experiment: out-degree 10, 1,470 links, ``--rounds`` rounds), sampled
   at 10 Hz as every run is; the sampler's CPU share is what the run's ``run.json`` records.

No traffic flows in 1 and 2: "all busy" forces what traffic on every interface causes (a class dump
per interface per sample); the cost of a dump does not depend on the amount of traffic.
The machine's load average is printed with the results: other processes lengthen the
wall time of a sample, not its CPU time.
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import struct
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_netns import BenchError, checkpoint, log, scratch_host, table  # noqa: E402
from controller.model.telemetry_conf import TelemetryConf  # noqa: E402
from controller.results.rates import LinkRates  # noqa: E402
from controller.results.run_dir import RunDir  # noqa: E402
from controller.telemetry.collector import Collector  # noqa: E402
from controller.telemetry.export import configured_rates  # noqa: E402
from worker.kernel.netlink import NLMSG_DONE  # noqa: E402
from worker.observe.stats import RECV_BYTES  # noqa: E402

SEED = 20261123
SIZES = ((147, 1466), (500, 5000))
TARGET_SHARE = 0.05  # of one core at 147 nodes and 10 Hz
PERIODS_MS = (100, 50, 20, 10)


def edges(n: int, count: int, rng: random.Random) -> list[tuple[int, int]]:
    """``count`` distinct directed links: every node sends to about count/n random others."""
    base, extra = divmod(count, n)
    out = []
    for i in range(n):
        degree = base + (1 if i < extra else 0)
        out += [(i, j) for j in rng.sample([k for k in range(n) if k != i], degree)]
    return out


def bring_up(host: Any, n: int, count: int) -> None:
    rng = random.Random(SEED + n)
    pairs = edges(n, count, rng)
    nodes = host.create_nodes({"version": 1, "nodes": [{"name": f"n{i}"} for i in range(n)]})["nodes"]
    body = {"version": 1, "links": [{"src": f"n{i}", "dst": f"n{j}", "dst_ip": nodes[j]["ip"],
                                     "shape": {"rate_bps": rng.randint(1, 100) * 10**6}} for i, j in pairs],
            "isolation": {"drop": [str(host.runtime.subnet)], "keep": [host.runtime.bridge_ip]}}
    result = host.set_links(body)
    if sum(s["rules"] for s in result["nodes"]) != count:
        raise BenchError(f"expected {count} shaped links")


def run_sampler(host: Any, period_ms: int, seconds: float, with_collector: bool,
                always_dump: bool = True) -> dict[str, Any]:
    """Sample for ``seconds`` through the host's API (and, ``with_collector``, the controller's
    pull loop writing CSV files): the sampler's CPU share, sample times, skipped periods."""
    scratch = tempfile.mkdtemp(prefix="edgetb-bench-tel-")
    summary = None
    try:
        if with_collector:
            collector = Collector(host, TelemetryConf(period_ms=period_ms), RunDir(scratch),
                                  LinkRates(configured_rates(host)))
            collector.start()
            collector.mark_start()
            collector.run_in_thread()
        else:
            host.telemetry_start({"version": 1, "period_ms": period_ms, "restart": True})
        sampler = host.telemetry.sampler
        for node in sampler._nodes:  # the worst case: every class read at every sample, as if all were busy
            if node.sock is not None:
                node.sock.always_dump = always_dump
        time.sleep(0.5)  # past the first samples, which open the sockets
        t0, cpu0, n0, late0 = time.monotonic(), sampler.cpu_s, sampler.samples, sampler.late
        time.sleep(seconds)
        wall, cpu = time.monotonic() - t0, sampler.cpu_s - cpu0
        samples, late = sampler.samples - n0, sampler.late - late0
        durations = sorted(list(sampler.durations_s)[-samples:])
        if with_collector:
            summary = collector.finish()
    finally:
        host.telemetry_stop()
        shutil.rmtree(scratch, ignore_errors=True)
    return {"share": cpu / wall, "cpu_ms": cpu / max(1, samples) * 1000, "samples": samples, "late": late,
            "mean_ms": statistics.mean(durations) * 1000,
            "p95_ms": durations[int(0.95 * (len(durations) - 1))] * 1000,
            "collector_share": (summary["collector_cpu_s"] / (wall + 0.5)) if summary else None}


def syscalls_alone(host: Any, period_ms: int, seconds: float) -> dict[str, Any]:
    """The system calls of an all-busy sample without any decoding, every period in a thread
    of its own: per node, the counters-and-classes request, its answers up to the dump's end
    and the two cgroup reads. Its CPU share is what no decoding could go under."""
    host.telemetry_start({"version": 1, "period_ms": 10_000, "restart": True})  # opens the sockets
    sampler = host.telemetry.sampler
    sampler._stop.set()  # the sockets stay open; this thread uses them alone
    sampler._thread.join()
    reads = [(n.sock.sock, n.sock._stats_and_dump, n.cgroup._cpu_fd if n.cgroup else -1,
              n.cgroup._mem_fd if n.cgroup else -1) for n in sampler._nodes if n.sock is not None]
    result: dict[str, float] = {}

    def loop() -> None:
        cpu0, t0, passes = time.thread_time(), time.monotonic(), 0
        due = t0
        while time.monotonic() - t0 < seconds:
            for sock, request, cpu_fd, mem_fd in reads:
                sock.sendall(request)
                sock.recv(RECV_BYTES)  # the interface's counters
                while struct.unpack_from("=IH", sock.recv(RECV_BYTES))[1] != NLMSG_DONE:
                    pass
                for fd in (cpu_fd, mem_fd):
                    if fd >= 0:
                        os.pread(fd, 4096, 0)
            passes += 1
            due += period_ms / 1000
            time.sleep(max(0.0, due - time.monotonic()))
        result.update(share=(time.thread_time() - cpu0) / (time.monotonic() - t0),
                      cpu_ms=(time.thread_time() - cpu0) / passes * 1000)

    try:
        thread = threading.Thread(target=loop)
        thread.start()
        thread.join()
    finally:
        host.telemetry_stop()
    return result


def real_run(n: int, rounds: int) -> dict[str, Any]:
    """Run ``gl_run.py --auto`` with ``n`` gossip nodes; the telemetry part of its ``run.json``."""
    import glob
    import json
    import subprocess

    from bench.bench_netns import free_port
    from bench.bench_scale import experiment, free_subnet

    workdir = tempfile.mkdtemp(prefix=f"edgetb-bench-tel-run-{n}-")
    try:
        os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
        experiment(workdir, n, rounds)
        env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"))
        done = subprocess.run([sys.executable, os.path.join(ROOT, "gl_run.py"), "--auto", "--quiet-nodes",
                               "--workdir", workdir, "--port", str(free_port()), "--id", "bt" + os.urandom(1).hex(),
                               "--subnet", free_subnet(), "--timeout", "1800"], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"gl_run.py failed ({done.returncode}): {done.stdout[-2000:]}")
        records = glob.glob(os.path.join(workdir, "dml_file", "log", "*", "run.json"))
        if len(records) != 1:
            raise BenchError(f"expected one run folder, found {len(records)}")
        with open(records[0]) as f:
            return json.load(f)["telemetry"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="147 nodes only, 5 s per measurement")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per measurement (default 10)")
    parser.add_argument("--subnet", default="10.210.0.0/16")
    parser.add_argument("--real-run", action="store_true", help="also a real 147-node gossip run (gl_run.py)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the real run (default 10)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_telemetry needs root (namespaces, tc)", file=sys.stderr)
        return 2
    seconds = 5.0 if args.quick else args.seconds
    sizes = SIZES[:1] if args.quick else SIZES
    cost_rows, period_rows = [], []
    for n, count in sizes:
        with scratch_host(args.subnet) as host:
            log(f"{n} nodes, {count} links: bringing up testbed {host.testbed_id}")
            bring_up(host, n, count)
            checkpoint()
            log("  10 Hz, idle interfaces (no class dump)")
            idle = run_sampler(host, 100, seconds, with_collector=False, always_dump=False)
            log("  10 Hz, every class read, with the controller pulling and writing CSV")
            r = run_sampler(host, 100, seconds, with_collector=True)
            log("  10 Hz, the system calls of an all-busy sample alone (no decoding)")
            floor = syscalls_alone(host, 100, seconds)
            target = f"<= {TARGET_SHARE:.0%}" if n == 147 else "-"
            met = ("met" if r["share"] <= TARGET_SHARE else "NOT met") if n == 147 else "-"  # the worst case
            cost_rows.append([n, f"{count:,}", f"{idle['share']:.1%} ({idle['cpu_ms']:.1f} ms)",
                              f"{r['share']:.1%} ({r['cpu_ms']:.1f} ms)",
                              f"{floor['share']:.1%} ({floor['cpu_ms']:.1f} ms)", f"{r['mean_ms']:.1f}",
                              f"{r['p95_ms']:.1f}", r["late"], f"{r['collector_share']:.1%}", target, met])
            sustained = None
            for period in PERIODS_MS:
                checkpoint()
                log(f"  period {period} ms")
                p = run_sampler(host, period, seconds, with_collector=False)
                ok = p["late"] <= 0.01 * p["samples"] and p["share"] < 1.0
                sustained = period if ok else sustained
                period_rows.append([n, period, f"{p['share']:.1%}", f"{p['cpu_ms']:.1f}", f"{p['mean_ms']:.1f}",
                                    f"{p['p95_ms']:.1f}",
                                    p["samples"], p["late"], "yes" if ok else "no"])
            period_rows.append([n, f"**shortest sustained here: {sustained} ms**" if sustained else "none here",
                                "", f"free core: ~{r['cpu_ms']:.0f} ms", "", "", "", "", ""])
    real_rows = []
    if args.real_run:
        checkpoint()
        log(f"a real run: {SIZES[0][0]} gossip nodes, {args.rounds} rounds (gl_run.py --auto)")
        tel = real_run(SIZES[0][0], args.rounds)
        host = next(iter(tel["hosts"].values()))
        share = host["sampler_cpu_share"]
        real_rows.append([SIZES[0][0], f"{host['sampler_cpu_s']:.2f}", f"{host['sampled_s']:.1f}", f"{share:.1%}",
                          host["samples"], host["late"], host["lost"], f"{tel['collector_cpu_s']:.2f}",
                          f"<= {TARGET_SHARE:.0%}", "met" if share <= TARGET_SHARE else "NOT met"])
    load = os.getloadavg()
    print(f"\nMachine: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
          f"(1/5/15 min) at the end; {seconds:g} s per measurement.\n")
    print("Sampler cost at 10 Hz (share of one core: sampler thread CPU time / wall time)\n")
    print(table(["nodes", "links", "sampler CPU, idle (CPU/sample)", "sampler CPU, all busy (CPU/sample)",
                 "its system calls alone", "sample mean ms", "sample p95 ms", "skipped", "controller CPU",
                 "target", "result"], cost_rows))
    print("\nShorter periods (sampler alone)\n")
    print(table(["nodes", "period ms", "sampler CPU", "CPU ms/sample", "sample mean ms", "sample p95 ms", "samples",
                 "skipped", "sustained"], period_rows))
    if real_rows:
        print("\nA real gossip run (run.json's telemetry)\n")
        print(table(["nodes", "sampler CPU s", "sampled s", "sampler CPU", "samples", "late", "lost",
                     "collector CPU s", "target", "result"], real_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

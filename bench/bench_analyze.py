"""Benchmark of ``edgetb analyze``: a synthetic 10-minute run of EdgeTB's largest experiment
(147 nodes, 1,466 links) sampled at 10 Hz, analysed end to end.

Run: ``.venv/bin/python bench/bench_analyze.py [--minutes 10] [--nodes 147] [--links 1466]
[--period-ms 100] [--repeat 3] [--keep DIR]``. Prints a Markdown table on stdout
(progress on stderr); the figures go into BENCHMARKS.md. Target: ≤ 10 s.

The run folder holds what a finished run holds: run.json, topology.json, events/ (one
round every ~6 s per node), traffic.csv and the sampler's telemetry/links.csv,
nodes.csv and hosts.csv (cumulative counters; each link ON 40 % of a round at a share
of its rate, CPU and memory following the rounds). No captures: a 147-node capture of
ten minutes is not what ``analyze`` is timed on here (``--pcap-nodes N`` adds N).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from controller.results.analysis import AnalysisConfig, analyze  # noqa: E402

T0 = 1_800_000_000.0


def say(msg: str) -> None:
    print(f"bench_analyze: {msg}", file=sys.stderr, flush=True)


def _write_block(f, times: np.ndarray, names: list[str], columns: list[np.ndarray], fmts: list[str]) -> None:
    """Rows time-major: for each time, one row per name."""
    fmt = ",".join(["{:.3f}", "{}"] + fmts) + "\n"
    for i, t in enumerate(times):
        f.write("".join(fmt.format(t, name, *(c[i, j] for c in columns)) for j, name in enumerate(names)))


def synthesize(out: str, minutes: float, n_nodes: int, n_links: int, period_s: float, pcap_nodes: int,
               seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    run = os.path.join(out, "run")
    os.makedirs(os.path.join(run, "events"))
    os.makedirs(os.path.join(run, "telemetry"))
    nodes = [f"n{i}" for i in range(1, n_nodes + 1)]
    ips = {n: f"10.99.{(i + 2) // 256}.{(i + 2) % 256}" for i, n in enumerate(nodes)}
    pairs: set[tuple[str, str]] = set()
    while len(pairs) < n_links:
        a, b = rng.choice(n_nodes, 2, replace=False)
        pairs.add((nodes[a], nodes[b]))
    links = sorted(pairs)
    rates = rng.choice([10e6, 20e6, 50e6, 100e6], len(links))
    duration = minutes * 60
    json.dump({"run_id": "bench", "started_at": T0, "ended_at": T0 + duration + 1},
              open(os.path.join(run, "run.json"), "w"))
    json.dump({"nodes": [{"name": n, "ip": ips[n], "cpu": 1.0} for n in nodes],
               "links": [{"src": s, "dst": d, "rate_bps": float(r)} for (s, d), r in zip(links, rates)]},
              open(os.path.join(run, "topology.json"), "w"))
    round_s = 6.0
    n_rounds = int(duration // round_s) - 1
    for n in nodes:
        with open(os.path.join(run, "events", f"{n}.jsonl"), "w") as f:
            f.write(json.dumps({"type": "started", "role": "gossip", "t": T0}) + "\n")
            for r in range(n_rounds):
                s = T0 + 1 + r * round_s
                f.write(json.dumps({"type": "round", "round": r + 1, "t_start": s, "t_end": s + round_s,
                                    "bytes_sent": 2_000_000, "global_accuracy": min(0.95, 0.3 + 0.01 * r)}) + "\n")
    times = np.round(np.arange(0, duration + period_s / 2, period_s), 3)
    phase = ((times[:, None] - 1.0) % round_s) / round_s
    on = (phase < 0.4) & (times[:, None] >= 1.0)
    share = rng.uniform(0.2, 0.9, len(links))
    per_sample = on * (rates * share * period_s / 8)[None, :]
    tx = np.cumsum(per_sample, axis=0).astype(np.int64)
    pk = tx // 1400
    zeros = np.zeros_like(tx)
    with open(os.path.join(run, "traffic.csv"), "w") as f:  # what the nodes counted: the payload
        f.write("run_id,node,round,peer,direction,bytes\n")
        for j, (s, d) in enumerate(links):
            f.write(f"bench,{s},1,{d},sent,{int(tx[-1, j] - 66 * pk[-1, j])}\n")
    say(f"writing telemetry/links.csv ({len(times) * len(links) / 1e6:.1f} M rows)")
    with open(os.path.join(run, "telemetry", "links.csv"), "w") as f:
        f.write("time_s,src,dst,tx_bytes,tx_packets,drops,overlimits,backlog_bytes\n")
        names = [f"{s},{d}" for s, d in links]
        _write_block(f, times, names, [tx, pk, zeros, zeros, zeros], ["{}"] * 5)
    say("writing telemetry/nodes.csv")
    node_on = ((((times[:, None] - 1.0) % round_s) / round_s) < 0.5) & (times[:, None] >= 1.0)
    cpu = np.cumsum(np.where(node_on, 0.8, 0.05) * period_s + 0 * np.arange(n_nodes)[None, :], axis=0)
    mem = (200e6 + np.where(node_on, 50e6, 0) + rng.uniform(0, 1e6, (len(times), n_nodes))).astype(np.int64)
    idx = {n: i for i, n in enumerate(nodes)}
    ntx = np.zeros((len(times), n_nodes), np.int64)
    nrx = np.zeros((len(times), n_nodes), np.int64)
    for j, (s, d) in enumerate(links):
        ntx[:, idx[s]] += tx[:, j]
        nrx[:, idx[d]] += tx[:, j]
    nz = np.zeros_like(ntx)
    with open(os.path.join(run, "telemetry", "nodes.csv"), "w") as f:
        f.write("time_s,node,cpu_s,mem_bytes,tx_bytes,rx_bytes,tx_packets,rx_packets,drops\n")
        _write_block(f, times, nodes, [cpu, mem, ntx, nrx, ntx // 1400, nrx // 1400, nz],
                     ["{:.3f}", "{}", "{}", "{}", "{}", "{}", "{}"])
    with open(os.path.join(run, "telemetry", "hosts.csv"), "w") as f:
        f.write("time_s,host,cpu_s,mem_bytes,tx_bytes,rx_bytes\n")
        _write_block(f, times, ["local"], [cpu.sum(1, keepdims=True), mem.sum(1, keepdims=True),
                                           ntx.sum(1, keepdims=True), nrx.sum(1, keepdims=True)],
                     ["{:.3f}", "{}", "{}", "{}"])
    if pcap_nodes:
        say(f"writing {pcap_nodes} captures")
        os.makedirs(os.path.join(run, "telemetry", "pcap"))
        for n in nodes[:pcap_nodes]:
            _synthetic_pcap(os.path.join(run, "telemetry", "pcap", f"{n}.pcap"), ips[n],
                            [ips[d] for s, d in links if s == n] or [ips[nodes[0]]], duration, round_s, rng)
    return run


def _synthetic_pcap(path: str, src: str, dsts: list[str], duration: float, round_s: float, rng) -> None:
    """Frames of 1,514 B at 1,000 per second during each round's ON 40 %, to the node's peers."""
    def ip(a: str) -> bytes:
        return bytes(int(x) for x in a.split("."))

    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 128, 1))
        t = np.arange(1.0, duration, 0.001)
        t = t[((t - 1.0) % round_s) / round_s < 0.4]
        d = rng.integers(0, len(dsts), t.size)
        heads = [bytes(12) + b"\x08\x00" + b"\x45\x00\x05\xdc" + bytes(5) + b"\x06" + bytes(2) + ip(src) + ip(x)
                 + struct.pack(">HH", 40000 + i, 4444) + bytes(16) for i, x in enumerate(dsts)]
        for ti, di in zip(T0 + t, d):
            sec = int(ti)
            f.write(struct.pack("<IIII", sec, int((ti - sec) * 1e6), len(heads[di]), 1514) + heads[di])


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the parsing workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--nodes", type=int, default=147)
    p.add_argument("--links", type=int, default=1466)
    p.add_argument("--period-ms", type=float, default=100.0)
    p.add_argument("--pcap-nodes", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--keep", help="make (or reuse) the run folder here instead of a temporary one")
    args = p.parse_args()
    base = args.keep or tempfile.mkdtemp(prefix="bench-analyze-")
    try:
        run = os.path.join(base, "run")
        if not os.path.isdir(run):
            started = time.monotonic()
            synthesize(base, args.minutes, args.nodes, args.links, args.period_ms / 1000, args.pcap_nodes)
            say(f"synthesized in {time.monotonic() - started:.1f}s")
        size_mb = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(run, "telemetry"))
                      for f in fs) / 1e6
        rows = []
        for plots in (False, True):
            times, cpus = [], []
            for i in range(args.repeat):
                shutil.rmtree(os.path.join(run, "analysis"), ignore_errors=True)
                started, cpu0 = time.monotonic(), _cpu_s()
                summary = analyze(run, AnalysisConfig(plots=plots), progress=say if i == 0 else None)
                times.append(time.monotonic() - started)
                cpus.append(_cpu_s() - cpu0)
            rows.append((plots, times, summary, cpus))
        load = os.getloadavg()[0]
        print(f"| nodes | links | period | minutes | telemetry MB | captures | plots | analyze s (median of "
              f"{args.repeat}) | min | CPU s (all processes, median) | load average | target |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for plots, times, summary, cpus in rows:
            print(f"| {args.nodes} | {args.links} | {args.period_ms:g} ms | {args.minutes:g} | {size_mb:.0f} | "
                  f"{args.pcap_nodes} | {'yes' if plots else 'no'} | {statistics.median(times):.2f} | "
                  f"{min(times):.2f} | {statistics.median(cpus):.2f} | {load:.1f} on {os.cpu_count()} cores | ≤ 10 s |")
        for plots, times, summary, _ in rows:
            say(f"steps ({'with' if plots else 'without'} plots, last run): "
                + ", ".join(f"{k} {v:.2f}s" for k, v in summary["timings_s"].items()))
        bursts = sum(1 for _ in open(os.path.join(run, "analysis", "bursts.csv"))) - 1
        say(f"bursts.csv rows: {bursts}; fidelity: {rows[-1][2]['fidelity']['passed']} of "
            f"{rows[-1][2]['fidelity']['checked']} checks pass")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

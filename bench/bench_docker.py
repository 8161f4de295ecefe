"""Benchmark of the Docker runtime: time to bring up N containers with shaped links.

Run as root, after ``bash scripts/docker_setup.sh && bash scripts/build_node_image.sh``:
``.venv/bin/python bench/bench_docker.py [--nodes 50] [--degree 3] [--runs 3]``. Prints a
Markdown table on stdout (progress on stderr); the figures go into BENCHMARKS.md.

Each run is ``controller.workers.deploy.deploy`` — what ``edgetb up --runtime docker`` does — on a
fresh testbed: a seeded random graph (each node links to ``degree`` random others, 5–20 mbit),
containers with cpu 0.5 and 256 MiB, every link shaped and verified. Then one command is run
in every container (the nodes answer), and the testbed is reset; nothing carrying its id
may be left (a leftover is a product bug and fails the benchmark).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_netns import (BenchError, _on_signal, checkpoint, fresh_testbed_id, free_subnet, log, secs,  # noqa: E402
                         shielded, table, teardown)
from controller.model.topology import Topology  # noqa: E402
from controller.workers import deploy  # noqa: E402
from worker.host import WorkerHost  # noqa: E402
from worker.nodes import docker as runtime_docker  # noqa: E402
from worker.shaping import apply
from worker.shaping.plan import Plan  # noqa: E402

SEED = 20261122
TARGET_S = 30.0  # 50 Docker nodes with shaped links ready (EdgeTB waits ~30 s for the first healthcheck)
CPU, MEM = 0.5, "256M"


def topology(n: int, degree: int, rng: random.Random) -> Topology:
    topo = Topology()
    for i in range(n):
        topo.add_node(f"n{i}", cpu=CPU, mem=MEM)
    for i in range(n):
        for j in rng.sample([k for k in range(n) if k != i], degree):
            topo.add_link(f"n{i}", f"n{j}", f"{rng.randint(5, 20)}mbit")
    return topo


def one_run(n: int, degree: int, run: int, subnet: str) -> list[Any]:
    topo = topology(n, degree, random.Random(SEED + run))
    state_dir = tempfile.mkdtemp(prefix="edgetb-bench-docker-")
    host = WorkerHost(fresh_testbed_id(), free_subnet(subnet), state_root=state_dir, runtime="docker")
    left: dict[str, list[str]] = {}
    try:
        log(f"run {run}: testbed {host.testbed_id}, {n} containers, {len(topo.links)} links")
        t0 = time.perf_counter()
        result = deploy.deploy(topo, host, lambda m: log(f"  {m}"))
        up_s = time.perf_counter() - t0
        checkpoint()
        # independent checks: every node's kernel state matches its plan, every node runs a command
        plans = host.store.read()["plans"]
        if sorted(plans) != sorted(topo.nodes) or sum(len(p["rules"]) for p in plans.values()) != len(topo.links):
            raise BenchError(f"run {run}: {len(plans)} shaped nodes, expected {n}")
        for rec in result["nodes"]:
            apply.verify(rec["netns"], Plan.from_dict(plans[rec["name"]]))
        t1 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda name: host.exec(name, {"version": 1, "argv": ["true"]})["returncode"],
                                  list(topo.nodes)))
        exec_s = time.perf_counter() - t1
        if any(codes):
            raise BenchError(f"run {run}: 'true' failed in {sum(1 for c in codes if c)} containers")
    finally:
        with shielded():
            t2 = time.perf_counter()
            left = teardown(host)
            down_s = time.perf_counter() - t2
            shutil.rmtree(state_dir, ignore_errors=True)
        if left:
            raise BenchError(f"testbed {host.testbed_id}: reset left {left} behind (a product bug)")
        checkpoint()
    nodes_s = result["seconds_nodes"]
    return [run, n, len(topo.links), secs(nodes_s), secs(up_s - nodes_s), secs(up_s), secs(exec_s), secs(down_s),
            "met" if up_s <= TARGET_S else "NOT met"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=50)
    p.add_argument("--degree", type=int, default=3)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--subnet", default="10.210.0.0/16")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench_docker: run as root", file=sys.stderr)
        return 2
    problem = runtime_docker.probe()
    if problem:
        print(f"bench_docker: {problem}", file=sys.stderr)
        return 2
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    api = runtime_docker.connect()
    info = api.info()
    image = api.inspect_image(runtime_docker.node_image())
    rows = [one_run(args.nodes, args.degree, run, args.subnet) for run in range(1, args.runs + 1)]
    up = [float(r[5]) for r in rows]
    print(f"Docker {info['ServerVersion']}, storage driver {info['Driver']}, cgroup v{info.get('CgroupVersion', '?')}, "
          f"{os.cpu_count()} cores; image {runtime_docker.node_image()} ({image['Size'] / 1e6:.0f} MB); "
          f"containers with cpu {CPU} and {MEM}; random graph, out-degree {args.degree}, 5–20 mbit.\n")
    print(table(["run", "nodes", "links", "containers s", "shaping + verify s", "bring-up s",
                 "a command in every node s", "reset s", f"target ≤ {TARGET_S:g} s"], rows))
    print(f"\nbring-up median {statistics.median(up):.2f} s, max {max(up):.2f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"bench_docker: {e}", file=sys.stderr)
        sys.exit(1)

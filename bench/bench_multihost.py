"""Benchmark of a multi-host bring-up: code sync, nodes on every host, routes, cross-host shaping.

Run as root: ``.venv/bin/python bench/bench_multihost.py [--hosts 3] [--nodes 50] [--degree 4]``.
Prints a Markdown table on stdout (progress on stderr); the figures go into BENCHMARKS.md.

The hosts are this machine's namespace (an in-process netns host, with the controller) plus
``hosts - 1`` agents, each in its own host network namespace on a veth LAN (as in the e2e
tier, tests/e2e/lan.py). Each run: the agents sync dml_app/ and dataset/ from the controller's
``/files`` routes (first run: every file; later runs: nothing changed), then
``controller.workers.deploy.deploy`` on the cluster — every host creates its nodes in parallel, routes
go in, and every link is shaped and verified on its source's host. A seeded random graph gives
each node ``degree`` links, most of them to nodes on other hosts. Then every node knocks on a
closed port of a node on another host (the refusal proves the route), and the cluster is reset; leftovers fail the benchmark.
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_netns import fresh_testbed_id, log, secs, table  # noqa: E402
from controller.model.hosts import Host, Hosts, check_placement  # noqa: E402
from controller.model.topology import Topology  # noqa: E402
from controller.workers import deploy, files  # noqa: E402
from controller.workers.connect import connect  # noqa: E402
from tests.e2e.lan import Lan  # noqa: E402
from worker.kernel import nsfs  # noqa: E402

SEED = 20261123
KNOCK = ("import socket, sys; s = socket.socket(); s.settimeout(3); "
         "print(s.connect_ex((sys.argv[1], 9)))")


def topology(hosts: list[str], per_host: int, degree: int, rng: random.Random) -> Topology:
    topo = Topology()
    names = []
    for h in hosts:
        for i in range(per_host):
            names.append(topo.add_node(f"{h}n{i}", host=h).name)
    for src in names:
        for dst in rng.sample([n for n in names if n != src], degree):
            topo.add_link(src, dst, f"{rng.randint(5, 20)}mbit")
    return topo


def serve_files(ip: str, workdir: str, token: str) -> tuple[Any, int]:
    """The controller's /files routes on ``ip`` (a thread); the server and its port."""
    from flask import Flask, request
    from werkzeug.serving import make_server

    from worker.api.errors import AuthError
    from worker.serving import json_errors

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    app = Flask("bench-files")
    json_errors(app, logging.getLogger("bench"))

    def check() -> None:
        if request.headers.get("Authorization") != f"Bearer {token}":
            raise AuthError("token")

    files.register(app, {"dml_app": ROOT, "dataset": workdir}, check)
    server = make_server(ip, 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_port


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--nodes", type=int, default=50, help="nodes per host")
    p.add_argument("--degree", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="edgetb-bench-mh-"))
    workdir = tmp / "exp"
    (workdir / "dataset").mkdir(parents=True)
    (workdir / "dataset" / "shard.npz").write_bytes(os.urandom(4 << 20))  # stands in for the shards
    lan = Lan(tmp)
    rows = []
    failed = False
    try:
        agents = [lan.add_host("netns", f"10.{lan.octet}.{16 * (k + 1)}.0/20") for k in range(args.hosts - 1)]
        host_names = ["local"] + [h["name"] for h in agents]
        token_file = tmp / "token"
        token_file.write_text(lan.token)
        hosts = Hosts({"local": Host("local", "netns")} | {
            h["name"]: Host(h["name"], "netns", h["url"], h["ip"], token_file=str(token_file),
                            tls_fingerprint=h["fingerprint"]) for h in agents},
            lan.ip(None))
        server, port = serve_files(lan.ip(None), str(workdir), lan.token)
        results: dict[str, list[float]] = {k: [] for k in ("sync", "deploy", "ping")}
        for run in range(args.runs):
            topo = topology(host_names, args.nodes, args.degree, random.Random(SEED + run))
            cross = sum(1 for l in topo.links.values() if topo.nodes[l.src].host != topo.nodes[l.dst].host)
            tid = fresh_testbed_id()
            cluster = connect(tid, f"10.{lan.octet}.128.0/20", workdir=str(workdir), code_root=ROOT, hosts=hosts,
                              placement=check_placement(topo, hosts))
            try:
                log(f"run {run}: {len(topo.nodes)} nodes on {len(host_names)} hosts, {len(topo.links)} links "
                    f"({cross} across hosts)")
                t0 = time.monotonic()
                cluster.sync_code(f"http://{lan.ip(None)}:{port}", lan.token, log)
                t1 = time.monotonic()
                up = deploy.deploy(topo, cluster, log)
                t2 = time.monotonic()
                ips = up["ips"]
                names = list(topo.nodes)
                bad = []
                for i, src in enumerate(names):  # each node knocks on a closed port of a node of the next host
                    dst = names[(i + args.nodes) % len(names)]
                    out = cluster.exec(src, {"version": 1, "argv": [sys.executable, "-c", KNOCK, ips[dst]]})
                    if out["stdout"].strip() != "111":  # ECONNREFUSED: the other node's kernel answered
                        bad.append(f"{src}->{dst}: {out['stdout'].strip() or out['stderr'][-200:]}")
                t3 = time.monotonic()
                if bad:
                    raise RuntimeError(f"{len(bad)} pings across hosts failed: {bad[:5]}")
                results["sync"].append(t1 - t0)
                results["deploy"].append(t2 - t1)
                results["ping"].append((t3 - t2) / len(names))
            finally:
                cluster.reset()
                left = [n for n in nsfs.list_netns() if n.startswith(f"etb-{tid}-")]
                if left:
                    failed = True
                    log(f"LEFTOVERS: {left}")
        server.shutdown()
        n = args.nodes * args.hosts
        rows.append([f"{args.hosts} × {args.nodes}", str(n), str(args.degree * n),
                     f"{secs(results['sync'][0])} / {secs(statistics.median(results['sync'][1:] or results['sync']))}",
                     f"{secs(min(results['deploy']))}–{secs(max(results['deploy']))}",
                     f"{1000 * statistics.median(results['ping']):.0f} ms"])
    finally:
        left = lan.close()
        subprocess.run(["rm", "-rf", str(tmp)])
        if left:
            failed = True
            log(f"LEFTOVERS on the agents: {left}")
    print(table(["hosts × nodes", "nodes", "links", "sync first / again", "deploy (create + route + shape + verify)",
                 "knock across hosts, per node"], rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

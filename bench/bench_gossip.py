"""Gossip learning at scale: 100 and 500 netns nodes on one host.

Run as root: ``.venv/bin/python bench/bench_gossip.py [--nodes 100 500] [--rounds 5]``.
Each size runs gl_run.py --auto in a scratch experiment directory: a random graph
of out-degree 10 (fewer when the graph is smaller) with links of 200-500 KB/s,
the digits dataset split IID, the numpy model. While it runs, every node
process's memory is sampled: RSS (counts shared library pages in every
process) and PSS (shares them out: what a node really costs). Prints a
Markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def graph(workdir: str, n: int, rounds: int, seed: int = 0) -> list[str]:
    """Write links.json (a random graph of out-degree 10, links of 200-500 KB/s) and
    gl_structure.json for ``n`` nodes; returns their names."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(1, n + 1)]
    degree = min(10, n - 1)
    links = {a: [{"dest": b, "bw": f"{rng.randint(200, 500)}kbps"} for b in rng.sample([x for x in names if x != a], degree)]
             for a in names}
    with open(os.path.join(workdir, "links.json"), "w") as f:
        json.dump(links, f)
    with open(os.path.join(workdir, "gl_structure.json"), "w") as f:
        json.dump({"sync": rounds, "wait_s": 5, "model": {"kind": "numpy", "hidden": [128]},
                   "node_list": [{"name": x, "epoch": 1} for x in names]}, f)
    return names


def experiment(workdir: str, n: int, rounds: int, seed: int = 0) -> None:
    graph(workdir, n, rounds, seed)
    with open(os.path.join(workdir, "gl_dataset.json"), "w") as f:
        json.dump({"dataset": "digits", "split": "iid", "batch_size": 32}, f)


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB, or (0, 0) when it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1])
    except OSError:
        pass
    return rss, pss


def run(n: int, rounds: int) -> list:
    import requests

    workdir = tempfile.mkdtemp(prefix=f"edgetb-gossip-{n}-")

    os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
    experiment(workdir, n, rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"))
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "gl_run.py"), "--auto", "--quiet-nodes",
                             "--workdir", workdir, "--port", str(port), "--id", "bg" + secrets.token_hex(1),
                             "--subnet", "10.240.0.0/16", "--timeout", "1800"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_rss: dict[str, int] = {}
    peak_pss: dict[str, int] = {}
    t_ready = t_running = None
    status: dict = {}
    while proc.poll() is None:
        try:
            status = requests.get(f"http://127.0.0.1:{port}/status", timeout=5).json()
        except requests.RequestException:
            time.sleep(1)
            continue
        if status["phase"] in ("ready", "running") and t_ready is None:
            t_ready = time.monotonic() - started
        if status["phase"] == "running" and t_running is None:
            t_running = time.monotonic()
        for node in status["nodes"]:
            if node["pid"]:
                rss, pss = memory_kib(node["pid"])
                peak_rss[node["name"]] = max(peak_rss.get(node["name"], 0), rss)
                peak_pss[node["name"]] = max(peak_pss.get(node["name"], 0), pss)
        time.sleep(2)
    out = proc.stdout.read()
    total = time.monotonic() - started
    finished = [line for line in out.splitlines() if line.startswith("n") and line.rstrip().endswith("done")]
    if proc.returncode != 0 and not finished:
        log(out[-3000:])
    run_s = (time.monotonic() - t_running) if t_running else float("nan")
    shutil.rmtree(workdir, ignore_errors=True)
    mib = lambda d: max(d.values()) / 1024 if d else float("nan")  # noqa: E731
    mean = lambda d: sum(d.values()) / len(d) / 1024 if d else float("nan")  # noqa: E731
    return [n, min(10, n - 1), rounds, f"{len(finished)}/{n}", f"{t_ready or float('nan'):.0f}", f"{run_s:.0f}",
            f"{total:.0f}", f"{mean(peak_rss):.1f} / {mib(peak_rss):.1f}", f"{mean(peak_pss):.1f} / {mib(peak_pss):.1f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    rows = []
    for n in args.nodes:
        log(f"gossip with {n} nodes")
        rows.append(run(n, args.rounds))
    print("| nodes | out-degree | rounds | nodes done | ready s | run s | wall s | RSS MiB per node, mean / max "
          "| PSS MiB per node, mean / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

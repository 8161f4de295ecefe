"""Benchmark of docker-compose.yml: the testbed image build, and ``compose up`` to a deployed experiment.

Run as root after ``bash scripts/docker_setup.sh``:
``.venv/bin/python bench/bench_compose.py [--nodes 8 50] [--runs 3]``.
Prints a Markdown table on stdout (progress on stderr); the figures go into BENCHMARKS.md.

First ``scripts/build_testbed_image.sh`` is timed (the dependencies image is reused by tag when
it exists, so this is the code layer; the first build ever adds the wheel download). Then for
each size, a bidirectional ring of that many nodes (20 Mbit/s links, a gossip structure) is
brought up with ``compose up -d`` on its own id, subnet and ports: the time until the
controller's phase is ``ready`` (agent start, health check, code sync, containers created,
links shaped and verified, node processes answering), then ``compose down`` (the controller
resets the nodes on SIGTERM), after which no container carrying the id may be left.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_netns import log, secs, table  # noqa: E402
from tests.docker.compose import Compose, compose_cli  # noqa: E402
from worker.nodes import docker as runtime_docker  # noqa: E402


def ring(n: int) -> tuple[dict, dict]:
    names = [f"n{i}" for i in range(1, n + 1)]
    links = {name: [{"dest": names[(i + 1) % n], "bw": "20mbit"}, {"dest": names[i - 1], "bw": "20mbit"}]
             for i, name in enumerate(names)}
    return links, {"sync": 1, "epoch": 1, "wait_s": 1, "node_list": [{"name": name} for name in names]}


def one_run(tmp: Path, cli: list[str], n: int) -> tuple[float, float]:
    """Seconds from ``up`` to ready, and of ``down``."""
    links, structure = ring(n)
    c = Compose(tmp, cli, links, structure)
    api = runtime_docker.connect()
    try:
        started = time.monotonic()
        c.run("up", "-d")
        c.wait_phase("ready", timeout_s=300)
        up_s = time.monotonic() - started
        started = time.monotonic()
        c.down()
        down_s = time.monotonic() - started
        left = api.containers(all=True, filters={"label": f"edgetb.testbed={c.id}"})
        if left:
            raise SystemExit(f"compose down left {len(left)} nodes of testbed {c.id}")
        return up_s, down_s
    finally:
        c.down(check=False)
        api.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[8, 50])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    cli = compose_cli()
    if cli is None:
        raise SystemExit("no compose CLI: run bash scripts/docker_setup.sh")
    started = time.monotonic()
    subprocess.run(["bash", os.path.join(ROOT, "scripts/build_testbed_image.sh")], check=True)
    build_s = time.monotonic() - started
    log(f"testbed image built in {build_s:.1f} s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgetb-bench-compose-") as tmp:
        for n in args.nodes:
            ups, downs = [], []
            for run in range(args.runs):
                up_s, down_s = one_run(Path(tmp), cli, n)
                log(f"{n} nodes, run {run + 1}: ready {up_s:.1f} s after up, down in {down_s:.1f} s")
                ups.append(up_s)
                downs.append(down_s)
            rows.append([str(n), str(2 * n), secs(statistics.median(ups)), f"{min(ups):.1f}–{max(ups):.1f}",
                         secs(statistics.median(downs))])
    print(f"testbed image build (code layer; dependencies reused): {build_s:.1f} s; compose CLI: {' '.join(cli)}\n")
    print(table(["nodes", "links", "up → ready, median s", "range s", "down, median s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

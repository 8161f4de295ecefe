"""Benchmarks of the emulation core: bring-up, rule programming, agent memory.

Run as root: ``.venv/bin/python bench/bench_netns.py [--quick]``. Prints Markdown
tables (progress on stderr); the figures go into BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from worker import tc_apply  # noqa: E402
from worker.host import WorkerHost  # noqa: E402
from worker.shape import Shape  # noqa: E402
from worker.tc_plan import Target, make_plan  # noqa: E402


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def new_host(subnet: str) -> WorkerHost:
    return WorkerHost("b" + secrets.token_hex(2), subnet, state_root=tempfile.mkdtemp(prefix="edgetb-bench-"))


def checked_reset(host: WorkerHost) -> None:
    host.reset()
    left = host.runtime.leftovers()
    if any(left.values()):
        raise SystemExit(f"bench: leftovers after reset: {left}")


def graph(n: int, degree: int | None, rng: random.Random) -> list[tuple[int, int]]:
    """Full mesh when degree is None, else each node links to ``degree`` random others."""
    if degree is None:
        return [(i, j) for i in range(n) for j in range(n) if i != j]
    return [(i, j) for i in range(n) for j in rng.sample([k for k in range(n) if k != i], degree)]


def bring_up(n: int, degree: int | None) -> list[Any]:
    rng = random.Random(n)
    host = new_host("10.250.0.0/16")
    try:
        t0 = time.perf_counter()
        nodes = host.create_nodes({"version": 1, "nodes": [{"name": f"n{i}"} for i in range(n)]})["nodes"]
        t1 = time.perf_counter()
        edges = graph(n, degree, rng)
        body = {"version": 1, "links": [{"src": f"n{i}", "dst": f"n{j}", "dst_ip": nodes[j]["ip"],
                                         "shape": {"rate_bps": rng.randint(1, 100) * 10**6}} for i, j in edges]}
        host.set_links(body)
        t2 = time.perf_counter()
    finally:
        checked_reset(host)
    kind = "full mesh" if degree is None else f"random, out-degree {degree}"
    return [n, kind, len(edges), f"{t1 - t0:.2f}", f"{t2 - t1:.2f}", f"{t2 - t0:.2f}",
            "<= 5 s" if n == 100 else "-"]


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def rules_1000(reps: int) -> list[list[Any]]:
    host = new_host("10.251.0.0/16")
    rows = []
    try:
        rec = host.create_nodes({"version": 1, "nodes": [{"name": "r"}]})["nodes"][0]
        ns = rec["netns"]
        targets = [Target(f"d{i}", f"10.252.{i // 250}.{i % 250 + 1}", Shape(10**7)) for i in range(1000)]
        plan = make_plan("eth0", targets)

        apply_t = _timed(lambda: tc_apply.apply(ns, plan), reps)
        verify_t = _timed(lambda: tc_apply.verify(ns, plan), reps)
        rows.append(["edgetb: batched netlink (program)", f"{statistics.median(apply_t):.3f}", f"{min(apply_t):.3f}", "<= 0.2 s"])
        rows.append(["edgetb: read back + verify", f"{statistics.median(verify_t):.3f}", f"{min(verify_t):.3f}", "-"])

        batch = tempfile.NamedTemporaryFile("w", suffix=".tc", delete=False)
        batch.write("qdisc replace dev eth0 root handle 1: htb default 1\n")
        for i, t in enumerate(targets):
            batch.write(f"class add dev eth0 parent 1: classid 1:{0x10 + i:x} htb rate 10mbit ceil 10mbit\n")
            batch.write(f"filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst {t.dest_ip}/32 flowid 1:{0x10 + i:x}\n")
        batch.close()

        def tc_batch() -> None:
            tc_apply.clear(ns, "eth0")
            subprocess.run(["ip", "netns", "exec", ns, "tc", "-batch", batch.name], check=True)

        t_batch = _timed(tc_batch, reps)
        rows.append(["tc -batch (one process)", f"{statistics.median(t_batch):.3f}", f"{min(t_batch):.3f}", "-"])

        from pyroute2 import IPRoute

        def pyroute2_sync() -> None:
            tc_apply.clear(ns, "eth0")
            with IPRoute(netns=ns, flags=0) as ipr:
                ipr.tc("add", "htb", 2, 0x10000, default=1)
                for i, t in enumerate(targets):
                    ipr.tc("add-class", "htb", 2, 0x10000 | (0x10 + i), parent=0x10000, rate="10mbit", ceil="10mbit")
                    ipr.tc("add-filter", "u32", 2, parent=0x10000, prio=1, protocol=0x0800, target=0x10000 | (0x10 + i),
                           keys=[f"0x{socket.inet_aton(t.dest_ip).hex()}/0xffffffff+16"])

        t_py = _timed(pyroute2_sync, 1)
        rows.append(["pyroute2, one synchronous request per rule", f"{t_py[0]:.3f}", f"{t_py[0]:.3f}", "-"])

        def tc_per_rule() -> None:
            tc_apply.clear(ns, "eth0")
            for line in open(batch.name).read().splitlines()[:201]:
                subprocess.run(["ip", "netns", "exec", ns, "tc", *line.split()], check=True)

        t_proc = _timed(tc_per_rule, 1)[0] * 1000 / 100
        rows.append(["one tc process per rule (100 rules, extrapolated)", f"{t_proc:.2f}", f"{t_proc:.2f}", "-"])
        os.unlink(batch.name)
    finally:
        checked_reset(host)
    return rows


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def agent_memory() -> list[list[Any]]:
    from controller.agent_client import AgentClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_urlsafe(24)
    state = tempfile.mkdtemp(prefix="edgetb-bench-agent-")
    env = dict(os.environ, EDGETB_TOKEN=token, EDGETB_STATE_DIR=state)
    proc = subprocess.Popen([sys.executable, "-m", "worker.agent", "--port", str(port), "--bind", "127.0.0.1",
                             "--id", "bag" + secrets.token_hex(1), "--subnet", "10.253.0.0/16"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    client = AgentClient(f"http://127.0.0.1:{port}", token)
    rows = []
    try:
        for _ in range(100):
            try:
                client.health()
                break
            except Exception:
                time.sleep(0.05)
        client.status()
        rows.append(["idle", rss_kib(proc.pid) // 1024])
        nodes = client.create_nodes({"version": 1, "nodes": [{"name": f"n{i}"} for i in range(100)]})["nodes"]
        client.set_links({"version": 1, "links": [{"src": a["name"], "dst": b["name"], "dst_ip": b["ip"],
                                                   "shape": {"rate_bps": 10**7}} for a in nodes for b in nodes if a is not b]})
        client.status()
        rows.append(["after 100 nodes + 9,900 shaped links", rss_kib(proc.pid) // 1024])
    finally:
        try:
            client.reset()
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 10 and 100 only, one repetition")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    reps = 1 if args.quick else 5
    print(f"# edgetb emulation-core benchmarks ({os.uname().release}, {os.cpu_count()} cores)\n")

    sizes = [(10, None), (100, None)] + ([] if args.quick else [(500, 10)])
    rows = []
    for n, degree in sizes:
        log(f"bring-up of {n} nodes")
        rows.append(bring_up(n, degree))
    print("## Bring-up: nodes created, every link shaped and verified\n")
    print(table(["nodes", "graph", "directed links", "nodes s", "shaping + verify s", "total s", "target"], rows))

    log("1,000 rules on one node")
    print(f"\n## 1,000 per-destination rules (HTB class + u32 filter) on one node, median and best of {reps}\n")
    print(table(["method", "median s", "best s", "target"], rules_1000(reps)))

    log("agent memory")
    print("\n## Agent memory (RSS)\n")
    print(table(["agent state", "RSS MiB"], agent_memory()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

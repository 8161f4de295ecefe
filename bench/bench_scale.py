"""Gossip learning at scale: hundreds to a thousand netns nodes on one host, with and without
bridge netfilter.

Run as root: ``.venv/bin/python bench/bench_scale.py [--nodes 250 500 1000] [--rounds 5]
[--netfilter off on]``. Each size runs ``gl_run.py --auto`` in a scratch experiment directory: a
random graph of out-degree 10 with links of 200-500 KB/s, digits in EdgeTB's per-node format
with overlapping shard windows (300 training samples per node, whatever the number of nodes),
the numpy model. With ``--netfilter on`` the run goes with ``br_netfilter`` loaded and
``net.bridge.bridge-nf-call-iptables=1`` (what dockerd sets: every frame crossing the bridge
goes through iptables), with ``off`` with that setting 0; the setting (and the module) are
restored afterwards.

Measured: ready s (start of gl_run.py until every node answers), run s (start of the run until
it ends) and rounds per minute over it, wall s; each node process's USS (its own pages), PSS (shared pages shared out) and RSS
from ``/proc/<pid>/smaps_rollup``, mean and max over nodes of each node's peak; the controller's
CPU seconds and peak RSS (on one host it is also the worker) and the zygote's; the kernel's ARP
resolution failures and unresolved drops (``/proc/net/stat/arp_cache``: host-wide, so anything
else running counts too), the most neighbour entries of the nodes' namespaces seen unresolved
(incomplete or failed) at once, and the nodes' ``send_failed`` events. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's worker (neighbour tables)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gossip import graph  # noqa: E402
from dml_app.runtime.events import read_events  # noqa: E402
SHARD_SIZE = 100  # digits' training split (1,437 samples) gives 14 shards, its test split 3
TRAIN_SHARDS, TEST_SHARDS = 14, 3
TRAIN_LEN = 3  # 300 training samples per node
BR_NF_CALL = "/proc/sys/net/bridge/bridge-nf-call-iptables"
SAMPLE_EVERY_S = 10.0
TICKS = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# the experiment ----------------------------------------------------------------------------------
def experiment(workdir: str, n: int, rounds: int, seed: int = 0) -> None:
    names = graph(workdir, n, rounds, seed)  # bench_gossip's graph and structure
    # EdgeTB's per-node format: overlapping windows of consecutive shards, so every node trains on
    # TRAIN_LEN shards however many nodes share the 14
    windows: dict[str, Any] = {name: {"train_start_index": i % (TRAIN_SHARDS - TRAIN_LEN + 1) + 1,
                                      "train_len": TRAIN_LEN, "test_start_index": i % TEST_SHARDS + 1,
                                      "test_len": 1, "batch_size": 32} for i, name in enumerate(names)}
    windows["_settings"] = {"dataset": "digits", "shard_size": SHARD_SIZE}
    with open(os.path.join(workdir, "gl_dataset.json"), "w") as f:
        json.dump(windows, f)


# measuring ---------------------------------------------------------------------------------------
def memory_kib(pid: int) -> Optional[tuple[int, int, int]]:
    """(USS, PSS, RSS) of a process in KiB, or None when it is gone."""
    values = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
                    values[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if "Rss" not in values:
        return None
    return values.get("Private_Clean", 0) + values.get("Private_Dirty", 0), values.get("Pss", 0), values["Rss"]


def cpu_s(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_kib(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def zygote_pids(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"worker.confinement.zygote" in f.read():
                    found.append(int(entry))
        except (OSError, ValueError):
            pass
    return found


def arp_stats() -> dict[str, int]:
    """The kernel's ARP table counters, summed over CPUs (hexadecimal in the file)."""
    with open("/proc/net/stat/arp_cache") as f:
        header = f.readline().split()
        totals = dict.fromkeys(header, 0)
        for line in f:
            for key, value in zip(header, line.split()):
                totals[key] += int(value, 16)
    return totals


def unresolved_neighbours(testbed: str, nodes: list[str]) -> int:
    """How many neighbour entries of the nodes' namespaces are being resolved or failed now."""
    from worker.nodes import netns_neighbours as neighbours

    count = 0
    for node in nodes:
        try:
            entries = neighbours.read(f"etb-{testbed}-{node}")
        except Exception:  # noqa: BLE001 - a node gone at the end of the run
            continue
        count += sum(1 for e in entries if e.state & (NUD_INCOMPLETE | NUD_FAILED))
    return count


NUD_INCOMPLETE, NUD_FAILED = 0x01, 0x20


def send_failures(workdir: str) -> tuple[int, dict[str, int]]:
    """The nodes' send_failed events: how many, and how many of each kind of error."""
    count, kinds = 0, {}
    for path in glob.glob(os.path.join(workdir, "dml_file", "log", "*", "events", "*.jsonl")):
        for event in read_events(path):
            if event["type"] == "send_failed":
                count += 1
                kind = str(event.get("error", ""))[:60]
                kinds[kind] = kinds.get(kind, 0) + 1
    return count, kinds


def phase_times(out: str, started_at: float) -> str:
    """Seconds (to the second, from gl_run.py's time stamps) from its start (``started_at``, a
    ``time.time()``) to ``creating`` nodes (reading the files, writing confs and shards), from
    there to ``starting`` their processes (the network), and from there to ``ready``."""
    import re

    local = time.localtime(started_at)
    marks: dict[str, int] = {"first": local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec}
    for line in out.splitlines():
        m = re.match(r"\[(\d\d):(\d\d):(\d\d)\] (\w+)", line)
        if m:
            t = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
            if m[4] in ("creating", "starting", "ready"):
                marks.setdefault(m[4], t)
    if not {"first", "creating", "starting", "ready"} <= set(marks):
        return "-"
    return (f"{(marks['creating'] - marks['first']) % 86400} + {(marks['starting'] - marks['creating']) % 86400} "
            f"+ {(marks['ready'] - marks['starting']) % 86400}")


# bridge netfilter -----------------------------------------------------------------------------
class BridgeNetfilter:
    """Set ``net.bridge.bridge-nf-call-iptables`` (loading br_netfilter first when it is a module
    not loaded yet); ``restore`` puts the value, and the module, back as they were."""

    def __init__(self) -> None:
        self.loaded = False
        self.value_before: Optional[str] = None

    def set(self, on: bool) -> None:
        if not os.path.exists(BR_NF_CALL):
            if not on:
                return  # no bridge netfilter at all: off already
            subprocess.run(["modprobe", "br_netfilter"], check=True)
            self.loaded = True
        with open(BR_NF_CALL) as f:
            self.value_before = f.read().strip()
        with open(BR_NF_CALL, "w") as f:
            f.write("1" if on else "0")

    def restore(self) -> None:
        if self.value_before is not None and os.path.exists(BR_NF_CALL):
            with open(BR_NF_CALL, "w") as f:
                f.write(self.value_before)
        if self.loaded:
            subprocess.run(["modprobe", "-r", "br_netfilter"], capture_output=True)


def free_subnet() -> str:
    """A 10.1xx.0.0/16 that no interface of this host uses (the tests take 10.200 and up)."""
    from tests.subnets import free_subnets

    free = free_subnets(range(160, 200))
    if not free:
        raise SystemExit("bench: no free 10.1xx.0.0/16 subnet")
    return free[0]


# one run ---------------------------------------------------------------------------------------
def run(n: int, rounds: int, netfilter: bool, timeout_s: int, use_zygote: bool = True) -> dict[str, Any]:
    import requests

    workdir = tempfile.mkdtemp(prefix=f"edgetb-scale-{n}-")
    os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
    experiment(workdir, n, rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"), EDGETB_ZYGOTE="1" if use_zygote else "0")
    load_before = os.getloadavg()
    arp_before = arp_stats()
    started, started_at = time.monotonic(), time.time()
    testbed = "bs" + secrets.token_hex(1)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "gl_run.py"), "--auto", "--quiet-nodes",
                             "--workdir", workdir, "--port", str(port), "--id", testbed,
                             "--subnet", free_subnet(), "--timeout", str(timeout_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[str, tuple[int, int, int]] = {}
    t_ready = t_running = t_end = None
    controller_cpu = zygote_cpu = None
    controller_rss = 0
    zygote_mem = (0, 0, 0)
    last_sample = 0.0
    loads = []
    unresolved = 0
    out_lines: list[str] = []
    import threading

    reader = threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            status = requests.get(f"http://127.0.0.1:{port}/status", timeout=10).json()
        except (requests.RequestException, ValueError):
            time.sleep(1)
            continue
        now = time.monotonic()
        if status["phase"] in ("ready", "running", "finished") and t_ready is None:
            t_ready = now - started
        if status["phase"] == "running" and t_running is None:
            t_running = now
        if status["phase"] in ("finished", "failed") and t_end is None and t_running is not None:
            t_end = now
        controller_cpu = cpu_s(proc.pid) or controller_cpu
        controller_rss = max(controller_rss, peak_rss_kib(proc.pid) or 0)
        for z in zygote_pids(proc.pid):
            zygote_cpu = cpu_s(z) or zygote_cpu
            zygote_mem = tuple(max(a, b) for a, b in zip(zygote_mem, memory_kib(z) or (0, 0, 0)))  # type: ignore
        if t_ready is not None and now - last_sample >= SAMPLE_EVERY_S and status["phase"] in ("ready", "running"):
            last_sample = now
            loads.append(os.getloadavg()[0])
            unresolved = max(unresolved, unresolved_neighbours(testbed, [node["name"] for node in status["nodes"]]))
            for node in status["nodes"]:
                mem = memory_kib(node["pid"]) if node.get("pid") else None
                if mem:
                    old = peaks.get(node["name"], (0, 0, 0))
                    peaks[node["name"]] = tuple(max(a, b) for a, b in zip(old, mem))  # type: ignore
        time.sleep(0.2 if t_ready is None else 2)  # ready to a fifth of a second
    reader.join(timeout=30)
    total = time.monotonic() - started
    out = "".join(out_lines)
    if os.environ.get("BENCH_SCALE_OUTPUT"):  # gl_run.py's output kept, to read its time stamps
        with open(os.environ["BENCH_SCALE_OUTPUT"], "a") as f:
            f.write(out)
    arp_after = arp_stats()
    done = sum(1 for line in out.splitlines() if line.split()[:1] and line.split()[0].startswith("n")
               and line.rstrip().endswith("done"))
    if proc.returncode != 0:
        log(out[-3000:])
    phases = phase_times(out, started_at)
    fails, kinds = send_failures(workdir)
    if os.environ.get("BENCH_SCALE_KEEP"):  # the run folder kept, to read its events
        log(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)

    def stat(i: int) -> str:
        if not peaks:
            return "-"
        values = [p[i] / 1024 for p in peaks.values()]
        return f"{sum(values) / len(values):.1f} / {max(values):.1f}"

    return {"nodes": n, "netfilter": "on" if netfilter else "off", "start": "zygote" if use_zygote else "exec",
            "done": f"{done}/{n}",
            "ready_s": t_ready, "phases": phases, "run_s": (t_end or time.monotonic()) - t_running if t_running else None,
            "rounds": rounds,
            "wall_s": total, "uss": stat(0), "pss": stat(1), "rss": stat(2),
            "controller": f"{controller_cpu or 0:.0f} s, {controller_rss / 1024:.0f} MiB",
            "zygote": f"{zygote_cpu or 0:.1f} s, USS {zygote_mem[0] / 1024:.0f} / RSS {zygote_mem[2] / 1024:.0f} MiB",
            "arp_failed": arp_after.get("res_failed", 0) - arp_before.get("res_failed", 0),
            "arp_unresolved": arp_after.get("unresolved_discards", 0) - arp_before.get("unresolved_discards", 0),
            "nodes_unresolved": unresolved, "send_failed": fails, "send_failed_kinds": kinds,
            "load": f"{load_before[0]:.1f} / {max(loads, default=load_before[0]):.1f}",
            "exit": proc.returncode}


def fmt(value: Any) -> str:
    return f"{value:.0f}" if isinstance(value, float) else str(value if value is not None else "-")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[250, 500, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--netfilter", nargs="+", choices=("off", "on"), default=["off", "on"])
    parser.add_argument("--timeout", type=int, default=3600, help="gl_run.py --timeout per run")
    parser.add_argument("--exec", action="store_true", help="start nodes as fresh processes, not from the zygote "
                        "(EDGETB_ZYGOTE=0), for comparison")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    rows = []
    for n in args.nodes:
        for mode in args.netfilter:
            nf = BridgeNetfilter()
            log(f"gossip with {n} nodes, bridge netfilter {mode}")
            try:
                nf.set(mode == "on")
                rows.append(run(n, args.rounds, mode == "on", args.timeout, use_zygote=not args.exec))
            finally:
                nf.restore()
            log(json.dumps(rows[-1]))
    print("| nodes | bridge netfilter | node start | nodes done | ready s | confs + network + starts s | run s | rounds per min | wall s | USS MiB per node, mean / max "
          "| PSS MiB, mean / max | RSS MiB, mean / max | controller CPU, peak RSS | zygote CPU, memory "
          "| host ARP failed / unresolved drops | nodes' unresolved entries, max | send_failed | load before / peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_min = f"{r['rounds'] / (r['run_s'] / 60):.2f}" if r["run_s"] else "-"
        cells = [r["nodes"], r["netfilter"], r["start"], r["done"], r["ready_s"], r["phases"], r["run_s"], per_min,
                 r["wall_s"], r["uss"], r["pss"],
                 r["rss"], r["controller"], r["zygote"], f"{r['arp_failed']} / {r['arp_unresolved']}",
                 r["nodes_unresolved"], r["send_failed"], r["load"]]
        print("| " + " | ".join(fmt(c) for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue 47's targets for Flower runs: the same app (examples/flower/numpy_app), the same
isolation (``--isolation process``), N SuperNodes, R rounds:

- edgetb: ``flwr_run.py --auto`` over links of ``--rate`` (1 Gbit/s), command to exit (nodes,
  links, Flower, the run folder and the teardown all counted);
- Flower's own deployment: the SuperLink, the SuperNodes and their SuperExecs as plain processes
  of this host on loopback, ``flwr run`` of the same app, first process to the run's end; in a
  CPU cgroup of their own (``bench-flower-plain``), as edgetb's nodes are in theirs: under other
  load the kernel shares CPU between groups first, and processes left in the root group would
  each weigh what all of edgetb's nodes weigh together (``--plain-in-root-cgroup``: so);
- the bytes each SuperLink->SuperNode link carried a round (edgetb's telemetry) against the
  serialised model (the ArrayRecord's bytes, as flwr serialises it);
- per SuperNode node, the peak cgroup memory the telemetry read (``memory.usage_in_bytes`` or
  ``memory.current``: page cache included), and the peaks of the group's own ``memory.stat``
  read here every second: anonymous memory (the processes' own) apart from page cache (file).

    sudo .venv/bin/python bench/bench_flower.py                 # 4 SuperNodes, 3 rounds, 1 Gbit/s
    sudo .venv/bin/python bench/bench_flower.py --turns 2       # plain, edgetb, plain, edgetb
    sudo .venv/bin/python bench/bench_flower.py --padding-values 500000 --fraction-evaluate 0 --no-plain
    sudo .venv/bin/python bench/bench_flower.py --supernodes 50 --rounds 3 --no-plain
    sudo EDGETB_FLWR_SUPERLINK_CPU_WEIGHT=100 .venv/bin/python bench/bench_flower.py ...  # the SuperLink's node weighed as any

On a netns host Flower's programs are forked from the Flower fork server of their Python
(``worker.confinement.flower_forks``): its peak resident memory (the pages the nodes share, charged
outside them) is ``fork_server_rss_peak_mb``.

``--padding-values N`` sends N float32 zeros with the model (the app's ``padding-values``): a
model of about 4N bytes. ``--fraction-evaluate 0`` leaves out federated evaluation: FedAvg's
evaluate message carries the model too, so with it a SuperNode receives the model twice a round.
The bytes a round are everything the telemetry counted on the SuperLink->SuperNode link from the
deployment to the end (registration, polling, heartbeats, every message and its model), divided
by the rounds.

Targets: edgetb within 1.2x of the plain processes' wall time; 1.00-1.10x of the ArrayRecord a
round a link; 50 SuperNodes, 3 rounds within 10 minutes, <= 150 MB per SuperNode node.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP = os.path.join(ROOT, "examples", "flower", "numpy_app")


def experiment(workdir: str, python: str, supernodes: int, rounds: int, rate: str,
               extra: dict[str, object]) -> list[str]:
    """An experiment directory: the app, links from n1 to every SuperNode, the structure, a dataset."""
    names = [f"n{i}" for i in range(2, supernodes + 2)]
    shutil.copytree(APP, os.path.join(workdir, "app"))
    links = {"n1": [{"dest": n, "bw": rate} for n in names], **{n: [{"dest": "n1", "bw": rate}] for n in names}}
    with open(os.path.join(workdir, "links.json"), "w") as f:
        json.dump(links, f)
    with open(os.path.join(workdir, "flwr_dataset.json"), "w") as f:
        json.dump({"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}, f)
    with open(os.path.join(workdir, "flwr_structure.json"), "w") as f:
        json.dump({"app": "app", "python": python, "node_list": ["n1", *names],
                   "run_config": {"num-server-rounds": rounds, **extra}}, f)
    return names


class MemoryStat:
    """The peaks of each node's cgroup ``memory.stat`` (anonymous and file), read every second."""

    def __init__(self, tb: str, names: list[str]) -> None:
        v1 = f"/sys/fs/cgroup/memory/edgetb-{tb}"
        self.base = v1 if os.path.isdir("/sys/fs/cgroup/memory") else f"/sys/fs/cgroup/edgetb-{tb}"
        self.names = names
        self.peak: dict[str, dict[str, int]] = {}
        self.server_rss_peak = 0  # the Flower fork server's resident memory (its shared pages: outside the nodes)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _read(self, node: str) -> dict[str, int]:
        try:
            with open(os.path.join(self.base, node, "memory.stat")) as f:
                stat = dict(line.split() for line in f if line.strip())
        except OSError:
            return {}
        anon = stat.get("total_rss", stat.get("rss", stat.get("anon")))  # v1, v2
        file = stat.get("total_cache", stat.get("cache", stat.get("file")))
        return {"anon": int(anon), "file": int(file)} if anon is not None and file is not None else {}

    def _server_rss(self) -> int:
        total = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"worker.confinement.flower_forks" not in f.read():
                        continue
                with open(f"/proc/{pid}/status") as f:
                    status = dict(line.split(":", 1) for line in f if ":" in line)
                with open(f"/proc/{status['PPid'].strip()}/cmdline", "rb") as f:
                    forked = b"worker.confinement.flower_forks" in f.read()
                if not forked:  # the server (its forked programs carry its command line)
                    total += int(status["VmRSS"].split()[0]) * 1024
            except (OSError, KeyError, ValueError):
                continue
        return total

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            self.server_rss_peak = max(self.server_rss_peak, self._server_rss())
            for node in self.names:
                for key, value in self._read(node).items():
                    peak = self.peak.setdefault(node, {})
                    peak[key] = max(peak.get(key, 0), value)

    def __enter__(self) -> "MemoryStat":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def run_edgetb(workdir: str, tb: str, port: int, names: list[str], turn: int,
               subnet: str = "10.231.0.0/16") -> tuple[float, dict[str, dict[str, int]]]:
    """Command to exit; the peaks of each SuperNode node's memory.stat."""
    log = os.path.join(workdir, f"edgetb-{turn}.log")
    started = time.monotonic()
    with MemoryStat(tb, names) as mem, open(log, "w") as out:
        done = subprocess.run([sys.executable, os.path.join(ROOT, "flwr_run.py"), "--workdir", workdir, "--id", tb,
                               "--subnet", subnet, "--port", str(port), "-d", "flwr_dataset.json", "--auto",
                               "--timeout", "1800", "--telemetry-period-ms", "500"],
                              stdout=out, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state")))
    wall_s = time.monotonic() - started
    mem.peak["fork server"] = {"rss": mem.server_rss_peak}
    if done.returncode != 0:
        with open(log) as f:
            raise SystemExit(f"edgetb run failed ({done.returncode}):\n{f.read()[-4000:]}")
    return wall_s, mem.peak


PLAIN_GROUP = "bench-flower-plain"


def cpu_group() -> str:
    """A CPU cgroup of its own for the plain processes (v1 ``cpu`` or v2), made here: under other
    load, the kernel shares CPU between groups first, and edgetb's nodes are all in one group
    (``edgetb-<id>``), so plain processes left in the root group would each weigh what all of
    edgetb's nodes weigh together."""
    base = "/sys/fs/cgroup/cpu" if os.path.isdir("/sys/fs/cgroup/cpu") else "/sys/fs/cgroup"
    group = os.path.join(base, PLAIN_GROUP)
    os.makedirs(group, exist_ok=True)
    return group


def run_plain(workdir: str, python: str, names: list[str], rounds: int, shards: dict[str, str],
              extra: dict[str, object], turn: int, group: str = "") -> float:
    """Flower's own deployment on loopback: SuperLink, SuperNodes, SuperExecs, ``flwr run``
    (in CPU cgroup ``group`` when given)."""
    bin_dir = os.path.join(python, "bin")
    home = os.path.join(workdir, f"plain-{turn}")
    os.makedirs(home)
    with open(os.path.join(home, "config.toml"), "w") as f:
        f.write('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:19092"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=home, PYTHONUNBUFFERED="1", FLWR_TELEMETRY_ENABLED="0", PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    procs: list[subprocess.Popen] = []
    logs = open(os.path.join(home, "processes.log"), "w")

    superlink_log = open(os.path.join(home, "superlink.log"), "w")

    def join_group() -> None:  # (in the child, before exec)
        if group:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def start(argv: list[str], own_env: dict[str, str], out: object = logs) -> subprocess.Popen:
        p = subprocess.Popen(argv, env=own_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                             preexec_fn=join_group)
        procs.append(p)
        return p

    started = time.monotonic()
    try:
        start([f"{bin_dir}/flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
               "--database", os.path.join(home, "superlink.db"), "--host", "127.0.0.1", "--port", "19092"], env,
              superlink_log)
        for i, name in enumerate(names):
            node_home = os.path.join(home, name)
            os.makedirs(node_home)
            node_env = dict(env, FLWR_HOME=node_home)
            conf = f'partition-id={i} num-partitions={len(names)} data-path="{shards[name]}"'
            port = 20000 + i
            start([f"{bin_dir}/flower-supernode", "--insecure", "--superlink", "127.0.0.1:19092", "--isolation",
                   "process", "--host", "127.0.0.1", "--port", str(port), "--node-config", conf], node_env)
            start([f"{bin_dir}/flower-superexec", "--insecure", "--runtime-api-address", f"127.0.0.1:{port}"], node_env)
        deadline = time.monotonic() + 300
        while True:  # every SuperNode registered, as edgetb waits for it
            with open(os.path.join(home, "superlink.log")) as f:
                if f.read().count("Activated node_id") >= len(names):
                    break
            if time.monotonic() > deadline:
                raise SystemExit("the plain SuperNodes did not register within 300 s")
            time.sleep(0.5)
        done = subprocess.run([f"{bin_dir}/flwr", "run", os.path.join(workdir, "app"), "local", "--stream",
                               "--run-config", " ".join(f"{k}={v}" for k, v in
                                                        {"num-server-rounds": rounds, **extra}.items())], env=env, capture_output=True,
                              text=True, timeout=1800, preexec_fn=join_group)
        wall_s = time.monotonic() - started
        if done.returncode != 0 or f"[ROUND {rounds}/{rounds}]" not in done.stdout:
            raise SystemExit(f"plain Flower run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return wall_s
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        logs.close()
        superlink_log.close()


def array_record_bytes(python: str, padding_values: int) -> int:
    """The serialised ArrayRecord of the app's initial model, as flwr serialises it."""
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from flwr.app import ArrayRecord\n"
            "from flwr.common.serde import array_record_to_proto\n"
            "from numpy_app import task\n"
            "weights = task.initial_weights(int(sys.argv[2]))\n"
            "print(len(array_record_to_proto(ArrayRecord(weights)).SerializeToString()))\n")
    done = subprocess.run([os.path.join(python, "bin", "python3"), "-c", code, APP, str(padding_values)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return int(done.stdout.strip())


def link_bytes(run_dir: str) -> dict[tuple[str, str], int]:
    sent: dict[tuple[str, str], int] = {}
    with gzip.open(os.path.join(run_dir, "telemetry", "links.csv.gz"), "rt") as f:
        for r in csv.DictReader(f):
            key = (r["src"], r["dst"])
            sent[key] = max(sent.get(key, 0), int(r["tx_bytes"] or 0))
    return sent


def peak_memory(run_dir: str) -> dict[str, int]:
    peak: dict[str, int] = {}
    path = os.path.join(run_dir, "telemetry", "nodes.csv.gz")
    if not os.path.exists(path):
        return peak
    with gzip.open(path, "rt") as f:
        for r in csv.DictReader(f):
            if r.get("mem_bytes"):
                peak[r["node"]] = max(peak.get(r["node"], 0), int(float(r["mem_bytes"])))
    return peak


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--supernodes", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--python", default="/opt/edgetb-flwr")
    p.add_argument("--port", type=int, default=3391)
    p.add_argument("--subnet", default="10.231.0.0/16", help="the nodes' subnet (one no other testbed uses)")
    p.add_argument("--padding-values", type=int, default=0, help="float32 zeros sent with the model")
    p.add_argument("--fraction-evaluate", type=float, default=1.0, help="0: no federated evaluation")
    p.add_argument("--turns", type=int, default=1, help="plain then edgetb, this many times in turn")
    p.add_argument("--no-plain", action="store_true", help="edgetb only (the 50-node run)")
    p.add_argument("--plain-in-root-cgroup", action="store_true",
                   help="leave the plain processes in this process's CPU cgroup (not one of their own)")
    p.add_argument("--keep", help="keep the experiment directory here")
    a = p.parse_args()
    workdir = a.keep or tempfile.mkdtemp(prefix="bench-flower-")
    os.makedirs(workdir, exist_ok=True)
    os.chmod(workdir, 0o755)
    extra: dict[str, object] = {"padding-values": a.padding_values, "fraction-evaluate": a.fraction_evaluate}
    names = experiment(workdir, a.python, a.supernodes, a.rounds, a.rate, extra)
    shards = {n: os.path.join(workdir, "dataset", "digits", f"{n}.npz") for n in names}
    model = array_record_bytes(a.python, a.padding_values)
    out: dict[str, object] = {"supernodes": a.supernodes, "rounds": a.rounds, "rate": a.rate,
                              "array_record_bytes": model, "fraction_evaluate": a.fraction_evaluate, "turns": []}
    group = "" if a.no_plain or a.plain_in_root_cgroup else cpu_group()
    out["plain_cpu_group"] = group or None
    for turn in range(a.turns):
        row: dict[str, object] = {"load_before": round(os.getloadavg()[0], 1)}
        if not a.no_plain and os.path.isdir(os.path.join(workdir, "dataset")):
            row["plain_s"] = round(run_plain(workdir, a.python, names, a.rounds, shards, extra, turn, group), 1)
        edgetb_s, mem = run_edgetb(workdir, "fb", a.port, names, turn, a.subnet)
        row["edgetb_s"] = round(edgetb_s, 1)
        if not a.no_plain and "plain_s" not in row:  # (the first turn: the shards exist once edgetb wrote them)
            row["plain_s"] = round(run_plain(workdir, a.python, names, a.rounds, shards, extra, turn, group), 1)
        if "plain_s" in row:
            row["ratio"] = round(edgetb_s / float(row["plain_s"]), 3)  # type: ignore[arg-type]
        logs = os.path.join(workdir, "dml_file", "log")
        run_dir = os.path.join(logs, sorted(os.listdir(logs))[-1])
        sent = link_bytes(run_dir)
        per_round = [sent.get(("n1", n), 0) / a.rounds for n in names]
        row.update(down_bytes_per_round_median=sorted(per_round)[len(per_round) // 2],
                   down_ratio_min=round(min(per_round) / model, 3), down_ratio_max=round(max(per_round) / model, 3))
        peak = peak_memory(run_dir)
        if peak:
            row["mem_peak_mb_max"] = round(max(peak.get(n, 0) for n in names) / 1e6, 1)
        server = mem.pop("fork server", {}).get("rss", 0)
        if mem:
            row["anon_peak_mb_max"] = round(max(m.get("anon", 0) for m in mem.values()) / 1e6, 1)
            row["file_peak_mb_max"] = round(max(m.get("file", 0) for m in mem.values()) / 1e6, 1)
        row["fork_server_rss_peak_mb"] = round(server / 1e6, 1)
        with open(os.path.join(run_dir, "run.json")) as f:
            record = json.load(f)
        row.update(ended=record.get("ended"), rounds_done=record.get("rounds"))
        row["load_after"] = round(os.getloadavg()[0], 1)
        out["turns"].append(row)  # type: ignore[union-attr]
        print(json.dumps(row), flush=True)
    print(json.dumps(out))
    if group:
        try:
            os.rmdir(group)
        except OSError as e:
            print(f"the cgroup {group} is left: {e}", file=sys.stderr)
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

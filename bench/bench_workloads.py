"""EdgeTB's 147-node gossip shape with EdgeTB's Fashion-MNIST CNN, in numpy, Keras and PyTorch.

Run as root: ``.venv/bin/python bench/bench_workloads.py [--nodes 147] [--rounds 5] [--mnist-subset]
[--variants numpy keras torch] [--model edgetb_fashion_cnn|lenet5]``.

The shape of ``bench/bench_gossip_edgetb.py`` (random symmetric links of 200-500 KB/s, at most 10
a node, EdgeTB's per-node dataset format in shards of 100 samples), with the model
``edgetb_fashion_cnn`` (about 0.23 M parameters; ``--model lenet5``: LeNet-5, about 61 k) of each kind. The data: Fashion-MNIST when
``dataset/fashion_mnist/`` holds its files, else the MNIST subset that ``--mnist-subset``
writes (the same shape: 28x28x1, 10 classes). Each node trains ``--train-shards`` shards a round.

Each variant runs ``gl_run.py`` in a scratch directory, driven over HTTP like a user: the time to
``ready`` (nodes made, processes started, confs pushed: the model built on every node), the
memory of every node process once all have run a round (trained and evaluated: USS, the pages only
that process holds, its median, mean and max; PSS; how many node processes were alive then, and
their threads), whether the host's zygote had the framework's library mapped (it preloads
TensorFlow or PyTorch for the nodes it forks), rounds per minute of the run phase, the median ``train_s``, the mean final global
accuracy, and where the run's time went (``breakdown``: the node processes' CPU in training and
evaluation from the rounds' ``phases`` against the host's busy CPU and the run's wall time on its
cores, the first round, the wait for the last node). Before the Keras variant at full size, a small run measures a Keras node's USS and the
variant is skipped when the machine's available memory could not hold ``--nodes`` of them.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import requests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gossip_edgetb import MNIST_NPZ, free_port, log, symmetric_links, write_mnist_subset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from controller.results.run_dir import read_run_events  # noqa: E402

FASHION_DIR = os.path.join(ROOT, "dataset", "fashion_mnist")
SHARD = 100
MEM_SHARE = 0.8  # of the available memory, the most a variant's nodes may need


def dataset_source() -> tuple[str, str]:
    """(dataset name, directory to copy) for the run: Fashion-MNIST's files, else the MNIST subset."""
    if glob.glob(os.path.join(FASHION_DIR, "*")):
        return "fashion_mnist", FASHION_DIR
    if os.path.exists(MNIST_NPZ):
        return "mnist", os.path.dirname(MNIST_NPZ)
    raise SystemExit("bench: no Fashion-MNIST files in dataset/fashion_mnist/ and no MNIST subset: "
                     "run with --mnist-subset")


def experiment(workdir: str, n: int, rounds: int, kind: str, dataset: str, train_shards: int, bn_momentum: float,
               global_test: int, model: str = "edgetb_fashion_cnn") -> None:
    rng = random.Random(0)
    names = [f"n{i}" for i in range(1, n + 1)]
    with open(os.path.join(workdir, "links.json"), "w") as f:
        json.dump(symmetric_links(names, 10, rng), f)
    with open(os.path.join(workdir, "gl_structure.json"), "w") as f:
        json.dump({"sync": rounds, "wait_s": 5, "model": {"kind": kind, "name": model, "seed": 0,
                                                          "bn_momentum": bn_momentum},
                   "node_list": [{"name": x, "epoch": 1} for x in names]}, f)
    train_total, test_total = (40, 10) if dataset == "mnist" else (600, 100)  # shards of 100
    per_node = {x: {"train_len": train_shards, "train_start_index": rng.randint(1, train_total - train_shards + 1),
                    "test_len": 1, "test_start_index": rng.randint(1, test_total), "batch_size": 32} for x in names}
    with open(os.path.join(workdir, "gl_dataset.json"), "w") as f:
        json.dump({**per_node, "_settings": {"dataset": dataset, "shard_size": SHARD, "global_test_size": global_test}},
                  f)


def memory_kib(pid: int) -> Optional[tuple[int, int]]:
    """(USS, PSS) of a process in KiB, from /proc/<pid>/smaps_rollup; None when it is gone."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1])
    except OSError:
        return None
    return fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0), fields.get("Pss", 0)


def threads(pid: int) -> Optional[int]:
    """How many threads a process has (``/proc/<pid>/task``); None when it is gone."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None


FRAMEWORK_LIBS = {"keras": "libtensorflow", "torch": "libtorch_cpu"}  # kind -> a library its zygote preloads


def zygote_maps(node_pid: int, kind: str) -> Optional[bool]:
    """Whether the zygote that forked ``node_pid`` (its parent) has ``kind``'s framework library
    mapped: it was preloaded, shared by the nodes. None when there is nothing to check."""
    lib = FRAMEWORK_LIBS.get(kind)
    if lib is None:
        return None
    try:
        with open(f"/proc/{node_pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/maps") as f:
            return lib in f.read()
    except (OSError, ValueError, IndexError):
        return None


def busy_cpu_s() -> float:
    """The host's CPU seconds spent on anything but idle and iowait since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _phase_cpu_s(spans: list) -> float:
    return sum(s[3] - s[2] for s in spans if isinstance(s, list) and len(s) == 4)


def breakdown(run_dir: str, run_s: float, busy_s: float) -> dict[str, Any]:
    """Where a run's time went, from its nodes' ``round`` events: the CPU seconds the node processes
    spent training and evaluating (the phases' CPU clocks), that CPU spread over the host's cores
    (the compute floor of the run, in seconds), the host's busy CPU over the run on its cores, the
    first round's wall time (the slowest node's end) and how long the run went on after the median
    node's last round (stragglers)."""
    train_cpu = eval_cpu = wait_wall = 0.0
    first_end, last_ends = [], []
    t0 = None
    for events in read_run_events(run_dir).values():
        rounds = [e for e in events if e.get("type") == "round"]
        for e in rounds:
            phases = e.get("phases") or {}
            train_cpu += _phase_cpu_s(phases.get("train", []))
            eval_cpu += _phase_cpu_s(phases.get("evaluate", []))
            wait_wall += sum(s[1] - s[0] for s in phases.get("wait", []) if isinstance(s, list) and len(s) >= 2)
            start = e.get("t_start")
            t0 = start if t0 is None or (start is not None and start < t0) else t0
        if rounds:
            first_end.append(rounds[0]["t_end"])
            last_ends.append(rounds[-1]["t_end"])
    cores = os.cpu_count() or 1
    if not last_ends or t0 is None:
        return {}
    return {"train_cpu_s": train_cpu, "eval_cpu_s": eval_cpu, "floor_s": (train_cpu + eval_cpu) / cores,
            "busy_s": busy_s / cores, "first_round_s": max(first_end) - t0,
            "straggle_s": max(last_ends) - statistics.median(last_ends), "wait_s_node": wait_wall / len(last_ends),
            "run_s": run_s}


def available_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))


def run(n: int, rounds: int, kind: str, train_shards: int, timeout_s: float, bn_momentum: float = 0.99,
        global_test: int = 500, model: str = "edgetb_fashion_cnn") -> dict[str, Any]:
    dataset, source = dataset_source()
    workdir = tempfile.mkdtemp(prefix=f"edgetb-workloads-{kind}-{n}-")
    os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
    shutil.copytree(source, os.path.join(workdir, "dataset", dataset))
    experiment(workdir, n, rounds, kind, dataset, train_shards, bn_momentum, global_test, model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"))
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "gl_run.py"), "--quiet-nodes", "--workdir", workdir,
                             "--port", str(port), "--id", "bw" + secrets.token_hex(1), "--subnet", "10.242.0.0/16"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result: dict[str, Any] = {"variant": kind, "nodes": n, "model": model}
    try:
        status = wait(url, ("ready",), timeout_s, proc)
        result["ready_s"] = time.monotonic() - started
        busy_at_start = busy_cpu_s()
        requests.get(url + "/start", timeout=120)
        uss, pss, tasks, preloaded = [], [], [], None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # the nodes' memory once every node has run a round
            status = requests.get(url + "/status", timeout=120).json()
            if status["phase"] in ("finished", "failed") or all(x.get("round", 0) >= 1 for x in status["nodes"]):
                pids = [x["pid"] for x in status["nodes"] if x.get("pid")]
                found = [memory_kib(pid) for pid in pids]
                uss = [u for u, _ in filter(None, found)]
                pss = [p for _, p in filter(None, found)]
                tasks = list(filter(None, (threads(pid) for pid in pids)))
                preloaded = zygote_maps(pids[0], kind) if pids else None
                break
            time.sleep(1)
        wait(url, ("finished", "failed"), timeout_s, proc)
        busy = busy_cpu_s() - busy_at_start
        summary = requests.get(url + "/finish", timeout=600).json()
        run_dir = summary["run_dir"]
        with open(os.path.join(run_dir, "run.json")) as f:
            record = json.load(f)
        with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
            train_s = [float(r["train_s"]) for r in csv.DictReader(f) if r.get("train_s")]
        run_s = float(record["ended_at"]) - float(record["started_at"])
        accuracies = [x["final_global_accuracy"] for x in summary["nodes"] if x.get("final_global_accuracy") is not None]
        done = sum(1 for x in summary["nodes"] if x["ended"] == "done")
        result.update(run_s=run_s, rounds_per_min=rounds / (run_s / 60), done=f"{done}/{n}",
                      train_s=statistics.median(train_s) if train_s else None,
                      accuracy=statistics.mean(accuracies) if accuracies else None,
                      uss_mib=statistics.median(uss) / 1024 if uss else None,
                      uss_mean_mib=statistics.mean(uss) / 1024 if uss else None,
                      uss_max_mib=max(uss) / 1024 if uss else None, alive=f"{len(uss)}/{n}",
                      threads=statistics.median(tasks) if tasks else None, zygote_preloaded=preloaded,
                      pss_mib=statistics.median(pss) / 1024 if pss else None, dataset=dataset,
                      breakdown=breakdown(run_dir, run_s, busy))
    finally:
        try:
            requests.get(url + "/emulated/reset", timeout=300)
        except requests.RequestException:
            pass
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if "done" not in result:
            log(out[-3000:])
        shutil.rmtree(workdir, ignore_errors=True)
    result["wall_s"] = time.monotonic() - started
    return result


def wait(url: str, phases: tuple[str, ...], timeout_s: float, proc: subprocess.Popen) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"bench: gl_run.py exited {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            status = requests.get(url + "/status", timeout=120).json()
            if status["phase"] in phases:
                return status
        except requests.RequestException:
            pass
        time.sleep(1)
    raise SystemExit(f"bench: the run never reached {phases}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=147)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--train-shards", type=int, default=1, help="shards of 100 samples a node trains a round")
    parser.add_argument("--variants", nargs="+", choices=("numpy", "keras", "torch"), default=["numpy", "keras"])
    parser.add_argument("--model", choices=("edgetb_fashion_cnn", "lenet5"), default="edgetb_fashion_cnn",
                        help="the built-in network every variant runs")
    parser.add_argument("--probe-nodes", type=int, default=8, help="the small Keras run that sizes a node")
    parser.add_argument("--mnist-subset", action="store_true", help="write the MNIST subset if missing")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--bn-momentum", type=float, default=0.99, help="the model's bn_momentum (EdgeTB's: 0.99)")
    parser.add_argument("--global-test", type=int, default=500,
                        help="global test samples every node evaluates every round (EdgeTB: none)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    if args.mnist_subset and not os.path.exists(MNIST_NPZ):
        write_mnist_subset()
    results = []
    for kind in args.variants:
        if kind == "keras" and args.nodes > args.probe_nodes:
            log(f"sizing a Keras node: {args.probe_nodes} nodes, 2 rounds")
            probe = run(args.probe_nodes, 2, kind, args.train_shards, args.timeout, args.bn_momentum, args.global_test,
                        args.model)
            results.append({**probe, "variant": "keras (sizing)"})
            per_node_kib = max(probe.get("uss_max_mib") or 0, probe.get("pss_mib") or 0) * 1024
            fit = int(MEM_SHARE * available_kib() / per_node_kib) if per_node_kib else args.nodes
            if fit < args.nodes:
                log(f"{args.nodes} Keras nodes need about {per_node_kib * args.nodes / 2**20:.1f} GiB, "
                    f"{available_kib() / 2**20:.1f} GiB available: running the {fit} that fit")
            n = min(fit, args.nodes)
        else:
            n = args.nodes
        log(f"{n} gossip nodes, {args.rounds} rounds, {args.model} in {kind}")
        results.append(run(n, args.rounds, kind, args.train_shards, args.timeout, args.bn_momentum, args.global_test,
                           args.model))
        log(json.dumps(results[-1]))
    print(f"EdgeTB's gossip shape with {args.model}: {args.rounds} rounds, "
          f"{args.train_shards * SHARD} training samples a node, bn_momentum {args.bn_momentum}, "
          f"{args.global_test} global test samples, {results[0].get('dataset') if results else '-'}\n")
    columns = [("variant", "{}"), ("nodes", "{}"), ("done", "{}"), ("ready_s", "{:.0f}"), ("run_s", "{:.0f}"),
               ("rounds_per_min", "{:.2f}"), ("train_s", "{:.2f}"), ("uss_mib", "{:.0f}"), ("uss_mean_mib", "{:.1f}"),
               ("uss_max_mib", "{:.0f}"), ("pss_mib", "{:.0f}"), ("alive", "{}"), ("threads", "{:.0f}"),
               ("zygote_preloaded", "{}"), ("accuracy", "{:.3f}"), ("wall_s", "{:.0f}")]
    print("| " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results:
        print("| " + " | ".join("-" if r.get(k) is None else fmt.format(r[k]) for k, fmt in columns) + " |")
    print("\nwhere the run's time went (s; CPU summed over the nodes, floor and busy on the host's "
          f"{os.cpu_count()} cores)\n")
    keys = ("run_s", "floor_s", "busy_s", "train_cpu_s", "eval_cpu_s", "first_round_s", "straggle_s", "wait_s_node")
    print("| variant | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for r in results:
        b = r.get("breakdown") or {}
        print(f"| {r['variant']} | " + " | ".join("-" if b.get(k) is None else f"{b[k]:.1f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

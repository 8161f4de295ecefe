"""Issue 47's targets for Flower runs: the same app (examples/flower/numpy_app), the same
isolation (``--isolation process``), N SuperNodes, R rounds:

- edgetb: ``flwr_run.py --auto`` over links of ``--rate`` (1 Gbit/s), command to exit (nodes,
  links, Flower, the run folder and the teardown all counted);
- Flower's own deployment: the SuperLink, the SuperNodes and their SuperExecs as plain processes
  of this host on loopback, ``flwr run`` of the same app, first process to the run's end;
- the bytes each SuperLink->SuperNode link carried a round (edgetb's telemetry) against the
  serialised model (the ArrayRecord's bytes, as flwr serialises it);
- per SuperNode node, the peak cgroup memory the telemetry read.

    sudo .venv/bin/python bench/bench_flower.py                 # 4 SuperNodes, 3 rounds, 1 Gbit/s
    sudo .venv/bin/python bench/bench_flower.py --supernodes 50 --rounds 3

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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP = os.path.join(ROOT, "examples", "flower", "numpy_app")


def experiment(workdir: str, python: str, supernodes: int, rounds: int, rate: str) -> list[str]:
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
                   "run_config": {"num-server-rounds": rounds}}, f)
    return names


def run_edgetb(workdir: str, tb: str, port: int) -> float:
    started = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "flwr_run.py"), "--workdir", workdir, "--id", tb,
                           "--subnet", "10.231.0.0/16", "--port", str(port), "-d", "flwr_dataset.json", "--auto",
                           "--timeout", "1200", "--telemetry-period-ms", "500"],
                          capture_output=True, text=True, env=dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state")))
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"edgetb run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall_s


def run_plain(workdir: str, python: str, names: list[str], rounds: int, shards: dict[str, str]) -> float:
    """Flower's own deployment on loopback: SuperLink, SuperNodes, SuperExecs, ``flwr run``."""
    bin_dir = os.path.join(python, "bin")
    home = os.path.join(workdir, "plain")
    os.makedirs(home)
    with open(os.path.join(home, "config.toml"), "w") as f:
        f.write('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:19092"\ninsecure = true\n')
    env = dict(os.environ, FLWR_HOME=home, PYTHONUNBUFFERED="1", PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
    procs: list[subprocess.Popen] = []
    logs = open(os.path.join(home, "processes.log"), "w")

    superlink_log = open(os.path.join(home, "superlink.log"), "w")

    def start(argv: list[str], own_env: dict[str, str], out: object = logs) -> subprocess.Popen:
        p = subprocess.Popen(argv, env=own_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
                               "--run-config", f"num-server-rounds={rounds}"], env=env, capture_output=True,
                              text=True, timeout=1800)
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


def array_record_bytes(python: str) -> int:
    """The serialised ArrayRecord of the app's initial model, as flwr serialises it."""
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from flwr.app import ArrayRecord\n"
            "from flwr.common.serde import array_record_to_proto\n"
            "from numpy_app import task\n"
            "print(len(array_record_to_proto(ArrayRecord(task.initial_weights())).SerializeToString()))\n")
    done = subprocess.run([os.path.join(python, "bin", "python3"), "-c", code, APP], capture_output=True, text=True)
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
    p.add_argument("--no-plain", action="store_true", help="edgetb only (the 50-node run)")
    p.add_argument("--keep", help="keep the experiment directory here")
    a = p.parse_args()
    workdir = a.keep or tempfile.mkdtemp(prefix="bench-flower-")
    os.makedirs(workdir, exist_ok=True)
    os.chmod(workdir, 0o755)
    names = experiment(workdir, a.python, a.supernodes, a.rounds, a.rate)
    edgetb_s = run_edgetb(workdir, "fb", a.port)
    (run_dir,) = [os.path.join(workdir, "dml_file", "log", d) for d in os.listdir(os.path.join(workdir, "dml_file", "log"))]
    out = {"supernodes": a.supernodes, "rounds": a.rounds, "rate": a.rate, "edgetb_s": round(edgetb_s, 1)}
    if not a.no_plain:
        shards = {n: os.path.join(workdir, "dataset", "digits", f"{n}.npz") for n in names}
        plain_s = run_plain(workdir, a.python, names, a.rounds, shards)
        out.update(plain_s=round(plain_s, 1), ratio=round(edgetb_s / plain_s, 3))
    model = array_record_bytes(a.python)
    sent = link_bytes(run_dir)
    per_round = [sent.get(("n1", n), 0) / a.rounds for n in names]
    out.update(array_record_bytes=model, down_bytes_per_round_median=sorted(per_round)[len(per_round) // 2],
               down_ratio_min=round(min(per_round) / model, 2), down_ratio_max=round(max(per_round) / model, 2))
    mem = peak_memory(run_dir)
    if mem:
        out["supernode_peak_mem_mb_max"] = round(max(mem.get(n, 0) for n in names) / 1e6, 1)
    print(json.dumps(out))
    if not a.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Federated learning round time against the ideal: do sends and uploads overlap?

Run as root: ``.venv/bin/python bench/bench_fl.py [--trainers 50] [--params 1000000] [--rounds 3]``.
One aggregator and N trainers on a star of 10 Mbit/s links (both directions),
a numpy MLP of about ``--params`` parameters, every trainer picked every round,
one epoch on its digits shard. For each round the aggregator's events give the
round time; the ideal is the model's transfer down plus up at the link rate,
plus the slowest trainer's training and the aggregation (FedAvg and
evaluation). Sending to the trainers one after another would take N times the
transfer. Prints a Markdown table; the target is a ratio <= 1.15.

``--access 10mbit`` gives the aggregator an uplink and a downlink at that rate
(nodes.json), shared by all its trainers, as an edge server's access link is:
the ideal is then every trainer's model through the access link each way
(N transfers down and N up at the access rate) plus the compute.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from controller.model.units import parse_rate_bps  # noqa: E402
from dml_app.runtime.events import read_events  # noqa: E402

RATE_BPS = 10_000_000
TARGET_RATIO = 1.15


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def experiment(workdir: str, trainers: int, params: int, rounds: int, access: str = "") -> int:
    """Write links, structure and dataset files; returns the hidden layer width."""
    names = [f"t{i}" for i in range(1, trainers + 1)]
    links = {"agg": [{"dest": t, "bw": "10mbit"} for t in names]}
    links.update({t: [{"dest": "agg", "bw": "10mbit"}] for t in names})
    hidden = max(1, round((params - 10) / (64 + 1 + 10)))  # 64 -> hidden -> 10 on digits
    structure = {"model": {"kind": "numpy", "hidden": [hidden], "learning_rate": 0.001, "seed": 0},
                 "node_list": [{"name": "agg", "sync": rounds, "trainer_fraction": 1.0, "deadline_s": 600,
                                "quorum": 1.0}] + [{"name": t, "epoch": 1} for t in names]}
    files = [("links.json", links), ("fl_structure.json", structure),
             ("fl_dataset.json", {"dataset": "digits", "split": "iid", "batch_size": 64})]
    if access:
        files.append(("nodes.json", {"nodes": [{"name": "agg", "uplink": access, "downlink": access}]
                                     + [{"name": t} for t in names]}))
    for name, data in files:
        with open(os.path.join(workdir, name), "w") as f:
            json.dump(data, f)
    return hidden


def run(trainers: int, params: int, rounds: int, access: str = "") -> list[list[str]]:
    workdir = tempfile.mkdtemp(prefix=f"edgetb-fl-{trainers}-")
    os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
    try:
        hidden = experiment(workdir, trainers, params, rounds, access)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"))
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "fl_run.py"), "--auto", "--quiet-nodes",
                               "--workdir", workdir, "--port", str(port), "--id", "bf" + secrets.token_hex(1),
                               "--subnet", "10.241.0.0/16", "--timeout", "1800",
                               *(["--nodes", "nodes.json"] if access else [])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            log(proc.stdout[-3000:])
            raise SystemExit(f"bench: fl_run.py exited {proc.returncode}")
        run_dir = max(os.scandir(os.path.join(workdir, "dml_file", "log")), key=lambda e: e.stat().st_mtime).path
        events = {n[:-len(".jsonl")]: read_events(os.path.join(run_dir, "events", n))
                  for n in os.listdir(os.path.join(run_dir, "events"))}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    n_params = 64 * hidden + hidden + hidden * 10 + 10
    rows = []
    for agg in (e for e in events["agg"] if e["type"] == "round"):
        r = agg["round"]
        trained = [e for t, ev in events.items() if t != "agg" for e in ev if e["type"] == "round" and e["round"] == r]
        model_bytes = agg["bytes_sent"] / len(agg["picked"])
        transfer_s = model_bytes * 8 / min(RATE_BPS, parse_rate_bps(access) if access else RATE_BPS)
        train_s = max(e["train_s"] for e in trained)
        shared = len(trained) if access else 1  # transfers that queue on the aggregator's access link
        ideal_s = 2 * transfer_s * shared + train_s + agg["aggregate_s"]
        round_s = agg["t_end"] - agg["t_start"]
        sequential_s = 2 * transfer_s * len(trained)
        ratio = round_s / ideal_s
        rows.append([str(trainers), f"{n_params:,}", str(r), f"{model_bytes / 1e6:.2f}", f"{round_s:.2f}",
                     f"{transfer_s * shared:.2f} + {transfer_s * shared:.2f}", f"{train_s:.2f}", f"{agg['aggregate_s']:.2f}",
                     f"{ideal_s:.2f}", f"{ratio:.3f}", f"{sequential_s:.0f}",
                     "met" if ratio <= TARGET_RATIO else "NOT met"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainers", type=int, default=50)
    parser.add_argument("--params", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--access", default="", help="the aggregator's uplink and downlink, e.g. 10mbit")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    log(f"FL: {args.trainers} trainers, about {args.params:,} parameters, {args.rounds} rounds")
    started = time.monotonic()
    rows = run(args.trainers, args.params, args.rounds, args.access)
    log(f"done in {time.monotonic() - started:.0f} s")
    print("| trainers | parameters | round | model MB | round s | transfer down + up s | slowest train s "
          "| aggregate s | ideal s | round / ideal | one after another s | target <= 1.15 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the adaptation monitors cost a ring all-reduce round, beside KungFu's published figures.

Run as root: ``.venv/bin/python bench/bench_monitors.py [--nodes 8] [--rounds 24] [--model mlp|cnn]``.

Each variant runs ``ra_run.py --auto`` in a scratch directory (netns nodes, the links of a full
mesh at ``--rate``, the digits data set): the noise scale every round and ``grad_var`` never,
every 8 rounds, every round (``monitor_every`` 0, 8, 1). Every ring round event carries
``monitor_s`` (the seconds its monitors took, on the round's path), so their cost is their share
of the round's seconds, on every node; the table gives the median share over the nodes, split
into the noise scale (rounds without ``grad_var``) and the rounds with it.
KungFu (OSDI'20, section 6) reports its monitors' cost as lost throughput: noise scale 4.6 %,
gradient variance 20 % every step and 3 % every 8 steps.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's event reader

from dml_app.runtime.events import read_events  # noqa: E402

MODELS = {"mlp": {"kind": "numpy", "hidden": [128], "learning_rate": 0.005, "seed": 0},
          "cnn": {"kind": "numpy", "name": "lenet5", "learning_rate": 0.002, "seed": 0}}
KUNGFU = {0: "4.6 % (noise scale)", 8: "3 % (variance every 8 steps)", 1: "20 % (variance every step)"}


def write_experiment(workdir: str, nodes: int, rounds: int, model: str, rate: str, monitor_every: int) -> None:
    names = [f"n{i}" for i in range(1, nodes + 1)]
    links = {a: [{"dest": b, "bw": rate} for b in names if b != a] for a in names}
    structure = {"sync": rounds, "strategy": "ring", "monitor_every": monitor_every, "model": MODELS[model],
                 "node_list": [{"name": n, "epoch": 1} for n in names]}
    dataset = {"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}
    for name, data in (("links.json", links), ("ra_structure.json", structure), ("ra_dataset.json", dataset)):
        with open(os.path.join(workdir, name), "w") as f:
            json.dump(data, f)


def run_variant(args: argparse.Namespace, monitor_every: int, port: int) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix="edgetb-monitors-")
    os.chmod(workdir, 0o755)  # (the node processes read it as their own users)
    try:
        write_experiment(workdir, args.nodes, args.rounds, args.model, args.rate, monitor_every)
        started = time.monotonic()
        out = subprocess.run([sys.executable, os.path.join(ROOT, "ra_run.py"), "--workdir", workdir, "--auto",
                              "--id", "bmon", "--port", str(port)], capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise SystemExit(f"monitor_every={monitor_every}: the run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        wall_s = time.monotonic() - started
        shares, gns_shares, var_shares, durations = [], [], [], []
        for path in glob.glob(os.path.join(workdir, "dml_file", "node", "*", "*.jsonl")):
            rounds = [e for e in read_events(path) if e["type"] == "round" and "monitor_s" in e]
            rounds = rounds[1:]  # the first round carries the start-up
            if not rounds:
                continue
            round_s = [e["t_end"] - e["t_start"] for e in rounds]
            durations += round_s
            shares.append(sum(e["monitor_s"] for e in rounds) / sum(round_s))
            plain = [(e["monitor_s"], d) for e, d in zip(rounds, round_s) if e.get("grad_var") is None]
            with_var = [(e["monitor_s"], d) for e, d in zip(rounds, round_s) if e.get("grad_var") is not None]
            if plain:
                gns_shares.append(sum(m for m, _ in plain) / sum(d for _, d in plain))
            if with_var:
                var_shares.append(sum(m for m, _ in with_var) / sum(d for _, d in with_var))
        return {"monitor_every": monitor_every, "wall_s": wall_s, "round_s": statistics.median(durations),
                "share": statistics.median(shares),
                "gns_share": statistics.median(gns_shares) if gns_shares else None,
                "var_share": statistics.median(var_shares) if var_shares else None}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--model", choices=tuple(MODELS), default="mlp")
    p.add_argument("--rate", default="20mbit", help="every link's rate (default 20mbit)")
    p.add_argument("--port", type=int, default=3397)
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the nodes are network namespaces")
    rows = [run_variant(args, every, args.port) for every in (0, 8, 1)]
    print(f"\nmonitors of a {args.nodes}-node ring all-reduce, {args.model}, {args.rounds} rounds, links {args.rate}")
    print(f"{'grad_var':>15}{'round s':>10}{'monitors':>11}{'noise scale':>13}{'with grad_var':>15}"
          f"  KungFu's cost")
    for r in rows:
        every = {0: "never", 1: "every round"}.get(r["monitor_every"], f"every {r['monitor_every']}")
        print(f"{every:>15}{r['round_s']:>10.3f}{pct(r['share']):>11}{pct(r['gns_share']):>13}"
              f"{pct(r['var_share']):>15}  {KUNGFU[r['monitor_every']]}")


if __name__ == "__main__":
    main()

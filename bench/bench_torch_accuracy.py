"""Accuracy parity of the model kinds: EdgeTB's Fashion-MNIST CNN in numpy, Keras and PyTorch, gossip
on the shapes image set, a few seeds each.

Run as root: ``.venv/bin/python bench/bench_torch_accuracy.py [--seeds 0 1 2] [--kinds numpy keras torch]``.

Each run is ``gl_run.py`` on netns nodes driven like the e2e tier drives it (``tests/e2e/harness.py``):
``--nodes`` gossip nodes in a ring of 20 Mbit/s links, the shapes set (``dml_tool/shapes_dataset.py``,
``--size`` x ``--size`` grey images of four shapes, 300 training images a node, written into the
experiment directory), ``--rounds`` rounds of ``--epochs`` epochs, ``edgetb_fashion_cnn`` with
``bn_momentum`` 0.9. A seed is the run's: the model's (its initial weights), the split's and the
images' (so the kinds meet the same seeds, paired). The figure is each run's mean final global
accuracy over its nodes (every node evaluates the same global test set), then the mean per kind.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dml_tool import shapes_dataset  # noqa: E402
from tests.e2e.harness import Run  # noqa: E402
from tests.e2e.test_algorithms import run_to_end  # noqa: E402

PER_NODE_TRAIN, TEST, GLOBAL_TEST = 300, 400, 300
FRAMEWORKS = {"keras": "tensorflow", "torch": "torch"}


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def ring(names: list[str]) -> dict[str, list[dict[str, str]]]:
    n = len(names)
    return {a: [{"dest": names[(i + 1) % n], "bw": "20mbit"}, {"dest": names[(i - 1) % n], "bw": "20mbit"}]
            for i, a in enumerate(names)}


def run(tmp: Path, kind: str, seed: int, nodes: int, rounds: int, epochs: int, size: int,
        timeout_s: float) -> dict[str, Any]:
    names = [f"n{i}" for i in range(1, nodes + 1)]
    structure = {"sync": rounds, "wait_s": 3, "epoch": epochs,
                 "model": {"kind": kind, "name": "edgetb_fashion_cnn", "seed": seed, "bn_momentum": 0.9},
                 "node_list": [{"name": n} for n in names]}
    dataset = {"dataset": "shapes.npz", "split": "iid", "seed": seed, "batch_size": 32,
               "global_test_size": GLOBAL_TEST}
    r = Run(tmp, structure=structure, links=ring(names), dataset=dataset, defer=True)
    shapes_dataset.write(str(r.workdir / "shapes.npz"), PER_NODE_TRAIN * nodes, TEST, size, seed)
    started = time.monotonic()
    r.start()
    try:
        summary, _ = run_to_end(r, timeout_s=timeout_s)
    finally:
        out = r.close()
    finals = [n["final_global_accuracy"] for n in summary["nodes"] if n.get("final_global_accuracy") is not None]
    done = sum(1 for n in summary["nodes"] if n["ended"] == "done")
    if done < nodes:
        log(out[-3000:])
    return {"kind": kind, "seed": seed, "done": f"{done}/{nodes}", "accuracy": statistics.mean(finals) if finals else None,
            "min": min(finals) if finals else None, "wall_s": time.monotonic() - started}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=("numpy", "keras", "torch"), default=["numpy", "keras", "torch"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--size", type=int, default=16, help="image side in pixels")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a run may take")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root (network namespaces, tc)")
    kinds = [k for k in args.kinds if k not in FRAMEWORKS or importlib.util.find_spec(FRAMEWORKS[k]) is not None]
    results = []
    with tempfile.TemporaryDirectory(prefix="edgetb-accuracy-") as tmp:
        os.chmod(tmp, 0o755)  # node processes run as their own uids and read it
        for seed in args.seeds:  # seed by seed: a kind's runs spread over the run's whole span of load
            for kind in kinds:
                log(f"{kind}, seed {seed}: {args.nodes} gossip nodes, {args.rounds} rounds x {args.epochs} epochs")
                results.append(run(Path(tmp), kind, seed, args.nodes, args.rounds, args.epochs, args.size, args.timeout))
                log(str(results[-1]))
    print(f"Gossip, {args.nodes} nodes in a ring, shapes {args.size}x{args.size} ({PER_NODE_TRAIN} training images "
          f"a node, {GLOBAL_TEST} global test), {args.rounds} rounds x {args.epochs} epochs, edgetb_fashion_cnn, "
          "bn_momentum 0.9: mean final global accuracy of the nodes\n")
    print("| kind | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean | min node | done | wall s (mean) |")
    print("|---|" + "---|" * (len(args.seeds) + 4))
    for kind in kinds:
        mine = [r for r in results if r["kind"] == kind]
        accs = [r["accuracy"] for r in mine if r["accuracy"] is not None]
        cells = ["-" if r["accuracy"] is None else f"{r['accuracy']:.3f}" for r in mine]
        mins = [r["min"] for r in mine if r["min"] is not None]
        print(f"| {kind} | " + " | ".join(cells) + f" | {statistics.mean(accs) if accs else float('nan'):.3f} | "
              f"{min(mins) if mins else float('nan'):.3f} | "
              f"{', '.join(r['done'] for r in mine)} | {statistics.mean(r['wall_s'] for r in mine):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

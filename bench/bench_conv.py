"""The numpy Fashion-MNIST CNN's training and evaluation time per 100 samples, against an older
revision of its layers, and how far the two revisions' gradients differ.

Run: ``.venv/bin/python bench/bench_conv.py [--baseline REV] [--repeat 5] [--model NAME]``.

A node's round: one epoch over 100 samples (28x28x1) in batches of 32, ``edgetb_fashion_cnn``
(bn_momentum 0.9; ``--model`` for another built-in CNN, on 28x28x1 or CIFAR's 32x32x3), one thread (as nodes run: OPENBLAS_NUM_THREADS=1). ``--baseline REV`` loads
``dml_app/models/numpy/layers.py`` as it was at git revision REV and times both nets in turns, in
the same process, so that the machine's load falls on both alike; each training starts with the
memory kept after the last call given back, its evaluation follows it (as in a node's round).
Reported: the median (and the range) of ``--repeat`` timings of each, wall and CPU milliseconds,
the time per layer of one batch (the fastest of the repeats), and the relative error between the
two revisions' gradients of one batch (same seed, same weights) in float32 and in float64. Before and after the timings, a
fixed reference (``reference_ms``: float32 matrix products and an elementwise pass, one thread)
says how fast the host's CPU ran then (its speed swings with the load of other machines).
"""
from __future__ import annotations

import os

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")  # before numpy: one thread, as a node

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from dml_app.models.architectures import architecture  # noqa: E402
from dml_app.models.numpy import layers as current_layers  # noqa: E402
from dml_app.models.numpy.heap import give_back, reuse_freed_memory  # noqa: E402
from dml_app.models.numpy.net import Sequential  # noqa: E402

SHAPES = {"edgetb_fashion_cnn": (28, 28, 1), "lenet5": (28, 28, 1), "edgetb_cifar10_cnn": (32, 32, 3)}
CLASSES = 10
CONF = {"seed": 0, "bn_momentum": 0.9}
LAYERS_PATH = "dml_app/models/numpy/layers.py"


def layers_at(rev: str) -> ModuleType:
    """``layers.py`` as it was at git revision ``rev``, imported under another name."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{LAYERS_PATH}"], check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="bench-conv-"), "layers_baseline.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("layers_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def network(name: str, layers: ModuleType, dtype: str = "float32") -> Sequential:
    """Built-in network ``name`` made of ``layers``' classes (as ``build_numpy`` makes it)."""
    kinds = {"conv2d": layers.Conv2D, "batch_normalization": layers.BatchNormalization,
             "max_pooling2d": layers.MaxPool2D, "flatten": layers.Flatten, "dense": layers.Dense}
    steps = architecture(name, SHAPES[name], CLASSES, CONF)
    return Sequential([kinds[kind](**opts) for kind, opts in steps], SHAPES[name], seed=CONF["seed"], dtype=dtype)


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000


def per_layer_ms(net: Sequential, x: np.ndarray, repeat: int) -> list[tuple[str, float, float]]:
    """(layer, forward ms, backward ms) of one training batch, the fastest of ``repeat`` (reusing
    freed memory, as ``Sequential.train`` does)."""
    forward: dict[str, list[float]] = {layer.name: [] for layer in net.layers}
    backward: dict[str, list[float]] = {layer.name: [] for layer in net.layers}
    with reuse_freed_memory():
        _per_layer_runs(net, x, repeat, forward, backward)
    return [(layer.name, min(forward[layer.name]), min(backward[layer.name])) for layer in net.layers]


def _per_layer_runs(net: Sequential, x: np.ndarray, repeat: int, forward: dict[str, list[float]],
                    backward: dict[str, list[float]]) -> None:
    for _ in range(repeat):
        h = x
        for layer in net.layers:
            started = time.perf_counter()
            h = layer.forward(h, True)
            forward[layer.name].append((time.perf_counter() - started) * 1000)
        delta = np.full(h.shape, 1.0 / len(h), h.dtype)
        for depth, layer in enumerate(reversed(net.layers)):
            started = time.perf_counter()
            delta = layer.backward(delta, need_dx=depth < len(net.layers) - 1)
            backward[layer.name].append((time.perf_counter() - started) * 1000)


def gradient_error(name: str, baseline: ModuleType, x: np.ndarray, y: np.ndarray, dtype: str
                   ) -> tuple[float, float]:
    """The largest relative error (norm of the difference over the larger norm) between the two
    revisions' gradients of one batch, over the arrays: (weights, input)."""
    new, old = network(name, current_layers, dtype), network(name, baseline, dtype)
    old.set_weights(new.get_weights())
    _, grads_new, dx_new = new.gradients(x, y, need_dx=True)
    _, grads_old, dx_old = old.gradients(x, y, need_dx=True)

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        a, b = a.astype(np.float64), b.astype(np.float64)
        return float(np.linalg.norm(a - b) / max(np.linalg.norm(a), np.linalg.norm(b), 1e-30))

    worst = max(rel(a, b) for a, b in zip(grads_new, grads_old) if a is not None)
    return worst, rel(dx_new, dx_old)


def reference_ms(repeat: int = 5) -> float:
    """CPU ms of a fixed piece of work (100 products of 256x256 float32 matrices and 20 passes
    over 4 MiB of float32), the fastest of ``repeat``: the host's speed at the time."""
    a = np.ones((256, 256), np.float32)
    maps = np.ones(2**20, np.float32)

    def work() -> None:
        for _ in range(100):
            a @ a
        for _ in range(20):
            np.multiply(maps, 1.0001, out=maps)

    return min(timed(work)[1] for _ in range(repeat))


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision whose layers.py to time and compare against")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", choices=tuple(SHAPES), default="edgetb_fashion_cnn")
    args = parser.parse_args()
    data = np.random.default_rng(0)
    x = data.random((args.samples, *SHAPES[args.model]), dtype=np.float32)
    y = data.integers(0, CLASSES, args.samples)
    variants: dict[str, ModuleType] = {"current": current_layers}
    baseline: Optional[ModuleType] = None
    if args.baseline:
        baseline = layers_at(args.baseline)
        variants = {f"baseline {args.baseline}": baseline, "current": current_layers}
    nets = {label: network(args.model, module) for label, module in variants.items()}
    per_100 = 100.0 / args.samples
    train: dict[str, list[tuple[float, float]]] = {label: [] for label in nets}
    evaluate: dict[str, list[tuple[float, float]]] = {label: [] for label in nets}
    for net in nets.values():  # warm up
        net.train(x, y, 1, args.batch_size)
    reference_before = reference_ms()
    for _ in range(args.repeat):  # in turns: the machine's load falls on every variant alike
        for label, net in nets.items():
            give_back()  # a node's round starts after its wait: the memory kept after its last call given back
            wall, cpu = timed(lambda: net.train(x, y, 1, args.batch_size))
            train[label].append((wall * per_100, cpu * per_100))
            wall, cpu = timed(lambda: net.evaluate(x, y))
            evaluate[label].append((wall * per_100, cpu * per_100))
    reference_after = reference_ms()
    print(f"{args.model} on {SHAPES[args.model]}, {args.samples} samples in batches of {args.batch_size}, one thread; "
          f"median (range) of {args.repeat} runs, ms per 100 samples; the host's reference work "
          f"{reference_before:.1f} ms CPU before, {reference_after:.1f} after\n")
    print("| layers | train, wall | train, CPU | evaluate, wall | evaluate, CPU |")
    print("|---|---|---|---|---|")
    for label in nets:
        print(f"| {label} | {summary([w for w, _ in train[label]])} | {summary([c for _, c in train[label]])} "
              f"| {summary([w for w, _ in evaluate[label]])} | {summary([c for _, c in evaluate[label]])} |")
    batch = nets["current"].shaped(x[:args.batch_size])
    layer_times = {label: per_layer_ms(net, batch, max(3, args.repeat)) for label, net in nets.items()}
    print(f"\nper layer, one batch of {args.batch_size} (ms, fastest of the runs; forward / backward)\n")
    print("| layer | " + " | ".join(layer_times) + " |")
    print("|---|" + "---|" * len(layer_times))
    for i, layer in enumerate(nets["current"].layers):
        cells = [f"{times[i][1]:.2f} / {times[i][2]:.2f}" for times in layer_times.values()]
        print(f"| {layer.name} | " + " | ".join(cells) + " |")
    if baseline is not None:
        xb, yb = x[:args.batch_size], y[:args.batch_size]
        for dtype in ("float32", "float64"):
            weights, inputs = gradient_error(args.model, baseline, xb, yb, dtype)
            print(f"\ngradients against the baseline's, {dtype}: relative error {weights:.1e} (weights, "
                  f"the worst array), {inputs:.1e} (input)", end="")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A user's own files, run as a user runs them (``gl_run.py``/``fl_run.py``, ``--check`` where
nothing needs to run): a model file shaped as EdgeTB's (built when imported) with two lines of glue
beside it, an aggregation method, a model that starts differently on every build, data paths, and
every refusal naming the user's own file and the fix."""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from dml_tool import shapes_dataset
from tests.e2e.test_algorithms import rounds_of, run_to_end, star

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs .[tf]")
FILES = Path(__file__).parent / "user_files"
NODES = ["n1", "n2", "n3", "n4"]
RING = {a: [{"dest": NODES[(i + 1) % 4], "bw": "20mbit"}, {"dest": NODES[(i - 1) % 4], "bw": "20mbit"}]
        for i, a in enumerate(NODES)}
SHAPES_28 = {"dataset": "shapes.npz", "split": "iid", "seed": 0, "batch_size": 32, "global_test_size": 200}


def refused(r, *args: str) -> str:
    """The run script's output, once it has exited 2 (a refusal) having made nothing."""
    r.start(*args)
    assert r.proc.wait(timeout=180) == 2, r.proc.stdout.read()
    out = r.close()
    assert "dml_user/" not in out, out  # the user's own path, never the staged copy's
    return out


def checked(r) -> str:
    r.start("--check")
    assert r.proc.wait(timeout=180) == 0, r.proc.stdout.read()
    return r.close()


def with_edgetb_model(r):
    shutil.copytree(FILES / "nns", r.workdir / "nns")
    shapes_dataset.write(str(r.workdir / "shapes.npz"), 800, 200, 28, 0)
    return r


@needs_tf
def test_an_edgetb_model_file_runs_with_two_lines_of_glue(run):
    model = {"module": "nns/glue.py", "bn_momentum": 0.9, "seed": 0}  # no "kind": it is inferred
    structure = {"sync": 5, "wait_s": 2, "epoch": 3, "model": model, "node_list": [{"name": n} for n in NODES]}
    r = with_edgetb_model(run(structure=structure, links=RING, dataset=SHAPES_28, defer=True))
    r.start()
    summary, events = run_to_end(r, timeout_s=600)
    out = r.close()
    assert "your model: nns/glue.py, build(), kind keras (inferred" in out, out
    started = [next(e for e in events[n] if e["type"] == "started") for n in NODES]
    assert len({e["initial_weights_crc32"] for e in started}) == 1, started  # one start for every node
    assert all(n["ended"] == "done" and n["rounds"] == 5 for n in summary["nodes"]), summary["nodes"]
    final = [n["final_global_accuracy"] for n in summary["nodes"]]
    assert np.mean(final) >= 0.75, final  # bn_momentum reached the user's layers (at 0.99: near chance)


@needs_tf
def test_the_model_file_without_glue_is_refused_with_the_fix(run):
    structure = {"sync": 2, "model": {"module": "nns/nn_fashion_mnist.py"}, "node_list": [{"name": n} for n in NODES]}
    out = refused(with_edgetb_model(run(structure=structure, links=RING, dataset=SHAPES_28, defer=True)), "--check")
    assert "nns/nn_fashion_mnist.py: defines no function 'build' (it defines: FashionMnist, nn;" in out, out
    assert "def build(input_shape, n_classes, conf): return nn.model" in out, out


@needs_tf
def test_a_kind_that_does_not_match_the_model_says_which(run):
    structure = {"sync": 2, "model": {"module": "nns/glue.py", "kind": "numpy"},
                 "node_list": [{"name": n} for n in NODES]}
    out = refused(with_edgetb_model(run(structure=structure, links=RING, dataset=SHAPES_28, defer=True)), "--check")
    assert 'nns/glue.py: build returned a Functional, a model of kind keras' in out, out
    assert 'set "kind": "keras"' in out, out


def test_a_model_that_starts_differently_on_every_build_is_refused(run):
    source = ("import numpy as np\nfrom dml_app.model_numpy import NumpyMLP\n"
              "def build(input_shape, n_classes, conf):\n"
              "    return NumpyMLP([64, 16, n_classes], seed=int(np.random.default_rng().integers(1 << 30)))\n")
    structure = {"sync": 2, "model": {"module": "nns/m.py"}, "node_list": [{"name": n} for n in NODES]}
    r = run(structure=structure, links=RING, defer=True)
    (r.workdir / "nns").mkdir()
    (r.workdir / "nns" / "m.py").write_text(source)
    out = refused(r, "--auto")
    assert "nns/m.py: two builds with the same seed start from different weights" in out, out


AGGREGATION_METHOD = '''from dml_app.roles.fl import AggregatorRole


class Mine(AggregatorRole):
    def aggregation(self, current, updates, counts):
        return updates[0]
'''
AGGREGATE = '''import numpy as np
from dml_app.roles.fl import AggregatorRole


class Median(AggregatorRole):
    def aggregate(self, current, updates, counts):
        return [np.median(np.stack(arrays), axis=0).astype(arrays[0].dtype) for arrays in zip(*updates)]
'''


def test_an_aggregation_method_is_refused_and_aggregate_runs(run):
    trainers = NODES[1:]
    structure = {"model": {"kind": "numpy", "hidden": [32], "seed": 0},
                 "algorithm": {"module": "algos/agg.py", "role": "Mine"},
                 "node_list": [{"name": "n1", "sync": 3, "deadline_s": 60}] + [{"name": t, "epoch": 2} for t in trainers]}
    r = run(kind="fl", structure=structure, links=star("n1", trainers), defer=True)
    (r.workdir / "algos").mkdir()
    (r.workdir / "algos" / "agg.py").write_text(AGGREGATION_METHOD)
    out = refused(r, "--check")
    assert "algos/agg.py: Mine.aggregation (line 5) is a method, which the role never calls" in out, out
    assert "define aggregate(self, current, updates, counts) -> weights instead" in out, out

    r = run(kind="fl", structure={**structure, "algorithm": {"module": "algos/agg.py", "role": "Median"}},
            links=star("n1", trainers), defer=True)
    (r.workdir / "algos").mkdir()
    (r.workdir / "algos" / "agg.py").write_text(AGGREGATE)
    r.start()
    summary, events = run_to_end(r)
    out = r.close()
    assert "your algorithm: algos/agg.py, Median" in out, out
    rounds = rounds_of(events["n1"])
    assert len(rounds) == 3 and all(e["aggregation"] == "Median.aggregate" for e in rounds), rounds
    assert summary["nodes"][0]["final_global_accuracy"] >= 0.8, summary["nodes"]


DATA_MODULE = '''import numpy as np


def load():
    with np.load("{path}") as d:  # (relative: to the experiment directory)
        return d["x_train"], d["y_train"], d["x_test"], d["y_test"]
'''


def test_data_paths_a_user_writes(run):
    structure = {"sync": 2, "node_list": [{"name": n} for n in NODES]}
    r = run(structure=structure, links=RING, dataset={"dataset": {"module": "data/load.py"}}, defer=True)
    (r.workdir / "data").mkdir()
    shapes_dataset.write(str(r.workdir / "data" / "arrays.npz"), 200, 50, 8, 0)
    (r.workdir / "data" / "load.py").write_text(DATA_MODULE.format(path="data/arrays.npz"))
    assert "your data: data/load.py, load()" in checked(r)

    outside = r.workdir.parent / "outside"
    outside.mkdir()
    shapes_dataset.write(str(outside / "arrays.npz"), 200, 50, 8, 0)
    (r.workdir / "data" / "load.py").write_text(DATA_MODULE.format(path=outside / "arrays.npz"))
    out = refused(r, "--check")
    assert "data/load.py: load() failed: FileNotFoundError" in out and "(line 5)" in out, out
    assert "sees only that directory" in out, out

    r = run(structure=structure, links=RING, dataset={"dataset": str(outside / "arrays.npz")}, defer=True)
    out = refused(r, "--check")
    assert f"'{outside / 'arrays.npz'}': an absolute path; give a path relative to the experiment directory" in out
    assert "is not digits" not in out, out
    os.symlink(outside / "arrays.npz", r.workdir / "linked.npz")
    (r.workdir / "gl_dataset.json").write_text('{"dataset": "linked.npz"}')
    out = refused(r, "--check")
    assert "a symbolic link leads it out of the experiment directory" in out and "mount --bind" in out, out
    (r.workdir / "dataset").mkdir()
    os.symlink(outside, r.workdir / "dataset" / "mnist")  # the same rule for a built-in data set's files
    (r.workdir / "gl_dataset.json").write_text('{"dataset": "mnist"}')
    out = refused(r, "--check")
    assert "a symbolic link leads it out of the experiment directory" in out, out

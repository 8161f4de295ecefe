"""Workloads you bring, end to end on netns nodes with shaped links: EdgeTB's Fashion-MNIST CNN in
numpy and in Keras on an image set where a CNN must beat an MLP, your own model file, data file
and algorithm files, and bad user code refused before anything is made."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from controller.results.evaluate import load_safetensors
from dml_app.models.numpy.mlp import NumpyMLP
from dml_tool import shapes_dataset
from tests.e2e.harness import ROOT, Run
from tests.e2e.test_algorithms import rounds_of, run_to_end, star

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
HAS_TF = importlib.util.find_spec("tensorflow") is not None
NODES = ["n1", "n2", "n3", "n4"]
RING = {a: [{"dest": NODES[(i + 1) % 4], "bw": "20mbit"}, {"dest": NODES[(i - 1) % 4], "bw": "20mbit"}]
        for i, a in enumerate(NODES)}
SHAPES = {"dataset": "shapes.npz", "split": "iid", "seed": 0, "batch_size": 32, "global_test_size": 300}
TRAIN, TEST = 1200, 400  # images of the shapes set: 300 a node


def cnn(kind: str) -> dict:
    """EdgeTB's Fashion-MNIST CNN; its BN statistics move faster than Keras' default (0.99), as a run
    of a few hundred steps needs for its evaluation (which uses them) to mean anything."""
    return {"kind": kind, "name": "edgetb_fashion_cnn", "seed": 0, "bn_momentum": 0.9}


def mlp_accuracy(epochs: int) -> float:
    """What an MLP trained on all of the shapes set at once reaches: the bar a CNN must clear."""
    x, y = shapes_dataset.make(TRAIN, 16, 0)
    xt, yt = shapes_dataset.make(TEST, 16, 1)
    model = NumpyMLP([256, 128, 4], 0.005, "adam", 0)
    model.train(x, y, epochs, 32)
    return model.evaluate(xt, yt)[1]


def with_shapes(r: Run) -> Run:
    shapes_dataset.write(str(r.workdir / "shapes.npz"), TRAIN, TEST, 16, 0)
    return r


def copy_example(r: Run, example: str, to: str) -> None:
    (r.workdir / to).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "examples" / example, r.workdir / to)


def final_accuracies(summary: dict) -> dict[str, float]:
    return {n["node"]: n["final_global_accuracy"] for n in summary["nodes"]}


@pytest.mark.parametrize("kind", ["numpy", pytest.param("keras", marks=pytest.mark.skipif(not HAS_TF,
                                                                                          reason="needs .[tf]"))])
def test_gossip_with_edgetb_fashion_cnn_beats_the_mlp(run, kind):
    structure = {"sync": 5, "wait_s": 3, "epoch": 2,
                 "model": cnn(kind), "node_list": [{"name": n} for n in NODES]}
    r = with_shapes(run(structure=structure, links=RING, dataset=SHAPES, defer=True))
    r.start()
    summary, events = run_to_end(r, timeout_s=600)
    assert all(n["ended"] == "done" and n["rounds"] == 5 for n in summary["nodes"]), summary["nodes"]
    with np.load(r.workdir / json.loads((r.workdir / "dml_file/conf/n1_dataset.json").read_text())["shard"],
                 allow_pickle=False) as shard:
        assert shard["x_train"].shape[1:] == (16, 16, 1)  # images keep their shape
    final = final_accuracies(summary)
    bar = mlp_accuracy(epochs=10)  # the MLP sees all the data, for more epochs
    assert min(final.values()) >= max(0.9, bar + 0.05), (final, bar)
    model_file = Path(summary["nodes"][0]["model"])
    assert model_file.is_file()
    arrays, meta = load_safetensors(str(model_file))
    # 3 x (conv kernel and bias, BN gamma, beta, moving mean and variance), 2 x (dense kernel and bias)
    assert len(arrays) == 22 and json.loads(meta["input_shape"]) == [16, 16, 1], meta
    assert [a.shape for a in arrays[4:6]] == [(32,), (32,)]  # BN statistics travel with the weights
    names = json.loads(meta["tensor_order"])  # named by layer, whatever the framework
    assert names[:2] == ["conv2d/kernel", "conv2d/bias"] and names[4:6] == ["batch_normalization/moving_mean",
                                                                           "batch_normalization/moving_variance"]


@pytest.mark.parametrize("kind", ["numpy", pytest.param("keras", marks=pytest.mark.skipif(not HAS_TF,
                                                                                          reason="needs .[tf]"))])
def test_federated_with_edgetb_fashion_cnn(run, kind):
    trainers = NODES[1:]
    structure = {"model": cnn(kind), "node_list": [
        {"name": "n1", "sync": 4, "deadline_s": 120, "quorum": 1.0}] + [{"name": t, "epoch": 2} for t in trainers]}
    r = with_shapes(run(kind="fl", structure=structure, links=star("n1", trainers), dataset=SHAPES, defer=True))
    r.start()
    summary, events = run_to_end(r, timeout_s=600)
    agg = rounds_of(events["n1"])
    assert len(agg) == 4 and all(e["closed"] == "all" for e in agg), agg
    assert final_accuracies(summary)["n1"] >= 0.85, summary["nodes"]


def test_etree_with_a_user_model_file(run):
    structure = {"model": {"module": "nns/softmax.py", "learning_rate": 0.2, "seed": 0}, "node_list": [
        {"name": "n1", "layer": 2, "sync": 4, "child_num": 3},
        {"name": "n2", "layer": 1, "epoch": 2}, {"name": "n3", "layer": 1, "epoch": 2},
        {"name": "n4", "layer": 1, "epoch": 2}]}
    r = run(kind="el", structure=structure, links=star("n1", NODES[1:]),
            dataset={"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}, defer=True)
    copy_example(r, "models/softmax.py", "nns/softmax.py")
    r.start()
    summary, events = run_to_end(r)
    run_dir = Path(summary["run_dir"])
    assert (run_dir / "inputs" / "nns" / "softmax.py").read_bytes() == (ROOT / "examples/models/softmax.py").read_bytes()
    assert (r.workdir / "dml_user" / "nns" / "softmax.py").is_file()
    root = rounds_of(events["n1"])
    assert root and root[-1]["accuracy"] >= 0.85, root[-1:]
    # the model travelled as the user's arrays, named by its weight_names
    assert all(n["ended"] == "done" for n in summary["nodes"]), summary["nodes"]


def test_user_algorithms_fedprox_and_momentum_gossip(run):
    trainers = NODES[1:]
    fl = {"model": {"kind": "numpy", "hidden": [64], "seed": 0},
          "algorithm": {"module": "algos/fedprox.py", "role": "FedProxTrainer", "mu": 0.1},
          "node_list": [{"name": "n1", "sync": 4, "deadline_s": 60}] + [{"name": t, "epoch": 2} for t in trainers]}
    r = run(kind="fl", structure=fl, links=star("n1", trainers), defer=True)
    copy_example(r, "algorithms/fedprox.py", "algos/fedprox.py")
    r.start()
    summary, events = run_to_end(r)
    assert final_accuracies(summary)["n1"] >= 0.85, summary["nodes"]
    for t in trainers:
        assert all(e["prox_mu"] == 0.1 for e in rounds_of(events[t])) and rounds_of(events[t]), events[t]
    gossip = {"sync": 5, "wait_s": 2, "epoch": 2, "model": {"kind": "numpy", "hidden": [64], "seed": 0},
              "algorithm": {"module": "algos/gossip_momentum.py", "role": ["MomentumGossip"], "beta": 0.3},
              "node_list": [{"name": n} for n in NODES]}
    r = run(structure=gossip, links=RING, defer=True)
    copy_example(r, "algorithms/gossip_momentum.py", "algos/gossip_momentum.py")
    r.start()
    summary, events = run_to_end(r)
    assert all(n["ended"] == "done" and n["rounds"] == 5 for n in summary["nodes"]), summary["nodes"]
    assert all(e["momentum_beta"] == 0.3 for n in NODES for e in rounds_of(events[n]))
    assert min(n["accuracy"] for n in summary["nodes"]) >= 0.85, summary["nodes"]


BAD_MODELS = {
    "raises": ("def build(input_shape, n_classes, conf):\n    return {}['width']\n", "KeyError: 'width' (line 2)"),
    "wrong type": ("def build(input_shape, n_classes, conf):\n    return 42\n", "which has no get_weights"),
    "shapes differ": ("import numpy as np\nfrom dml_app.model_numpy import NumpyMLP\n"
                      "def build(input_shape, n_classes, conf):\n"
                      "    return NumpyMLP([64, 8 + conf['seed'], n_classes])\n", "shapes differ between builds"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_bad_user_code_is_refused_before_anything_is_made(run, case):
    source, words = BAD_MODELS[case]
    structure = {"sync": 2, "model": {"module": "nns/bad.py"}, "node_list": [{"name": n} for n in NODES]}
    r = run(structure=structure, links=RING, defer=True)
    (r.workdir / "nns").mkdir()
    (r.workdir / "nns" / "bad.py").write_text(source)
    r.start("--auto")
    assert r.proc.wait(timeout=120) == 2
    out = r.close()  # (checks that no namespace was left)
    assert "nns/bad.py" in out and words in out, out
    assert not (r.workdir / "dml_file" / "log").exists()


def test_an_algorithm_class_that_is_not_a_role_is_refused(run):
    structure = {"sync": 2, "algorithm": {"module": "algos/x.py", "role": "NotARole"},
                 "node_list": [{"name": n} for n in NODES]}
    r = run(structure=structure, links=RING, defer=True)
    (r.workdir / "algos").mkdir()
    (r.workdir / "algos" / "x.py").write_text("class NotARole:\n    pass\n")
    r.start("--auto")
    assert r.proc.wait(timeout=120) == 2
    out = r.close()
    assert "algos/x.py: NotARole must subclass one of the built-in roles" in out, out

"""PyTorch models end to end on netns nodes with shaped links: the built-in LeNet-5 in torch on
gossip, FL, the E-tree and the ring with adaptive_batch (4 nodes, 2 rounds each: every algorithm
moves torch weights),
and the example torch module as a user's file (its kind inferred) with the FedProx trainers.
Skipped without PyTorch (CI installs it)."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT
from tests.e2e.test_algorithms import ring_links, rounds_of, run_to_end, star

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)"),
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs .[torch]")]
NODES = ["n1", "n2", "n3", "n4"]
RING = {a: [{"dest": NODES[(i + 1) % 4], "bw": "20mbit"}, {"dest": NODES[(i - 1) % 4], "bw": "20mbit"}]
        for i, a in enumerate(NODES)}
LENET = {"kind": "torch", "name": "lenet5", "seed": 0, "learning_rate": 0.003}


def done(summary: dict, rounds: int) -> None:
    assert all(n["ended"] == "done" for n in summary["nodes"]), summary["nodes"]
    assert all(n["final_global_accuracy"] is not None for n in summary["nodes"]), summary["nodes"]


def test_gossip_and_fl_with_a_torch_lenet5(run):
    structure = {"sync": 2, "wait_s": 2, "epoch": 2, "model": LENET, "node_list": [{"name": n} for n in NODES]}
    r = run(structure=structure, links=RING, defer=True)
    r.start()
    summary, events = run_to_end(r)
    out = r.close()
    done(summary, 2)
    assert all(len(rounds_of(events[n])) == 2 for n in NODES)
    model = json.loads((Path(summary["run_dir"]) / "confs.json").read_text())["n1"]["structure"]["model"]
    assert model == LENET, model  # only what means something for it: no MLP or optimizer defaults
    record = json.loads((Path(summary["run_dir"]) / "run.json").read_text())
    assert record["models"] == [{"kind": "torch", "label": "lenet5 · torch", "model": LENET, "nodes": NODES}], record
    assert "your model" not in out, out  # (a built-in)

    trainers = NODES[1:]
    fl = {"model": LENET, "node_list": [{"name": "n1", "sync": 2, "deadline_s": 60}] +
          [{"name": t, "epoch": 2} for t in trainers]}
    summary, events = run_to_end(run(kind="fl", structure=fl, links=star("n1", trainers)))
    done(summary, 2)
    assert len(rounds_of(events["n1"])) == 2
    assert summary["nodes"][0]["final_global_accuracy"] >= 0.3, summary["nodes"]  # (chance: 0.1; 2 rounds)


def test_etree_and_ring_with_a_torch_lenet5(run):
    structure = {"model": LENET, "node_list": [
        {"name": "n1", "layer": 2, "sync": 2, "child_num": 3},
        {"name": "n2", "layer": 1, "epoch": 2}, {"name": "n3", "layer": 1, "epoch": 2},
        {"name": "n4", "layer": 1, "epoch": 2}]}
    summary, events = run_to_end(run(kind="el", structure=structure, links=star("n1", NODES[1:])))
    done(summary, 2)
    assert len([e for e in rounds_of(events["n1"]) if e["layer"] == 2]) == 2

    names = ["r1", "r2", "r3", "r4"]
    ring = {"sync": 2, "model": LENET, "node_list": [{"name": n, "epoch": 2} for n in names],
            "policies": [{"kind": "adaptive_batch", "max_batch": 128}]}  # (the adaptation policies too)
    summary, _ = run_to_end(run(kind="ra", structure=ring, links=ring_links(names)))
    done(summary, 2)
    assert len({n["final_global_accuracy"] for n in summary["nodes"]}) == 1  # one shared model


def test_the_example_torch_module_with_fedprox_trainers(run):
    trainers = NODES[1:]
    structure = {"model": {"module": "nns/torch_cnn.py", "filters": 8, "seed": 0},  # no "kind": inferred
                 "algorithm": {"module": "algos/fedprox.py", "role": "FedProxTrainer", "mu": 0.01},
                 "node_list": [{"name": "n1", "sync": 3, "deadline_s": 60}] + [{"name": t, "epoch": 2} for t in trainers]}
    r = run(kind="fl", structure=structure, links=star("n1", trainers), defer=True)
    for example, to in (("models/torch_cnn.py", "nns/torch_cnn.py"), ("algorithms/fedprox.py", "algos/fedprox.py")):
        (r.workdir / to).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "examples" / example, r.workdir / to)
    r.start()
    summary, events = run_to_end(r)
    out = r.close()
    assert "your model: nns/torch_cnn.py, build(), kind torch (inferred" in out, out
    done(summary, 3)
    assert summary["nodes"][0]["final_global_accuracy"] >= 0.8, summary["nodes"]
    started = [next(e for e in events[n] if e["type"] == "started") for n in NODES]
    assert len({e["initial_weights_crc32"] for e in started}) == 1, started
    record = json.loads((Path(summary["run_dir"]) / "run.json").read_text())
    assert [(m["label"], m["model"]) for m in record["models"]] == [  # (the kind inferred, the user's path)
        ("nns/torch_cnn.py · torch", {"kind": "torch", "module": "nns/torch_cnn.py", "filters": 8, "seed": 0})], record
    final_models_load_with_strict_keys(Path(summary["run_dir"]), r.workdir / "nns" / "torch_cnn.py")


def final_models_load_with_strict_keys(run_dir: Path, source: Path) -> None:
    """The docs' recipe: each node's final model, read by safetensors.torch, loads into the user's
    module with strict=True (integer buffers included: a trainer's count of batches, never sent)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location("torch_cnn_example", source)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for node in NODES:
        path = run_dir / "models" / f"{node}.safetensors"
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert meta["kind"] == "torch" and json.loads(meta["model"])["module"] == "nns/torch_cnn.py", meta
        state = load_file(str(path))
        model = example.build(tuple(json.loads(meta["input_shape"])), state["classifier.3.bias"].shape[0],
                              json.loads(meta["model"]))
        model.load_state_dict(state, strict=True)
        assert json.loads(meta["tensor_order"]) == list(model.state_dict()), meta
        batches = int(model.features[2].num_batches_tracked)
        assert batches > 0 if node != "n1" else batches == 0, (node, batches)  # (the aggregator never trains)

"""Federated, E-tree and ring all-reduce learning end to end on netns nodes with shaped links."""
from __future__ import annotations

import csv
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from dml_app.models.make import make_model
from dml_app.runtime.events import read_events
from dml_app.wire import weights as wire
from tests.e2e.harness import ROOT, Run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
MODEL = {"kind": "numpy", "hidden": [64], "learning_rate": 0.005, "seed": 0}


def star(center: str, leaves: list[str], bw: str = "20mbit") -> dict:
    links = {center: [{"dest": leaf, "bw": bw} for leaf in leaves]}
    links.update({leaf: [{"dest": center, "bw": "10mbit"}] for leaf in leaves})
    return links


def ring_links(names: list[str]) -> dict:
    return {a: [{"dest": names[(i + 1) % len(names)], "bw": "10mbit"}] for i, a in enumerate(names)}


def run_to_end(r: Run, timeout_s: float = 240) -> tuple[dict, dict[str, list[dict]]]:
    """Start, wait for the run to finish, collect: (summary, events by node)."""
    r.wait_phase("ready")
    assert r.get("/start").json()["phase"] == "running"
    r.wait_phase("finished", timeout_s=timeout_s)
    summary = r.get("/finish").json()
    events = {p.stem: read_events(str(p)) for p in (Path(summary["run_dir"]) / "events").iterdir()}
    return summary, events


def rounds_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "round"]


def check_traffic_follows_links(summary: dict, links: dict) -> None:
    for node in summary["nodes"]:
        allowed = {link["dest"] for link in links.get(node["node"], [])}
        # and answers, back over the connection a linked node opened (a relayed ring join's)
        allowed |= {src for src, out in links.items() if any(link["dest"] == node["node"] for link in out)}
        assert set(node["sent_to"]) <= allowed, f"{node['node']} sent to {node['sent_to']}, links only to {allowed}"


def test_federated_learning_with_8_trainers(run):
    trainers = [f"t{i}" for i in range(1, 9)]
    links = star("agg", trainers)
    structure = {"model": MODEL, "node_list": [
        {"name": "agg", "sync": 8, "trainer_fraction": 0.75, "deadline_s": 30, "quorum": 0.5}]
        + [{"name": t, "epoch": 3} for t in trainers]}
    summary, events = run_to_end(run(kind="fl", structure=structure, links=links))
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert all(n["ended"] == "done" for n in nodes.values()), nodes
    assert nodes["agg"]["rounds"] == 8 and nodes["agg"]["accuracy"] >= 0.85, nodes["agg"]
    agg_rounds = rounds_of(events["agg"])
    assert all(len(e["picked"]) == 6 and e["closed"] == "all" and e["received_models"] == 6 for e in agg_rounds)
    assert sum(len(rounds_of(events[t])) for t in trainers) == 8 * 6  # every pick trained once
    check_traffic_follows_links(summary, links)


def test_federated_learning_survives_a_trainer_killed_mid_run(run):
    trainers = [f"t{i}" for i in range(1, 6)]
    deadline_s, rounds = 6, 6
    structure = {"model": MODEL, "node_list": [
        {"name": "agg", "sync": rounds, "trainer_fraction": 1.0, "deadline_s": deadline_s, "quorum": 0.5}]
        + [{"name": t, "epoch": 20} for t in trainers]}
    r = run(kind="fl", structure=structure, links=star("agg", trainers))
    r.wait_phase("ready")
    r.get("/start")
    started = time.monotonic()
    while next(n for n in r.get("/status").json()["nodes"] if n["name"] == "agg")["round"] < 1:
        assert time.monotonic() - started < 60, "the first round never closed"
        time.sleep(0.1)
    victim = next(n for n in r.get("/status").json()["nodes"] if n["name"] == "t3")
    os.kill(victim["pid"], signal.SIGKILL)
    status = r.wait_phase("finished", timeout_s=rounds * deadline_s + 60)
    elapsed = time.monotonic() - started
    assert elapsed < rounds * deadline_s + 30, f"the run took {elapsed:.0f}s"
    states = {n["name"]: n["state"] for n in status["nodes"]}
    assert states.pop("t3") == "failed" and set(states.values()) == {"done"}, states
    summary = r.get("/finish").json()
    agg = rounds_of(read_events(str(Path(summary["run_dir"]) / "events" / "agg.jsonl")))
    assert len(agg) == rounds, "the aggregator completed all its rounds"
    after = [e for e in agg if "t3" in e["missing"]]
    assert after and all(e["closed"] == "quorum" and e["received_models"] == 4 for e in after), agg


def test_etree_three_layers_with_relays(run):
    """The default E-tree (8 trainers under 2 aggregators under the root) on the default
    links, where some parents and children have no direct link and talk through relays."""
    structure = json.loads((ROOT / "el_structure.json").read_text())
    summary, events = run_to_end(run(kind="el", structure=structure))
    nodes = {n["node"]: n for n in summary["nodes"]}
    assert all(n["ended"] == "done" for n in nodes.values()), nodes
    root_rounds = [e for e in rounds_of(events["n1"]) if e["layer"] == 3]
    assert len(root_rounds) == 5 and root_rounds[-1]["accuracy"] >= 0.85, root_rounds[-1]
    assert nodes["n1"]["accuracy"] == root_rounds[-1]["accuracy"]
    trainers = {"n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8"}
    assert {n for n, ev in events.items() if any(e["layer"] == 1 for e in rounds_of(ev))} == trainers
    assert all(len([e for e in rounds_of(events[t]) if e["layer"] == 1]) == 5 * 2 for t in trainers)
    links = json.loads((ROOT / "links.json").read_text())
    check_traffic_follows_links(summary, links)
    relayed = [e for e in rounds_of(events["n2"]) + [e for e in events["n2"] if e["type"] == "done"]
               if "n3" in e.get("sent_to", {})]
    assert relayed, "n2 relays between n1 and n3, which have no link"
    assert summary["algorithm"] == "etree" and nodes["n1"]["rounds_by_layer"] == {"1": 10, "2": 10, "3": 5}
    rows = list(csv.DictReader((Path(summary["run_dir"]) / "metrics.csv").open()))
    for name, ev in events.items():  # a node's rows are exactly its round events, with their layer
        assert [(int(r["round"]), int(r["layer"])) for r in rows if r["node"] == name] == \
            [(e["round"], e["layer"]) for e in rounds_of(ev)], name
    assert {r["role"] for r in rows} == {"etree"}


def test_ring_all_reduce_with_6_nodes(run):
    names = [f"r{i}" for i in range(1, 7)]
    links = ring_links(names)
    structure = {"sync": 6, "model": MODEL, "node_list": [{"name": n, "epoch": 3} for n in names]}
    summary, _ = run_to_end(run(kind="ra", structure=structure, links=links))
    for node in summary["nodes"]:
        assert node["ended"] == "done" and node["rounds"] == 6 and node["accuracy"] >= 0.85, node
    check_traffic_follows_links(summary, links)
    assert summary["algorithm"] == "ring" and len(summary["models"]) == 6
    models = [load_file(path) for path in summary["models"]]  # the members hold one shared model
    assert all(sorted(m) == sorted(models[0]) and all(np.array_equal(m[k], models[0][k]) for k in m) for m in models)
    assert len({n["final_global_accuracy"] for n in summary["nodes"]}) == 1


def test_ring_all_reduce_leaves_exactly_the_mean(run):
    """No training: after one round every node holds the elementwise mean of the initial
    weights, including a bias of 4 elements on a ring of 6."""
    names = [f"r{i}" for i in range(1, 7)]
    model = {"kind": "numpy", "hidden": [4], "seed": 0}
    structure = {"sync": 1, "model": model,
                 "node_list": [{"name": n, "epoch": 0, "seed": 100 + i} for i, n in enumerate(names)]}
    r = run(kind="ra", structure=structure, links=ring_links(names))
    summary, _ = run_to_end(r)
    assert all(n["ended"] == "done" for n in summary["nodes"])
    initial = [make_model({**model, "seed": 100 + i}, input_shape=64, n_classes=10).get_weights()
               for i in range(len(names))]
    assert min(w.size for w in initial[0]) < len(names)
    expected = [np.mean(np.stack(layer).astype(np.float64), axis=0) for layer in zip(*initial)]
    run_id = Path(summary["run_dir"]).name
    for name in names:
        held, _ = wire.decode((r.workdir / "dml_file" / "node" / name / f"{run_id}.weights").read_bytes())
        assert [w.shape for w in held] == [w.shape for w in expected]
        error = max(float(np.max(np.abs(h.astype(np.float64) - e))) for h, e in zip(held, expected))
        assert error <= 1e-6, f"{name}: max abs error {error}"
        saved = load_file(str(Path(summary["run_dir"]) / "models" / f"{name}.safetensors"))
        names = make_model(model, input_shape=64, n_classes=10).weight_names()  # named by layer, as sent
        assert all(np.array_equal(saved[n], h) for n, h in zip(names, held)), \
            f"{name}: the saved model is the node's final model"

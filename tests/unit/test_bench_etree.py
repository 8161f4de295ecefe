"""bench_etree_edgetb.py's experiments: the controller's own loaders accept them as written, and
the default is EdgeTB's 40-node el3 E-tree with el_run.py's full mesh of links."""
from __future__ import annotations

import argparse
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_etree_edgetb import (EL3_GROUPS, EL_NAMES, MODEL_BYTES, el_dataset_start, etree_structure,  # noqa: E402
                                experiment, link_floor_s, mesh_links)


def load(workdir: str) -> tuple[dict, dict, dict]:
    from controller.confs.structures import LOADERS
    from controller.model.topology import links_from_data

    with open(os.path.join(workdir, "links.json")) as f:
        links = json.load(f)
    with open(os.path.join(workdir, "el_structure.json")) as f:
        structure = json.load(f)
    with open(os.path.join(workdir, "el_dataset.json")) as f:
        dataset = json.load(f)
    learning = {k: v for k, v in structure.items() if k != "telemetry"}  # the runner takes telemetry first
    confs = LOADERS["etree"](learning, "el_structure.json", links_from_data(links, "links.json"))
    return confs, links, dataset


@pytest.fixture(autouse=True)
def mnist_shards(monkeypatch):
    """MNIST's shard counts (600 to train, 100 to test) without its file: a clean checkout has none."""
    import bench_etree_edgetb

    monkeypatch.setattr(bench_etree_edgetb, "shard_counts", lambda dataset: (600, 100))


def args(**kw: object) -> argparse.Namespace:
    base = dict(shape="el3", nodes=40, aggregators=8, root_sync=0, agg_sync=0, epochs=1, links="mesh",
                bw_kbps=[200, 500], structure="{}")
    return argparse.Namespace(**{**base, **kw})


def test_the_default_is_edgetbs_el3_tree_on_a_full_mesh(tmp_path):
    floor_s = experiment(str(tmp_path), args(), "mnist")
    confs, links, dataset = load(str(tmp_path))
    assert sorted(confs) == sorted(EL_NAMES) and len(confs) == 40
    root = confs["p1"]["positions"]
    assert [(p["layer"], p["sync"]) for p in root] == [(3, 25), (2, 4)]
    assert root[0]["children"] == list(EL3_GROUPS)
    trainers = [n for n, c in confs.items() if any(p["layer"] == 1 for p in c["positions"])]
    assert len(trainers) == 34 and not set(trainers) & set(EL3_GROUPS)  # aggregators do not train
    assert confs["n8"]["positions"][0]["children"] == ["p3", "n34", "n35", "n36", "n37"]
    assert len(links) == 40 and all(len(ls) == 39 for ls in links.values())  # el_run.py: every pair
    rate = {(a, x["dest"]): x["bw"] for a, ls in links.items() for x in ls}
    assert all(rate[(b, a)] == bw for (a, b), bw in rate.items())  # symmetric
    assert all(200 <= int(bw[:-4]) <= 500 for bw in rate.values())
    assert {(v["train_len"], v["test_len"], v["batch_size"]) for k, v in dataset.items() if k != "_settings"} \
        == {(5, 5, 32)}
    assert dataset["n21"]["test_start_index"] == 2 and dataset["p3"]["test_start_index"] == 3  # el_dataset.json
    assert 400 < floor_s < 600  # 100 trainer rounds of 0.8-2 s hops


def test_the_guess_keeps_its_tree_links_and_its_floor(tmp_path):
    floor_s = experiment(str(tmp_path), args(shape="guess", links="tree"), "mnist")
    confs, links, _ = load(str(tmp_path))
    assert len(confs) == 40
    assert sum(len(ls) for ls in links.values()) == 2 * (7 + 32)
    assert floor_s == pytest.approx(52.9, abs=0.05)  # the figure BENCHMARKS.md gave for this shape


def test_tree_links_keep_only_the_el3_trees_pairs(tmp_path):
    experiment(str(tmp_path), args(links="tree"), "mnist")
    _, links, _ = load(str(tmp_path))
    assert sum(len(ls) for ls in links.values()) == 2 * (5 + 34)
    assert {x["dest"] for x in links["n9"]} == {"p1"}


def test_the_floor_is_the_slowest_childs_path_times_sync():
    node_list = [{"name": "a", "layer": 3, "sync": 2, "child_num": 2},
                 {"name": "a", "layer": 2, "sync": 3, "child_num": 1},
                 {"name": "b", "layer": 2, "sync": 1, "child_num": 1},
                 {"name": "c", "layer": 1, "epoch": 1}, {"name": "d", "layer": 1, "epoch": 1}]
    links = mesh_links(["a", "b", "c", "d"], (100, 100))
    hop = MODEL_BYTES / 100e3
    # a's layer-2 round: 3 x (a->c->a); b's: a->b, (b->d->b), b->a; the root takes the slower, twice
    assert link_floor_s(node_list, links) == pytest.approx(2 * max(3 * 2 * hop, 4 * hop))


def test_el_dataset_starts_match_edgetbs_file():
    starts = [el_dataset_start(k) for k in range(40)]
    assert starts[:3] == [1, 6, 11] and starts[19] == 96 and starts[20] == 2 and starts[38] == 92
    assert starts[39] == 3


def test_the_guess_structure_still_puts_every_node_on_layer_one():
    names = [f"n{i}" for i in range(1, 41)]
    structure, _ = etree_structure(names, 8, 5, 2, 1)
    assert sorted(e["name"] for e in structure["node_list"] if e["layer"] == 1) == sorted(names)

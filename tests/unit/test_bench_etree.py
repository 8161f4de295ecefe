"""bench_etree_edgetb.py's experiment: the controller's own loaders accept it as written."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_etree_edgetb import etree_structure  # noqa: E402


def test_the_bench_tree_loads_with_every_node_a_trainer_and_links_along_it():
    from controller.confs.structures import LOADERS
    from controller.model.topology import links_from_data

    names = [f"n{i}" for i in range(1, 41)]
    structure, links = etree_structure(names, 8, 5, 2, 1)
    topology = links_from_data(links, "links.json")
    learning = {k: v for k, v in structure.items() if k != "telemetry"}  # the runner takes telemetry first
    confs = LOADERS["etree"](learning, "el_structure.json", topology)
    assert set(confs) == set(names)
    trainers = [e["name"] for e in structure["node_list"] if e["layer"] == 1]
    assert sorted(trainers) == sorted(names)  # aggregators train in their own groups too
    layer2 = [e for e in structure["node_list"] if e["layer"] == 2]
    assert sum(e["child_num"] for e in layer2) == 40 and len(layer2) == 8
    rates = [int(link["bw"][:-4]) for ls in links.values() for link in ls]
    assert len(rates) == 2 * (7 + 32) and 200 <= min(rates) and max(rates) <= 500

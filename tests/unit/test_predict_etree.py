"""The E-tree's analytic arithmetic, by hand: calls of each position, rounds of each node's lowest
layer, the models that cross (a non-root node's last answer uncounted), the root's critical path;
and gossip's received models (the last one refused by a finished node)."""
from __future__ import annotations

import json

import pytest

from controller.predict import analytic
from controller.predict.features import etree_rounds, node_features
from controller.predict.setting import from_input_dir

GROUPS = [["n1", "n2", "n3", "n4", "n5"], ["n6", "n7", "n8", "n9", "n10"]]  # layer-2 aggregators n1, n6


def etree_experiment(rate: str, root_sync: int, model: dict) -> dict:
    """Root n1 (``root_sync`` global rounds) over the aggregators n1 and n6 (2 rounds each), 5
    trainers each, every link at ``rate``: structure, links and dataset."""
    node_list = [{"name": "n1", "layer": 3, "sync": root_sync, "child_num": 2}]
    node_list += [{"name": g[0], "layer": 2, "sync": 2, "child_num": 5} for g in GROUPS]
    node_list += [{"name": n, "layer": 1, "epoch": 1} for g in GROUPS for n in g]
    links: dict = {}
    for a, b in [(g[0], n) for g in GROUPS for n in g[1:]] + [("n1", "n6")]:
        links.setdefault(a, []).append({"dest": b, "bw": rate})
        links.setdefault(b, []).append({"dest": a, "bw": rate})
    return {"structure": {"model": model, "node_list": node_list}, "links": links,
            "dataset": {"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32}}


def write_etree(folder, rate: str = "5mbit") -> None:
    """The E-tree above with 3 global rounds, as an input directory."""
    files = etree_experiment(rate, 3, {"kind": "numpy", "hidden": [64], "seed": 0})
    for name, doc in {"el_structure.json": files["structure"], "el_dataset.json": files["dataset"],
                      "links.json": files["links"]}.items():
        (folder / name).write_text(json.dumps(doc))


def test_etree_calls_and_rounds(tmp_path):
    write_etree(tmp_path)
    calls, rounds = etree_rounds(from_input_dir(str(tmp_path)))
    assert calls[("n1", 3)] == 1 and calls[("n6", 2)] == calls[("n1", 2)] == 3
    assert calls[("n7", 1)] == calls[("n1", 1)] == 6  # 3 global rounds x 2 rounds of the aggregator
    assert set(rounds.values()) == {6.0}  # every node is timed by its layer-1 rounds


def test_etree_models_that_cross_per_round(tmp_path):
    write_etree(tmp_path)
    setting = from_input_dir(str(tmp_path))
    model = setting.model_bytes
    terms = analytic.terms(setting)
    # a trainer: 6 models down, 6 answers up of which the last goes after its last round
    assert terms["n7"].payload_recv_bytes == pytest.approx(model)
    assert terms["n7"].payload_sent_bytes == pytest.approx(5 / 6 * model)
    # n6: 2 rounds x 4 children each way per call, 3 calls; its 3 answers up to n1 (the last uncounted)
    assert terms["n6"].messages_sent == pytest.approx((24 + 2) / 6)
    assert terms["n6"].messages_recv == pytest.approx((24 + 3) / 6)
    # the root: its layer-2 children (24 each way) and n6 at layer 3 (3 each way); nothing lost
    assert terms["n1"].messages_sent == terms["n1"].messages_recv == pytest.approx(27 / 6)
    # the critical path: each global round is n6's way (down, 2 rounds of down and up, up)
    w = analytic.wire_s(model, 5e6)
    for t in terms.values():
        assert t.transfer_s == pytest.approx(3 * 6 * w / 6)
        assert t.steps == pytest.approx(3.0)
        assert t.round_units == pytest.approx(max(analytic._units(setting, n) for n in setting.structure))
    features = node_features(setting)
    assert features["n7"]["rounds"] == 6 and features["n7"]["out_degree"] == 1
    assert features["n1"]["out_degree"] == 5  # n2..n5 and n6


def test_gossip_receives_r_minus_1_models_of_each_in_neighbour(tmp_path):
    names = ["n1", "n2", "n3"]
    docs = {"gl_structure.json": {"sync": 10, "model": {"kind": "numpy", "hidden": [64]},
                                  "node_list": [{"name": n, "epoch": 1} for n in names]},
            "gl_dataset.json": {"dataset": "digits", "split": "iid", "seed": 0, "batch_size": 32},
            "links.json": {a: [{"dest": names[(i + 1) % 3], "bw": "5mbit"}] for i, a in enumerate(names)}}
    for name, doc in docs.items():
        (tmp_path / name).write_text(json.dumps(doc))
    setting = from_input_dir(str(tmp_path))
    t = analytic.terms(setting)["n2"]
    assert t.payload_sent_bytes == setting.model_bytes
    assert t.payload_recv_bytes == pytest.approx(0.9 * setting.model_bytes)

"""Prediction's features of a configuration, by hand: paths, rates, background flows."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from controller.predict.features import node_features
from controller.predict.setting import from_input_dir
from worker.api.errors import ConfigError

RING4 = os.path.join(os.path.dirname(__file__), "data", "predict", "ring4", "inputs")


def test_paths_rates_and_degrees_of_a_ring():
    features = node_features(from_input_dir(RING4))
    # ring n1 -> n2 -> n3 -> n4 -> n1 over links of 20, 20, 10 and 10 Mbit/s
    assert [features[n]["rate_min_bps"] for n in ("n1", "n2", "n3", "n4")] == [20e6, 20e6, 10e6, 10e6]
    assert all(f["out_degree"] == 1 and f["in_degree"] == 1 and f["relay_hops"] == 0 for f in features.values())
    assert features["n1"]["background_bps"] == 0


def test_background_flows_load_the_nodes_whose_paths_share_their_links(tmp_path):
    inputs = tmp_path / "inputs"
    shutil.copytree(RING4, inputs)
    (inputs / "scenario.json").write_text(json.dumps({"seed": 1, "events": [
        {"at": 0, "background": {"src": "n1", "dst": "n2", "rate": "4mbit", "on_s": 1, "off_s": 3, "for": 60}},
        {"at": 0, "background": {"src": "n3", "dst": "n4", "rate": "2mbit", "for": 60}},
        {"at": 5, "crash": "n2"}]}))  # other events do not count
    features = node_features(from_input_dir(str(inputs)))
    assert features["n1"]["background_bps"] == pytest.approx(1e6)  # 4 Mbit/s a quarter of the time, on n1->n2
    assert features["n3"]["background_bps"] == pytest.approx(2e6)  # on n3->n4
    assert features["n2"]["background_bps"] == features["n4"]["background_bps"] == 0


def test_a_background_flow_between_unknown_nodes_is_refused_with_the_file(tmp_path):
    inputs = tmp_path / "inputs"
    shutil.copytree(RING4, inputs)
    (inputs / "scenario.json").write_text(json.dumps({"events": [
        {"at": 0, "background": {"src": "n1", "dst": "n9", "rate": "4mbit", "for": 60}}]}))
    with pytest.raises(ConfigError, match="scenario.json"):
        from_input_dir(str(inputs))

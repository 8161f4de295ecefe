"""Prediction refuses what it cannot answer, with errors that name the algorithm or the file."""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest

from controller.cli import main
from controller.predict import model_file
from controller.predict.evaluate import evaluate
from controller.predict.greybox import TooFewConfigurations
from controller.predict.setting import MissingFileError, from_input_dir, from_run_dir
from tests.unit.test_predict_fit import make_run
from worker.api.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "data", "predict")
RING4, FL4 = os.path.join(DATA, "ring4"), os.path.join(DATA, "fl4")


@pytest.fixture(scope="module")
def two_rings(tmp_path_factory) -> list[str]:
    root = str(tmp_path_factory.mktemp("two-rings"))
    rng = np.random.default_rng(1)
    return [make_run(root, "a", (3, 5, 1.0, 1, 32), rng), make_run(root, "b", (4, 20, 0.5, 2, 64), rng)]


def test_an_algorithm_never_seen_in_training_is_refused_with_its_name(two_rings):
    doc = model_file.fit(model_file.load_runs(two_rings))
    with pytest.raises(ConfigError, match=r"algorithm 'fl' was never seen in training \(the model knows ring\)"):
        model_file.predict_input_dir(doc, os.path.join(FL4, "inputs"))


def test_one_configuration_is_too_few_even_when_run_twice(tmp_path):
    again = tmp_path / "again"
    shutil.copytree(RING4, again)
    with pytest.raises(TooFewConfigurations, match=r"1 configuration\(s\).*at least 2"):
        model_file.fit(model_file.load_runs([RING4, str(again)]))
    assert issubclass(TooFewConfigurations, ConfigError)


def test_grey_box_with_fewer_configurations_than_coefficients_is_refused_and_said(two_rings):
    doc = model_file.fit(model_file.load_runs(two_rings))
    group = doc["groups"]["ring/ring"]
    assert "5 coefficients" in group["greybox"]["round_mean_s"]["refused"]
    assert "2 configuration(s)" in group["greybox"]["round_mean_s"]["refused"]
    assert "coef" in group["greybox"]["bytes_sent_per_round"]  # 2 coefficients, 2 configurations: fitted
    result = model_file.predict_input_dir(doc, two_rings[0] + "-inputs")
    ring = result["roles"]["ring"]
    assert ring["predictions"]["round_mean_s"]["greybox"] is None
    assert ring["predictions"]["round_mean_s"]["svr"] is not None
    assert "greybox:round_mean_s" in ring["refused"]


def test_evaluation_needs_three_configurations(two_rings):
    with pytest.raises(TooFewConfigurations, match=r"2 configuration\(s\).*at least 3"):
        evaluate(model_file.load_runs(two_rings))


@pytest.mark.parametrize("missing", ["metrics.csv", "confs.json", "topology.json", "run.json"])
def test_a_missing_file_of_a_run_folder_is_named(tmp_path, missing):
    run = tmp_path / "run"
    shutil.copytree(RING4, run)
    os.remove(run / missing)
    with pytest.raises(MissingFileError, match=f"{run / missing}: missing"):
        model_file.load_runs([str(run)])


@pytest.mark.parametrize("missing, said", [("links.json", "no links file"), ("ra_dataset.json", "no dataset file"),
                                           ("ra_structure.json", "no structure file")])
def test_a_missing_file_of_an_input_directory_is_named(tmp_path, missing, said):
    inputs = tmp_path / "inputs"
    shutil.copytree(os.path.join(RING4, "inputs"), inputs)
    os.remove(inputs / missing)
    with pytest.raises(MissingFileError, match=f"{inputs}: {said}"):
        from_input_dir(str(inputs))


def test_a_model_file_that_is_missing_or_not_a_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such model file"):
        model_file.load(str(tmp_path / "model.json"))
    (tmp_path / "other.json").write_text(json.dumps({"version": 1}))
    with pytest.raises(ConfigError, match="edgetb-predict-model"):
        model_file.load(str(tmp_path / "other.json"))
    good = {"kind": model_file.KIND, "version": model_file.VERSION, "features": list(model_file.FEATURES)}
    for groups in ({}, {"ring/ring": []}, {"ring/ring": {"names": {}}}, "x"):
        (tmp_path / "damaged.json").write_text(json.dumps({**good, "groups": groups}))
        with pytest.raises(ConfigError, match="'groups' are damaged"):
            model_file.load(str(tmp_path / "damaged.json"))


@pytest.mark.parametrize("header", [[1, 2], {"w": "F32"}, {"w": {"dtype": "F32", "shape": ["3"]}},
                                    {"w": {"dtype": "F32", "shape": 3}}])
def test_a_model_file_of_a_run_with_a_bad_header_is_a_clear_error(tmp_path, header):
    from controller.predict.setting import _model_size_from_file
    body = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(ConfigError, match="m.safetensors: "):
        _model_size_from_file(str(tmp_path / "m.safetensors"))


def test_a_torch_final_model_is_sized_by_what_travels(tmp_path):
    """Its integer buffers (saved in the file, never sent) count for nothing."""
    from controller.predict.setting import _model_size_from_file
    header = {"__metadata__": {"kind": "torch"}, "w": {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 24]},
              "bn.num_batches_tracked": {"dtype": "I64", "shape": [], "data_offsets": [24, 32]}}
    body = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + bytes(32))
    assert _model_size_from_file(str(tmp_path / "m.safetensors")) == (6, 4)
    header["__metadata__"]["kind"] = "numpy"  # (a numpy model's integer arrays travel)
    body = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(len(body).to_bytes(8, "little") + body + bytes(32))
    assert _model_size_from_file(str(tmp_path / "m.safetensors")) == (7, 8)


def test_a_run_folder_and_its_inputs_give_the_same_features():
    for run in (RING4, FL4):
        a = model_file.rows_of_setting(from_run_dir(run))
        b = model_file.rows_of_setting(from_input_dir(os.path.join(run, "inputs")))
        assert [(r.node, r.role, r.features, r.config) for r in a] == [(r.node, r.role, r.features, r.config) for r in b]
    ring = {r.node: r.features for r in model_file.rows_of_setting(from_run_dir(RING4))}
    assert ring["n1"]["param_count"] == 64 * 32 + 32 + 32 * 10 + 10  # digits 8x8, hidden 32, 10 classes
    assert ring["n1"]["samples"] == 360 and ring["n4"]["samples"] == 359  # 1438 training images over 4 nodes
    assert ring["n1"]["rate_min_bps"] == 20e6  # n1 -> n2, its successor


def test_the_cli_fits_predicts_and_evaluates_with_clear_exit_codes(two_rings, tmp_path, capsys):
    model, out = str(tmp_path / "model.json"), str(tmp_path / "prediction.json")
    assert main(["predict", "fit", *two_rings, "--out", model]) == 0
    began = time.perf_counter()
    assert main(["predict", two_rings[1] + "-inputs", "--model", model, "--out", out]) == 0
    assert time.perf_counter() - began < 1.0
    table = capsys.readouterr().out
    assert "role ring (4 node(s), fitted on 2 configuration(s))" in table
    assert "bytes_sent_per_round" in table
    with open(out) as f:
        result = json.load(f)
    assert [n["node"] for n in result["nodes"]] == ["n1", "n2", "n3", "n4"]
    assert main(["predict", FL4 + "/inputs", "--model", model, "--out", out]) == 2
    assert "algorithm 'fl' was never seen" in capsys.readouterr().err
    assert main(["predict", "eval", *two_rings, "--out", str(tmp_path / "e.json")]) == 2
    assert main(["predict", "fit", RING4]) == 2  # no --out


def test_a_setting_never_seen_in_training_is_refused_with_its_name(two_rings, tmp_path):
    doc = model_file.fit(model_file.load_runs(two_rings))
    inputs = tmp_path / "tree"
    shutil.copytree(two_rings[0] + "-inputs", inputs)
    structure = json.loads((inputs / "ra_structure.json").read_text())
    (inputs / "ra_structure.json").write_text(json.dumps({**structure, "strategy": "binary_tree"}))
    with pytest.raises(ConfigError, match=r"strategy 'binary_tree' was never seen in training for ring/ring "
                                          r"\(the model knows 'ring'\)"):
        model_file.predict_input_dir(doc, str(inputs))

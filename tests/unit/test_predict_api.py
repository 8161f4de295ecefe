"""Testbed.predict: the Python API predicts a declared experiment as ``edgetb predict INPUT_DIR`` does."""
from __future__ import annotations

import os
import shutil

import pytest

from controller.predict import model_file
from controller.testbed import Testbed
from worker.api.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "data", "predict")


def test_testbed_predict_is_the_input_directorys_prediction(tmp_path):
    model = str(tmp_path / "model.json")
    model_file.save(model_file.fit(model_file.load_runs([os.path.join(DATA, "ring4"), os.path.join(DATA, "ring4-h96")])),
                    model)
    work = tmp_path / "work"
    shutil.copytree(os.path.join(DATA, "ring4", "inputs"), work)
    tb = Testbed(workdir=str(work), structure="ra_structure.json", dataset="ra_dataset.json", algorithm="ring")
    for name in ("n1", "n2", "n3", "n4"):
        tb.add_emulated_node(name)
    with pytest.raises(ConfigError, match="load_link"):
        tb.predict(model)
    tb.load_link("links.json")
    got = tb.predict(model)
    want = model_file.predict_input_dir(model_file.load(model), str(work))
    assert got["roles"]["ring"]["predictions"] == want["roles"]["ring"]["predictions"]
    assert got["config"] == want["config"]
    bytes_sent = got["roles"]["ring"]["predictions"]["bytes_sent_per_round"]["analytic"]
    assert bytes_sent == pytest.approx(23104, rel=0.01)  # ring4 measured 23080 to 23124 per round

"""Features from the model itself: parameters, bytes and FLOPs per layer, by hand and against the
built models (numpy, a user's numpy Sequential, PyTorch)."""
from __future__ import annotations

import numpy as np
import pytest

from controller.predict import model_graph
from dml_app.models.make import make_model

USER_FILE = '''
from dml_app.models.numpy import layers as L
from dml_app.models.numpy.net import Sequential


def build(input_shape, n_classes, conf):
    return Sequential([L.Conv2D(4, 3, "valid", "relu"), L.Flatten(), L.Dense(n_classes)], input_shape, 0.001)
'''


def test_a_convolution_and_a_dense_layer_by_hand():
    steps = [("conv2d", {"filters": 4, "kernel_size": 3, "padding": "valid"}), ("flatten", {}),
             ("dense", {"units": 10})]
    g = model_graph.from_steps(steps, (8, 8, 1))
    conv, _, dense = g.layers
    assert conv.output_shape == [6, 6, 4] and conv.params == 3 * 3 * 1 * 4 + 4 and conv.bytes == 4 * conv.params
    assert conv.flops_per_sample == 2 * 9 * 1 * 4 * 36 + 2 * 36 * 4
    assert dense.params == 144 * 10 + 10 and dense.flops_per_sample == 2 * 144 * 10 + 2 * 10
    assert g.train_flops_per_sample == 3 * (conv.flops_per_sample + dense.flops_per_sample)
    assert g.to_dict()["edges"] == [[0, 1], [1, 2]]


@pytest.mark.parametrize("name", ["mlp", "lenet5", "edgetb_cifar10_cnn", "edgetb_fashion_cnn"])
def test_a_built_ins_parameters_and_bytes_are_the_built_models(name):
    conf = {"kind": "numpy", "name": name}
    g = model_graph.graph_of(conf, (8, 8, 1), 10)
    weights = make_model(conf, (8, 8, 1), 10).get_weights()
    assert g.param_count == sum(w.size for w in weights) and g.model_bytes == sum(w.nbytes for w in weights)
    assert not g.estimated


def test_a_users_numpy_sequential_is_read_layer_by_layer(tmp_path):
    (tmp_path / "mine.py").write_text(USER_FILE)
    g = model_graph.graph_of({"kind": "numpy", "module": "mine.py"}, (8, 8, 1), 10, str(tmp_path))
    assert [layer.kind for layer in g.layers] == ["conv2d", "flatten", "dense"] and not g.estimated
    assert g.param_count == 40 + 1450


@pytest.mark.parametrize("name", ["lenet5", "edgetb_fashion_cnn"])
def test_torchs_counted_flops_agree_with_the_description_within_10_percent(name):
    described = model_graph.graph_of({"kind": "numpy", "name": name}, (8, 8, 1), 10)
    model = make_model({"kind": "torch", "name": name}, (8, 8, 1), 10)
    counted = model_graph.from_torch(model.module, model.tensor(np.zeros((1, 8, 8, 1), dtype=np.float32)))
    assert counted.param_count == described.param_count
    assert counted.train_flops_per_sample == pytest.approx(described.train_flops_per_sample, rel=0.10)


def test_a_one_batch_profile_times_the_model():
    seconds = model_graph.profile_s_per_sample({"kind": "numpy", "name": "lenet5"}, (8, 8, 1), 10, batches=1)
    assert 0 < seconds < 1

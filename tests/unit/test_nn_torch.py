"""The torch kind: its built-in networks hold the numpy networks' arrays (the same names, shapes
and layout on the wire, the same losses on the same weights), it trains, its integer buffers stay
local (and are saved in its final model, which loads with strict keys), a user's module is wrapped
with its hooks, and a bad file (not a module, an integer parameter, NaN weights, no torch) is refused
naming the file and the node. Skipped without PyTorch (CI installs it)."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dml_app.models.contract import ModelError
from dml_app.models.make import make_model

torch = pytest.importorskip("torch")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "models" / "torch_cnn.py"
NETS = [("edgetb_fashion_cnn", (28, 28, 1)), ("edgetb_fashion_cnn", (8, 8, 1)), ("lenet5", (28, 28, 1)),
        ("lenet5", (8, 8, 1)), ("edgetb_cifar10_cnn", (32, 32, 3)), ("mlp", (8, 8, 1))]


@pytest.mark.parametrize("name,shape", NETS)
def test_a_builtin_holds_the_numpy_nets_arrays_and_gives_the_same_loss(name, shape):
    conf = {"name": name, "seed": 0, "bn_momentum": 0.9}
    ours, reference = make_model({**conf, "kind": "torch"}, shape, 10), make_model({**conf, "kind": "numpy"}, shape, 10)
    assert ours.weight_names() == reference.weight_names()
    rng = np.random.default_rng(1)
    weights = [w + rng.normal(0, 0.05, w.shape).astype(np.float32) for w in reference.get_weights()]
    weights = [np.abs(w) + 0.5 if n.endswith("moving_variance") else w for w, n in zip(weights, reference.weight_names())]
    ours.set_weights(weights)
    reference.set_weights(weights)
    assert all(np.array_equal(a, b) for a, b in zip(ours.get_weights(), weights))
    x, y = rng.random((32, *shape), dtype=np.float32), rng.integers(0, 10, 32)
    assert np.allclose(ours.evaluate(x, y), reference.evaluate(x, y), rtol=1e-4, atol=1e-5)


def test_the_same_seed_builds_the_same_weights_and_training_lowers_the_loss():
    a = make_model({"kind": "torch", "name": "lenet5", "seed": 3}, (8, 8, 1), 4)
    b = make_model({"kind": "torch", "name": "lenet5", "seed": 3}, (8, 8, 1), 4)
    assert all(np.array_equal(u, v) for u, v in zip(a.get_weights(), b.get_weights()))
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, 256)
    x = (rng.random((256, 8, 8, 1)) * 0.1 + y[:, None, None, None] / 4).astype(np.float32)
    before = a.evaluate(x, y)[0]
    a.train(x, y, epochs=10, batch_size=32)
    assert a.evaluate(x, y)[0] < before * 0.7


class Net(torch.nn.Module if torch else object):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.out = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.conv(x))).flatten(1))


class Hooks:
    calls: list = []

    @staticmethod
    def make_optimizer(model, conf):
        Hooks.calls.append(conf["learning_rate"])
        return torch.optim.SGD(model.parameters(), lr=conf["learning_rate"])

    @staticmethod
    def loss(logits, labels):
        Hooks.calls.append("loss")
        return torch.nn.functional.cross_entropy(logits, labels)


def test_a_users_module_carries_its_float_state_by_key_and_keeps_its_integer_buffers():
    from dml_app.models import pytorch

    model = pytorch.wrap(Net(), "nns/net.py: build", {"learning_rate": 0.1}, Hooks)
    assert model.weight_names() == ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "bn.running_mean",
                                    "bn.running_var", "out.weight", "out.bias"]  # (no num_batches_tracked)
    assert model.get_weights()[0].shape == (4, 1, 3, 3)  # a user's layout is its own
    x, y = np.random.default_rng(0).random((8, 8, 8, 1), dtype=np.float32), np.zeros(8, dtype=np.int64)
    model.train(x, y, 1, 4)  # channels-last samples, transposed at the model
    assert Hooks.calls == [0.1, "loss", "loss"]
    assert int(model.module.bn.num_batches_tracked) == 2
    model.set_weights(model.get_weights())
    assert int(model.module.bn.num_batches_tracked) == 2  # never sent, never overwritten


def test_what_is_not_a_module_or_has_integer_parameters_is_refused():
    from dml_app.models import pytorch

    with pytest.raises(ModelError, match="nns/x.py: build must return a torch.nn.Module .*got dict"):
        pytorch.wrap({}, "nns/x.py: build", {})
    net = Net()
    net.count = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ModelError, match="parameter 'count' is of dtype torch.int64"):
        pytorch.wrap(net, "nns/x.py: build", {})
    model = pytorch.wrap(Net(), "nns/x.py: build", {})
    with pytest.raises(ValueError, match=r"array 0 \(conv.weight\): shape \(3, 3\) does not fit"):
        model.set_weights([np.zeros((3, 3), np.float32)] + model.get_weights()[1:])


NET_FILE = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.out = torch.nn.Linear(4 * 6 * 6, 3)
        self.register_buffer("mask", torch.ones(3, dtype=torch.bool))

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.conv(x))).flatten(1)) * self.mask


def build(input_shape, n_classes, conf):
    return Net()
'''


def test_a_final_model_holds_the_integer_buffers_and_loads_with_strict_keys(tmp_path):
    """What a node saves (its weights, then its integer buffers), set into the model in the probe and
    written by the controller, loads with load_state_dict(strict=True) (the docs' recipe)."""
    from safetensors.torch import load_file

    from controller.results.evaluate import load_safetensors, safetensors_bytes
    from dml_app import probe
    from dml_app.models import pytorch

    (tmp_path / "net.py").write_text(NET_FILE)
    conf = {"module": "net.py", "kind": "torch"}
    node = make_model(conf, (8, 8, 1), 3, str(tmp_path))
    node.train(np.random.default_rng(0).random((8, 8, 8, 1), dtype=np.float32), np.zeros(8, np.int64), 1, 4)
    local = node.local_state()
    assert {k: a.dtype for k, a in local.items()} == {"mask": np.uint8, "bn.num_batches_tracked": np.int64}
    arrays = node.get_weights() + list(local.values())
    np.savez(tmp_path / "n1.npz", **{f"{i:04d}": a for i, a in enumerate(arrays)})
    [result] = probe.probe_evaluate({"workdir": str(tmp_path), "conf": conf, "input_shape": [8, 8, 1], "n_classes": 3,
                                     "test": "", "weights": [str(tmp_path / "n1.npz")]})["results"]
    assert result["names"] == node.weight_names() + ["mask", "bn.num_batches_tracked"], result
    (tmp_path / "n1.safetensors").write_bytes(safetensors_bytes(arrays, {"kind": "torch"}, result["names"], result["order"]))
    module = make_model(conf, (8, 8, 1), 3, str(tmp_path)).module
    module.load_state_dict(load_file(str(tmp_path / "n1.safetensors")), strict=True)
    assert int(module.bn.num_batches_tracked) == 2 and module.mask.dtype == torch.bool
    assert all(torch.equal(module.state_dict()[k], v) for k, v in node.module.state_dict().items())
    assert json.loads(load_safetensors(str(tmp_path / "n1.safetensors"))[1]["tensor_order"]) == list(module.state_dict())
    builtin = pytorch.build("lenet5", (28, 28, 1), 10, {})  # a built-in's: the three kinds' common file
    assert builtin.local_state() == {} and builtin.final_names()[0] == builtin.weight_names()
    with pytest.raises(ValueError, match="expected 2 integer buffers after the weights, got 0"):
        node.set_local_state([])


def test_a_key_longer_than_the_wire_allows_is_whole_in_the_final_model():
    from dml_app.models import pytorch
    from dml_app.wire import weights as wire

    net = torch.nn.Sequential()
    net.add_module("x" * 150, torch.nn.Linear(3, 2))
    model = pytorch.wrap(net, "nns/long.py: build", {})
    assert model.final_names()[0] == ["x" * 150 + ".weight", "x" * 150 + ".bias"]
    arrays, _, names = wire.decode_named(wire.encode(model.get_weights(), {}, model.weight_names()))
    assert names == ["x" * 96, "x" * 96] and len(arrays) == 2  # on the wire a name only labels: cut, ordered by position


BAD_FILES = {
    "not a module": ("def build(s, n, c):\n    return {}\n", True,
                     r"nns/bad.py: build must return a torch.nn.Module \(model kind 'torch'\), got dict"),
    "an integer parameter": ("import torch\ndef build(s, n, c):\n    m = torch.nn.Linear(64, n)\n"
                             "    m.count = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)\n"
                             "    return m\n", False, r"nns/bad.py: build: parameter 'count' is of dtype torch.int64"),
    "NaN weights": ("import torch\ndef build(s, n, c):\n    m = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, n))\n"
                    "    torch.nn.init.constant_(m[1].bias, float('nan'))\n    return m\n", False,
                    r"nns/bad.py: build: the initial weights hold NaN or infinite values \(array 1, '1.bias'\)"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_torch_file_is_refused_before_the_run_naming_the_file_and_the_node(tmp_path, case):
    """Tried in the probe sandbox at deploy: the message names the user's file (not its staged copy)
    and the nodes of the model."""
    from controller.confs import usercode
    from worker.api.errors import ConfigError

    source, explicit, message = BAD_FILES[case]
    os.chmod(tmp_path, 0o755)  # (the probe runs as nobody)
    (tmp_path / "nns").mkdir()
    (tmp_path / "nns" / "bad.py").write_text(source)
    np.savez(tmp_path / "n.npz", x_train=np.zeros((3, 8, 8, 1), np.float32), y_train=np.arange(3))
    model = {"module": "nns/bad.py", "seed": 0, **({"kind": "torch"} if explicit else {})}
    structure = {n: {"role": "gossip", "model": dict(model)} for n in ("n1", "n2")}
    usercode.stage(str(tmp_path), structure, "gl_structure.json")
    with pytest.raises(ConfigError, match="gl_structure.json: field 'model' of node n1 \\(and 1 more\\): " + message):
        usercode.check(str(tmp_path), structure, {n: {"shard": "n.npz", "n_classes": 10} for n in structure},
                       "gl_structure.json")


def test_without_torch_a_torch_model_says_how_to_get_it(monkeypatch, tmp_path):
    from controller.confs import usercode
    from dml_app import probe
    from worker.api.errors import ConfigError

    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(ModelError, match=r"a model of kind 'torch' needs PyTorch: pip install '\.\[torch\]'"):
        make_model({"kind": "torch", "name": "lenet5"}, (28, 28, 1), 10)
    (tmp_path / "nns").mkdir()
    shutil.copy(EXAMPLE, tmp_path / "nns" / "torch_cnn.py")
    for model, said in (({"module": "nns/torch_cnn.py"}, r"nns/torch_cnn.py: importing it failed: .*\(PyTorch is not"),
                        ({"module": "nns/torch_cnn.py", "kind": "torch"}, "a model of kind 'torch' needs PyTorch")):
        with pytest.raises(ValueError, match=said + r".*pip install '\.\[torch\]'"):  # (in the probe)
            probe.probe_model({"workdir": str(tmp_path), "conf": model, "input_shape": [8, 8, 1], "n_classes": 3})
    np.savez(tmp_path / "n.npz", x_train=np.zeros((3, 8, 8, 1), np.float32), y_train=np.arange(3))
    structure = {"n1": {"role": "gossip", "model": {"kind": "torch", "name": "lenet5"}}}
    with pytest.raises(ConfigError, match=r"field 'model' of node n1: a model of kind 'torch' needs PyTorch: "
                                          r"pip install '\.\[torch\]'"):
        usercode.check(str(tmp_path), structure, {"n1": {"shard": "n.npz", "n_classes": 10}}, "gl_structure.json")


def test_a_torch_file_on_docker_nodes_is_refused_before_the_run(tmp_path):
    """Its kind inferred in the probe sandbox: Docker nodes have numpy only (built-ins: test_usercode)."""
    from controller.confs import usercode
    from worker.api.errors import ConfigError

    os.chmod(tmp_path, 0o755)  # (the probe runs as nobody)
    (tmp_path / "nns").mkdir()
    shutil.copy(EXAMPLE, tmp_path / "nns" / "torch_cnn.py")
    np.savez(tmp_path / "n.npz", x_train=np.zeros((3, 8, 8, 1), np.float32), y_train=np.arange(3))
    structure = {n: {"role": "gossip", "model": {"module": "nns/torch_cnn.py", "seed": 0}} for n in ("n1", "n2")}
    usercode.stage(str(tmp_path), structure, "gl_structure.json")
    with pytest.raises(ConfigError, match="field 'model' of node n1 \\(and 1 more\\): a model of kind 'torch' needs "
                                          "PyTorch in the nodes, and the Docker node image has numpy only \\(n2\\)"):
        usercode.check(str(tmp_path), structure, {n: {"shard": "n.npz", "n_classes": 10} for n in structure},
                       "gl_structure.json", {"n1": "netns", "n2": "docker"})


def test_weights_that_turn_nan_in_training_stop_the_node_naming_the_file():
    from dml_app.models import pytorch

    model = pytorch.wrap(Net(), "nns/net.py: build", {})
    model.set_weights([np.full_like(w, np.nan) if i == 0 else w for i, w in enumerate(model.get_weights())])
    x, y = np.random.default_rng(0).random((8, 8, 8, 1), dtype=np.float32), np.zeros(8, dtype=np.int64)
    with pytest.raises(ModelError, match=r"nns/net.py: build: the training loss is nan \(weights diverged"):
        model.train(x, y, 1, 4)

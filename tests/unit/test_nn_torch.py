"""The torch kind: its built-in networks hold the numpy networks' arrays (the same names, shapes
and layout on the wire, the same losses on the same weights), it trains, its integer buffers stay
local, a user's module is wrapped with its hooks, and what is not a module is refused. Skipped
without PyTorch (CI installs it)."""
from __future__ import annotations

import numpy as np
import pytest

from dml_app.models.contract import ModelError
from dml_app.models.make import make_model

torch = pytest.importorskip("torch")
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

"""The numpy networks against the same networks in Keras, on the same weights: logits, one SGD
step and one Adam step (BatchNormalization in training mode, moving statistics included), and
the Keras wrapper's model contract. Skipped without TensorFlow (CI installs it)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from dml_app.models import keras as keras_kind
from dml_app.models.numpy.mlp import NumpyMLP
from dml_app.models.numpy.net import build_numpy

NETS = [("edgetb_fashion_cnn", (28, 28, 1)), ("edgetb_fashion_cnn", (8, 8, 1)), ("lenet5", (28, 28, 1)),
        ("lenet5", (8, 8, 1)), ("edgetb_cifar10_cnn", (32, 32, 3)), ("mlp", (8, 8, 1))]


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


def _pair(name: str, shape: tuple, conf: dict):
    """The numpy net and the Keras net of ``name``, the Keras one holding the numpy one's weights."""
    net = build_numpy(name, shape, 10, conf)
    keras = keras_kind.KerasModel(keras_kind.build_keras(name, shape, 10, conf))
    keras.set_weights(net.get_weights())
    return net, keras


def _batch(shape: tuple, n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.random((n, *shape), dtype=np.float32), rng.integers(0, 10, n)


@pytest.mark.parametrize("name,shape", NETS)
def test_same_weights_same_names_same_logits(tf, name, shape):
    net, keras = _pair(name, shape, {"seed": 2})
    assert keras.weight_names() == net.weight_names()
    assert [w.shape for w in keras.get_weights()] == [w.shape for w in net.get_weights()]
    x, _ = _batch(shape)
    for layer in net.layers:  # moving statistics away from 0 and 1, so that evaluation mode shows
        if layer.keras_name == "batch_normalization":
            layer.params[2][:] = np.linspace(-0.2, 0.3, layer.params[2].size)
            layer.params[3][:] = np.linspace(0.5, 2.0, layer.params[3].size)
    keras.set_weights(net.get_weights())
    expected = keras.model(x, training=False).numpy()
    assert np.abs(expected).max() > 0.01
    assert np.allclose(net.logits(x), expected, atol=1e-4)


def _after_one_step(name: str, shape: tuple, conf: dict) -> tuple[list, list, list, list[str]]:
    net, keras = _pair(name, shape, conf)
    before = net.get_weights()
    x, y = _batch(shape)
    net.train_step(x, y)
    keras.model.train_on_batch(x, y)  # one batch, BatchNormalization in training mode
    return before, net.get_weights(), keras.get_weights(), net.weight_names()


@pytest.mark.parametrize("name,shape", NETS)
def test_one_sgd_step_gives_the_same_weights(tf, name, shape):
    before, mine, theirs, names = _after_one_step(name, shape, {"optimizer": "sgd", "learning_rate": 0.05,
                                                                "seed": 3})
    for n, b, a, k in zip(names, before, mine, theirs):
        assert not np.array_equal(a, b), n  # the step moved it (biases and moving statistics too)
        assert np.allclose(a, k, atol=1e-4), n


def _gradient_errors(tf, keras, exact, x, y) -> list:
    """Per array of the weight list: the largest error of TensorFlow's float32 gradient against
    the float64 numpy one (None for moving statistics); leaves the Keras weights as they were."""
    before = keras.get_weights()
    with tf.GradientTape() as tape:
        logits = keras.model(x, training=True)
        loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)
    theirs = iter(g.numpy() for g in tape.gradient(loss, keras.model.trainable_variables))
    keras.set_weights(before)  # the training-mode call moved the moving statistics
    _, grads, _ = exact.gradients(x, y)
    return grads, [None if g is None else float(np.abs(next(theirs) - g).max()) for g in grads]


@pytest.mark.parametrize("name,shape", NETS)
def test_one_adam_step_gives_the_same_weights(tf, name, shape):
    """Adam's first step is lr * g / (|g| + e), e = 1e-7 / sqrt(0.001): where the gradient is
    within TensorFlow's float32 error d of zero, or so near it that changing g by d changes the
    step by more than half the tolerance, the step is as uncertain as TensorFlow's gradient;
    those elements are held to Adam's bound |step| <= lr only, every other one must agree."""
    lr, e = 0.001, 1e-7 / np.sqrt(0.001)
    conf = {"optimizer": "adam", "learning_rate": lr, "seed": 4}
    net, keras = _pair(name, shape, conf)
    exact = build_numpy(name, shape, 10, conf, dtype="float64")
    before = net.get_weights()
    exact.set_weights(before)
    x, y = _batch(shape)
    grads, errors = _gradient_errors(tf, keras, exact, x, y)
    net.train_step(x, y)
    keras.model.train_on_batch(x, y)
    checked = uncertain = 0
    for n, b, a, k, g, d in zip(net.weight_names(), before, net.get_weights(), keras.get_weights(), grads, errors):
        assert not np.array_equal(a, b), n  # the step moved it (moving statistics too)
        if g is None:
            sure = np.ones(a.shape, bool)
        else:
            d = 2 * d  # margin: the tape's gradient is not the fit step's to the last bit
            size = np.abs(g)
            sure = (g == 0) | ((size > d) & (lr * e * d <= 0.5e-4 * (size + e) * (size - d + e)))
            assert np.all(np.abs(a - b) <= lr * 1.0001), n
        checked += int(sure.sum())
        uncertain += int((~sure).sum())
        assert np.allclose(a[sure], k[sure], atol=1e-4), n
    print(f"{name} {shape}: Adam step compared on {checked} elements, {uncertain} within TensorFlow's error")
    assert uncertain <= 0.02 * checked


def test_the_wrapper_keeps_the_contract(tf):
    net, keras = _pair("edgetb_fashion_cnn", (8, 8, 1), {"seed": 5})
    x, y = _batch((8, 8, 1), 40)
    loss, accuracy = keras.evaluate(x.reshape(40, 64), y)  # flat features reshaped to 8x8x1
    mine = net.evaluate(x, y)
    assert abs(loss - mine[0]) < 1e-4 and abs(accuracy - mine[1]) < 1e-6
    result = keras.train(x, y, epochs=2, batch_size=8)
    assert result["loss"] > 0 and result["train_s"] > 0
    assert all(w.dtype == np.float32 for w in keras.get_weights())
    with pytest.raises(ValueError, match="expected 22 arrays"):
        keras.set_weights(keras.get_weights()[:-1])
    bad = keras.get_weights()
    bad[0] = np.zeros((3, 3, 1, 31), np.float32)
    with pytest.raises(ValueError, match="array 0"):
        keras.set_weights(bad)
    with pytest.raises(ValueError, match="do not fit"):
        keras.evaluate(x.reshape(40, 64)[:, :60], y)
    with pytest.raises(ValueError, match="known ones are edgetb_fashion_cnn"):
        keras_kind.build_keras("vgg16", (32, 32, 3), 10, {})


def test_keras_mlp_is_the_numpy_mlp(tf):
    mlp = NumpyMLP([64, 64, 10], learning_rate=0.005)
    keras = keras_kind.KerasModel(keras_kind.build_keras("mlp", (64,), 10, {}))
    assert keras.weight_names() == mlp.weight_names()
    assert float(keras.model.optimizer.learning_rate.numpy()) == pytest.approx(0.005)
    keras.set_weights(mlp.get_weights())
    x, y = _batch((64,), 30)
    assert np.allclose(keras.evaluate(x, y), mlp.evaluate(x, y), atol=1e-4)


def test_without_tensorflow_keras_nets_say_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # import tensorflow raises ImportError
    with pytest.raises(ValueError, match=r"needs TensorFlow: pip install '\.\[tf\]'"):
        keras_kind.build_keras("lenet5", (28, 28, 1), 10, {})

"""The numpy MLP's optimizer steps over its flat buffers equal Adam and SGD written out."""
from __future__ import annotations

import numpy as np
import pytest

from dml_app.models.numpy.mlp import NumpyMLP


def _batch(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((32, 12), dtype=np.float32), rng.integers(0, 4, 32)


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_three_steps_equal_the_textbook_update_bit_for_bit(optimizer):
    model = NumpyMLP([12, 16, 8, 4], optimizer=optimizer, learning_rate=0.05)
    params = model.get_weights()
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    x, y = _batch()
    for step in range(1, 4):
        _, grads = model._gradients(x, y)
        grads = [g.copy() for g in grads]
        model._apply(grads)
        for i, g in enumerate(grads):
            if optimizer == "sgd":
                params[i] = params[i] - (0.05 * g).astype(np.float32)
                continue
            m[i] = 0.9 * m[i] + (1 - 0.9) * g
            v[i] = 0.999 * v[i] + (1 - 0.999) * g * g
            m_hat, v_hat = m[i] / (1 - 0.9 ** step), v[i] / (1 - 0.999 ** step)
            params[i] = params[i] - (0.05 * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)
        for mine, expected in zip(model.get_weights(), params):
            assert mine.dtype == np.float32
            np.testing.assert_array_equal(mine, expected)


def test_weights_are_copies_in_and_out():
    model = NumpyMLP([12, 16, 4])
    weights = model.get_weights()
    weights[0][...] = 7.0                       # changing a copy leaves the model alone
    assert not np.any(model.get_weights()[0] == 7.0)
    rng = np.random.default_rng(2)
    given = [rng.standard_normal(w.shape) for w in weights]       # float64, cast on the way in
    expected = [g.astype(np.float32) for g in given]
    model.set_weights(given)
    given[0][...] = 9.0                         # nor does changing what was given
    for mine, wanted in zip(model.get_weights(), expected):
        assert mine.dtype == np.float32
        np.testing.assert_array_equal(mine, wanted)
    x, y = _batch()
    model.train(x, y, 1, 32)                    # training moves the weights set
    assert not np.array_equal(model.get_weights()[0], expected[0])

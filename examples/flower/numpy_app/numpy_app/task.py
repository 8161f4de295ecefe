"""The model (softmax regression as two arrays), its training and evaluation, and the data:
the node's own shard (``data-path`` of its node config, an ``.npz`` with ``x_train``,
``y_train``, ``x_test``, ``y_test``) or, without one, a synthetic partition."""
from __future__ import annotations

import numpy as np

N_FEATURES = 64  # the digits dataset: 8x8 images
N_CLASSES = 10


def initial_weights(padding_values: int = 0) -> list[np.ndarray]:
    """Weights and biases, all zeros; with ``padding_values``, a third array of that many zeros
    that travels with the model untouched (a larger model on the wire, the same training)."""
    arrays = [np.zeros((N_FEATURES, N_CLASSES), np.float32), np.zeros(N_CLASSES, np.float32)]
    return arrays + ([np.zeros(padding_values, np.float32)] if padding_values > 0 else [])


def _samples(x: np.ndarray) -> np.ndarray:
    x = x.reshape(len(x), -1)
    return (x / 255.0).astype(np.float32) if x.dtype == np.uint8 else x.astype(np.float32)


def load_data(node_config: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) of this node."""
    path = node_config.get("data-path")
    if path:
        with np.load(str(path), allow_pickle=False) as d:
            return _samples(d["x_train"]), d["y_train"].astype(np.int64), _samples(d["x_test"]), d["y_test"].astype(np.int64)
    pid, parts = int(node_config.get("partition-id", 0)), int(node_config.get("num-partitions", 1))
    rng = np.random.default_rng(1234)  # the same classes everywhere, a different share per partition
    centres = rng.normal(size=(N_CLASSES, N_FEATURES)).astype(np.float32)
    mine = np.random.default_rng(pid + 7 * parts)
    y = mine.integers(0, N_CLASSES, 400)
    x = centres[y] + mine.normal(scale=4.0, size=(len(y), N_FEATURES)).astype(np.float32)
    return x[:300], y[:300], x[300:], y[300:]


def _probabilities(weights: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    z = x @ weights[0] + weights[1]
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def train(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray, epochs: int, lr: float) -> tuple[list[np.ndarray], float]:
    """Full-batch gradient descent; the new weights (any padding as it came) and the last training loss."""
    w, b = weights[0].copy(), weights[1].copy()
    onehot = np.eye(N_CLASSES, dtype=np.float32)[y]
    loss = 0.0
    for _ in range(epochs):
        p = _probabilities([w, b], x)
        loss = float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-9)))
        grad = (p - onehot) / len(y)
        w -= lr * (x.T @ grad)
        b -= lr * grad.sum(axis=0)
    return [w, b, *weights[2:]], loss


def evaluate(weights: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(loss, accuracy) on ``x``, ``y``."""
    p = _probabilities(weights, x)
    loss = float(-np.mean(np.log(p[np.arange(len(y)), y] + 1e-9)))
    return loss, float(np.mean(p.argmax(axis=1) == y))

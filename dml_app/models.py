"""Choosing a node's model from its conf: the numpy MLP (default) or a Keras MLP.

Conf: ``{"kind": "numpy" | "tf", "hidden": [64], "learning_rate": 0.005,
"optimizer": "adam", "seed": 0}``. Every node of a run uses the same seed, so
all start from the same weights (averaging models from different random starts
would mix unrelated features).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from dml_app.model_numpy import NumpyMLP

MAX_GLOBAL_TEST_SAMPLES = 1_000_000  # the upper bound of a dataset file's global_test_size


def make_model(conf: dict[str, Any], n_features: int, n_classes: int) -> Any:
    kind = conf.get("kind", "numpy")
    sizes = [n_features, *[int(h) for h in conf.get("hidden", [64])], n_classes]
    lr = float(conf.get("learning_rate", 0.005))
    seed = int(conf.get("seed", 0))
    if kind == "numpy":
        return NumpyMLP(sizes, lr, conf.get("optimizer", "adam"), seed)
    if kind == "tf":
        return KerasMLP(sizes, lr, seed)
    raise ValueError(f"unknown model kind {kind!r}: use numpy or tf")


def load_global_test(path: str, n_features: int, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """The run's global test set: an npz (no pickle) with ``x`` (samples x features, float)
    and ``y`` (class labels). Anything that does not fit the model raises ValueError."""
    try:
        with np.load(path, allow_pickle=False) as f:
            files = sorted(f.files)
            x = f["x"] if "x" in files else None
            y = f["y"] if "y" in files else None
    except Exception as e:  # missing, not an npz, a pickled array (refused), a corrupt member
        raise ValueError(f"global test set {path}: cannot be read: {type(e).__name__}: {e}") from None
    if x is None or y is None:
        raise ValueError(f"global test set {path}: needs arrays x and y, has {files}")
    if len(x) != len(y) or not 0 < len(y) <= MAX_GLOBAL_TEST_SAMPLES:
        raise ValueError(f"global test set {path}: {len(x)} samples of x and {len(y)} of y "
                         f"(1 to {MAX_GLOBAL_TEST_SAMPLES} expected, the same count)")
    if x.dtype.kind not in "fiu" or y.dtype.kind not in "iu":
        raise ValueError(f"global test set {path}: x must be numbers and y integer labels, got {x.dtype} and {y.dtype}")
    x = x.reshape(len(x), -1).astype(np.float32)
    if x.shape[1] != n_features:
        raise ValueError(f"global test set {path}: {x.shape[1]} features, the model takes {n_features}")
    y = y.astype(np.int64)
    if y.min() < 0 or y.max() >= n_classes:
        raise ValueError(f"global test set {path}: labels {int(y.min())}..{int(y.max())}, "
                         f"the model has {n_classes} classes")
    return x, y


class KerasMLP:
    """The same MLP in TensorFlow/Keras (``pip install .[tf]``), with the numpy model's interface."""

    def __init__(self, sizes: Sequence[int], learning_rate: float, seed: int) -> None:
        try:
            import tensorflow as tf
        except ImportError:
            raise ValueError("model kind 'tf' needs TensorFlow: pip install '.[tf]'") from None
        tf.keras.utils.set_random_seed(seed)
        layers = [tf.keras.Input(shape=(sizes[0],))]
        layers += [tf.keras.layers.Dense(h, activation="relu") for h in sizes[1:-1]]
        layers.append(tf.keras.layers.Dense(sizes[-1]))
        self.model = tf.keras.Sequential(layers)
        self.model.compile(optimizer=tf.keras.optimizers.Adam(learning_rate),
                           loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])

    def get_weights(self) -> list[np.ndarray]:
        return [w.astype(np.float32) for w in self.model.get_weights()]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        self.model.set_weights(list(weights))

    def train(self, x: np.ndarray, y: np.ndarray, epochs: int = 1, batch_size: int = 32) -> dict[str, float]:
        started = time.perf_counter()
        hist = self.model.fit(x, y, epochs=int(epochs), batch_size=batch_size, verbose=0)
        return {"loss": float(hist.history["loss"][-1]), "train_s": time.perf_counter() - started}

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        loss, acc = self.model.evaluate(x, y, verbose=0)
        return float(loss), float(acc)

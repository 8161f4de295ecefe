"""The Keras kind (``"kind": "keras"``, or its older name ``"tf"``): the built-in networks in
TensorFlow/Keras, and a user's compiled ``tf.keras.Model``, behind the node model contract.

What ``make_model`` asks of a kind: ``build`` (a built-in network: ``build_keras`` gives the
compiled model of its description, whose weight list (order, shapes, layer names) is the numpy
network's, so the same weights can be set in either; ``KerasModel`` wraps it as a node model),
``seed`` (TensorFlow seeded before a user's build: the same initial weights on every node) and
``wrap`` (a user's compiled model as a node model). TensorFlow is imported inside the functions
only: a node that never uses Keras does not load it.
"""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import numpy as np

from dml_app.models import architectures
from dml_app.models.contract import ModelError


def _tf() -> Any:
    try:
        import tensorflow as tf
    except ImportError:
        raise ValueError("a Keras model needs TensorFlow: pip install '.[tf]'") from None
    return tf


def build_keras(name: str, input_shape: Sequence[int], n_classes: int, conf: dict[str, Any] | None = None) -> Any:
    """A compiled ``tf.keras.Model`` for network ``name`` (``dml_app.models.architectures``): Adam (or SGD,
    conf ``optimizer``) at conf ``learning_rate``, sparse categorical cross-entropy from logits,
    accuracy; conf ``seed`` seeds the initial weights."""
    conf = conf or {}
    steps = architectures.architecture(name, input_shape, n_classes, conf)
    optimizer = conf.get("optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    tf = _tf()
    tf.keras.utils.set_random_seed(int(conf.get("seed", 0)))
    made = {"conv2d": lambda o, n: tf.keras.layers.Conv2D(o["filters"], o["kernel_size"], padding=o["padding"],
                                                          activation=o["activation"], name=n),
            "batch_normalization": lambda o, n: tf.keras.layers.BatchNormalization(
                momentum=o.get("momentum", architectures.BN_MOMENTUM), epsilon=1e-3, name=n),
            "max_pooling2d": lambda o, n: tf.keras.layers.MaxPooling2D(2, name=n),
            "flatten": lambda o, n: tf.keras.layers.Flatten(name=n),
            "dense": lambda o, n: tf.keras.layers.Dense(o["units"], activation=o["activation"], name=n)}
    counts: dict[str, int] = {}
    layers = [tf.keras.Input(shape=tuple(int(d) for d in input_shape))]
    for kind, opts in steps:  # named as the numpy net names its layers
        seen = counts.get(kind, 0)
        counts[kind] = seen + 1
        layers.append(made[kind](opts, kind if seen == 0 else f"{kind}_{seen}"))
    model = tf.keras.Sequential(layers, name=name)
    lr = architectures.learning_rate(name, conf)
    opt = tf.keras.optimizers.Adam(lr) if optimizer == "adam" else tf.keras.optimizers.SGD(lr)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def weight_name(variable: Any, model_name: str) -> str:
    """``"<layer>/<array>"`` of a Keras variable (Keras 3's ``path``, or tf.keras 2's ``name``)."""
    name = str(getattr(variable, "path", None) or variable.name)
    name = name.split(":")[0]
    return name[len(model_name) + 1:] if name.startswith(model_name + "/") else name


class KerasModel:
    """A compiled Keras model as a node model: float32 weights, silent fit/evaluate, inputs reshaped
    to the model's input shape when their element count per sample matches."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.input_shape = tuple(int(d) for d in model.input_shape[1:])

    def get_weights(self) -> list[np.ndarray]:
        return [np.asarray(w, dtype=np.float32) for w in self.model.get_weights()]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        current = self.model.get_weights()
        if len(weights) != len(current):
            raise ValueError(f"expected {len(current)} arrays, got {len(weights)}")
        for i, (w, c) in enumerate(zip(weights, current)):
            if tuple(np.shape(w)) != tuple(c.shape):
                raise ValueError(f"array {i}: shape {tuple(np.shape(w))}, expected {tuple(c.shape)}")
        self.model.set_weights([np.asarray(w, dtype=np.float32) for w in weights])

    def weight_names(self) -> list[str]:
        return [weight_name(v, self.model.name) for v in self.model.weights]

    def shaped(self, x: np.ndarray) -> np.ndarray:
        """``x`` as ``(n, *input_shape)`` float32."""
        x = np.asarray(x, dtype=np.float32)
        if tuple(x.shape[1:]) != self.input_shape:
            if x.ndim < 1 or math.prod(x.shape[1:]) != math.prod(self.input_shape):
                raise ValueError(f"inputs of shape {list(x.shape[1:])} per sample do not fit the model's "
                                 f"input shape {list(self.input_shape)}")
            x = x.reshape(len(x), *self.input_shape)
        return x

    def train(self, x: np.ndarray, y: np.ndarray, epochs: int = 1, batch_size: int = 32) -> dict[str, float]:
        """Keras ``fit``; returns the mean loss of the last epoch and the seconds spent."""
        started = time.perf_counter()
        hist = self.model.fit(self.shaped(x), np.asarray(y, dtype=np.int64), epochs=int(epochs),
                              batch_size=int(batch_size), verbose=0)
        return {"loss": float(hist.history["loss"][-1]), "train_s": time.perf_counter() - started}

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean cross-entropy loss, accuracy)."""
        loss, acc = self.model.evaluate(self.shaped(x), np.asarray(y, dtype=np.int64), verbose=0)
        return float(loss), float(acc)


# the kind ------------------------------------------------------------------------------------------
def seed(value: int) -> None:
    """Seed TensorFlow (the same initial weights on every node), or say how to install it."""
    try:
        import tensorflow as tf
    except ImportError:
        raise ModelError("a model of kind 'keras' needs TensorFlow: pip install '.[tf]'") from None
    tf.keras.utils.set_random_seed(value)
    try:  # one thread per pool, as numpy's BLAS: hundreds of nodes share a few cores
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # the runtime is already up (a second model in one process): as it is
        pass


def build(name: str, input_shape: tuple[int, ...], n_classes: int, conf: dict[str, Any]) -> KerasModel:
    """Built-in network ``name`` in Keras, TensorFlow seeded first (the same weights on every node)."""
    seed(int(conf.get("seed") or 0))
    return KerasModel(build_keras(name, input_shape, n_classes, conf))


def wrap(built: Any, what: str, conf: dict[str, Any], hooks: Any = None) -> KerasModel:
    """A user's build result (``what`` names it) as a node model: it must be a compiled
    ``tf.keras.Model``; the model conf's ``bn_momentum`` and ``learning_rate`` apply to it."""
    if not callable(getattr(built, "fit", None)) or not callable(getattr(built, "get_weights", None)):
        raise ModelError(f"{what} must return a tf.keras.Model (model kind 'keras'), got {type(built).__name__}")
    if getattr(built, "optimizer", None) is None or getattr(built, "compiled_loss", True) is None:
        raise ModelError(f"{what} must return a compiled model: call model.compile(...)")
    if conf.get("bn_momentum") is not None:
        for layer in _layers(built):
            if type(layer).__name__ == "BatchNormalization":
                layer.momentum = float(conf["bn_momentum"])
    if conf.get("learning_rate") is not None:
        built.optimizer.learning_rate = float(conf["learning_rate"])
    return KerasModel(built)


def _layers(model: Any) -> list[Any]:
    """Every layer of ``model``, those of nested models included."""
    found = []
    for layer in getattr(model, "layers", []):
        found.append(layer)
        found.extend(_layers(layer))
    return found

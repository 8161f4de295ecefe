"""A Sequential numpy network with the node model contract.

Softmax cross-entropy from logits, Adam (Keras' update and defaults: beta1
0.9, beta2 0.999, epsilon 1e-7) or plain SGD, seeded glorot-uniform
initialisation and a seeded batch order, float32 unless float64 is asked for
(gradient checks). Layers are named as Keras names them in a fresh model
(``conv2d``, ``conv2d_1``, ``batch_normalization``, ...), and ``weight_names``
gives ``"<layer>/<array>"`` per array, in ``get_weights`` order.

``build_numpy`` makes a built-in network (``dml_app.models.architectures``) as a ``Sequential``
of ``layers``, one layer per step of its description.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np

from dml_app.models.architectures import architecture, learning_rate
from dml_app.models.numpy import layers as L
from dml_app.models.numpy.heap import reuse_freed_memory
from dml_app.models.numpy.layers import Layer
from dml_app.models.numpy.minibatch import train_epochs
from dml_app.models.numpy.rand import Rng

EVAL_BATCH = 16  # samples per forward pass when evaluating: a batch's maps stay in cache (5-8 % faster than 32) and memory low
KEEP_FREED_S = 1.0  # freed memory kept this long after a call: a round's training and evaluations share it


class Sequential:
    """Layers in a row, built for per-sample ``input_shape``; the last layer's outputs are logits."""

    def __init__(self, layers: Sequence[Layer], input_shape: Sequence[int], learning_rate: float = 0.001,
                 optimizer: str = "adam", seed: int = 0, dtype: str = "float32") -> None:
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
        if not layers:
            raise ValueError("a network needs at least one layer")
        self.dtype = np.dtype(dtype)
        self.input_shape = tuple(int(d) for d in input_shape)
        if not self.input_shape or min(self.input_shape) < 1:
            raise ValueError(f"input shape must be positive sizes, got {list(input_shape)}")
        self.layers = list(layers)
        self.learning_rate = float(learning_rate)
        self.optimizer = optimizer
        self.rng = Rng(seed)
        counts: dict[str, int] = {}
        shape = self.input_shape
        for layer in self.layers:
            seen = counts.get(layer.keras_name, 0)
            counts[layer.keras_name] = seen + 1
            layer.name = layer.keras_name if seen == 0 else f"{layer.keras_name}_{seen}"
            shape = layer.build(shape, self.rng, self.dtype)
        if len(shape) != 1:
            raise ValueError(f"the last layer must give (classes,) logits, gives {shape}")
        self.n_classes = shape[0]
        self._slots = [(layer, i) for layer in self.layers for i in range(len(layer.params))]
        self._m = [np.zeros_like(layer.params[i]) for layer, i in self._slots]
        self._v = [np.zeros_like(layer.params[i]) for layer, i in self._slots]
        self._step = 0

    # weights ---------------------------------------------------------------------------
    def get_weights(self) -> list[np.ndarray]:
        return [layer.params[i].copy() for layer, i in self._slots]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        if len(weights) != len(self._slots):
            raise ValueError(f"expected {len(self._slots)} arrays, got {len(weights)}")
        for k, (w, (layer, i)) in enumerate(zip(weights, self._slots)):
            if tuple(np.shape(w)) != layer.params[i].shape:
                raise ValueError(f"array {k} ({layer.name}/{layer.param_names[i]}): shape {tuple(np.shape(w))}, "
                                 f"expected {layer.params[i].shape}")
        for w, (layer, i) in zip(weights, self._slots):
            layer.params[i] = np.array(w, dtype=self.dtype)  # a copy

    def weight_names(self) -> list[str]:
        return [f"{layer.name}/{layer.param_names[i]}" for layer, i in self._slots]

    def count_params(self) -> int:
        return sum(math.prod(layer.params[i].shape) for layer, i in self._slots)

    # forward / backward ------------------------------------------------------------------
    def shaped(self, x: np.ndarray) -> np.ndarray:
        """``x`` as ``(n, *input_shape)`` of the net's dtype; the element count per sample must match."""
        x = np.asarray(x)
        if tuple(x.shape[1:]) != self.input_shape:
            per_sample = math.prod(x.shape[1:]) if x.ndim > 1 else 1
            if x.ndim < 1 or per_sample != math.prod(self.input_shape):
                raise ValueError(f"inputs of shape {list(x.shape[1:])} per sample do not fit the model's "
                                 f"input shape {list(self.input_shape)}")
            x = x.reshape(len(x), *self.input_shape)
        return np.ascontiguousarray(x, dtype=self.dtype)

    def logits(self, x: np.ndarray, training: bool = False) -> np.ndarray:
        """The last layer's outputs for ``x`` (in training mode BatchNormalization uses and
        updates batch statistics)."""
        h = self.shaped(x)
        for layer in self.layers:
            h = layer.forward(h, training)
        return h

    @staticmethod
    def _log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    def gradients(self, x: np.ndarray, y: np.ndarray, need_dx: bool = False
                  ) -> tuple[float, list[Optional[np.ndarray]], Optional[np.ndarray]]:
        """One forward pass in training mode and its backward pass: (mean loss, one gradient per
        array of ``get_weights`` (None for moving statistics), the gradient w.r.t. ``x`` if asked)."""
        y = np.asarray(y, dtype=np.int64)
        logp = self._log_softmax(self.logits(x, training=True))
        n = len(y)
        loss = float(-logp[np.arange(n), y].mean())
        delta = np.exp(logp)
        delta[np.arange(n), y] -= 1
        delta /= n
        for depth, layer in enumerate(reversed(self.layers)):
            last = depth == len(self.layers) - 1
            delta = layer.backward(delta, need_dx=need_dx or not last)
        grads = [layer.grads[i] for layer, i in self._slots]
        return loss, grads, delta if need_dx else None

    def _apply(self, grads: list[Optional[np.ndarray]]) -> None:
        lr = self.learning_rate
        if self.optimizer == "sgd":
            for (layer, i), g in zip(self._slots, grads):
                if g is not None:
                    layer.params[i] -= (lr * g).astype(self.dtype)
            return
        self._step += 1
        b1, b2, eps = 0.9, 0.999, 1e-7
        alpha = lr * math.sqrt(1 - b2 ** self._step) / (1 - b1 ** self._step)
        for k, ((layer, i), g) in enumerate(zip(self._slots, grads)):
            if g is None:
                continue
            m, v = self._m[k], self._v[k]
            m += (g - m) * (1 - b1)
            v += (g * g - v) * (1 - b2)
            layer.params[i] -= (alpha * m / (np.sqrt(v) + eps)).astype(self.dtype)

    def train_step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One optimiser step on one batch; returns its loss."""
        loss, grads, _ = self.gradients(x, y)
        self._apply(grads)
        return loss

    # the node model contract ----------------------------------------------------------------
    def train(self, x: np.ndarray, y: np.ndarray, epochs: int = 1, batch_size: int = 32) -> dict[str, float]:
        """Minibatch training in a seeded order; returns the mean loss of the last epoch and the seconds spent.
        The batches reuse the memory the previous ones freed (``heap``), given back ``KEEP_FREED_S``
        after the call unless another call (the round's evaluation) comes first."""
        with reuse_freed_memory(KEEP_FREED_S):
            return train_epochs(self.rng, self.shaped(x), np.asarray(y, dtype=np.int64), epochs, batch_size,
                                self.train_step)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean cross-entropy loss, accuracy) on ``x, y``, BatchNormalization on its moving statistics
        (the batches reuse freed memory, as training's, kept as long)."""
        x = self.shaped(x)
        y = np.asarray(y, dtype=np.int64)
        if len(x) == 0:
            return 0.0, 0.0
        loss_sum, correct = 0.0, 0
        with reuse_freed_memory(KEEP_FREED_S):
            for start in range(0, len(x), EVAL_BATCH):
                xb, yb = x[start:start + EVAL_BATCH], y[start:start + EVAL_BATCH]
                logp = self._log_softmax(self.logits(xb))
                loss_sum += float(-logp[np.arange(len(yb)), yb].sum())
                correct += int((logp.argmax(axis=1) == yb).sum())
        return loss_sum / len(x), correct / len(x)


LAYERS = {"conv2d": L.Conv2D, "batch_normalization": L.BatchNormalization, "max_pooling2d": L.MaxPool2D,
          "flatten": L.Flatten, "dense": L.Dense}  # the layer of each step kind of a description


def build_numpy(name: str, input_shape: Sequence[int], n_classes: int, conf: dict[str, Any] | None = None,
                dtype: str = "float32") -> Sequential:
    """Network ``name`` in numpy. conf: ``learning_rate`` (0.001 for the CNNs), ``optimizer``
    ("adam" | "sgd"), ``seed`` (initial weights and batch order), ``hidden`` (mlp)."""
    conf = conf or {}
    steps = architecture(name, input_shape, n_classes, conf)
    if math.prod(int(d) for d in input_shape) < 1:
        raise ValueError(f"network {name}: input shape {list(input_shape)} is empty")
    return Sequential([LAYERS[kind](**opts) for kind, opts in steps], input_shape,
                      learning_rate(name, conf), conf.get("optimizer", "adam"), int(conf.get("seed", 0)), dtype)

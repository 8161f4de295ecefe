"""A small multilayer perceptron in numpy: the fast default model of a node.

ReLU hidden layers, a softmax output with cross-entropy loss, minibatch SGD or
Adam. Weights are a list of float32 arrays ``[W1, b1, W2, b2, ...]``, the form
gossip, FedAvg and all-reduce combine, named ``dense/kernel``, ``dense/bias``,
``dense_1/kernel``... as Keras names the same MLP's. Inputs of any per-sample
shape (images included) are flattened.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dml_app.models.numpy.minibatch import train_epochs
from dml_app.models.numpy.rand import Rng


class NumpyMLP:
    """Dense layers ``sizes[0] -> ... -> sizes[-1]`` for classification."""

    def __init__(self, sizes: Sequence[int], learning_rate: float = 0.01, optimizer: str = "adam",
                 seed: int = 0) -> None:
        if len(sizes) < 2 or any(int(s) <= 0 for s in sizes):
            raise ValueError(f"layer sizes must be >= 2 positive integers, got {list(sizes)}")
        if optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
        rng = Rng(seed)
        self.sizes = [int(s) for s in sizes]
        self.learning_rate = float(learning_rate)
        self.optimizer = optimizer
        self.rng = rng
        shapes = [shape for fan_in, fan_out in zip(self.sizes[:-1], self.sizes[1:])
                  for shape in ((fan_in, fan_out), (fan_out,))]
        total = sum(int(np.prod(shape)) for shape in shapes)
        # Parameters, their gradients and Adam's moments each live in one flat buffer, the
        # per-layer arrays being views of it: a step is a dozen operations, not a dozen per array.
        self._param_flat = np.zeros(total, np.float32)
        self._grad_flat = np.zeros(total, np.float32)
        self._m_flat = np.zeros(total, np.float32)
        self._v_flat = np.zeros(total, np.float32)
        self._scratch = (np.empty(total, np.float32), np.empty(total, np.float32))
        self.params = _views(self._param_flat, shapes)
        self._grads = _views(self._grad_flat, shapes)
        for i in range(0, len(self.params), 2):
            fan_in = self.sizes[i // 2]
            self.params[i][...] = (rng.standard_normal(shapes[i]) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        self._step = 0

    # weights -----------------------------------------------------------------
    def get_weights(self) -> list[np.ndarray]:
        return [p.copy() for p in self.params]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        if len(weights) != len(self.params):
            raise ValueError(f"expected {len(self.params)} arrays, got {len(weights)}")
        for i, (w, p) in enumerate(zip(weights, self.params)):
            if tuple(w.shape) != p.shape:
                raise ValueError(f"array {i}: shape {tuple(w.shape)}, expected {p.shape}")
        for w, p in zip(weights, self.params):
            p[...] = np.asarray(w, dtype=np.float32)

    def weight_names(self) -> list[str]:
        """One name per array, by layer: ``dense/kernel``, ``dense/bias``, ``dense_1/kernel``, ..."""
        layers = [("dense" if i == 0 else f"dense_{i}") for i in range(len(self.params) // 2)]
        return [f"{layer}/{part}" for layer in layers for part in ("kernel", "bias")]

    @staticmethod
    def _flat(x: np.ndarray) -> np.ndarray:
        """``x`` as (samples, features) float32, whatever its per-sample shape."""
        x = np.asarray(x, dtype=np.float32)
        return x.reshape(len(x), -1) if x.ndim != 2 else x

    # forward / backward ----------------------------------------------------------
    def _forward(self, x: np.ndarray) -> list[np.ndarray]:
        acts = [x]
        for i in range(0, len(self.params), 2):
            z = acts[-1] @ self.params[i] + self.params[i + 1]
            acts.append(np.maximum(z, 0) if i + 2 < len(self.params) else z)
        return acts

    @staticmethod
    def _softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)

    def _gradients(self, x: np.ndarray, y: np.ndarray) -> tuple[float, list[np.ndarray]]:
        acts = self._forward(x)
        probs = self._softmax(acts[-1])
        n = len(x)
        loss = float(-np.log(probs[np.arange(n), y] + 1e-12).mean())
        delta = probs
        delta[np.arange(n), y] -= 1
        delta /= n
        grads = self._grads
        for layer in range(len(self.params) // 2 - 1, -1, -1):
            np.matmul(acts[layer].T, delta, out=grads[2 * layer])
            np.sum(delta, axis=0, out=grads[2 * layer + 1])
            if layer:
                delta = (delta @ self.params[2 * layer].T) * (acts[layer] > 0)
        return loss, grads

    def _apply(self, grads: list[np.ndarray]) -> None:
        """One optimizer step over the flat buffers (``grads`` are views of ``_grad_flat``), in
        place: the same arithmetic, in the same order, as ``m = b1*m + (1-b1)*g`` written out."""
        lr, p, g = self.learning_rate, self._param_flat, self._grad_flat
        if self.optimizer == "sgd":
            p -= (lr * g).astype(np.float32)
            return
        self._step += 1
        b1, b2, eps = 0.9, 0.999, 1e-8
        m, v, (t, u) = self._m_flat, self._v_flat, self._scratch
        m *= b1
        m += np.multiply(g, 1 - b1, out=t)      # m = b1*m + (1-b1)*g
        np.multiply(g, 1 - b2, out=t)
        t *= g
        v *= b2
        v += t                                  # v = b2*v + (1-b2)*g*g
        np.divide(v, 1 - b2 ** self._step, out=t)
        np.sqrt(t, out=t)
        t += eps                                # sqrt(v_hat) + eps
        np.divide(m, 1 - b1 ** self._step, out=u)
        u *= lr                                 # lr * m_hat
        u /= t
        p -= u

    # training and evaluation ----------------------------------------------------------
    def train(self, x: np.ndarray, y: np.ndarray, epochs: int = 1, batch_size: int = 32) -> dict[str, float]:
        """Minibatch training; returns the mean loss of the last epoch and the seconds spent."""
        return train_epochs(self.rng, self._flat(x), np.asarray(y, dtype=np.int64), epochs, batch_size, self._step_on)

    def _step_on(self, x: np.ndarray, y: np.ndarray) -> float:
        loss, grads = self._gradients(x, y)
        self._apply(grads)
        return loss

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean cross-entropy loss, accuracy) on ``x, y``."""
        x = self._flat(x)
        y = np.asarray(y, dtype=np.int64)
        probs = self._softmax(self._forward(x)[-1])
        loss = float(-np.log(probs[np.arange(len(x)), y] + 1e-12).mean())
        return loss, float((probs.argmax(axis=1) == y).mean())


def _views(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Consecutive views of ``flat`` with ``shapes``."""
    views, at = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        views.append(flat[at:at + size].reshape(shape))
        at += size
    return views

"""Your own model, in plain numpy: softmax regression (one dense layer), with the model contract.

In a structure file: ``"model": {"module": "nns/softmax.py", "learning_rate": 0.1}`` (the file
copied into the experiment directory's ``nns/``); the entry's other keys reach ``build`` as ``conf``.
"""
import time

import numpy as np


class Softmax:
    """Logits = x @ W + b, trained by minibatch gradient descent on the cross-entropy."""

    def __init__(self, n_inputs, n_classes, learning_rate, seed):
        rng = np.random.default_rng(seed)
        self.w = (rng.standard_normal((n_inputs, n_classes)) * 0.01).astype(np.float32)
        self.b = np.zeros(n_classes, dtype=np.float32)
        self.lr, self.rng = learning_rate, rng

    def get_weights(self):
        return [self.w.copy(), self.b.copy()]

    def set_weights(self, weights):
        w, b = weights
        if w.shape != self.w.shape or b.shape != self.b.shape:
            raise ValueError(f"expected {self.w.shape} and {self.b.shape}, got {w.shape} and {b.shape}")
        self.w, self.b = np.array(w, dtype=np.float32), np.array(b, dtype=np.float32)

    def weight_names(self):
        return ["dense/kernel", "dense/bias"]

    def _probs(self, x):
        z = x.reshape(len(x), -1) @ self.w + self.b
        e = np.exp(z - z.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def train(self, x, y, epochs=1, batch_size=32):
        started, losses = time.perf_counter(), []
        for _ in range(int(epochs)):
            losses = []
            for idx in np.array_split(self.rng.permutation(len(x)), max(1, len(x) // batch_size)):
                xb, yb = x[idx].reshape(len(idx), -1), y[idx]
                p = self._probs(xb)
                losses.append(float(-np.log(p[np.arange(len(yb)), yb] + 1e-12).mean()))
                p[np.arange(len(yb)), yb] -= 1
                self.w -= self.lr * (xb.T @ p / len(yb)).astype(np.float32)
                self.b -= self.lr * p.mean(axis=0).astype(np.float32)
        return {"loss": float(np.mean(losses)) if losses else 0.0, "train_s": time.perf_counter() - started}

    def evaluate(self, x, y):
        p = self._probs(x)
        loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
        return loss, float((p.argmax(axis=1) == y).mean())


def build(input_shape, n_classes, conf):
    """The testbed calls this on every node (and once in a sandbox before the run)."""
    return Softmax(int(np.prod(input_shape)), n_classes, float(conf.get("learning_rate", 0.1)),
                   int(conf.get("seed", 0)))

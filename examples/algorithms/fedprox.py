"""FedProx (Li et al., 2020): federated trainers whose local training is held near the global model.

Each trainer minimises its loss plus a proximal term, ``f(w) + mu/2 ||w - w_g||^2``, where
``w_g`` is the global model of the round: with uneven (non-IID) shards the trainers then drift
less from each other. The aggregator is the built-in one.

Use: copy this file into the experiment directory and name it in the structure file, with
``mu`` (default 0.01) and, optionally, ``prox_lr`` (the proximal step; default the model's
``learning_rate``)::

    "algorithm": {"module": "algos/fedprox.py", "role": "FedProxTrainer", "mu": 0.01}

How, with nothing but the model's contract (``get_weights``, ``set_weights``, ``train``,
``evaluate``): proximal gradient descent. Each local step is the model's own ``train`` on one
mini-batch (a gradient step on ``f``), then the exact proximal map of the ``mu`` term with
step ``eta = prox_lr``::

    w <- argmin_v ||v - w||^2 / (2 eta) + mu/2 ||v - w_g||^2 = (w + eta mu w_g) / (1 + eta mu)

that is, ``w`` moved towards ``w_g`` by the share ``eta mu / (1 + eta mu)``. With plain SGD
(``"optimizer": "sgd"``) this is proximal SGD on FedProx's local objective. With Adam, whose
steps are scaled per coordinate, ``eta`` is only the nominal step, so the pull is an
approximation of the proximal term's effect (of the right direction and size order). The step
is stable for any ``mu``: ``mu = 0`` is plain local training, a huge ``mu`` keeps ``w`` at ``w_g``.

The round event gains ``prox_mu`` and ``prox_distance`` (``||w - w_g||`` of the update sent).
"""
from __future__ import annotations

import math
import time
import zlib
from typing import Any

import numpy as np

from dml_app.roles.base import NOT_TRAINED, Context, RoundRecord, Weights
from dml_app.roles.fl import TrainerRole


class FedProxTrainer(TrainerRole):
    """The built-in FL trainer, with FedProx's proximal term in its local training."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        params = ctx.conf.get("algorithm") or {}
        self.mu = _number(params.get("mu", 0.01), "mu")
        default_lr = (ctx.conf.get("model") or {}).get("learning_rate", getattr(ctx.model, "learning_rate", 0.01))
        self.prox_lr = _number(params.get("prox_lr", default_lr), "prox_lr")
        self.rng = np.random.default_rng(zlib.crc32(ctx.name.encode()))  # the order of the mini-batches
        self.distance = 0.0  # ||w - w_g|| of the last update

    def local_update(self, arrays: Weights, meta: dict[str, Any]) -> dict[str, float]:
        """``epoch`` epochs of proximal steps from the global model ``arrays``."""
        self.ctx.model.set_weights(arrays)
        if self.epochs <= 0:
            self.distance = 0.0
            return NOT_TRAINED
        return self.ctx.compute(self._train_proximal, arrays)

    def _train_proximal(self, global_weights: Weights) -> dict[str, float]:
        model, (x, y) = self.ctx.model, self.ctx.data[:2]
        pull = self.prox_lr * self.mu / (1.0 + self.prox_lr * self.mu)  # share of the way to w_g per step
        anchor = [np.asarray(g, dtype=np.float64) for g in global_weights]
        started, losses = time.perf_counter(), []
        for _ in range(self.epochs):
            order, losses = self.rng.permutation(len(x)), []
            for start in range(0, len(x), self.batch_size):
                batch = order[start:start + self.batch_size]
                losses.append(model.train(x[batch], y[batch], 1, len(batch))["loss"])
                if pull > 0:
                    model.set_weights([(w - pull * (w - g)).astype(w.dtype)
                                       for w, g in zip(model.get_weights(), anchor)])
        self.distance = math.sqrt(sum(float(np.sum((w - g) ** 2)) for w, g in zip(model.get_weights(), anchor)))
        return {"loss": float(np.mean(losses)) if losses else float("nan"), "train_s": time.perf_counter() - started}

    def round(self, r: int) -> RoundRecord:
        """The built-in round, its event with this algorithm's fields."""
        record = super().round(r)
        record.extra.update(prox_mu=self.mu, prox_distance=self.distance)
        return record


def _number(value: Any, name: str) -> float:
    """A parameter of the algorithm: a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"algorithm, field {name!r}: expected a finite number >= 0, got {value!r}")
    return float(value)

"""Gossip learning with momentum: each node moves towards its neighbours' average with heavy-ball
momentum instead of jumping to it.

Where the built-in gossip node sets its model to the average ``avg`` of its own model ``w`` and
the models that arrived, this one keeps a momentum buffer ``m`` (zero at first)::

    m <- beta * m + (avg - w)
    w <- w + m

``beta = 0`` is plain gossip; a larger ``beta`` carries on in the direction of the last moves
(faster agreement when the models drift together, overshoot when ``beta`` is near 1). A round in
which nothing arrived leaves the model and the buffer as they are, as plain gossip does.

Use: copy this file into the experiment directory and name it in every node's conf, with
``beta`` (in [0, 1), default 0.5)::

    "algorithm": {"module": "algos/gossip_momentum.py", "role": "MomentumGossip", "beta": 0.5}

The round event gains ``momentum_beta`` and ``momentum_norm`` (``||m||`` after the round).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from dml_app.roles.base import Context, RoundRecord, Weights
from dml_app.roles.gossip import GossipRole


class MomentumGossip(GossipRole):
    """The built-in gossip node, combining with heavy-ball momentum."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        beta = (ctx.conf.get("algorithm") or {}).get("beta", 0.5)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"algorithm, field 'beta': expected a number in [0, 1), got {beta!r}")
        self.beta = float(beta)
        self.momentum: Optional[list[np.ndarray]] = None  # m, one float64 array per layer

    def combine(self, received: list[tuple[str, Weights]]) -> None:
        """``m <- beta m + (avg - w)``, ``w <- w + m``, layer by layer in float64."""
        if not received:
            return
        models = [self.ctx.model.get_weights()] + [w for _, w in received]
        new, momentum = [], []
        for i, layers in enumerate(zip(*models)):
            own = np.asarray(layers[0], dtype=np.float64)
            avg = np.mean([np.asarray(layer, dtype=np.float64) for layer in layers], axis=0)
            m = avg - own if self.momentum is None else self.beta * self.momentum[i] + (avg - own)
            momentum.append(m)
            new.append((own + m).astype(layers[0].dtype))
        self.momentum = momentum
        self.ctx.model.set_weights(new)

    def round(self, round_no: int) -> RoundRecord:
        """The built-in round, its event with this algorithm's fields."""
        record = super().round(round_no)
        norm = 0.0 if self.momentum is None else math.sqrt(sum(float(np.sum(m * m)) for m in self.momentum))
        record.extra.update(momentum_beta=self.beta, momentum_norm=norm)
        return record

"""A batch-size schedule: double the batch every few rounds, up to a cap.

The simplest policy that changes how a run trains, and a template for your own: a larger batch
late in training (fewer, bigger steps, fewer rounds' worth of noise) without the gradient noise
scale the built-in ``adaptive_batch`` needs. The batch trains ``every_rounds`` rounds at each size:
with ``every_rounds`` 5, rounds 1-5 use the dataset file's ``batch_size`` (say 32), rounds 6-10
64, rounds 11-15 128, and so on until ``max_batch``.

Use: copy this file into the experiment directory and name it in the structure file, with
``every_rounds`` (default 5), ``factor`` (default 2) and ``max_batch`` (default 256)::

    "policies": [{"module": "policies/schedule_batch.py", "class": "ScheduleBatch",
                  "every_rounds": 5, "max_batch": 256}]

Each node votes the batch size it trained with; the nodes that decide together (a ring's members)
take the largest, so that they all choose the same. Every change is a ``policy_decision`` event.
"""
from __future__ import annotations

from typing import Any

from dml_app.policies import Action, Policy, PolicyError, PolicyView, Vote


def _whole(conf: dict[str, Any], key: str, default: int, low: int) -> int:
    value = conf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PolicyError(f"policy ScheduleBatch, field {key!r}: expected a whole number >= {low}, got {value!r}")
    return value


class ScheduleBatch(Policy):
    """Multiply the batch size by ``factor`` every ``every_rounds`` rounds, at most ``max_batch``."""

    def __init__(self, conf: dict[str, Any], view: PolicyView) -> None:
        super().__init__(conf, view)
        self.every = _whole(conf, "every_rounds", 5, 1)
        self.factor = _whole(conf, "factor", 2, 2)
        self.max_batch = _whole(conf, "max_batch", 256, 1)
        self.current = view.batch_size  # the batch size of the last round trained

    def after_round(self, metrics: dict[str, Any]) -> Vote:
        size = metrics.get("batch_size")
        if isinstance(size, int) and size >= 1:
            self.current = size
        return {"batch_size": self.current}

    def decide(self, round_no: int, votes: dict[str, Vote]) -> Action:
        if round_no <= 1 or (round_no - 1) % self.every:
            return None
        sizes = [v["batch_size"] for v in votes.values() if v and isinstance(v.get("batch_size"), int)]
        current = max(sizes, default=self.current)
        target = min(self.max_batch, current * self.factor)
        if target <= current:
            return None
        return {"batch_size": target, "reason": f"round {round_no}: x{self.factor} every {self.every} rounds"}

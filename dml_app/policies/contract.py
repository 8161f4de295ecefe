"""The policy contract: what a policy is (``Policy``, its hooks), what it may read of its node
(``PolicyView``), and what its votes and actions must be (``check_vote``, ``check_action``).

A policy sees each round's metrics (``after_round``) and answers with its *vote*: a small JSON
object of this node's inputs. ``decide`` turns the votes of the nodes that decide together into
an *action* (``{"strategy": "star:n3"}``, ``{"batch_size": 64}``, ``{"members": [...]}``) or None.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from dml_app.reduction.allreduce import StructureError, parse

Vote = Optional[dict[str, Any]]
Action = Optional[dict[str, Any]]
MAX_VOTE_BYTES = 4096  # one policy's vote, as JSON
MAX_POLICIES = 8  # policies of one structure file (so: votes of one node)
MAX_NUMBER = 1e300  # a vote's numbers stay below this (a float of any policy's arithmetic)
ACTIONS = ("strategy", "batch_size", "members")  # what an action may change


class PolicyError(ValueError):
    """A policy's conf, vote or action cannot be used."""


@dataclass
class PolicyView:
    """What a policy may read of its node: its name, the members it decides with, the
    all-reduce strategy and batch size in use, the nominal rate of its links."""

    name: str
    role: str
    members: list[str] = field(default_factory=list)
    strategy: Optional[str] = None
    batch_size: int = 32
    link_bps: dict[str, int] = field(default_factory=dict)
    sites: dict[str, str] = field(default_factory=dict)
    standby: list[str] = field(default_factory=list)  # FL: trainers not (yet) picked, in the order to add them


class Policy:
    """Base of every policy; override the hooks you need. ``conf``: the policy's entry."""

    kind = "policy"

    def __init__(self, conf: dict[str, Any], view: PolicyView) -> None:
        self.conf = conf
        self.view = view

    def before_run(self) -> None:
        """Once, before the first round."""

    def before_round(self, round_no: int) -> None:
        """Before round ``round_no`` trains."""

    def after_round(self, metrics: dict[str, Any]) -> Vote:
        """After a round: its metrics (the ``round`` event's fields); this node's vote."""
        return None

    def decide(self, round_no: int, votes: dict[str, Vote]) -> Action:
        """The action for the round about to run, from the votes of the nodes deciding
        together (by node name, in member order); None to change nothing."""
        return None

    def on_membership_change(self, members: list[str]) -> None:
        """The members deciding together changed (a ring's formation)."""

    def after_run(self) -> None:
        """Once, after the last round."""


def check_vote(vote: Any, who: str) -> Vote:
    """``vote`` when it is a JSON object of at most ``MAX_VOTE_BYTES``; PolicyError otherwise."""
    if vote is None:
        return None
    if not isinstance(vote, dict):
        raise PolicyError(f"{who}: a vote is a JSON object or None, not {type(vote).__name__}")
    try:
        size = len(json.dumps(vote, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise PolicyError(f"{who}: a vote must be plain JSON ({e})") from None
    if size > MAX_VOTE_BYTES:
        raise PolicyError(f"{who}: a vote takes {size} bytes, more than {MAX_VOTE_BYTES}")
    if not _bounded(vote):
        raise PolicyError(f"{who}: a vote's numbers must be below {MAX_NUMBER:g} in size")
    return vote


def _bounded(value: Any) -> bool:
    """Every number in ``value`` (plain JSON) below ``MAX_NUMBER`` in size."""
    if isinstance(value, dict):
        return all(_bounded(v) for v in value.values())
    if isinstance(value, list):
        return all(_bounded(v) for v in value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return math.isfinite(float(value)) if abs(value) < MAX_NUMBER else False
    return True


def check_action(action: Any, who: str, members: Optional[list[str]] = None) -> Action:
    """``action`` when it changes only what ``ACTIONS`` names (plus a ``reason``); a strategy is
    checked against ``members`` (a ring's) when they are given."""
    if action is None:
        return None
    if not isinstance(action, dict) or not set(action) - {"reason"} <= set(ACTIONS):
        raise PolicyError(f"{who}: an action is an object of {', '.join(ACTIONS)} (and a reason), "
                          f"not {action!r}")
    if "batch_size" in action and not (isinstance(action["batch_size"], int) and action["batch_size"] >= 1):
        raise PolicyError(f"{who}: batch_size must be a whole number >= 1, not {action['batch_size']!r}")
    if "strategy" in action and not isinstance(action["strategy"], str):
        raise PolicyError(f"{who}: strategy must be a string, not {action['strategy']!r}")
    if "strategy" in action and members is not None:
        try:
            parse(action["strategy"], members)
        except StructureError as e:
            raise PolicyError(f"{who}: {e}") from None
    members = action.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise PolicyError(f"{who}: members must be a list of node names, not {members!r}")
    return action

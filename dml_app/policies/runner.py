"""A node's policies built from its structure conf (``build``: the built-in kinds or the user's
own classes) and run together (``Policies``): every policy's vote on a round, and the actions
their decisions take, each a ``policy_decision`` event (or a ``policy_error`` one).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

from dml_app.policies.builtin import KINDS
from dml_app.policies.contract import Policy, PolicyError, PolicyView, Vote, check_action, check_vote
from dml_app.runtime.usercode import UserCodeError, attribute, load_file, shown


def build(entries: list[dict[str, Any]], view: PolicyView, workdir: str) -> list[Policy]:
    """The node's policies from the structure's ``policies`` entries (already validated)."""
    out: list[Policy] = []
    for entry in entries or []:
        if "module" in entry:
            relative = entry["module"]
            cls = attribute(load_file(workdir, relative), relative, entry.get("class", ""), "policy class")
            if not (isinstance(cls, type) and issubclass(cls, Policy)):
                raise UserCodeError(f"{shown(relative)}: {entry.get('class')!r} is not a subclass of dml_app.policies.Policy")
        elif entry.get("kind") in KINDS:
            cls = KINDS[entry["kind"]]
        else:
            raise PolicyError(f"unknown policy {entry!r}; known kinds: {', '.join(KINDS)}")
        out.append(cls(dict(entry), view))
    return out


def policy_id(policy: Policy, index: int) -> str:
    """The policy's name in votes and events: its kind (or class), and its index when needed."""
    name = policy.kind if policy.kind != Policy.kind else type(policy).__name__
    return f"{index}:{name}"


class Policies:
    """A node's policies, run together: the votes of all, and the actions they take."""

    def __init__(self, policies: list[Policy], events: Any, apply: Callable[[dict[str, Any]], None]) -> None:
        self.policies = policies
        self.events = events
        self.apply = apply  # the role's: takes an action (strategy, batch size)
        self.recent: list[dict[str, Any]] = []  # decisions not yet reported (``take_recent``)

    def __bool__(self) -> bool:
        return bool(self.policies)

    def each(self, hook: str, *args: Any) -> None:
        for p in self.policies:
            getattr(p, hook)(*args)

    def votes(self, metrics: dict[str, Any]) -> dict[str, Vote]:
        """Every policy's vote on this round's ``metrics``, by policy id."""
        return {policy_id(p, i): check_vote(p.after_round(dict(metrics)), policy_id(p, i))
                for i, p in enumerate(self.policies)}

    def decide(self, round_no: int, votes: dict[str, dict[str, Vote]],
               members: Optional[list[str]] = None) -> list[dict[str, Any]]:
        """Each policy decides on the members' votes (``votes[member][policy id]``); every
        action is applied and written as a ``policy_decision`` event; the actions, in order.
        A policy that raises, or whose action cannot be taken, changes nothing: a
        ``policy_error`` event (every member deciding on the same votes fails the same way)."""
        taken = []
        for i, p in enumerate(self.policies):
            pid = policy_id(p, i)
            mine = {m: v.get(pid) if isinstance(v, dict) else None for m, v in votes.items()}
            try:
                action = check_action(p.decide(round_no, mine), pid, members)
                if action is None:
                    continue
                self.apply(action)
            except Exception as e:  # a policy's own code (or a peer's odd vote): it acts no more this round
                self.events.write("policy_error", round=round_no, policy=pid, error=f"{type(e).__name__}: {e}"[:500])
                continue
            event = self.events.write("policy_decision", round=round_no, policy=pid, inputs=mine.get(p.view.name),
                                      votes=mine, action=action)
            self.recent.append({"t": event["t"], "round": round_no, "policy": pid, "action": action})
            taken.append(action)
        return taken

    def snapshot(self) -> list[dict[str, Any]]:
        """Every policy's state (its attributes but its view), to ``restore`` when a decision is undone."""
        return [copy.deepcopy({k: v for k, v in vars(p).items() if k != "view"}) for p in self.policies]

    def restore(self, states: list[dict[str, Any]]) -> None:
        for p, state in zip(self.policies, states):
            vars(p).update(copy.deepcopy(state))

    def take_recent(self) -> list[dict[str, Any]]:
        """The decisions since the last call (for the node's progress report)."""
        out, self.recent = self.recent, []
        return out

"""Adaptation policies: code that watches the training and changes how it runs.

A policy sees each round's metrics (``after_round``) and answers with its *vote*: a small JSON
object of this node's inputs. ``decide`` turns the votes of the nodes that decide together into
an *action* (``{"strategy": "star:n3"}``, ``{"batch_size": 64}``) or None. Who decides: every
ring member, on the votes of every member of the next formation (each member decides the same
way, as in KungFu: the votes travel with the ring's formation, so every member sees the same
ones); a gossip node, the FL aggregator and an E-tree parent each on their own vote.

Every decision that acts is a ``policy_decision`` event (round, policy, inputs, votes, action).

Policies of the structure file's ``policies`` list: the built-in kinds (``KINDS``) or the
user's own class (``{"module": "policies/mine.py", "class": "Mine", ...}``), a subclass of
``Policy`` built with its conf (every key of its entry) and a ``PolicyView`` of the node.
"""
from __future__ import annotations

import copy
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dml_app.runtime.usercode import UserCodeError, attribute, load_file

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


def median(values: list[float]) -> Optional[float]:
    """The median of ``values`` (None when empty)."""
    return statistics.median(values) if values else None


class AdaptiveStrategy(Policy):
    """Switch the all-reduce strategy when the communication goodput drops (ring only).

    ``kungfu``: the reference is the goodput of the first round after ``warmup_rounds``; a node
    votes when its goodput is below ``threshold`` x the reference; the ring switches to
    ``alternative`` when more than half the members vote, once.
    ``robust``: the reference is the median goodput of the first ``reference_rounds`` rounds, the
    decision uses the median of the last ``window_rounds``; after a switch, ``cooldown_rounds``
    rounds pass before the next, and the reference is measured anew under the new strategy. The
    candidate is the strategy whose estimated all-reduce time over the link rates the members
    measured since the last switch is least (an edge not measured counts as the fastest). Away
    from the strategy of the start, every ``probe_rounds`` rounds the ring tries it again for one
    round: when most members see its goodput back at ``threshold`` x its first reference, it
    stays; otherwise the ring returns to the strategy it left.
    Every decision depends only on the votes and on round numbers, so all members take the same.
    """

    kind = "adaptive_strategy"

    def __init__(self, conf: dict[str, Any], view: PolicyView) -> None:
        super().__init__(conf, view)
        self.mode = str(conf.get("mode", "robust"))
        self.threshold = float(conf.get("threshold", 0.8))
        self.warmup_rounds = int(conf.get("warmup_rounds", 1))
        self.reference_rounds = int(conf.get("reference_rounds", 5))
        self.window_rounds = int(conf.get("window_rounds", 3))
        self.cooldown_rounds = int(conf.get("cooldown_rounds", 5))
        self.alternative = conf.get("alternative")
        self.probe_rounds = int(conf.get("probe_rounds", 20))
        self.goodputs: list[float] = []  # this node's goodput of every round since the last switch
        self.reference: Optional[float] = None
        self.switches = 0
        self.last_switch: Optional[int] = None
        self.home = view.strategy  # the strategy of the start
        self.home_reference: Optional[float] = None  # this node's first reference, under ``home``
        self.probing: Optional[str] = None  # trying ``home`` again: the strategy to return to
        self.rates: dict[str, float] = {}  # peer -> measured rate (b/s) of this node's sends since the last switch

    def after_round(self, metrics: dict[str, Any]) -> Vote:
        goodput = metrics.get("comm_goodput_bps")
        if not isinstance(goodput, (int, float)) or goodput <= 0:
            return None
        self.goodputs.append(float(goodput))
        for peer, bps in (metrics.get("send_bps") or {}).items():
            self.rates[peer] = float(bps)
        if self.probing is not None:  # this round ran the start's strategy again: is it good?
            back = self.home_reference is not None and goodput >= self.threshold * self.home_reference
            return {"goodput_bps": round(goodput), "vote": not back}
        if self.mode == "kungfu":
            if self.reference is None and len(self.goodputs) > self.warmup_rounds:
                self.reference = self.goodputs[self.warmup_rounds]
            low = self.reference is not None and goodput < self.threshold * self.reference
            return {"goodput_bps": round(goodput), "vote": bool(low)}
        if self.reference is None and len(self.goodputs) >= self.reference_rounds:
            self.reference = median(self.goodputs[:self.reference_rounds])
            if self.home_reference is None and self.view.strategy == self.home:
                self.home_reference = self.reference
        recent = median(self.goodputs[-self.window_rounds:]) if len(self.goodputs) >= self.window_rounds else None
        low = self.reference is not None and recent is not None and recent < self.threshold * self.reference
        return {"goodput_bps": round(goodput), "vote": bool(low),
                "send_bps": {p: round(r) for p, r in sorted(self.rates.items())}}

    def decide(self, round_no: int, votes: dict[str, Vote]) -> Action:
        from dml_app.reduction.allreduce import best_strategy  # (the structures import no policy)

        members = list(votes)
        yes = sum(1 for v in votes.values() if v and v.get("vote"))
        if self.mode == "kungfu":
            if self.switches or not self.alternative or 2 * yes <= len(members):
                return None
            self.switches += 1
            return {"strategy": str(self.alternative), "reason": f"{yes} of {len(members)} members voted"}
        if self.probing is not None:  # the votes of the round that tried the start's strategy again
            left, self.probing = self.probing, None
            if 2 * yes <= len(members):
                self.goodputs.clear()
                self.reference = self.home_reference
                return None  # back home for good
            candidate = left
            reason = f"the start's strategy tried again: {yes} of {len(members)} members still saw its goodput low"
        elif self.last_switch is not None and round_no - self.last_switch < self.cooldown_rounds:
            return None
        elif (self.view.strategy != self.home and self.probe_rounds and self.last_switch is not None
              and round_no - self.last_switch >= self.probe_rounds):
            self.probing, self.last_switch = self.view.strategy, round_no
            return {"strategy": str(self.home), "reason": f"trying the start's strategy again after "
                                                          f"{self.probe_rounds} rounds"}
        elif 2 * yes > len(members):
            candidate = best_strategy(members, measured_rates(votes), self.view.sites)
            if candidate == self.view.strategy:
                return None
            reason = f"{yes} of {len(members)} members saw goodput below {self.threshold:g} x the reference"
        else:
            return None
        self.switches += 1
        self.last_switch = round_no
        self.goodputs.clear()  # a new reference under the new strategy; measurements of now-unused edges expire
        self.reference = None
        self.rates.clear()
        return {"strategy": candidate, "reason": reason}


def measured_rates(votes: dict[str, Vote]) -> dict[tuple[str, str], float]:
    """(sender, receiver) -> the rate the votes report for that edge."""
    out: dict[tuple[str, str], float] = {}
    for sender, vote in votes.items():
        sent = vote.get("send_bps") if isinstance(vote, dict) else None
        for peer, bps in (sent.items() if isinstance(sent, dict) else ()):
            if isinstance(bps, (int, float)) and not isinstance(bps, bool) and 0 < bps < MAX_NUMBER:
                out[(sender, str(peer))] = float(bps)
    return out


class AdaptiveBatch(Policy):
    """Grow the batch with the gradient noise scale (KungFu's rule): the new batch is the moving
    average of the noise scale, at most ``max_growth`` times the current one and at most
    ``max_batch``; it never shrinks. The members decide on the mean of their estimates."""

    kind = "adaptive_batch"

    def __init__(self, conf: dict[str, Any], view: PolicyView) -> None:
        super().__init__(conf, view)
        self.max_batch = int(conf.get("max_batch", 1024))
        self.max_growth = float(conf.get("max_growth", 2.0))
        self.ema = float(conf.get("ema", 0.5))  # weight of the newest estimate
        self.every = int(conf.get("every_rounds", 1))
        self.average: Optional[float] = None

    def after_round(self, metrics: dict[str, Any]) -> Vote:
        gns = metrics.get("gns")
        if not isinstance(gns, (int, float)) or not gns > 0:
            return None
        return {"gns": float(gns)}

    def decide(self, round_no: int, votes: dict[str, Vote]) -> Action:
        estimates = [float(v["gns"]) for v in votes.values() if isinstance(v, dict) and isinstance(v.get("gns"), (int, float))
                     and 0 < v["gns"] < MAX_NUMBER]
        if not estimates:
            return None
        mean = sum(estimates) / len(estimates)
        self.average = mean if self.average is None else self.ema * mean + (1 - self.ema) * self.average
        if round_no % self.every:
            return None
        current = self.view.batch_size
        target = int(min(self.max_batch, current * self.max_growth, self.average))
        if target <= current:
            return None
        return {"batch_size": target, "reason": f"noise scale {self.average:.1f}"}


class ElasticScaling(Policy):
    """Grow the FL aggregator's trainers while it pays (KungFu's rule): every ``window_rounds``
    rounds, the median throughput T(N) (samples trained per second) with N trainers is compared
    with T(N-1): while T(N) >= (1 + ``alpha`` / N) T(N-1), the next standby trainer is added;
    otherwise the last added is removed, and the policy stops."""

    kind = "elastic_scaling"

    def __init__(self, conf: dict[str, Any], view: PolicyView) -> None:
        super().__init__(conf, view)
        self.window_rounds = int(conf.get("window_rounds", 3))
        self.alpha = float(conf.get("alpha", 1 / 3))
        self.window: list[float] = []
        self.previous: Optional[float] = None  # T(N - 1)
        self.added: list[str] = []
        self.stopped = False
        self.history: list[tuple[int, float]] = []  # (N, T(N)) as measured

    def after_round(self, metrics: dict[str, Any]) -> Vote:
        value = metrics.get("throughput_sps")
        return {"throughput_sps": float(value)} if isinstance(value, (int, float)) and value > 0 else None

    def decide(self, round_no: int, votes: dict[str, Vote]) -> Action:
        if self.stopped:
            return None
        self.window += [float(v["throughput_sps"]) for v in votes.values() if isinstance(v, dict)
                        and isinstance(v.get("throughput_sps"), (int, float)) and 0 < v["throughput_sps"] < MAX_NUMBER]
        if len(self.window) < self.window_rounds:
            return None
        n, t = len(self.view.members), median(self.window)
        self.window = []
        self.history.append((n, t))
        gain = None if self.previous is None else t / self.previous - 1
        if self.previous is not None and t < (1 + self.alpha / n) * self.previous and self.added:
            self.stopped = True
            last = self.added.pop()
            return {"members": [m for m in self.view.members if m != last],
                    "reason": f"T({n}) = {t:.1f}/s is only {gain:+.1%} over T({n - 1}); below alpha/N = "
                              f"{self.alpha / n:.1%}: {last} removed"}
        left = [m for m in self.view.standby if m not in self.view.members]
        if not left:
            self.stopped = True
            return None
        self.previous = t
        self.added.append(left[0])
        said = "first window" if gain is None else f"{gain:+.1%} over T({n - 1})"
        return {"members": [*self.view.members, left[0]], "reason": f"T({n}) = {t:.1f}/s ({said}): {left[0]} added"}


KINDS: dict[str, type[Policy]] = {AdaptiveStrategy.kind: AdaptiveStrategy, AdaptiveBatch.kind: AdaptiveBatch,
                                  ElasticScaling.kind: ElasticScaling}


def build(entries: list[dict[str, Any]], view: PolicyView, workdir: str) -> list[Policy]:
    """The node's policies from the structure's ``policies`` entries (already validated)."""
    out: list[Policy] = []
    for entry in entries or []:
        if "module" in entry:
            relative = entry["module"]
            cls = attribute(load_file(workdir, relative), relative, entry.get("class", ""), "policy class")
            if not (isinstance(cls, type) and issubclass(cls, Policy)):
                raise UserCodeError(f"{relative}: {entry.get('class')!r} is not a subclass of dml_app.policies.Policy")
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
        from dml_app.reduction.allreduce import StructureError, parse
        try:
            parse(action["strategy"], members)
        except StructureError as e:
            raise PolicyError(f"{who}: {e}") from None
    members = action.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise PolicyError(f"{who}: members must be a list of node names, not {members!r}")
    return action


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

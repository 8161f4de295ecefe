"""The built-in policies (``KINDS``, by the ``kind`` a structure file names): ``adaptive_strategy``
(a ring's all-reduce strategy, by the goodput), ``adaptive_batch`` (the batch size, by the
gradient noise scale) and ``elastic_scaling`` (an FL aggregator's trainers, by the throughput).
"""
from __future__ import annotations

import statistics
from typing import Any, Optional

from dml_app.policies.contract import MAX_NUMBER, Action, Policy, PolicyView, Vote
from dml_app.reduction.allreduce import best_strategy


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

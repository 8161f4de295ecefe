"""Shaping plans: what tc state one sending interface should hold (pure data, no I/O).

One plan per sender's egress interface:

- an HTB root ``1:`` whose default class ``1:1`` passes unclassified (control)
  traffic at full speed;
- one class ``1:<minor>`` per destination with rate = ceil = the link's rate;
- a leaf under that class: netem where delay/jitter/loss are set, else a pfifo
  when a queue length is set, else the kernel's default;
- a u32 filter ``800::<minor>`` matching the destination IP.

Minors are assigned in rule order from ``FIRST_MINOR`` and kept across updates,
so a runtime change touches one class and its leaf, never the root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from worker.errors import ConfigError
from worker.shape import Shape, format_rate

DEFAULT_MINOR = 1
FIRST_MINOR = 0x10
MAX_MINOR = 0xFFF  # u32 node ids are 12 bits; the filter handle reuses the minor
DEFAULT_CLASS_RATE_BPS = 10 * 10**9
NETEM_DEFAULT_LIMIT = 1000


@dataclass(frozen=True)
class Rule:
    """Traffic to ``dest_ip`` goes through class 1:<minor>, shaped by ``shape``."""

    dest: str
    dest_ip: str
    minor: int
    shape: Shape

    @property
    def leaf(self) -> Optional[str]:
        """The leaf qdisc kind this rule needs: 'netem', 'pfifo' or None."""
        if self.shape.needs_netem:
            return "netem"
        return "pfifo" if self.shape.queue_pkts else None

    def to_dict(self) -> dict[str, Any]:
        return {"dest": self.dest, "dest_ip": self.dest_ip, "minor": self.minor, "shape": self.shape.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Rule":
        return cls(data["dest"], data["dest_ip"], int(data["minor"]), Shape.from_dict(data["shape"]))


@dataclass(frozen=True)
class Plan:
    """Everything one interface should hold."""

    ifname: str
    rules: tuple[Rule, ...] = field(default_factory=tuple)

    @property
    def needs_netem(self) -> bool:
        return any(r.leaf == "netem" for r in self.rules)

    def by_dest(self) -> dict[str, Rule]:
        return {r.dest: r for r in self.rules}

    def to_dict(self) -> dict[str, Any]:
        return {"ifname": self.ifname, "rules": [r.to_dict() for r in self.rules]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        return cls(data["ifname"], tuple(Rule.from_dict(r) for r in data["rules"]))


@dataclass(frozen=True)
class Target:
    """One wanted outgoing link: to node ``dest`` at ``dest_ip``."""

    dest: str
    dest_ip: str
    shape: Shape


def make_plan(ifname: str, targets: list[Target], previous: Optional[Plan] = None) -> Plan:
    """The plan for ``targets``; destinations already in ``previous`` keep their minor."""
    seen: set[str] = set()
    for t in targets:
        if t.dest in seen:
            raise ConfigError(f"two links to {t.dest!r} from the same interface")
        seen.add(t.dest)
    kept = previous.by_dest() if previous else {}
    used = {r.minor for r in kept.values() if r.dest in seen}
    rules = []
    next_minor = FIRST_MINOR
    for t in targets:
        old = kept.get(t.dest)
        if old is not None:
            minor = old.minor
        else:
            while next_minor in used:
                next_minor += 1
            minor = next_minor
            used.add(minor)
        if minor > MAX_MINOR:
            raise ConfigError(f"{ifname}: more than {MAX_MINOR - FIRST_MINOR + 1} destinations on one interface")
        rules.append(Rule(t.dest, t.dest_ip, minor, t.shape))
    return Plan(ifname, tuple(rules))


@dataclass(frozen=True)
class Change:
    """One step of an in-place update: ``op`` is add, change or remove."""

    op: str
    old: Optional[Rule]
    new: Optional[Rule]


def diff(old: Plan, new: Plan) -> list[Change]:
    """The rule-level steps that turn ``old`` into ``new`` (unchanged rules are left out)."""
    before, after = old.by_dest(), new.by_dest()
    changes = [Change("remove", before[d], None) for d in before if d not in after]
    for dest, rule in after.items():
        prior = before.get(dest)
        if prior is None:
            changes.append(Change("add", None, rule))
        elif prior != rule:
            changes.append(Change("change", prior, rule))
    return changes


def _leaf_args(rule: Rule) -> str:
    s = rule.shape
    if rule.leaf == "netem":
        args = f"netem delay {s.delay_ms:g}ms"
        if s.jitter_ms:
            args += f" {s.jitter_ms:g}ms"
        if s.loss_pct:
            args += f" loss {s.loss_pct:g}%"
        return args + f" limit {s.queue_pkts or NETEM_DEFAULT_LIMIT}"
    return f"pfifo limit {s.queue_pkts}"


def rule_commands(dev: str, rule: Rule, verb: str = "add") -> list[str]:
    """The tc command lines for one rule's class, leaf and filter."""
    m = rule.minor
    lines = [f"tc class {verb} dev {dev} parent 1: classid 1:{m:x} htb "
             f"rate {format_rate(rule.shape.rate_bps)} ceil {format_rate(rule.shape.rate_bps)}"]
    if rule.leaf:
        lines.append(f"tc qdisc replace dev {dev} parent 1:{m:x} handle {m:x}: {_leaf_args(rule)}")
    if verb == "add":
        lines.append(f"tc filter add dev {dev} parent 1: protocol ip prio 1 handle 800::{m:x} u32 "
                     f"match ip dst {rule.dest_ip}/32 flowid 1:{m:x}")
    return lines


def render(plan: Plan, netns: Optional[str] = None) -> list[str]:
    """The plan as the equivalent ``tc`` command lines (for --dry-run and logs)."""
    prefix = f"ip netns exec {netns} " if netns else ""
    dev = plan.ifname
    lines = [f"tc qdisc replace dev {dev} root handle 1: htb default {DEFAULT_MINOR:x}",
             f"tc class add dev {dev} parent 1: classid 1:{DEFAULT_MINOR:x} htb "
             f"rate {format_rate(DEFAULT_CLASS_RATE_BPS)} ceil {format_rate(DEFAULT_CLASS_RATE_BPS)}"]
    for rule in plan.rules:
        lines += rule_commands(dev, rule)
    return [prefix + line for line in lines]


def render_diff(dev: str, changes: list[Change]) -> list[str]:
    """An update as tc command lines."""
    lines = []
    for c in changes:
        if c.op == "remove" and c.old:
            m = c.old.minor
            lines += [f"tc filter del dev {dev} parent 1: protocol ip prio 1 handle 800::{m:x} u32",
                      f"tc class del dev {dev} classid 1:{m:x}"]
        elif c.op == "add" and c.new:
            lines += rule_commands(dev, c.new)
        elif c.new and c.old:
            lines.append(rule_commands(dev, c.new, "change")[0])
            if c.old.leaf and c.new.leaf and c.old.leaf != c.new.leaf:
                lines.append(f"tc qdisc del dev {dev} parent 1:{c.new.minor:x} handle {c.new.minor:x}:")
            if c.new.dest_ip != c.old.dest_ip:
                lines.append(rule_commands(dev, c.new)[-1].replace("filter add", "filter replace"))
            if c.new.leaf:
                lines.append(rule_commands(dev, c.new, "change")[1])
            elif c.old.leaf:
                lines.append(f"tc qdisc del dev {dev} parent 1:{c.new.minor:x} handle {c.new.minor:x}:")
    return lines

"""Shaping plans: what tc state one sending interface should hold (pure data, no I/O).

One plan per sender's egress interface:

- an HTB root ``1:`` whose default class ``1:1`` passes unclassified (control)
  traffic at full speed;
- the access class ``1:3``: the node's uplink, parent of every link's class (at the
  uplink rate when the node has one, else at 10 Gbit/s, i.e. no limit);
- one class ``1:<minor>`` per destination under ``1:3``: without an uplink, rate = ceil =
  the link's rate; with one, ceil = the link's rate (no pair exceeds its link) and rate =
  min(link rate, uplink / number of links). HTB lends a class its parent's spare tokens up
  to its ceil and serves a class below its rate without asking the parent, so the rates
  of the children must add up to at most the uplink for the uplink to hold: the equal
  share does that, guarantees every busy peer its share, and lets busy peers borrow what
  idle ones leave (all children have the same quantum, so the spare is shared evenly).
  Changing the uplink, or the number of links under it, changes these classes in place;
  their minors, counters and leaves stay;
- a leaf under that class: netem where delay/jitter/loss are set, else a pfifo
  when a queue length is set, else the kernel's default;
- a u32 filter ``800::<minor>`` matching the destination IP.

Isolation ("no link, no path", the default of a deployed testbed): traffic to the
testbed's node address space (every emulator host's node subnet, every physical
node's address) leaves only by a link. The plan then also holds

- a drop class ``1:2`` whose leaf is a pfifo of limit 0 (every packet enqueued
  there is dropped, and counted, in the kernel: this kernel has no gact action);
- u32 filters ``800::<node>`` (prio 1, like the links) that send the addresses
  which must stay reachable to the default class: each node subnet's gateway
  (the bridge: controller and agents are reached there, other hosts' nodes are
  routed through it) and the peers this node links to without a shaped link of
  its own (the way back of a one-way link: a pair linked in one direction is open
  both ways, its reverse unshaped);
- one u32 filter per node-space prefix at prio 2 (evaluated after every prio-1
  filter) into the drop class: a few prefixes, never one filter per unlinked peer;
- on an emulated node (never on a physical device's NIC), one prio-3 filter that
  drops all IPv6: nodes are addressed by IPv4 only, and their IPv6 link-local
  addresses would otherwise be a path between nodes that no link joins.

ARP is not IP and is not filtered; anything outside the node space (the LAN, the
controller's own address, the Internet) takes the default class as before. An
open plan (EdgeTB's behaviour) has neither the drop class nor these filters.

Minors are assigned in rule order from ``FIRST_MINOR`` and kept across updates,
so a runtime change touches one class and its leaf, never the root. Pass filters
take their node ids from the same range (they have no class of their own).
"""
from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

from worker.api.errors import ConfigError
from worker.api.schema import IPV4_ADDRESS, IPV4_PREFIX, Field, Place, Schema
from worker.api.shape import Shape, tc_rate

DEFAULT_MINOR = 1
DROP_MINOR = 2
ACCESS_MINOR = 3  # the uplink: parent of every link's class  # isolation: the class whose pfifo of limit 0 drops what it is given
RULE_PRIO = 1  # per-destination filters (links and passes)
DROP_PRIO = 2  # node-space prefixes, after every per-destination filter
IPV6_DROP_PRIO = 3  # an emulated node's IPv6 (link-local only: no path of the testbed)
FIRST_MINOR = 0x10
MAX_MINOR = 0xFFF  # u32 node ids are 12 bits; the filter handle reuses the minor
DEFAULT_CLASS_RATE_BPS = 10 * 10**9
NETEM_DEFAULT_LIMIT = 1000  # packets waiting for the link's rate when the link sets no queue
FRAME_BYTES = 1500  # a full-size frame: what the delay line of a busy link holds
# the downlink's IFB device and its HTB tree (worker.shaping.downlink makes it)
IFB_NAME = "edgetb-down"
IFB_ROOT_MINOR = 1
IFB_DEFAULT_MINOR = 2
IFB_FIRST_PEER_MINOR = 0x10
LEAF_LIMIT_PKTS = 100  # per class: 120 ms at 10 Mbit/s


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
class Pass:
    """Traffic to ``dest_ip`` leaves unshaped by the default class (filter 800::<node>):
    a kept address of the node space (``dest`` is "") or a linked peer without a shaped link."""

    dest: str
    dest_ip: str
    node: int

    def to_dict(self) -> dict[str, Any]:
        return {"dest": self.dest, "dest_ip": self.dest_ip, "node": self.node}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Pass":
        return cls(str(data["dest"]), str(data["dest_ip"]), int(data["node"]))


@dataclass(frozen=True)
class Isolation:
    """The testbed's node address space: traffic to ``drop`` leaves only by a link, except
    to the ``keep`` addresses (gateways, the controller) inside it."""

    drop: tuple[str, ...]
    keep: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.drop:
            raise ConfigError("isolation: 'drop' needs at least one prefix (or ask for the open network)")

    def to_dict(self) -> dict[str, Any]:
        return {"drop": list(self.drop), "keep": list(self.keep)}

    @classmethod
    def from_dict(cls, data: Any, place: Union[Place, str] = "isolation") -> Optional["Isolation"]:
        """``{"drop": [prefix, ...], "keep": [address, ...]}``, or ``{"open": true}`` (None: open)."""
        if isinstance(data, dict) and data == {"open": True}:
            return None
        values = ISOLATION_SCHEMA.validate(data, place)
        return cls(tuple(values["drop"]), tuple(values["keep"]))


ISOLATION_SCHEMA = Schema({"drop": Field(list, "the node address space (IPv4 prefixes)", required=True,
                                         items=IPV4_PREFIX),
                           "keep": Field(list, "addresses inside it reached without a link", default=[],
                                         items=IPV4_ADDRESS)},
                          doc='or {"open": true}, the open network')


@dataclass(frozen=True)
class Plan:
    """Everything one interface should hold; ``drops`` is empty on an open network."""

    ifname: str
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    passes: tuple[Pass, ...] = field(default_factory=tuple)
    drops: tuple[str, ...] = field(default_factory=tuple)
    drop_ipv6: bool = False
    keep: tuple[str, ...] = field(default_factory=tuple)  # the isolation's kept addresses, even those a link reaches
    uplink_bps: Optional[int] = None  # the node's access links (None: none); see worker.shaping.downlink for the downlink
    downlink_bps: Optional[int] = None

    @property
    def access_rate_bps(self) -> int:
        """The rate of the access class 1:3: the uplink, or no limit."""
        return self.uplink_bps or DEFAULT_CLASS_RATE_BPS

    def class_rates(self, rule: Rule) -> tuple[int, int]:
        """(rate, ceil) in bit/s of a link's class (see the module docstring)."""
        link = rule.shape.rate_bps
        if not self.uplink_bps:
            return link, link
        return max(8, min(link, self.uplink_bps // max(1, len(self.rules)))), link

    @property
    def needs_netem(self) -> bool:
        return any(r.leaf == "netem" for r in self.rules)

    @property
    def isolated(self) -> bool:
        return bool(self.drops)

    @property
    def empty(self) -> bool:
        """Nothing to hold: no link, no isolation (the interface is left unshaped)."""
        return not (self.rules or self.passes or self.drops or self.uplink_bps or self.downlink_bps)

    def isolation(self) -> Optional[Isolation]:
        """The isolation this plan was made with (None: open)."""
        if not self.drops:
            return None
        return Isolation(self.drops, self.keep or tuple(p.dest_ip for p in self.passes if not p.dest))

    def unshaped(self) -> list[tuple[str, str]]:
        """The peers reached without a shaped link: (node, ip)."""
        return [(p.dest, p.dest_ip) for p in self.passes if p.dest]

    def downlink_peers(self) -> tuple[str, ...]:
        """The addresses that share the node's downlink, each with a class of its own: its linked
        peers and those it reaches without a link (on a testbed, the nodes that send to it)."""
        return tuple(sorted({r.dest_ip for r in self.rules} | {p.dest_ip for p in self.passes if p.dest},
                            key=lambda ip: tuple(int(x) for x in ip.split("."))))

    def by_dest(self) -> dict[str, Rule]:
        return {r.dest: r for r in self.rules}

    def passes_by_ip(self) -> dict[str, Pass]:
        return {p.dest_ip: p for p in self.passes}

    def to_dict(self) -> dict[str, Any]:
        return {"ifname": self.ifname, "rules": [r.to_dict() for r in self.rules],
                "passes": [p.to_dict() for p in self.passes], "drops": list(self.drops),
                "drop_ipv6": self.drop_ipv6, "keep": list(self.keep), "uplink_bps": self.uplink_bps,
                "downlink_bps": self.downlink_bps}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        return cls(data["ifname"], tuple(Rule.from_dict(r) for r in data["rules"]),
                   tuple(Pass.from_dict(p) for p in data.get("passes", [])), tuple(data.get("drops", [])),
                   bool(data.get("drop_ipv6", False)), tuple(data.get("keep", [])),
                   _rate_or_none(data.get("uplink_bps")), _rate_or_none(data.get("downlink_bps")))


def _rate_or_none(value: Any) -> Optional[int]:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Target:
    """One wanted outgoing link: to node ``dest`` at ``dest_ip``."""

    dest: str
    dest_ip: str
    shape: Shape


def make_plan(ifname: str, targets: list[Target], previous: Optional[Plan] = None,
              isolation: Optional[Isolation] = None, unshaped: Iterable[tuple[str, str]] = (),
              drop_ipv6: bool = False, uplink_bps: Optional[int] = None,
              downlink_bps: Optional[int] = None) -> Plan:
    """The plan for ``targets``; destinations already in ``previous`` keep their minor (and
    passes their node). With ``isolation``, the node space is dropped but for its kept
    addresses and the ``unshaped`` peers, (node, ip) pairs reached without a shaped link,
    and with ``drop_ipv6`` (emulated nodes) all IPv6 too. ``uplink_bps`` and
    ``downlink_bps`` are the node's access links (None: none)."""
    seen: set[str] = set()
    for t in targets:
        if t.dest in seen:
            raise ConfigError(f"two links to {t.dest!r} from the same interface")
        seen.add(t.dest)
    wanted_passes = _wanted_passes(targets, isolation, unshaped)
    kept = previous.by_dest() if previous else {}
    kept_passes = previous.passes_by_ip() if previous else {}
    # a new link may take the minor of a link removed in the same update (deleted first), never
    # a pass's node; a new pass takes an id no old filter has: an update adds passes before it
    # changes links and removes passes after, so a peer moving between pass and link never
    # meets the drop filters
    used = {r.minor for r in kept.values() if r.dest in seen} | {p.node for p in kept_passes.values()}
    counter = [FIRST_MINOR]

    def take() -> int:
        while counter[0] in used:
            counter[0] += 1
        used.add(counter[0])
        return counter[0]

    def check(minor: int) -> int:
        if minor > MAX_MINOR:
            raise ConfigError(f"{ifname}: more than {MAX_MINOR - FIRST_MINOR + 1} destinations on one interface")
        return minor

    rules = []
    for t in targets:
        old = kept.get(t.dest)
        rules.append(Rule(t.dest, t.dest_ip, check(old.minor if old is not None else take()), t.shape))
    used |= {r.minor for r in kept.values()}
    passes = []
    for ip, dest in wanted_passes.items():
        old_pass = kept_passes.get(ip)
        passes.append(Pass(dest, ip, check(old_pass.node if old_pass is not None else take())))
    return Plan(ifname, tuple(rules), tuple(passes), isolation.drop if isolation else (),
                bool(isolation) and drop_ipv6, isolation.keep if isolation else (), uplink_bps, downlink_bps)


def _wanted_passes(targets: list[Target], isolation: Optional[Isolation],
                   unshaped: Iterable[tuple[str, str]]) -> dict[str, str]:
    """ip -> dest ("" for a kept address) of the pass filters an isolated plan needs: the
    addresses inside the dropped space that no shaped link already reaches."""
    if isolation is None:
        return {}
    space = [ipaddress.IPv4Network(p) for p in isolation.drop]
    shaped = {t.dest_ip for t in targets}
    shaped_dests = {t.dest for t in targets}
    wanted: dict[str, str] = {}
    for ip in isolation.keep:
        if ip not in shaped and any(ipaddress.IPv4Address(ip) in net for net in space):
            wanted.setdefault(ip, "")
    for dest, ip in unshaped:
        if dest in shaped_dests or ip in shaped or ip in wanted:
            continue
        if any(ipaddress.IPv4Address(ip) in net for net in space):
            wanted[ip] = dest
    return wanted


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


def pass_diff(old: Plan, new: Plan) -> tuple[list[Pass], list[Pass]]:
    """The pass filters to delete and to add to turn ``old`` into ``new`` (a new label alone is no change)."""
    before, after = old.passes_by_ip(), new.passes_by_ip()
    removed = [p for ip, p in before.items() if ip not in after or after[ip].node != p.node]
    added = [p for ip, p in after.items() if ip not in before or before[ip].node != p.node]
    return removed, added


def netem_limit_pkts(shape: Shape) -> int:
    """netem's limit for a link: its queue (``queue_pkts``, else 1000 packets) plus the full-size
    frames its delay (with jitter) holds at its rate. netem counts delayed packets in its limit, so
    the queue alone would cap a link whose bandwidth-delay product exceeds it below its rate."""
    in_flight = math.ceil(shape.rate_bps * (shape.delay_ms + shape.jitter_ms) / 1000 / 8 / FRAME_BYTES)
    return (shape.queue_pkts or NETEM_DEFAULT_LIMIT) + in_flight


def _leaf_args(rule: Rule) -> str:
    s = rule.shape
    if rule.leaf == "netem":
        args = f"netem delay {s.delay_ms:g}ms"
        if s.jitter_ms:
            args += f" {s.jitter_ms:g}ms"
        if s.loss_pct:
            args += f" loss {s.loss_pct:g}%"
        return args + f" limit {netem_limit_pkts(s)}"
    return f"pfifo limit {s.queue_pkts}"


def rule_commands(dev: str, rule: Rule, verb: str = "add", rates: Optional[tuple[int, int]] = None) -> list[str]:
    """The tc command lines for one rule's class (``rates``: (rate, ceil), default both the
    link's rate), leaf and filter."""
    m = rule.minor
    rate, ceil = rates or (rule.shape.rate_bps, rule.shape.rate_bps)
    lines = [f"tc class {verb} dev {dev} parent 1:{ACCESS_MINOR:x} classid 1:{m:x} htb "
             f"rate {tc_rate(rate)} ceil {tc_rate(ceil)}"]
    if rule.leaf:
        lines.append(f"tc qdisc replace dev {dev} parent 1:{m:x} handle {m:x}: {_leaf_args(rule)}")
    if verb == "add":
        lines.append(f"tc filter add dev {dev} parent 1: protocol ip prio 1 handle 800::{m:x} u32 "
                     f"match ip dst {rule.dest_ip}/32 flowid 1:{m:x}")
    return lines


def pass_command(dev: str, p: Pass, verb: str = "add") -> str:
    line = f"tc filter {verb} dev {dev} parent 1: protocol ip prio {RULE_PRIO} handle 800::{p.node:x} u32"
    return line + (f" match ip dst {p.dest_ip}/32 flowid 1:{DEFAULT_MINOR:x}" if verb == "add" else "")


def drop_class_commands(dev: str) -> list[str]:
    rate = tc_rate(DEFAULT_CLASS_RATE_BPS)
    return [f"tc class add dev {dev} parent 1: classid 1:{DROP_MINOR:x} htb rate {rate} ceil {rate}",
            f"tc qdisc replace dev {dev} parent 1:{DROP_MINOR:x} handle {DROP_MINOR:x}: pfifo limit 0"]


def drop_filter_commands(dev: str, drops: Iterable[str]) -> list[str]:
    return [f"tc filter add dev {dev} parent 1: protocol ip prio {DROP_PRIO} u32 match ip dst {prefix} "
            f"flowid 1:{DROP_MINOR:x}" for prefix in drops]


def ipv6_drop_command(dev: str, verb: str = "add") -> str:
    line = f"tc filter {verb} dev {dev} parent 1: protocol ipv6 prio {IPV6_DROP_PRIO} u32"
    return line + (f" match u32 0 0 flowid 1:{DROP_MINOR:x}" if verb == "add" else "")


def access_class_command(dev: str, plan: Plan, verb: str = "add") -> str:
    rate = tc_rate(plan.access_rate_bps)
    return f"tc class {verb} dev {dev} parent 1: classid 1:{ACCESS_MINOR:x} htb rate {rate} ceil {rate}"


def peer_minor(i: int) -> int:
    """The class (and filter) minor of the ``i``-th peer of a node's downlink."""
    return IFB_FIRST_PEER_MINOR + i


def share_bps(downlink_bps: int, peers: int) -> int:
    """Each downlink class's guaranteed rate: the downlink split between the peers and the
    default class."""
    return max(8, downlink_bps // (peers + 1))


def downlink_commands(dev: str, downlink_bps: Optional[int], peers: tuple[str, ...] = ()) -> list[str]:
    """The downlink as tc lines (worker.shaping.downlink); None: its removal."""
    if downlink_bps is None:
        return [f"tc qdisc del dev {dev} ingress", f"ip link del {IFB_NAME}"]
    rate, share = tc_rate(downlink_bps), tc_rate(share_bps(downlink_bps, len(peers)))
    lines = [f"ip link add {IFB_NAME} up type ifb",
             f"tc qdisc add dev {IFB_NAME} root handle 1: htb default {IFB_DEFAULT_MINOR:x}",
             f"tc class add dev {IFB_NAME} parent 1: classid 1:1 htb rate {rate} ceil {rate}"]
    for i, minor in enumerate([IFB_DEFAULT_MINOR, *(peer_minor(i) for i in range(len(peers)))]):
        lines += [f"tc class add dev {IFB_NAME} parent 1:1 classid 1:{minor:x} htb rate {share} ceil {rate}",
                  f"tc qdisc replace dev {IFB_NAME} parent 1:{minor:x} handle {minor:x}: pfifo limit {LEAF_LIMIT_PKTS}"]
        if i:
            lines.append(f"tc filter add dev {IFB_NAME} parent 1: protocol ip prio 1 u32 "
                         f"match ip src {peers[i - 1]}/32 flowid 1:{minor:x}")
    return lines + [f"tc qdisc add dev {dev} ingress",
                    f"tc filter add dev {dev} parent ffff: protocol all prio 1 u32 match u32 0 0 "
                    f"action mirred egress redirect dev {IFB_NAME}"]


def render(plan: Plan, netns: Optional[str] = None) -> list[str]:
    """The plan as the equivalent ``tc`` command lines (for --dry-run and logs)."""
    prefix = f"ip netns exec {netns} " if netns else ""
    dev = plan.ifname
    lines = [f"tc qdisc replace dev {dev} root handle 1: htb default {DEFAULT_MINOR:x}",
             f"tc class add dev {dev} parent 1: classid 1:{DEFAULT_MINOR:x} htb "
             f"rate {tc_rate(DEFAULT_CLASS_RATE_BPS)} ceil {tc_rate(DEFAULT_CLASS_RATE_BPS)}"]
    if plan.drops:
        lines += drop_class_commands(dev)
    lines.append(access_class_command(dev, plan))
    for rule in plan.rules:
        lines += rule_commands(dev, rule, rates=plan.class_rates(rule))
    lines += [pass_command(dev, p) for p in plan.passes]
    lines += drop_filter_commands(dev, plan.drops)
    lines += [ipv6_drop_command(dev)] if plan.drop_ipv6 else []
    lines += downlink_commands(dev, plan.downlink_bps, plan.downlink_peers()) if plan.downlink_bps else []
    return [prefix + line for line in lines]


def render_update(old: Plan, new: Plan) -> list[str]:
    """A whole update (links, passes, isolation) as tc lines, in the order it is applied."""
    dev = new.ifname
    removed, added = pass_diff(old, new)
    lines = drop_class_commands(dev) if new.drops and not old.drops else []
    lines += [pass_command(dev, p) for p in added]
    if old.uplink_bps != new.uplink_bps:
        lines.append(access_class_command(dev, new, "change"))
    changes = diff(old, new)
    lines += render_diff(dev, changes, new)
    changed = {c.new.dest for c in changes if c.new}
    lines += [rule_commands(dev, r, "change", new.class_rates(r))[0] for r in reshared(old, new)
              if r.dest not in changed]
    lines += [pass_command(dev, p, "del") for p in removed]
    if old.drops != new.drops:
        if old.drops:
            lines.append(f"tc filter del dev {dev} parent 1: protocol ip prio {DROP_PRIO} u32")
        lines += drop_filter_commands(dev, new.drops)
    if old.drop_ipv6 != new.drop_ipv6:
        lines.append(ipv6_drop_command(dev, "add" if new.drop_ipv6 else "del"))
    if old.drops and not new.drops:
        lines.append(f"tc class del dev {dev} classid 1:{DROP_MINOR:x}")
    if downlink_changed(old, new):
        lines += downlink_commands(dev, new.downlink_bps, new.downlink_peers())
    return lines


def downlink_changed(old: Plan, new: Plan) -> bool:
    """Whether the downlink's rate, or (with a downlink) the peers sharing it, changed."""
    return old.downlink_bps != new.downlink_bps or (
        new.downlink_bps is not None and old.downlink_peers() != new.downlink_peers())


def reshared(old: Plan, new: Plan) -> list[Rule]:
    """The links of ``new`` whose class rate changes because the uplink or its share did
    (their own shape unchanged): with an uplink, every link's rate is the equal share."""
    if old.uplink_bps == new.uplink_bps and (not new.uplink_bps or len(old.rules) == len(new.rules)):
        return []
    before = old.by_dest()
    return [r for r in new.rules if r.dest in before and before[r.dest] == r
            and old.class_rates(before[r.dest]) != new.class_rates(r)]


def render_diff(dev: str, changes: list[Change], plan: Optional[Plan] = None) -> list[str]:
    """An update as tc command lines (``plan``: the new plan, for its links' class rates)."""
    lines = []

    def rates(rule: Rule) -> Optional[tuple[int, int]]:
        return plan.class_rates(rule) if plan else None

    for c in changes:
        if c.op == "remove" and c.old:
            m = c.old.minor
            lines += [f"tc filter del dev {dev} parent 1: protocol ip prio 1 handle 800::{m:x} u32",
                      f"tc class del dev {dev} classid 1:{m:x}"]
        elif c.op == "add" and c.new:
            lines += rule_commands(dev, c.new, rates=rates(c.new))
        elif c.new and c.old:
            lines.append(rule_commands(dev, c.new, "change", rates(c.new))[0])
            if c.old.leaf and c.new.leaf and c.old.leaf != c.new.leaf:
                lines.append(f"tc qdisc del dev {dev} parent 1:{c.new.minor:x} handle {c.new.minor:x}:")
            if c.new.dest_ip != c.old.dest_ip:
                lines.append(rule_commands(dev, c.new)[-1].replace("filter add", "filter replace"))
            if c.new.leaf:
                lines.append(rule_commands(dev, c.new, "change")[1])
            elif c.old.leaf:
                lines.append(f"tc qdisc del dev {dev} parent 1:{c.new.minor:x} handle {c.new.minor:x}:")
    return lines

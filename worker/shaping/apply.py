"""Make a shaping plan real in a network namespace, read it back, and check it.

Apply and update send their requests in batches, and read-back dumps the state,
on one netlink socket per node (worker.kernel.netlink). Any difference between kernel state and plan
raises ShapingError: a mismatch is an error, never a log line. Isolation (the drop class,
its pfifo of limit 0, the pass filters and the prio-2 drop prefixes: see worker.shaping.plan) is
programmed in the same batch as the links and read back and compared with them.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from worker.api.errors import CapabilityError, ShapingError
from worker.kernel import netlink as nl
from worker.kernel import nsfs
from worker.shaping import downlink as access
from worker.shaping.plan import (ACCESS_MINOR, DEFAULT_CLASS_RATE_BPS, DEFAULT_MINOR, DROP_MINOR, DROP_PRIO,
                                 IPV6_DROP_PRIO, RULE_PRIO, Plan, Rule, diff, downlink_changed, pass_diff,
                                 netem_limit_pkts, render_update, reshared)

_netem_lock = threading.Lock()
_netem_available: Optional[bool] = None


def ifindex_in(netns: Optional[str], ifname: str) -> int:
    """The index of ``ifname`` inside ``netns`` (host namespace when None)."""
    index = nl.ifindex(netns, ifname)
    if index is None:
        raise ShapingError(f"no interface {ifname!r} in namespace {netns or 'host'}")
    return index


def netem_available() -> bool:
    """Whether this kernel has sch_netem (probed once, in a throwaway namespace)."""
    global _netem_available
    with _netem_lock:
        if _netem_available is None:
            with nsfs.throwaway(), nl.RtnlSocket() as sock:  # gone on every exit path
                sock.run([nl.link_up(1), nl.htb_root(1, DEFAULT_MINOR), nl.htb_class(1, 0x10, 10**6)])
                failures = sock.run([nl.netem_leaf(1, 0x10, 1.0, 0.0, 0.0, 10)])
            _netem_available = not failures
        return _netem_available


def require_netem(plans: dict[str, Plan]) -> None:
    """Fail before anything is created when a plan needs netem and the kernel lacks it."""
    needing = [f"{node}->{r.dest} ({r.shape.describe()})"
               for node, plan in plans.items() for r in plan.rules if r.leaf == "netem"]
    if needing and not netem_available():
        shown = ", ".join(needing[:5]) + (f" and {len(needing) - 5} more" if len(needing) > 5 else "")
        raise CapabilityError(
            f"this kernel ({os.uname().release}) has no sch_netem, so delay, jitter and loss cannot "
            f"be emulated; links that need it: {shown}. Remove delay/jitter/loss from these links or "
            f"run on a kernel with sch_netem.")


def _class_message(ifindex: int, plan: Plan, rule: Rule, flags: int = nl.CREATE) -> bytes:
    rate, ceil = plan.class_rates(rule)
    return nl.htb_class(ifindex, rule.minor, rate, flags, ceil_bps=ceil, parent_minor=ACCESS_MINOR)


def _rule_messages(ifindex: int, plan: Plan, rule: Rule, class_flags: int = nl.CREATE) -> list[bytes]:
    msgs = [_class_message(ifindex, plan, rule, class_flags)]
    s = rule.shape
    if rule.leaf == "netem":
        msgs.append(nl.netem_leaf(ifindex, rule.minor, s.delay_ms, s.jitter_ms, s.loss_pct, netem_limit_pkts(s)))
    elif rule.leaf == "pfifo":
        msgs.append(nl.pfifo_leaf(ifindex, rule.minor, s.queue_pkts or 0))
    return msgs


def _raise_failures(netns: str, failures: list[nl.Failure], what: list[str], action: str) -> None:
    if failures:
        lines = [f"{what[f.position]}: {f.describe()}" for f in failures[:10]]
        more = f" (and {len(failures) - 10} more)" if len(failures) > 10 else ""
        raise ShapingError(f"{action} in {netns} failed: " + "; ".join(lines) + more,
                           detail={"netns": netns, "failures": lines})


def _drop_class_messages(ifindex: int) -> list[bytes]:
    return [nl.htb_class(ifindex, DROP_MINOR, DEFAULT_CLASS_RATE_BPS), nl.pfifo_leaf(ifindex, DROP_MINOR, 0)]


def _pass_label(dest: str, dest_ip: str) -> str:
    return f"unshaped way to {dest} ({dest_ip})" if dest else f"kept address {dest_ip}"


def apply(netns: Optional[str], plan: Plan) -> None:
    """Replace the interface's egress shaping with ``plan`` in one batch; undo it on failure."""
    ifindex = ifindex_in(netns, plan.ifname)
    msgs = [nl.htb_root(ifindex, DEFAULT_MINOR), nl.htb_class(ifindex, DEFAULT_MINOR, DEFAULT_CLASS_RATE_BPS)]
    what = ["root qdisc", "default class"]
    if plan.drops:
        msgs += _drop_class_messages(ifindex)
        what += ["isolation drop class", "isolation drop leaf"]
    msgs.append(nl.htb_class(ifindex, ACCESS_MINOR, plan.access_rate_bps))
    what.append(f"access class (uplink {plan.uplink_bps or 'none'})")
    for rule in plan.rules:
        rule_msgs = _rule_messages(ifindex, plan, rule)
        rule_msgs.append(nl.u32_dst_filter(ifindex, rule.minor, rule.dest_ip, rule.minor))
        msgs += rule_msgs
        what += [f"link to {rule.dest} ({rule.shape.describe()})"] * len(rule_msgs)
    for p in plan.passes:
        msgs.append(nl.u32_dst_filter(ifindex, p.node, p.dest_ip, DEFAULT_MINOR))
        what.append(_pass_label(p.dest, p.dest_ip))
    for prefix in plan.drops:
        msgs.append(nl.u32_prefix_filter(ifindex, prefix, DROP_MINOR, DROP_PRIO))
        what.append(f"isolation filter dropping {prefix}")
    if plan.drop_ipv6:
        msgs.append(nl.u32_all_filter(ifindex, nl.ETH_P_IPV6, DROP_MINOR, IPV6_DROP_PRIO))
        what.append("isolation filter dropping IPv6")
    with nl.RtnlSocket(netns) as sock:
        sock.run([nl.delete_root(ifindex)])  # absent root is fine
        failures = sock.run(msgs)
        if failures:
            sock.run([nl.delete_root(ifindex)])
    _raise_failures(netns, failures, what, "applying shaping")
    if plan.downlink_bps is not None:
        access.set_downlink(netns, ifindex, plan.downlink_bps, None, plan.downlink_peers())


def update(netns: Optional[str], old: Plan, new: Plan) -> list[str]:
    """Change the rules, passes and isolation that differ, in place (root and other links
    untouched); returns tc lines. New passes are added first and old ones removed last, so a
    peer that moves between link and pass is never dropped on the way."""
    changes = diff(old, new)
    removed, added = pass_diff(old, new)
    tree_same = (not changes and not removed and not added and old.drops == new.drops
                 and old.drop_ipv6 == new.drop_ipv6 and old.uplink_bps == new.uplink_bps)
    if tree_same and not downlink_changed(old, new):
        return []
    ifindex = ifindex_in(netns, new.ifname)
    if downlink_changed(old, new):
        access.set_downlink(netns, ifindex, new.downlink_bps, old.downlink_bps, new.downlink_peers(),
                            old.downlink_peers() if old.downlink_bps is not None else ())
    if tree_same:
        return render_update(old, new)
    msgs: list[bytes] = []
    what: list[str] = []
    if new.drops and not old.drops:
        msgs += _drop_class_messages(ifindex)
        what += ["isolation drop class", "isolation drop leaf"]
    for p in added:  # before the links change: a peer moving from link to pass is never dropped
        msgs.append(nl.u32_dst_filter(ifindex, p.node, p.dest_ip, DEFAULT_MINOR))
        what.append(_pass_label(p.dest, p.dest_ip))
    if old.uplink_bps != new.uplink_bps:
        msgs.append(nl.htb_class(ifindex, ACCESS_MINOR, new.access_rate_bps, flags=0))
        what.append(f"changing the uplink to {new.uplink_bps or 'none'}")
    # with an uplink every link's rate is an equal share of it: shares before adds (the sum stays in bounds)
    for rule in reshared(old, new):
        msgs.append(_class_message(ifindex, new, rule, flags=0))
        what.append(f"sharing the uplink with the link to {rule.dest}")
    for c in changes:
        if c.op == "remove" and c.old:
            step = [nl.delete_u32_filter(ifindex, c.old.minor), nl.delete_class(ifindex, c.old.minor)]
            label = f"removing link to {c.old.dest}"
        elif c.op == "add" and c.new:
            step = _rule_messages(ifindex, new, c.new)
            step.append(nl.u32_dst_filter(ifindex, c.new.minor, c.new.dest_ip, c.new.minor))
            label = f"adding link to {c.new.dest}"
        else:
            assert c.old and c.new
            step = _rule_messages(ifindex, new, c.new, class_flags=0)
            if c.old.leaf and c.new.leaf and c.old.leaf != c.new.leaf:
                step.insert(1, nl.delete_leaf(ifindex, c.new.minor))  # the kernel will not swap a leaf's kind in place
            if c.old.dest_ip != c.new.dest_ip:
                step.append(nl.u32_dst_filter(ifindex, c.new.minor, c.new.dest_ip, c.new.minor, flags=nl.REPLACE))
            if c.old.leaf and not c.new.leaf:
                step.append(nl.delete_leaf(ifindex, c.new.minor))
            label = f"changing link to {c.new.dest} to {c.new.shape.describe()}"
        msgs += step
        what += [label] * len(step)
    for p in removed:  # after: a peer moving from pass to link is never dropped either
        msgs.append(nl.delete_u32_filter(ifindex, p.node, RULE_PRIO))
        what.append(f"removing {_pass_label(p.dest, p.dest_ip)}")
    if old.drops != new.drops:
        if old.drops:
            msgs.append(nl.delete_filters(ifindex, DROP_PRIO))
            what.append("removing the isolation filters")
        for prefix in new.drops:
            msgs.append(nl.u32_prefix_filter(ifindex, prefix, DROP_MINOR, DROP_PRIO))
            what.append(f"isolation filter dropping {prefix}")
    if old.drop_ipv6 != new.drop_ipv6:
        if new.drop_ipv6:
            msgs.append(nl.u32_all_filter(ifindex, nl.ETH_P_IPV6, DROP_MINOR, IPV6_DROP_PRIO))
        else:
            msgs.append(nl.delete_filters(ifindex, IPV6_DROP_PRIO, nl.ETH_P_IPV6))
        what.append("isolation filter dropping IPv6")
    if old.drops and not new.drops:
        msgs.append(nl.delete_class(ifindex, DROP_MINOR))
        what.append("removing the isolation drop class")
    with nl.RtnlSocket(netns) as sock:
        failures = sock.run(msgs)
    _raise_failures(netns or "the host", failures, what, "updating shaping")
    return render_update(old, new)


def clear(netns: Optional[str], ifname: str) -> None:
    """Remove all egress shaping from the interface (an absent root is fine)."""
    ifindex = ifindex_in(netns, ifname)
    with nl.RtnlSocket(netns) as sock:
        sock.run([nl.delete_root(ifindex)])
    if netns is not None:  # a downlink exists only in an emulated node (a physical NIC's ingress is not ours)
        access.set_downlink(netns, ifindex, None, None)


@dataclass
class Observed:
    """The parts of kernel tc state that a plan speaks of."""

    root: Optional[dict[str, Any]] = None
    classes: dict[int, int] = field(default_factory=dict)  # minor -> rate in bytes/s
    leaves: dict[int, dict[str, Any]] = field(default_factory=dict)  # minor -> {kind, ...}
    filters: dict[int, dict[str, Any]] = field(default_factory=dict)  # u32 node -> {dest_ip, minor} (prio 1)
    drops: dict[str, int] = field(default_factory=dict)  # prefix -> class minor (prio-2 filters)
    ipv6_drop: Optional[int] = None  # class minor of the prio-3 filter taking all IPv6
    ceils: dict[int, int] = field(default_factory=dict)  # minor -> ceil in bytes/s
    parents: dict[int, int] = field(default_factory=dict)  # minor -> the parent class's minor (0: the root)
    downlink: access.Downlink = field(default_factory=access.Downlink)

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root,
                "classes": {f"1:{m:x}": self._class_dict(m, r) for m, r in sorted(self.classes.items())},
                "leaves": {f"1:{m:x}": v for m, v in sorted(self.leaves.items())},
                "filters": {f"800::{n:x}": v for n, v in sorted(self.filters.items())},
                "drops": {p: {"minor": m} for p, m in sorted(self.drops.items())},
                "ipv6_drop": None if self.ipv6_drop is None else {"minor": self.ipv6_drop},
                "downlink": self.downlink.to_dict()}

    def _class_dict(self, minor: int, rate: Optional[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"rate_bps": None if rate is None else rate * 8}
        if self.ceils.get(minor) is not None:
            out["ceil_bps"] = self.ceils[minor] * 8
        if minor in self.parents:
            out["parent"] = f"1:{self.parents[minor]:x}" if self.parents[minor] else "1:"
        return out


def _leaf(kind: str, options: bytes) -> dict[str, Any]:
    leaf: dict[str, Any] = {"kind": kind}
    if kind == "pfifo" and len(options) >= 4:
        leaf["limit"] = struct.unpack_from("=I", options)[0]
    elif kind == "netem" and len(options) >= 24:
        latency, limit, loss, _, _, jitter = struct.unpack_from("=6I", options)
        leaf.update(delay_us=round(latency / nl.TICKS_PER_US), jitter_us=round(jitter / nl.TICKS_PER_US),
                    loss_pct=loss * 100 / 0xFFFFFFFF, limit=limit)
    return leaf


def read_back(netns: Optional[str], ifname: str) -> Observed:
    """Read the interface's egress tc state from the kernel: three dumps on one socket."""
    ifindex = ifindex_in(netns, ifname)
    seen = Observed()
    with nl.RtnlSocket(netns) as sock:
        for q in nl.tc_dump(sock, nl.RTM_GETQDISC, ifindex):
            if q.parent == nl.TC_H_ROOT:
                seen.root = {"kind": q.kind, "handle": q.handle}
                if q.kind == "htb":
                    seen.root["default_minor"] = nl.htb_default_minor(q.options)
            elif q.parent >> 16 == 1:
                seen.leaves[q.parent & 0xFFFF] = _leaf(q.kind, q.options)
        if not seen.root or seen.root["kind"] != "htb":
            return seen
        for c in nl.tc_dump(sock, nl.RTM_GETTCLASS, ifindex):
            seen.classes[c.handle & 0xFFFF] = nl.htb_rate_bytes(c.options)
            seen.ceils[c.handle & 0xFFFF] = nl.htb_ceil_bytes(c.options)
            seen.parents[c.handle & 0xFFFF] = 0 if c.parent == nl.TC_H_ROOT else c.parent & 0xFFFF
        for f in nl.tc_dump(sock, nl.RTM_GETTFILTER, ifindex, nl.tc_handle(1, 0)):
            classid, keys = nl.u32_key(f.options) if f.kind == "u32" else (None, [])
            if classid is None:
                continue
            dest = nl.dst_prefix(keys)
            if f.info >> 16 == IPV6_DROP_PRIO:
                if f.info & 0xFFFF == socket.htons(nl.ETH_P_IPV6) and keys == [(0, 0, 0)]:
                    seen.ipv6_drop = classid & 0xFFFF
                else:
                    seen.drops[f"prio {IPV6_DROP_PRIO} filter {f.handle:x}"] = classid & 0xFFFF
            elif f.info >> 16 == DROP_PRIO:
                # a prefix in the plan's form: a /32 (a physical node's address) keeps its length
                seen.drops[str(ipaddress.IPv4Network(dest)) if dest else f"filter {f.handle:x}"] = classid & 0xFFFF
            else:
                seen.filters[f.handle & 0xFFF] = {"dest_ip": dest, "minor": classid & 0xFFFF}
        seen.downlink = access.read_downlink(sock, ifindex)
    return seen


def mismatches(plan: Plan, seen: Observed, ticked: frozenset[str] = frozenset()) -> list[str]:
    """Every way the kernel state differs from the plan (empty when they agree); the rate and
    netem values of the links to ``ticked`` are a trace clock's (a bin's, not the plan's)."""
    problems = []
    if not seen.root or seen.root.get("kind") != "htb" or seen.root.get("handle") != nl.tc_handle(1, 0):
        return [f"root qdisc is {seen.root}, expected htb 1:"]
    if seen.root.get("default_minor") != DEFAULT_MINOR:
        problems.append(f"root default class is {seen.root.get('default_minor')}, expected {DEFAULT_MINOR}")
    # minor -> (rate, ceil) in bytes/s, parent minor
    wanted_classes = {DEFAULT_MINOR: ((DEFAULT_CLASS_RATE_BPS // 8,) * 2, 0),
                      ACCESS_MINOR: ((plan.access_rate_bps // 8,) * 2, 0)}
    if plan.drops:
        wanted_classes[DROP_MINOR] = ((DEFAULT_CLASS_RATE_BPS // 8,) * 2, 0)
    for r in plan.rules:
        rate, ceil = plan.class_rates(r)
        wanted_classes[r.minor] = ((max(1, rate // 8), max(1, ceil // 8)), ACCESS_MINOR)
    traced = {r.minor for r in plan.rules if r.dest in ticked}
    for minor, ((rate, ceil), parent) in wanted_classes.items():
        got, got_ceil = seen.classes.get(minor), seen.ceils.get(minor)
        if minor in traced and got is not None:
            pass  # (its rate is the current bin's)
        elif got != rate:
            problems.append(f"class 1:{minor:x}: rate {None if got is None else got * 8} bit/s, expected {rate * 8}")
        elif got_ceil is not None and got_ceil != ceil:
            problems.append(f"class 1:{minor:x}: ceil {got_ceil * 8} bit/s, expected {ceil * 8}")
        if minor in seen.parents and seen.parents[minor] != parent:
            problems.append(f"class 1:{minor:x}: parent 1:{seen.parents[minor]:x}, expected 1:{parent:x}")
    for minor in set(seen.classes) - set(wanted_classes):
        problems.append(f"class 1:{minor:x} is not in the plan")
    for rule in plan.rules:
        got_filter = seen.filters.get(rule.minor)
        if got_filter != {"dest_ip": rule.dest_ip, "minor": rule.minor}:
            problems.append(f"filter for {rule.dest} ({rule.dest_ip}): found {got_filter}")
        problems += _leaf_mismatch(rule, seen.leaves.get(rule.minor), rule.dest in ticked)
    for p in plan.passes:
        got_filter = seen.filters.get(p.node)
        if got_filter != {"dest_ip": p.dest_ip, "minor": DEFAULT_MINOR}:
            problems.append(f"filter for the {_pass_label(p.dest, p.dest_ip)}: found {got_filter}")
    leaf_minors = {r.minor for r in plan.rules}
    if plan.drops:
        leaf_minors.add(DROP_MINOR)
        leaf = seen.leaves.get(DROP_MINOR)
        if leaf != {"kind": "pfifo", "limit": 0}:
            problems.append(f"isolation drop leaf under 1:{DROP_MINOR:x}: found {leaf}, expected pfifo limit 0")
    for minor in set(seen.leaves) - leaf_minors:
        problems.append(f"leaf under 1:{minor:x} is not in the plan")
    for node in set(seen.filters) - {r.minor for r in plan.rules} - {p.node for p in plan.passes}:
        problems.append(f"filter 800::{node:x} is not in the plan")
    wanted_drops = {prefix: DROP_MINOR for prefix in plan.drops}
    if seen.drops != wanted_drops:
        missing = sorted(set(wanted_drops) - set(seen.drops))
        extra = sorted(set(seen.drops) - set(wanted_drops))
        wrong = sorted(p for p in set(wanted_drops) & set(seen.drops) if seen.drops[p] != DROP_MINOR)
        problems.append(f"isolation filters: missing {missing}, not in the plan {extra}, "
                        f"not into 1:{DROP_MINOR:x} {wrong}")
    wanted_ipv6 = DROP_MINOR if plan.drop_ipv6 else None
    if seen.ipv6_drop != wanted_ipv6:
        problems.append(f"IPv6 isolation filter: found {seen.ipv6_drop and f'1:{seen.ipv6_drop:x}'}, "
                        f"expected {wanted_ipv6 and f'1:{wanted_ipv6:x}'}")
    return problems + access.downlink_mismatches(plan.downlink_bps, seen.downlink, plan.downlink_peers())


def _leaf_mismatch(rule: Rule, leaf: Optional[dict[str, Any]], ticked: bool = False) -> list[str]:
    s = rule.shape
    name = f"leaf of 1:{rule.minor:x} ({rule.dest})"
    if rule.leaf is None:
        return [f"{name}: found {leaf['kind']}, expected the default"] if leaf else []
    if not leaf or leaf["kind"] != rule.leaf:
        return [f"{name}: found {leaf and leaf['kind']}, expected {rule.leaf}"]
    if rule.leaf == "pfifo" and leaf.get("limit") != s.queue_pkts:
        return [f"{name}: limit {leaf.get('limit')}, expected {s.queue_pkts}"]
    if rule.leaf == "netem" and not ticked:  # (a ticked link's delay and loss are its bin's)
        wanted = {"delay_us": round(s.delay_ms * 1000), "jitter_us": round(s.jitter_ms * 1000),
                  "limit": netem_limit_pkts(s)}
        bad = [f"{k} {leaf.get(k)} (expected {v})" for k, v in wanted.items() if abs(leaf.get(k, -9) - v) > 1]
        if abs(leaf.get("loss_pct", -1) - s.loss_pct) > 1e-4:
            bad.append(f"loss {leaf.get('loss_pct')}% (expected {s.loss_pct}%)")
        return [f"{name}: " + ", ".join(bad)] if bad else []
    return []


def verify(netns: Optional[str], plan: Plan, ticked: frozenset[str] = frozenset()) -> None:
    """Raise ShapingError unless the kernel holds exactly ``plan`` (``ticked``: ``mismatches``')."""
    problems = mismatches(plan, read_back(netns, plan.ifname), ticked)
    if problems:
        shown = "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)" if len(problems) > 10 else "")
        raise ShapingError(f"tc state in {netns} differs from the plan: {shown}",
                           detail={"netns": netns, "mismatches": problems})

"""The shaping service of one testbed: its requests checked, plans made, nodes shaped and recorded.

``Links`` is what ``worker.host`` delegates to for ``set_links``, ``clear_links``
and ``shaping``: it parses a request into per-node ``Target``s, makes each node's plan
(``worker.shaping.plan``), programs and verifies it (``worker.shaping.apply``) and records it in
the state. Requests come checked (``worker.host`` with ``worker.api.bodies``); answers come without it.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from worker.api.bodies import REQUEST
from worker.api.errors import ConfigError, NotFound, TestbedError
from worker.api.protocol import ifname
from worker.api.shape import Shape
from worker.nodes.runtime import Runtime
from worker.shaping import apply as tc_apply
from worker.shaping.plan import Isolation, Plan, Target, make_plan, render
from worker.shaping.rates import RateSockets, change_rates
from worker.state import StateStore

# nodes shaped at once: the kernel takes one lock (RTNL) for every tc change, and threads waiting
# for it spin; at 1,000 nodes and 10,000 links one thread took 2.5-3.8 s, two 3.2 s, four 4.4 s
SHAPING_THREADS = 1
KEEP = object()  # set_links without "isolation": each node keeps its own


class Links:
    """The shaped links of one testbed's nodes on this host."""

    def __init__(self, store: StateStore, runtime: Runtime) -> None:
        self.store = store
        self.runtime = runtime
        self.rate_sockets = RateSockets()  # kept open between the rate changes of a replay
        # a node's links whose rate a trace clock ticks (their rates in the kernel are a bin's)
        self.ticked: Callable[[str], frozenset[str]] = lambda src: frozenset()

    def set_links(self, body: dict[str, Any], merge: bool = False) -> dict[str, Any]:
        """Shape the listed links. Each source's listed links replace its plan, or with
        ``merge`` change only the listed destinations (``"shape": null`` removes one).

        Isolation (worker.shaping.plan): ``"isolation": {"drop": [prefix, ...], "keep": [address, ...]}``
        drops traffic to the node address space but by links, ``{"open": true}`` is the open
        network; without it each node keeps its setting (open for a node never shaped).
        ``"unshaped": {node: [{"dst", "dst_ip"}, ...]}`` replaces the listed nodes' peers reached
        without a shaped link (the way back of one-way links); a node listed there is
        (re)planned even with no link of its own. ``"access": {node: {"uplink_bps": R,
        "downlink_bps": R}}`` sets the listed nodes' access links (null removes one, a key left
        out keeps it; see worker.shaping.plan and worker.shaping.downlink)."""
        links = body["links"]
        isolation: Any = Isolation.from_dict(body["isolation"]) if "isolation" in body else KEEP
        state = self.store.snapshot()
        unshaped = parse_unshaped(body.get("unshaped", {}), state)
        access = parse_access(body.get("access", {}), state)
        wanted: dict[str, dict[str, Optional[Target]]] = {node: {} for node in [*unshaped, *access]}
        for i, link in enumerate(links):
            if link["src"] not in state["nodes"]:
                raise NotFound(f"link {i}: no node {link['src']!r} on this host")
            removed = link["shape"] is None and merge
            shape = None if removed else Shape.from_dict(link["shape"], f"{REQUEST}: links[{i}], shape")
            per_src = wanted.setdefault(link["src"], {})
            if link["dst"] in per_src:
                raise ConfigError(f"link {i}: {link['src']}->{link['dst']} listed twice")
            per_src[link["dst"]] = Target(link["dst"], link["dst_ip"], shape) if shape else None
        plans = {src: self._plan_for(state, src, dests, merge, isolation, unshaped.get(src), access.get(src, {}))
                 for src, dests in wanted.items()}
        tc_apply.require_netem(plans)
        started = time.monotonic()
        results, failed = in_parallel(lambda src: self._shape_node(state, src, plans[src]), list(plans))
        with self.store.locked() as fresh:
            for src in plans:
                if src in failed or plans[src].empty:
                    fresh["plans"].pop(src, None)  # its shaping was cleared: kernel and state agree
                else:
                    fresh["plans"][src] = plans[src].to_dict()
        # linked peers reached without ARP where the runtime programs neighbours (netns)
        new_peers = {src: peer_ips(plan) - peer_ips(Plan.from_dict(state["plans"][src]) if src in state["plans"]
                                                   else None)
                     for src, plan in plans.items() if src not in failed}
        if any(new_peers.values()):
            self.runtime.set_neighbours({src: sorted(ips) for src, ips in new_peers.items() if ips})
        if failed:
            first = next(iter(failed.values()))
            raise type(first)(f"{first.message} (shaping of {', '.join(sorted(failed))} was removed; "
                              f"{len(results)} other nodes were shaped)", detail=first.detail)
        return {"nodes": results, "seconds": round(time.monotonic() - started, 4)}

    def _plan_for(self, state: dict[str, Any], src: str, dests: dict[str, Optional[Target]], merge: bool,
                  isolation: Any, unshaped: Optional[list[tuple[str, str]]], access: dict[str, Optional[int]]) -> Plan:
        previous = Plan.from_dict(state["plans"][src]) if src in state["plans"] else None
        targets: list[Target] = []
        if merge and previous:
            for rule in previous.rules:
                if rule.dest not in dests:
                    targets.append(Target(rule.dest, rule.dest_ip, rule.shape))
        targets += [t for t in dests.values() if t is not None]
        if isolation is KEEP:
            isolation = previous.isolation() if previous else None
        if unshaped is None:
            unshaped = previous.unshaped() if previous else []
        emulated = state["nodes"][src].get("netns") is not None  # a physical device's IPv6 is its own
        uplink = access.get("uplink_bps", previous.uplink_bps if previous else None)
        downlink = access.get("downlink_bps", previous.downlink_bps if previous else None)
        if downlink is not None and not emulated:
            raise ConfigError(f"access of {src}: a downlink needs an emulated node (a physical device's "
                              f"receive path is its own)")
        return make_plan(ifname(state["nodes"][src]), targets, previous, isolation, unshaped, drop_ipv6=emulated,
                         uplink_bps=uplink, downlink_bps=downlink)

    def _shape_node(self, state: dict[str, Any], src: str, plan: Plan) -> dict[str, Any]:
        netns = state["nodes"][src]["netns"]
        previous = Plan.from_dict(state["plans"][src]) if src in state["plans"] else None
        try:
            if plan.empty:  # open and without links: unshaped, as a node never shaped
                tc_apply.clear(netns, plan.ifname)
                return {"node": src, "rules": 0, "verified": True, "changed": None, "isolated": False}
            if previous is None:
                tc_apply.apply(netns, plan)
                lines = None
            else:
                lines = tc_apply.update(netns, previous, plan)
            tc_apply.verify(netns, plan, self.ticked(src))
        except TestbedError:
            tc_apply.clear(netns, plan.ifname)
            raise
        return {"node": src, "rules": len(plan.rules), "verified": True, "changed": lines,
                "isolated": plan.isolated}

    def set_rates(self, body: dict[str, Any]) -> dict[str, Any]:
        """Change the rates of shaped links in place (``{"rates": [{"src", "dst", "rate_bps"}]}``),
        one netlink batch per node (``worker.shaping.rates``); their delay, loss and queue stay,
        unless an entry gives ``delay_ms`` and ``loss_pct`` (a recording's: its netem leaf).
        A link that is not shaped on this host is refused before anything changes (its caller,
        ``WorkerHost.set_rates``, runs it at nice -10: a replay's tick is due at a time)."""
        started = time.monotonic()
        state = self.store.snapshot()
        wanted: dict[str, dict[str, int]] = {}
        impair: dict[str, dict[str, tuple[float, float]]] = {}
        for i, r in enumerate(body["rates"]):
            if r["src"] not in state["nodes"]:
                raise NotFound(f"{REQUEST}: rates[{i}]: no node {r['src']!r} on this host")
            plan = state["plans"].get(r["src"])
            if not plan or not any(rule["dest"] == r["dst"] for rule in plan["rules"]):
                raise NotFound(f"{REQUEST}: rates[{i}]: no shaped link {r['src']}->{r['dst']} on this host")
            per_src = wanted.setdefault(r["src"], {})
            if r["dst"] in per_src:
                raise ConfigError(f"{REQUEST}: rates[{i}]: {r['src']}->{r['dst']} listed twice")
            per_src[r["dst"]] = r["rate_bps"]
            if "delay_ms" in r or "loss_pct" in r:  # a recording's delay and loss: the netem leaf's
                impair.setdefault(r["src"], {})[r["dst"]] = (r.get("delay_ms", 0.0), r.get("loss_pct", 0.0))
        changed = 0
        done: list[str] = []
        try:
            for src, rates in wanted.items():
                changed += change_rates(self.rate_sockets, state["nodes"][src]["netns"], state["plans"][src], rates,
                                        impair.get(src))
                done.append(src)
        finally:  # what the kernel holds now, also when a node failed on the way
            with self.store.locked() as fresh:
                for src in done:
                    for rule in (fresh["plans"].get(src) or {}).get("rules", []):
                        if rule["dest"] in wanted[src]:
                            rule["shape"]["rate_bps"] = wanted[src][rule["dest"]]
                        if rule["dest"] in impair.get(src, {}):
                            rule["shape"]["delay_ms"], rule["shape"]["loss_pct"] = impair[src][rule["dest"]]
        return {"links": len(body["rates"]), "changed": changed, "seconds": round(time.monotonic() - started, 4)}

    def clear_links(self, node: Optional[str] = None) -> dict[str, Any]:
        self.rate_sockets.close()
        state = self.store.read()
        names = [node] if node else list(state["plans"])
        for name in names:
            rec = self.runtime.node(name)
            tc_apply.clear(rec["netns"], ifname(rec))
        with self.store.locked() as fresh:
            for name in names:
                fresh["plans"].pop(name, None)
        return {"cleared": names}

    def shaping(self, node: str) -> dict[str, Any]:
        """The node's plan, the kernel's state, and whether they agree."""
        rec = self.runtime.node(node)
        plan_data = self.store.read()["plans"].get(node)
        seen = tc_apply.read_back(rec["netns"], ifname(rec))
        plan = Plan.from_dict(plan_data) if plan_data else None
        problems = tc_apply.mismatches(plan, seen, self.ticked(node)) if plan else []
        return {"node": node, "plan": plan_data, "kernel": seen.to_dict(), "tc": render(plan) if plan else [],
                "mismatches": problems, "verified": bool(plan) and not problems}


def in_parallel(fn: Callable[[str], Any], items: list[str]) -> tuple[list[Any], dict[str, TestbedError]]:
    """Run ``fn`` on every item (``SHAPING_THREADS`` threads); results of those that worked,
    errors by item."""
    results: list[Any] = []
    failed: dict[str, TestbedError] = {}

    def one(item: str) -> None:
        try:
            results.append(fn(item))
        except TestbedError as e:
            failed[item] = e

    if min(SHAPING_THREADS, len(items)) <= 1:
        for item in items:
            one(item)
    else:
        with ThreadPoolExecutor(max_workers=min(SHAPING_THREADS, len(items))) as pool:
            list(pool.map(one, items))
    return results, failed


def parse_unshaped(value: dict[str, Any], state: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """The body's ``unshaped`` map (checked by ``worker.api.bodies.SET_LINKS``) of this host's
    nodes: node -> [(peer, peer ip)]."""
    for node in value:
        if node not in state["nodes"]:
            raise NotFound(f"unshaped: no node {node!r} on this host")
    return {node: [(p["dst"], p["dst_ip"]) for p in peers] for node, peers in value.items()}


def parse_access(value: dict[str, Any], state: dict[str, Any]) -> dict[str, dict[str, Optional[int]]]:
    """The body's ``access`` map (checked by ``worker.api.bodies.SET_LINKS``) of this host's
    nodes: node -> {"uplink_bps"?, "downlink_bps"?}."""
    for node in value:
        if node not in state["nodes"]:
            raise NotFound(f"access: no node {node!r} on this host")
    return value


def peer_ips(plan: Optional[Plan]) -> set[str]:
    """The addresses a node's plan reaches directly (its permanent neighbour entries)."""
    if plan is None:
        return set()
    return {r.dest_ip for r in plan.rules} | {ip for _, ip in plan.unshaped()}

"""Bringing a topology up on a worker, all or nothing, and changing its links later.

The requests sent to workers are computed by pure functions (``node_requests``,
``link_requests``, ``isolation_request``) so a dry run prints exactly what a real run
would apply.

No link, no path (the default): every node's tree drops traffic to the testbed's node
address space (each emulator host's node subnet, each physical node's address) unless
links.json links the pair; the subnets' gateways (bridges: the controller and agents,
routes to other hosts) and the controller's address stay reachable, and so does
everything outside the node space. A pair linked in one direction only is open both
ways (TCP needs its replies), the way back unshaped. ``open_network=True`` restores
EdgeTB's open network, where unlinked pairs talk through the default class. Runtime
updates keep each node's setting; a link added opens its pair, a link removed closes it.
"""
from __future__ import annotations

import ipaddress
import time
from typing import Any, Callable, Optional

from controller.model.hosts import Hosts, node_addresses
from controller.model.topology import Topology
from controller.model.traces import REPLAY_GSO_MAX_BYTES
from controller.workers.api import Worker
from controller.workers.connect import recorded_plans
from worker.api.errors import CapabilityError, ConfigError, TestbedError
from worker.api.protocol import NODE_IFNAME, node_address
from worker.shaping.plan import Isolation, Plan, Target, make_plan

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def node_requests(topology: Topology, replays: bool = False) -> dict[str, Any]:
    """The body of the create-nodes request (a physical node comes with its device's address).
    When a recording is replayed (``replays``: a scenario's ``trace`` event too), emulated nodes
    hand their interface packets of one frame at most (``controller.model.traces``)."""
    gso = {"gso_max_bytes": REPLAY_GSO_MAX_BYTES} if replays or topology.replays_traces else {}
    return {"version": 1, "nodes": [{"name": n.name, "cpu": n.cpu, "mem_bytes": n.mem_bytes}
                                    | ({"ip": n.ip} if n.kind == "physical" else gso)
                                    | ({"pids_max": n.pids_max} if n.pids_max else {})
                                    | ({"python": n.python} if n.python else {})
                                    for n in topology.nodes.values()]}


def link_requests(topology: Topology, ips: dict[str, str]) -> dict[str, Any]:
    """The body of the set-links request: every directed link with its destination's IP, and
    the access links of the nodes that have them."""
    body: dict[str, Any] = {"version": 1, "links": [{"src": link.src, "dst": link.dst, "dst_ip": ips[link.dst],
                                                     "shape": link.shape.to_dict()} for link in topology.links.values()]}
    access = access_request(topology)
    if access:
        body["access"] = access
    return body


def set_access(worker: Worker, node: str, sides: dict[str, Optional[int]]) -> dict[str, Any]:
    """Change one node's access links in place (``uplink_bps``/``downlink_bps``: None removes
    one, a key left out keeps it): a merging links update, through any worker. Its links'
    classes stay (their counters and minors too)."""
    return worker.set_links({"version": 1, "links": [], "access": {node: sides}}, merge=True)


def access_request(topology: Topology, names: Optional[list[str]] = None) -> dict[str, dict[str, Optional[int]]]:
    """node -> {uplink_bps, downlink_bps} for the nodes (of ``names``, default all) with an access link."""
    nodes = [topology.nodes[n] for n in names] if names is not None else list(topology.nodes.values())
    return {n.name: {"uplink_bps": n.uplink_bps, "downlink_bps": n.downlink_bps}
            for n in nodes if n.uplink_bps is not None or n.downlink_bps is not None}


def shared_rate_bps(topology: Topology, src: str, dst: str) -> int:
    """The rate ``src`` can count on towards ``dst`` when everything is busy: the link's, or the
    guaranteed share of the sender's uplink (split between its links) or of the receiver's
    downlink (split between its peers and its default class), whichever is less (see
    worker.shaping.plan and worker.shaping.downlink). Nodes size their send time-outs with it."""
    rate = topology.links[(src, dst)].shape.rate_bps
    up, down = topology.nodes[src].uplink_bps, topology.nodes[dst].downlink_bps
    if up:
        rate = min(rate, up // max(1, sum(1 for s, _ in topology.links if s == src)))
    if down:
        peers = {s for s, d in topology.links if d == dst} | {d for s, d in topology.links if s == dst}
        rate = min(rate, down // (len(peers) + 1))
    return max(8, rate)


def planned_ips(topology: Topology, subnet: str, subnets: Optional[dict[str, str]] = None,
                hosts: Optional[Hosts] = None) -> dict[str, str]:
    """The addresses fresh hosts give the topology's nodes (for dry runs and first confs): each
    host numbers its emulated nodes in its subnet (``subnets`` by host, else ``subnet``), the
    nodes of a swarm's hosts (``hosts``) are numbered in its overlay; a physical node has its
    device's address."""
    swarm = set(hosts.swarm) if hosts else set()
    ips: dict[str, str] = node_addresses([n.name for n in topology.nodes.values() if n.host in swarm],
                                         hosts.overlay_subnet) if swarm and hosts else {}
    count: dict[str, int] = {}
    for n in topology.nodes.values():
        if n.kind == "physical" and n.ip:
            ips[n.name] = n.ip
            continue
        if n.name in ips:
            continue
        net = ipaddress.IPv4Network((subnets or {}).get(n.host, subnet))
        ips[n.name] = node_address(net, count.get(n.host, 0))
        count[n.host] = count.get(n.host, 0) + 1
    return ips


def plans(topology: Topology, ips: dict[str, str], isolation: Optional[Isolation] = None) -> dict[str, Plan]:
    """Per-node shaping plans, as the worker would make them on a fresh testbed (with
    ``isolation``, every node has one, linked or not)."""
    targets: dict[str, list[Target]] = {n: [] for n in topology.nodes} if isolation else {}
    for link in topology.links.values():
        targets.setdefault(link.src, []).append(Target(link.dst, ips[link.dst], link.shape))
    for name in access_request(topology):
        targets.setdefault(name, [])
    unshaped = unshaped_peers(topology, ips)
    return {src: make_plan(NODE_IFNAME, t, isolation=isolation,
                           unshaped=[(p["dst"], p["dst_ip"]) for p in unshaped.get(src, [])],
                           drop_ipv6=topology.nodes[src].kind != "physical",
                           uplink_bps=topology.nodes[src].uplink_bps, downlink_bps=topology.nodes[src].downlink_bps)
            for src, t in targets.items()}


def node_space(topology: Topology, ips: dict[str, str], subnets: list[str],
               controller_ip: Optional[str] = None) -> Isolation:
    """What isolation drops: every emulator host's node subnet and every node address outside
    them (physical devices); what it keeps: each subnet's gateway (its first address) and the
    controller's address when it lies inside that space."""
    nets = [ipaddress.IPv4Network(s) for s in subnets]
    drop = [str(n) for n in nets]
    for name in sorted(topology.nodes):
        ip = ips.get(name)
        if ip and not any(ipaddress.IPv4Address(ip) in n for n in nets) and f"{ip}/32" not in drop:
            drop.append(f"{ip}/32")
    keep = [str(n.network_address + 1) for n in nets]
    if controller_ip and controller_ip not in keep and any(
            ipaddress.IPv4Address(controller_ip) in ipaddress.IPv4Network(d) for d in drop):
        keep.append(controller_ip)
    if not drop:
        raise ConfigError("isolation: the testbed has no node subnet and no node address to isolate")
    return Isolation(tuple(drop), tuple(keep))


def worker_subnets(caps: dict[str, Any]) -> list[str]:
    """The node subnets of a worker's hosts, from its capabilities (one host, or a cluster's)."""
    hosts = caps.get("hosts")
    found = [c.get("subnet") for c in hosts.values()] if isinstance(hosts, dict) else [caps.get("subnet")]
    return list(dict.fromkeys(s for s in found if s))  # a swarm's hosts share one overlay


def unshaped_peers(topology: Topology, ips: dict[str, str],
                   nodes: Optional[list[str]] = None) -> dict[str, list[dict[str, str]]]:
    """For each node (of ``nodes``, default all): the peers that link to it while it has no link
    back, which it reaches unshaped (replies of a one-way link)."""
    names = list(topology.nodes) if nodes is None else nodes
    back: dict[str, list[str]] = {n: [] for n in names}
    for src, dst in topology.links:
        if dst in back and (dst, src) not in topology.links:
            back[dst].append(src)
    return {n: [{"dst": s, "dst_ip": ips[s]} for s in sorted(peers)] for n, peers in back.items()}


def isolation_request(topology: Topology, ips: dict[str, str], isolation: Optional[Isolation],
                      nodes: Optional[list[str]] = None) -> dict[str, Any]:
    """The isolation part of a set-links body: the setting, and every listed node's unshaped
    peers (so that each of them gets its tree, linked or not)."""
    if isolation is None:
        return {"isolation": {"open": True}}
    return {"isolation": isolation.to_dict(), "unshaped": unshaped_peers(topology, ips, nodes)}


def check_capabilities(topology: Topology, caps: dict[str, Any]) -> None:
    """Fail before anything is created when the worker cannot emulate the topology."""
    check_netem(topology, caps)
    limited = [n.name for n in topology.nodes.values() if n.cpu or n.mem_bytes or n.pids_max]
    if limited and not caps.get("cgroup_version"):
        raise CapabilityError(f"the worker has no usable cgroups, so the limits of {', '.join(limited[:5])} cannot be set")


def refusal(topology: Topology, worker: Worker) -> Optional[tuple[int, str]]:
    """Asked before anything is made: ``(2, why)`` when a worker cannot shape ``topology`` (a run
    script's code for bad input), ``(1, why)`` when a worker does not answer (a failed deploy's),
    else None."""
    try:
        check_capabilities(topology, worker.capabilities())
    except CapabilityError as e:
        return 2, e.message
    except TestbedError as e:
        return 1, e.message
    return None


def check_netem(topology: Topology, caps: dict[str, Any]) -> None:
    """Fail when a link needs netem (delay, jitter, loss: links.json's or a recording's columns)
    and the worker's kernel (``caps``: its ``netem`` and ``kernel``) lacks it."""
    traces = topology.traces
    needing = [f"{l.src}->{l.dst} ({l.shape.describe()}"
               + (f"; the columns of {traces[(l.src, l.dst)].file}" if (l.src, l.dst) in traces else "") + ")"
               for l in topology.links.values() if l.shape.needs_netem]
    if needing and not caps.get("netem"):
        shown = ", ".join(needing[:5]) + (f" and {len(needing) - 5} more" if len(needing) > 5 else "")
        raise CapabilityError(
            f"the worker's kernel ({caps.get('kernel', '?')}) has no sch_netem, so delay, jitter and loss "
            f"cannot be emulated; links that need it: {shown}")


def deploy(topology: Topology, worker: Worker, progress: Progress = _quiet,
           open_network: bool = False, replays: bool = False) -> dict[str, Any]:
    """Create every node and shape every link; on any failure remove what was created. Unless
    ``open_network``, traffic between nodes that no link joins is dropped (see the module);
    ``replays``: a scenario replays a recording (``node_requests``)."""
    caps = worker.capabilities()
    check_capabilities(topology, caps)
    if worker.status()["nodes"]:
        raise ConfigError("this testbed is already up; take it down first (edgetb down)")
    started = time.monotonic()
    if getattr(worker, "fabric", None) is not None:
        worker.progress = progress  # type: ignore[attr-defined]  # a cluster's swarm fabric says what it made
    try:
        progress(f"creating {len(topology.nodes)} nodes")
        made = worker.create_nodes(node_requests(topology, replays))
        created = made["nodes"]
        for warning in made.get("warnings", []):
            progress(f"warning: {warning}")
        ips = {n["name"]: n["ip"] for n in created}
        t_nodes = time.monotonic() - started
        progress(f"created {len(created)} nodes in {t_nodes:.2f} s; shaping {len(topology.links)} links ({topology.rates_text()})")
        bridge_ip = worker.status().get("bridge_ip")  # where nodes reach the controller (and agents)
        if open_network:
            wanted = topology.links or access_request(topology)
            shaped = worker.set_links(link_requests(topology, ips)) if wanted else {"nodes": []}
        else:
            space = node_space(topology, ips, worker_subnets(caps), bridge_ip)
            shaped = worker.set_links(link_requests(topology, ips) | isolation_request(topology, ips, space))
            progress(f"isolated: traffic to {', '.join(space.drop)} leaves only by a link "
                     f"(gateways {', '.join(space.keep) or '-'} open; --open-network to allow all)")
    except BaseException:
        progress("bring-up failed: removing what was created")
        try:
            worker.reset()
        except TestbedError:
            pass
        raise
    total = time.monotonic() - started
    progress(f"shaped and verified {len(topology.links)} links on {len(shaped['nodes'])} nodes; ready in {total:.2f} s")
    return {"nodes": created, "ips": ips, "bridge_ip": bridge_ip, "seconds_nodes": round(t_nodes, 3),
            "seconds_total": round(total, 3)}


def update_links(topology: Topology, worker: Worker, progress: Progress = _quiet,
                 only: Optional[set[tuple[str, str]]] = None) -> dict[str, Any]:
    """Re-shape links in place: every source's links become those of ``topology`` (links
    left out are removed), or only the (src, dst) pairs in ``only`` change. Each node keeps
    its isolation setting: a link added opens its pair, a link removed closes it."""
    status = worker.status()
    ips = {n["name"]: n["ip"] for n in status["nodes"]}
    unknown = sorted({n for pair in topology.links for n in pair if n not in ips})
    if unknown:
        raise ConfigError(f"nodes not in the running testbed: {', '.join(unknown)}")
    check_capabilities(topology, worker.capabilities())
    if only is not None:
        changed = topology.copy()
        changed.links = {pair: link for pair, link in topology.links.items() if pair in only}
        progress(f"updating {len(changed.links)} links in place")
        return merge_links(changed, worker, ips)
    body = link_requests(topology, ips)
    # every node is listed: one left without links keeps only its isolation (an open one is cleared)
    body["unshaped"] = unshaped_peers(topology, ips, [n["name"] for n in status["nodes"]])
    progress(f"re-shaping {len(body['links'])} links in place")
    return worker.set_links(body)


def merge_links(changed: Topology, worker: Worker, ips: dict[str, str]) -> dict[str, Any]:
    """Add or change the links of ``changed`` in place, other links untouched. On an isolated
    node a link's destination must answer: when it has no link back, its plan (read from the
    worker) gains the source as an unshaped peer."""
    body = link_requests(changed, ips)
    unshaped: dict[str, list[dict[str, str]]] = {}
    plans: dict[str, Optional[dict[str, Any]]] = {}
    for src, dst in changed.links:
        if (dst, src) in changed.links:
            continue
        if dst not in plans:
            plans[dst] = worker.shaping(dst)["plan"]
        plan = plans[dst]
        if not plan or not plan.get("drops") or any(r["dest"] == src for r in plan["rules"]):
            continue  # open, or linked back already
        peers = unshaped.setdefault(dst, [{"dst": p["dest"], "dst_ip": p["dest_ip"]}
                                          for p in plan.get("passes", []) if p["dest"]])
        if all(p["dst"] != src for p in peers):
            peers.append({"dst": src, "dst_ip": ips[src]})
    if unshaped:
        body["unshaped"] = unshaped
    return worker.set_links(body, merge=True)


def live_topology(worker: Worker) -> Topology:
    """The topology of the testbed that is up, as its worker records it: its nodes (limits,
    access links) and every shaped link. An empty testbed is a ConfigError."""
    from controller.model.topology import Link

    status = worker.status()
    if not status["nodes"]:
        raise ConfigError(f"testbed {status['testbed_id']} has no nodes: bring it up first (edgetb up links.json)")
    recorded = recorded_plans(worker)  # this host's worker reads its own state, an agent is asked
    topology = Topology()
    plans: dict[str, Plan] = {}
    for n in status["nodes"]:
        data = recorded.get(n["name"])
        plan = Plan.from_dict(data) if data else None
        physical = n.get("runtime") == "physical"
        topology.add_node(n["name"], "physical" if physical else "emulated", cpu=n["cpu"], mem=n["mem_bytes"],
                          ip=n["ip"] if physical else None, source="the testbed's state",
                          uplink=plan.uplink_bps if plan else None, downlink=plan.downlink_bps if plan else None)
        if plan is not None:
            plans[n["name"]] = plan
    for src, plan in plans.items():
        for rule in plan.rules:
            if rule.dest in topology.nodes:
                topology.links[(src, rule.dest)] = Link(src, rule.dest, rule.shape)
    return topology

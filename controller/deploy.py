"""Bringing a topology up on a worker, all or nothing, and changing its links later.

The requests sent to workers are computed by pure functions (``node_requests``,
``link_requests``) so a dry run prints exactly what a real run would apply.
"""
from __future__ import annotations

import ipaddress
import time
from typing import Any, Callable, Optional

from controller.agent_client import Worker
from controller.topology import Topology
from worker.errors import CapabilityError, ConfigError, TestbedError
from worker.runtime_netns import NODE_IFNAME, node_address
from worker.tc_plan import Plan, Target, make_plan

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def node_requests(topology: Topology) -> dict[str, Any]:
    """The body of the create-nodes request (a physical node comes with its device's address)."""
    return {"version": 1, "nodes": [{"name": n.name, "cpu": n.cpu, "mem_bytes": n.mem_bytes}
                                    | ({"ip": n.ip} if n.kind == "physical" else {})
                                    for n in topology.nodes.values()]}


def link_requests(topology: Topology, ips: dict[str, str]) -> dict[str, Any]:
    """The body of the set-links request: every directed link with its destination's IP."""
    return {"version": 1, "links": [{"src": link.src, "dst": link.dst, "dst_ip": ips[link.dst],
                                     "shape": link.shape.to_dict()} for link in topology.links.values()]}


def planned_ips(topology: Topology, subnet: str, subnets: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The addresses fresh hosts give the topology's nodes (for dry runs and first confs): each
    host numbers its emulated nodes in its subnet (``subnets`` by host, else ``subnet``);
    a physical node has its device's address."""
    ips: dict[str, str] = {}
    count: dict[str, int] = {}
    for n in topology.nodes.values():
        if n.kind == "physical" and n.ip:
            ips[n.name] = n.ip
            continue
        net = ipaddress.IPv4Network((subnets or {}).get(n.host, subnet))
        ips[n.name] = node_address(net, count.get(n.host, 0))
        count[n.host] = count.get(n.host, 0) + 1
    return ips


def plans(topology: Topology, ips: dict[str, str]) -> dict[str, Plan]:
    """Per-node shaping plans, as the worker would make them on a fresh testbed."""
    targets: dict[str, list[Target]] = {}
    for link in topology.links.values():
        targets.setdefault(link.src, []).append(Target(link.dst, ips[link.dst], link.shape))
    return {src: make_plan(NODE_IFNAME, t) for src, t in targets.items()}


def check_capabilities(topology: Topology, caps: dict[str, Any]) -> None:
    """Fail before anything is created when the worker cannot emulate the topology."""
    needing = [f"{l.src}->{l.dst} ({l.shape.describe()})" for l in topology.links.values() if l.shape.needs_netem]
    if needing and not caps.get("netem"):
        shown = ", ".join(needing[:5]) + (f" and {len(needing) - 5} more" if len(needing) > 5 else "")
        raise CapabilityError(
            f"the worker's kernel ({caps.get('kernel', '?')}) has no sch_netem, so delay, jitter and loss "
            f"cannot be emulated; links that need it: {shown}")
    limited = [n.name for n in topology.nodes.values() if n.cpu or n.mem_bytes]
    if limited and not caps.get("cgroup_version"):
        raise CapabilityError(f"the worker has no usable cgroups, so the limits of {', '.join(limited[:5])} cannot be set")


def deploy(topology: Topology, worker: Worker, progress: Progress = _quiet) -> dict[str, Any]:
    """Create every node and shape every link; on any failure remove what was created."""
    check_capabilities(topology, worker.capabilities())
    if worker.status()["nodes"]:
        raise ConfigError("this testbed is already up; take it down first (edgetb down)")
    started = time.monotonic()
    try:
        progress(f"creating {len(topology.nodes)} nodes")
        created = worker.create_nodes(node_requests(topology))["nodes"]
        ips = {n["name"]: n["ip"] for n in created}
        t_nodes = time.monotonic() - started
        progress(f"created {len(created)} nodes in {t_nodes:.2f} s; shaping {len(topology.links)} links ({topology.rates_text()})")
        shaped = worker.set_links(link_requests(topology, ips)) if topology.links else {"nodes": []}
    except BaseException:
        progress("bring-up failed: removing what was created")
        try:
            worker.reset()
        except TestbedError:
            pass
        raise
    total = time.monotonic() - started
    progress(f"shaped and verified {len(topology.links)} links on {len(shaped['nodes'])} nodes; ready in {total:.2f} s")
    return {"nodes": created, "ips": ips, "seconds_nodes": round(t_nodes, 3), "seconds_total": round(total, 3)}


def update_links(topology: Topology, worker: Worker, progress: Progress = _quiet,
                 only: Optional[set[tuple[str, str]]] = None) -> dict[str, Any]:
    """Re-shape links in place: every source's links become those of ``topology`` (links
    left out are removed), or only the (src, dst) pairs in ``only`` change."""
    status = worker.status()
    ips = {n["name"]: n["ip"] for n in status["nodes"]}
    unknown = sorted({n for pair in topology.links for n in pair if n not in ips})
    if unknown:
        raise ConfigError(f"nodes not in the running testbed: {', '.join(unknown)}")
    check_capabilities(topology, worker.capabilities())
    body = link_requests(topology, ips)
    if only is not None:
        body["links"] = [l for l in body["links"] if (l["src"], l["dst"]) in only]
        progress(f"updating {len(body['links'])} links in place")
        return worker.set_links(body, merge=True)
    sources = {l["src"] for l in body["links"]}
    for gone in [n["name"] for n in status["nodes"] if n["shaped"] and n["name"] not in sources]:
        worker.clear_links(gone)
    progress(f"re-shaping {len(body['links'])} links in place")
    return worker.set_links(body)

"""Routes between hosts, so that every node reaches every other by its own IP.

Each emulator host holds its nodes' subnet. Every other host (and the
controller's) gets a route to that subnet via the host's LAN address, IP
forwarding on, and iptables ACCEPT rules for traffic from and to its peers
(Docker's FORWARD policy is DROP). What is installed is recorded in the state
and removed by reset: routes by exact destination and gateway, rules by the
testbed's comment.

Only node subnets can be routed: no default route, no prefix shorter than
/``MIN_PREFIXLEN``, nothing loopback, link-local, multicast or reserved, and
nothing that overlaps a network of this host's interfaces (its LAN, other
testbeds' bridges) or a route this testbed did not install. IP forwarding is
shared by every testbed on the host: the testbeds that need it are counted in
a host-wide file, and the last one to leave restores what the host had.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any, Optional

from worker.api.errors import ConfigError, NodeRuntimeError
from worker.nodes.netns import remove_forward_rules
from worker.nodes.runtime import Naming
from worker.state import StateStore, host_record

FORWARD_SYSCTL = "/proc/sys/net/ipv4/ip_forward"
MAX_ROUTES = 4096
MIN_PREFIXLEN = 8


@dataclass(frozen=True)
class Route:
    subnet: str
    via: str

    def to_dict(self) -> dict[str, str]:
        return {"subnet": self.subnet, "via": self.via}


def _network(value: Any, where: str) -> str:
    """A node subnet: an IPv4 network of at least /MIN_PREFIXLEN that is not special."""
    try:
        if not isinstance(value, str):
            raise ValueError
        network = ipaddress.IPv4Network(value)
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not an IPv4 network such as '10.78.0.0/16'") from None
    if network.prefixlen < MIN_PREFIXLEN:
        raise ConfigError(f"{where}: {network} is {'the default route' if network.prefixlen == 0 else 'too wide'}; "
                          f"only node subnets of /{MIN_PREFIXLEN} or longer can be routed")
    special = next((kind for kind in ("loopback", "link_local", "multicast", "reserved", "unspecified")
                    if getattr(network, f"is_{kind}")), None)
    if special:
        raise ConfigError(f"{where}: {network} is a {special.replace('_', '-')} network, not a node subnet")
    return str(network)


def overlaps(routes: list[Route], taken: dict[str, str]) -> Optional[str]:
    """Why ``routes`` cannot be installed beside the host's ``taken`` networks (network -> what
    holds it), or None (pure)."""
    for route in routes:
        net = ipaddress.IPv4Network(route.subnet)
        for other, holder in taken.items():
            if net.overlaps(ipaddress.IPv4Network(other)):
                return f"route to {route.subnet} overlaps {other} ({holder}) on this host"
    return None


def parse_routes(body: dict[str, Any]) -> tuple[list[Route], list[str]]:
    """The routes and peer networks of a set-routes request, validated."""
    routes_in, peers_in = body.get("routes"), body.get("peers", [])
    if not isinstance(routes_in, list) or not isinstance(peers_in, list):
        raise ConfigError("'routes' and 'peers' must be lists")
    if len(routes_in) > MAX_ROUTES or len(peers_in) > MAX_ROUTES:
        raise ConfigError(f"at most {MAX_ROUTES} routes and peers")
    routes, seen = [], set()
    for i, entry in enumerate(routes_in):
        if not isinstance(entry, dict) or set(entry) != {"subnet", "via"}:
            raise ConfigError(f"route {i}: expected {{\"subnet\": ..., \"via\": ...}}, got {entry!r}")
        subnet = _network(entry["subnet"], f"route {i}, field 'subnet'")
        try:
            via = str(ipaddress.IPv4Address(entry["via"]))
        except ValueError:
            raise ConfigError(f"route {i}, field 'via': {entry['via']!r} is not an IPv4 address") from None
        if subnet in seen:
            raise ConfigError(f"route {i}: {subnet} is listed twice")
        seen.add(subnet)
        routes.append(Route(subnet, via))
    peers = sorted({_network(p, f"peer {i}") for i, p in enumerate(peers_in)})
    return routes, peers


class Routes:
    """The routes, forwarding and ACCEPT rules of one testbed on this host."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.comment = Naming(store.testbed_id).iptables_comment

    def set(self, routes: list[Route], peers: list[str]) -> dict[str, Any]:
        """Make the installed routes and peer rules exactly these (idempotent)."""
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with self.store.locked() as state:
            old = [Route(**r) for r in state.get("routes", [])]
            with IPRoute() as ipr:
                problem = overlaps([r for r in routes if r not in old], _taken_networks(ipr, old))
            if problem:
                raise ConfigError(problem)
            if routes or peers:  # forward only what crosses hosts
                hold_forwarding(self.store.testbed_id)
            with IPRoute() as ipr:
                for route in old:
                    if route not in routes:
                        _delete_route(ipr, route)
                state["routes"] = [r.to_dict() for r in old if r in routes]
                for route in routes:
                    try:
                        ipr.route("replace", dst=route.subnet, gateway=route.via)
                    except NetlinkError as e:
                        raise NodeRuntimeError(f"cannot route {route.subnet} via {route.via}: {e.args[-1]} "
                                               f"(is {route.via} on a network this host is attached to?)") from None
                    if route.to_dict() not in state["routes"]:
                        state["routes"].append(route.to_dict())
            self._set_rules(peers)
            state["peers"] = peers
            return {"version": 1, "routes": state["routes"], "peers": peers}

    def _set_rules(self, peers: list[str]) -> None:
        if not shutil.which("iptables"):
            return
        remove_forward_rules(self.comment, keep=_not_a_peer_rule)
        for peer in peers:
            for direction in ("-s", "-d"):
                rule = ["FORWARD", direction, peer, "-m", "comment", "--comment", self.comment, "-j", "ACCEPT"]
                done = subprocess.run(["iptables", "-w", "-I", "FORWARD", "1", *rule[1:]], capture_output=True,
                                      text=True)
                if done.returncode != 0:
                    raise NodeRuntimeError(f"iptables could not accept traffic {direction} {peer}: {done.stderr.strip()}")

    def reset(self) -> int:
        """Remove what ``set`` installed; the number of routes removed."""
        from pyroute2 import IPRoute

        with self.store.locked() as state:
            routes = [Route(**r) for r in state.pop("routes", [])]
            if routes:
                with IPRoute() as ipr:
                    for route in routes:
                        _delete_route(ipr, route)
            if state.pop("peers", None) and shutil.which("iptables"):
                remove_forward_rules(self.comment, keep=_not_a_peer_rule)
            was = state.pop("ip_forward_was", None)  # a state written before the host-wide count
            release_forwarding(self.store.testbed_id, was)
            return len(routes)


def _not_a_peer_rule(words: list[str]) -> bool:
    return "-s" not in words and "-d" not in words


def _delete_route(ipr: Any, route: Route) -> None:
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr.route("del", dst=route.subnet, gateway=route.via)
    except NetlinkError:
        pass  # already gone (its interface went down or away)


def _taken_networks(ipr: Any, ours: list[Route]) -> dict[str, str]:
    """The networks of this host's interfaces and routes, but the routes in ``ours``."""
    names = {m["index"]: m.get_attr("IFLA_IFNAME") for m in ipr.get_links()}
    taken = {}
    for msg in ipr.get_addr(family=2):
        iface = ipaddress.IPv4Interface(f"{msg.get_attr('IFA_ADDRESS')}/{msg['prefixlen']}")
        taken[str(iface.network)] = f"interface {names.get(msg['index'], msg['index'])}"
    mine = {(r.subnet, r.via) for r in ours}
    for msg in ipr.get_routes(family=2, table=254):
        if msg["dst_len"] == 0:
            continue  # the default route: every subnet is more specific
        dst = f"{msg.get_attr('RTA_DST')}/{msg['dst_len']}"
        if (str(ipaddress.IPv4Network(dst, strict=False)), msg.get_attr("RTA_GATEWAY")) not in mine:
            taken.setdefault(str(ipaddress.IPv4Network(dst, strict=False)), "a route")
    return taken


def hold_forwarding(testbed_id: str) -> None:
    """Count ``testbed_id`` among those that need IP forwarding; the first one switches it on and
    remembers what the host had."""
    with host_record("ip_forward") as host:
        record = host.read({})
        holders = set(record.get("holders", []))
        if not holders:
            record["was"] = _read_forwarding()
        if testbed_id not in holders:
            holders.add(testbed_id)
            record["holders"] = sorted(holders)
            host.write(record)
        if _read_forwarding() != "1":
            _write_forwarding("1")


def release_forwarding(testbed_id: str, legacy_was: Optional[str] = None) -> None:
    """``testbed_id`` no longer needs forwarding; the last one to leave restores what the host had."""
    with host_record("ip_forward") as host:
        record = host.read({})
        holders = set(record.get("holders", []))
        if testbed_id not in holders:
            if not holders and legacy_was is not None and _read_forwarding() != legacy_was:
                _write_forwarding(legacy_was)
            return
        holders.discard(testbed_id)
        if holders:
            host.write({**record, "holders": sorted(holders)})
            return
        if record.get("was") in ("0", "1") and _read_forwarding() != record["was"]:
            _write_forwarding(record["was"])
        os.unlink(host.path)


def _read_forwarding() -> str:
    with open(FORWARD_SYSCTL) as f:
        return f.read().strip()


def _write_forwarding(value: str) -> None:
    with open(FORWARD_SYSCTL, "w") as f:
        f.write(value)

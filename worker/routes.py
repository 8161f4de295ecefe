"""Routes between hosts, so that every node reaches every other by its own IP.

Each emulator host holds its nodes' subnet. Every other host (and the
controller's) gets a route to that subnet via the host's LAN address, IP
forwarding on, and iptables ACCEPT rules for traffic from and to its peers
(Docker's FORWARD policy is DROP). What is installed is recorded in the state
and removed by reset: routes by exact destination and gateway, rules by the
testbed's comment, forwarding restored to what it was.
"""
from __future__ import annotations

import ipaddress
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from worker.errors import ConfigError, NodeRuntimeError
from worker.runtime_netns import Naming, remove_forward_rules
from worker.state import StateStore

FORWARD_SYSCTL = "/proc/sys/net/ipv4/ip_forward"
MAX_ROUTES = 4096


@dataclass(frozen=True)
class Route:
    subnet: str
    via: str

    def to_dict(self) -> dict[str, str]:
        return {"subnet": self.subnet, "via": self.via}


def _network(value: Any, where: str) -> str:
    try:
        if not isinstance(value, str):
            raise ValueError
        return str(ipaddress.IPv4Network(value))
    except ValueError:
        raise ConfigError(f"{where}: {value!r} is not an IPv4 network such as '10.78.0.0/16'") from None


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
            was = _read_forwarding()
            if (routes or peers) and was != "1":  # forward only what crosses hosts
                state.setdefault("ip_forward_was", was)
                _write_forwarding("1")
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
            was = state.pop("ip_forward_was", None)
            if was is not None and _read_forwarding() != was:
                _write_forwarding(was)
            return len(routes)


def _not_a_peer_rule(words: list[str]) -> bool:
    return "-s" not in words and "-d" not in words


def _delete_route(ipr: Any, route: Route) -> None:
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        ipr.route("del", dst=route.subnet, gateway=route.via)
    except NetlinkError:
        pass  # already gone (its interface went down or away)


def _read_forwarding() -> str:
    with open(FORWARD_SYSCTL) as f:
        return f.read().strip()


def _write_forwarding(value: str) -> None:
    with open(FORWARD_SYSCTL, "w") as f:
        f.write(value)

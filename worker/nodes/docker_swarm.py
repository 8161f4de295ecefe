"""A Docker host's part of the swarm fabric: joining the testbed's swarm, and what it sets up in each node.

The controller's machine is the swarm's manager (``controller.workers.swarm``, with the manager's part
here in ``worker.nodes.docker_manager``); it sends every Docker host's agent a ``set_fabric`` request
over the agent's pinned HTTPS channel: the manager's address, the worker join token (never on a
command line, never in a file), this host's advertised address and the overlay (``Fabric``). The agent's engine joins the swarm unless it is a member already (of that
swarm: another is refused); a swarm joined for the testbed is recorded in its state and left at reset.
The Docker runtime then puts its containers on the overlay at the planned addresses and routes, inside
each node's namespace, the controller's address (and any routed node subnets) via the overlay's
gateway, which the controller's machine runs.
"""
from __future__ import annotations

import errno
import ipaddress
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from worker.api.bodies import VERSION
from worker.api.errors import ConfigError, NodeRuntimeError
from worker.api.schema import Field, Schema
from worker.kernel import netlink
from worker.nodes.docker_exec import sdk, short_error
from worker.sockets import tcp_sockets

MANAGER_PORT = 2377
ATTACH_TRIES, ATTACH_RETRY_S = 3, 2.0  # a container's start on a swarm overlay
LEAVE_TRIES = 3
GOSSIP_PORT = 7946
PORT_WAIT_S = 30.0
MAX_FABRIC_ROUTES = 1024
FABRIC_SCHEMA = Schema({
    "version": VERSION,
    "manager": Field(str, "the manager's address and port, e.g. '10.254.0.1:2377'", required=True, max_len=21),
    "token": Field(str, "the swarm's worker join token", required=True, max_len=256),
    "advertise_addr": Field(str, "this host's LAN address", required=True, max_len=15),
    "network": Field(str, "the overlay network's name", required=True, max_len=64),
    "subnet": Field(str, "the overlay's subnet", required=True, max_len=18),
    "mtu": Field(int, "the overlay's MTU in bytes", required=True, low=1280, high=8950),
    "gateway": Field(str, "the overlay address of the controller's gateway", required=True, max_len=15),
    "routes": Field(list, "networks the nodes reach via the gateway", required=True, max_items=MAX_FABRIC_ROUTES,
                    items=Field(str, max_len=18))})


@dataclass(frozen=True)
class Fabric:
    """The overlay a Docker host's nodes join (what the state keeps of a ``set_fabric`` request: no token)."""

    network: str
    subnet: str
    mtu: int
    gateway: str
    routes: tuple[str, ...]
    manager: str
    joined: bool = False  # whether this host's engine joined the swarm for the testbed (left at reset)
    gwbridge_made: bool = False  # whether that join made the engine's docker_gwbridge (removed at reset)

    @classmethod
    def from_request(cls, body: Any) -> tuple["Fabric", str, str]:
        """The fabric, the join token and the advertised address of a request, validated."""
        body = FABRIC_SCHEMA.validate(body, "set_fabric request", ConfigError)
        where = "set_fabric request"
        try:
            subnet = ipaddress.IPv4Network(body["subnet"])
            gateway = ipaddress.IPv4Address(body["gateway"])
            ipaddress.IPv4Address(body["advertise_addr"])
            host, _, port = body["manager"].rpartition(":")
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"manager {body['manager']!r} has no port")
            ipaddress.IPv4Address(host)
            routes = tuple(str(ipaddress.IPv4Network(r)) for r in body["routes"])
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None
        if gateway not in subnet:
            raise ConfigError(f"{where}: gateway {gateway} is not in the overlay {subnet}")
        if not body["network"].startswith("etb-") or not body["network"].replace("-", "").isalnum():
            raise ConfigError(f"{where}: {body['network']!r} is not a testbed's overlay network (etb-<id>-ov)")
        return cls(body["network"], str(subnet), body["mtu"], str(gateway), routes, body["manager"]), \
            body["token"], body["advertise_addr"]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "routes": list(self.routes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Fabric":
        return cls(**{**data, "routes": tuple(data["routes"])})

    def check_address(self, node: str, ip: Any) -> str:
        """A node's planned overlay address: in the subnet, and neither Docker's gateway nor ours."""
        net = ipaddress.IPv4Network(self.subnet)
        try:
            addr = ipaddress.IPv4Address(ip)
        except ValueError:
            raise ConfigError(f"node {node}: {ip!r} is not an IPv4 address") from None
        if addr not in net or addr in (net.network_address, net.broadcast_address, net.network_address + 1,
                                       ipaddress.IPv4Address(self.gateway)):
            raise ConfigError(f"node {node}: {addr} is not a node address of the overlay {net}")
        return str(addr)


def swarm_of(info: dict[str, Any]) -> dict[str, Any]:
    """The swarm part of an engine's ``info()``: state (inactive, active, ...), node id and address,
    manager or not, cluster id (a worker's engine does not know it: None) and the managers' addresses."""
    swarm = info.get("Swarm") or {}
    cluster = swarm.get("Cluster") or {}
    return {"state": swarm.get("LocalNodeState") or "inactive", "node_id": swarm.get("NodeID") or None,
            "node_addr": swarm.get("NodeAddr") or None, "manager": bool(swarm.get("ControlAvailable")),
            "cluster_id": cluster.get("ID") or None,
            "managers": sorted(m.get("Addr", "") for m in swarm.get("RemoteManagers") or []),
            "error": swarm.get("Error") or None}


def join(api: Any, manager: str, token: str, advertise_addr: str) -> bool:
    """Join the swarm managed at ``manager`` (True), or find the engine already in it (False);
    an engine in another swarm is refused: leaving it is the user's call."""
    member = swarm_of(api.info())
    if member["state"] == "active":
        if manager in member["managers"]:
            return False
        raise ConfigError(f"this host's Docker engine is in another swarm (managers {', '.join(member['managers'])}); "
                          f"leave it ('docker swarm leave') or make {manager.rpartition(':')[0]} its manager")
    if member["state"] != "inactive":
        raise NodeRuntimeError(f"this host's Docker engine is {member['state']} in a swarm; wait or leave it")
    wait_port_free(advertise_addr, GOSSIP_PORT)
    try:
        api.join_swarm([manager], token, listen_addr=f"{advertise_addr}:{MANAGER_PORT}",
                       advertise_addr=advertise_addr, data_path_addr=advertise_addr)
    except sdk().errors.APIError as e:
        raise NodeRuntimeError(f"joining the swarm at {manager} failed: {short_error(e)} (is {MANAGER_PORT}/tcp "
                               "open towards it, and 7946/tcp+udp and 4789/udp between the hosts?)") from None
    return True


def wait_port_free(address: str, port: int, timeout_s: float = PORT_WAIT_S) -> None:
    """Until nothing holds ``address:port`` (TCP): an engine that has just left a swarm can keep
    its gossip listener a while, and a join meanwhile leaves the host without overlay peers."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
                return
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    return  # not this host's address (a NAT): the engine says what is wrong
        if time.monotonic() > deadline:
            raise NodeRuntimeError(f"port {port} on {address} is still held ({holders(port)}), by the engine's last "
                                   "swarm most likely: restart dockerd on this host, then up again")
        time.sleep(0.5)


TCP_STATES = {1: "established", 2: "syn-sent", 3: "syn-recv", 4: "fin-wait-1", 5: "fin-wait-2", 6: "time-wait",
              7: "close", 8: "close-wait", 9: "last-ack", 10: "listening", 11: "closing"}


def holders(port: int) -> str:
    """The TCP sockets of this namespace on local ``port``, in words (for an error)."""
    found = [f"{TCP_STATES.get(t.state, t.state)} {t.local[0]}:{t.local[1]}"
             + ("" if t.state == 10 else f" to {t.remote[0]}:{t.remote[1]}")
             + (" (no process: closing)" if t.inode == 0 else "")
             for t in tcp_sockets() if t.local[1] == port]
    return "; ".join(found[:8]) or "no socket seen"


GWBRIDGE = "docker_gwbridge"  # the bridge an engine makes when it enters a swarm, and keeps after leaving


def has_gwbridge(api: Any) -> bool:
    return any(n["Name"] == GWBRIDGE for n in api.networks(names=[GWBRIDGE]))


def remove_gwbridge(api: Any, timeout_s: float = 15.0) -> None:
    """Remove the engine's ``docker_gwbridge`` (made when it entered the swarm): its endpoints
    go a moment after the leave; one still used after ``timeout_s`` (someone else's) stays."""
    docker = sdk()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            api.remove_network(GWBRIDGE)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)


def leave(api: Any) -> None:
    """Leave the swarm (a worker's leave; forced, since its tasks are the testbed's). A busy
    engine can run out of its own time cleaning up: the leave is tried again."""
    for attempt in range(1, LEAVE_TRIES + 1):
        try:
            api.leave_swarm(force=True)
            return
        except sdk().errors.APIError as e:
            if "not part of a swarm" in str(e):
                return
            if "deadline exceeded" not in str(e) or attempt == LEAVE_TRIES:
                raise NodeRuntimeError(f"leaving the swarm failed: {short_error(e)}") from None
            time.sleep(ATTACH_RETRY_S)


def started(api: Any, make: Callable[[], str]) -> str:
    """Start the container ``make()`` creates (its id); a start whose overlay attachment timed out
    (an engine that has just joined, its gossip with the manager still settling, or a busy
    manager) is tried again with a new container, up to ``ATTACH_TRIES`` times."""
    docker = sdk()
    for attempt in range(1, ATTACH_TRIES + 1):
        container_id = make()
        try:
            api.start(container_id)
            return container_id
        except docker.errors.APIError as e:
            if "attaching to network failed" not in str(e) or attempt == ATTACH_TRIES:
                raise
            try:
                api.remove_container(container_id, force=True)
            except docker.errors.NotFound:
                pass
            time.sleep(ATTACH_RETRY_S)
    raise AssertionError("unreachable")


def route_node(netns: str, fabric: Fabric) -> None:
    """Inside a node's namespace: each of the fabric's networks via the overlay's gateway."""
    with netlink.RtnlSocket(netns) as sock:
        failures = sock.run(netlink.route_via(dst, fabric.gateway) for dst in fabric.routes)
    if failures:
        raise NodeRuntimeError(f"route to {fabric.routes[failures[0].position]} via {fabric.gateway} in {netns}: "
                               f"{failures[0].text}")

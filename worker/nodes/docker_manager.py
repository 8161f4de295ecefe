"""The swarm manager's part of the Docker fabric: what the controller's machine runs.

The controller's machine manages the testbed's swarm (``controller.workers.swarm``): its Docker
engine makes the swarm and the overlay and runs the overlay's gateway container, and this machine
routes the overlay through a veth into that gateway. This module is the controller's one door to
the Docker runtime and to the kernel for it; ``tests/unit/test_import_contract.py`` holds the
list below (``__all__``) and refuses any other import of ``worker.nodes`` from the controller.

- the engine: ``connect`` (a client of the local engine), ``sdk`` (the Docker SDK), ``short_error``
  (a Docker error in one line), ``node_image``, ``require_image``, ``LABEL`` (what every object of
  a testbed is labelled with, ``worker.nodes.docker``);
- the swarm (``worker.nodes.docker_swarm``): ``MANAGER_PORT``, ``swarm_of`` (an engine's
  membership), ``started`` (a container started, retried while its overlay attaches),
  ``has_gwbridge`` and ``remove_gwbridge``;
- the gateway's link into this machine: ``link_gateway`` and ``unlink_gateway``.
"""
from __future__ import annotations

import os
import socket
from typing import Any

from worker.api.errors import NodeRuntimeError
from worker.kernel import netlink, nsfs
from worker.nodes.docker import LABEL, connect, node_image, require_image
from worker.nodes.docker_exec import sdk, short_error
from worker.nodes.docker_swarm import MANAGER_PORT, has_gwbridge, remove_gwbridge, started, swarm_of

__all__ = ["LABEL", "MANAGER_PORT", "connect", "has_gwbridge", "link_gateway", "node_image", "remove_gwbridge",
           "require_image", "sdk", "short_error", "started", "swarm_of", "unlink_gateway"]

GATEWAY_IFNAME = "ctl0"  # the gateway's end of its link to this machine


def link_gateway(gateway_ns: str, pid: int, host_if: str, near: str, far: str, subnet: str, controller_ip: str,
                 routes: list[str]) -> None:
    """Name the gateway container's (``pid``) network namespace ``gateway_ns`` and link it to this
    machine: a veth ``host_if`` here (``near``/30) to ``ctl0`` there (``far``/30), this machine
    routing the overlay ``subnet`` via the gateway (from ``controller_ip``), the gateway
    forwarding and routing ``controller_ip`` and ``routes`` back via this machine."""
    nsfs.attach(gateway_ns, pid)
    fd = os.open(nsfs.netns_path(gateway_ns), os.O_RDONLY | os.O_CLOEXEC)
    try:  # netlink sockets only: this process has threads, and must not fork into a namespace
        with netlink.RtnlSocket() as sock:
            failures = sock.run(netlink.veth_pair(host_if, GATEWAY_IFNAME, fd))
    finally:
        os.close(fd)
    _raise(failures, "veth into the gateway")
    with netlink.RtnlSocket() as sock:
        index = socket.if_nametoindex(host_if)
        failures = sock.run([netlink.add_ipv4(index, near, 30), netlink.link_up(index),
                             netlink.route_via(subnet, far, prefsrc=controller_ip)])
    _raise(failures, "this machine's end of the gateway link")
    with nsfs.entered(gateway_ns):
        with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
            f.write("1\n")
        ctl = socket.if_nametoindex(GATEWAY_IFNAME)
    with netlink.RtnlSocket(gateway_ns) as sock:
        failures = sock.run([netlink.add_ipv4(ctl, far, 30), netlink.link_up(ctl)] +
                            [netlink.route_via(dst, near) for dst in [f"{controller_ip}/32", *routes]])
    _raise(failures, "the gateway's end of its link")


def unlink_gateway(gateway_ns: str, host_if: str) -> None:
    """The gateway's namespace name and this machine's end of its veth (and so its route); what is
    gone already is fine."""
    nsfs.remove(gateway_ns)
    with netlink.RtnlSocket() as sock:
        sock.run([netlink.delete_link(host_if)])  # gone already when its container went


def _raise(failures: list[Any], what: str) -> None:
    if failures:
        raise NodeRuntimeError(f"{what}: step {failures[0].position + 1}: {failures[0].describe()}")

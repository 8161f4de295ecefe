"""The swarm fabric, from the controller's machine: its Docker engine manages the swarm whose
overlay network joins the Docker hosts' nodes (``"engine": "swarm"`` in hosts.json).

At ``up`` (``SwarmFabric.up``):

1. the engine initialises a swarm (advertised, listening and data path at ``controller_ip``), or
   uses the one it manages already (hosts join it at its own address); a swarm it initialised
   carries the node label ``edgetb.swarm-init=<id>`` and is left at ``down`` (handed to another
   testbed whose overlay is still in it, which leaves it in turn); a swarm the user had is left
   as it was;
2. a fresh overlay ``etb-<id>-ov`` (attachable, internal: the nodes have no other interface; the
   MTU of hosts.json), made anew each ``up`` since a removed container's static address can stay
   allocated in an old one. Docker picks its own addresses (each host's load-balancer endpoint) from the top of the subnet
   only (``docker_range``), so that they never take a node's planned address;
3. the overlay's gateway: a container ``etb-<id>--gw`` below that range, with a
   veth ``etb-<id>--gh`` from this machine into it over a /30 of 169.254.0.0/16. This machine routes
   the overlay via it (from ``controller_ip``), so the controller reaches every node by its overlay
   address and the nodes reach the controller via the gateway: the control plane is never a
   shaped link (the controller is no node's peer: its packets take the unshaped default class);
4. every Docker host's agent gets the worker join token over its pinned HTTPS channel
   (``set_fabric``) and joins; a host that joined for the testbed carries the node label
   ``edgetb.joined-for=<id>`` (set as soon as it joined) and is removed from a swarm that stays.

``down`` is idempotent and tries every step; ``up`` starts by removing a gateway a dead run left.

Swarm's virtual IPs and ingress need IPVS, which the testbed does not assume: nothing here makes
a service or publishes a port, and a swarm the testbed makes has no ingress network, so that a
port published through it is refused (``edgetb swarm check`` warns where IPVS is absent).
"""
from __future__ import annotations

import hashlib
import ipaddress
import time
from typing import Any, Callable, Optional

from controller.model.hosts import VXLAN_OVERHEAD_BYTES, Hosts, docker_range, overlay_gateway
from worker.api.errors import ConfigError, NodeRuntimeError, TestbedError
from worker.nodes.docker_manager import LABEL as TESTBED_LABEL
from worker.nodes.docker_manager import (MANAGER_PORT, connect, has_gwbridge, link_gateway, node_image, remove_gwbridge,
                                         require_image, sdk, short_error, started, swarm_of, unlink_gateway)

INIT_LABEL = "edgetb.swarm-init"
JOINED_LABEL = "edgetb.joined-for"
GWBRIDGE_LABEL = "edgetb.gwbridge-made-by"
LINK_NET = ipaddress.IPv4Network("169.254.0.0/16")
METADATA = ipaddress.IPv4Network("169.254.169.252/30")  # holds 169.254.169.254, clouds' metadata service
READY_TIMEOUT_S = 60.0
Progress = Callable[[str], None]


def link_pair(testbed_id: str) -> tuple[str, str]:
    """This machine's and the gateway's ends of their /30 (from the testbed's id)."""
    k = int.from_bytes(hashlib.sha256(testbed_id.encode()).digest()[:2], "big") % (LINK_NET.num_addresses // 4 - 1)
    base = LINK_NET.network_address + 4 * (k + 1)
    if base == METADATA.network_address:  # never the cloud's metadata address
        base -= 4
    return str(base + 1), str(base + 2)


class SwarmFabric:
    """The swarm and overlay of one testbed, driven from the controller's machine."""

    def __init__(self, hosts: Hosts, testbed_id: str, controller_ip: str) -> None:
        self.hosts = hosts
        self.id = testbed_id
        self.controller_ip = controller_ip
        self.network = f"etb-{testbed_id}-ov"
        self.gateway = f"etb-{testbed_id}--gw"  # a node's name starts with a letter or digit: never this
        self.host_if = f"etb-{testbed_id}--gh"
        self.subnet = hosts.overlay_subnet
        self._api: Optional[Any] = None

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = connect()
        return self._api

    # bring-up ------------------------------------------------------------------------------
    def up(self, workers: dict[str, Any], routes: list[str], progress: Progress) -> None:
        """Swarm, overlay, gateway, then every Docker host joined (``workers`` by host name);
        ``routes``: networks besides the controller's address that nodes reach via the gateway."""
        self._remove_gateway()  # what a run that died may have left
        manager = self._ensure_swarm()
        self._fresh_overlay()
        self._start_gateway(routes)
        token = self.api.inspect_swarm()["JoinTokens"]["Worker"]
        body = {"version": 1, "manager": manager, "token": token, "network": self.network, "subnet": self.subnet,
                "mtu": self.hosts.overlay_mtu, "gateway": overlay_gateway(self.subnet),
                "routes": [f"{self.controller_ip}/32", *routes]}
        joined: dict[str, dict[str, Any]] = {}
        for name in self.hosts.swarm:  # one at a time: the manager takes joins in turn anyway
            host = self.hosts.hosts[name]
            advertise = self.controller_ip if host.local else host.ip or self.controller_ip
            joined[name] = workers[name].set_fabric({**body, "advertise_addr": advertise})
            if joined[name].get("joined"):  # labelled at once: down removes it even if a later join fails
                self._label(joined[name]["node_id"], JOINED_LABEL)
        self._wait_ready(joined)
        fresh = [n for n, j in joined.items() if j.get("joined")]
        progress(f"swarm fabric: {len(joined)} Docker hosts on overlay {self.network} ({self.subnet}, MTU "
                 f"{self.hosts.overlay_mtu})" + (f"; joined {', '.join(fresh)}" if fresh else ""))

    def _ensure_swarm(self) -> str:
        """The manager's address (``ip:port``) that hosts join: of the swarm this machine's engine
        manages already, else of one it makes now."""
        member = swarm_of(self.api.info())
        if member["state"] == "active":
            if not member["manager"]:
                raise ConfigError("this machine's Docker engine is a swarm worker; the controller's machine must be "
                                  "a manager of the swarm (or in none: it then makes one)")
            return f"{member['node_addr'] or self.controller_ip}:{MANAGER_PORT}"
        if member["state"] != "inactive":
            raise NodeRuntimeError(f"this machine's Docker engine is {member['state']} in a swarm; wait or leave it")
        bridge_before = has_gwbridge(self.api)
        try:
            self.api.init_swarm(advertise_addr=self.controller_ip, listen_addr=f"{self.controller_ip}:{MANAGER_PORT}",
                                data_path_addr=self.controller_ip)
        except sdk().errors.APIError as e:
            raise NodeRuntimeError(f"cannot make a swarm at {self.controller_ip}: {short_error(e)}") from None
        node_id = swarm_of(self.api.info())["node_id"]
        self._label(node_id, INIT_LABEL)
        if not bridge_before:
            self._label(node_id, GWBRIDGE_LABEL)
        self._remove_ingress()
        return f"{self.controller_ip}:{MANAGER_PORT}"

    def _remove_ingress(self) -> None:
        """Remove the routing mesh's network from a swarm this testbed made: it needs IPVS, nothing
        of the testbed uses it, and without it a port published through the ingress is refused by
        the engine itself ("ingress network not present"). Hosts then join without setting up its
        sandbox, and leave without waiting for its removal."""
        docker = sdk()
        for net in self.api.networks(filters={"name": "ingress"}):
            if net.get("Ingress") or net["Name"] == "ingress":
                try:
                    self.api.remove_network(net["Id"])
                except docker.errors.APIError as e:
                    raise NodeRuntimeError(f"cannot remove the swarm's ingress network: {short_error(e)}") from None

    def _label(self, node_id: str, key: str, value: Optional[str] = None) -> None:
        """Label the swarm node ``node_id`` with ``key`` = ``value`` (default: this testbed's id)."""
        node = self.api.inspect_node(node_id)
        spec = node["Spec"]
        spec["Labels"] = {**(spec.get("Labels") or {}), key: value or self.id}
        self.api.update_node(node_id, node["Version"]["Index"], spec)

    def _fresh_overlay(self) -> None:
        self._remove_overlay()
        docker = sdk()
        ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=self.subnet,
                                                                               iprange=str(docker_range(self.subnet)))])
        try:
            self.api.create_network(self.network, driver="overlay", attachable=True, internal=True, ipam=ipam,
                                    # the driver's option is the underlay's MTU: nodes get it less VXLAN's headers
                                    options={"com.docker.network.driver.mtu":
                                             str(self.hosts.overlay_mtu + VXLAN_OVERHEAD_BYTES)},
                                    labels={TESTBED_LABEL: self.id}, check_duplicate=True)
        except docker.errors.APIError as e:
            raise NodeRuntimeError(f"cannot make overlay {self.network} ({self.subnet}): {short_error(e)}") from None

    def _start_gateway(self, routes: list[str]) -> None:
        """The gateway container on the overlay, and this machine's veth into it."""
        docker = sdk()
        api = self.api
        require_image(api, node_image())
        host = api.create_host_config(network_mode=self.network, init=True, cap_drop=["ALL"], read_only=True,
                                      security_opt=["no-new-privileges"], mem_limit=64 * 1024 * 1024, pids_limit=16)
        networking = api.create_networking_config({self.network: api.create_endpoint_config(
            ipv4_address=overlay_gateway(self.subnet))})
        try:
            made = started(api, lambda: api.create_container(
                node_image(), command=["sleep", "infinity"], name=self.gateway,
                labels={TESTBED_LABEL: self.id}, host_config=host, networking_config=networking,
                user="65534:65534")["Id"])
            pid = api.inspect_container(made)["State"]["Pid"]
        except docker.errors.APIError as e:
            raise NodeRuntimeError(f"cannot start the overlay's gateway {self.gateway}: {short_error(e)}") from None
        near, far = link_pair(self.id)
        link_gateway(self.gateway_ns, pid, self.host_if, near, far, self.subnet, self.controller_ip, routes)

    @property
    def gateway_ns(self) -> str:
        return self.gateway  # etb-<id>--gw: a reset of the testbed removes etb-<id>-* names

    def _wait_ready(self, joined: dict[str, dict[str, Any]]) -> None:
        """Until every joined host's swarm node is ready."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = {j["node_id"]: name for name, j in joined.items()}
        while waiting:
            nodes = {node["ID"]: node for node in self.api.nodes()}
            strangers = [name for node_id, name in waiting.items() if node_id not in nodes]
            if strangers:
                raise ConfigError(f"the Docker engines of {', '.join(strangers)} are in another swarm than this "
                                  "machine's (an old one?): 'docker swarm leave --force' on them, then up again")
            for node_id in list(waiting):
                if nodes[node_id]["Status"]["State"] == "ready":
                    waiting.pop(node_id)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise NodeRuntimeError(f"swarm nodes of {', '.join(waiting.values())} not ready after "
                                       f"{READY_TIMEOUT_S:.0f} s: check 7946/tcp+udp between the hosts")
            time.sleep(0.5)

    # teardown -----------------------------------------------------------------------------
    def down(self) -> dict[str, Any]:
        """Remove the gateway, the overlay, the hosts that joined for the testbed and a swarm this
        testbed made; what is not there is fine (idempotent). Every step is tried; the first
        failure is raised at the end."""
        removed: dict[str, Any] = {"gateway": False, "overlay": False, "swarm_nodes": 0, "swarm_left": False}
        self._remove_link()  # needs no engine
        try:
            self.api  # noqa: B018 - connects, or says there is no engine
        except TestbedError:
            return removed  # no engine: nothing else of ours can be in it
        failed: list[str] = []
        for step, what in ((self._remove_gateway, "gateway"), (self._remove_overlay, "overlay"),
                           (self._leave, "swarm")):
            try:
                found = step()
                if what == "swarm":
                    removed.update(found)
                else:
                    removed[what] = found
            except TestbedError as e:
                failed.append(e.message)
            except sdk().errors.APIError as e:
                failed.append(f"{what}: {short_error(e)}")
        if failed:
            raise NodeRuntimeError(f"swarm fabric of testbed {self.id} not all removed: {'; '.join(failed)}",
                                   detail={"removed": removed})
        return removed

    def _remove_link(self) -> None:
        """The gateway's namespace name and this machine's end of its veth (and so its route)."""
        unlink_gateway(self.gateway_ns, self.host_if)

    def _remove_gateway(self) -> bool:
        self._remove_link()
        try:
            self.api.remove_container(self.gateway, force=True)
            return True
        except sdk().errors.NotFound:
            return False

    def _leave(self) -> dict[str, Any]:
        """Remove the hosts that joined for the testbed from the swarm; leave a swarm it made."""
        api = self.api
        left = {"swarm_nodes": 0, "swarm_left": False}
        member = swarm_of(api.info())
        if member["state"] != "active" or not member["manager"]:
            return left
        for node in api.nodes(filters={"node.label": f"{JOINED_LABEL}={self.id}"}):
            try:
                api.remove_node(node["ID"], force=True)
                left["swarm_nodes"] += 1
            except sdk().errors.APIError:
                pass  # still leaving: it goes with the swarm or at the next down
        me = api.inspect_node(member["node_id"])
        if (me["Spec"].get("Labels") or {}).get(INIT_LABEL) != self.id:
            return left
        others = sorted({n["Labels"][TESTBED_LABEL] for n in api.networks(filters={"driver": "overlay"})
                         if (n.get("Labels") or {}).get(TESTBED_LABEL, self.id) != self.id})
        if others:  # another testbed's overlay is in this swarm: the swarm goes with the last of them
            self._label(member["node_id"], INIT_LABEL, others[0])
            return left
        api.leave_swarm(force=True)
        left["swarm_left"] = True
        if (me["Spec"].get("Labels") or {}).get(GWBRIDGE_LABEL) == self.id:
            remove_gwbridge(api)  # the swarm's making made it
        return left

    def _remove_overlay(self, timeout_s: float = 20.0) -> bool:
        """Remove the overlay; the workers' attachments may hold it for a moment after their containers go."""
        docker = sdk()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.api.remove_network(self.network)
                return True
            except docker.errors.NotFound:
                return False
            except docker.errors.APIError as e:
                if time.monotonic() > deadline:
                    raise NodeRuntimeError(f"cannot remove overlay {self.network}: {short_error(e)}") from None
                time.sleep(0.5)

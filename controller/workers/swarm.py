"""The swarm fabric, from the controller's machine: its Docker engine manages the swarm whose
overlay network joins the Docker hosts' nodes (``"engine": "swarm"`` in hosts.json).

At ``up`` (``SwarmFabric.up``):

1. the engine initialises a swarm (advertised and data path at ``controller_ip``), or uses the one
   it manages already; a swarm it initialised carries the node label ``edgetb.swarm-init=<id>`` and
   is left at ``down``, a swarm the user had is left as it was;
2. a fresh overlay ``etb-<id>-ov`` (attachable, internal: the nodes have no other interface; the
   MTU of hosts.json), made anew each ``up`` since a removed container's static address can stay
   allocated in an old one;
   Docker picks its own addresses (each host's load-balancer endpoint) from the top of the subnet
   only (``docker_range``), so that they never take a node's planned address;
3. the overlay's gateway: a container ``etb-<id>-ovgw`` below that range, with a
   veth ``etb-<id>-ovh`` from this machine into it over a /30 of 169.254.0.0/16. This machine routes
   the overlay via it (from ``controller_ip``), so the controller reaches every node by its overlay
   address and the nodes reach the controller via the gateway: the control plane is never a
   shaped link (the controller is no node's peer: its packets take the unshaped default class);
4. every Docker host's agent gets the worker join token over its pinned HTTPS channel
   (``set_fabric``) and joins; a host that joined for the testbed carries the node label
   ``edgetb.joined-for=<id>`` and is removed from a swarm that stays at ``down``.

Swarm's virtual IPs and ingress need IPVS, which the testbed does not assume: nothing here
publishes a port or makes a service (``check_no_ingress``).
"""
from __future__ import annotations

import hashlib
import ipaddress
import time
from typing import Any, Callable, Optional

from controller.model.hosts import Hosts, docker_range, overlay_gateway
from worker.api.errors import ConfigError, NodeRuntimeError, TestbedError
from worker.kernel import nsfs
from worker.nodes import docker as runtime_docker
from worker.nodes.docker_exec import sdk, short_error
from worker.nodes.swarm import MANAGER_PORT, swarm_of

INIT_LABEL = "edgetb.swarm-init"
JOINED_LABEL = "edgetb.joined-for"
LINK_NET = ipaddress.IPv4Network("169.254.0.0/16")
READY_TIMEOUT_S = 60.0
Progress = Callable[[str], None]


def link_pair(testbed_id: str) -> tuple[str, str]:
    """This machine's and the gateway's ends of their /30 (from the testbed's id)."""
    k = int.from_bytes(hashlib.sha256(testbed_id.encode()).digest()[:2], "big") % (LINK_NET.num_addresses // 4 - 1)
    base = LINK_NET.network_address + 4 * (k + 1)
    return str(base + 1), str(base + 2)


def check_no_ingress(spec: dict[str, Any]) -> None:
    """Refuse a service spec that publishes a port through the ingress (it needs IPVS)."""
    ports = (spec.get("EndpointSpec") or {}).get("Ports") or []
    if any(p.get("PublishMode", "ingress") == "ingress" for p in ports):
        raise ConfigError("a published ingress port needs IPVS (Swarm's routing mesh), which the testbed does not "
                          "assume: reach nodes by their overlay addresses, or publish in 'host' mode")


class SwarmFabric:
    """The swarm and overlay of one testbed, driven from the controller's machine."""

    def __init__(self, hosts: Hosts, testbed_id: str, controller_ip: str) -> None:
        self.hosts = hosts
        self.id = testbed_id
        self.controller_ip = controller_ip
        self.network = f"etb-{testbed_id}-ov"
        self.gateway = f"etb-{testbed_id}-ovgw"
        self.host_if = f"etb-{testbed_id}-ovh"
        self.subnet = hosts.overlay_subnet
        self._api: Optional[Any] = None

    @property
    def api(self) -> Any:
        if self._api is None:
            self._api = runtime_docker.connect()
        return self._api

    # bring-up ------------------------------------------------------------------------------
    def up(self, workers: dict[str, Any], routes: list[str], progress: Progress) -> None:
        """Swarm, overlay, gateway, then every Docker host joined (``workers`` by host name);
        ``routes``: networks besides the controller's address that nodes reach via the gateway."""
        self._ensure_swarm()
        self._fresh_overlay()
        self._start_gateway(routes)
        token = self.api.inspect_swarm()["JoinTokens"]["Worker"]
        manager = f"{self.controller_ip}:{MANAGER_PORT}"
        body = {"version": 1, "manager": manager, "token": token, "network": self.network, "subnet": self.subnet,
                "mtu": self.hosts.overlay_mtu, "gateway": overlay_gateway(self.subnet),
                "routes": [f"{self.controller_ip}/32", *routes]}
        joined: dict[str, dict[str, Any]] = {}
        for name in self.hosts.swarm:  # one at a time: the manager takes joins in turn anyway
            host = self.hosts.hosts[name]
            advertise = self.controller_ip if host.local else host.ip or self.controller_ip
            joined[name] = workers[name].set_fabric({**body, "advertise_addr": advertise})
        self._wait_ready(joined)
        fresh = [n for n, j in joined.items() if j.get("joined")]
        progress(f"swarm fabric: {len(joined)} Docker hosts on overlay {self.network} ({self.subnet}, MTU "
                 f"{self.hosts.overlay_mtu})" + (f"; joined {', '.join(fresh)}" if fresh else ""))

    def _ensure_swarm(self) -> None:
        member = swarm_of(self.api.info())
        if member["state"] == "active":
            if not member["manager"]:
                raise ConfigError("this machine's Docker engine is a swarm worker; the controller's machine must be "
                                  "a manager of the swarm (or in none: it then makes one)")
            return
        if member["state"] != "inactive":
            raise NodeRuntimeError(f"this machine's Docker engine is {member['state']} in a swarm; wait or leave it")
        try:
            self.api.init_swarm(advertise_addr=self.controller_ip, listen_addr=f"0.0.0.0:{MANAGER_PORT}",
                                data_path_addr=self.controller_ip)
        except sdk().errors.APIError as e:
            raise NodeRuntimeError(f"cannot make a swarm at {self.controller_ip}: {short_error(e)}") from None
        self._label(swarm_of(self.api.info())["node_id"], INIT_LABEL)

    def _label(self, node_id: str, key: str) -> None:
        node = self.api.inspect_node(node_id)
        spec = node["Spec"]
        spec["Labels"] = {**(spec.get("Labels") or {}), key: self.id}
        self.api.update_node(node_id, node["Version"]["Index"], spec)

    def _fresh_overlay(self) -> None:
        self._remove_overlay()
        docker = sdk()
        ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=self.subnet,
                                                                               iprange=str(docker_range(self.subnet)))])
        try:
            self.api.create_network(self.network, driver="overlay", attachable=True, internal=True, ipam=ipam,
                                    options={"com.docker.network.driver.mtu": str(self.hosts.overlay_mtu)},
                                    labels={runtime_docker.LABEL: self.id}, check_duplicate=True)
        except docker.errors.APIError as e:
            raise NodeRuntimeError(f"cannot make overlay {self.network} ({self.subnet}): {short_error(e)}") from None

    def _start_gateway(self, routes: list[str]) -> None:
        """The gateway container on the overlay, and this machine's veth into it."""
        from pyroute2 import IPRoute, NetNS

        docker = sdk()
        api = self.api
        runtime_docker.require_image(api, runtime_docker.node_image())
        host = api.create_host_config(network_mode=self.network, init=True, cap_drop=["ALL"], read_only=True,
                                      security_opt=["no-new-privileges"], mem_limit=64 * 1024 * 1024, pids_limit=16)
        networking = api.create_networking_config({self.network: api.create_endpoint_config(
            ipv4_address=overlay_gateway(self.subnet))})
        try:
            made = api.create_container(runtime_docker.node_image(), command=["sleep", "infinity"], name=self.gateway,
                                        labels={runtime_docker.LABEL: self.id}, host_config=host,
                                        networking_config=networking, user="65534:65534")
            api.start(made["Id"])
            pid = api.inspect_container(made["Id"])["State"]["Pid"]
        except docker.errors.APIError as e:
            raise NodeRuntimeError(f"cannot start the overlay's gateway {self.gateway}: {short_error(e)}") from None
        nsfs.attach(self.gateway, pid)
        near, far = link_pair(self.id)
        with IPRoute() as ipr:
            ipr.link("add", ifname=self.host_if, kind="veth", peer={"ifname": "ctl0", "net_ns_fd": self.gateway_ns})
            index = ipr.link_lookup(ifname=self.host_if)[0]
            ipr.addr("add", index=index, address=near, prefixlen=30)
            ipr.link("set", index=index, state="up")
            net = ipaddress.IPv4Network(self.subnet)
            ipr.route("replace", dst=str(net.network_address), dst_len=net.prefixlen, gateway=far,
                      prefsrc=self.controller_ip)
        with NetNS(self.gateway_ns, flags=0) as ns:
            ctl = ns.link_lookup(ifname="ctl0")[0]
            ns.addr("add", index=ctl, address=far, prefixlen=30)
            ns.link("set", index=ctl, state="up")
            for dst in [f"{self.controller_ip}/32", *routes]:
                target = ipaddress.IPv4Network(dst)
                ns.route("replace", dst=str(target.network_address), dst_len=target.prefixlen, gateway=near)
        with nsfs.entered(self.gateway_ns):
            with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
                f.write("1\n")

    @property
    def gateway_ns(self) -> str:
        return self.gateway  # etb-<id>-ovgw: the testbed's namespaces are etb-<id>-*

    def _wait_ready(self, joined: dict[str, dict[str, Any]]) -> None:
        """Until every joined host's swarm node is ready (and labelled, when it joined for us)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = {j["node_id"]: name for name, j in joined.items()}
        for name, j in joined.items():
            if j.get("joined"):
                self._label(j["node_id"], JOINED_LABEL)
        while waiting:
            for node in self.api.nodes():
                if node["ID"] in waiting and node["Status"]["State"] == "ready":
                    waiting.pop(node["ID"])
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise NodeRuntimeError(f"swarm nodes of {', '.join(waiting.values())} not ready after "
                                       f"{READY_TIMEOUT_S:.0f} s: check 7946/tcp+udp between the hosts")
            time.sleep(0.5)

    # teardown -----------------------------------------------------------------------------
    def down(self) -> dict[str, Any]:
        """Remove the gateway, the overlay, the hosts that joined for the testbed and a swarm this
        testbed made; what is not there is fine (idempotent)."""
        docker = sdk()
        removed: dict[str, Any] = {"gateway": False, "overlay": False, "swarm_nodes": 0, "swarm_left": False}
        try:
            api = self.api
        except TestbedError:
            return removed  # no engine: nothing of ours can be in it
        nsfs.remove(self.gateway_ns)
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=self.host_if):
                ipr.link("del", index=index)
        try:
            api.remove_container(self.gateway, force=True)
            removed["gateway"] = True
        except docker.errors.NotFound:
            pass
        removed["overlay"] = self._remove_overlay()
        member = swarm_of(api.info())
        if member["state"] != "active" or not member["manager"]:
            return removed
        for node in api.nodes(filters={"node.label": f"{JOINED_LABEL}={self.id}"}):
            try:
                api.remove_node(node["ID"], force=True)
                removed["swarm_nodes"] += 1
            except docker.errors.APIError:
                pass  # still leaving: it goes with the swarm or at the next down
        me = api.inspect_node(member["node_id"])
        if (me["Spec"].get("Labels") or {}).get(INIT_LABEL) == self.id:
            api.leave_swarm(force=True)
            removed["swarm_left"] = True
        return removed

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

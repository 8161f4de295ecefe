"""Where nodes run: the worker hosts of a multi-host experiment (pure model, no I/O but reading).

hosts.json lists the worker hosts; a node's ``host`` (nodes file) names one::

    {"version": 1,
     "controller_ip": "10.254.0.1",
     "hosts": [
       {"name": "local", "runtime": "docker"},
       {"name": "e1", "agent": "https://10.254.0.2:3334", "runtime": "netns",
        "tls_fingerprint": "9E:DF:...:32:C6"},
       {"name": "pi1", "agent": "https://10.254.0.3:3334", "runtime": "physical",
        "tls_fingerprint": "41:0B:...:7A:11", "nfs": "10.254.0.1:/srv/edgetb"}]}

- A host without ``agent`` is driven in-process on the controller's machine; an agent at a
  loopback address (``http://127.0.0.1:3334``, as docker-compose.yml runs one) shares the
  controller's network stack too. One such local host at most.
- ``runtime``: ``netns`` or ``docker`` for an emulator host, ``physical`` for a device that
  runs its one node itself (the node's ``ip`` is the device's).
- ``ip``: the host's LAN address, which other hosts route its nodes' subnet via (default:
  the agent URL's address; the controller's for a local host).
- ``controller_ip``: how nodes and agents reach the controller (default: the address the
  controller's machine uses towards the first remote agent; with only a local agent, its
  node subnet's gateway).
- ``nfs``: an export holding the experiment directory, mounted by the agent instead of
  fetching dml_app/ and dataset/ over HTTP.
- ``token_file``: the agent's own token, in a file of mode 0600 (a file others may read is
  refused, and so are two agents with one token). Without it: for the only agent,
  ``$EDGETB_TOKEN``, else this machine's agent token file; for a loopback agent, that file.
- ``tls_fingerprint``: the SHA-256 fingerprint of the agent's TLS certificate (``python3 -m
  worker.agent --print-fingerprint`` on that host; 64 hex digits, colons allowed), pinned;
  required for an ``https://`` agent on another machine (a plain ``http://`` agent is accepted
  on loopback only). ``Host.tls_fingerprint`` holds it as 64 lower-case hex digits.

Fabric (``engine``): ``routed`` (the default) routes between the hosts' node subnets as above;
``swarm`` puts the Docker hosts' nodes on one Docker Swarm overlay network instead
(``controller.workers.swarm``): ``overlay_subnet`` (default ``10.80.0.0/20``) holds every Docker
node's address, ``overlay_mtu`` (default 1450) is its MTU. netns and physical hosts stay routed.

The file is strict (``HOSTS_SCHEMA``, ``HOST_SCHEMA``): an unknown field is refused with the
nearest valid name, as are wrong types.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from controller.model.topology import Topology, read_topology_json, valid_name
from worker.api.errors import TopologyError
from worker.api.peers import is_loopback_host, normalize_fingerprint
from worker.api.schema import Field, Place, Schema, describe

RUNTIMES = ("netns", "docker", "physical")
ENGINES = ("routed", "swarm")
ENCRYPTED_REFUSAL = ("encrypted overlays are refused: IPsec needs xfrm/ESP in every host's kernel, and the links would "
                     "be shaped on ciphertext whose overhead distorts the rates")
DEFAULT_OVERLAY_SUBNET = "10.80.0.0/20"
DEFAULT_OVERLAY_MTU = 1450
VXLAN_OVERHEAD_BYTES = 50  # outer Ethernet, IPv4, UDP and VXLAN headers: the underlay's MTU is the overlay's + this
MIN_OVERLAY_MTU, MAX_OVERLAY_MTU = 1280, 8950  # IPv6's minimum; a 9000-byte underlay less VXLAN's 50
LOCAL = "local"
NFS_RE = re.compile(r"^[A-Za-z0-9.-]+:/[A-Za-z0-9._/-]*$")
FINGERPRINT_RE = re.compile(r"[0-9A-Fa-f]{64}|[0-9A-Fa-f]{2}(?::[0-9A-Fa-f]{2}){31}")
HOST_SCHEMA = Schema({
    "name": Field(str, "1-15 letters, digits, '_' or '-'", required=True),
    "agent": Field(str, "agent URL, e.g. 'http://10.254.0.2:3334'", max_len=256),
    "runtime": Field(str, "what the host's nodes are: network namespaces, Docker containers, or the "
                          "physical device itself", default="netns", choices=RUNTIMES),
    "ip": Field(str, "the host's LAN IPv4 address", max_len=15),
    "nfs": Field(str, "export holding the experiment, e.g. '10.254.0.1:/srv/edgetb'", max_len=512),
    "token_file": Field(str, "path of the agent's token", max_len=4096),
    "tls_fingerprint": Field(str, "SHA-256 of the agent's certificate", pattern=FINGERPRINT_RE,
                             hint="a SHA-256 fingerprint: 64 hex digits, colons allowed")})
HOST_FIELDS = tuple(HOST_SCHEMA.fields)
HOSTS_SCHEMA = Schema({"version": Field(int, "the file format's version", default=1, choices=(1,)),
                       "hosts": Field(list, "the worker hosts", required=True, min_items=1, max_items=4096),
                       "controller_ip": Field(str, "how nodes and agents reach the controller", max_len=15),
                       "engine": Field(str, "how the hosts' nodes reach each other", default="routed",
                                       choices=ENGINES),
                       "overlay_subnet": Field(str, "the swarm overlay's subnet, e.g. '10.80.0.0/20'", max_len=18),
                       "overlay_mtu": Field(int, "the swarm overlay's MTU in bytes", low=MIN_OVERLAY_MTU,
                                            high=MAX_OVERLAY_MTU),
                       "overlay_encrypted": Field(bool, "IPsec on the overlay: refused", default=False)})


@dataclass(frozen=True)
class Host:
    """One worker host; ``agent`` None means in-process on the controller's machine."""

    name: str
    runtime: str = "netns"
    agent: Optional[str] = None
    ip: Optional[str] = None
    nfs: Optional[str] = None
    token_file: Optional[str] = None
    tls_fingerprint: Optional[str] = None  # 64 lower-case hex digits, no colons

    @property
    def emulator(self) -> bool:
        return self.runtime != "physical"

    @property
    def local(self) -> bool:
        """Whether the host shares the controller's network stack (in-process or a loopback agent)."""
        return self.agent is None or is_loopback_host(urlsplit(self.agent).hostname or "")


@dataclass
class Hosts:
    hosts: dict[str, Host]
    controller_ip: Optional[str] = None
    engine: str = "routed"
    overlay_subnet: str = DEFAULT_OVERLAY_SUBNET
    overlay_mtu: int = DEFAULT_OVERLAY_MTU
    overlay_encrypted: bool = False  # refused at up (ENCRYPTED_REFUSAL); read so that a check can say so

    @property
    def swarm(self) -> list[str]:
        """The hosts whose nodes share the swarm overlay (none in routed mode)."""
        return [h.name for h in self.hosts.values() if self.engine == "swarm" and h.runtime == "docker"]

    @classmethod
    def single(cls, runtime: str = "netns", topology: Optional[Topology] = None) -> "Hosts":
        """The single-host default: one in-process host, named as the topology's emulated nodes
        name their host when they all name the same one (else ``local``)."""
        names = {n.host for n in topology.nodes.values() if n.kind == "emulated"} if topology else set()
        name = names.pop() if len(names) == 1 else LOCAL
        return cls({name: Host(name, runtime)})


def _ipv4(value: Any, where: str) -> str:
    try:
        if not isinstance(value, str):
            raise ValueError
        return str(ipaddress.IPv4Address(value))
    except ValueError:
        raise TopologyError(f"{where}: {value!r} is not an IPv4 address such as '10.254.0.2'") from None


def load_hosts(path: str) -> Hosts:
    """The hosts declared in ``path`` (format in the module docstring)."""
    data = read_topology_json(path)
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: expected an object like {{\"hosts\": [{{\"name\": \"local\"}}]}}, "
                            f"got {describe(data)}")
    HOSTS_SCHEMA.validate(data, path, TopologyError)
    controller_ip = _ipv4(data["controller_ip"], f"{path}, field 'controller_ip'") if "controller_ip" in data else None
    hosts: dict[str, Host] = {}
    for i, entry in enumerate(data["hosts"]):
        label = f"hosts[{i}]" + (f" ({entry['name']})" if isinstance(entry, dict) and
                                 isinstance(entry.get("name"), str) else "")
        where = f"{path}: {label}"
        HOST_SCHEMA.validate(entry, Place(path, (label,)), TopologyError)
        name = entry["name"]
        if not valid_name(name):
            raise TopologyError(f"{where}, field 'name': {name!r} is not a valid host name (1-15 letters, digits, "
                                "'_' or '-')")
        if name in hosts:
            raise TopologyError(f"{where}: host {name!r} is declared twice")
        where = f"{path}: host {name!r}"
        runtime = entry.get("runtime", "netns")
        if runtime not in RUNTIMES:
            raise TopologyError(f"{where}, field 'runtime': {runtime!r} is not one of {', '.join(RUNTIMES)}")
        agent, ip = entry.get("agent"), entry.get("ip")
        if agent is not None:
            parts = urlsplit(agent) if isinstance(agent, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise TopologyError(f"{where}, field 'agent': {agent!r} is not an agent URL such as "
                                    "'http://10.254.0.2:3334'")
            if ip is None and not is_loopback_host(parts.hostname):
                try:
                    ip = str(ipaddress.IPv4Address(parts.hostname))
                except ValueError:
                    raise TopologyError(f"{where}, field 'ip': the agent is named {parts.hostname!r}, so give the "
                                        "host's LAN address in 'ip'") from None
        elif runtime == "physical":
            raise TopologyError(f"{where}, field 'agent': a physical device runs its own agent; give its URL")
        if ip is not None:
            ip = _ipv4(ip, f"{where}, field 'ip'")
        nfs = entry.get("nfs")
        if nfs is not None and (agent is None or not isinstance(nfs, str) or not NFS_RE.fullmatch(nfs)):
            raise TopologyError(f"{where}, field 'nfs': {nfs!r} must be an export such as '10.254.0.1:/srv/edgetb', "
                                "on a host with an agent")
        token_file = entry.get("token_file")
        fingerprint = entry.get("tls_fingerprint")
        if fingerprint is not None:
            fingerprint = normalize_fingerprint(fingerprint, f"{where}, field 'tls_fingerprint'")
        host = Host(name, runtime, agent, ip, nfs, token_file, fingerprint)
        if host.local and any(h.local for h in hosts.values()):
            raise TopologyError(f"{where}, field 'agent': only one host can share the controller's machine (no "
                                "'agent', or an agent at a loopback address)")
        hosts[name] = host
    engine = data.get("engine", "routed")
    overlay = _overlay_subnet(data.get("overlay_subnet", DEFAULT_OVERLAY_SUBNET), f"{path}, field 'overlay_subnet'")
    found = Hosts(hosts, controller_ip, engine, overlay, data.get("overlay_mtu", DEFAULT_OVERLAY_MTU),
                  bool(data.get("overlay_encrypted", False)))
    if engine == "swarm":
        if not found.swarm:
            raise TopologyError(f"{path}, field 'engine': 'swarm' joins Docker hosts, and no host has runtime 'docker'")
        for name, ip in [("controller_ip", controller_ip)] + [(f"host {h.name!r}, field 'ip'", h.ip)
                                                             for h in hosts.values()]:
            if ip and ipaddress.IPv4Address(ip) in ipaddress.IPv4Network(overlay):
                raise TopologyError(f"{path}: overlay_subnet {overlay} holds {name} {ip}; choose a subnet no host "
                                    "address is in")
    elif any(k in data for k in ("overlay_subnet", "overlay_mtu", "overlay_encrypted")):
        raise TopologyError(f"{path}: the 'overlay_*' fields are for \"engine\": \"swarm\"")
    return found


def _overlay_subnet(value: Any, where: str) -> str:
    """An overlay subnet: an IPv4 network of /8 to /28."""
    try:
        net = ipaddress.IPv4Network(value)
    except (ValueError, TypeError):
        raise TopologyError(f"{where}: {value!r} is not an IPv4 network such as '10.80.0.0/20'") from None
    if not 8 <= net.prefixlen <= 28:
        raise TopologyError(f"{where}: {net} must be a /8 to /28 network")
    special = next((kind for kind in ("loopback", "link_local", "multicast", "reserved", "unspecified")
                    if getattr(net, f"is_{kind}")), None)
    if special:
        raise TopologyError(f"{where}: {net} is a {special.replace('_', '-')} network, not one for nodes")
    return str(net)


def docker_range(subnet: str) -> ipaddress.IPv4Network:
    """The top of an overlay subnet, where Docker allocates the addresses it picks itself (each
    host's load-balancer endpoint): a /26, or the last quarter of a smaller subnet."""
    net = ipaddress.IPv4Network(subnet)
    return list(net.subnets(new_prefix=max(net.prefixlen + 2, 26)))[-1]


def overlay_gateway(subnet: str) -> str:
    """The testbed's gateway on the overlay: the address below Docker's range."""
    return str(docker_range(subnet).network_address - 1)


def overlay_capacity(subnet: str) -> int:
    """How many nodes an overlay subnet holds: from its third address (Docker holds the
    second) up to the gateway's."""
    net = ipaddress.IPv4Network(subnet)
    return int(ipaddress.IPv4Address(overlay_gateway(subnet))) - int(net.network_address) - 2


def node_addresses(names: list[str], subnet: str) -> dict[str, str]:
    """The overlay address of each swarm node, in order: from the subnet's third address
    (Docker holds the second) up to the gateway's (``overlay_gateway``)."""
    net = ipaddress.IPv4Network(subnet)
    if len(names) > overlay_capacity(subnet):
        raise TopologyError(f"overlay_subnet {net} holds {overlay_capacity(subnet)} nodes, not {len(names)}: "
                            "choose a larger one")
    return {name: str(net.network_address + 2 + i) for i, name in enumerate(names)}

def check_placement(topology: Topology, hosts: Hosts, source: str = "hosts") -> dict[str, str]:
    """Node -> host name; every node's host exists and has the runtime its kind needs."""
    placement: dict[str, str] = {}
    per_host: dict[str, list[str]] = {}
    for node in topology.nodes.values():
        host = hosts.hosts.get(node.host)
        if host is None:
            raise TopologyError(f"node {node.name!r}, field 'host': unknown host {node.host!r}; "
                                f"{source} declares {', '.join(hosts.hosts)}")
        if (node.kind == "physical") != (host.runtime == "physical"):
            want = "a physical host (runtime 'physical')" if node.kind == "physical" else "an emulator host"
            raise TopologyError(f"node {node.name!r}: {node.kind} nodes need {want}; host {host.name!r} "
                                f"of {source} runs {host.runtime} nodes")
        placement[node.name] = host.name
        per_host.setdefault(host.name, []).append(node.name)
    for name, nodes in per_host.items():
        if hosts.hosts[name].runtime == "physical" and len(nodes) > 1:
            raise TopologyError(f"host {name!r} is one physical device: it runs one node, not {', '.join(nodes)}")
    return placement


def plan_routes(subnets: dict[str, str], lan_ips: dict[str, str], controller_ip: str,
                controller_host: Optional[str]) -> dict[Optional[str], dict[str, Any]]:
    """The set-routes request of every network stack: each host's (and the controller's, key
    None unless a host shares it) routes to the other hosts' node subnets, and its peers."""
    stacks: dict[Optional[str], str] = {name: ip for name, ip in lan_ips.items()}
    if controller_host is None:
        stacks[None] = controller_ip
    everyone = sorted({f"{ip}/32" for ip in stacks.values()} | {f"{controller_ip}/32"} | set(subnets.values()))
    requests: dict[Optional[str], dict[str, Any]] = {}
    for stack, ip in stacks.items():
        routes = [{"subnet": subnets[h], "via": lan_ips[h]} for h in sorted(subnets) if h != stack]
        own = {f"{ip}/32", subnets.get(stack or "")}
        requests[stack] = {"version": 1, "routes": routes, "peers": [p for p in everyone if p not in own]}
    return requests


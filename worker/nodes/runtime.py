"""What every node runtime is, and the vocabulary they share.

``Runtime`` is the interface the parts of a host hold a runtime by (``worker.host``,
``worker.shaping.links``, ``worker.nodes.processes``, ``worker.observe.sampling``,
``worker.faults``); ``worker.nodes.netns.NetnsRuntime``, ``worker.nodes.docker.DockerRuntime``
(with its swarm fabric, ``worker.nodes.docker_swarm``) and ``worker.nodes.physical.PhysicalRuntime``
implement it. Shared by the three: what a caller asks for (``NodeSpec``), the names of a
testbed's resources (``Naming``), and the checks of a creation against the state (``new_specs``,
``claim_runtime``: one testbed holds one kind of node).
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from worker.api.errors import ConfigError, NodeRuntimeError
from worker.api.protocol import MAX_PIDS_MAX, MIN_PIDS_MAX
from worker.api.schema import IPV4_ADDRESS, Field, Schema
from worker.confinement.cgroups import Cgroups
from worker.confinement.uids import Identity
from worker.kernel import netlink as nl

TESTBED_ID_RE = re.compile(r"[a-z0-9]{1,5}")
NODE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,14}")
MAX_NODES = 60_000
MIN_GSO_BYTES, MAX_GSO_BYTES = 1280, 65_536  # an IPv6-sized frame at least; the kernel's default (without BIG TCP)


def parse_subnet(subnet: str) -> ipaddress.IPv4Network:
    """A node subnet: an IPv4 network with room for the bridge and nodes."""
    try:
        network = ipaddress.IPv4Network(subnet)
    except ValueError as e:
        raise ConfigError(f"subnet {subnet!r}: {e}") from None
    if network.num_addresses < 4:
        raise ConfigError(f"subnet {subnet} is too small")
    return network


class Naming:
    """Names of every resource of one testbed."""

    def __init__(self, testbed_id: str) -> None:
        if not isinstance(testbed_id, str) or not TESTBED_ID_RE.fullmatch(testbed_id):
            raise ConfigError(f"testbed id {testbed_id!r} must be 1-5 lowercase letters or digits")
        self.id = testbed_id
        self.bridge = f"etb-{testbed_id}-br"
        self.cgroup = f"edgetb-{testbed_id}"
        self.iptables_comment = f"edgetb-{testbed_id}"
        self._link_re = re.compile(rf"etb-{testbed_id}-(br|\d+)")

    def netns(self, node: str) -> str:
        return f"etb-{self.id}-{node}"

    def host_if(self, index: int) -> str:
        return f"etb-{self.id}-{index}"

    def owns_link(self, ifname: str) -> bool:
        return bool(self._link_re.fullmatch(ifname))

    def owns_netns(self, name: str) -> bool:
        return name.startswith(f"etb-{self.id}-")


@dataclass(frozen=True)
class NodeSpec:
    """What a caller asks for: a name and optional limits (``ip`` only for a physical device);
    memory and pids None: ``worker.confinement.confine``'s defaults."""

    name: str
    cpu: Optional[float] = None
    mem_bytes: Optional[int] = None
    ip: Optional[str] = None
    pids_max: Optional[int] = None
    python: Optional[str] = None  # a virtual environment (``worker.confinement.node_python``)
    gso_max_bytes: Optional[int] = None  # the largest packet its stack hands its interface (None: the kernel's)

    @classmethod
    def from_dict(cls, data: Any, place: Optional[str] = None) -> "NodeSpec":
        """A node of a request (``place``: where it sits, e.g. ``nodes[3]``); anything malformed
        is a ConfigError naming the node and the field."""
        name = data.get("name") if isinstance(data, dict) else None
        return cls(**NODE_SPEC_SCHEMA.validate(data, _node_place(place, name)))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check(self) -> None:
        """A spec made in code checked as a request's would be."""
        NODE_SPEC_SCHEMA.validate(self.to_dict(), _node_place(None, self.name))


NODE_SPEC_SCHEMA = Schema({
    "name": Field(str, "the node's name", required=True, pattern=NODE_NAME_RE,
                  hint=f"a node name ({NODE_NAME_RE.pattern})"),
    "cpu": Field(float, "CPU cores", nullable=True, low=0, low_open=True, high=1024),
    "mem_bytes": Field(int, "memory limit in bytes", nullable=True, low=4 * 1024 * 1024),
    "ip": replace(IPV4_ADDRESS, nullable=True, doc="a physical device's address"),
    "pids_max": Field(int, "most processes", nullable=True, low=MIN_PIDS_MAX, high=MAX_PIDS_MAX),
    "python": Field(str, "a virtual environment's path: its bin/ first on PATH, shown to the node", nullable=True,
                    max_len=1024),
    "gso_max_bytes": Field(int, "the largest packet the node's stack hands its interface (gso_max_size; a "
                           "recorded trace's replay wants one frame)", nullable=True, low=MIN_GSO_BYTES, high=MAX_GSO_BYTES)})


def _node_place(place: Optional[str], name: Any) -> str:
    """``node 'a'``, or ``nodes[3] (a)`` for a node of a request's list."""
    if not isinstance(name, str):
        return place or "node"
    return f"{place} ({name[:20]})" if place else f"node {name[:20]!r}"


def emulated_only(specs: Sequence[NodeSpec], kind: str) -> None:
    """Emulated nodes get their address from the host's subnet: an ``ip`` is for physical devices."""
    for spec in specs:
        spec.check()
        if spec.ip is not None:
            raise ConfigError(f"node {spec.name}: a {kind} node gets its address from the subnet; "
                              "an 'ip' is for physical nodes")


def new_specs(state: dict[str, Any], specs: Sequence[NodeSpec]) -> list[NodeSpec]:
    """The specs not yet in ``state``; a listed-twice name or changed limits are errors."""
    todo, seen = [], set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"node {spec.name!r} is listed twice")
        seen.add(spec.name)
        old = state["nodes"].get(spec.name)
        if old is None:
            todo.append(spec)
        elif (old["cpu"], old["mem_bytes"], old.get("pids_max")) != (spec.cpu, spec.mem_bytes, spec.pids_max):
            raise ConfigError(f"node {spec.name!r} exists with cpu={old['cpu']} mem_bytes={old['mem_bytes']} "
                              f"pids_max={old.get('pids_max')}; reset before changing its limits")
        elif old.get("gso_max_bytes") != spec.gso_max_bytes:
            raise ConfigError(f"node {spec.name!r} exists with gso_max_bytes {old.get('gso_max_bytes')}, not "
                              f"{spec.gso_max_bytes}; reset before changing it")
        elif old.get("python") != spec.python:
            raise ConfigError(f"node {spec.name!r} exists with python {old.get('python')!r}, not "
                              f"{spec.python!r}; reset before changing it")
    if len(state["nodes"]) + len(todo) > MAX_NODES:
        raise ConfigError(f"at most {MAX_NODES} nodes per testbed")
    return todo


def set_gso_max(netns: str, ifname: str, size_bytes: int) -> None:
    """The largest packet the stack of ``netns`` hands ``ifname`` (``ip link set ... gso_max_size``)."""
    index = nl.ifindex(netns, ifname)
    if index is None:
        raise NodeRuntimeError(f"no interface {ifname!r} in {netns} to set gso_max_size on")
    with nl.RtnlSocket(netns) as sock:
        failures = sock.run([nl.gso_max_size(index, size_bytes)])
    if failures:
        raise NodeRuntimeError(f"gso_max_size {size_bytes} on {ifname} in {netns}: {failures[0].text}")


def worker_dirs(store: Any) -> tuple[str, ...]:
    """The worker's own directories on this host (state, run records), which no node sees."""
    from worker.state import host_run_dir, state_root

    return (state_root(), os.path.dirname(store.dir), host_run_dir())


def check_pythons(specs: Sequence[NodeSpec], store: Any, ident_of: Optional[Any] = None) -> None:
    """Every declared Python of ``specs`` checked on this host (``worker.confinement.node_python``),
    before anything is made; ``ident_of(spec)``: the node's identity when it is known already."""
    from worker.confinement import node_python

    for spec in specs:
        if spec.python is not None:
            node_python.resolve(spec.python, spec.name, ident_of(spec) if ident_of else None, worker_dirs(store))


def claim_runtime(state: dict[str, Any], kind: str, testbed_id: str) -> None:
    """Record that the testbed's nodes are of ``kind``; one testbed holds one kind of node."""
    if state["nodes"] and state.get("runtime", "netns") != kind:
        raise ConfigError(f"testbed {testbed_id} already has {state.get('runtime', 'netns')} nodes; "
                          f"take it down first, or use another testbed id for {kind} nodes")
    state["runtime"] = kind


@runtime_checkable
class Runtime(Protocol):
    """A testbed's nodes of one kind on this host: made, found, run in and removed."""

    kind: str  # "netns", "docker" or "physical": recorded with each node and in the state
    subnet: Optional[ipaddress.IPv4Network]  # the nodes' addresses; None on a physical device (its own)
    cgroups: Optional[Cgroups]  # the nodes' groups where the runtime keeps them (netns), else None:
    #                             the engine's (docker) or none (physical)

    def create_nodes(self, specs: Sequence[NodeSpec]) -> list[dict[str, Any]]:
        """Create every node in ``specs`` (all or nothing; existing identical ones are kept): their records."""
        ...

    def node(self, name: str) -> dict[str, Any]:
        """The node's record (NotFound naming the node and the testbed)."""
        ...

    def identity(self, name: str) -> Identity:
        """The unprivileged uid and gid the node's processes run as."""
        ...

    def popen(self, name: str, argv: Sequence[str], **kwargs: Any) -> Any:
        """Start ``argv`` in the node (no shell): a ``subprocess.Popen`` or one with its interface.
        netns and physical nodes take a ``view`` (``worker.confinement.fsview.View``: as the node's
        uid, confined) or none (as root: the operator's ``edgetb exec``); a container's process
        runs as the container's user."""
        ...

    def set_neighbours(self, peers: dict[str, list[str]]) -> int:
        """Permanent neighbour entries between each listed node and the given peer addresses, where
        the runtime programs them (netns); how many were programmed (0 elsewhere)."""
        ...

    def reset(self) -> dict[str, int]:
        """Remove everything of this testbed's nodes on this host: ``{"nodes": how many}``."""
        ...


@runtime_checkable
class ForkableRuntime(Runtime, Protocol):
    """A runtime whose nodes are a network namespace and cgroups of this host, into which the
    host's node zygote forks node processes (``worker.confinement.zygote``): netns."""

    def identity(self, name: str, rec: Optional[dict[str, Any]] = None) -> Identity:
        """The node's uid and gid (``rec``: its record, when the caller has read it)."""
        ...

    def netns_path(self, rec: dict[str, Any]) -> str:
        """The node's network namespace file."""
        ...

    def procs_files(self, rec: dict[str, Any]) -> list[str]:
        """The cgroup.procs files a process of the node joins."""
        ...

    def rlimits(self, rec: dict[str, Any]) -> list[tuple[int, int, int]]:
        """The rlimits of the node's processes."""
        ...

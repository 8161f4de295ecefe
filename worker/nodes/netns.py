"""Emulated nodes as network namespaces on one bridge, with cgroup limits.

Each node is a namespace ``etb-<id>-<node>`` holding ``eth0`` (the end of a veth
whose host end ``etb-<id>-<index>`` sits on the bridge ``etb-<id>-br``) and an
address from the testbed's subnet, with a default route via the bridge, which
holds the subnet's first address: the host reaches every node, and nodes reach
other hosts' subnets through the host's routes. Every name carries the testbed
id, and reset removes exactly what carries it.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
from typing import Any, Callable, Optional, Sequence

from worker.api.errors import ConfigError, NodeRuntimeError, NotFound
from worker.api.protocol import DEFAULT_SUBNET, NODE_IFNAME, node_address
from worker.confinement import cgroups, confine, fsview, privilege, uids
from worker.kernel import netlink as nl, nsfs
from worker.nodes import netns_neighbours as neighbours
from worker.nodes.runtime import (Naming, NodeSpec, check_pythons, claim_runtime, emulated_only, new_specs,
                                  parse_subnet)
from worker.state import StateStore

NODE_IFINDEX = 2


class NetnsRuntime:
    """Creates, runs commands in, and removes the netns nodes of one testbed (a ``ForkableRuntime``)."""

    kind = "netns"

    def __init__(self, store: StateStore, subnet: str = DEFAULT_SUBNET) -> None:
        self.store = store
        self.names = Naming(store.testbed_id)
        self.subnet = parse_subnet(subnet)
        self.cgroups = cgroups.Cgroups(self.names.cgroup)
        self._uid_base: Optional[int] = None

    # addresses -------------------------------------------------------------
    @property
    def bridge_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def node_ip(self, index: int) -> str:
        return node_address(self.subnet, index)

    # bring-up ----------------------------------------------------------------
    def create_nodes(self, specs: Sequence[NodeSpec]) -> list[dict[str, Any]]:
        """Create every node in ``specs`` (all or nothing); existing identical nodes are kept."""
        emulated_only(specs, self.kind)
        with self.store.locked() as state:
            claim_runtime(state, self.kind, self.names.id)
            state.setdefault("subnet", str(self.subnet))
            if state["subnet"] != str(self.subnet):
                raise ConfigError(f"testbed {self.names.id} already uses subnet {state['subnet']}, not {self.subnet}")
            todo = self._new_specs(state, specs)
            check_pythons(todo, self.store)
            if todo and any(s.cpu or s.mem_bytes or s.pids_max for s in todo):
                self.cgroups.require()
            created: list[str] = []
            try:
                self._ensure_bridge(state)
                next_index = max((n["index"] for n in state["nodes"].values()), default=-1) + 1
                records = []
                for i, spec in enumerate(todo):
                    records.append({"name": spec.name, "index": next_index + i, "ip": self.node_ip(next_index + i),
                                    "prefixlen": self.subnet.prefixlen, "netns": self.names.netns(spec.name),
                                    "ifname": NODE_IFNAME, "host_if": self.names.host_if(next_index + i), "cpu": spec.cpu,
                                    "mem_bytes": spec.mem_bytes, "pids_max": spec.pids_max, "runtime": self.kind}
                                   | ({"python": spec.python} if spec.python else {})
                                   | ({"gso_max_bytes": spec.gso_max_bytes} if spec.gso_max_bytes else {}))
                self._create_records(records, created)
                for rec in records:
                    state["nodes"][rec["name"]] = rec
            except BaseException:
                for name in created:
                    self._remove_node_resources(name)
                if not state["nodes"]:
                    self._remove_shared(state)
                raise
            return [state["nodes"][s.name] for s in specs]

    def _new_specs(self, state: dict[str, Any], specs: Sequence[NodeSpec]) -> list[NodeSpec]:
        return new_specs(state, specs)

    def _ensure_bridge(self, state: dict[str, Any]) -> None:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            if not ipr.link_lookup(ifname=self.names.bridge):
                self._check_subnet_free(ipr)
                # a MAC address of its own: else the bridge takes its lowest port's, which changes
                # as ports come and go, and the nodes' permanent entries for it would go stale
                ipr.link("add", ifname=self.names.bridge, kind="bridge", address=neighbours.node_mac(self.bridge_ip))
                index = ipr.link_lookup(ifname=self.names.bridge)[0]
                ipr.addr("add", index=index, address=self.bridge_ip, prefixlen=self.subnet.prefixlen)
                ipr.link("set", index=index, state="up")
        state["bridge"] = self.names.bridge
        if shutil.which("iptables") and not state.get("iptables"):
            rule = self._iptables_rule()
            if subprocess.run(["iptables", "-w", "-C", *rule], capture_output=True).returncode != 0:
                done = subprocess.run(["iptables", "-w", "-I", *rule[:1], "1", *rule[1:]], capture_output=True, text=True)
                if done.returncode != 0:
                    raise NodeRuntimeError(f"iptables could not accept traffic on {self.names.bridge}: {done.stderr.strip()}")
            state["iptables"] = True

    def _check_subnet_free(self, ipr: Any) -> None:
        for msg in ipr.get_addr(family=2):
            addr = ipaddress.IPv4Interface(f"{msg.get_attr('IFA_ADDRESS')}/{msg['prefixlen']}")
            if addr.network.overlaps(self.subnet):
                label = msg.get_attr("IFA_LABEL")
                raise ConfigError(f"subnet {self.subnet} overlaps {addr} on {label}; choose another subnet")

    def _iptables_rule(self) -> list[str]:
        br = self.names.bridge
        return ["FORWARD", "-i", br, "-o", br, "-m", "comment", "--comment", self.names.iptables_comment, "-j", "ACCEPT"]

    def _create_records(self, records: list[dict[str, Any]], created: list[str]) -> None:
        if not records:
            return
        bridge_index = _ifindex(self.names.bridge)
        for rec in records:
            nsfs.create(rec["netns"])
            created.append(rec["name"])
        fds = [os.open(nsfs.netns_path(r["netns"]), os.O_RDONLY | os.O_CLOEXEC) for r in records]
        try:
            with nl.RtnlSocket() as sock:
                failures = sock.run(m for r, fd in zip(records, fds)
                                    for m in nl.veth_into_netns(r["host_if"], bridge_index, NODE_IFNAME, fd, NODE_IFINDEX))
        finally:
            for fd in fds:
                os.close(fd)
        _raise_first(failures, [f"veth for node {r['name']}: {step}" for r in records
                                for step in ("create", "no IPv6 address on the host's end", "up")])
        gateway_mac = _mac_of(self.names.bridge)
        for rec in records:
            node_sysctls(rec["netns"])  # before eth0 is up
            gso = [nl.gso_max_size(NODE_IFINDEX, rec["gso_max_bytes"])] if rec.get("gso_max_bytes") else []
            with nl.RtnlSocket(rec["netns"]) as sock:
                failures = sock.run([nl.link_up(1), neighbours.set_mac(NODE_IFINDEX, neighbours.node_mac(rec["ip"])),
                                     *gso, nl.link_up(NODE_IFINDEX), nl.add_ipv4(NODE_IFINDEX, rec["ip"], rec["prefixlen"]),
                                     nl.default_route(NODE_IFINDEX, self.bridge_ip),
                                     neighbours.permanent(NODE_IFINDEX, self.bridge_ip, gateway_mac)])
            _raise_first(failures, [f"node {rec['name']}: {step}" for step in
                                    ("lo up", "MAC address", *(["gso_max_size"] if gso else []), "eth0 up", "address",
                                     "default route", "gateway entry")])
            if self.cgroups.version is not None:  # named limits, else the default memory and pids limits
                self.cgroups.create(rec["name"], rec["cpu"], rec["mem_bytes"], rec["pids_max"])
        with nl.RtnlSocket() as sock:  # the host reaches every node without asking
            failures = sock.run(neighbours.entries_for(bridge_index, [r["ip"] for r in records]))
        _raise_first(failures, [f"host entry for node {r['name']}" for r in records])

    def set_neighbours(self, peers: dict[str, list[str]]) -> int:
        """Permanent neighbour entries: each listed node's for the given peer addresses (those in
        this testbed's subnet: others are reached through the gateway), and each peer node's for
        the listed node (its replies). Returns how many entries were programmed."""
        state = self.store.read()
        by_ip = {rec["ip"]: name for name, rec in state["nodes"].items()}
        wanted: dict[str, set[str]] = {}
        for node, ips in peers.items():
            if node not in state["nodes"]:
                continue
            for ip in ips:
                if ip in by_ip and ip != state["nodes"][node]["ip"]:
                    wanted.setdefault(node, set()).add(ip)
                    wanted.setdefault(by_ip[ip], set()).add(state["nodes"][node]["ip"])
        count = 0
        for node, ips in wanted.items():
            with nl.RtnlSocket(state["nodes"][node]["netns"]) as sock:
                failures = sock.run(neighbours.entries_for(NODE_IFINDEX, sorted(ips)))
            _raise_first(failures, [f"node {node}: neighbour entry"] * len(ips))
            count += len(ips)
        return count

    # processes -------------------------------------------------------------------
    def node(self, name: str) -> dict[str, Any]:
        rec = self.store.snapshot()["nodes"].get(name)  # shared: the caller gets its own copy
        if rec is None:
            raise NotFound(f"no node {name!r} in testbed {self.names.id}")
        return dict(rec)

    def identity(self, name: str, rec: Optional[dict[str, Any]] = None) -> uids.Identity:
        """The node's own uid and gid (this testbed's block + the node's index); ``rec`` is the
        node's record when the caller has read it already."""
        index = (rec or self.node(name))["index"]
        if not 0 <= index < uids.UID_SLOT:
            raise ConfigError(f"node index {index} is outside 0..{uids.UID_SLOT - 1}")
        if self._uid_base is None:  # the testbed's block is fixed until reset gives it back
            self._uid_base = uids.uid_base(self.names.id)
        uid = self._uid_base + index
        return uids.Identity(uid, uid)

    def netns_path(self, rec: dict[str, Any]) -> str:
        return nsfs.netns_path(rec["netns"])

    def procs_files(self, rec: dict[str, Any]) -> list[str]:
        """The cgroup.procs files a process of the node joins: its limits' groups (none on a host
        without cgroups)."""
        return self.cgroups.procs_files(rec["name"]) if self.cgroups.version is not None else []

    def rlimits(self, rec: dict[str, Any]) -> list[tuple[int, int, int]]:
        """The rlimits of the node's processes (``worker.confinement.confine``)."""
        return confine.node_rlimits(rec.get("pids_max"))

    def popen(self, name: str, argv: Sequence[str], view: Optional[fsview.View] = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside the node's namespace and cgroups (no shell involved): as the node's
        unprivileged uid with ``view`` as its file system (every process the worker starts), or,
        without a view, as root for the operator's own ``edgetb exec`` on this host."""
        rec = self.node(name)
        procs = self.procs_files(rec)
        if view is not None:
            return privilege.launch(privilege.Launch(argv, self.identity(name, rec), view, self.netns_path(rec),
                                                     procs, kwargs, self.rlimits(rec)))
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError("a command must be a non-empty list of strings")
        ns_fd = os.open(self.netns_path(rec), os.O_RDONLY | os.O_CLOEXEC)
        cg_fds = cgroups.join_fds(procs)

        def enter() -> None:
            cgroups.join_in_child(cg_fds)
            nsfs.setns_fd(ns_fd)

        try:
            return subprocess.Popen(list(argv), preexec_fn=enter, **kwargs)
        except FileNotFoundError:
            raise NotFound(f"command not found: {argv[0]!r}") from None
        finally:
            os.close(ns_fd)
            for fd, _ in cg_fds:
                os.close(fd)

    # teardown ----------------------------------------------------------------------
    def _remove_node_resources(self, name: str, by_namespace: Optional[dict[tuple[int, int], list[int]]] = None
                               ) -> None:
        netns = self.names.netns(name)
        if by_namespace is None:
            pids = nsfs.pids_in(netns)
        else:
            try:
                st = os.stat(nsfs.netns_path(netns))
                pids = by_namespace.get((st.st_dev, st.st_ino), [])
            except FileNotFoundError:
                pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.cgroups.remove(name)
        nsfs.remove(netns)  # its veth end goes with it, and the host end with that

    def _remove_shared(self, state: dict[str, Any]) -> None:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            ours = [(m["index"], m.get_attr("IFLA_IFNAME")) for m in ipr.get_links()
                    if self.names.owns_link(m.get_attr("IFLA_IFNAME") or "")]
            for index, _ in ours:
                try:
                    ipr.link("del", index=index)
                except Exception:  # already gone with its peer
                    pass
        self._remove_iptables_rules()
        self.cgroups.remove_all()
        state.pop("bridge", None)
        state.pop("iptables", None)

    def _remove_iptables_rules(self) -> None:
        if shutil.which("iptables"):
            remove_forward_rules(self.names.iptables_comment)

    def reset(self) -> dict[str, int]:
        """Remove every resource that carries this testbed's id, with or without a state file."""
        with self.store.locked() as state:
            names = set(state["nodes"]) | self.cgroups.nodes()
            prefix = f"etb-{self.names.id}-"
            names |= {n[len(prefix):] for n in nsfs.list_netns() if self.names.owns_netns(n)}
            by_namespace = nsfs.pids_by_namespace()
            for name in names:
                self._remove_node_resources(name, by_namespace)
            self._remove_shared(state)
            state.update(nodes={}, plans={}, processes={})
            state.pop("subnet", None)
            state.pop("runtime", None)
            uids.release_uid_base(self.names.id)
            self._uid_base = None
            return {"nodes": len(names)}

    def leftovers(self) -> dict[str, list[str]]:
        """Everything on this host that carries the testbed id (empty after a clean reset)."""
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            links = [m.get_attr("IFLA_IFNAME") for m in ipr.get_links()]
        rules = []
        if shutil.which("iptables"):
            out = subprocess.run(["iptables", "-w", "-S"], capture_output=True, text=True).stdout
            rules = [line for line in out.splitlines() if self.names.iptables_comment in line.split()]
        return {"netns": [n for n in nsfs.list_netns() if self.names.owns_netns(n)],
                "links": [n for n in links if n and self.names.owns_link(n)],
                "cgroups": sorted(self.cgroups.nodes()) + [b for b in self.cgroups.bases() if os.path.isdir(b)],
                "iptables": rules}


# opened in the node's namespace: the files of that namespace
NODE_SYSCTLS = (
    # unprivileged processes may ping (ICMP echo sockets, as Docker allows in its containers)
    ("/proc/sys/net/ipv4/ping_group_range", b"0 2147483647"),
    # no IPv6 on eth0: nodes are addressed by IPv4, and a link-local address would be a path
    # around the links' shaping; its announcements (duplicate address detection, router
    # solicitations, listener reports: multicast, flooded by the bridge to every node) cost
    # millions of deliveries at 1,000 nodes and slowed the shaping after creation by half
    (f"/proc/sys/net/ipv6/conf/{NODE_IFNAME}/disable_ipv6", b"1"),
)


def node_sysctls(netns: str) -> None:
    """Set the node namespace's ``NODE_SYSCTLS`` (before its eth0 is up)."""
    fds = []
    try:
        with nsfs.entered(netns):
            for path, _ in NODE_SYSCTLS:
                fds.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
        for fd, (_, value) in zip(fds, NODE_SYSCTLS):
            os.write(fd, value)
    finally:
        for fd in fds:
            os.close(fd)


def remove_forward_rules(comment: str, keep: Callable[[list[str]], bool] = lambda words: False) -> None:
    """Delete the iptables FORWARD rules that carry ``comment`` (but those ``keep`` keeps)."""
    listing = subprocess.run(["iptables", "-w", "-S", "FORWARD"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        words = line.split()
        if words[:1] == ["-A"] and comment in words and not keep(words):
            subprocess.run(["iptables", "-w", "-D", *words[1:]], capture_output=True)


def _mac_of(ifname: str) -> str:
    """The MAC address of ``ifname`` in this thread's namespace (by netlink: /sys shows the
    namespace of whoever mounted it, not an agent's in its own)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        index = ipr.link_lookup(ifname=ifname)
        mac = ipr.get_links(index[0])[0].get_attr("IFLA_ADDRESS") if index else None
    if not mac:
        raise NodeRuntimeError(f"interface {ifname} vanished")
    return str(mac)


def _ifindex(name: str) -> int:
    import socket

    try:
        return socket.if_nametoindex(name)
    except OSError:
        raise NodeRuntimeError(f"interface {name} vanished") from None


def _raise_first(failures: list[nl.Failure], what: list[str]) -> None:
    if failures:
        f = failures[0]
        raise NodeRuntimeError(f"{what[f.position]}: {f.describe()}" +
                               (f" (and {len(failures) - 1} more failures)" if len(failures) > 1 else ""))

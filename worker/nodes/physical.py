"""A physical device as a node: the agent runs the role directly on its own host.

The device is one node. Its address is one the host already has (the node's
``ip`` in the topology); its links leave by the interface holding that address,
where shaping puts one HTB class per destination, as on an emulated node's
``eth0``. Nothing is created on the device but that qdisc tree and the
processes, and reset removes exactly those.
"""
from __future__ import annotations

import ipaddress
import subprocess
from typing import Any, Optional, Sequence

from worker.api.errors import ConfigError, NotFound, TestbedError
from worker.confinement import fsview, privilege, uids
from worker.kernel.procs import kill_group
from worker.nodes.runtime import Naming, NodeSpec, check_pythons, claim_runtime, new_specs
from worker.shaping import apply
from worker.state import StateStore


def local_addresses() -> dict[str, tuple[str, int]]:
    """This host's IPv4 addresses: address -> (interface, prefix length)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        names = {m["index"]: m.get_attr("IFLA_IFNAME") for m in ipr.get_links()}
        return {m.get_attr("IFA_ADDRESS"): (names.get(m["index"], "?"), m["prefixlen"])
                for m in ipr.get_addr(family=2)}


class PhysicalRuntime:
    """The one node of a physical device: its own network stack, its own processes (a ``Runtime``)."""

    kind = "physical"
    bridge_ip: Optional[str] = None
    subnet = None
    cgroups = None  # a device's node takes no limits

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.names = Naming(store.testbed_id)

    def create_nodes(self, specs: Sequence[NodeSpec]) -> list[dict[str, Any]]:
        for spec in specs:
            spec.check()
            if spec.cpu or spec.mem_bytes or spec.pids_max or spec.gso_max_bytes:
                raise ConfigError(f"node {spec.name}: a physical device takes no cpu, memory, pids or gso_max_bytes limits")
            if spec.ip is None:
                raise ConfigError(f"node {spec.name}: a physical node needs the device's 'ip'")
        with self.store.locked() as state:
            todo = new_specs(state, specs)
            check_pythons(todo, self.store)
            if len(state["nodes"]) + len(todo) > 1:
                raise ConfigError(f"a physical device runs one node; asked for "
                                  f"{', '.join(sorted(set(state['nodes']) | {s.name for s in todo}))}")
            if todo:
                spec = todo[0]
                addresses = local_addresses()
                if spec.ip not in addresses:
                    mine = ", ".join(sorted(a for a in addresses if not ipaddress.IPv4Address(a).is_loopback))
                    raise ConfigError(f"node {spec.name}: {spec.ip} is not an address of this device "
                                      f"(it has {mine or 'none'})")
                ifname, prefixlen = addresses[spec.ip]
                claim_runtime(state, self.kind, self.names.id)
                state["nodes"][spec.name] = {
                    "name": spec.name, "index": 0, "ip": spec.ip, "prefixlen": prefixlen, "netns": None,
                    "ifname": ifname, "cpu": None, "mem_bytes": None, "runtime": self.kind}
                state["nodes"][spec.name] |= {"python": spec.python} if spec.python else {}
            return [state["nodes"][s.name] for s in specs]

    def node(self, name: str) -> dict[str, Any]:
        rec = self.store.read()["nodes"].get(name)
        if rec is None:
            raise NotFound(f"no node {name!r} on this device (testbed {self.names.id})")
        return rec

    def identity(self, name: str) -> uids.Identity:
        """The unprivileged uid and gid the node's processes run as on the device."""
        return uids.Identity.of_node(self.names.id, self.node(name)["index"])

    def set_neighbours(self, peers: dict[str, list[str]]) -> int:
        """Nothing to program: the device resolves its neighbours itself."""
        return 0

    def popen(self, name: str, argv: Sequence[str], view: Optional[fsview.View] = None,
              **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on the device itself (its network; no shell involved): as the node's
        unprivileged uid in its own mount namespace with ``view`` as its file system, or, without
        a view, as root for the operator's own ``edgetb exec``."""
        self.node(name)
        if view is not None:
            return privilege.launch(privilege.Launch(argv, self.identity(name), view, None, (), kwargs))
        try:
            return subprocess.Popen(list(argv), **kwargs)
        except FileNotFoundError:
            raise NotFound(f"command not found: {argv[0]!r}") from None

    def reset(self) -> dict[str, int]:
        """Stop the node's processes and remove its shaping; the device is left as it was."""
        with self.store.locked() as state:
            for proc in state["processes"].values():
                kill_group(proc)
            for name, plan in state["plans"].items():
                rec = state["nodes"].get(name)
                if rec:
                    try:
                        apply.clear(None, rec["ifname"])
                    except TestbedError:
                        pass  # the interface is gone: so is its qdisc
            count = len(state["nodes"])
            state.update(nodes={}, plans={}, processes={})
            state.pop("runtime", None)
            uids.release_uid_base(self.names.id)
            return {"nodes": count}

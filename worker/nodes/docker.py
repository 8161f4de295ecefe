"""Emulated nodes as Docker containers on one user-defined bridge network per testbed.

The only module that imports ``docker`` (the Docker SDK for Python), and only when a
Docker runtime is used or probed, so netns-only users need neither the SDK nor an engine.

- The network ``etb-<id>-net`` (bridge ``etb-<id>-dbr``) holds the testbed's subnet; its
  gateway is the subnet's first address, as the netns runtime's bridge. Containers
  ``etb-<id>-<node>`` get the same addresses a netns testbed would give (``node_address``),
  are reached by those addresses (no published ports) and are started in parallel.
- Limits: ``nano_cpus`` from ``cpu`` (a CFS quota), ``mem_limit`` (= memory+swap) from ``mem_bytes``,
  ``pids_limit`` from ``pids_max`` (memory and pids: ``worker.confinement.confine``'s defaults when unset), the
  nodes' rlimits; a read-only root file system with a private tmpfs on ``/tmp``, ``/var/tmp``, ``/run/lock``.
- Inside every container the node's files sit at fixed paths of their own, whatever the host's
  (a checkout in root's home, a path with spaces): ``/opt/edgetb/dml_app`` (the code root's) and
  ``/opt/edgetb/dataset`` and ``/opt/edgetb/dml_user`` (the user's code) (the experiment directory's,
  else the code root's), read-only, and
  ``/opt/edgetb/dml_file/node/<name>/`` (the node's own, read-write); ``/opt/edgetb`` is the
  working directory, ``PYTHONPATH`` and the node's ``--workdir``. Each source must be one the
  node's uid can list: else the deploy fails naming it and the fix.
- A declared Python (``"python"`` of nodes.json): a virtual environment inside the image, checked
  in a throwaway container before any node is made (``worker.nodes.docker_python``); its ``bin/``
  leads the container's ``PATH``.
- Shaping: each container's network namespace is bind-mounted on /run/netns/etb-<id>-<node>,
  where a netns node's would be, so shaping reaches it from the host with netlink, with no
  ``docker exec tc`` and no NET_ADMIN in the container.
- Processes run inside the container through the engine's exec API (its namespaces and
  cgroups, so its CPU and memory limits hold); ``worker.nodes.docker_exec.ExecProcess`` gives
  them Popen's interface, with the process's host pid (a session leader, so the worker can signal
  its group).
- Swarm fabric (``worker.nodes.docker_swarm``): after a ``set_fabric`` request the engine is in the
  testbed's swarm and containers join its overlay network instead of the bridge, each at the
  address the controller planned (``ip`` of the node's spec), with routes to the controller via
  the overlay's gateway; reset leaves a swarm joined for the testbed.
- Everything is labelled ``edgetb.testbed=<id>``; reset removes by that label only.
"""
from __future__ import annotations

import ipaddress
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dml_app.runtime.usercode import USERCODE_DIR
from worker import REPO_ROOT
from worker.api.errors import CapabilityError, ConfigError, NodeRuntimeError, NotFound
from worker.api.protocol import DEFAULT_SUBNET, NODE_IFNAME, node_address
from worker.confinement import confine, fsview, uids
from worker.kernel import nsfs
from worker.nodes import docker_python, docker_swarm as swarm
from worker.nodes.docker_exec import ExecProcess, sdk, short_error
from worker.nodes.runtime import Naming, NodeSpec, claim_runtime, emulated_only, new_specs, parse_subnet, set_gso_max
from worker.state import StateStore

DOCKER_TMPFS = ("/tmp", "/var/tmp", "/run/lock")  # a node's writable places besides its own (and the engine's /dev/shm)
DEFAULT_IMAGE = "edgetb-node:bookworm-1"  # scripts/build_node_image.sh and worker/Dockerfile build this tag
LABEL = "edgetb.testbed"
NODE_LABEL = "edgetb.node"
START_THREADS = 8
API_TIMEOUT_S = 120
PROBE_TIMEOUT_S = 3
BUILD_HINT = ("build it with 'bash scripts/build_node_image.sh' (offline, from Debian packages), or "
              "'docker build -t {image} -f worker/Dockerfile worker' where Docker Hub is reachable")
ENGINE_HINT = "start one with 'bash scripts/docker_setup.sh' (installs docker.io and starts dockerd)"
NODE_ROOT = "/opt/edgetb"  # inside a container: code, data and the node's own directory (no host path)


@dataclass(frozen=True)
class Mount:
    """A host directory shown in a container at ``target`` (read-only unless ``writable``)."""

    source: str
    target: str
    writable: bool = False


def node_image() -> str:
    return os.environ.get("EDGETB_NODE_IMAGE", DEFAULT_IMAGE)


def connect(timeout_s: float = API_TIMEOUT_S) -> Any:
    """A low-level client of the local engine (``DOCKER_HOST`` or the default socket) that answers."""
    docker = sdk()
    try:
        api = docker.APIClient(base_url=os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"),
                               version="auto", timeout=timeout_s, max_pool_size=64)
        api.ping()
    except Exception as e:  # connection refused, no socket, version negotiation failed
        raise CapabilityError(f"no Docker engine answers ({short_error(e)}); {ENGINE_HINT}") from None
    return api


def require_image(api: Any, image: str) -> None:
    docker = sdk()
    try:
        api.inspect_image(image)
    except docker.errors.ImageNotFound:
        raise CapabilityError(f"the node image {image} does not exist; {BUILD_HINT.format(image=image)}") from None
    except docker.errors.APIError as e:
        raise NodeRuntimeError(f"cannot inspect image {image}: {short_error(e)}") from None


def probe(image: Optional[str] = None) -> Optional[str]:
    """Why Docker nodes cannot be created here (None when they can: SDK, engine and image are there)."""
    try:
        api = connect(PROBE_TIMEOUT_S)
        try:
            require_image(api, image or node_image())
        finally:
            api.close()
    except (CapabilityError, NodeRuntimeError) as e:
        return e.message
    return None


class DockerRuntime:
    """Creates, runs commands in, and removes the Docker nodes of one testbed (a ``Runtime``)."""

    kind = "docker"
    cgroups = None  # the engine keeps each container's groups

    def __init__(self, store: StateStore, subnet: str = DEFAULT_SUBNET, image: Optional[str] = None,
                 code_root: str = REPO_ROOT, workdir: Optional[str] = None) -> None:
        """Nodes get ``dml_app/`` of ``code_root``; with ``workdir`` (the experiment directory),
        its ``dataset/`` and each node its own ``dml_file/node/<name>/``, else ``code_root``'s
        ``dataset/`` (``mounts``)."""
        self.workdir = os.path.abspath(workdir) if workdir else None
        self.store = store
        self.names = Naming(store.testbed_id)
        self.subnet = parse_subnet(subnet)
        self.image = image or node_image()
        self.set_code_root(code_root)
        self.network = f"etb-{self.names.id}-net"
        self.bridge = f"etb-{self.names.id}-dbr"
        self._api: Optional[Any] = None
        self._api_lock = threading.Lock()
        self._image_path: Optional[str] = None

    def set_code_root(self, code_root: str) -> None:
        """Containers made from now on mount ``dml_app/`` of ``code_root``."""
        self.code_root = os.path.abspath(code_root)

    def mounts(self, node: Optional[str] = None) -> list[Mount]:
        """What a container shows at ``NODE_ROOT``; with ``node``, its own directory too (made by
        ``uids.prepare_node_dir`` with no link on its way; the shared ones are resolved)."""
        data = self.workdir or self.code_root
        found = [Mount(os.path.realpath(os.path.join(self.code_root, "dml_app")), f"{NODE_ROOT}/dml_app"),
                 Mount(os.path.realpath(os.path.join(data, "dataset")), f"{NODE_ROOT}/dataset"),
                 Mount(os.path.realpath(os.path.join(data, USERCODE_DIR)), f"{NODE_ROOT}/{USERCODE_DIR}")]
        if node is not None and self.workdir:
            found.append(Mount(uids.node_dir(self.workdir, node), uids.node_dir(NODE_ROOT, node), True))
        return found

    def _check_mounts(self, records: Sequence[dict[str, Any]]) -> None:
        """Each shared source exists and each node's uid can list it: else an error naming it."""
        sources = [m.source for m in self.mounts()]
        missing = [p for p in sources if not os.path.isdir(p)]
        if missing:
            raise ConfigError(f"cannot mount into the nodes: {', '.join(missing)} does not exist")
        view = fsview.View(read=tuple(sources))
        for rec in records:
            fsview.check_readable(view, uids.Identity.of_node(self.names.id, rec["index"]))

    @property
    def api(self) -> Any:
        """The engine's client, connected on first use (CapabilityError when there is no engine)."""
        with self._api_lock:
            if self._api is None:
                self._api = connect()
            return self._api

    # addresses and names -----------------------------------------------------------
    @property
    def bridge_ip(self) -> str:
        return str(self.subnet.network_address + 1)

    def node_ip(self, index: int) -> str:
        return node_address(self.subnet, index)

    def container(self, node: str) -> str:
        return f"etb-{self.names.id}-{node}"

    def _labels(self, node: Optional[str] = None) -> dict[str, str]:
        return {LABEL: self.names.id, **({NODE_LABEL: node} if node else {})}

    # bring-up ------------------------------------------------------------------------
    def create_nodes(self, specs: Sequence[NodeSpec]) -> list[dict[str, Any]]:
        """Create and start a container per spec, in parallel (all or nothing); existing ones are kept.
        On a swarm fabric each spec carries its planned overlay address."""
        with self.store.locked() as state:
            fabric = swarm.Fabric.from_dict(state["fabric"]) if state.get("fabric") else None
            if fabric is None:
                emulated_only(specs, self.kind)
            subnet = ipaddress.IPv4Network(fabric.subnet) if fabric else self.subnet
            if state["nodes"] and state.get("subnet", str(subnet)) != str(subnet):
                raise ConfigError(f"testbed {self.names.id} already uses subnet {state['subnet']}, not {subnet}")
            todo = new_specs(state, specs)
            if todo:
                require_image(self.api, self.image)
            next_index = max((n["index"] for n in state["nodes"].values()), default=-1) + 1
            records = [{"name": s.name, "index": next_index + i, "prefixlen": subnet.prefixlen,
                        "ip": fabric.check_address(s.name, s.ip) if fabric else self.node_ip(next_index + i),
                        "netns": self.names.netns(s.name), "network": fabric.network if fabric else self.network,
                        "ifname": NODE_IFNAME, "container": self.container(s.name), "cpu": s.cpu,
                        "mem_bytes": s.mem_bytes, "pids_max": s.pids_max, "runtime": self.kind}
                       | ({"python": s.python} if s.python else {})
                       | ({"gso_max_bytes": s.gso_max_bytes} if s.gso_max_bytes else {})
                       for i, s in enumerate(todo)]
            taken = {n["ip"] for n in state["nodes"].values()}
            for rec in records:
                if rec["ip"] in taken:
                    raise ConfigError(f"node {rec['name']}: address {rec['ip']} is taken")
                taken.add(rec["ip"])
            if records:
                self._check_mounts(records)
                self._check_pythons(records)
            claim_runtime(state, self.kind, self.names.id)
            state["subnet"] = str(subnet)
            created: list[str] = []
            try:
                if records:
                    if fabric is None:
                        self._ensure_network(state)
                    self._start_all(records, created, fabric)
                for rec in records:
                    state["nodes"][rec["name"]] = rec
            except BaseException:
                self._remove_containers(created)
                if not state["nodes"]:
                    self._remove_network(state)
                    state.pop("subnet", None)
                    state.pop("runtime", None)
                raise
            return [state["nodes"][s.name] for s in specs]

    def _check_pythons(self, records: Sequence[dict[str, Any]]) -> None:
        """Each declared Python checked in the image (``worker.nodes.docker_python``), once per path,
        as the first node that declares it (image files are no node's: all node uids are 'others')."""
        seen: set[str] = set()
        for rec in records:
            if rec.get("python") and rec["python"] not in seen:
                docker_python.check(self.api, self.image, rec["python"], rec["name"],
                                    uids.Identity.of_node(self.names.id, rec["index"]), self._labels())
                seen.add(rec["python"])

    def _ensure_network(self, state: dict[str, Any]) -> None:
        docker = sdk()
        try:
            self.api.inspect_network(self.network)
        except docker.errors.NotFound:
            self._check_subnet_free()
            ipam = docker.types.IPAMConfig(pool_configs=[
                docker.types.IPAMPool(subnet=str(self.subnet), gateway=self.bridge_ip)])
            try:
                self.api.create_network(self.network, driver="bridge", ipam=ipam, labels=self._labels(),
                                        options={"com.docker.network.bridge.name": self.bridge,
                                                 # nodes keep their own source address on the way to other hosts
                                                 "com.docker.network.bridge.enable_ip_masquerade": "false"},
                                        check_duplicate=True)
            except docker.errors.APIError as e:
                raise NodeRuntimeError(f"cannot create network {self.network} ({self.subnet}): {short_error(e)}") from None
        state["network"] = self.network
        state["bridge"] = self.bridge

    def _check_subnet_free(self) -> None:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for msg in ipr.get_addr(family=2):
                addr = ipaddress.IPv4Interface(f"{msg.get_attr('IFA_ADDRESS')}/{msg['prefixlen']}")
                if addr.network.overlaps(self.subnet):
                    raise ConfigError(f"subnet {self.subnet} overlaps {addr} on {msg.get_attr('IFA_LABEL')}; "
                                      "choose another subnet")

    def _start_all(self, records: list[dict[str, Any]], created: list[str],
                   fabric: Optional[swarm.Fabric] = None) -> None:
        lock = threading.Lock()
        errors: list[str] = []

        def one(rec: dict[str, Any]) -> None:
            if errors:
                return  # something failed already: start no more
            try:
                self._start_one(rec, lambda: _locked_append(lock, created, rec["name"]))
                if fabric is not None:
                    swarm.route_node(rec["netns"], fabric)
            except Exception as e:
                with lock:
                    errors.append(f"node {rec['name']}: {e.message if hasattr(e, 'message') else short_error(e)}")

        if fabric is not None:  # the first attachment brings the overlay to this engine: concurrent
            one(records[0])     # first ones can wait on each other past the engine's deadline
            records = records[1:]
        if records:
            with ThreadPoolExecutor(max_workers=min(START_THREADS, len(records))) as pool:
                list(pool.map(one, records))
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise NodeRuntimeError(f"starting containers failed: {errors[0]}{more}", detail=errors)

    def identity(self, name: str) -> uids.Identity:
        """The uid and gid the node's container runs as (this testbed's block + the node's index)."""
        return uids.Identity.of_node(self.names.id, self.node(name)["index"])

    def container_config(self, rec: dict[str, Any], ident: uids.Identity) -> tuple[dict[str, Any], dict[str, Any]]:
        """The container's create arguments and host config (pure): a non-root user without
        capabilities nor new privileges; the code and data read-only, and of ``dml_file`` only
        the node's own directory, read-write; all at ``NODE_ROOT``, whatever their host paths."""
        docker = sdk()
        mounts = [docker.types.Mount(m.target, m.source, type="bind", read_only=not m.writable)
                  for m in self.mounts(rec["name"])]
        env = {"PYTHONPATH": NODE_ROOT, "EDGETB_NODE": rec["name"]}
        if rec.get("python"):  # the declared environment's bin/ first (checked in the image before)
            env["PATH"] = f"{rec['python']}/bin:{self.image_path()}"
        if self.workdir:
            env["HOME"] = uids.node_dir(NODE_ROOT, rec["name"])
        mem = rec["mem_bytes"] or confine.default_mem_bytes()
        host = {"network_mode": rec.get("network", self.network), "mounts": mounts, "init": True,
                "cap_drop": ["ALL"], "security_opt": ["no-new-privileges"],
                "nano_cpus": int(round(rec["cpu"] * 1e9)) if rec["cpu"] else None,
                "mem_limit": mem, "memswap_limit": mem, "pids_limit": rec.get("pids_max") or confine.DEFAULT_PIDS_MAX,
                "ulimits": confine.docker_ulimits(rec.get("pids_max")), "read_only": True,
                "tmpfs": {path: "rw,exec,nosuid,nodev,size=256m,mode=1777" for path in DOCKER_TMPFS}}
        create = {"command": ["sleep", "infinity"], "name": rec["container"], "hostname": rec["name"],
                  "labels": self._labels(rec["name"]), "working_dir": NODE_ROOT,
                  "user": f"{ident.uid}:{ident.gid}", "environment": env}
        return create, host

    def image_path(self) -> str:
        """The image's ``PATH`` (looked up once)."""
        if self._image_path is None:
            self._image_path = docker_python.image_path(self.api, self.image)
        return self._image_path

    def _start_one(self, rec: dict[str, Any], on_created: Any) -> None:
        docker = sdk()
        api = self.api
        ident = uids.Identity.of_node(self.names.id, rec["index"])
        if self.workdir:
            uids.prepare_node_dir(self.workdir, rec["name"], ident)
        create, host = self.container_config(rec, ident)
        host_config = api.create_host_config(**host)
        network = rec.get("network", self.network)
        networking = api.create_networking_config({network: api.create_endpoint_config(ipv4_address=rec["ip"])})
        made: list[str] = []

        def make() -> str:
            made.append(api.create_container(self.image, host_config=host_config, networking_config=networking,
                                             **create)["Id"])
            if len(made) == 1:
                on_created()
            return made[-1]

        try:
            container_id = swarm.started(api, make)
            pid = api.inspect_container(container_id)["State"]["Pid"]
        except docker.errors.APIError as e:
            raise NodeRuntimeError(short_error(e)) from None
        if not pid:
            raise NodeRuntimeError(f"container {rec['container']} is not running after start")
        rec["container_id"] = container_id
        nsfs.attach(rec["netns"], pid)
        if rec.get("gso_max_bytes"):
            set_gso_max(rec["netns"], rec["ifname"], rec["gso_max_bytes"])

    # swarm fabric ------------------------------------------------------------------------
    def set_fabric(self, body: Any) -> dict[str, Any]:
        """Join the testbed's swarm (unless this engine is in it already) and put the nodes made
        from now on on its overlay (``worker.nodes.docker_swarm``)."""
        fabric, token, advertise = swarm.Fabric.from_request(body)
        with self.store.locked() as state:
            old = state.get("fabric")
            if state["nodes"] and (old is None or swarm.Fabric.from_dict(old).network != fabric.network):
                raise ConfigError(f"testbed {self.names.id} has nodes on another network; reset it first")
            bridge_before = swarm.has_gwbridge(self.api)
            joined = swarm.join(self.api, fabric.manager, token, advertise)
            fabric = swarm.Fabric(**{**fabric.to_dict(), "routes": fabric.routes,
                                     "joined": joined or bool(old and old.get("joined")),
                                     "gwbridge_made": (joined and not bridge_before) or
                                     bool(old and old.get("gwbridge_made"))})
            state["fabric"] = fabric.to_dict()
            # joined: for the testbed, by this call or an earlier one (a retried call says so too)
            return {"version": 1, "joined": fabric.joined, "node_id": swarm.swarm_of(self.api.info())["node_id"],
                    "network": fabric.network}

    def set_neighbours(self, peers: dict[str, list[str]]) -> int:
        """Nothing to program: containers resolve their neighbours themselves."""
        return 0

    # processes -------------------------------------------------------------------------
    def node(self, name: str) -> dict[str, Any]:
        rec = self.store.read()["nodes"].get(name)
        if rec is None:
            raise NotFound(f"no node {name!r} in testbed {self.names.id}")
        return rec

    def popen(self, name: str, argv: Sequence[str], stdin: Any = None, stdout: Any = None, stderr: Any = None,
              env: Optional[dict[str, str]] = None, **_ignored: Any) -> "ExecProcess":
        """Start ``argv`` inside the node's container (no shell involved). ``env`` is added to the
        image's environment; each process gets its own session (as ``start_new_session``)."""
        rec = self.node(name)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ConfigError("a command must be a non-empty list of strings")
        return ExecProcess(self.api, rec["container"], list(argv), env or {}, NODE_ROOT,
                           stdin=stdin, stdout=stdout, stderr=stderr)

    # teardown ---------------------------------------------------------------------------
    def _remove_containers(self, names: Sequence[str]) -> None:
        """Remove these nodes' containers and namespace names (in parallel; missing ones are fine)."""
        for name in names:
            nsfs.remove(self.names.netns(name))
        if not names:
            return
        docker = sdk()

        def one(name: str) -> None:
            try:
                self.api.remove_container(self.container(name), force=True, v=True)
            except docker.errors.NotFound:
                pass

        with ThreadPoolExecutor(max_workers=min(START_THREADS, len(names))) as pool:
            list(pool.map(one, names))

    def _remove_network(self, state: dict[str, Any], timeout_s: float = 10.0) -> None:
        """Remove the testbed's networks; the engine may still count endpoints of containers it has
        just removed for a moment, so "active endpoints" is retried until ``timeout_s``."""
        docker = sdk()
        deadline = time.monotonic() + timeout_s
        for net in self.api.networks(filters={"label": f"{LABEL}={self.names.id}"}):
            if net.get("Scope") == "swarm":
                continue  # the swarm's overlay: its manager removes it (controller.workers.swarm)
            while True:
                try:
                    self.api.remove_network(net["Id"])
                    break
                except docker.errors.NotFound:
                    break
                except docker.errors.APIError as e:
                    if "active endpoints" not in str(e):
                        raise NodeRuntimeError(f"cannot remove network {net['Name']}: {short_error(e)}") from None
                    if time.monotonic() > deadline:
                        raise NodeRuntimeError(
                            f"cannot remove network {net['Name']}: the engine still counts endpoints on it with "
                            "its containers gone (a Docker engine bug, moby/moby#42119); restart dockerd and "
                            "reset again") from None
                    time.sleep(0.2)
        state.pop("network", None)
        state.pop("bridge", None)

    def _our_containers(self) -> list[dict[str, Any]]:
        return self.api.containers(all=True, filters={"label": f"{LABEL}={self.names.id}"})

    def reset(self) -> dict[str, int]:
        """Remove every container and network labelled with this testbed's id, and their namespace names."""
        docker = sdk()
        with self.store.locked() as state:
            for netns in nsfs.list_netns():  # first: these need no engine
                if self.names.owns_netns(netns):
                    nsfs.remove(netns)
            found = self._our_containers()
            names = {c["Labels"].get(NODE_LABEL) or c["Names"][0].lstrip("/") for c in found}

            def one(container: dict[str, Any]) -> None:
                try:
                    self.api.remove_container(container["Id"], force=True, v=True)
                except docker.errors.NotFound:
                    pass

            if found:
                with ThreadPoolExecutor(max_workers=min(START_THREADS, len(found))) as pool:
                    list(pool.map(one, found))
            self._remove_network(state)
            fabric = state.get("fabric") or {}
            if fabric.get("joined"):
                swarm.leave(self.api)  # before the record goes: a failed leave is tried again at the next reset
            if fabric.get("gwbridge_made"):
                swarm.remove_gwbridge(self.api)
            state.pop("fabric", None)
            removed = len(names | set(state["nodes"]))
            state.update(nodes={}, plans={}, processes={})
            state.pop("subnet", None)
            state.pop("runtime", None)
            uids.release_uid_base(self.names.id)
            return {"nodes": removed}

    def leftovers(self) -> dict[str, list[str]]:
        """Everything that carries the testbed id (empty after a clean reset)."""
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            links = [m.get_attr("IFLA_IFNAME") for m in ipr.get_links()]
        return {"containers": sorted(c["Names"][0].lstrip("/") for c in self._our_containers()),
                "networks": sorted(n["Name"] for n in self.api.networks(filters={"label": f"{LABEL}={self.names.id}"})),
                "netns": [n for n in nsfs.list_netns() if self.names.owns_netns(n)],
                "links": [n for n in links if n == self.bridge]}


def _locked_append(lock: threading.Lock, items: list[str], item: str) -> None:
    with lock:
        items.append(item)

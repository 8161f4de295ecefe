"""The worker's operations, as plain functions on JSON-shaped data.

``WorkerHost`` is what the agent's routes call and what the CLI calls directly
on a single host: create nodes, shape links (apply, update in place, verify),
run processes in nodes, report status, reset. Requests and answers are the
versioned JSON documents of the agent's REST API. It is a facade: it checks a
request's version and hands it to the part that does the work (the node runtime,
``worker.shaping.links``, ``worker.nodes.processes``, ``worker.observe``,
``worker.routes``, ``worker.faults``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import TYPE_CHECKING, Any, Optional, cast

from dml_app.runtime.usercode import USERCODE_DIR
from worker import REPO_ROOT
from worker.api import bodies
from worker.api.bodies import REQUEST
from worker.api.errors import ConfigError, TestbedError
from worker.api.protocol import API_VERSION, DEFAULT_SUBNET, check_version, ifname
from worker.confinement import privilege, zygote
from worker.confinement.cgroups import detect_version
from worker.nodes.netns import NetnsRuntime
from worker.nodes.processes import MAX_LOG_READ_BYTES, Processes
from worker.nodes.runtime import NodeSpec, Runtime
from worker.observe.capture import SNAP_BYTES, Captures
from worker.observe.sampling import Telemetry
from worker.routes import Routes, parse_routes
from worker.shaping import apply as tc_apply
from worker.shaping.links import Links
from worker.shaping.rates import urgent
from worker.shaping.host_schedule import HostSchedule
from worker.state import StateStore

if TYPE_CHECKING:
    from worker.nodes.docker import DockerRuntime


def kernel_netem() -> dict[str, Any]:
    """Whether this host's kernel has sch_netem, and its release (a run's ``--check`` asks)."""
    return {"netem": tc_apply.netem_available(), "kernel": os.uname().release}


def versioned(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer of the API: ``answer`` with its version first."""
    return {"version": API_VERSION, **answer}


RUNTIMES = ("netns", "docker", "physical")


class WorkerHost:
    """Everything one worker host does for one testbed."""

    def __init__(self, testbed_id: str = "0", subnet: str = DEFAULT_SUBNET, state_root: Optional[str] = None,
                 runtime: Optional[str] = None, runtime_options: Optional[dict[str, Any]] = None,
                 workdir: Optional[str] = None, code_root: Optional[str] = None) -> None:
        """``runtime`` is the kind of node this testbed makes: ``netns``, ``docker`` or ``physical``
        (default: the kind its existing nodes are, else netns). ``runtime_options`` go to the Docker
        runtime (``image``). Nodes run ``dml_app`` from ``code_root`` with ``workdir`` as
        their experiment directory (defaults: this checkout's code, and a directory of the testbed's
        state; ``sync`` fills that directory with the controller's code and data and runs from it)."""
        self.store = StateStore(testbed_id, state_root)
        state = self.store.read()
        if runtime is None:
            runtime = state.get("runtime", "netns") if state["nodes"] else "netns"
        if runtime not in RUNTIMES:
            raise ConfigError(f"runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
        self.workdir = os.path.abspath(workdir or os.path.join(self.store.dir, "work"))
        code_root = os.path.abspath(code_root or state.get("code_root") or REPO_ROOT)
        self.runtime: Runtime
        if runtime == "docker":
            from worker.nodes.docker import DockerRuntime  # the Docker SDK only when asked for

            for tree in ("dataset", USERCODE_DIR):  # mounted into every node
                os.makedirs(os.path.join(self.workdir, tree), exist_ok=True)
            self.runtime = DockerRuntime(self.store, subnet, code_root=code_root, workdir=self.workdir,
                                         **(runtime_options or {}))
        elif runtime_options:
            raise ConfigError("runtime options are for the docker runtime only")
        elif runtime == "physical":
            from worker.nodes.physical import PhysicalRuntime

            self.runtime = PhysicalRuntime(self.store)
        else:
            self.runtime = NetnsRuntime(self.store, subnet)
        self.routes = Routes(self.store)
        self.captures = Captures(self.store)
        self.links = Links(self.store, self.runtime)
        self.schedule = HostSchedule(self.store)  # a trace's bins ticked by this host's clock
        self.links.ticked = self.schedule.ticked  # (their rates are a bin's, not the plan's)
        self.procs = Processes(self.store, self.runtime, workdir=self.workdir, code_root=code_root)
        self.telemetry = Telemetry(self.store, self.runtime)
        from worker.faults import Faults

        self.faults = Faults(self)

    @property
    def testbed_id(self) -> str:
        return self.store.testbed_id

    @property
    def code_root(self) -> str:
        """Where node processes run ``dml_app`` from (the experiment directory once synced)."""
        return self.procs.code_root

    @code_root.setter
    def code_root(self, path: str) -> None:
        self.procs.code_root = path

    # as the controller's worker (controller.workers.api.Worker) ----------------------
    is_local = True  # in the controller's process: its state, runtime and clock are this machine's

    @property
    def workers(self) -> dict[str, "WorkerHost"]:
        return {"local": self}

    def sync_code(self, url: str, token: str, progress: Any) -> None:
        """Nothing to fetch: in the controller's process, nodes run its own code (``code_root``)."""

    @property
    def _zygote(self) -> Optional[zygote.Zygote]:
        """This host's node zygote, once started (``worker.nodes.processes``)."""
        return self.procs.zygote

    # capabilities and nodes ------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        """What this host can emulate (asked before anything is created)."""
        from worker.nodes import docker as runtime_docker  # imports the SDK only inside, when probing
        from worker.sync import nfs_problem as probe_nfs

        image = cast("DockerRuntime", self.runtime).image if self.runtime.kind == "docker" else None
        docker_problem = runtime_docker.probe(image)
        nfs_problem = probe_nfs()
        return {"version": API_VERSION, **kernel_netem(),
                "cgroup_version": detect_version(), "iptables": bool(shutil.which("iptables")),
                "runtimes": ["netns"] + ([] if docker_problem else ["docker"]), "runtime": self.runtime.kind,
                "docker": {"image": image or runtime_docker.node_image(), "available": docker_problem is None,
                           "problem": docker_problem},
                "subnet": str(self.runtime.subnet) if self.runtime.subnet else None,
                "nfs": {"available": nfs_problem is None, "problem": nfs_problem}}

    def create_nodes(self, body: Any) -> dict[str, Any]:
        body = bodies.checked(bodies.CREATE_NODES, body)
        specs = [NodeSpec.from_dict(n, f"{REQUEST}: nodes[{i}]") for i, n in enumerate(body["nodes"])]
        created = self.runtime.create_nodes(specs)
        warnings = []
        if self.runtime.kind == "netns" and specs and not privilege.per_mount_proc():
            warnings.append(f"this kernel ({os.uname().release}) cannot give a node a /proc of its own (Linux 5.8 "
                            "can): node processes see every process of this host in /proc (command lines, not "
                            "environments); run untrusted node code on a newer kernel")
        return {"version": API_VERSION, "nodes": created, **({"warnings": warnings} if warnings else {})}

    # shaping (worker.shaping.links) ------------------------------------------------------
    def set_links(self, body: Any, merge: bool = False) -> dict[str, Any]:
        """Shape the listed links (``worker.shaping.links.Links.set_links``)."""
        answer = versioned(self.links.set_links(bodies.checked(bodies.SET_LINKS, body), merge))
        self.schedule.replanned()  # (the ticked links' classes may have moved)
        return answer

    def set_rates(self, body: Any) -> dict[str, Any]:
        """Change the rates of shaped links in place (``worker.shaping.links.Links.set_rates``);
        the body checked at nice -10 too (``worker.shaping.rates.urgent``: a tick is due now)."""
        with urgent():
            return versioned(self.links.set_rates(bodies.checked(bodies.SET_RATES, body)))

    def clear_links(self, node: Optional[str] = None) -> dict[str, Any]:
        if node is None:
            self.schedule.stop()
        else:  # one node's links: the other traced links keep their clock
            self.schedule.end_node(node)
        return versioned(self.links.clear_links(node))

    def schedule_start(self, body: Any) -> dict[str, Any]:
        """Tick a trace's bins by this host's clock (``worker.shaping.host_schedule.HostSchedule``)."""
        return versioned(self.schedule.start(body))

    def schedule_end(self, body: Any) -> dict[str, Any]:
        """Stop ticking the listed links (a constant rate was set on them)."""
        return versioned(self.schedule.end(body))

    def schedule_stop(self) -> dict[str, Any]:
        """Stop the clock: its ticks and each link's last bin (stored as its plan's)."""
        return versioned(self.schedule.stop())

    def shaping(self, node: str) -> dict[str, Any]:
        """The node's plan, the kernel's state, and whether they agree."""
        return versioned(self.links.shaping(node))

    # processes (worker.nodes.processes) ---------------------------------------------------
    def start_process(self, node: str, body: Any) -> dict[str, Any]:
        """Start ``argv`` in the node, as the node's unprivileged uid (see ``worker.confinement.privilege``)."""
        return versioned(self.procs.start_process(node, bodies.checked(bodies.START_PROCESS, body)))

    def start_node(self, node: str, body: Any) -> dict[str, Any]:
        """Start a node's DML process (``python -m dml_app.node ARGS``) from this host's code
        root with this host's experiment directory, in the node's runtime."""
        return versioned(self.procs.start_node(node, bodies.checked(bodies.START_NODE, body)))

    def popen(self, node: str, argv: list[str], env: dict[str, str], **kwargs: Any) -> Any:
        """Start a process in ``node``, not recorded (``worker.nodes.processes.Processes.popen``)."""
        return self.procs.popen(node, argv, env, **kwargs)

    def processes(self) -> dict[str, Any]:
        return versioned({"processes": self.procs.processes()})

    def stop_process(self, node: str, proc_id: str, timeout_s: float = 5.0,
                     log_offset: Optional[int] = None) -> dict[str, Any]:
        """Stop a recorded process and forget it; with ``log_offset``, what its log holds from
        there (``log``: bounded, in base64, as ``process_log``'s)."""
        return versioned(self.procs.stop_process(node, proc_id, timeout_s, log_offset))

    def process_log(self, node: str, proc_id: str, offset: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        """Up to ``limit`` bytes (64 KiB at most) of a recorded process's log from ``offset``, in
        base64, with ``next_offset`` and whether it runs (``worker.nodes.processes.read_log_bytes``)."""
        return versioned(self.procs.process_log(node, proc_id, offset, MAX_LOG_READ_BYTES if limit is None else limit))

    def restart_processes(self, node: str) -> list[str]:
        """Start again the node's recorded processes that no longer run (a replaced node)."""
        return self.procs.restart_processes(node)

    def exec(self, node: str, body: Any) -> dict[str, Any]:
        """Run a command in a node to completion; its output is captured (1 MiB each at most)."""
        return versioned(self.procs.exec(node, bodies.checked(bodies.EXEC, body)))

    def fault(self, body: Any) -> dict[str, Any]:
        """Apply a scenario's changes to nodes (``worker.faults``): ``{"version": 1, "faults":
        [{"kind", "node", ...}, ...]}``; every one checked before any is applied."""
        body = check_version(body)
        started = time.monotonic()
        results = self.faults.apply(body.get("faults"))  # checked there (worker.api.faults)
        return {"version": API_VERSION, "results": results, "seconds": round(time.monotonic() - started, 4)}

    # captures ---------------------------------------------------------------------------
    def start_capture(self, node: str, body: Any) -> dict[str, Any]:
        """Capture the node's egress (tcpdump in its namespace, snap length ``snap_bytes``,
        default 128) into this testbed's state directory (``worker.observe.capture``)."""
        body = bodies.checked(bodies.START_CAPTURE, body)
        snap = body.get("snap_bytes", SNAP_BYTES)
        rec = self.runtime.node(node)
        return self.captures.start(node, rec, ifname(rec), snap)

    def stop_capture(self, node: str) -> dict[str, Any]:
        self.runtime.node(node)
        return self.captures.stop(node)

    def remove_capture(self, node: str) -> dict[str, Any]:
        self.runtime.node(node)
        return self.captures.remove(node)

    def capture_chunks(self, node: str) -> Any:
        """The node's capture file, in pieces (an iterator of bytes)."""
        self.runtime.node(node)
        return self.captures.chunks(node)

    # routes and code ---------------------------------------------------------------------
    def set_routes(self, body: Any) -> dict[str, Any]:
        """Route other hosts' node subnets via their LAN addresses; accept traffic from ``peers``."""
        routes, peers = parse_routes(check_version(body))
        return self.routes.set(routes, peers)

    def set_fabric(self, body: Any) -> dict[str, Any]:
        """Join the testbed's swarm and put the nodes made from now on on its overlay (Docker hosts)."""
        if self.runtime.kind != "docker":
            raise ConfigError(f"the swarm fabric joins Docker hosts; this host makes {self.runtime.kind} nodes")
        return cast("DockerRuntime", self.runtime).set_fabric(body)

    def swarm_probe(self, body: Any) -> dict[str, Any]:
        """What this host offers a swarm overlay, read-only (``worker.swarm_probe``)."""
        from worker import swarm_probe

        return swarm_probe.probe(body)

    def sync(self, body: Any) -> dict[str, Any]:
        """Fill this host's experiment directory with the controller's ``dml_app/`` and ``dataset/``:
        mounted over NFS when ``nfs`` names an export, else fetched over HTTP (changed files only)."""
        from worker import sync

        body = check_version(body)
        if body.get("manifest") is None:  # the hashes come with this call, never from the file server
            raise ConfigError("sync needs the controller's 'manifest' of the files to fetch")
        files = sync.check_manifest(body["manifest"], sync.TREES)
        if body.get("nfs"):
            share = os.path.join(self.workdir, "nfs")
            if not os.path.ismount(share):
                result = sync.mount_nfs(str(body["nfs"]), share)
            else:
                result = {"version": API_VERSION, "method": "nfs", "dest": share, "export": body["nfs"]}
            # the code is copied out of the share, checked (root imports it); the data stays there
            result["code"] = sync.copy_verified(share, self.workdir, "dml_app", files)
            for tree in ("dataset", USERCODE_DIR):
                link = os.path.join(self.workdir, tree)
                if not os.path.islink(link):
                    if os.path.isdir(link):  # an earlier HTTP copy
                        shutil.rmtree(link)
                    os.symlink(os.path.join("nfs", tree), link)
        else:
            url, token = body.get("url"), body.get("token")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not isinstance(token, str):
                raise ConfigError("sync needs the controller's 'url' (http://...) and a 'token', or an 'nfs' export")
            result = sync.sync_http(url, token, self.workdir, manifest=body["manifest"])
        with self.store.locked() as state:
            state["code_root"] = self.code_root = self.workdir
            state["code_manifest"] = sync.code_hashes(files)  # checked again before root imports it
            state["synced"] = result["method"]
        if self.runtime.kind == "docker":
            cast("DockerRuntime", self.runtime).set_code_root(self.code_root)
        return result

    # telemetry (worker.observe.sampling) -------------------------------------------------
    def telemetry_start(self, body: Any) -> dict[str, Any]:
        """Start sampling this host's nodes and links every ``period_ms`` (worker.observe.telemetry);
        a sampler already running at another period is replaced (its samples are dropped)."""
        return versioned(self.telemetry.start(check_version(body)))

    def telemetry_read(self, cursor: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        """The samples since ``cursor``, ``limit`` at most (100 by default, 1,000 at most; ask
        again from the answer's ``cursor``); ``lost`` says how many the ring overwrote first."""
        return versioned(self.telemetry.read(cursor, limit))

    def telemetry_stop(self) -> dict[str, Any]:
        return versioned(self.telemetry.stop())

    # status and reset ---------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        self.procs.book.flush()
        state = self.store.read()
        nodes = []
        for name, rec in state["nodes"].items():
            plan = state["plans"].get(name)
            nodes.append({"name": name, "ip": rec["ip"], "runtime": rec["runtime"], "cpu": rec["cpu"],
                          "mem_bytes": rec["mem_bytes"], "links": len(plan["rules"]) if plan else 0,
                          "shaped": plan is not None, "gso_max_bytes": rec.get("gso_max_bytes")})
        running = self.procs.running(state)
        bridge = state.get("bridge")
        return {"version": API_VERSION, "testbed_id": self.testbed_id,
                "runtime": state.get("runtime") or self.runtime.kind, "subnet": state.get("subnet"),
                "bridge": bridge, "bridge_ip": bridge_address(bridge, state.get("subnet")) if bridge else None,
                "routes": state.get("routes", []), "nodes": nodes, "processes_running": running}

    def reset(self) -> dict[str, Any]:
        """Stop the recorded processes (SIGTERM, then SIGKILL after a grace period), then remove
        every resource of this testbed."""
        self.faults.reset()
        self.schedule.stop()
        self.telemetry_stop()
        self.procs.stop_all()
        children, zyg = self.procs.forget()
        captures = self.captures.reset()  # before the namespaces go
        self.links.rate_sockets.close()  # (an open socket would keep its namespace alive)
        if zyg is not None:
            zyg.close()  # its node processes die with it
        removed = self.runtime.reset()
        removed["captures"] = captures["captures"]
        removed["routes"] = self.routes.reset()
        share = os.path.join(self.workdir, "nfs")
        if os.path.ismount(share):
            from worker.sync import unmount

            unmount(share)
        for child in children:
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return {"version": API_VERSION, "removed": removed}


def bridge_address(bridge: str, subnet: Optional[str]) -> Optional[str]:
    """The IPv4 address the bridge holds in the kernel; if it cannot be read, the recorded
    subnet's first address (never a default subnet's)."""
    import ipaddress

    net = ipaddress.IPv4Network(subnet) if subnet else None
    try:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            index = ipr.link_lookup(ifname=bridge)
            held = [m.get_attr("IFA_ADDRESS") for m in ipr.get_addr(family=2, index=index[0])] if index else []
    except Exception:  # noqa: BLE001 - netlink unavailable (no root): the record is what is known
        held = []
    for addr in held:
        if net is None or ipaddress.IPv4Address(addr) in net:
            return str(addr)
    return str(net.network_address + 1) if net else None


__all__ = ["WorkerHost", "API_VERSION", "TestbedError"]

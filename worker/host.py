"""The worker's operations, as plain functions on JSON-shaped data.

``WorkerHost`` is what the agent's routes call and what the CLI calls directly
on a single host: create nodes, shape links (apply, update in place, verify),
run processes in nodes, report status, reset. Requests and answers are the
versioned JSON documents of the agent's REST API.
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from worker.nodes import privilege, zygote

from worker.shaping import apply as tc_apply
from worker.observe.capture import SNAP_BYTES, Captures
from worker.nodes.cgroups import detect_version
from worker.api.errors import ConfigError, NotFound, TestbedError, TestbedTimeout
from worker.kernel.procs import start_ticks
from worker.routes import Routes, parse_routes
from worker.api.protocol import API_VERSION, DEFAULT_SUBNET, NODE_IFNAME, check_version
from worker.nodes.netns import NetnsRuntime, NodeSpec
from worker.api.shape import MAX_RATE_BPS, Shape
from worker.state import StateStore, state_root
from worker.shaping.plan import Isolation, Plan, Target, make_plan

MAX_OUTPUT_BYTES = 1 << 20
# nodes shaped at once: the kernel takes one lock (RTNL) for every tc change, and threads waiting
# for it spin; at 1,000 nodes and 10,000 links one thread took 2.5-3.8 s, two 3.2 s, four 4.4 s
SHAPING_THREADS = 1
TELEMETRY_READ_LIMIT, TELEMETRY_READ_MAX = 100, 1000  # samples per telemetry read


def _argv(value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ConfigError("argv must be a non-empty list of strings")
    return value


RUNTIMES = ("netns", "docker", "physical")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NODE_MODULE = "dml_app.node"


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
        self.code_root = os.path.abspath(code_root or state.get("code_root") or REPO_ROOT)
        self.runtime: Any
        if runtime == "docker":
            from worker.nodes.docker import DockerRuntime  # the Docker SDK only when asked for

            os.makedirs(os.path.join(self.workdir, "dataset"), exist_ok=True)  # mounted into every node
            self.runtime = DockerRuntime(self.store, subnet, code_root=self.code_root, workdir=self.workdir,
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
        self._children: dict[str, Any] = {}  # subprocess.Popen or zygote.ZygoteProcess
        self._envs: dict[str, dict[str, str]] = {}  # a process's env, in memory only, to start it again
        self._zygote: Optional[zygote.Zygote] = None
        self._book = _ProcessBook(self.store)
        self._lock = threading.Lock()
        from worker.faults import Faults

        self.faults = Faults(self)
        self._sampler: Any = None  # worker.observe.telemetry.Sampler while sampling

    @property
    def testbed_id(self) -> str:
        return self.store.testbed_id

    # as the controller's worker (controller.workers.api.Worker) ----------------------
    is_local = True  # in the controller's process: its state, runtime and clock are this machine's

    @property
    def workers(self) -> dict[str, "WorkerHost"]:
        return {"local": self}

    def sync_code(self, url: str, token: str, progress: Any) -> None:
        """Nothing to fetch: in the controller's process, nodes run its own code (``code_root``)."""

    # capabilities and nodes ------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        """What this host can emulate (asked before anything is created)."""
        from worker.nodes import docker as runtime_docker  # imports the SDK only inside, when probing
        from worker.sync import nfs_problem as probe_nfs

        image = getattr(self.runtime, "image", None)
        docker_problem = runtime_docker.probe(image)
        nfs_problem = probe_nfs()
        return {"version": API_VERSION, "netem": tc_apply.netem_available(),
                "cgroup_version": detect_version(), "iptables": bool(shutil.which("iptables")),
                "runtimes": ["netns"] + ([] if docker_problem else ["docker"]), "runtime": self.runtime.kind,
                "docker": {"image": image or runtime_docker.node_image(), "available": docker_problem is None,
                           "problem": docker_problem},
                "subnet": str(self.runtime.subnet) if self.runtime.subnet else None,
                "nfs": {"available": nfs_problem is None, "problem": nfs_problem},
                "kernel": os.uname().release}

    def create_nodes(self, body: Any) -> dict[str, Any]:
        body = check_version(body)
        if not isinstance(body.get("nodes"), list):
            raise ConfigError("'nodes' must be a list")
        specs = [NodeSpec.from_dict(n) for n in body["nodes"]]
        return {"version": API_VERSION, "nodes": self.runtime.create_nodes(specs)}

    # shaping -----------------------------------------------------------------------
    def set_links(self, body: Any, merge: bool = False) -> dict[str, Any]:
        """Shape the listed links. Each source's listed links replace its plan, or with
        ``merge`` change only the listed destinations (``"shape": null`` removes one).

        Isolation (worker.shaping.plan): ``"isolation": {"drop": [prefix, ...], "keep": [address, ...]}``
        drops traffic to the node address space but by links, ``{"open": true}`` is the open
        network; without it each node keeps its setting (open for a node never shaped).
        ``"unshaped": {node: [{"dst", "dst_ip"}, ...]}`` replaces the listed nodes' peers reached
        without a shaped link (the way back of one-way links); a node listed there is
        (re)planned even with no link of its own. ``"access": {node: {"uplink_bps": R,
        "downlink_bps": R}}`` sets the listed nodes' access links (null removes one, a key left
        out keeps it; see worker.shaping.plan and worker.shaping.downlink)."""
        body = check_version(body)
        links = body.get("links")
        if not isinstance(links, list):
            raise ConfigError("'links' must be a list")
        isolation: Any = Isolation.from_dict(body["isolation"]) if "isolation" in body else KEEP
        state = self._state()
        unshaped = _unshaped(body.get("unshaped", {}), state)
        access = _access(body.get("access", {}), state)
        wanted: dict[str, dict[str, Optional[Target]]] = {node: {} for node in [*unshaped, *access]}
        for i, link in enumerate(links):
            if not isinstance(link, dict) or not {"src", "dst", "dst_ip"} <= set(link):
                raise ConfigError(f"link {i}: needs src, dst, dst_ip and shape")
            if link["src"] not in state["nodes"]:
                raise NotFound(f"link {i}: no node {link['src']!r} on this host")
            shape = None if link.get("shape") is None and merge else Shape.from_dict(link.get("shape"))
            per_src = wanted.setdefault(link["src"], {})
            if link["dst"] in per_src:
                raise ConfigError(f"link {i}: {link['src']}->{link['dst']} listed twice")
            per_src[link["dst"]] = Target(link["dst"], str(link["dst_ip"]), shape) if shape else None
        plans = {src: self._plan_for(state, src, dests, merge, isolation, unshaped.get(src), access.get(src, {}))
                 for src, dests in wanted.items()}
        tc_apply.require_netem(plans)
        started = time.monotonic()
        results, failed = self._in_parallel(lambda src: self._shape_node(state, src, plans[src]), list(plans))
        with self.store.locked() as fresh:
            for src in plans:
                if src in failed or plans[src].empty:
                    fresh["plans"].pop(src, None)  # its shaping was cleared: kernel and state agree
                else:
                    fresh["plans"][src] = plans[src].to_dict()
        if hasattr(self.runtime, "set_neighbours"):  # netns: linked peers reached without ARP
            new_peers = {src: _peer_ips(plan) - _peer_ips(Plan.from_dict(state["plans"][src]) if src in state["plans"]
                                                         else None)
                         for src, plan in plans.items() if src not in failed}
            if any(new_peers.values()):
                self.runtime.set_neighbours({src: sorted(ips) for src, ips in new_peers.items() if ips})
        if failed:
            first = next(iter(failed.values()))
            raise type(first)(f"{first.message} (shaping of {', '.join(sorted(failed))} was removed; "
                              f"{len(results)} other nodes were shaped)", detail=first.detail)
        return {"version": API_VERSION, "nodes": results, "seconds": round(time.monotonic() - started, 4)}

    def _plan_for(self, state: dict[str, Any], src: str, dests: dict[str, Optional[Target]], merge: bool,
                  isolation: Any, unshaped: Optional[list[tuple[str, str]]], access: dict[str, Optional[int]]) -> Plan:
        previous = Plan.from_dict(state["plans"][src]) if src in state["plans"] else None
        targets: list[Target] = []
        if merge and previous:
            for rule in previous.rules:
                if rule.dest not in dests:
                    targets.append(Target(rule.dest, rule.dest_ip, rule.shape))
        targets += [t for t in dests.values() if t is not None]
        if isolation is KEEP:
            isolation = previous.isolation() if previous else None
        if unshaped is None:
            unshaped = previous.unshaped() if previous else []
        emulated = state["nodes"][src].get("netns") is not None  # a physical device's IPv6 is its own
        uplink = access.get("uplink_bps", previous.uplink_bps if previous else None)
        downlink = access.get("downlink_bps", previous.downlink_bps if previous else None)
        if downlink is not None and not emulated:
            raise ConfigError(f"access of {src}: a downlink needs an emulated node (a physical device's "
                              f"receive path is its own)")
        return make_plan(_ifname(state["nodes"][src]), targets, previous, isolation, unshaped, drop_ipv6=emulated,
                         uplink_bps=uplink, downlink_bps=downlink)

    def _shape_node(self, state: dict[str, Any], src: str, plan: Plan) -> dict[str, Any]:
        netns = state["nodes"][src]["netns"]
        previous = Plan.from_dict(state["plans"][src]) if src in state["plans"] else None
        try:
            if plan.empty:  # open and without links: unshaped, as a node never shaped
                tc_apply.clear(netns, plan.ifname)
                return {"node": src, "rules": 0, "verified": True, "changed": None, "isolated": False}
            if previous is None:
                tc_apply.apply(netns, plan)
                lines = None
            else:
                lines = tc_apply.update(netns, previous, plan)
            tc_apply.verify(netns, plan)
        except TestbedError:
            tc_apply.clear(netns, plan.ifname)
            raise
        return {"node": src, "rules": len(plan.rules), "verified": True, "changed": lines,
                "isolated": plan.isolated}

    def _in_parallel(self, fn: Any, items: list[str]) -> tuple[list[Any], dict[str, TestbedError]]:
        """Run ``fn`` on every item (a few threads); results of those that worked, errors by item."""
        results: list[Any] = []
        failed: dict[str, TestbedError] = {}

        def one(item: str) -> None:
            try:
                results.append(fn(item))
            except TestbedError as e:
                failed[item] = e

        if min(SHAPING_THREADS, len(items)) <= 1:
            for item in items:
                one(item)
        else:
            with ThreadPoolExecutor(max_workers=min(SHAPING_THREADS, len(items))) as pool:
                list(pool.map(one, items))
        return results, failed

    def clear_links(self, node: Optional[str] = None) -> dict[str, Any]:
        state = self.store.read()
        names = [node] if node else list(state["plans"])
        for name in names:
            rec = self.runtime.node(name)
            tc_apply.clear(rec["netns"], _ifname(rec))
        with self.store.locked() as fresh:
            for name in names:
                fresh["plans"].pop(name, None)
        return {"version": API_VERSION, "cleared": names}

    def shaping(self, node: str) -> dict[str, Any]:
        """The node's plan, the kernel's state, and whether they agree."""
        rec = self.runtime.node(node)
        plan_data = self.store.read()["plans"].get(node)
        seen = tc_apply.read_back(rec["netns"], _ifname(rec))
        plan = Plan.from_dict(plan_data) if plan_data else None
        problems = tc_apply.mismatches(plan, seen) if plan else []
        from worker.shaping.plan import render

        return {"version": API_VERSION, "node": node, "plan": plan_data, "kernel": seen.to_dict(),
                "tc": render(plan) if plan else [], "mismatches": problems,
                "verified": bool(plan) and not problems}

    # processes -------------------------------------------------------------------------
    def start_process(self, node: str, body: Any) -> dict[str, Any]:
        """Start ``argv`` in the node, as the node's unprivileged uid (see ``worker.nodes.privilege``)."""
        body = check_version(body)
        argv = _argv(body.get("argv"))
        env = body.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError("env must map strings to strings")
        return self._start(node, argv, env)

    def _start(self, node: str, argv: list[str], env: dict[str, str],
               node_args: Optional[list[str]] = None) -> dict[str, Any]:
        """Start a process in the node and record it; with ``node_args`` it is the node's DML
        process, forked by the zygote on netns nodes (``EDGETB_ZYGOTE=0``: started as ``argv``)."""
        rec = self._state()["nodes"].get(node) or self.runtime.node(node)  # an unknown node gets no log file
        proc_id = uuid.uuid4().hex[:12]
        log_path = os.path.join(self.store.logs_dir(), f"{node}-{proc_id}.log")
        with open(log_path, "ab") as log:
            if node_args is not None and self._zygote_wanted():
                child = self._spawn_node(node, rec, node_args, env, log.fileno())
            else:
                child = self._popen(node, argv, env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        with self._lock:
            self._children[proc_id] = child
            self._envs[proc_id] = dict(env)
        record = {"id": proc_id, "node": node, "argv": argv, "pid": child.pid, "log": log_path,
                  "started": time.time(), "start_ticks": start_ticks(child.pid)}
        self._book.add(record)
        return {"version": API_VERSION, **record, "running": True}

    def _state(self) -> dict[str, Any]:
        """The state as last read (``StateStore.snapshot``): not to be changed."""
        return self.store.snapshot()

    def _zygote_wanted(self) -> bool:
        return self.runtime.kind == "netns" and os.environ.get("EDGETB_ZYGOTE", "1") != "0"

    def _spawn_node(self, node: str, rec: dict[str, Any], args: list[str], env: dict[str, str],
                    log_fd: int) -> "zygote.ZygoteProcess":
        """Fork the node's DML process from this host's zygote (started on first use, and again
        when the code root changed): in the node's cgroups, namespace and view, as its uid."""
        ident = self.runtime.identity(node, rec)
        view = self.node_view(node, ident)
        privilege.check_readable(view, ident)
        with self._lock:
            if self._zygote is None or not self._zygote.alive or self._zygote.code_root != self.code_root:
                if self._zygote is not None:
                    self._zygote.close()
                hashes = self._state().get("code_manifest")
                if hashes is not None and os.path.realpath(self.code_root) == os.path.realpath(self.workdir):
                    from worker import sync

                    sync.verify_code(self.code_root, hashes)  # the zygote imports it as root
                self._zygote = zygote.Zygote(self.code_root, os.path.join(self.store.logs_dir(), "zygote.log"))
                self._zygote.start()
            zyg = self._zygote
        request = {"args": args, "uid": ident.uid, "gid": ident.gid,
                   "cgroup_procs": self.runtime.procs_files(rec), "rlimits": self.runtime.rlimits(rec),
                   "ops": [[op.kind, op.path, op.writable] for op in privilege.plan_view(view)]}
        child_env = _child_env(env)
        child_env.setdefault("HOME", view.home or "/")
        netns = self.runtime.netns_path(rec)
        netns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC) if netns else None
        try:
            return zyg.spawn(request, log_fd, child_env, netns_fd)
        finally:
            if netns_fd is not None:
                os.close(netns_fd)

    def _popen(self, node: str, argv: list[str], env: dict[str, str], **kwargs: Any) -> Any:
        """Start a process in ``node``: netns and physical nodes get their least-privilege view and
        uid; a container's process runs as the container's (non-root) user."""
        if self.runtime.kind == "docker":
            return self.runtime.popen(node, argv, env=dict(env), start_new_session=True, **kwargs)
        view = self.node_view(node)
        return self.runtime.popen(node, argv, view=view, env=_child_env(env), start_new_session=True, **kwargs)

    def node_view(self, node: str, ident: Optional["privilege.Identity"] = None) -> "privilege.View":
        """What a node's processes see: Python and the code read-only, the experiment directory
        read-only but for its own ``dml_file/node/<name>/`` (made its uid's, mode 0700); the
        worker's state, the rest of ``dml_file/`` and the code root's ``dml_file/`` hidden."""
        ident = ident or self.runtime.identity(node)
        home = privilege.prepare_node_dir(self.workdir, node, ident)
        real = os.path.realpath
        hide = [real(state_root()), real(os.path.dirname(self.store.dir)), real(privilege.host_run_dir()),
                real(os.path.join(self.workdir, "dml_file")), real(os.path.join(self.code_root, "dml_file"))]
        read = [*privilege.python_dirs(), real(os.path.join(self.code_root, "dml_app")), real(self.workdir)]
        return privilege.View(read=tuple(dict.fromkeys(read)), write=(real(home),), hide=tuple(dict.fromkeys(hide)),
                              home=home)

    def processes(self) -> dict[str, Any]:
        self._book.flush()
        procs = []
        for rec in self.store.read()["processes"].values():
            procs.append({**rec, **self._process_state(rec)})
        return {"version": API_VERSION, "processes": procs}

    def _process_state(self, rec: dict[str, Any]) -> dict[str, Any]:
        child = self._children.get(rec["id"])
        if child is not None:
            code = child.poll()
            return {"running": code is None, "returncode": code}
        ticks = rec.get("start_ticks")
        return {"running": ticks is not None and start_ticks(rec["pid"]) == ticks, "returncode": None}

    def stop_process(self, node: str, proc_id: str, timeout_s: float = 5.0) -> dict[str, Any]:
        rec = self._book.get(proc_id, self._state())
        if rec is None or rec["node"] != node:
            raise NotFound(f"no process {proc_id!r} in node {node!r}")
        if self._process_state(rec)["running"]:
            import signal

            try:
                os.killpg(rec["pid"], signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                while self._process_state(rec)["running"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self._process_state(rec)["running"]:
                    os.killpg(rec["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        child = self._children.pop(proc_id, None)
        code = child.wait(timeout=timeout_s) if child else None
        self._book.remove(proc_id)
        return {"version": API_VERSION, "id": proc_id, "stopped": True, "returncode": code}

    def fault(self, body: Any) -> dict[str, Any]:
        """Apply a scenario's changes to nodes (``worker.faults``): ``{"version": 1, "faults":
        [{"kind", "node", ...}, ...]}``; every one checked before any is applied."""
        body = check_version(body)
        if not isinstance(body.get("faults"), list) or not body["faults"]:
            raise ConfigError("'faults' must be a non-empty list")
        started = time.monotonic()
        results = self.faults.apply(body["faults"])
        return {"version": API_VERSION, "results": results, "seconds": round(time.monotonic() - started, 4)}

    def restart_processes(self, node: str) -> list[str]:
        """Start again, with the same argv (and env, when this worker started them), the node's
        recorded processes that no longer run (a replaced node); their old records go."""
        started = []
        for rec in self._book.records():
            if rec["node"] != node or self._process_state(rec)["running"]:
                continue
            env = self._envs.pop(rec["id"], {})
            self._children.pop(rec["id"], None)
            self._book.remove(rec["id"])
            started.append(self.start_process(node, {"version": API_VERSION, "argv": rec["argv"], "env": env})["id"])
        return started

    def exec(self, node: str, body: Any) -> dict[str, Any]:
        """Run a command in a node to completion; its output is captured (1 MiB each at most)."""
        body = check_version(body)
        argv = _argv(body.get("argv"))
        timeout_s = float(body.get("timeout_s", 60))
        child = self._popen(node, argv, {}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            import signal

            try:  # its children too: they hold the output pipes open
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.communicate(timeout=5)
            raise TestbedTimeout(f"{argv[0]} in {node} ran past {timeout_s:g}s and was killed") from None
        return {"version": API_VERSION, "returncode": child.returncode,
                "stdout": out[:MAX_OUTPUT_BYTES].decode(errors="replace"),
                "stderr": err[:MAX_OUTPUT_BYTES].decode(errors="replace")}

    def start_node(self, node: str, body: Any) -> dict[str, Any]:
        """Start a node's DML process (``python -m dml_app.node ARGS``) from this host's code
        root with this host's experiment directory, in the node's runtime."""
        body = check_version(body)
        args = body.get("args")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConfigError("args must be a list of strings")
        if any(a.startswith("--workdir") for a in args):
            raise ConfigError("--workdir is the host's to choose")
        env = body.get("env") or {}
        if not isinstance(env, dict):
            raise ConfigError("env must map strings to strings")
        if not os.path.isdir(os.path.join(self.code_root, "dml_app")):
            raise ConfigError(f"no dml_app in {self.code_root}: sync the code to this host first")
        if not os.path.isdir(os.path.join(self.workdir, "dml_file")):  # (mkdir takes the directory lock)
            os.makedirs(os.path.join(self.workdir, "dml_file"), exist_ok=True)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ConfigError("env must map strings to strings")
        python, workdir, code_root = sys.executable, self.workdir, self.code_root
        if self.runtime.kind == "docker":  # the container's own paths of the same directories
            from worker.nodes.docker import NODE_ROOT

            python, workdir, code_root = "python3", NODE_ROOT, NODE_ROOT
        node_args = [*args, "--workdir", workdir]
        return self._start(node, [python, "-m", NODE_MODULE, *node_args], {**env, "PYTHONPATH": code_root},
                           node_args=node_args)

    # captures ---------------------------------------------------------------------------
    def start_capture(self, node: str, body: Any) -> dict[str, Any]:
        """Capture the node's egress (tcpdump in its namespace, snap length ``snap_bytes``,
        default 128) into this testbed's state directory (``worker.observe.capture``)."""
        body = check_version(body)
        snap = body.get("snap_bytes", SNAP_BYTES)
        if not isinstance(snap, int) or isinstance(snap, bool):
            raise ConfigError("snap_bytes must be an integer")
        rec = self.runtime.node(node)
        return self.captures.start(node, rec, _ifname(rec), snap)

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
            link = os.path.join(self.workdir, "dataset")
            if not os.path.islink(link):
                if os.path.isdir(link):  # an earlier HTTP copy
                    shutil.rmtree(link)
                os.symlink(os.path.join("nfs", "dataset"), link)
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
            self.runtime.set_code_root(self.code_root)
        return result

    # telemetry ---------------------------------------------------------------------------
    def telemetry_start(self, body: Any) -> dict[str, Any]:
        """Start sampling this host's nodes and links every ``period_ms`` (worker.observe.telemetry);
        a sampler already running at another period is replaced (its samples are dropped)."""
        from worker.observe.telemetry import DEFAULT_PERIOD_MS, Sampler, check_period_ms

        body = check_version(body)
        period_ms = check_period_ms(body.get("period_ms", DEFAULT_PERIOD_MS))
        with self._lock:
            current = self._sampler
            if current is not None and current.running and current.period_ms == period_ms and not body.get("restart"):
                return {"version": API_VERSION, **_sampler_info(current)}
            if current is not None:
                current.stop()
            self._sampler = Sampler(self.store, getattr(self.runtime, "cgroups", None), period_ms)
            self._sampler.start()
            return {"version": API_VERSION, **_sampler_info(self._sampler)}

    def telemetry_read(self, cursor: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        """The samples since ``cursor``, ``limit`` at most (100 by default, 1,000 at most; ask
        again from the answer's ``cursor``); ``lost`` says how many the ring overwrote first."""
        sampler = self._sampler
        if sampler is None:
            raise NotFound("telemetry is not started on this host")
        limit = TELEMETRY_READ_LIMIT if limit is None else max(1, min(limit, TELEMETRY_READ_MAX))
        return {"version": API_VERSION, **sampler.read(cursor, limit)}

    def telemetry_stop(self) -> dict[str, Any]:
        with self._lock:
            sampler, self._sampler = self._sampler, None
        if sampler is None:
            return {"version": API_VERSION, "stopped": False}
        sampler.stop()
        return {"version": API_VERSION, "stopped": True, **_sampler_info(sampler)}

    # status and reset ---------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        self._book.flush()
        state = self.store.read()
        nodes = []
        for name, rec in state["nodes"].items():
            plan = state["plans"].get(name)
            nodes.append({"name": name, "ip": rec["ip"], "runtime": rec["runtime"], "cpu": rec["cpu"],
                          "mem_bytes": rec["mem_bytes"], "links": len(plan["rules"]) if plan else 0,
                          "shaped": plan is not None})
        running = sum(1 for p in state["processes"].values() if self._process_state(p)["running"])
        bridge = state.get("bridge")
        return {"version": API_VERSION, "testbed_id": self.testbed_id,
                "runtime": state.get("runtime") or self.runtime.kind, "subnet": state.get("subnet"),
                "bridge": bridge, "bridge_ip": bridge_address(bridge, state.get("subnet")) if bridge else None,
                "routes": state.get("routes", []), "nodes": nodes, "processes_running": running}

    def reset(self) -> dict[str, Any]:
        self.faults.reset()
        self.telemetry_stop()
        self._book.flush()
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
            zyg, self._zygote = self._zygote, None
        captures = self.captures.reset()  # before the namespaces go
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


def _sampler_info(sampler: Any) -> dict[str, Any]:
    return {"host": sampler.host_name, "period_ms": sampler.period_ms, "now_s": time.monotonic(),
            "started_s": sampler.started_mono, "cursor": sampler.ring.next_cursor,
            "sampler_cpu_s": round(sampler.cpu_s, 6), "samples_taken": sampler.samples, "running": sampler.running}


class _ProcessBook:
    """Process records on their way to the state file: the starts and stops of hundreds of node
    processes are saved in a few transactions (each rewrites the whole state), within
    ``FLUSH_AFTER_S``, and at once before anything reads them from the file."""

    FLUSH_AFTER_S = 2.0  # each save rewrites the whole state: megabytes at 1,000 nodes

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._added: dict[str, dict[str, Any]] = {}
        self._removed: set[str] = set()
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._timer: Optional[threading.Timer] = None

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._added[record["id"]] = record
            self._removed.discard(record["id"])
            self._schedule()

    def remove(self, proc_id: str) -> None:
        with self._lock:
            self._added.pop(proc_id, None)
            self._removed.add(proc_id)
            self._schedule()

    def get(self, proc_id: str, state: dict[str, Any]) -> Optional[dict[str, Any]]:
        with self._lock:
            if proc_id in self._removed:
                return None
            return self._added.get(proc_id) or state["processes"].get(proc_id)

    def records(self) -> list[dict[str, Any]]:
        """Every process record: the file's with the changes not yet saved (none is in flight:
        a flush holds ``_flushing`` from taking the changes until they are in the file)."""
        with self._flushing, self._lock:
            state = self.store.snapshot()
            kept = [rec for proc_id, rec in state["processes"].items()
                    if proc_id not in self._removed and proc_id not in self._added]
            return kept + list(self._added.values())

    def _schedule(self) -> None:
        if self._timer is None or not self._timer.is_alive():
            self._timer = threading.Timer(self.FLUSH_AFTER_S, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        with self._flushing:
            with self._lock:
                added, removed = self._added, self._removed
                self._added, self._removed = {}, set()
            if added or removed:
                with self.store.locked() as state:
                    state["processes"].update(added)
                    for proc_id in removed:
                        state["processes"].pop(proc_id, None)


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


KEEP = object()  # set_links without "isolation": each node keeps its own


def _unshaped(value: Any, state: dict[str, Any]) -> dict[str, list[tuple[str, str]]]:
    """The body's ``unshaped`` map, checked: node -> [(peer, peer ip)]."""
    if not isinstance(value, dict):
        raise ConfigError("'unshaped' must map node names to lists of {dst, dst_ip}")
    out: dict[str, list[tuple[str, str]]] = {}
    for node, peers in value.items():
        if node not in state["nodes"]:
            raise NotFound(f"unshaped: no node {node!r} on this host")
        if not isinstance(peers, list) or not all(isinstance(p, dict) and set(p) == {"dst", "dst_ip"}
                                                  and all(isinstance(v, str) for v in p.values()) for p in peers):
            raise ConfigError(f"unshaped.{node} must be a list of {{dst, dst_ip}} (strings)")
        for p in peers:
            try:
                ipaddress.IPv4Address(p["dst_ip"])
            except ValueError:
                raise ConfigError(f"unshaped.{node}: {p['dst_ip']!r} ({p['dst']}) is not an IPv4 address") from None
        out[node] = [(p["dst"], p["dst_ip"]) for p in peers]
    return out


def _access_rate(value: Any, where: str) -> Optional[int]:
    """An access rate: None, or bit/s as an integer (the controller parses links.json's units)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 8 <= value <= MAX_RATE_BPS:
        raise ConfigError(f"{where}: {value!r} is not a rate in [8, {MAX_RATE_BPS}] bit/s")
    return value


def _access(value: Any, state: dict[str, Any]) -> dict[str, dict[str, Optional[int]]]:
    """The body's ``access`` map, checked: node -> {"uplink_bps"?, "downlink_bps"?}."""
    if not isinstance(value, dict):
        raise ConfigError("'access' must map node names to {uplink_bps, downlink_bps}")
    out: dict[str, dict[str, Optional[int]]] = {}
    for node, sides in value.items():
        if node not in state["nodes"]:
            raise NotFound(f"access: no node {node!r} on this host")
        if not isinstance(sides, dict) or not set(sides) <= {"uplink_bps", "downlink_bps"}:
            raise ConfigError(f"access.{node} must be an object with uplink_bps and/or downlink_bps")
        out[node] = {k: _access_rate(v, f"access.{node}.{k}") for k, v in sides.items()}
    return out


def _peer_ips(plan: Optional[Plan]) -> set[str]:
    """The addresses a node's plan reaches directly (its permanent neighbour entries)."""
    if plan is None:
        return set()
    return {r.dest_ip for r in plan.rules} | {ip for _, ip in plan.unshaped()}


def _ifname(node: dict[str, Any]) -> str:
    """The interface a node's links leave by (recorded by its runtime)."""
    return node.get("ifname") or NODE_IFNAME


CHILD_ENV_KEYS = ("PATH", "LANG", "LANGUAGE", "TZ", "TERM")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    """A node process's environment: a few harmless variables of the worker's (an allow-list:
    none of its secrets) and what the request gives."""
    env = {k: v for k, v in os.environ.items() if k in CHILD_ENV_KEYS or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(extra)
    return env


__all__ = ["WorkerHost", "API_VERSION", "TestbedError"]

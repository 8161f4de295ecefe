"""Processes in a testbed's nodes: start, stop, start again, run to completion.

A node's DML process is forked by the host's node zygote on netns nodes (``worker.confinement.zygote``);
every other process is started by the node's runtime, as the node's unprivileged uid in its view
(``worker.confinement.privilege``). Process records reach the state file in batches (``ProcessBook``).
Requests come checked (``worker.host`` with ``worker.api.bodies``); answers come without it.
"""
from __future__ import annotations

import base64
import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Optional, cast

from worker.api.errors import ConfigError, NodeRuntimeError, NotFound, TestbedTimeout
from worker.api.protocol import FLOWER_PRELOADS, PRELOAD_ENV
from worker.confinement import flower_forks, fsview, node_python, privilege, uids, zygote
from worker.kernel.procs import start_ticks
from worker.nodes.runtime import ForkableRuntime, Runtime, worker_dirs
from worker.state import StateStore

MAX_OUTPUT_BYTES = 1 << 20
MAX_LOG_READ_BYTES = 64 * 1024  # the most one read of a process's log returns
STOP_GRACE_S = 5.0  # from SIGTERM to SIGKILL when processes are stopped
NODE_MODULE = "dml_app.node"
DEFAULT_CPU_WEIGHT = 100  # a node's weight in the kernel's CPU sharing (cgroup v2's default)


def read_log_bytes(path: str, offset: int, limit_bytes: int = MAX_LOG_READ_BYTES) -> tuple[bytes, int]:
    """Up to ``limit_bytes`` (capped at ``MAX_LOG_READ_BYTES``) of the log at ``path`` from
    ``offset``, and the file's size. The node writes that file: a symbolic link or anything but a
    regular file is refused (NodeRuntimeError naming the path), and the bytes are not interpreted."""
    if offset < 0 or limit_bytes < 0:
        raise ConfigError(f"a log read needs a non-negative offset and limit, not {offset} and {limit_bytes}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"no log file {path}") from None
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise NodeRuntimeError(f"cannot read the log {path}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NodeRuntimeError(f"the log {path} is not a regular file")
        want = min(limit_bytes, MAX_LOG_READ_BYTES, max(0, st.st_size - offset))
        return (os.pread(fd, want, offset) if want else b""), st.st_size
    finally:
        os.close(fd)


def child_env(extra: dict[str, str], python: Optional[str] = None) -> dict[str, str]:
    """A node process's environment: the worker's harmless variables (``zygote.harmless_env``),
    with the node's declared Python's ``bin/`` first on ``PATH``, and what the request gives."""
    env = zygote.harmless_env()
    env["PATH"] = node_python.path_with(python, env["PATH"])
    return {**env, **extra}


class Processes:
    """The processes this worker runs in one testbed's nodes. ``code_root`` and ``workdir`` are
    the host's (``code_root`` changes when the host syncs its code)."""

    def __init__(self, store: StateStore, runtime: Runtime, workdir: str, code_root: str) -> None:
        self.store = store
        self.runtime = runtime
        self.workdir = workdir
        self.code_root = code_root
        self._children: dict[str, Any] = {}  # subprocess.Popen or zygote.ZygoteProcess
        self._envs: dict[str, dict[str, str]] = {}  # a process's env, in memory only, to start it again
        self._zygote: Optional[zygote.Zygote] = None
        self._flower: dict[str, flower_forks.FlowerForks] = {}  # a Python environment -> its Flower fork server
        self._flower_refused: dict[str, str] = {}  # an environment -> why its programs start fresh
        self._flower_lock = threading.Lock()
        self.book = ProcessBook(store)
        self._lock = threading.Lock()

    @property
    def zygote(self) -> Optional[zygote.Zygote]:
        """The host's node zygote, once started."""
        return self._zygote

    # starting -----------------------------------------------------------------------------
    def start_process(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        """Start ``argv`` in the node, as the node's unprivileged uid (see ``worker.confinement.privilege``)."""
        return self.start(node, body["argv"], body.get("env") or {})

    def start_node(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        """Start a node's DML process (``python -m dml_app.node ARGS``) from this host's code
        root with this host's experiment directory, in the node's runtime."""
        args, env = body["args"], body.get("env") or {}
        if any(a.startswith("--workdir") for a in args):
            raise ConfigError("--workdir is the host's to choose")
        if not os.path.isdir(os.path.join(self.code_root, "dml_app")):
            raise ConfigError(f"no dml_app in {self.code_root}: sync the code to this host first")
        if not os.path.isdir(os.path.join(self.workdir, "dml_file")):  # (mkdir takes the directory lock)
            os.makedirs(os.path.join(self.workdir, "dml_file"), exist_ok=True)
        python, workdir, code_root = sys.executable, self.workdir, self.code_root
        if self.runtime.kind == "docker":  # the container's own paths of the same directories
            from worker.nodes.docker import NODE_ROOT

            python, workdir, code_root = "python3", NODE_ROOT, NODE_ROOT
        node_args = [*args, "--workdir", workdir]
        return self.start(node, [python, "-m", NODE_MODULE, *node_args], {**env, "PYTHONPATH": code_root},
                          node_args=node_args)

    def start(self, node: str, argv: list[str], env: dict[str, str],
              node_args: Optional[list[str]] = None) -> dict[str, Any]:
        """Start a process in the node and record it; with ``node_args`` it is the node's DML
        process, forked by the zygote on netns nodes (``EDGETB_ZYGOTE=0``: started as ``argv``)."""
        rec = self._state()["nodes"].get(node) or self.runtime.node(node)  # an unknown node gets no log file
        proc_id = uuid.uuid4().hex[:12]
        log_path = os.path.join(self.store.logs_dir(), f"{node}-{proc_id}.log")
        asked = dict(env)  # (kept to start it again: its weight too)
        with open(log_path, "ab") as log:
            child: Any = None
            if flower_forks.CPU_WEIGHT_ENV in env:
                env = self._weigh(node, rec, env, log)
            if node_args is not None and self._zygote_wanted():
                child = self._spawn_node(node, rec, node_args, env, log.fileno())
            elif env.get(flower_forks.FORK_ENV) == flower_forks.FORK_VALUE and self._zygote_wanted():
                child = self._fork_flower(node, rec, argv, env, log)
            if child is None:
                fresh = {k: v for k, v in env.items() if k != flower_forks.FORK_ENV}
                child = self.popen(node, argv, fresh, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        with self._lock:
            self._children[proc_id] = child
            self._envs[proc_id] = asked
        record = {"id": proc_id, "node": node, "argv": argv, "pid": child.pid, "log": log_path,
                  "started": time.time(), "start_ticks": start_ticks(child.pid)}
        self.book.add(record)
        return {**record, "running": True}

    def _state(self) -> dict[str, Any]:
        """The state as last read (``StateStore.snapshot``): not to be changed."""
        return self.store.snapshot()

    def _zygote_wanted(self) -> bool:
        return self.runtime.kind == "netns" and os.environ.get("EDGETB_ZYGOTE", "1") != "0"

    def _spawn_node(self, node: str, rec: dict[str, Any], args: list[str], env: dict[str, str],
                    log_fd: int) -> zygote.ZygoteProcess:
        """Fork the node's DML process from this host's zygote (started on first use, and again
        when the code root changed): in the node's cgroups, namespace and view, as its uid."""
        runtime = cast(ForkableRuntime, self.runtime)  # netns (``_zygote_wanted``)
        ident = runtime.identity(node, rec)
        view = self.node_view(node, ident)
        fsview.check_readable(view, ident)
        asked = tuple(p for p in env.get(PRELOAD_ENV, "").split(",") if p in zygote.PRELOADS)
        with self._lock:
            lacks = set(asked) - set(self._zygote.preload) if self._zygote is not None else set()
            idle = not any(c.poll() is None for c in self._children.values())
            if self._zygote is None or not self._zygote.alive or self._zygote.code_root != self.code_root \
                    or (lacks and idle):  # (a busy zygote keeps serving: its nodes only share less)
                preload = tuple(sorted(set(asked) | set(self._zygote.preload if self._zygote else ())))
                if self._zygote is not None:
                    self._zygote.close()
                self._verify_code()  # the zygote imports it as root
                self._zygote = zygote.Zygote(self.code_root, os.path.join(self.store.logs_dir(), "zygote.log"),
                                             preload=preload)
                self._zygote.start()
            zyg = self._zygote
        request = {"args": args, "uid": ident.uid, "gid": ident.gid,
                   "cgroup_procs": runtime.procs_files(rec), "rlimits": runtime.rlimits(rec),
                   "ops": [[op.kind, op.path, op.writable] for op in fsview.plan_view(view)]}
        env_of_child = child_env(env, view.python)
        env_of_child.setdefault("HOME", view.home or "/")
        netns = runtime.netns_path(rec)
        netns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC) if netns else None
        try:
            return zyg.spawn(request, log_fd, env_of_child, netns_fd)
        finally:
            if netns_fd is not None:
                os.close(netns_fd)

    def _verify_code(self) -> None:
        """The code root synced from the controller, checked against its manifest before root
        imports it (``worker.sync.verify_code``; a code root of this host's own is not synced)."""
        hashes = self._state().get("code_manifest")
        if hashes is not None and os.path.realpath(self.code_root) == os.path.realpath(self.workdir):
            from worker import sync

            sync.verify_code(self.code_root, hashes)

    def _fork_flower(self, node: str, rec: dict[str, Any], argv: list[str], env: dict[str, str],
                     log: Any) -> Optional[zygote.ZygoteProcess]:
        """Fork Flower's program ``argv`` from the fork server of the node's declared Python
        (``worker.confinement.flower_forks``), its shims leading the node's ``PATH``; None (and a
        line in its log saying why) when it is to start as a fresh process."""
        runtime = cast(ForkableRuntime, self.runtime)
        ident = runtime.identity(node, rec)
        view = self.node_view(node, ident)
        name = os.path.basename(argv[0])
        try:
            if not view.python:
                raise ConfigError("the node declares no Python environment")
            if name not in flower_forks.FORKABLE or argv[0] not in (name, os.path.join(view.python, "bin", name)):
                raise ConfigError(f"{argv[0]!r} is not one of Flower's programs of {view.python}")
            forks = self._flower_forks(view.python, tuple(env.get(PRELOAD_ENV, "").split(",")))
            node_request = {"uid": ident.uid, "gid": ident.gid, "cgroup_procs": runtime.procs_files(rec),
                            "rlimits": runtime.rlimits(rec),
                            "ops": [[op.kind, op.path, op.writable] for op in fsview.plan_view(view)]}
            env_of_child = child_env({k: v for k, v in env.items() if k not in (flower_forks.FORK_ENV, PRELOAD_ENV)},
                                     view.python)
            env_of_child.setdefault("HOME", view.home or "/")
            netns = runtime.netns_path(rec)
            netns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC) if netns else None
            try:
                bin_dir = forks.serve_node(node_request, netns_fd)
                env_of_child["PATH"] = f"{bin_dir}:{env_of_child['PATH']}"
                return forks.spawn({**node_request, "args": [name, *argv[1:]]}, log.fileno(), env_of_child, netns_fd)
            finally:
                if netns_fd is not None:
                    os.close(netns_fd)
        except (ConfigError, NodeRuntimeError) as e:
            log.write(f"edgetb: {name} starts as a fresh process: {e}\n".encode())
            log.flush()
            return None

    def _weigh(self, node: str, rec: dict[str, Any], env: dict[str, str], log: Any) -> dict[str, str]:
        """The node's CPU weight set from the program's ``EDGETB_CPU_WEIGHT`` (netns nodes; a line in
        its log when it cannot be) while it runs; the environment without it."""
        try:
            self._set_weight(rec, int(env[flower_forks.CPU_WEIGHT_ENV]))
        except (ValueError, ConfigError, OSError) as e:
            log.write(f"edgetb: the node's CPU weight is not set: {e}\n".encode())
            log.flush()
        return {k: v for k, v in env.items() if k != flower_forks.CPU_WEIGHT_ENV}

    def _set_weight(self, rec: dict[str, Any], weight: int) -> None:
        """Write the node's CPU weight (``flower_forks.cpu_weight_writes``; netns nodes only)."""
        if self.runtime.kind != "netns":
            raise ConfigError(f"{self.runtime.kind} nodes are not weighed")
        procs = cast(ForkableRuntime, self.runtime).procs_files(rec)
        for path, value in flower_forks.cpu_weight_writes(procs, weight):
            with open(path, "w") as f:
                f.write(value)

    def _flower_forks(self, python: str, preload: tuple[str, ...] = ()) -> flower_forks.FlowerForks:
        """The running fork server of environment ``python`` (started on first use, importing
        ``preload`` of ``FLOWER_PRELOADS`` ahead; started anew, when idle, for a preload it lacks);
        NodeRuntimeError (saying why) when its programs are to start fresh."""
        wanted = tuple(p for p in FLOWER_PRELOADS if p in preload)
        with self._flower_lock:
            forks = self._flower.get(python)
            if forks is not None and forks.alive and flower_forks.may_serve(forks.preload, wanted, forks.live()):
                return forks
            if python in self._flower_refused:
                raise NodeRuntimeError(self._flower_refused[python])
            why = flower_forks.check_owned_by_root(python)
            if why is not None:
                self._flower_refused[python] = f"the Flower fork server runs as root and {why}"
                raise NodeRuntimeError(self._flower_refused[python])
            if forks is not None:
                forks.close()
            self._verify_code()  # the fork server imports it as root too
            forks = flower_forks.FlowerForks(python, self.code_root,
                                             os.path.join(self.store.logs_dir(), "flower-forks.log"), wanted)
            try:
                forks.start()
            except NodeRuntimeError as e:
                self._flower_refused[python] = e.message
                raise
            self._flower[python] = forks
            return forks

    def popen(self, node: str, argv: list[str], env: dict[str, str], **kwargs: Any) -> Any:
        """Start a process in ``node`` (not recorded; ``kwargs`` go to ``Popen``): netns and
        physical nodes get their least-privilege view and uid; a container's process runs as the
        container's (non-root) user."""
        if self.runtime.kind == "docker":
            return self.runtime.popen(node, argv, env=dict(env), start_new_session=True, **kwargs)
        view = self.node_view(node)
        return self.runtime.popen(node, argv, view=view, env=child_env(env, view.python), start_new_session=True,
                                  **kwargs)

    def node_view(self, node: str, ident: Optional[uids.Identity] = None) -> fsview.View:
        """What a node's processes see: Python and the code read-only, the experiment directory
        read-only but for its own ``dml_file/node/<name>/`` (made its uid's, mode 0700); the
        worker's state, the rest of ``dml_file/`` and the code root's ``dml_file/`` hidden."""
        ident = ident or self.runtime.identity(node)
        real = os.path.realpath
        hide = [*map(real, worker_dirs(self.store)),
                real(os.path.join(self.workdir, "dml_file")), real(os.path.join(self.code_root, "dml_file"))]
        declared = self.runtime.node(node).get("python")  # checked again: it may have changed since
        python = node_python.resolve(declared, node, ident, hide) if declared else None
        home = uids.prepare_node_dir(self.workdir, node, ident)
        read = [*privilege.python_dirs(), *(python.shown if python else ()), real(os.path.join(self.code_root, "dml_app")),
                real(self.workdir)]
        return fsview.View(read=tuple(dict.fromkeys(read)), write=(real(home),), hide=tuple(dict.fromkeys(hide)),
                           home=home, python=python.path if python else None)

    # watching and stopping ----------------------------------------------------------------------
    def processes(self) -> list[dict[str, Any]]:
        """Every recorded process, with whether it runs and its exit code."""
        self.book.flush()  # (the state parsed again only when it changed: a run's watch asks every second)
        return [{**rec, **self.process_state(rec)} for rec in self.store.snapshot()["processes"].values()]

    def process_state(self, rec: dict[str, Any]) -> dict[str, Any]:
        """Whether the recorded process runs (a child of this worker, or the same process as
        recorded: its start time), and its exit code when known."""
        child = self._children.get(rec["id"])
        if child is not None:
            code = child.poll()
            return {"running": code is None, "returncode": code}
        ticks = rec.get("start_ticks")
        return {"running": ticks is not None and start_ticks(rec["pid"]) == ticks, "returncode": rec.get("returncode")}

    def hold(self, proc_id: str) -> Optional[int]:
        """Wait for a process this worker started to end (a node process dies with the process
        that started it: ``worker.confinement.privilege``), then record its exit code."""
        with self._lock:
            child = self._children[proc_id]
        code = child.wait()
        with self.store.locked() as state:
            if proc_id in state["processes"]:
                state["processes"][proc_id]["returncode"] = code
        return code

    def stop_process(self, node: str, proc_id: str, timeout_s: float = 5.0,
                     log_offset: Optional[int] = None) -> dict[str, Any]:
        """Stop the process (SIGTERM to its group, SIGKILL after ``timeout_s``) and forget it;
        with ``log_offset``, the answer's ``log`` holds what it wrote from there (up to
        ``MAX_LOG_READ_BYTES``: what it printed as it stopped, which no later read could get)."""
        rec = self.book.get(proc_id, self._state())
        if rec is None or rec["node"] != node:
            raise NotFound(f"no process {proc_id!r} in node {node!r}")
        if self.process_state(rec)["running"]:
            try:
                os.killpg(rec["pid"], signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                while self.process_state(rec)["running"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self.process_state(rec)["running"]:
                    os.killpg(rec["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        child = self._children.get(proc_id)  # (kept until its record goes: a listing meanwhile reads its code)
        code = child.wait(timeout=timeout_s) if child else None
        if flower_forks.CPU_WEIGHT_ENV in self._envs.pop(proc_id, {}):  # the node weighs as any again
            try:
                self._set_weight(self._state()["nodes"].get(node) or self.runtime.node(node), DEFAULT_CPU_WEIGHT)
            except (ConfigError, NotFound, OSError):
                pass
        rest: dict[str, Any] = {}
        if log_offset is not None:
            data, _ = read_log_bytes(rec["log"], log_offset)
            rest = {"log": {"offset": log_offset, "next_offset": log_offset + len(data),
                            "data_b64": base64.b64encode(data).decode("ascii")}}
        self.book.remove(proc_id)
        with self._lock:
            self._children.pop(proc_id, None)
        return {"id": proc_id, "stopped": True, "returncode": code, **rest}

    def process_log(self, node: str, proc_id: str, offset: int = 0,
                    limit_bytes: int = MAX_LOG_READ_BYTES) -> dict[str, Any]:
        """A bounded piece of a recorded process's log (its output and errors) from ``offset``:
        the bytes in base64, where the next read starts, and whether the process still runs."""
        rec = self.book.get(proc_id, self._state())
        if rec is None or rec["node"] != node:
            raise NotFound(f"no process {proc_id!r} in node {node!r}")
        data, size = read_log_bytes(rec["log"], offset, limit_bytes)
        return {"id": proc_id, "node": node, "offset": offset, "next_offset": offset + len(data),
                "size_bytes": size, "data_b64": base64.b64encode(data).decode("ascii"),
                **self.process_state(rec)}

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> int:
        """Stop every recorded process that runs: SIGTERM to each one's process group, SIGKILL
        to those left after ``grace_s``; how many ran."""
        running = [rec for rec in self.book.records() if self.process_state(rec)["running"]]
        _signal_groups(running, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.process_state(r)["running"] for r in running):
            time.sleep(0.05)
        _signal_groups([r for r in running if self.process_state(r)["running"]], signal.SIGKILL)
        return len(running)

    def restart_processes(self, node: str) -> list[str]:
        """Start again, with the same argv (and env, when this worker started them), the node's
        recorded processes that no longer run (a replaced node); their old records go."""
        started = []
        for rec in self.book.records():
            if rec["node"] != node or self.process_state(rec)["running"]:
                continue
            with self._lock:
                env = self._envs.pop(rec["id"], {})
                self._children.pop(rec["id"], None)
            self.book.remove(rec["id"])
            started.append(self.start_process(node, {"argv": rec["argv"], "env": env})["id"])
        return started

    def exec(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        """Run a command in a node to completion; its output is captured (1 MiB each at most)."""
        argv, timeout_s = body["argv"], body["timeout_s"]
        child = self.popen(node, argv, body.get("env") or {}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            out, err = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:  # its children too: they hold the output pipes open
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.communicate(timeout=5)
            raise TestbedTimeout(f"{argv[0]} in {node} ran past {timeout_s:g}s and was killed") from None
        return {"returncode": child.returncode, "stdout": out[:MAX_OUTPUT_BYTES].decode(errors="replace"),
                "stderr": err[:MAX_OUTPUT_BYTES].decode(errors="replace")}

    def running(self, state: dict[str, Any]) -> int:
        """How many of the processes recorded in ``state`` run."""
        return sum(1 for p in state["processes"].values() if self.process_state(p)["running"])

    def forget(self) -> tuple[list[Any], Optional[zygote.Zygote]]:
        """Drop every child and the zygote (for reset): the children to wait for and the zygote
        to close (its node processes die with it), once the nodes are gone."""
        self.book.flush()
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
            zyg, self._zygote = self._zygote, None
        with self._flower_lock:
            flowers, self._flower = list(self._flower.values()), {}
            self._flower_refused.clear()
        for forks in flowers:
            forks.close()  # (the Flower processes it forked die with it)
        return children, zyg


def _signal_groups(records: list[dict[str, Any]], sig: int) -> None:
    """Send ``sig`` to the process group of each record (each leads its own session)."""
    for rec in records:
        try:
            os.killpg(rec["pid"], sig)
        except (ProcessLookupError, PermissionError):
            pass


class ProcessBook:
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

"""CPU, memory and process limits of emulated nodes, through cgroup v1 or v2.

Each testbed has one group (``edgetb-<id>``) holding one child per node. What
is written where is computed by ``limit_writes`` as plain data, so both cgroup
versions are tested as tables; ``Cgroups`` makes it real. A node always gets a
memory and a pids limit (``worker.confinement.confine``'s defaults when it names none).

A node is removed through its groups: frozen (v1 ``freezer``, v2 ``cgroup.freeze``),
every process killed, thawed (or v2's ``cgroup.kill``), so that no process can fork
faster than it is killed.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from typing import Any, Callable, Optional

from worker.api.errors import CapabilityError, NodeRuntimeError
from worker.confinement import confine
from worker.state import host_record

CFS_PERIOD_US = 100_000
V1_CONTROLLERS = ("cpu", "memory")
V1_OPTIONAL = ("pids", "freezer")  # joined where they are mounted


def detect_version(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """2 for a unified hierarchy at ``root``, 1 for v1 cpu+memory hierarchies, None for neither."""
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        return 2
    if all(os.path.isdir(os.path.join(root, c)) for c in V1_CONTROLLERS):
        return 1
    return None


def limit_writes(version: int, cpu: Optional[float], mem_bytes: Optional[int],
                 pids_max: Optional[int] = None) -> list[tuple[str, str, str]]:
    """(controller, file, value) writes that set a node's limits; controller is '' on v2."""
    quota = str(int(round(cpu * CFS_PERIOD_US))) if cpu else None
    if version == 1:
        writes = [("cpu", "cpu.cfs_period_us", str(CFS_PERIOD_US)), ("cpu", "cpu.cfs_quota_us", quota or "-1")]
        if mem_bytes:
            writes += [("memory", "memory.limit_in_bytes", str(mem_bytes)),
                       ("memory", "memory.memsw.limit_in_bytes", str(mem_bytes))]
        if pids_max:
            writes.append(("pids", "pids.max", str(pids_max)))
        return writes
    writes = [("", "cpu.max", f"{quota or 'max'} {CFS_PERIOD_US}")]
    writes += [("", "memory.max", str(mem_bytes) if mem_bytes else "max")]
    if mem_bytes:
        writes.append(("", "memory.swap.max", "0"))
    if pids_max:
        writes.append(("", "pids.max", str(pids_max)))
    return writes


def _write(path: str, value: str, optional: bool = False) -> None:
    """Write one cgroup file; an ``optional`` one the kernel does not offer is skipped
    (cgroupfs answers EACCES, not ENOENT, for a file it does not have)."""
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        if optional and e.errno in (errno.ENOENT, errno.EACCES):
            return
        if isinstance(e, FileNotFoundError):
            raise
        raise NodeRuntimeError(f"cannot write {value!r} to {path}: {e.strerror}") from None


class Cgroups:
    """The cgroups of one testbed."""

    def __init__(self, group: str, root: str = "/sys/fs/cgroup") -> None:
        self.group = group
        self.root = root
        self.version = detect_version(root)
        self._v2_ready = False  # controllers delegated and the testbed's group made (once, not per node)

    def require(self) -> None:
        if self.version is None:
            raise CapabilityError(f"no cgroup v1 (cpu, memory) or v2 hierarchy under {self.root}: "
                                  "CPU and memory limits cannot be set")

    def bases(self) -> list[str]:
        """The testbed's group in each hierarchy (they may not exist yet)."""
        if self.version == 1:
            return [os.path.join(self.root, c, self.group) for c in v1_hierarchies(self.root)]
        if self.version == 2:
            return [os.path.join(self.root, self.group)]
        return []

    def dirs(self, node: str) -> list[str]:
        return [os.path.join(base, node) for base in self.bases()]

    def create(self, node: str, cpu: Optional[float], mem_bytes: Optional[int], pids_max: Optional[int] = None
               ) -> None:
        """Make the node's group(s) and set its limits (memory and pids None: ``worker.confinement.confine``'s
        defaults; cpu None: unlimited)."""
        self.require()
        if self.version == 2 and not (self._v2_ready and os.path.isdir(self.bases()[0])):
            added = enable_v2_controllers(self.root)
            os.makedirs(self.bases()[0], exist_ok=True)
            _write(os.path.join(self.bases()[0], "cgroup.subtree_control"), " ".join(f"+{c}" for c in added))
            self._v2_ready = True
        for d in self.dirs(node):
            os.makedirs(d, exist_ok=True)
        mounted = v1_hierarchies(self.root) if self.version == 1 else []
        for controller, name, value in limit_writes(self.version or 0, cpu, mem_bytes or confine.default_mem_bytes(),
                                                    pids_max or confine.DEFAULT_PIDS_MAX):
            if controller and controller not in mounted:
                continue  # (v1 without the pids hierarchy: RLIMIT_NPROC still bounds the node)
            base = os.path.join(self.root, controller, self.group, node) if controller else self.dirs(node)[0]
            optional = name.startswith("memory.memsw") or name.endswith("swap.max") or \
                (self.version == 2 and name == "pids.max")
            _write(os.path.join(base, name), value, optional=optional)

    def set_limits(self, node: str, cpu: Optional[float], mem_bytes: Optional[int],
                   pids_max: Optional[int] = None) -> None:
        """Change the limits of an existing node's group(s) (``create``'s defaults). On v1 the
        swap limit is lifted first: the kernel refuses a memory limit above it."""
        self.require()
        if self.version == 1:
            memsw = os.path.join(self.root, "memory", self.group, node, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):
                _write(memsw, "-1", optional=True)
        self.create(node, cpu, mem_bytes, pids_max)

    def reader(self, node: str) -> "CounterReader":
        """A reader of the node's CPU and memory counters."""
        return CounterReader(self.version, self.dirs(node))

    def procs_files(self, node: str) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs(node)]

    def pids(self, node: str) -> set[int]:
        found: set[int] = set()
        for path in self.procs_files(node):
            try:
                with open(path) as f:
                    found.update(int(x) for x in f.read().split())
            except FileNotFoundError:
                pass
        return found

    def nodes(self) -> set[str]:
        """Every node group of this testbed that exists now."""
        found: set[str] = set()
        for base in self.bases():
            if os.path.isdir(base):
                found.update(e for e in os.listdir(base) if os.path.isdir(os.path.join(base, e)))
        return found

    def remove(self, node: str, timeout_s: float = 5.0) -> None:
        """Kill the node's processes (``kill``) and remove its groups."""
        deadline = time.monotonic() + timeout_s
        self.kill(node, timeout_s / 2)
        while True:
            pids = self.pids(node)
            _kill_all(pids)
            try:
                for d in self.dirs(node):
                    if os.path.isdir(d):
                        os.rmdir(d)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise NodeRuntimeError(f"cgroup of node {node} still busy after {timeout_s}s: pids {sorted(pids)}")
                time.sleep(0.02)

    def freezer_dir(self, node: str) -> Optional[str]:
        """The node's group that can freeze it (None where there is none)."""
        if self.version == 1:
            return os.path.join(self.root, "freezer", self.group, node) if "freezer" in v1_hierarchies(self.root) \
                else None
        return self.dirs(node)[0] if self.version == 2 else None

    def kill(self, node: str, timeout_s: float = 10.0) -> None:
        """SIGKILL every process of the node, a fork bomb's included, and wait until its group is
        empty: v2's ``cgroup.kill`` where the kernel has it, else the group frozen (no process
        runs, so none forks), every process killed, the group thawed (the killed ones then die),
        again while any is left (one that was still running when the freeze gave up).
        Without a freezer: killed until none is left (bounded by the node's pids limit)."""
        path = self.freezer_dir(node)
        if path is None or not os.path.isdir(path) or not self.pids(node):
            return
        deadline = time.monotonic() + timeout_s
        if self.version == 2 and os.path.exists(os.path.join(path, "cgroup.kill")):
            _write(os.path.join(path, "cgroup.kill"), "1")
            _wait_empty(lambda: self.pids(node), deadline)
            return
        state, frozen, thawed = ("freezer.state", "FROZEN", "THAWED") if self.version == 1 else \
            ("cgroup.freeze", "1", "0")
        while self.pids(node) and time.monotonic() < deadline:
            _write(os.path.join(path, state), frozen)
            try:
                while not _is_frozen(path, self.version) and time.monotonic() < deadline:
                    time.sleep(0.005)
                _kill_all(self.pids(node))
            finally:
                _write(os.path.join(path, state), thawed)
            _wait_empty(lambda: self.pids(node), min(deadline, time.monotonic() + 1.0))

    def remove_all(self) -> None:
        for node in self.nodes():
            self.remove(node)
        for base in self.bases():
            if os.path.isdir(base):
                try:
                    os.rmdir(base)
                except OSError:
                    pass
        if self.version == 2:
            restore_v2_controllers(self.root)
        self._v2_ready = False


def _wait_empty(pids: Callable[[], Any], deadline: float) -> None:
    """Until ``pids()`` is empty (killed processes take a moment to go), or ``deadline``."""
    while pids() and time.monotonic() < deadline:
        time.sleep(0.01)


def _kill_all(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_frozen(path: str, version: Optional[int]) -> bool:
    """Whether every process of the group at ``path`` is frozen."""
    try:
        if version == 1:
            with open(os.path.join(path, "freezer.state")) as f:
                return f.read().strip() == "FROZEN"
        with open(os.path.join(path, "cgroup.events")) as f:
            return "frozen 1" in f.read()
    except OSError:
        return True  # gone: nothing left to freeze


def v1_hierarchies(root: str) -> list[str]:
    """The v1 hierarchies a node joins: cpu and memory; cpuacct where it is mounted apart from
    cpu (its ``cpuacct.usage`` is the node's CPU time); pids and freezer where they are mounted
    (the node's process limit, and its removal by freezing)."""
    found = list(V1_CONTROLLERS)
    cpu, acct = os.path.join(root, "cpu"), os.path.join(root, "cpuacct")
    if os.path.isdir(acct) and os.path.realpath(acct) != os.path.realpath(cpu):
        found.append("cpuacct")
    found += [c for c in V1_OPTIONAL if os.path.isdir(os.path.join(root, c))]
    return found


def process_groups(pid: int, root: str = "/sys/fs/cgroup") -> tuple[Optional[int], list[str]]:
    """The cgroup version and the directories holding a process's CPU and memory counters, from
    ``/proc/<pid>/cgroup`` (a container's groups, whatever made them: Docker's cgroupfs or
    systemd driver); (None, []) when the process is gone."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return groups_of(f.read(), root)
    except OSError:
        return None, []


def groups_of(proc_cgroup: str, root: str = "/sys/fs/cgroup") -> tuple[Optional[int], list[str]]:
    """``process_groups`` from the text of a ``/proc/<pid>/cgroup``."""
    paths: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    if "cpuacct" in paths or "memory" in paths:
        dirs = []
        for controller in ("cpuacct", "memory"):
            if controller in paths:
                mounts = [os.path.join(root, controller)] + [os.path.join(root, name) for name in _v1_mounts(root)
                                                             if controller in name.split(",")]
                dirs += [os.path.join(m, paths[controller].lstrip("/")) for m in mounts if os.path.isdir(m)][:1]
        return 1, dirs
    if "" in paths:
        return 2, [os.path.join(root, paths[""].lstrip("/"))]
    return None, []


def _v1_mounts(root: str) -> list[str]:
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


class CounterReader:
    """A cgroup's CPU seconds and memory bytes: v1 ``cpuacct.usage`` (ns) and
    ``memory.usage_in_bytes``, v2 ``cpu.stat`` (``usage_usec``) and ``memory.current``. The files
    stay open and are read with ``pread``; a counter the group does not offer reads as None."""

    def __init__(self, version: Optional[int], dirs: list[str]) -> None:
        self.version = version
        v1 = version == 1
        cpu_file, mem_file = ("cpuacct.usage", "memory.usage_in_bytes") if v1 else ("cpu.stat", "memory.current")
        self._cpu_fd = self._open(dirs, cpu_file)
        self._mem_fd = self._open(dirs, mem_file)

    @staticmethod
    def _open(dirs: list[str], name: str) -> int:
        for d in dirs:
            try:
                return os.open(os.path.join(d, name), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
        return -1

    def close(self) -> None:
        for fd in (self._cpu_fd, self._mem_fd):
            if fd >= 0:
                os.close(fd)
        self._cpu_fd = self._mem_fd = -1

    def cpu_ns(self) -> Optional[int]:
        """CPU time used by the group since it was made, in nanoseconds."""
        if self._cpu_fd < 0:
            return None
        try:
            data = os.pread(self._cpu_fd, 4096, 0)
        except OSError:
            return None
        if self.version == 1:
            return int(data)
        start = data.find(b"usage_usec ")
        if start < 0:
            return None
        end = data.find(b"\n", start)
        return int(data[start + 11:end if end >= 0 else None]) * 1000

    def mem_bytes(self) -> Optional[int]:
        if self._mem_fd < 0:
            return None
        try:
            return int(os.pread(self._mem_fd, 64, 0))
        except (OSError, ValueError):
            return None


V2_CONTROLLERS = ("cpu", "memory", "pids")
GROUP_PREFIX = "edgetb-"


def enable_v2_controllers(root: str) -> list[str]:
    """Delegate cpu, memory and (where the kernel has it) pids to the root's children,
    remembering (host-wide, per hierarchy) which ones this host did not delegate before, for
    ``restore_v2_controllers``. Returns the controllers the testbed's group passes on."""
    control = os.path.join(root, "cgroup.subtree_control")
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            available = set(f.read().split())
    except OSError:
        available = set(V2_CONTROLLERS)
    wanted = [c for c in V2_CONTROLLERS if c in available or c != "pids"]
    with host_record("cgroup2") as host:
        record = host.read({})
        with open(control) as f:
            enabled = set(f.read().split())
        added = [c for c in wanted if c not in enabled]
        if added:
            record[root] = sorted(set(record.get(root, [])) | set(added))
            host.write(record)
            _write(control, " ".join(f"+{c}" for c in added))
    return wanted


def restore_v2_controllers(root: str) -> None:
    """When no testbed's group is left under ``root``, take back the controllers that
    ``enable_v2_controllers`` delegated (one another user started using in the meantime stays)."""
    control = os.path.join(root, "cgroup.subtree_control")
    with host_record("cgroup2") as host:
        record = host.read({})
        added = record.get(root)
        if not added or any(e.startswith(GROUP_PREFIX) and os.path.isdir(os.path.join(root, e))
                            for e in os.listdir(root)):
            return
        for controller in added:
            try:
                with open(control, "w") as f:
                    f.write(f"-{controller}")
            except OSError:
                pass  # busy: a group of someone else's now uses it
        del record[root]
        host.write(record)


def self_join_target(procs_file: str) -> tuple[str, bool]:
    """Where a process with one thread moves itself into the group of ``procs_file``: on cgroup
    v1 the group's ``tasks`` file, written "0" (the caller's own thread: the kernel then skips its
    global threadgroup lock, whose taking after a pause waits for an RCU grace period, 4-6 ms
    here, one process after another), else ``cgroup.procs`` with the pid. (path, write "0")"""
    tasks = os.path.join(os.path.dirname(procs_file), "tasks")
    return (tasks, True) if os.path.exists(tasks) else (procs_file, False)


def join_fds(procs_files: list[str]) -> list[tuple[int, bool]]:
    """Open a node's groups' files before a fork, for ``join_in_child`` (descriptor, write "0")."""
    return [(os.open(path, os.O_WRONLY | os.O_CLOEXEC), zero) for path, zero in map(self_join_target, procs_files)]


def join_in_child(fds: list[tuple[int, bool]], close: bool = False) -> None:
    """Move the calling (just forked, one thread) process into the groups; raw syscalls only."""
    pid = str(os.getpid()).encode()
    try:
        for fd, zero in fds:
            os.write(fd, b"0" if zero else pid)
    finally:
        if close:
            for fd, _ in fds:
                os.close(fd)

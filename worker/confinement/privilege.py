"""Node processes with least privilege.

Every process started in a node runs as that node's own unprivileged uid and
gid (``uid_base(testbed) + node index``, no passwd entry, no supplementary
groups), with no capabilities (effective, permitted, inheritable, ambient and
bounding sets all empty), with ``no_new_privs``, in its own mount namespace
with its own ``/proc`` (``hidepid=invisible``: it sees only its own uid's
processes, never the agent's or the controller's environment), where it sees:

* the files a node needs, read-only: Python, the code root's ``dml_app/``, the
  experiment directory (its shards);
* its own directory ``<workdir>/dml_file/node/<name>/`` read-write (owned by
  its uid, mode 0700);
* nothing of the worker's state (``/var/lib/edgetb``: tokens, logs, state), of
  the rest of ``dml_file/`` (hosts.json, confs, results, other nodes);
* a private ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/dev/mqueue`` and ``/run/lock`` (no
  world-writable place shared with the host or other nodes; what is written there counts
  against the node's memory limit), and IPC of its own.

It runs with the node's rlimits and under its seccomp filter (``worker.confinement.confine``).

Directories that others cannot traverse (``/root`` of a venv built from a
Python under it, pytest's ``/tmp/pytest-of-root``) are covered in the node's
view by an empty read-only tmpfs holding only what the node needs, so nodes
work from any checkout without loosening the host's permissions.

A node never outlives the process that started it: node processes are forked
by one long-lived thread, because ``PR_SET_PDEATHSIG`` (set after the uid
change, which clears it) fires when the forking *thread* ends; so the kernel
kills the node when that process dies, ``kill -9`` included. (A node's own
children are not covered; they stay in its network namespace and cgroup, which
reset empties.)

Who a node is (its uid, its directory) is ``worker.confinement.uids``; what it sees of the file system
is ``worker.confinement.fsview``; this module starts processes as the node.

Everything happens in the forked child before ``exec``, by system calls:
cgroups, network namespace, mount namespace and view, ``/proc``, rlimits, bounding set,
groups, gid, uid, inheritable and ambient sets, ``no_new_privs``, death signal, seccomp.
"""
from __future__ import annotations

import ctypes
import errno
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from worker.api.errors import ConfigError, NodeRuntimeError, NotFound
from worker.confinement import cgroups, confine
from worker.confinement.fsview import (MS_NODEV, MS_NOEXEC, MS_NOSUID, Op, View, apply_view, check_readable, mount,
                                       oserror, plan_view, under)
from worker.confinement.uids import Identity
from worker.kernel import nsfs

PR_SET_PDEATHSIG = 1

_libc = nsfs.libc


# launching ----------------------------------------------------------------------------------------
PR_SET_KEEPCAPS = 8
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
PR_CAP_AMBIENT_CLEAR_ALL = 4
CAP_NET_RAW = 13
CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except OSError:
        return 63


def per_mount_proc() -> bool:
    """Whether each /proc mount has its own options (Linux 5.8): only then may a node's /proc be
    mounted ``hidepid=invisible`` without changing the host's /proc."""
    try:
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (5, 8)


def _drop_privileges(ident: Identity, last_cap: int) -> None:
    """In the child: become ``ident`` with no capability left and none to gain."""
    for cap in range(last_cap + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            raise oserror("drop from the bounding set capability", str(cap))
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before 4.3: none to clear
    os.setgroups([])
    os.setresgid(ident.gid, ident.gid, ident.gid)
    os.setresuid(ident.uid, ident.uid, ident.uid)  # clears effective, permitted and ambient
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:  # and inheritable
        raise oserror("clear the capabilities of uid", str(ident.uid))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise oserror("set no_new_privs for uid", str(ident.uid))


class _Spawner:
    """One long-lived thread that forks every node process, so that the death signal the
    children ask for fires only when this process dies (not when a worker thread ends)."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[tuple[Callable[[], Any], Future]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], Any]) -> Any:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="edgetb-spawner", daemon=True)
                self._thread.start()
        if threading.current_thread() is self._thread:
            return fn()
        done: Future = Future()
        self._jobs.put((fn, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # handed to the caller
                done.set_exception(e)


_spawner: Optional[_Spawner] = _Spawner()  # None in a forked child until it needs one


def _the_spawner() -> _Spawner:
    global _spawner
    if _spawner is None:
        _spawner = _Spawner()
    return _spawner


def _forget_spawner() -> None:
    """In a forked child (nothing but an assignment: it may be about to exec): the parent's
    spawner thread is not there, and its queue may hold that thread as its waiter, so a job put
    there would wake no one; the child makes a spawner of its own when it needs one."""
    global _spawner
    _spawner = None


os.register_at_fork(after_in_child=_forget_spawner)


@dataclass(frozen=True)
class Confinement:
    """What confines every node on this host, found once: the highest capability to drop, whether
    a node gets a ``/proc`` of its own (``hidepid``), and the seccomp filter."""

    last_cap: int
    hide_pids: bool
    seccomp: confine.Filter

    @classmethod
    def here(cls) -> "Confinement":
        """This host's (a ``CapabilityError`` on a machine whose filter is not known)."""
        return cls(_last_cap(), per_mount_proc(), confine.node_filter())


def become_node(ident: Identity, ops: Sequence[Op], rlimits: confine.Rlimits, confinement: Confinement,
                starter: int, cgroup_fds: Sequence[tuple[int, bool]] = (), netns_fd: Optional[int] = None,
                keep_fds: Optional[Sequence[int]] = None) -> None:
    """In a just-forked child, system calls only: become the node. Joins its cgroups
    (``cgroup_fds``, from ``cgroups.join_fds``) and network namespace (``netns_fd``), enters mount
    and IPC namespaces of its own with the mounts of ``ops`` and a ``/proc`` of its own, closes
    every descriptor above 2 but ``keep_fds`` (when given: a child that will not ``exec``), sets
    ``rlimits``, becomes ``ident`` without capabilities and with ``no_new_privs``, dies with its
    parent (and leaves, exit 125, when ``starter``, its parent, is already gone), enters ``/``
    and installs the seccomp filter, last. An error is an ``OSError`` naming what failed."""
    cgroups.join_in_child(list(cgroup_fds))
    if netns_fd is not None:
        nsfs.setns_fd(netns_fd)
    apply_view(list(ops))
    if confinement.hide_pids:
        mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible")
    if keep_fds is not None:  # nothing of the parent's (what the view's set-up held open) stays open
        low = 3
        for fd in sorted(set(keep_fds)):
            if fd >= low:
                os.closerange(low, fd)
                low = fd + 1
        os.closerange(low, 1 << 16)
    confine.set_rlimits(rlimits)
    _drop_privileges(ident, confinement.last_cap)
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:  # after the uid change
        raise oserror("set the parent-death signal of uid", str(ident.uid))
    if os.getppid() != starter:  # the starter died before the line above
        os._exit(125)
    os.chdir("/")  # (a directory entered before the view would lead out of it)
    confinement.seccomp.install()  # last: after no_new_privs, and before the node runs anything


def become_tool_user(uid: int, gid: int, keep_caps: Sequence[int], starter: int) -> None:
    """In a just-forked child of ``spawn``, before ``exec``: become ``uid``/``gid`` holding only
    ``keep_caps`` (as ambient capabilities, so the program ``exec``'d has them without a file
    capability), with ``no_new_privs``, and die with this process. For a host tool that needs one
    capability (tcpdump: ``CAP_NET_RAW``) and would otherwise drop root itself, which clears the
    parent-death signal. System calls only; an error is an ``OSError``."""
    for cap in range(_last_cap() + 1):
        if cap not in keep_caps and _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 \
                and ctypes.get_errno() != errno.EINVAL:
            raise oserror("drop from the bounding set capability", str(cap))
    _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    if _libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise oserror("keep capabilities across the uid change to", str(uid))
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # keeps the permitted set (KEEPCAPS), clears the effective one
    mask = sum(1 << cap for cap in keep_caps)
    header, data = _CapHeader(CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = mask & 0xFFFFFFFF
    data[1].effective = data[1].permitted = data[1].inheritable = mask >> 32
    if _libc.capset(ctypes.byref(header), data) != 0:
        raise oserror("set the capabilities of uid", str(uid))
    for cap in keep_caps:
        if _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) != 0:
            raise oserror("raise the ambient capability", str(cap))
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise oserror("set no_new_privs for uid", str(uid))
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:  # after the uid change
        raise oserror("set the parent-death signal of uid", str(uid))
    if os.getppid() != starter:
        os._exit(125)


def die_with_parent() -> None:
    """In a just-forked child: be killed when the thread that forked it ends (see ``spawn``)."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def spawn(start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
    """Run ``start`` (a ``Popen``) on the one long-lived thread that forks every node process,
    so a child's death signal fires only when this process dies."""
    return _the_spawner().run(start)


@dataclass
class Launch:
    """How to start one process in a node (see ``launch``)."""

    argv: Sequence[str]
    ident: Identity
    view: View
    netns_path: Optional[str] = None
    cgroup_procs: Sequence[str] = ()
    popen: dict[str, Any] = field(default_factory=dict)
    rlimits: confine.Rlimits = field(default_factory=confine.node_rlimits)


def launch(spec: Launch) -> subprocess.Popen:
    """Start ``spec.argv`` in the node (no shell): in its cgroups and network namespace, in a
    mount namespace of its own with ``spec.view``, as its uid without capabilities, with its
    rlimits and seccomp filter (``become_node``). Errors name what failed."""
    if not spec.argv or not all(isinstance(a, str) for a in spec.argv):
        raise ConfigError("a command must be a non-empty list of strings")
    check_readable(spec.view, spec.ident)
    ops = plan_view(spec.view)
    ident, rlimits = spec.ident, list(spec.rlimits)
    confinement = Confinement.here()  # (a CapabilityError on a machine it does not know)
    starter = os.getpid()

    fds: list[int] = []
    try:
        ns_fd = os.open(spec.netns_path, os.O_RDONLY | os.O_CLOEXEC) if spec.netns_path else None
        if ns_fd is not None:
            fds.append(ns_fd)
        cg_fds = cgroups.join_fds(list(spec.cgroup_procs))
        fds += [fd for fd, _ in cg_fds]

        def enter() -> None:  # in the child, between fork and exec: system calls only
            try:
                become_node(ident, ops, rlimits, confinement, starter, cg_fds, ns_fd)
            except OSError as e:
                os.write(2, f"edgetb: cannot start a node process: {e}\n".encode())
                raise

        env = dict(spec.popen.pop("env", None) or {})
        if spec.view.home:
            env.setdefault("HOME", spec.view.home)
        spec.popen.pop("cwd", None)  # "/": a directory entered before the view would lead out of it

        def start() -> subprocess.Popen:
            return subprocess.Popen(list(spec.argv), preexec_fn=enter, env=env, cwd="/", **spec.popen)

        try:
            return _the_spawner().run(start)
        except subprocess.SubprocessError:
            raise NodeRuntimeError(f"could not set up a node process for {spec.argv[0]!r} "
                                   "(namespaces, mounts, cgroups or privileges; its log says which)") from None
        except FileNotFoundError:
            raise NotFound(f"command not found: {spec.argv[0]!r}") from None
        except PermissionError:
            raise ConfigError(f"node processes run as uid {ident.uid}, which may not run {spec.argv[0]!r} "
                              "(or a directory on its way is closed to others)") from None
        except BlockingIOError:  # EAGAIN from exec: RLIMIT_NPROC
            nproc = next((soft for which, soft, _ in rlimits if which == resource.RLIMIT_NPROC), None)
            raise NodeRuntimeError(f"the node's processes (uid {ident.uid}) are at their limit of {nproc} "
                                   f"processes and threads; {spec.argv[0]!r} was not started") from None
    finally:
        for fd in fds:
            os.close(fd)


def python_dirs() -> list[str]:
    """The directories a node's Python needs: this interpreter's prefixes (a venv and its base)."""
    dirs = []
    for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))):
        real = os.path.realpath(p)
        if not any(under(real, d) for d in dirs):
            dirs = [d for d in dirs if not under(d, real)] + [real]
    return dirs
